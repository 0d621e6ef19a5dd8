"""``fedbroker cloud``: point the broker at Terraform's outputs, and see or sweep its cloud instances.

Commands::

    fedbroker cloud settings-from-terraform --provider aws|gcp OUTPUTS.json [OUTPUTS2.json ...]
        the broker settings section (YAML) for the ``terraform output -json`` of terraform/aws (one file per
        region's module) or terraform/gcp; paste it into the file named by ``FEDBROKER_CONFIG``
    fedbroker cloud instances [--all] [--json] [--config FILE]
        the broker's cloud instance records (intent rows included), newest first, from its database
    fedbroker cloud sweep [--dry-run] [--config FILE]
        terminate now every instance tagged with this broker's id whose attempt is not live (the
        reconciler does this every ``cloud.sweep_interval_s``); ``--dry-run`` lists them and terminates nothing

``instances`` and ``sweep`` read the broker's settings (``--config`` or ``$FEDBROKER_CONFIG``) and talk to
its database (and, for ``sweep``, the providers) directly: they are operator commands, not API calls.
Bad input exits 2 with a message naming the file and the output or key.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from broker.cli.console import JsonOpt, current_console, echo_json, fail, utc_text


__all__ = ["register", "cloud_app", "settings_from_terraform", "find_orphans", "NO_TABLES"]

cloud_app = typer.Typer(no_args_is_help=True, help="Cloud instances: settings from Terraform outputs, the "
                                                    "instance records, the orphan sweep.")

def _outputs(path: Path) -> dict:
    """``{name: value}`` of one ``terraform output -json`` file; ValueError naming the file."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e}); write it with `terraform output -json > {path.name}`") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected the object `terraform output -json` prints, got {type(raw).__name__}")
    out = {}
    for k, v in raw.items():
        if not isinstance(v, dict) or "value" not in v:
            raise ValueError(f"{path}: output {k!r} has no 'value' (is this `terraform output -json`?)")
        out[k] = v["value"]
    return out


def settings_from_terraform(provider: str, files: list[Path]) -> dict:
    """The settings mapping (``{"cloud_providers": [...], provider: {...}}``) for Terraform output files.

    AWS: one file per region (each ``terraform/aws`` apply is one region; its ``region`` output keys it).
    GCP: exactly one file. The provider's own function (its ``terraform`` line in :mod:`providers.registry`)
    reads the outputs; the result is checked against its section of :class:`broker.service.settings.BrokerSettings`.
    Raises ``ValueError`` naming the file and the missing or bad output."""
    from typing import get_args

    from broker.service.settings import BrokerSettings
    from providers.registry import PROVIDERS

    if provider not in PROVIDERS:
        raise ValueError(f"provider={provider!r}: must be {' or '.join(PROVIDERS)}")
    e = PROVIDERS[provider]
    section = e.load("terraform")([(f, _outputs(f)) for f in files])
    model = next(a for a in get_args(BrokerSettings.model_fields[e.settings_section].annotation) if a is not type(None))
    model.model_validate(section)
    return {"cloud_providers": [provider], e.settings_section: section}


@cloud_app.command("settings-from-terraform")
def settings_cmd(provider: str = typer.Option(..., "--provider", help="aws or gcp"),
                 files: list[Path] = typer.Argument(..., help="`terraform output -json` file(s): one per AWS region, "
                                                             "one for GCP.")) -> None:
    """Print the broker settings (YAML) that point it at the infrastructure Terraform made."""
    from pydantic import ValidationError

    from broker.service.settings import validation_message

    try:
        data = settings_from_terraform(provider, files)
    except ValidationError as e:
        fail(validation_message(e, prefix=f"{provider} settings from {', '.join(map(str, files))}:"), code=2)
    except ValueError as e:
        fail(str(e), code=2)
    typer.echo(f"# fedbroker settings for {provider}, from {', '.join(str(f) for f in files)}\n"
               "# (merge into the file FEDBROKER_CONFIG names; add checkpoint_uri for checkpoints that survive"
               " instances)")
    typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


def _settings(config: Optional[Path]):
    from broker.service.settings import SettingsError, load_settings

    try:
        return load_settings(config)
    except SettingsError as e:
        fail(str(e), code=2)


ConfigOpt = typer.Option(None, "--config", help="Settings YAML (default: $FEDBROKER_CONFIG).")

NO_TABLES = ("the broker's database has no tables yet: start the broker once (fedbroker serve ...) "
             "or check database_url")


@contextmanager
def _database(st):
    """Exit 2 with :data:`NO_TABLES` when the broker's database has no tables (a fresh state dir, the broker
    never started, or ``database_url``/``database_schema`` pointing elsewhere); other database errors exit 1
    naming the database."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    try:
        yield
    except (OperationalError, ProgrammingError) as e:
        why = str(getattr(e, "orig", None) or e)
        if "no such table" in why or ("relation" in why and "does not exist" in why) or "UndefinedTable" in why:
            fail(NO_TABLES, code=2)
        from broker.service.redact import mask_url

        fail(f"cannot query the broker's database ({mask_url(st.effective_database_url)}): {why.strip()}")


def _attempt_key(inst) -> tuple[str, int] | None:
    """``(job, attempt)`` from an instance's tags; ``None`` when the attempt tag is not an integer (such an
    instance belongs to no live attempt)."""
    raw = str(inst.tags.get("fedbroker-attempt", ""))
    if not re.fullmatch(r"[0-9]+", raw):
        return None
    return inst.tags.get("fedbroker-job", ""), int(raw)


def find_orphans(cb) -> tuple[list, list[str]]:
    """Instances tagged with this broker's id whose ``(job, attempt)`` is not live, without terminating
    them (what :meth:`broker.service.cloud.CloudBroker.sweep` would terminate), and one message per provider whose
    listing failed. ``cb``: a :class:`broker.service.cloud.CloudBroker`."""
    from providers.base import ProviderError

    with cb.store.session() as s:  # read before listing, as the sweep does
        live = cb.live_attempts(s)
    orphans, errors = [], []
    for name, compute in cb.computes.items():
        lister = getattr(compute, "list_managed", None)
        if not callable(lister):
            continue
        try:
            managed = lister(cb.settings.cloud.broker_id)
        except ProviderError as e:
            errors.append(f"{name}: cannot list instances ({e})")
            continue
        orphans.extend(i for i in managed if _attempt_key(i) not in live)
    return orphans, errors


@cloud_app.command("instances")
def instances_cmd(show_all: bool = typer.Option(False, "--all", help="Include terminated and failed records."),
                  limit: int = typer.Option(100, "--limit", min=1, max=10000), config: Optional[Path] = ConfigOpt,
                  as_json: bool = JsonOpt) -> None:
    """The broker's cloud instance records, newest first (intent rows and failed options included)."""
    from broker.service.store import cloud as instances
    from broker.service.store.core import JobStore

    st = _settings(config)
    store = JobStore.from_settings(st)
    with _database(st), store.session() as s:
        rows = instances.instance_rows(s, limit, live_only=not show_all)
    if as_json:
        echo_json(rows)
        return
    tab = Table(title=f"{len(rows)} cloud instance record(s)")
    for col in ("job", "att", "rank", "option", "state", "instance", "address", "updated", "last report", "error"):
        tab.add_column(col)
    for r in rows:
        tab.add_row(r["job_id"], str(r["attempt"]), str(r["rank"]), escape(r["offer_id"]), r["state"],
                    r["instance_id"] or "-", r["private_ip"] or "-", utc_text(r["updated_at"]), r["last_event"] or "-",
                    escape((r["error"] or "")[:80]))
    current_console().print(tab)


@cloud_app.command("sweep")
def sweep_cmd(config: Optional[Path] = ConfigOpt,
              dry_run: bool = typer.Option(False, "--dry-run", help="List the orphans; terminate nothing.")) -> None:
    """Terminate now every instance tagged with this broker's id whose attempt is not live."""
    from broker.service.cloud import CloudBroker
    from broker.service.store.core import JobStore

    st = _settings(config)
    if not st.cloud_providers:
        fail("no cloud provider is configured (cloud_providers is empty)", code=2)
    cb = CloudBroker(JobStore.from_settings(st), st)
    if dry_run:
        with _database(st):
            orphans, errors = find_orphans(cb)
        for inst in orphans:
            typer.echo(f"orphan {inst.provider}/{inst.instance_id} in {inst.zone} ({inst.state}; job "
                       f"{inst.tags.get('fedbroker-job', '-')} attempt {inst.tags.get('fedbroker-attempt', '-')})")
        typer.echo(f"{len(orphans)} orphan instance(s) of broker {st.cloud.broker_id!r} "
                   f"(dry run: none terminated)")
        for msg in errors:
            typer.echo(msg, err=True)
        if errors:
            raise typer.Exit(1)
        return
    import logging

    logging.getLogger("fedbroker.cloud").setLevel(logging.ERROR)  # each orphan is printed below, once
    with _database(st):
        gone = cb.sweep()
    for inst in gone:
        typer.echo(f"terminated {inst.provider}/{inst.instance_id} in {inst.zone} (job "
                   f"{inst.tags.get('fedbroker-job', '-')} attempt {inst.tags.get('fedbroker-attempt', '-')})")
    typer.echo(f"{len(gone)} orphan instance(s) terminated")


def register(app: typer.Typer) -> None:
    """Add ``fedbroker cloud`` to the main CLI."""
    app.add_typer(cloud_app, name="cloud")
