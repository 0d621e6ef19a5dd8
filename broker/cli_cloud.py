"""``fedbroker cloud``: point the broker at Terraform's outputs, and see or sweep its cloud instances.

Commands::

    fedbroker cloud settings-from-terraform --provider aws|gcp OUTPUTS.json [OUTPUTS2.json ...]
        the broker settings section (YAML) for the ``terraform output -json`` of terraform/aws (one file per
        region's module) or terraform/gcp; paste it into the file named by ``FEDBROKER_CONFIG``
    fedbroker cloud instances [--all] [--json] [--config FILE]
        the broker's cloud instance records (intent rows included), newest first, from its database
    fedbroker cloud sweep [--config FILE]
        terminate now every instance tagged with this broker's id whose attempt is not live (the
        reconciler does this every ``cloud.sweep_interval_s``)

``instances`` and ``sweep`` read the broker's settings (``--config`` or ``$FEDBROKER_CONFIG``) and talk to
its database (and, for ``sweep``, the providers) directly: they are operator commands, not API calls.
Bad input exits 2 with a message naming the file and the output or key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from broker.cli_jobs import JsonOpt, _console, _echo_json, _fail, _t

__all__ = ["register", "cloud_app", "settings_from_terraform"]

cloud_app = typer.Typer(no_args_is_help=True, help="Cloud instances: settings from Terraform outputs, the "
                                                    "instance records, the orphan sweep.")

#: terraform output name -> settings key (terraform/aws/outputs.tf, per region)
AWS_OUTPUTS = {"ami_id": "ami_id", "subnet_ids_by_az": "subnet_ids_by_az", "subnet_ids_by_az_id": "subnet_ids_by_az_id",
               "security_group_id": "security_group_id",
               "placement_group_name": "placement_group_name", "instance_profile_name": "instance_profile_name",
               "launch_template_id": "launch_template_id"}
#: terraform output name -> settings key (terraform/gcp/outputs.tf)
GCP_OUTPUTS = {"project": "project", "region": "region", "network": "network", "subnetwork": "subnetwork",
               "service_account_email": "service_account_email", "gpu_image": "gpu_image",
               "instance_template": "instance_template"}


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
    GCP: exactly one file. The result is checked against :class:`broker.settings.BrokerSettings`.
    Raises ``ValueError`` naming the file and the missing or bad output."""
    from broker.settings import AwsSettings, GcpSettings

    if provider == "aws":
        regions: dict[str, dict] = {}
        for f in files:
            out = _outputs(f)
            region = out.get("region")
            if not isinstance(region, str) or not region:
                raise ValueError(f"{f}: output 'region' is missing (terraform/aws outputs it)")
            if region in regions:
                raise ValueError(f"{f}: region {region!r} is given twice")
            missing = [k for k in ("ami_id", "subnet_ids_by_az") if k not in out]
            if missing:
                raise ValueError(f"{f}: outputs {missing} are missing (terraform/aws outputs them)")
            regions[region] = {key: out[name] for name, key in AWS_OUTPUTS.items() if out.get(name) is not None}
        section = {"regions": regions}
        AwsSettings.model_validate(section)
    elif provider == "gcp":
        if len(files) != 1:
            raise ValueError(f"gcp: give exactly one outputs file, got {len(files)}")
        out = _outputs(files[0])
        missing = [k for k in ("project", "region") if k not in out]
        if missing:
            raise ValueError(f"{files[0]}: outputs {missing} are missing (terraform/gcp outputs them)")
        section = {key: out[name] for name, key in GCP_OUTPUTS.items() if out.get(name) is not None}
        GcpSettings.model_validate(section)
    else:
        raise ValueError(f"provider={provider!r}: must be aws or gcp")
    return {"cloud_providers": [provider], provider: section}


@cloud_app.command("settings-from-terraform")
def settings_cmd(provider: str = typer.Option(..., "--provider", help="aws or gcp"),
                 files: list[Path] = typer.Argument(..., help="`terraform output -json` file(s): one per AWS region, "
                                                             "one for GCP.")) -> None:
    """Print the broker settings (YAML) that point it at the infrastructure Terraform made."""
    from pydantic import ValidationError

    try:
        data = settings_from_terraform(provider, files)
    except ValidationError as e:
        err = e.errors()[0]
        _fail(f"{provider} settings from {', '.join(map(str, files))}: {'.'.join(map(str, err['loc']))}="
              f"{err.get('input')!r}: {err['msg']}", code=2)
    except ValueError as e:
        _fail(str(e), code=2)
    typer.echo(f"# fedbroker settings for {provider}, from {', '.join(str(f) for f in files)}\n"
               "# (merge into the file FEDBROKER_CONFIG names; add checkpoint_uri for checkpoints that survive"
               " instances)")
    typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


def _settings(config: Optional[Path]):
    from broker.settings import SettingsError, load_settings

    try:
        return load_settings(config)
    except SettingsError as e:
        _fail(str(e), code=2)


ConfigOpt = typer.Option(None, "--config", help="Settings YAML (default: $FEDBROKER_CONFIG).")


@cloud_app.command("instances")
def instances_cmd(show_all: bool = typer.Option(False, "--all", help="Include terminated and failed records."),
                  limit: int = typer.Option(100, "--limit", min=1, max=10000), config: Optional[Path] = ConfigOpt,
                  as_json: bool = JsonOpt) -> None:
    """The broker's cloud instance records, newest first (intent rows and failed options included)."""
    from sqlalchemy import select

    from broker.db import CloudInstance
    from broker.store import JobStore

    st = _settings(config)
    store = JobStore.from_settings(st)
    q = select(CloudInstance).order_by(CloudInstance.id.desc()).limit(limit)
    if not show_all:
        q = q.where(CloudInstance.state.in_(("intent", "running", "terminating")))
    with store.session() as s:
        rows = [{"job_id": r.job_id, "attempt": r.attempt, "rank": r.rank, "offer_id": r.offer_id, "state": r.state,
                 "instance_id": r.provider_instance_id, "private_ip": r.private_ip, "created_at": r.created_at,
                 "updated_at": r.updated_at, "last_event": r.last_event, "error": r.error}
                for r in s.execute(q).scalars()]
    if as_json:
        _echo_json(rows)
        return
    tab = Table(title=f"{len(rows)} cloud instance record(s)")
    for col in ("job", "att", "rank", "option", "state", "instance", "address", "updated", "last report", "error"):
        tab.add_column(col)
    for r in rows:
        tab.add_row(r["job_id"], str(r["attempt"]), str(r["rank"]), escape(r["offer_id"]), r["state"],
                    r["instance_id"] or "-", r["private_ip"] or "-", _t(r["updated_at"]), r["last_event"] or "-",
                    escape((r["error"] or "")[:80]))
    _console().print(tab)


@cloud_app.command("sweep")
def sweep_cmd(config: Optional[Path] = ConfigOpt) -> None:
    """Terminate now every instance tagged with this broker's id whose attempt is not live."""
    from broker.cloud import CloudBroker
    from broker.store import JobStore

    st = _settings(config)
    if not st.cloud_providers:
        _fail("no cloud provider is configured (cloud_providers is empty)", code=2)
    gone = CloudBroker(JobStore.from_settings(st), st).sweep()
    for inst in gone:
        typer.echo(f"terminated {inst.provider}/{inst.instance_id} (job {inst.tags.get('fedbroker-job')} "
                   f"attempt {inst.tags.get('fedbroker-attempt')})")
    typer.echo(f"{len(gone)} orphan instance(s) terminated")


def register(app: typer.Typer) -> None:
    """Add ``fedbroker cloud`` to the main CLI."""
    app.add_typer(cloud_app, name="cloud")
