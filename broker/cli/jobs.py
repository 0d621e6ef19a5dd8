"""``fedbroker`` job commands for users of a live broker (they talk to its HTTP API through :class:`broker.Client`).

Commands::

    fedbroker submit JOB.yaml [--idempotency-key K] [--wait [--timeout S]] [--json]
    fedbroker status JOB_ID [--json]
    fedbroker list [--team T] [--state S]... [--name N] [--limit N] [--json]
    fedbroker cancel JOB_ID [--json]
    fedbroker cancel --all | --state S... | --name N [--team T] [--json]   (one request: POST /v1/jobs:cancel)
    fedbroker logs JOB_ID [--attempt N] [--rank R] [--tail N] [--follow] [--raw]
    fedbroker explain JOB_ID [--json]
    fedbroker nodes [list] [--json]               (broker.cli.nodes; also `nodes probe`)
    fedbroker schedule create|list|pause|resume|delete ...      (broker.cli.schedules)
    fedbroker tokens create|list|revoke|rotate ...; fedbroker audit   (broker.cli.tokens)

These are module-level functions, added to the root app by :func:`register`; the job file reader
(:func:`load_job_file`) is shared with ``schedule create``.

Each API command takes ``--url`` (``$FEDBROKER_API_URL``, else the settings' ``api_url``) and
``--token`` (``$FEDBROKER_TOKEN``). Exit status: 0 ok; 1 the broker refused the request or
cannot be reached (message on stderr); 2 a bad job file or option (nothing submitted).
``submit --wait`` exits 1 unless the job succeeded.
"""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.console import (JsonOpt, TokenOpt, UrlOpt, call, cell, client, current_console, echo_json, fail, show,
                                stderr, utc_text)
from broker.model import wait_text

__all__ = ["register", "load_job_file", "JobFileError", "placement_text", "last_lines", "terminal_safe",
           "submit", "status", "list_", "cancel", "logs", "explain"]


class JobFileError(ValueError):
    """A job file that cannot be read, parsed or validated; the message names the file, field and value."""


def load_job_file(path: Path):
    """Read a job spec mapping from ``path`` (YAML, or JSON for ``*.json``) and validate it.

    Returns a :class:`broker.model.JobSpec`. Raises :class:`JobFileError` naming the file,
    and for validation errors the field and the value (``JOB.yaml: gpus_per_node=-1: ...``).
    """
    import yaml
    from pydantic import ValidationError

    from broker.model import JobSpec
    from broker.service.jsonbody import MAX_BODY_BYTES
    from broker.unique_keys import DUPLICATE_KEY_ERRORS, read_document

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
        data = read_document(path, raw)
    except DUPLICATE_KEY_ERRORS as e:
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


#: how a placement's ``kind`` reads in a sentence (``JobView.placement``; kinds of :mod:`broker.service.schedulers`)
PLACEMENT_KIND_TEXT = {"onprem": "on-prem", "slurm": "Slurm", "kubernetes": "Kubernetes", "cloud": "cloud"}
#: cloud placement fields the offer id already spells out (``aws:us-east-1a:p3.16xlarge:spot``)
_IN_OFFER_ID = ("provider", "region", "zone", "instance_type", "market")


def _plain(v) -> str:
    """A placement value as text: scalars as they are, lists and mappings as compact JSON (never a Python repr)."""
    if v is None or isinstance(v, (str, int, float, bool)):
        return str(v)
    return json.dumps(v, separators=(",", ":"), sort_keys=True, default=str)


def _placement_node(n) -> str:
    """One node of a placement: ``gpu-a[0,1]`` (a pool's node and its GPU indices) or ``rank 0 aws/i-0abc
    (10.0.0.5)`` (a cloud instance and its private address)."""
    if not isinstance(n, dict):
        return _plain(n)
    name = str(n.get("node") or n.get("instance_id") or "?")
    if "gpus" in n and isinstance(n["gpus"], list):
        return f"{name}[{','.join(str(g) for g in n['gpus'])}]"
    text = f"rank {n['rank']} {name}" if "rank" in n else name
    return text + (f" ({n['private_ip']})" if n.get("private_ip") else "")


def placement_text(p: dict | None) -> str:
    """A job's placement (``JobView.placement``) as one line for any runtime, e.g.
    ``on-prem pool local (H200): gpu-a[0,1]``, ``Slurm pool hpc (A100): n1[0,1,2,3], n2[0,1,2,3]; scheduler gpu type
    a100``, ``cloud offer aws:us-east-1a:p3.16xlarge:spot (V100): rank 0 aws/i-0abc (10.0.0.5)``; ``-`` for none.
    Fields this does not know are appended as ``name value`` (lists and mappings as compact JSON), so a new
    runtime's placement still reads without a Python dict."""
    if not p:
        return "-"
    rest = dict(p)
    kind = str(rest.pop("kind", None) or "")
    label = PLACEMENT_KIND_TEXT.get(kind, kind or "placement")
    nodes = rest.pop("nodes", None)
    gpu_type = rest.pop("gpu_type", None)
    if "pool" in rest:
        head = f"{label} pool {rest.pop('pool')}"
    elif "offer_id" in rest:
        head = f"{label} offer {rest.pop('offer_id')}"
        for k in _IN_OFFER_ID:
            rest.pop(k, None)
    else:
        head = label
    if gpu_type:
        head += f" ({gpu_type})"
    if isinstance(nodes, list) and nodes:
        head += ": " + ", ".join(_placement_node(n) for n in nodes)
    elif nodes:
        rest["nodes"] = nodes
    extra = "; ".join(f"{k.replace('_', ' ')} {_plain(v)}" for k, v in rest.items() if v is not None)
    return head + (f"; {extra}" if extra else "")


def _cancel_requested_text(placement: dict | None) -> str:
    """What happens to a job whose cancel was requested, by its placement's kind (``JobView.placement``): a cloud
    job's instances are terminated, an agent host's node agent stops it, a scheduler's pool cancels it there."""
    kind = (placement or {}).get("kind")
    if kind == "cloud":
        return "cancel requested; the broker terminates its instances"
    if kind in ("onprem", None):
        return "cancel requested, the node agent stops it"
    return f"cancel requested, the broker cancels it in its {PLACEMENT_KIND_TEXT.get(kind, kind)} cluster"


def _print_job(job) -> None:
    con = current_console()
    s = job.spec
    rows = [("job", job.id), ("name", job.name or "-"), ("team", job.team), ("state", job.state),
            ("reason", job.reason or "-"), ("placement", placement_text(job.placement)),
            ("gpus", f"{s.nodes} x {s.gpus_per_node} {'/'.join(s.gpu_types) or 'any'}"),
            ("attempt", str(job.attempt)), ("submitted", utc_text(job.created_at)), ("not before", utc_text(job.not_before)),
            ("not after", utc_text(job.not_after)), ("deadline", utc_text(job.deadline)), ("started", utc_text(job.started_at)),
            ("finished", utc_text(job.finished_at))]
    if job.exit_code is not None:
        rows.append(("exit code", str(job.exit_code)))
    if job.cancel_requested and job.state != "cancelled":
        rows.append(("cancel", "requested"))
    rows.extend(("WARNING", w) for w in job.warnings)  # a deadline it cannot meet or runs past (broker.service.feasibility)
    for k, v in rows:
        con.print(f"{k:>11}: {escape(v)}", highlight=False)


def _history_printer(c):
    """``on_change(view)`` for :meth:`broker.Client.wait`: prints the job's events not printed yet, one line each
    (``2026-12-04T03:00:01Z queued -> starting: placed on pool local ...``), or, when the reason changed without
    a new event (a waiting job's expected start), the state and the new reason."""
    printed = {"events": 0, "reason": None}

    def on_change(job) -> None:
        con = current_console()
        events = call(c, c.explain, job.id).events
        for e in events[printed["events"]:]:
            con.print(escape(f"{utc_text(e.at)} {e.from_state or '-'} -> {e.to_state}: {e.reason}"), highlight=False)
            printed["reason"] = e.reason
        printed["events"] = max(printed["events"], len(events))
        if job.reason and job.reason != printed["reason"] and not job.done:
            con.print(escape(f"{utc_text(datetime.now(timezone.utc))} {job.state}: {job.reason}"), highlight=False)
        printed["reason"] = job.reason

    return on_change


def _money(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"${v:,.2f}"


def _num(v, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _wait(s) -> str:
    return "n/a" if s is None else wait_text(s)


#: below this console width ``list`` leaves out the team, submitted and deadline columns (``status`` and ``--json``
#: have them), so that name and reason keep room at 80 columns
LIST_WIDE_AT = 120


def _jobs_table(jobs) -> Table:
    """The ``list`` table: one line per job at any console width (:func:`broker.cli.console.console_width`). Ids,
    states, GPUs and instants are never cut; name and reason are ellipsised to what is left; below
    :data:`LIST_WIDE_AT` columns the team, submitted and deadline columns are left out (``--json`` has every
    field)."""
    wide = current_console().width >= LIST_WIDE_AT
    shown = [c for c in ("id", "team", "name", "state", "gpus", "submitted", "deadline", "reason")
             if wide or c not in ("team", "submitted", "deadline")]
    tab = Table(title=f"{len(jobs)} job(s)", show_edge=False)
    for col in shown:
        tab.add_column(col, no_wrap=col not in ("team", "name", "reason"))  # those three shrink, cut with …
    for j in jobs:
        row = {"id": j.id, "team": cell(j.team), "name": cell(j.name), "state": j.state,
               "gpus": f"{j.spec.nodes}x{j.spec.gpus_per_node}", "submitted": utc_text(j.created_at),
               "deadline": utc_text(j.deadline),
               "reason": cell("; ".join([f"WARNING: {w}" for w in j.warnings] + ([j.reason] if j.reason else [])) or None)}
        tab.add_row(*(row[c] for c in shown))
    return tab


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
            for w in job.warnings:
                stderr.print(escape(f"warning: {w}"), highlight=False)
        return
    if not as_json:
        current_console().print(f"{job.id} submitted; waiting (each change of state is printed as it "
                                "happens) ...", highlight=False)
        for w in job.warnings:
            stderr.print(escape(f"warning: {w}"), highlight=False)
    from broker.client import WaitTimeout

    try:
        job = call(c, c.wait, job.id, timeout=timeout, on_change=None if as_json else _history_printer(c))
    except WaitTimeout as e:
        job = e.job
        stderr.print(f"{job.id}: still {job.state} after {timeout:g} s")
    show(job, as_json, _print_job)
    if job.state != "succeeded":
        raise typer.Exit(1)


def status(job_id: str = typer.Argument(..., help="job-0123456789abcdef"),
           url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Show a job's state, reason, placement and times."""
    c = client(url, token)
    job = call(c, c.get, job_id)
    show(job, as_json, _print_job)


def list_(team: Optional[str] = typer.Option(None, help="Only this team (default: yours; admins: all)."),
          state: Optional[list[str]] = typer.Option(None, "--state", help="Only jobs in this state (repeatable)."),
          limit: int = typer.Option(50, help="At most this many jobs (1-1000), newest first."),
          name: Optional[str] = typer.Option(None, "--name", help="Only jobs of exactly this name."),
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
    # one job past the limit says whether the list was cut (the API serves at most 1000 a page)
    jobs = call(c, c.list, team=team, state=state or None, limit=min(limit + 1, 1000), name=name)
    more = len(jobs) > limit or (limit == 1000 and len(jobs) == 1000 and bool(
        call(c, c.list, team=team, state=state or None, limit=1, offset=1000, name=name)))
    jobs = jobs[:limit]
    if as_json:
        echo_json(jobs)
        return
    current_console().print(_jobs_table(jobs))
    if more:
        current_console().print(f"showing the newest {limit} jobs; more match (--limit up to 1000, --state, --name, "
                                f"--team)",
                                highlight=False)


def cancel(job_id: Optional[str] = typer.Argument(None, help="job-0123456789abcdef (or --all/--state/--name)"),
           all_: bool = typer.Option(False, "--all", help="Every unfinished job of the team."),
           state: Optional[list[str]] = typer.Option(None, "--state", help="Only jobs in this state (repeatable)."),
           name: Optional[str] = typer.Option(None, "--name", help="Only jobs of exactly this name."),
           team: Optional[str] = typer.Option(None, help="With --all/--state/--name: the team (default: yours; "
                                                       "an admin token must name one)."),
           url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Cancel a job, or with --all / --state / --name (AND-ed) many jobs of one team in one request (a running
    job is stopped by its node agent or its pool's scheduler; a cloud job's instances are terminated by the
    broker)."""
    bulk = all_ or bool(state) or name is not None
    if job_id is not None and (bulk or team is not None):
        fail(f"JOB_ID={job_id!r} with --all/--state/--name/--team: give a job id or a filter, not both", 2)
    if job_id is None and not bulk:
        fail("give a JOB_ID, or --all, --state or --name to cancel many jobs", 2)
    c = client(url, token)
    if job_id is not None:
        job = call(c, c.cancel, job_id)
        if as_json:
            echo_json(job)
        elif job.state == "cancelled":
            current_console().print(f"{job.id} cancelled", highlight=False)
        else:
            current_console().print(f"{job.id} {job.state}: {_cancel_requested_text(job.placement)}",
                                    highlight=False)
        return
    from broker.states import TERMINAL_STATES, JobState

    known = [s.value for s in JobState]
    unfinished = [s.value for s in JobState if s not in TERMINAL_STATES]
    for s in state or ():
        if s not in unfinished:
            why = f"a {s} job cannot be cancelled" if s in known else f"not a job state (one of {', '.join(known)})"
            fail(f"--state={s!r}: {why}; the unfinished states are {', '.join(unfinished)}", 2)
    res = call(c, c.cancel_many, all=all_, state=state or None, name=name, team=team)
    if as_json:
        echo_json(res)
        return
    con = current_console()
    con.print(f"team {res.team}: {len(res.cancelled)} job(s) cancelled, {len(res.cancel_requested)} running "
              f"job(s) asked to stop", highlight=False)
    if res.more:
        con.print("more jobs matched than one request changes: run the same command again", highlight=False)


def logs(job_id: str = typer.Argument(..., help="job-0123456789abcdef"),
         attempt: Optional[int] = typer.Option(None, help="Attempt number (default: the latest)."),
         rank: int = typer.Option(0, help="Node rank of a multi-node job."),
         tail: Optional[int] = typer.Option(None, "--tail", help="Only the last N lines (with --follow: then "
                                            "what follows)."),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing what the job writes until it "
                                     "ends (Ctrl-C stops following; the job runs on)."),
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
    if tail is not None and tail < 0:
        fail(f"--tail={tail}: must be >= 0", 2)
    c = client(url, token)

    def out(text: str) -> None:
        sys.stdout.write(text if raw else terminal_safe(text))  # typer.echo strips ANSI only off a terminal
        sys.stdout.flush()

    if follow:
        _follow_logs(c, job_id, attempt, rank, tail, out)
        return
    view = call(c, c.logs_view, job_id, attempt, rank)
    text = last_lines(view.text, tail) if tail is not None else view.text
    if text and not text.endswith("\n"):
        text += "\n"
    out(text)
    if view.attempt == 0:
        stderr.print(f"{job_id}: no attempt yet (no logs)")
    elif view.truncated:
        stderr.print(f"{job_id}: log of attempt {view.attempt} reached the size cap and was truncated")
    elif not view.text:
        stderr.print(f"{job_id}: {_no_log_text(c, job_id, view)}")


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
    if not d and j.state == "submitted":
        con.print("no planner decision yet (the planner has not taken this job in)")
    elif not d:
        con.print("no planner record for this job (the reason above is the latest word on it)", highlight=False)
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
    if len(ex.decisions) > 1 or (ex.decisions and not d):  # the latest of each kind, newest first
        con.print("latest decision of each kind:")
        for x in ex.decisions:
            start = x.get("start_s")
            where = f" on {x['target']}" if x.get("target") else ""
            when = (f" from {utc_text(datetime.fromtimestamp(start, tz=timezone.utc))}"
                    if isinstance(start, (int, float)) and math.isfinite(start) else "")
            try:
                at = utc_text(datetime.fromisoformat(x["at"]))
            except (KeyError, TypeError, ValueError):
                at = "-"
            con.print(escape(f"  {at} {x.get('kind')}{where}{when}: {x.get('reason') or '-'}"), highlight=False)
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


#: seconds between two polls of ``logs --follow`` (two small requests each: the job, then the new text)
FOLLOW_POLL_S = 1.0


def last_lines(text: str, n: int) -> str:
    """The last ``n`` lines of ``text`` (a line ends at ``\n``; a last line without one counts), as they are:
    ``last_lines("a\nb\nc\n", 2) == "b\nc\n"``, ``last_lines("a\nb", 1) == "b"``; ``n`` 0 gives ``""``."""
    if n <= 0:
        return ""
    lines = text.splitlines(keepends=True)
    return "".join(lines[-n:])


def _no_log_text(c, job_id: str, view) -> str:
    """Why an attempt's log is empty: the attempt ended without output, or it has not written any yet."""
    job = call(c, c.get, job_id)
    hint = f"; earlier attempts: --attempt 1..{view.attempt - 1}" if view.attempt > 1 else ""
    over = job.done or job.attempt > view.attempt
    what = f"has no output (the job is {job.state})" if over else "has no log yet"
    return f"attempt {view.attempt} rank {view.rank} {what}{hint}"


def _follow_logs(c, job_id: str, attempt: int | None, rank: int, tail: int | None, out) -> None:
    """``logs --follow``: print the attempt's log so far (its last ``tail`` lines if given), then only what is new,
    every :data:`FOLLOW_POLL_S` s, until the job ends (:meth:`broker.Client.follow_logs`); the end is said on stderr.
    Ctrl-C stops following cleanly (exit 130, no traceback): the job is not touched."""
    seen = None

    def drain() -> None:
        nonlocal seen
        for view in c.follow_logs(job_id, attempt, rank, FOLLOW_POLL_S):
            out(last_lines(view.text, tail) if seen is None and tail is not None else view.text)
            seen = view

    try:
        call(c, drain)  # an API error on any poll exits as every command's does
        job = call(c, c.get, job_id)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        stderr.print(f"{job_id}: stopped following (the job runs on)")
        raise typer.Exit(130) from None
    if seen is not None and not seen.text.endswith("\n"):
        out("\n")
    n = seen.attempt if seen is not None else (attempt or job.attempt)
    if seen is None:
        stderr.print(f"{job_id}: attempt {n} rank {rank} has no output (the job is {job.state})" if n else
                     f"{job_id}: {job.state} without an attempt (no logs)")
    elif job.attempt > n and not job.done:
        stderr.print(f"{job_id}: attempt {n} ended; the job is {job.state} on attempt {job.attempt} "
                     f"(follow it: fedbroker logs --follow {job_id})")
    else:
        code = f" (exit code {job.exit_code})" if job.exit_code is not None else ""
        stderr.print(f"{job_id}: {job.state}{code}", highlight=False)


#: the control characters a log shows escaped: C0 but tab and newline, DEL, C1
_LOG_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` as a terminal may show it: CRLF and a lone CR (a progress bar's redraw) become newlines, every
    other control character but tab is shown as ``\\xNN`` (ESC, BEL, the OSC that sets the window title or the
    clipboard ...)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _LOG_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def register(app: typer.Typer) -> None:
    """Add the job commands (submit, status, list, cancel, logs, explain) to ``app`` (``schedule`` is in
    :mod:`broker.cli.schedules`, ``tokens`` and ``audit`` in :mod:`broker.cli.tokens`, ``nodes`` in
    :mod:`broker.cli.nodes`)."""
    app.command()(submit)
    app.command()(status)
    app.command("list")(list_)
    app.command()(cancel)
    app.command()(logs)
    app.command()(explain)
