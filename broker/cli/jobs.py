"""``fedbroker`` commands for users of a live broker (they talk to its HTTP API through :class:`broker.Client`).

Commands::

    fedbroker submit JOB.yaml [--idempotency-key K] [--wait [--timeout S]] [--json]
    fedbroker status JOB_ID [--json]
    fedbroker list [--team T] [--state S]... [--limit N] [--json]
    fedbroker cancel JOB_ID [--json]
    fedbroker logs JOB_ID [--attempt N] [--rank R]
    fedbroker explain JOB_ID [--json]
    fedbroker nodes [list] [--json]               (broker.cli.nodes; also `nodes probe`)
    fedbroker schedule create NAME JOB.yaml --cron "0 2 * * *" [--timezone Europe/London] [--json]
    fedbroker schedule list [--team T] [--json]
    fedbroker schedule pause SCHEDULE_ID [--json]
    fedbroker schedule resume SCHEDULE_ID [--json]
    fedbroker schedule delete SCHEDULE_ID
    fedbroker tokens create --team T [--kind K | --admin] [--label L] [--ttl 30d] [--node N] [--json]
    fedbroker tokens list [--team T] [--all] [--json]
    fedbroker tokens revoke TOKEN_ID [--json]
    fedbroker tokens rotate TOKEN_ID [--ttl 30d] [--json]
    fedbroker audit [--since T] [--action A] [--limit N] [--json]     (admin tokens)

``tokens create`` without a token writes to the job store directly (settings' database): only the
bootstrap on a fresh store (no admin token yet); with ``--token`` every token command uses the API.

Each API command takes ``--url`` (``$FEDBROKER_API_URL``, else the settings' ``api_url``) and
``--token`` (``$FEDBROKER_TOKEN``). Exit status: 0 ok; 1 the broker refused the request or
cannot be reached (message on stderr); 2 a bad job file or option (nothing submitted).
``submit --wait`` exits 1 unless the job succeeded. ``schedule create`` checks the name,
``--cron``, ``--timezone`` and the job file (no absolute ``deadline``/``not_before``/``not_after``:
every run is relative to its fire instant, give ``slack_s``) before calling the broker.
"""

from __future__ import annotations

import json
import math
import re
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.console import (JsonOpt, TokenOpt, UrlOpt, call, client, current_console, echo_json, fail, show, stderr,
                                utc_text)
from broker.model import wait_text

__all__ = ["register", "load_job_file"]




class JobFileError(ValueError):
    """A job file that cannot be read, parsed or validated; the message names the file, field and value."""


def _print_schedule_line(x) -> None:
    current_console().print(escape(_schedule_line(x)), highlight=False)


def load_job_file(path: Path):
    """Read a job spec mapping from ``path`` (YAML, or JSON for ``*.json``) and validate it.

    Returns a :class:`broker.model.JobSpec`. Raises :class:`JobFileError` naming the file,
    and for validation errors the field and the value (``JOB.yaml: gpus_per_node=-1: ...``).
    """
    import yaml
    from pydantic import ValidationError

    from broker.model import JobSpec
    from broker.service.jsonbody import MAX_BODY_BYTES
    from broker.unique_keys import DuplicateJsonKey, DuplicateKeyError, load_yaml, unique_json_object

    try:
        with open(path, "rb") as f:  # at most what the API takes: /dev/zero once grew to 1.6 GB in 4 s
            data = f.read(MAX_BODY_BYTES + 1)
        if len(data) > MAX_BODY_BYTES:
            raise JobFileError(f"{path}: larger than {MAX_BODY_BYTES} bytes (the API's request limit)")
        raw = data.decode("utf-8")
    except OSError as e:
        raise JobFileError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise JobFileError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    try:
        data = json.loads(raw, object_pairs_hook=unique_json_object) if path.suffix.lower() == ".json" else load_yaml(raw)
    except DuplicateJsonKey as e:
        raise JobFileError(f"{path}: {e}") from None
    except DuplicateKeyError as e:
        raise JobFileError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise JobFileError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise JobFileError(f"{path}: not valid YAML ({where}{getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise JobFileError(f"{path}: must hold a mapping of job spec fields (image, command, gpus_per_node, ...), "
                           f"got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"]) or "(spec)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"{field}={err['input']!r}: unknown field (known: {', '.join(JobSpec.model_fields)})"
            elif err["loc"] and msg.startswith(f"{err['loc'][-1]}="):
                msg = f"{field}{msg[len(str(err['loc'][-1])):]}"
            elif err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
                msg = f"{field}={err.get('input')!r}: {msg}"
            else:
                msg = f"{field}: {msg}"
            parts.append(msg)
        raise JobFileError(f"{path}: " + "; ".join(parts)) from None


def _placement(p: dict | None) -> str:
    if not p:
        return "-"
    if p.get("kind") == "onprem":
        nodes = ", ".join(f"{n.get('node')}[{','.join(str(g) for g in n.get('gpus', []))}]" for n in p.get("nodes", []))
        return f"on-prem pool {p.get('pool')}: {nodes}"
    return ", ".join(f"{k}={v}" for k, v in p.items())


def _print_job(job) -> None:
    con = current_console()
    s = job.spec
    rows = [("job", job.id), ("name", job.name or "-"), ("team", job.team), ("state", job.state),
            ("reason", job.reason or "-"), ("placement", _placement(job.placement)),
            ("gpus", f"{s.nodes} x {s.gpus_per_node} {'/'.join(s.gpu_types) or 'any'}"),
            ("attempt", str(job.attempt)), ("submitted", utc_text(job.created_at)), ("not before", utc_text(job.not_before)),
            ("not after", utc_text(job.not_after)), ("deadline", utc_text(job.deadline)), ("started", utc_text(job.started_at)),
            ("finished", utc_text(job.finished_at))]
    if job.exit_code is not None:
        rows.append(("exit code", str(job.exit_code)))
    if job.cancel_requested and job.state != "cancelled":
        rows.append(("cancel", "requested"))
    for k, v in rows:
        con.print(f"{k:>11}: {escape(v)}", highlight=False)


def _money(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"${v:,.2f}"


def _num(v, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _wait(s) -> str:
    return "n/a" if s is None else wait_text(s)


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


def register(app: typer.Typer) -> None:
    """Add the job commands (submit, status, list, cancel, logs, explain, schedule, tokens, audit) to ``app``
    (``nodes`` is in :mod:`broker.cli.nodes`)."""

    @app.command()
    def submit(file: Path = typer.Argument(..., help="Job spec: YAML (or JSON) mapping of JobSpec fields."),
               idempotency_key: Optional[str] = typer.Option(None, help="Repeat a submit safely: same key, same job."),
               wait: bool = typer.Option(False, "--wait", help="Wait until the job finishes (exit 1 unless it succeeded)."),
               timeout: float = typer.Option(86400.0, help="With --wait: give up after this many seconds."),
               url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Submit the job described by FILE."""
        try:
            spec = load_job_file(file)
        except JobFileError as e:
            fail(str(e), 2)
        if wait and not (math.isfinite(timeout) and timeout > 0):
            fail(f"--timeout={timeout}: must be a finite number > 0", 2)
        c = client(url, token)
        job = call(c, c.submit, spec, idempotency_key=idempotency_key)
        if not wait:
            if as_json:
                echo_json(job)
            else:
                current_console().print(f"{job.id} {job.state} (team {job.team}, deadline {utc_text(job.deadline)})", highlight=False)
            return
        if not as_json:
            current_console().print(f"{job.id} submitted; waiting ...", highlight=False)
        from broker.client import WaitTimeout

        try:
            job = call(c, c.wait, job.id, timeout=timeout)
        except WaitTimeout as e:
            job = e.job
            stderr.print(f"{job.id}: still {job.state} after {timeout:g} s")
        show(job, as_json, _print_job)
        if job.state != "succeeded":
            raise typer.Exit(1)

    @app.command()
    def status(job_id: str = typer.Argument(..., help="job-0123456789abcdef"),
               url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Show a job's state, reason, placement and times."""
        c = client(url, token)
        job = call(c, c.get, job_id)
        show(job, as_json, _print_job)

    @app.command("list")
    def list_(team: Optional[str] = typer.Option(None, help="Only this team (default: yours; admins: all)."),
              state: Optional[list[str]] = typer.Option(None, "--state", help="Only jobs in this state (repeatable)."),
              limit: int = typer.Option(50, help="At most this many jobs (1-1000), newest first."),
              url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """List jobs, newest first."""
        from broker.states import JobState

        known = [s.value for s in JobState]
        for s in state or ():
            if s not in known:
                fail(f"--state={s!r}: not a job state (one of {', '.join(known)})", 2)
        if not 1 <= limit <= 1000:
            fail(f"--limit={limit}: must be between 1 and 1000", 2)
        c = client(url, token)
        jobs = call(c, c.list, team=team, state=state or None, limit=limit)
        if as_json:
            echo_json(jobs)
            return
        tab = Table(title=f"{len(jobs)} job(s)")
        for col in ("id", "team", "name", "state", "gpus", "submitted", "deadline", "reason"):
            tab.add_column(col, overflow="fold")
        for j in jobs:
            tab.add_row(j.id, j.team, escape(j.name or "-"), j.state, f"{j.spec.nodes}x{j.spec.gpus_per_node}",
                        utc_text(j.created_at), utc_text(j.deadline), escape(j.reason or ""))
        current_console().print(tab)

    @app.command()
    def cancel(job_id: str = typer.Argument(..., help="job-0123456789abcdef"),
               url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Cancel a job (a running job is stopped by its node agent; a cloud job's instances are terminated
        by the broker)."""
        c = client(url, token)
        job = call(c, c.cancel, job_id)
        if as_json:
            echo_json(job)
        elif job.state == "cancelled":
            current_console().print(f"{job.id} cancelled", highlight=False)
        else:
            then = ("cancel requested; the broker terminates its instances"
                    if (job.placement or {}).get("kind") == "cloud" else "cancel requested, the node agent stops it")
            current_console().print(f"{job.id} {job.state}: {then}", highlight=False)

    @app.command()
    def logs(job_id: str = typer.Argument(..., help="job-0123456789abcdef"),
             attempt: Optional[int] = typer.Option(None, help="Attempt number (default: the latest)."),
             rank: int = typer.Option(0, help="Node rank of a multi-node job."),
             raw: bool = typer.Option(False, "--raw", help="Print the log byte for byte, terminal control "
                                      "sequences included (only for logs you trust)."),
             url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt) -> None:
        """Print the captured stdout+stderr of a job's attempt. Control characters other than newline and tab
        are shown escaped (``\\x1b``), and a carriage return starts a new line, unless ``--raw``: a job's
        output is whatever it printed, and an escape sequence would drive the reader's terminal."""
        if attempt is not None and attempt < 1:
            fail(f"--attempt={attempt}: must be >= 1", 2)
        if rank < 0:
            fail(f"--rank={rank}: must be >= 0", 2)
        c = client(url, token)
        view = call(c, c.logs_view, job_id, attempt, rank)
        text = view.text if raw else terminal_safe(view.text)
        if text and not text.endswith("\n"):
            text += "\n"
        sys.stdout.write(text)  # as it is (typer.echo strips ANSI sequences only when not on a terminal)
        sys.stdout.flush()
        if view.attempt == 0:
            stderr.print(f"{job_id}: no attempt yet (no logs)")
        elif view.truncated:
            stderr.print(f"{job_id}: log of attempt {view.attempt} reached the size cap and was truncated")
        elif not view.text:
            hint = f"; earlier attempts: --attempt 1..{view.attempt - 1}" if view.attempt > 1 else ""
            stderr.print(f"{job_id}: attempt {view.attempt} rank {view.rank} has no log yet{hint}")

    @app.command()
    def explain(job_id: str = typer.Argument(..., help="job-0123456789abcdef"),
                url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Why the job is where it is: the chosen option and its alternatives ($, kWh, kgCO2e, wait), then the history."""
        c = client(url, token)
        ex = call(c, c.explain, job_id)
        if as_json:
            echo_json(ex)
            return
        con = current_console()
        j = ex.job
        con.print(f"{j.id} ({j.team}) is [bold]{j.state}[/bold]: {escape(j.reason or '-')}", highlight=False)
        d = ex.decision
        if not d:
            con.print("no planner decision yet (the planner has not seen this job)")
        else:
            con.print(f"decision: [bold]{d.get('kind')}[/bold]" + (f" - {escape(d['reason'])}" if d.get("reason") else ""),
                      highlight=False)
            if d.get("not_before") is not None:
                con.print(f"not before: {utc_text(datetime.fromtimestamp(d['not_before'], tz=timezone.utc))}", highlight=False)
            tab = Table(title="options (chosen first)")
            for col in ("", "target", "$", "kWh", "kgCO2e", "wait", "start", "note"):
                tab.add_column(col, justify="right" if col in ("$", "kWh", "kgCO2e", "wait") else "left")
            opts = ([("chosen", d["option"])] if d.get("option") else []) + [("alt", o) for o in d.get("alternatives") or []]
            for tag, o in opts:
                start = o.get("start_s")
                tab.add_row(tag, escape(str(o.get("target"))), _money(o.get("dollars_usd")),
                            _num(o.get("energy_kwh"), ",.2f"), _num(o.get("carbon_kg"), ",.3f"), _wait(o.get("wait_s")),
                            utc_text(datetime.fromtimestamp(start, tz=timezone.utc)) if start is not None else "-",
                            escape(o.get("note") or ("" if o.get("feasible", True) else "infeasible")))
            if opts:
                con.print(tab)
            for sig in d.get("signals") or []:  # where the grid signals came from (broker/service/live.py)
                flag = "[bold]FALLBACK[/bold] " if sig.get("fallback") else ""
                con.print(f"signals: {flag}{escape(str(sig.get('note', '')))}", highlight=False)
        hist = Table(title="history")
        for col in ("at", "from", "to", "reason"):
            hist.add_column(col)
        for e in ex.events:
            hist.add_row(utc_text(e.at), e.from_state or "-", e.to_state, escape(e.reason))
        con.print(hist)
        if ex.attempts:
            at = Table(title="attempts")
            for col in ("#", "where", "gpus", "started", "ended", "exit", "outcome", "reason"):
                at.add_column(col)
            for a in ex.attempts:
                where = a.pool if a.kind == "onprem" else a.offer_id
                at.add_row(str(a.number), f"{a.kind} {where or ''}".strip(), f"{a.gpus} {a.gpu_type or ''}".strip(),
                           utc_text(a.started_at), utc_text(a.ended_at), "-" if a.exit_code is None else str(a.exit_code),
                           a.outcome or "-", escape(a.reason))
            con.print(at)
            tried = [(a.number, f) for a in ex.attempts for f in a.failover]
            if tried:
                ft = Table(title="cloud failover (each option tried, in order)")
                for col in ("#", "at", "option", "rank", "result"):
                    ft.add_column(col)
                for num, f in tried:
                    result = "created" if not f.get("error") else f"{f['error']}: {f.get('message', '')}"
                    rank = f.get("rank")
                    ft.add_row(str(num), escape(str(f.get("at", ""))[:19]), escape(str(f.get("option"))),
                               "-" if rank is None else escape(str(rank)), escape(result))
                con.print(ft)

    schedule = typer.Typer(no_args_is_help=True,
                           help="Recurring runs: submit a job at every fire of a cron expression.")
    app.add_typer(schedule, name="schedule")

    @schedule.command("create")
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

    @schedule.command("list")
    def schedule_list(team: Optional[str] = typer.Option(None, help="Only this team (default: yours; admins: all)."),
                      url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """List schedules: cron, time zone, active/paused, next and last run."""
        c = client(url, token)
        xs = call(c, c.schedules, team)
        show(xs, as_json, _print_schedules)

    @schedule.command("pause")
    def schedule_pause(schedule_id: str = typer.Argument(..., help="sch-0123456789abcdef"),
                       url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Pause a schedule: it creates no jobs until resumed."""
        _schedule_action("pause_schedule", schedule_id, url, token, as_json)

    @schedule.command("resume")
    def schedule_resume(schedule_id: str = typer.Argument(..., help="sch-0123456789abcdef"),
                        url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Resume a paused schedule from its next fire (fires missed while paused are skipped)."""
        _schedule_action("resume_schedule", schedule_id, url, token, as_json)

    @schedule.command("delete")
    def schedule_delete(schedule_id: str = typer.Argument(..., help="sch-0123456789abcdef"),
                        url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt) -> None:
        """Delete a schedule (the jobs it already created stay)."""
        c = client(url, token)
        call(c, c.delete_schedule, schedule_id)
        current_console().print(f"{schedule_id} deleted", highlight=False)

    tokens = typer.Typer(no_args_is_help=True, help="API tokens: kinds, lifetimes, list, revoke, rotate "
                                                    "(over the API with --token; without one, only the bootstrap).")
    app.add_typer(tokens, name="tokens")

    @tokens.command("create")
    def tokens_create(team: str = typer.Option(..., help="The team the token acts for."),
                      kind: str = typer.Option("member", "--kind",
                                               help="member | team-admin | read-only | node | admin | finance."),
                      admin: bool = typer.Option(False, "--admin", help="Same as --kind admin (sees every team)."),
                      label: str = typer.Option("", help="A note stored with the token."),
                      ttl: Optional[str] = typer.Option(None, "--ttl", help="Lifetime: 30d, 12h, 90m or seconds "
                                                                           "(default: settings' token_ttl_days)."),
                      node: Optional[str] = typer.Option(None, "--node", help="The node of a node token."),
                      config: Optional[Path] = typer.Option(None, help="Settings YAML (default: $FEDBROKER_CONFIG)."),
                      url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Create an API token and print its secret (once: only its hash is stored).

        With --token (or FEDBROKER_TOKEN) it asks the API: an admin token creates any kind for any team, a
        team-admin token member and read-only tokens of its own team. Without a token it writes to the job
        store directly, which works only while the store has no admin token (a fresh install: the bootstrap);
        afterwards use an admin token."""
        from broker.service.tokens import TOKEN_KINDS, InvalidTokenRequest, parse_ttl

        if admin:
            if kind not in ("member", "admin"):
                fail(f"--admin with --kind={kind!r}: give one of them", 2)
            kind = "admin"
        if kind not in TOKEN_KINDS:
            fail(f"--kind={kind!r}: one of {', '.join(TOKEN_KINDS)}", 2)
        try:
            ttl_s = parse_ttl(ttl) if ttl is not None else None
        except InvalidTokenRequest as e:
            fail(str(e).replace("ttl=", "--ttl=", 1), 2)
        if token:
            c = client(url, token)
            made = call(c, c.create_token, team=team, kind=kind, label=label,
                         ttl_s=int(ttl_s) if ttl_s is not None else None, node=node)
        else:
            made = _bootstrap_token(config, team, kind, label, ttl_s, node)
        _print_created(made, as_json)

    @tokens.command("list")
    def tokens_list(team: Optional[str] = typer.Option(None, help="Only this team (admins)."),
                    include_revoked: bool = typer.Option(False, "--all", help="Also revoked tokens."),
                    url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """List tokens (never their secrets): an admin token sees every team's, a team-admin token its own team's."""
        c = client(url, token)
        rows = call(c, c.tokens, team=team, include_revoked=include_revoked)

        def human(rows) -> None:
            tab = Table(show_edge=False)
            for col in ("id", "team", "kind", "label", "created", "expires", "last used", "state"):
                tab.add_column(col)
            for t in rows:
                state = "revoked" if t.revoked else "expired" if t.expired else "active"
                tab.add_row(t.id, escape(t.team), t.kind + (f" ({escape(t.node)})" if t.node else ""), escape(t.label),
                            utc_text(t.created_at), utc_text(t.expires_at), utc_text(t.last_used_at), state)
            current_console().print(tab)

        show(rows, as_json, human)

    @tokens.command("revoke")
    def tokens_revoke(token_id: str = typer.Argument(..., help="tok-0123456789abcdef"),
                      url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Revoke a token: it answers 401 from now on."""
        c = client(url, token)
        t = call(c, c.revoke_token, token_id)
        show(t, as_json, lambda t: current_console().print(f"{t.id} revoked ({t.kind} of {t.team})", highlight=False))

    @tokens.command("rotate")
    def tokens_rotate(token_id: str = typer.Argument(..., help="tok-0123456789abcdef"),
                      ttl: Optional[str] = typer.Option(None, "--ttl", help="Lifetime of the new secret "
                                                                           "(default: settings' token_ttl_days)."),
                      url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """Replace a token by a new one (same kind, team and label, new expiry) and revoke the old one;
        prints the new secret (once)."""
        from broker.service.tokens import InvalidTokenRequest, parse_ttl

        try:
            ttl_s = parse_ttl(ttl) if ttl is not None else None
        except InvalidTokenRequest as e:
            fail(str(e).replace("ttl=", "--ttl=", 1), 2)
        c = client(url, token)
        _print_created(call(c, c.rotate_token, token_id, ttl_s=int(ttl_s) if ttl_s is not None else None), as_json)

    @app.command("audit")
    def audit(since: Optional[str] = typer.Option(None, help="Only events at or after this instant (ISO 8601; "
                                                             "UTC if no offset)."),
              action: Optional[str] = typer.Option(None, help="Only this action, e.g. token.revoke, job.cancel."),
              limit: int = typer.Option(100, min=1, max=1000),
              url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
        """The broker's audit log, newest first (needs an admin token): token operations, submits, cancels
        and schedule changes, each with the acting token."""
        when = None
        if since is not None:
            try:
                when = datetime.fromisoformat(since.replace("Z", "+00:00"))
            except ValueError:
                fail(f"--since={since!r}: not an ISO 8601 instant (e.g. 2026-12-01T12:00:00Z)", 2)
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
        c = client(url, token)
        rows = call(c, c.audit, since=when, action=action, limit=limit)

        def human(rows) -> None:
            for e in rows:
                actor = f"{e.actor_kind}:{e.actor_team or '-'}:{e.actor_token_id or '-'}"
                current_console().print(escape(f"{utc_text(e.at)}  {e.action:<16} {e.target:<22} by {actor}  "
                                        f"{json.dumps(e.detail, sort_keys=True)}"), highlight=False)

        show(rows, as_json, human)


#: the control characters a log shows escaped: C0 but tab and newline, DEL, C1
_LOG_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` as a terminal may show it: CRLF and a lone CR (a progress bar's redraw) become newlines, every
    other control character but tab is shown as ``\\xNN`` (ESC, BEL, the OSC that sets the window title or the
    clipboard ...)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _LOG_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


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


def _bootstrap_token(config: Path | None, team: str, kind: str, label: str, ttl_s: float | None, node: str | None):
    """Mint a token directly in the job store (:func:`broker.service.tokens.bootstrap`); exit 1 when refused, 2 for a bad
    field or settings file."""
    from broker.service.tokens import BootstrapRefused, InvalidTokenRequest, bootstrap

    with direct_store(config) as (settings, store):
        try:
            return bootstrap(store, team, kind, label=label, node=node,
                             ttl=ttl_s if ttl_s is not None else settings.token_ttl_days * 86400.0)
        except InvalidTokenRequest as e:
            fail(str(e), 2)
        except BootstrapRefused as e:
            fail(str(e), 1)


def _print_created(made, as_json: bool) -> None:
    """Print a just-created token: its secret alone on stdout (or the JSON), what it is on stderr."""
    if as_json:
        echo_json(made)
        return
    typer.echo(made.token)
    what = f"{made.kind} token {made.id} for team {made.team!r}" + (f" (node {made.node})" if made.node else "")
    stderr.print(escape(f"{what}, expires {utc_text(made.expires_at)}"
                      + (f", replaces {made.rotated_from} (now revoked)" if made.rotated_from else "")
                      + ": store it now, it is not shown again"), highlight=False)
