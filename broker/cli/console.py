"""What every ``fedbroker`` command group shares: the console, the common options, errors, JSON output,
the SDK client and UTC instants as text.

Tests widen :data:`console` (``monkeypatch.setattr(broker.cli.console, "console", ...)``); commands read it at
call time through :func:`current_console`.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["console", "stderr", "current_console", "fail", "echo_json", "show", "client", "call", "utc_text", "UrlOpt", "TokenOpt", "JsonOpt"]

#: the app's console; piped output keeps wide tables readable instead of wrapping them at 80 columns
console = Console(width=None if sys.stdout.isatty() else 200)
#: error and progress lines go to stderr
stderr = Console(stderr=True, width=200, highlight=False)

UrlOpt = typer.Option(None, "--url", envvar="FEDBROKER_API_URL", help="Broker API URL (default: settings' api_url).")
TokenOpt = typer.Option(None, "--token", envvar="FEDBROKER_TOKEN", help="API token.", show_default=False)
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")


def current_console() -> Console:
    """The app's console as it is now (tests replace :data:`console`)."""
    return console


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
    return v.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z") if v else "-"
