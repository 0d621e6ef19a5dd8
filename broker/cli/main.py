"""The ``fedbroker`` command line.

Commands:

* ``fedbroker simulate`` — replay a job trace under one or more policies on the
  bundled real prices and carbon data; prints a comparison table and writes
  ``OUT/results.json``, ``OUT/report.html`` and one ``OUT/jobs-<policy>.csv`` per
  policy (one row per job; columns and units in
  :data:`broker.sim.report.JOB_CSV_COLUMNS`: job_id, team, gpus, status, submit,
  start, end (UTC), placement (pool or offer id), market, dollars_usd,
  amortised_usd, energy_kwh, carbon_kg, wait_s, deadline (UTC), deadline_met, starts).
* ``fedbroker offers`` — list the cloud and on-prem options for one request,
  cheapest and cleanest first, with $/hour, total $, kWh and kgCO2e over the run.
* ``fedbroker cost reconcile`` — the usage ledger against a provider's bill or a pool's meter
  (:mod:`broker.cli.cost`).
* ``fedbroker pools`` — the cluster file's pools: kind, health, free GPUs by type (:mod:`broker.cli.pools`).

Bad arguments exit with status 2 and a message naming the option and value.
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple, Optional

import typer
from rich.markup import escape

from broker.cli.console import current_console, echo_json, fail, stderr
from broker.model import PLAN_INTERVAL_S
from broker.planner.core import POLICY_NAMES, PendingJob, PlannerContext
from broker.planner.costs import score
from broker.utc import iso_minutes

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="fedbroker: hybrid-cloud, energy-aware federation broker for GPU training jobs.")


def _fail(msg: str) -> None:
    """Exit 2 (bad usage) with ``error: msg``."""
    fail(msg, 2)


def _check_number(option: str, value: float, *, minimum: float = 0.0, strict: bool = False) -> None:
    """Exit 2 unless ``value`` is finite and >= ``minimum`` (> with ``strict``), naming the option."""
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        _fail(f"{option}={value}: must be a finite number {'>' if strict else '>='} {minimum:g}")


def _prepare_out(out: Path) -> None:
    """Create ``out`` and make sure it is writable before a long run (exit 2 otherwise)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fedbroker-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        _fail(f"--out={str(out)!r}: cannot write there ({e.strerror or e})")


def _parse_time(value: str, option: str) -> datetime:
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        _fail(f"{option}={value!r}: not an ISO 8601 date/time (e.g. 2023-09-04 or 2023-09-04T12:00:00+00:00)")
    try:
        (t if t.tzinfo is None else t.astimezone(timezone.utc)).replace(tzinfo=timezone.utc).timestamp()
    except (OverflowError, ValueError):  # year 1 with an offset: UTC cannot hold it (a traceback, once)
        _fail(f"{option}={value!r}: outside the years 1-9999 in UTC")
    return t


@app.command()
def simulate(
    trace: str = typer.Option("philly", help="'philly' (bundled) or a CSV path in the generic schema."),
    policy: str = typer.Option(",".join(POLICY_NAMES), help="Comma-separated policies."),
    jobs: Optional[int] = typer.Option(None, help="Replay only the first N jobs (submit order)."),
    start: Optional[str] = typer.Option(None, help="Shift the trace (by whole weeks) to start on/after this date; "
                                                   "data covers 2023-2024. Philly default: 2023-09-04."),
    cluster: Optional[Path] = typer.Option(None, help="On-prem cluster YAML/JSON (default: bundled Toronto pool)."),
    seed: int = typer.Option(0, help="Seed of the spot-trace phases."),
    out: Path = typer.Option(Path("out/sim"), help="Output directory for results.json, report.html and jobs-<policy>.csv."),
    carbon_price: float = typer.Option(190.0, help="Carbon price in the objective, USD per tCO2e."),
    value_of_time: float = typer.Option(0.002, help="Value of waiting, USD per GPU-hour (normal priority)."),
    slack_factor: float = typer.Option(1.0, help="Deadline slack = max(slack_factor x duration, min_slack_h)."),
    min_slack_h: float = typer.Option(12.0, help="Minimum deadline slack, hours."),
    step: float = typer.Option(PLAN_INTERVAL_S, help="Planning step, seconds: events (arrivals, completions, "
                                                     "interruptions, reviews, wake-ups, the signal hour of an "
                                                     "undecided job) are coalesced to the next multiple of it and "
                                                     "the planner runs once per step with news, never between. "
                                                     "Default: the live broker's beat interval (plan_interval_s)."),
    no_cloud: bool = typer.Option(False, "--no-cloud", help="No cloud offers: every policy places on-prem only."),
    market: str = typer.Option("any", help="Cloud offers of this market only: spot, on_demand or any."),
    bound: bool = typer.Option(False, "--bound", help="Also solve the LP lower bound (broker/sim/bound.py) and give "
                                                      "each policy's cost and score ratio to it (time steps of "
                                                      "6 h: a little weaker, much faster than hourly)."),
    sweep_carbon_price: Optional[str] = typer.Option(
        None, "--sweep-carbon-price",
        help="Comma-separated carbon prices, USD per tCO2e (e.g. 0,190,500,1000,2000): re-run the policies whose "
             "decisions use the carbon price (federated) at each, re-price the single run of the others, and with "
             "--bound solve the bound's score LP at each: the cost-carbon frontier (results.json 'frontier', the "
             "report's frontier plot and ratio table)."),
    signals: Optional[Path] = typer.Option(
        None, "--signals", help="Folder of your own hourly carbon and price CSVs (columns zone, hour_utc, value, "
                                "unit, quality; see pricing/user_signals.py) replayed in place of the bundled "
                                "series of the zones they give; short gaps interpolated, long ones filled from the "
                                "bundle, then a conservative value."),
    forecast: str = typer.Option("perfect", help="What the planner knows of future prices and carbon: 'perfect' "
                                                 "(the measured series) or a forecast model issued each UTC hour "
                                                 "from the hours before it: naive_day, naive_week, blend "
                                                 "(pricing/forecast.py). Costs and carbon are always the measured "
                                                 "ones: the gap to 'perfect' is the regret (docs/FORECASTS.md)."),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), help="Processes for the policy runs and LP solves "
                                                                  "(1: all in this process; the runs' wall-clock "
                                                                  "timings include any wait for a core)."),
) -> None:
    """Replay a job trace under the given policies and compare them.

    Writes OUT/results.json, OUT/report.html, OUT/usage-POLICY.csv.gz (the usage records, as the live ledger
    writes them: one per attempt, rank and resource line; columns broker.usage.USAGE_CSV_COLUMNS) and
    OUT/jobs-POLICY.csv: one row per job with
    job_id, team, gpus, status (completed/rejected/unfinished), submit, start, end (UTC ISO 8601),
    placement (pool name or cloud offer id), market (spot/on_demand, empty on-prem),
    dollars_usd (cloud bill + on-prem electricity, USD), amortised_usd (on-prem capital, USD),
    energy_kwh (kWh), carbon_kg (kgCO2e), wait_s (s), deadline (UTC), deadline_met, starts.

    With --bound, results.json has "bound" and each policy's ratios to it; with --sweep-carbon-price it has
    "frontier" (per carbon price: the bound's cost, carbon and score, each policy's cost, carbon, score and score
    ratio to the bound) and report.html the frontier plot. The runs and LP solves are independent tasks, run in
    --workers processes (each loads the inputs again: up to ~0.5 GB each on the whole Philly trace).
    """
    from broker.planner.core import PlannerConfig
    from broker.sim.bound import CLI_BLOCK_H
    from broker.sim.report import write_job_csv, write_report
    from broker.sim.sweep import RunSpec, Task, run_tasks, usage_file, uses_carbon_price

    policies, prices, forecast, offer_market = _simulate_options(
        policy, jobs, workers, sweep_carbon_price, forecast, carbon_price, value_of_time, slack_factor, min_slack_h,
        step, market)
    start_dt = _parse_time(start, "--start") if start else None
    _prepare_out(out)
    scen, tr = _simulate_inputs(trace, cluster, signals, start_dt, jobs, slack_factor, min_slack_h)
    pc = PlannerConfig(carbon_price_usd_per_tonne=carbon_price, value_of_time_usd_per_gpu_hour=value_of_time,
                       cloud_enabled=not no_cloud)
    spec = RunSpec(trace=trace, cluster=str(cluster) if cluster else None, start=start_dt, limit=jobs,
                   slack_factor=slack_factor, min_slack_s=min_slack_h * 3600.0, planner=pc.model_dump(), seed=seed,
                   step_s=step, market=offer_market, block_h=CLI_BLOCK_H, signals=str(signals) if signals else None,
                   usage_dir=str(out), forecast=forecast)
    # the longest first (workers take tasks in order): the carbon-price runs, the others' runs, then the LPs
    sens = [p for p in policies if uses_carbon_price(p)]
    tasks = [Task("run", carbon_price, p, full=True) for p in sens]
    tasks += [Task("run", cp, p) for cp in prices if cp != carbon_price for p in sens]
    tasks += [Task("run", carbon_price, p, full=True) for p in policies if p not in sens]
    if bound:
        tasks += [Task("bound", carbon_price)] + [Task("score", cp) for cp in prices if cp != carbon_price]
    n_proc = min(workers, len(tasks))
    others = [p for p in policies if p not in sens]
    current_console().print(f"{len(tasks)} tasks (policy runs{' and LP solves' if bound else ''}) in {n_proc} "
                            f"process{'es' if n_proc > 1 else ''}"
                            + (f"; {', '.join(others)} {'ignores' if len(others) == 1 else 'ignore'} the carbon "
                               f"price: one run{'' if len(others) == 1 else ' each'} serves every price"
                               if prices and others else ""))

    def done(task: Task, result, wall_s: float) -> None:
        if isinstance(result, RuntimeError):
            current_console().print(f"{task.label()}: no optimum ({wall_s:.1f} s)")
        else:
            current_console().print(f"{task.label()}: done in {wall_s:.1f} s"
                                    + (f" ({len(tr.jobs):,} jobs)" if task.kind == "run" else ""))

    got = dict(zip(tasks, run_tasks(tasks, spec, workers, tr, scen, on_done=done)))
    runs = {p: got[Task("run", carbon_price, p, full=True)] for p in policies}
    bound_doc, frontier = _bound_and_frontier(got, tasks, runs, policies, sens, prices, carbon_price, bound, pc)
    _print_runs(runs, frontier)
    meta = {"trace": trace, "jobs": len(tr.jobs), "jobs_limit": jobs, "trace_skipped": tr.skipped,
            "start": iso_minutes(tr.jobs[0].submit_s), "shift_s": tr.shift_s, "cluster": str(cluster or "bundled default"),
            "seed": seed, "step_s": step, "market": market.strip().lower(), "no_cloud": no_cloud,
            "carbon_price_usd_per_t": carbon_price, "value_of_time_usd_per_gpu_hour": value_of_time,
            "slack_factor": slack_factor, "min_slack_h": min_slack_h, "policies": policies,
            "sweep_carbon_price_usd_per_t": prices or None, "bound": bound,
            "pools": [p.model_dump() for p in scen.pools], "offers": len(scen.offers),
            "offers_skipped": scen.offers_skipped, "planner": pc.model_dump(),
            "signals": str(signals) if signals else "bundled", "forecast": forecast,
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    js, html = write_report(runs, out, meta, bound_doc, frontier)
    csvs = [write_job_csv(r, out / f"jobs-{name}.csv") for name, r in runs.items()]
    usage = [out / usage_file(name) for name in runs]  # written by the process that ran each policy
    current_console().print(f"results: [bold]{js}[/bold]\nreport:  [bold]{html}[/bold]\n"
                            f"per job: [bold]{', '.join(str(c) for c in csvs)}[/bold]\n"
                            f"usage:   [bold]{', '.join(str(c) for c in usage)}[/bold]")


def _simulate_options(policy: str, jobs: Optional[int], workers: int, sweep_carbon_price: Optional[str],
                      forecast: str, carbon_price: float, value_of_time: float, slack_factor: float,
                      min_slack_h: float, step: float, market: str):
    """``simulate``'s options checked, in this order (exit 2 naming the first bad one): ``(policies, carbon
    prices of the sweep, forecast, offer market)``."""
    from broker.model import Market
    from pricing.forecast import SIM_FORECASTS

    policies = list(dict.fromkeys(p.strip().lower() for p in policy.split(",") if p.strip()))
    bad = [p for p in policies if p not in POLICY_NAMES]
    if not policies or bad:
        _fail(f"--policy={policy!r}: unknown {bad or 'empty'}; choose from {', '.join(POLICY_NAMES)}")
    if jobs is not None and jobs < 1:
        _fail(f"--jobs={jobs}: must be >= 1")
    if workers < 1:
        _fail(f"--workers={workers}: must be >= 1")
    prices = _parse_prices(sweep_carbon_price) if sweep_carbon_price is not None else []
    forecast = forecast.strip().lower()
    if forecast not in SIM_FORECASTS:
        _fail(f"--forecast={forecast!r}: choose from {', '.join(SIM_FORECASTS)}")
    for opt, v in (("--carbon-price", carbon_price), ("--value-of-time", value_of_time),
                   ("--slack-factor", slack_factor), ("--min-slack-h", min_slack_h)):
        _check_number(opt, v)
    _check_number("--step", step, strict=True)
    markets = {"any": None, "spot": Market.spot, "on_demand": Market.on_demand}
    if market.strip().lower() not in markets:
        _fail(f"--market={market!r}: choose from {', '.join(markets)}")
    return policies, prices, forecast, markets[market.strip().lower()]


def _simulate_inputs(trace: str, cluster: Optional[Path], signals: Optional[Path], start_dt: Optional[datetime],
                     jobs: Optional[int], slack_factor: float, min_slack_h: float):
    """``simulate``'s ``(scenario, trace)``, each announced in a line (exit 2 for a file that cannot be read,
    an empty trace or one outside the signal data)."""
    from broker.sim.scenario import load_scenario
    from broker.sim.traces import TraceError, load_generic_csv, load_philly

    try:
        scen = load_scenario(cluster, signals_dir=signals)
    except (ValueError, OSError) as e:
        _fail(str(e))
    if scen.user_signals is not None:
        current_console().print(f"signals from {signals}:\n  " + "\n  ".join(scen.user_signals.summary()))
    site_tz = scen.pools[0].timezone
    kw = dict(start=start_dt, limit=jobs, slack_factor=slack_factor, min_slack_s=min_slack_h * 3600.0)
    try:
        if trace == "philly":
            tr = load_philly(site_tz=site_tz, **kw)
        else:
            tr = load_generic_csv(Path(trace), **kw)
    except (TraceError, OSError) as e:
        _fail(str(e))
    if not tr.jobs:
        _fail(f"--trace={trace!r}: no valid job (skipped: {tr.skipped})")
    _check_coverage(tr, scen)
    current_console().print(f"trace [bold]{trace}[/bold]: {len(tr.jobs):,} jobs from "
                  f"{iso_minutes(tr.jobs[0].submit_s)} to {iso_minutes(tr.jobs[-1].submit_s)}"
                  + (f", {tr.total_skipped:,} rows skipped {dict(tr.skipped)}" if tr.total_skipped else ""))
    current_console().print(f"on-prem: {', '.join(f'{p.name} ({p.total_gpus} GPUs, {p.carbon_zone})' for p in scen.pools)}; "
                  f"cloud: {len(scen.offers):,} offers")
    return scen, tr


def _bound_and_frontier(got: dict, tasks: list, runs: dict, policies: list[str], sens: list[str],
                        prices: list[float], carbon_price: float, bound: bool, pc):
    """``simulate``'s ``(bound document, frontier)`` from the finished tasks ``got``: with ``--bound`` the LP
    bound (printed; each run's metrics get their ratios to it) or a warning when it has no optimum; with
    ``--sweep-carbon-price`` the frontier entries. Either is None when not asked for (or no bound)."""
    from broker.sim.bound import FrontierPoint, ratios_to_bound
    from broker.sim.sweep import Task, frontier_entries

    bound_doc = lb = None
    points: dict[float, FrontierPoint] = {}
    if bound:
        parts = [got[t] for t in tasks if t.kind in ("bound", "score")]
        err = next((x for x in parts if isinstance(x, RuntimeError)), None)
        if err is not None:  # infeasible: no schedule meets every deadline; the runs are still written
            current_console().print(f"[yellow]warning:[/yellow] no bound: {err}")
        else:
            lb, points[carbon_price] = got[Task("bound", carbon_price)]
            points.update((t.carbon_price_usd_per_t, got[t]) for t in tasks if t.kind == "score")
    if lb is not None:
        for r in runs.values():
            r.metrics.update(ratios_to_bound(r.metrics, lb, pc))
        bound_doc = lb.as_json()
        current_console().print(f"LP lower bound: cost ${lb.cost_usd:,.0f}, carbon {lb.carbon_kg:,.0f} kg, score "
                                f"${lb.score_usd:,.0f} at ${lb.carbon_price_usd_per_t:,.0f}/t ({lb.block_h}-h steps, "
                                f"{lb.variables:,} variables, {lb.constraints:,} constraints, {lb.solve_s:.1f} s)"
                                + (f"; left out: {lb.excluded}" if lb.excluded else ""))
    frontier = None
    if prices:
        by_price = {p: {cp: (runs[p].metrics if p not in sens or cp == carbon_price
                             else got[Task("run", cp, p)]) for cp in prices} for p in policies}
        frontier = frontier_entries(prices, by_price, points or None, pc)
    return bound_doc, frontier


def _print_runs(runs: dict, frontier) -> None:
    """``simulate``'s summary: the comparison table, the frontier table, each policy's chargeback and a warning
    for job-hours outside the signal data."""
    from broker.sim.report import chargeback_summary, comparison_table, frontier_table

    current_console().print(comparison_table(runs))
    if frontier:
        current_console().print(frontier_table(frontier))
    for name, r in runs.items():
        current_console().print(escape(chargeback_summary(name, r.chargeback)))
    for name, r in runs.items():
        miss = r.metrics.get("missing_signal_hours", 0.0)
        if miss:
            current_console().print(f"[yellow]warning:[/yellow] {name}: {miss:,.0f} job-hours ran outside the bundled "
                          "price/carbon data; their energy cost and carbon are not counted (see missing_signal_hours)")


def _parse_prices(text: str) -> list[float]:
    """``--sweep-carbon-price`` as ascending distinct USD per tCO2e (exit 2 naming the bad item)."""
    out = set()
    for item in text.split(","):
        try:
            v = float(item)
        except ValueError:
            _fail(f"--sweep-carbon-price={text!r}: {item.strip()!r} is not a number (USD per tCO2e)")
        if not math.isfinite(v) or v < 0:
            _fail(f"--sweep-carbon-price={text!r}: {item.strip()!r} must be a finite number >= 0 (USD per tCO2e)")
        out.add(v)
    return sorted(out)


def _check_coverage(tr, scen) -> None:
    """Fail early if the trace starts outside the bundled signal coverage."""
    sig = scen.signals
    c = sig.carbon(scen.pools[0].carbon_zone)
    t0, t1 = tr.jobs[0].submit_s, tr.jobs[-1].submit_s
    if t0 < c.start_s or t1 > c.end_s:
        _fail(f"the trace spans {iso_minutes(t0)}..{iso_minutes(t1)} but the carbon data of zone {c.zone} covers "
              f"{iso_minutes(c.start_s)}..{iso_minutes(c.end_s)}; pass a --start (e.g. {iso_minutes(c.start_s)[:10]}) so that "
              "the whole trace falls inside")


@app.command()
def offers(
    gpu: Optional[str] = typer.Option(None, help="GPU type, e.g. A100, V100, H100, L4 (default: any)."),
    count: int = typer.Option(1, help="GPUs per node."),
    nodes: int = typer.Option(1, help="Nodes (gang size)."),
    spot: bool = typer.Option(True, "--spot/--no-spot", help="Include spot offers."),
    hours: float = typer.Option(1.0, help="Hours of runtime on the requested --gpu type (H hours on that GPU type, "
                                           "not V100-hours of work; without --gpu: hours on a V100, scaled by each "
                                           "GPU's relative throughput)."),
    start: str = typer.Option("now", help="Start instant (ISO 8601, UTC if no offset), or 'now' (the default). "
                                           "Outside the bundled 2023-24 history it is priced as the live broker "
                                           "prices it: that history replayed forward by whole weeks."),
    region: Optional[str] = typer.Option(None, help="Only this cloud region."),
    top: int = typer.Option(20, help="Rows to print."),
    sort: str = typer.Option("cost", help="Sort by 'cost', 'carbon' or 'score'."),
    carbon_price: float = typer.Option(190.0, help="USD per tCO2e for the score."),
    cluster: Optional[Path] = typer.Option(None, help="On-prem cluster file (default: bundled)."),
    as_json: bool = typer.Option(False, "--json", help="Print the ranked options as JSON (all of them; --top is "
                                                      "ignored): provider, region, zone, instance_type, gpu_type, "
                                                      "market, instances, usd_per_hour (one instance), hours, "
                                                      "total_usd, kwh, kg_co2e (null: no carbon data), "
                                                      "carbon_estimated (true: the region's carbon figure is an "
                                                      "annual figure or another year's hours), signals (where the "
                                                      "prices and carbon came from)."),
) -> None:
    """List the options for one request, cheapest (or cleanest) first."""
    from rich.table import Table

    from broker.planner.core import PlannerConfig
    from broker.sim.scenario import load_scenario
    from pricing.power import UnknownGpuTypeError, canonical_gpu_type

    for opt, v in (("--count", count), ("--nodes", nodes), ("--top", top)):
        if v < 1:
            _fail(f"{opt}={v}: must be >= 1")
    _check_number("--hours", hours, strict=True)
    _check_number("--carbon-price", carbon_price)
    if hours > 366 * 24:
        _fail(f"--hours={hours}: at most one year (8,784 h) of runtime can be costed")
    if sort not in ("cost", "carbon", "score"):
        _fail(f"--sort={sort!r}: choose cost, carbon or score")
    gtypes = None
    if gpu:
        try:
            gtypes = frozenset([canonical_gpu_type(gpu)])
        except UnknownGpuTypeError as e:
            _fail(f"--gpu={gpu!r}: {e}")
    from broker.service.live import ReplayedSignals, history_bounds, live_replay_offset_s, replay_note

    t = datetime.now(timezone.utc).replace(microsecond=0) if start.strip().lower() == "now" else \
        _parse_time(start, "--start")
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    now = t.timestamp()
    try:
        scen = load_scenario(cluster)
    except (ValueError, OSError) as e:
        _fail(str(e))
    config = PlannerConfig(carbon_price_usd_per_tonne=carbon_price)
    signals, source = scen.signals, "bundled 2023-24 history, as recorded"
    h0, h1 = history_bounds(scen.signals)
    if now < h0:
        _fail(f"--start={iso_minutes(now)}: outside the bundled price/carbon data (it starts at {iso_minutes(h0)}; "
              f"it holds {iso_minutes(h0)}..{iso_minutes(h1)})")
    if now >= h1:  # after the history (today): the live broker's series, the history shifted forward by whole weeks
        try:
            offset = live_replay_offset_s(h0, h1, now, max(config.horizon_s, hours * 3600.0))
        except ValueError:
            _fail(f"--hours={hours:g}: longer than the bundled price/carbon data can replay ({iso_minutes(h0)}..{iso_minutes(h1)})")
        signals, source = ReplayedSignals(scen.signals, offset), replay_note(offset, "as the live broker prices it "
                                                                                     "without live sources")
    ctx = PlannerContext(config, scen.pools, scen.offers, signals, scen.gpus)
    rows = ranked_options(ctx, request_job(ctx, gtypes, count, nodes, spot, hours, now, region), now,
                          sort, carbon_price, cloud_only=bool(region))
    if not rows:
        _fail(f"no offer or pool holds {nodes} x {count} {gpu or 'any'} GPUs"
              + (f" in region {region!r}" if region else "") + ("" if spot else " on-demand"))
    if any(math.isnan(r.carbon_kg) for r in rows):  # on stderr: --json keeps stdout pure JSON
        stderr.print("[yellow]note:[/yellow] some options run past the bundled carbon data (kgCO2e n/a)"
                     + ("; they are listed last" if sort != "cost" else ""))
    if as_json:  # each row names where its prices and carbon came from (stdout stays pure JSON)
        echo_json([{**option_json(r, nodes), "signals": source} for r in rows])
        return
    what = f"{hours:g} h on {gtypes and next(iter(gtypes))}" if gtypes else f"{hours:g} V100-hours"
    tab = Table(title=f"{nodes} x {count} {gpu or 'any GPU'}, {what} from {iso_minutes(now)}")
    for c in ("provider", "region", "zone", "instance", "gpu", "market", "$/hour", "runtime h", "total $", "kWh", "kgCO2e"):
        tab.add_column(c, justify="right" if c in ("$/hour", "runtime h", "total $", "kWh", "kgCO2e") else "left")
    for r in rows[:top]:
        kg = "n/a" if math.isnan(r.carbon_kg) else f"{r.carbon_kg:.3f}" + (ESTIMATE_MARK if r.carbon_estimated else "")
        tab.add_row(*r[:6], f"{r.usd_per_hour:.3f}", f"{r.runtime_s / 3600:.2f}", f"{r.dollars_usd:.2f}",
                    f"{r.energy_kwh:.2f}", kg)
    current_console().print(tab)
    current_console().print(f"{len(rows)} options; on-prem $ include the amortised GPU-hour; cloud $ include expected spot rework.")
    current_console().print(f"prices and carbon from {iso_minutes(now)}: {source}", highlight=False)
    if any(r.carbon_estimated for r in rows[:top]):
        current_console().print(f"{ESTIMATE_MARK} carbon estimated: the region has no hourly grid data for the "
                                "window (annual figure, or another year's hours).")


def request_job(ctx: PlannerContext, gpu_types: frozenset[str] | None, count: int, nodes: int, spot: bool,
                hours: float, start_s: float, region: str | None = None) -> PendingJob:
    """The pending job of one ``offers`` request: ``nodes`` x ``count`` GPUs of ``gpu_types`` (None: any) for
    ``hours`` hours on the requested GPU type (without a type: hours on the reference V100), from ``start_s``
    (POSIX s, UTC); spot allowed if ``spot``; only ``region`` if given."""
    # work in reference (V100) GPU-seconds: H hours on the requested type are H x its relative throughput
    work_s = hours * 3600.0 * (ctx.gpus.throughput[next(iter(gpu_types))] if gpu_types else 1.0)
    return PendingJob(job_id="query", team="default", priority=1, submit_s=start_s, deadline_s=math.inf,
                      earliest_s=start_s, work_s=work_s, gpus_per_node=count, nodes=nodes, gpu_types=gpu_types,
                      spot_ok=spot, regions=frozenset([region]) if region else None)


def ranked_options(ctx: PlannerContext, job: PendingJob, start_s: float, sort: str = "cost",
                   carbon_price: float = 190.0, cloud_only: bool = False) -> list[OptionRow]:
    """The answer of ``fedbroker offers``: :func:`option_rows` ranked by ``sort`` (``cost``: total USD, then
    kgCO2e, rows without carbon data after their equals; ``carbon`` and ``score`` at ``carbon_price`` USD/tCO2e:
    rows without carbon data last, as they cannot be ranked)."""
    rows = option_rows(ctx, job, start_s, cloud_only=cloud_only)
    # the score of a query prices carbon only: it has no priority, so no value of time for the wait
    key = {"cost": lambda r: (r.dollars_usd, r.carbon_kg), "carbon": lambda r: (r.carbon_kg, r.dollars_usd),
           "score": lambda r: (score(r.dollars_usd, r.carbon_kg, 0.0, 0.0, carbon_price), r.dollars_usd)}[sort]
    if sort == "cost":
        rows.sort(key=lambda r: (r.dollars_usd, math.isnan(r.carbon_kg), r.carbon_kg))
    else:
        rows.sort(key=lambda r: (math.isnan(r.carbon_kg),) + key(r))
    return rows


#: Mark after a kgCO2e figure in the ``offers`` table whose carbon figure is an estimate.
ESTIMATE_MARK = "*"


class OptionRow(NamedTuple):
    """One row of ``fedbroker offers``: where, what, and its cost over the whole run.

    ``carbon_estimated``: the carbon figure is an estimate (:func:`pricing.carbon.carbon_estimated`)."""

    provider: str
    region: str
    zone: str
    instance: str
    gpu_type: str
    market: str
    usd_per_hour: float
    runtime_s: float
    dollars_usd: float
    energy_kwh: float
    carbon_kg: float
    carbon_estimated: bool = False


def option_json(r: OptionRow, instances: int) -> dict:
    """One ``offers --json`` item: ``usd_per_hour`` is one instance's (on-prem: one node's share of the pool),
    ``hours`` the runtime (spot: with the expected rework), ``total_usd``/``kwh``/``kg_co2e`` the whole run's
    (``kg_co2e`` None where the window has no carbon data), ``carbon_estimated`` whether the carbon figure is
    an estimate."""
    return {"provider": r.provider, "region": r.region, "zone": r.zone, "instance_type": r.instance,
            "gpu_type": r.gpu_type, "market": r.market, "instances": instances,
            "usd_per_hour": r.usd_per_hour / instances, "hours": r.runtime_s / 3600.0, "total_usd": r.dollars_usd,
            "kwh": r.energy_kwh, "kg_co2e": None if math.isnan(r.carbon_kg) else r.carbon_kg,
            "carbon_estimated": bool(r.carbon_estimated)}


def _zone_estimated(zone: str) -> bool:
    """:func:`pricing.carbon.carbon_estimated` of a pool's zone; False for a zone whose series the caller
    supplied itself (not a bundled zone: not our estimate)."""
    from pricing.carbon import carbon_estimated
    from pricing.errors import UnknownZoneError

    try:
        return carbon_estimated(zone)
    except UnknownZoneError:
        return False


def option_rows(ctx: PlannerContext, job: PendingJob, start_s: float, cloud_only: bool = False) -> list[OptionRow]:
    """Every cloud offer and on-prem pool GPU type that can hold ``job``, costed from ``start_s``.

    Cloud rows: :meth:`PlannerContext.cloud_estimates` (expected spot rework, the bill from the
    create call). On-prem rows (unless ``cloud_only``): :meth:`PlannerContext.onprem_estimate`
    with the amortised capital in the USD and the USD per hour. The same cost model as the
    planner's explain records and the simulator's accounting (:mod:`broker.planner.costs`).
    """
    rows = []
    idx = ctx.compatible_offers(job)
    if idx.size:
        est = ctx.cloud_estimates(job, idx, start_s)
        for k, o in enumerate(idx):
            off = ctx.offers[o]
            rows.append(OptionRow(off.provider, off.region, off.zone, off.instance_type, off.gpu_type, off.market.value,
                                  float(est.usd_per_hour[k]), float(est.runtime_s[k]), float(est.dollars_usd[k]),
                                  float(est.energy_kwh[k]), float(est.carbon_kg[k]), off.carbon_estimated))
    if cloud_only:
        return rows
    for p, pool in enumerate(ctx.pools):
        for gt in ctx.pool_types(p):
            if job.gpu_types is not None and gt not in job.gpu_types:
                continue
            if sum(1 for n in pool.nodes if n.gpu_type == gt and n.gpu_count >= job.gpus_per_node) < job.nodes:
                continue
            r, e_cost, amort, energy, carbon = ctx.onprem_estimate(p, gt, job, start_s)
            dollars = e_cost + amort
            rows.append(OptionRow("onprem", pool.name, pool.carbon_zone, "-", gt, "owned", dollars / (r / 3600.0), r,
                                  dollars, energy, carbon, _zone_estimated(pool.carbon_zone)))
    return rows


from broker.cli.serve import register as _register_serve  # noqa: E402

_register_serve(app)
from broker.cli.jobs import register as _register_jobs; _register_jobs(app)
from broker.cli.schedules import register as _register_schedules; _register_schedules(app)
from broker.cli.tokens import register as _register_tokens; _register_tokens(app)
from broker.cli.nodes import register as _register_nodes; _register_nodes(app)
from broker.cli.cloud import register as _register_cloud; _register_cloud(app)
from broker.cli.cost import register as _register_cost; _register_cost(app)
from broker.cli.budgets import register as _register_budgets; _register_budgets(app)
from broker.cli.pools import register as _register_pools; _register_pools(app)
from broker.cli.signals import register as _register_signals; _register_signals(app)


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
