"""What every ``fedbroker`` command group shares: the console, the common options, errors, JSON output,
the SDK client and UTC instants as text.

The width of everything printed is :func:`console_width` (``COLUMNS``, else the terminal's, else
:data:`PIPED_WIDTH`), read at call time: :func:`current_console` returns the app's console at that width.
Table cells that may be long (names, reasons) are :func:`cell`: one line, ellipsised at the column's width, so
a row stays one line at any width. Tests may replace :data:`console`
(``monkeypatch.setattr(broker.cli.console, "console", ...)``): a replaced console keeps its own width.
:func:`direct_store` is the job store of the settings file, for the commands that talk to it directly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.text import Text

from broker.utc import iso_z

__all__ = ["console", "stderr", "current_console", "console_width", "cell", "PIPED_WIDTH", "fail", "echo_json", "show", "client", "call", "utc_text", "direct_store", "UrlOpt", "TokenOpt", "JsonOpt"]

#: the width of output that goes to no terminal (a pipe, a file) when ``COLUMNS`` does not say: wide tables
#: stay whole lines for grep instead of wrapping at Rich's default 80
PIPED_WIDTH = 200
#: ``COLUMNS`` below this is ignored (a typo such as ``COLUMNS=8`` would fold every table into a column of letters)
MIN_WIDTH = 40


def console_width(stream=None) -> int:
    """The width, in columns, the CLI prints at: ``$COLUMNS`` when it is a whole number >= :data:`MIN_WIDTH`,
    else the terminal's width when ``stream`` (default ``sys.stdout``) is a terminal, else :data:`PIPED_WIDTH`.
    Read at every call, so ``COLUMNS=80 fedbroker list`` (and a CliRunner's ``env``) take effect."""
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) >= MIN_WIDTH:
        return int(cols)
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        tty = False
    return max(shutil.get_terminal_size((PIPED_WIDTH, 24)).columns, MIN_WIDTH) if tty else PIPED_WIDTH


class _AppConsole(Console):
    """A console whose width is :func:`console_width` of its stream at each print (not fixed at import)."""

    @property
    def size(self) -> ConsoleDimensions:
        return ConsoleDimensions(console_width(self.file), Console.size.fget(self).height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


#: the app's console (stdout)
console: Console = _AppConsole()
#: error and progress lines go to stderr
stderr: Console = _AppConsole(stderr=True, highlight=False)

UrlOpt = typer.Option(None, "--url", envvar="FEDBROKER_API_URL", help="Broker API URL (default: settings' api_url).")
TokenOpt = typer.Option(None, "--token", envvar="FEDBROKER_TOKEN", help="API token.", show_default=False)
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")


def current_console() -> Console:
    """The app's console as it is now (tests replace :data:`console`)."""
    return console


def cell(text: str | None, empty: str = "-") -> Text:
    """A table cell of plain text (never read as markup) kept to one line: cut with ``…`` at its column's width
    when the table is wider than the console (:func:`console_width`). ``None`` or ``""`` shows ``empty``."""
    return Text(text or empty, no_wrap=True, overflow="ellipsis")


def fail(msg: str, code: int = 1) -> None:
    """Print ``error: msg`` on stderr and exit with ``code`` (1: the broker refused or failed; 2: bad usage)."""
    stderr.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(code)


def echo_json(obj: Any) -> None:
    """Print ``obj`` (pydantic models, datetimes, ...) as indented JSON."""
    from pydantic_core import to_jsonable_python

    typer.echo(json.dumps(to_jsonable_python(obj), indent=2))


def show(obj: Any, as_json: bool, human) -> None:
    """Print ``obj`` as JSON (``--json``) or with ``human(obj)``."""
    if as_json:
        echo_json(obj)
    else:
        human(obj)


def client(url: str | None, token: str | None):
    """A :class:`broker.client.Client` for ``--url``/``--token`` (settings and environment as fallbacks);
    exits 2 naming the option when they are missing or malformed."""
    from broker.client import Client
    from broker.service.settings import SettingsError

    try:
        return Client(url=url, token=token, retries=3)
    except (SettingsError, ValueError) as e:
        fail(str(e).replace("url=", "--url=").replace("token:", "--token (or FEDBROKER_TOKEN):"), 2)


def call(c, fn, *args, **kwargs):
    """Run one SDK call; exit 1 with the broker's message on an API error or an unreachable broker, exit 2
    with the field and value when an id is not of the server's format (:class:`broker.client.InvalidId`, no
    request sent); :class:`broker.client.WaitTimeout` is re-raised for the caller."""
    from broker.client import BrokerError, BrokerUnavailable, InvalidId, WaitTimeout

    try:
        return fn(*args, **kwargs)
    except WaitTimeout:
        raise
    except InvalidId as e:
        fail(str(e), 2)
    except BrokerUnavailable as e:
        if e.status is None:
            fail(f"{e}; is `fedbroker serve` running there?")  # the SDK's message names the URL and the cause
        fail(str(e))
    except BrokerError as e:
        fail(str(e))


def utc_text(v: datetime | None) -> str:
    """``2026-12-01T16:22:20Z`` (UTC, whole seconds), or ``-`` for None."""
    return iso_z(v.astimezone(timezone.utc)) if v else "-"  # naive: local time, as datetime.astimezone reads it


@contextmanager
def direct_store(config: Path | None):
    """``(settings, store)`` of the settings file ``config`` (default ``$FEDBROKER_CONFIG``), the store
    migrated, for the commands that talk to the job store directly (token bootstrap, node tokens). Exits 2
    for a bad settings file, 1 when the store cannot be used (the message masks the database password);
    the body's own ``typer.Exit`` passes through. The store's connections are closed afterwards."""
    from broker.service.redact import mask_text, mask_url, settings_secrets
    from broker.service.settings import SettingsError, load_settings
    from broker.service.store.core import JobStore

    try:
        settings = load_settings(config)
    except SettingsError as e:
        fail(str(e), 2)
    store = JobStore.from_settings(settings)
    if store.created_file:
        typer.echo(f"note: no job store at {mask_url(settings.effective_database_url)} yet; created a new, empty one "
                   "(if you meant an existing one: check FEDBROKER_CONFIG and the directory you run in)", err=True)
    try:
        store.migrate()
        yield settings, store
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:  # database unreachable, permissions ...
        fail(mask_text(f"cannot use the job store at {mask_url(settings.effective_database_url)}: "
                        f"{type(e).__name__}: {e}", settings_secrets(settings)))
    finally:
        store.engine.dispose()
