"""Benchmark whole-trace simulation throughput: ``broker.sim.simulator.simulate`` on the Philly trace.

For each policy this replays the first ``--jobs`` jobs of the bundled Philly
trace (default: all 82,247) on the bundled scenario (``load_scenario()``: the
default Toronto pool of 48 x 8 V100, the ~1,000 bundled cloud offers, real
2023 price/carbon series and spot traces), exactly as ``fedbroker simulate``
does, and reports:

* ``wall s``: wall time of ``simulate()`` (scenario and trace loading excluded,
  reported once as setup);
* ``jobs/s``: trace jobs replayed per wall second;
* ``cycles``: planner cycles (``metrics["planner_cycles"]``);
* ``plan s`` / ``plan %``: total time inside ``plan()`` (measured by wrapping
  ``broker.sim.simulator.plan`` from this script) and its share of the wall time;
  the rest is the simulator's own event loop, snapshot building and accounting;
* ``p99 ms``: the simulator's own p99 decision latency
  (``metrics["decision_latency_p99_ms"]``), plus the mean and max from the wrapper;
* ``peak RSS MiB``: ``ru_maxrss`` of a forked child process that runs only this
  policy (so it includes the loaded trace and scenario inherited from the parent,
  about 150-200 MiB, but not the other policies' runs).

Each policy runs once, in its own forked child, with a fresh ``Simulator``
(and so a fresh, cold ``PlannerContext``); its caches warm up during the run,
as in real use.

Usage::

    PYTHONPATH=. python3 benchmarks/bench_simulator.py --jobs 5000 --policies fifo,backfill,cheapest,federated
    PYTHONPATH=. python3 benchmarks/bench_simulator.py --json out/bench/sim.json           # all jobs, federated
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import broker.sim.simulator as simmod  # noqa: E402
from broker.planner.core import PlannerConfig  # noqa: E402
from broker.sim.scenario import load_scenario  # noqa: E402
from broker.sim.traces import load_philly  # noqa: E402
from _machine import machine_info, parse_policies  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)


class _TimeLimit(Exception):
    pass


def _run_policy(policy: str, trace, scen, seed: int, time_limit: float | None, verbose: bool) -> dict:
    """Run one policy in this process; returns the measured row."""
    real_plan = simmod.plan
    lat: list[float] = []

    def timed_plan(snap, ctx):
        t0 = time.perf_counter()
        out = real_plan(snap, ctx)
        lat.append(time.perf_counter() - t0)
        return out

    simmod.plan = timed_plan
    t0 = time.perf_counter()
    state = {"done": 0}

    def progress(done, total):
        state["done"] = done
        el = time.perf_counter() - t0
        if verbose:
            print(f"#   {policy}: {done:,}/{total:,} jobs, {len(lat):,} cycles, {el:.0f} s", file=sys.stderr, flush=True)
        if time_limit is not None and el > time_limit:
            raise _TimeLimit()

    row = {"policy": policy, "jobs": len(trace.jobs)}
    try:
        run = simmod.simulate(trace, scen.pools, scen.offers, scen.signals, policy, planner_config=PlannerConfig(),
                              gpus=scen.gpus, spot_traces=scen.spot_traces,
                              config=simmod.SimulationConfig(seed=seed), progress=progress)
        wall = time.perf_counter() - t0
        m = run.metrics
        row.update(status="ok", wall_s=wall, jobs_per_s=len(trace.jobs) / wall, cycles=int(m["planner_cycles"]),
                   p99_ms=float(m["decision_latency_p99_ms"]), jobs_completed=int(m["jobs_completed"]),
                   deadline_misses=int(m["deadline_misses"]), cloud_jobs=int(m["cloud_jobs"]))
    except _TimeLimit:
        wall = time.perf_counter() - t0
        a = np.array(lat) * 1000.0
        row.update(status=f"stopped after {wall:.0f} s at {state['done']:,} jobs done", wall_s=wall,
                   jobs_per_s=float("nan"), cycles=len(lat),
                   p99_ms=float(np.percentile(a, 99)) if a.size else float("nan"))
    finally:
        simmod.plan = real_plan
    a = np.array(lat) * 1000.0
    row.update(plan_s=float(a.sum() / 1000.0), plan_share=float(a.sum() / 1000.0 / wall) if wall > 0 else 0.0,
               mean_ms=float(a.mean()) if a.size else float("nan"), max_ms=float(a.max()) if a.size else float("nan"),
               maxrss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    return row


def _child(conn, *a):
    try:
        conn.send(_run_policy(*a))
    except BaseException as e:  # report, never hang the parent
        conn.send({"policy": a[0], "status": f"error: {e!r}", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def _f(x, fmt):
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=None, help="replay only the first N jobs (default: all 82,247)")
    ap.add_argument("--policies", default="federated", help="comma-separated policies (default: federated)")
    ap.add_argument("--seed", type=int, default=0, help="spot-trace phase seed")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop a policy after this many seconds and report it as stopped")
    ap.add_argument("--no-fork", action="store_true", help="run in this process (peak RSS then accumulates)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON to this path")
    args = ap.parse_args(argv)

    policies = parse_policies(ap, args.policies)
    if args.jobs is not None and args.jobs < 1:
        ap.error("--jobs must be >= 1")

    t0 = time.perf_counter()
    scen = load_scenario()
    trace = load_philly(site_tz=scen.pools[0].timezone, limit=args.jobs)
    setup_s = time.perf_counter() - t0
    print(f"# setup {setup_s:.1f} s: {len(trace.jobs):,} jobs, pools "
          f"{[(p.name, p.total_gpus) for p in scen.pools]}, {len(scen.offers)} offers", file=sys.stderr, flush=True)

    rows = []
    for pol in policies:
        a = (pol, trace, scen, args.seed, args.time_limit, not args.quiet)
        if args.no_fork:
            row = _run_policy(*a)
        else:
            ctx = mp.get_context("fork")
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(child,) + a)
            p.start()
            child.close()
            row = parent.recv() if parent.poll(None) else {"policy": pol, "status": "no result"}
            p.join()
        rows.append(row)
        print(f"# {pol}: {row.get('status')} {_f(row.get('wall_s'), '.1f')} s", file=sys.stderr, flush=True)
        if "traceback" in row:
            print(row["traceback"], file=sys.stderr)

    info = machine_info()
    print(f"\nMachine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, numpy {info['numpy']}; "
          f"code {info['git_head']}{'+dirty' if info['src_dirty'] else ''} (src {info['src_sha256']}). "
          f"Trace: Philly, {len(trace.jobs):,} jobs; on-prem {sum(p.total_gpus for p in scen.pools)} GPUs; "
          f"{len(scen.offers)} offers; setup (load scenario + trace) {setup_s:.1f} s.\n")
    print("| policy | jobs | status | wall s | jobs/s | cycles | plan s | plan % | mean ms | p99 ms | max ms "
          "| peak RSS MiB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r.get('jobs', len(trace.jobs)):,} | {r.get('status')} | {_f(r.get('wall_s'), ',.1f')} "
              f"| {_f(r.get('jobs_per_s'), ',.0f')} | {_f(r.get('cycles'), ',')} | {_f(r.get('plan_s'), ',.1f')} "
              f"| {_f(100 * r['plan_share'] if 'plan_share' in r else None, '.0f')} | {_f(r.get('mean_ms'), ',.2f')} "
              f"| {_f(r.get('p99_ms'), ',.2f')} | {_f(r.get('max_ms'), ',.1f')} | {_f(r.get('maxrss_mib'), ',.0f')} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "simulator_throughput", "machine": info, "setup_s": setup_s,
                                         "args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()},
                                         "results": rows}, indent=2))
        print(f"\nresults: {args.json}", file=sys.stderr)
    ok = all(r.get("status", "").startswith(("ok", "stopped")) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
