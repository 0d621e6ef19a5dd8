"""``fedbroker schedule``: recurring runs, a job submitted at every fire of a cron expression (over the API).

Commands::

    fedbroker schedule create NAME JOB.yaml --cron "0 2 * * *" [--timezone Europe/London] [--json]
    fedbroker schedule list [--team T] [--json]
    fedbroker schedule pause SCHEDULE_ID [--json]
    fedbroker schedule resume SCHEDULE_ID [--json]
    fedbroker schedule delete SCHEDULE_ID

Options and exit status as the job commands' (:mod:`broker.cli.jobs`). ``schedule create`` checks the name,
``--cron``, ``--timezone`` and the job file (no absolute ``deadline``/``not_before``/``not_after``:
every run is relative to its fire instant, give ``slack_s``) before calling the broker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.console import JsonOpt, TokenOpt, UrlOpt, call, client, current_console, fail, show, utc_text
from broker.cli.jobs import JobFileError, load_job_file

__all__ = ["schedule_app", "register"]

schedule_app = typer.Typer(no_args_is_help=True,
                           help="Recurring runs: submit a job at every fire of a cron expression.")


def _print_schedule_line(x) -> None:
    current_console().print(escape(_schedule_line(x)), highlight=False)


def _print_schedules(scheds) -> None:
    tab = Table(title=f"{len(scheds)} schedule(s)")
    for col in ("id", "team", "name", "cron", "timezone", "state", "next run", "last run", "gpus"):
        tab.add_column(col, overflow="fold")
    for x in scheds:
        tab.add_row(x.id, x.team, escape(x.name), escape(x.cron), x.timezone, "active" if x.enabled else "paused",
                    utc_text(x.next_fire_at) if x.enabled else "-", utc_text(x.last_fire_at),
                    f"{x.spec.nodes}x{x.spec.gpus_per_node}")
    current_console().print(tab)
    for x in scheds:  # a fire the reconciler skipped (the team's queued-jobs quota or priority entitlement)
        if x.last_skip_reason:
            current_console().print(f"{x.id} {escape(x.name)}: {escape(x.last_skip_reason)}")


def _schedule_line(x) -> str:
    state = f"next run {utc_text(x.next_fire_at)}" if x.enabled else "paused"
    return f"{x.id} {x.name}: cron {x.cron!r} in {x.timezone}, {state}"


def _schedule_action(method: str, schedule_id: str, url, token, as_json: bool) -> None:
    """Call ``Client.<method>(schedule_id)`` and print the schedule (a line, or JSON)."""
    c = client(url, token)
    x = call(c, getattr(c, method), schedule_id)
    show(x, as_json, _print_schedule_line)


@schedule_app.command("create")
def schedule_create(name: str = typer.Argument(..., help="Unique within your team: letters, digits, '.', '_', '-'."),
                    file: Path = typer.Argument(..., help="Job spec: YAML (or JSON) mapping of JobSpec fields, "
                                                          "without deadline/not_before/not_after (use slack_s)."),
                    cron: str = typer.Option(..., "--cron", help='5-field cron, e.g. "0 2 * * *" (02:00 daily), '
                                                                 'or @daily/@hourly/...'),
                    tz: str = typer.Option("UTC", "--timezone", help="IANA time zone the cron is read in."),
                    url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Create a schedule: submit the job in FILE at every fire of --cron (local time of --timezone)."""
    from broker.service.store.core import InvalidSchedule, check_schedule

    try:
        spec = load_job_file(file)
    except JobFileError as e:
        fail(str(e), 2)
    try:
        check_schedule(name, cron, tz, spec)
    except InvalidSchedule as e:
        opts = {"name": "NAME", "cron": "--cron", "timezone": "--timezone"}
        parts = [f"{file}: {msg.removeprefix('spec.')}" if field.startswith("spec.")
                 else f"{opts[field]}{msg[len(field):]}" if field in opts else msg
                 for field, _, msg in e.errors]
        fail("; ".join(parts), 2)
    c = client(url, token)
    x = call(c, c.create_schedule, name, cron, spec, timezone=tz)
    show(x, as_json, _print_schedule_line)


@schedule_app.command("list")
def schedule_list(team: Optional[str] = typer.Option(None, help="Only this team (default: yours; admins: all)."),
                  url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """List schedules: cron, time zone, active/paused, next and last run."""
    c = client(url, token)
    xs = call(c, c.schedules, team)
    show(xs, as_json, _print_schedules)


@schedule_app.command("pause")
def schedule_pause(schedule_id: str = typer.Argument(..., help="sch-0123456789abcdef"),
                   url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Pause a schedule: it creates no jobs until resumed."""
    _schedule_action("pause_schedule", schedule_id, url, token, as_json)


@schedule_app.command("resume")
def schedule_resume(schedule_id: str = typer.Argument(..., help="sch-0123456789abcdef"),
                    url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Resume a paused schedule from its next fire (fires missed while paused are skipped)."""
    _schedule_action("resume_schedule", schedule_id, url, token, as_json)


@schedule_app.command("delete")
def schedule_delete(schedule_id: str = typer.Argument(..., help="sch-0123456789abcdef"),
                    url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt) -> None:
    """Delete a schedule (the jobs it already created stay)."""
    c = client(url, token)
    call(c, c.delete_schedule, schedule_id)
    current_console().print(f"{schedule_id} deleted", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``schedule`` (``create``, ``list``, ``pause``, ``resume``, ``delete``) to the ``fedbroker`` CLI."""
    app.add_typer(schedule_app, name="schedule")
