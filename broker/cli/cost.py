"""``fedbroker cost``: the usage ledger against the provider's side (issue #12).

* ``fedbroker cost reconcile --from 2024-03-01 --to 2024-04-01 --cur bill.csv [--provider aws]`` — the ledger's
  instance lines against an AWS Cost and Usage Report-like CSV (:func:`broker.service.reconcile.read_cur_csv`):
  the provider total, what job lines carry (allocated) and the rest (unallocated), with every resource whose
  figures differ. ``--pool P --metered-kwh X`` does the same for an on-prem pool's energy against its meter.
  Exit 1 when a resource differs or the ledger has lines the bill does not; 2 for bad input.
* ``fedbroker cost report [--from 2024-03-01 --to 2024-04-01] --by team|project|provider|region|pool|line|day
  [--team T]`` — USD, GPU-hours, kWh and kgCO2e per group as a table (``--json``: the API's answer); each
  column with the decimals its smallest figure needs for 2 significant digits (:mod:`broker.money`).
* ``fedbroker cost export --focus FILE [--from ... --to ...] [--team T]`` — the ledger lines as a FOCUS 1.2 CSV.

``report`` and ``export`` default to this calendar month (UTC), as the finance page; ``reconcile`` needs both.

``reconcile`` reads the job store directly (the settings' database: an operator's check against the
provider's bill, every team's lines); ``report`` and ``export`` go through the HTTP API with ``--url`` and
``--token`` like ``fedbroker list``, so a team token sees its own team's lines only and an admin token every
team's. Exit 1 when the broker refuses or cannot be reached; 2 for a bad option.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.cloud import ConfigOpt, _database, _settings
from broker.cli.console import JsonOpt, TokenOpt, UrlOpt, call, client, current_console, echo_json, fail, stderr
from broker.money import decimals_for, figure_text
from broker.usage import SUMMARY_DIMENSIONS
from broker.utc import parse_utc

__all__ = ["cost_app", "register", "parse_day"]

cost_app = typer.Typer(no_args_is_help=True, help="Costs from the usage ledger: reconcile with the provider's bill.")


def parse_day(text: str, option: str) -> datetime:
    """``YYYY-MM-DD`` or an ISO 8601 instant (UTC when no zone is given) -> aware UTC datetime; exit 2 naming
    ``option`` otherwise."""
    try:
        return parse_utc(text, option, naive="utc")
    except ValueError:
        fail(f"{option}={text!r}: not a date (YYYY-MM-DD) or an ISO 8601 instant", code=2)


@cost_app.command("reconcile")
def reconcile_cmd(start: str = typer.Option(..., "--from", help="Period start, UTC (YYYY-MM-DD or ISO instant)."),
                  end: str = typer.Option(..., "--to", help="Period end (exclusive), UTC."),
                  cur: Optional[Path] = typer.Option(None, "--cur", help="AWS CUR-like CSV of the provider's bill."),
                  provider: str = typer.Option("aws", "--provider", help="Provider whose ledger lines --cur bills."),
                  pool: Optional[str] = typer.Option(None, "--pool", help="On-prem pool to reconcile (--metered-kwh)."),
                  metered_kwh: Optional[float] = typer.Option(None, "--metered-kwh",
                                                              help="The pool's metered facility energy, kWh."),
                  config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """The ledger against a provider-side total for [--from, --to): provider total = allocated + unallocated."""
    from broker.service.reconcile import ReconcileError, read_cur_csv, reconcile_cloud, reconcile_energy
    from broker.service.store import usage
    from broker.service.store.core import JobStore

    t0, t1 = parse_day(start, "--from"), parse_day(end, "--to")
    if t1 <= t0:
        fail(f"--to={end!r}: not after --from={start!r}", code=2)
    if cur is None and pool is None:
        fail("nothing to reconcile: give --cur FILE and/or --pool P --metered-kwh X", code=2)
    if (pool is None) != (metered_kwh is None):
        fail("--pool and --metered-kwh go together", code=2)
    try:
        bill = read_cur_csv(cur) if cur is not None else None
    except (ReconcileError, ValueError, OSError) as e:
        fail(str(e), code=2)
    st = _settings(config)
    store = JobStore.from_settings(st)
    with _database(st), store.session() as s:
        records = usage.usage_rows(s, start=t0, end=t1)
    out: dict = {"from": t0.isoformat(), "to": t1.isoformat()}
    bad = False
    con = current_console()
    if bill is not None:
        rec = reconcile_cloud(records, bill, t0, t1, provider=provider)
        diffs = [*rec.mismatched, *rec.ledger_only]
        bad = bool(diffs)
        out["cloud"] = {"provider": provider, "provider_total_usd": rec.provider_total_usd,
                        "allocated_usd": rec.allocated_usd, "unallocated_usd": rec.unallocated_usd,
                        "idle_usd": rec.idle_usd, "unexplained_usd": rec.unexplained_usd,
                        "unpriced_lines": rec.unpriced,
                        "differences": [{"resource": d.resource, "ledger_usd": d.ledger_usd,
                                         "provider_usd": d.provider_usd, "difference_usd": d.difference_usd}
                                        for d in diffs]}
        if not as_json:
            con.print(f"{provider} {t0:%Y-%m-%d}..{t1:%Y-%m-%d}: provider total ${rec.provider_total_usd:,.4f} = "
                      f"allocated to jobs ${rec.allocated_usd:,.4f} + unallocated ${rec.unallocated_usd:,.4f} "
                      f"(idle lines ${rec.idle_usd:,.4f}, not in the ledger ${rec.unexplained_usd:,.4f})"
                      + (f"; {rec.unpriced} ledger line(s) unpriced (flagged)" if rec.unpriced else ""))
            if diffs:
                tab = Table(title=f"{len(diffs)} resource(s) where the ledger and the bill differ")
                for col in ("resource", "ledger USD", "provider USD", "difference USD"):
                    tab.add_column(col)
                for d in diffs:
                    tab.add_row(escape(d.resource), f"{d.ledger_usd:.4f}", f"{d.provider_usd:.4f}",
                                f"{d.difference_usd:+.4f}")
                con.print(tab)
    if pool is not None:
        try:
            e = reconcile_energy(records, pool, metered_kwh, t0, t1)
        except ValueError as exc:
            fail(str(exc), code=2)
        out["energy"] = {"pool": pool, "metered_kwh": e.metered_kwh, "allocated_kwh": e.allocated_kwh,
                         "unallocated_kwh": e.unallocated_kwh, "unknown_lines": e.unknown_lines}
        bad = bad or e.unallocated_kwh < 0
        if not as_json:
            con.print(f"pool {pool}: metered {e.metered_kwh:,.3f} kWh = allocated to jobs {e.allocated_kwh:,.3f} kWh"
                      f" + unallocated (idle, overhead) {e.unallocated_kwh:,.3f} kWh"
                      + (f"; {e.unknown_lines} energy line(s) unknown (flagged)" if e.unknown_lines else "")
                      + ("  [the ledger allocated more than was metered]" if e.unallocated_kwh < 0 else ""))
    if as_json:
        echo_json(out)
    if bad:
        raise typer.Exit(1)


def _period(start: Optional[str], end: Optional[str]) -> tuple[datetime, datetime]:
    """``[--from, --to)`` as aware UTC; either left out defaults to this calendar month's (UTC) edge, as the finance
    page (:func:`broker.service.budgets.month_bounds`). Exit 2 naming the option for a bad one."""
    from broker.service.budgets import month_bounds

    month = month_bounds(datetime.now(timezone.utc))
    t0 = parse_day(start, "--from") if start is not None else month[0]
    t1 = parse_day(end, "--to") if end is not None else month[1]
    if t1 <= t0:
        fail(f"--to={end or t1.isoformat()!r}: not after --from={start or t0.isoformat()!r}", code=2)
    return t0, t1


_BY = SUMMARY_DIMENSIONS  # team, project, provider, region, pool, line (the unallocated lines apart), day


_FROM_HELP = "Period start, UTC (YYYY-MM-DD or ISO instant); default: this month's first day (UTC)."
_TO_HELP = "Period end (exclusive), UTC; default: next month's first day (UTC)."


@cost_app.command("report")
def report_cmd(start: Optional[str] = typer.Option(None, "--from", help=_FROM_HELP),
               end: Optional[str] = typer.Option(None, "--to", help=_TO_HELP),
               by: str = typer.Option("team", "--by", help="Group by: " + " | ".join(_BY) + "."),
               team: Optional[str] = typer.Option(None, "--team", help="Only this team (default: yours; admins: all)."),
               url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """USD, GPU-hours, kWh and kgCO2e of the ledger lines that start in [--from, --to) (default: this month, UTC),
    grouped --by. Each column shows its figures with the same decimals, enough for its smallest one to keep 2
    significant digits (broker.money)."""
    if by not in _BY:
        fail(f"--by={by!r}: not one of {', '.join(_BY)}", code=2)
    t0, t1 = _period(start, end)
    c = client(url, token)
    out = call(c, c.usage_summary, t0, t1, by=by, team=team)
    if as_json:
        echo_json(out)
        return
    tab = Table(title=f"Usage {t0:%Y-%m-%d %H:%M}..{t1:%Y-%m-%d %H:%M} UTC by {by}"
                      + (f" (team {escape(out.team)})" if out.team else " (all teams)"))
    for col in (by, "cost USD", "GPU-hours", "kWh", "kgCO2e", "lines", "estimated", "unpriced"):
        tab.add_column(col, justify="left" if col == by else "right")

    figures = ("cost_usd", "gpu_hours", "energy_kwh", "carbon_kg")
    every = [*out.groups, out.total]
    places = {f: decimals_for(getattr(g, f) for g in every) for f in figures}  # one number of decimals a column

    def row(key: str, g) -> None:
        tab.add_row(escape(key), *(figure_text(getattr(g, f), places[f]) for f in figures), str(g.lines),
                    str(g.estimated_lines), str(g.unpriced_lines))

    for g in out.groups:
        row(g.key if g.key is not None else "-", g)
    tab.add_section()
    row("total", out.total)
    current_console().print(tab)
    if out.total.unpriced_lines or out.total.unknown_energy_lines or out.total.unknown_carbon_lines:
        stderr.print(f"note: {out.total.unpriced_lines} line(s) without a known cost, "
                     f"{out.total.unknown_energy_lines} without kWh, {out.total.unknown_carbon_lines} without kgCO2e "
                     f"are left out of the sums (flagged in the ledger, never counted as 0)")


@cost_app.command("export")
def export_cmd(focus: Path = typer.Option(..., "--focus", help="Write a FOCUS 1.2 CSV to this file."),
               start: Optional[str] = typer.Option(None, "--from", help=_FROM_HELP),
               end: Optional[str] = typer.Option(None, "--to", help=_TO_HELP),
               team: Optional[str] = typer.Option(None, "--team", help="Only this team (default: yours; admins: all)."),
               url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt) -> None:
    """The ledger lines that start in [--from, --to) (default: this month, UTC) as a FOCUS 1.2 CSV (broker.focus)."""
    t0, t1 = _period(start, end)
    if focus.is_dir():
        fail(f"--focus={str(focus)!r}: is a directory", code=2)
    if not focus.parent.is_dir():
        fail(f"--focus={str(focus)!r}: no such directory {str(focus.parent)!r}", code=2)
    c = client(url, token)
    text, skipped = call(c, c.usage_focus, t0, t1, team=team)
    try:
        focus.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(f"--focus={str(focus)!r}: cannot write ({e.strerror or e})", code=2)
    import csv
    import io

    rows = max(0, sum(1 for _ in csv.reader(io.StringIO(text))) - 1)
    stderr.print(f"wrote {rows} FOCUS 1.2 row(s) to {escape(str(focus))}"
                 + (f"; {skipped} ledger line(s) without a known cost left out (flagged in the ledger)"
                    if skipped else ""))


def register(app: typer.Typer) -> None:
    """Add ``fedbroker cost`` to the main CLI."""
    app.add_typer(cost_app, name="cost")
