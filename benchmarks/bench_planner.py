"""Benchmark one planner cycle: ``broker.planner.registry.plan(snapshot, ctx)``.

For every (on-prem GPUs, pending jobs, policy) combination this builds one
deterministic snapshot and times ``plan()`` a few times.

Inputs (all deterministic, seeded numpy):

* **On-prem pool**: ``G / 8`` nodes of 8 x V100 16 GB in the bundled CA-ON
  zone (Toronto: IESO price, CA-ON carbon), PUE 1.3, $0.55/GPU-h amortised.
* **Busy state**: running jobs whose shapes and durations are drawn from the
  Philly trace are packed onto the nodes (random first-fit) until
  ``--busy`` (default 85 %) of the GPUs are allocated, so nodes are a mix of
  full, partly busy and idle. Each running job has started a uniform fraction of
  its trace duration ago and ends, as expected, after the rest of it.
* **Cloud**: the bundled offers (``load_scenario().offers``: 2,220 since issue 11), with spot
  availability at the cycle instant from the bundled spot traces
  (``broker.sim.simulator.SpotModel``).
* **Pending jobs**: drawn with replacement from the 82,247 Philly jobs (shapes,
  durations, teams), submitted in the last ``--max-age-h`` hours (uniform) and
  keeping each trace job's deadline slack (deadline - submit). Philly jobs are
  all priority ``normal``, any GPU type, not preemptible; ``--high-frac`` turns a
  fraction into ``high`` priority (exercises the preemption path).
  ``--committed-frac`` makes a fraction "already waiting" for the on-prem pool
  from an earlier cycle (review time in the future); default 0: a cold queue
  where every job is scored. By default they are passed in ``Snapshot.pending``
  (the figures before issue 11 item 4 were measured so: the planner sorts them);
  ``--queued`` passes them as the simulator and the live cycle do, in
  ``Snapshot.queued`` groups (:func:`broker.planner.policy_base.queue_group`, in
  submission order) with ``queued_demand``, so the planner merges the groups
  lazily and walks the queue only as far as GPUs are free.
* **Cycle instant**: 2023-10-02 15:00 UTC (a Monday mid-trace, inside the
  bundled 2023-2024 price/carbon coverage); horizon 48 h, slot 1 h (defaults).

Timing: each repetition builds a *fresh* ``PlannerContext`` (cold caches:
shape and offer caches empty), which is not timed (its build time is reported
as ``ctx_ms``); then ``plan()`` is timed with ``time.perf_counter``.
``--warm`` instead reuses one context after one untimed call (warm caches).
Peak memory: one extra, untimed call under ``tracemalloc`` (peak Python heap
allocated during ``plan()``, MiB); ``maxrss`` is the process's peak RSS so far
(monotonic over the whole run, so it is an upper bound for the row).

Usage::

    PYTHONPATH=. python3 benchmarks/bench_planner.py --sizes 1000,10000 --gpus 1000,10000 \
        --policies fifo,backfill,cheapest,federated --repeat 5 --json out/bench_planner.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import sys
import time
import tracemalloc
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.model import Pool, PoolNode  # noqa: E402
from broker.planner.core import POLICY_NAMES, PendingJob, PlannerConfig, PlannerContext, RunningJob, Snapshot  # noqa: E402
from broker.planner.policy_base import queue_group  # noqa: E402
from broker.planner.registry import POLICIES, plan  # noqa: E402
from broker.sim.scenario import load_scenario  # noqa: E402
from broker.sim.simulator import SpotModel  # noqa: E402
from broker.sim.traces import load_philly  # noqa: E402
from _machine import machine_info, parse_policies  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

NOW_S = datetime(2023, 10, 2, 15, tzinfo=timezone.utc).timestamp()
GPUS_PER_NODE = 8


# ----------------------------------------------------------------------------- inputs
class TraceShapes:
    """The Philly trace as flat arrays (shapes, durations, slack, teams)."""

    def __init__(self, site_tz: str):
        tr = load_philly(site_tz=site_tz)
        self.n = len(tr.jobs)
        self.gpn = np.array([j.gpus_per_node for j in tr.jobs], dtype=np.int64)
        self.nodes = np.array([j.nodes for j in tr.jobs], dtype=np.int64)
        self.dur = np.array([j.duration_s for j in tr.jobs])
        self.slack = np.array([j.deadline_s - j.submit_s for j in tr.jobs])
        self.team = [j.team for j in tr.jobs]


def make_pool(n_gpus: int) -> Pool:
    n_nodes = max(1, math.ceil(n_gpus / GPUS_PER_NODE))
    nodes = tuple(PoolNode(name=f"v100-{i:05d}", gpu_type="V100", gpu_count=GPUS_PER_NODE, gpu_memory_gb=16.0)
                  for i in range(n_nodes))
    return Pool(name=f"bench-{n_gpus}", site="benchmark pool (Toronto, IESO grid)", carbon_zone="CA-ON",
                price_zone="CA-ON", pue=1.3, amortised_usd_per_gpu_hour=0.55, timezone="America/Toronto",
                nodes=nodes)


def make_busy_state(pool: Pool, tr: TraceShapes, rng: np.random.Generator, busy: float):
    """Pack trace-shaped running jobs onto the pool until ``busy`` of its GPUs are allocated.

    Returns ``(free, running)``: free GPUs per node and the running jobs.
    """
    n_nodes = len(pool.nodes)
    free = np.full(n_nodes, GPUS_PER_NODE, dtype=np.int64)
    target = int(busy * n_nodes * GPUS_PER_NODE)
    allocated = 0
    running: list[RunningJob] = []
    misses = 0
    while allocated < target and misses < 200:
        k = int(rng.integers(tr.n))
        g, nn = int(tr.gpn[k]), int(tr.nodes[k])
        if g * nn > target - allocated + GPUS_PER_NODE:
            misses += 1
            continue
        cand = np.flatnonzero(free >= g)
        if cand.size < nn:
            misses += 1
            continue
        nodes = rng.choice(cand, size=nn, replace=False)
        free[nodes] -= g
        allocated += g * nn
        dur = float(tr.dur[k])
        done = float(rng.uniform(0.0, 1.0)) * dur
        low = bool(rng.random() < 0.3)  # 30 % low-priority, preemptible (victims for --high-frac jobs)
        running.append(RunningJob(job_id=f"run-{len(running)}", pool=0,
                                  allocation=[(int(i), g) for i in nodes], expected_end_s=NOW_S + (dur - done),
                                  started_s=NOW_S - done, priority=0 if low else 1, preemptible=low,
                                  team=tr.team[k]))
    return free, running


def make_pending(n: int, tr: TraceShapes, rng: np.random.Generator, max_age_h: float, high_frac: float,
                 committed_frac: float) -> list[PendingJob]:
    idx = rng.integers(0, tr.n, size=n)
    age = np.sort(rng.uniform(0.0, max_age_h * 3600.0, size=n))[::-1]
    high = rng.random(n) < high_frac
    committed = rng.random(n) < committed_frac
    review = NOW_S + rng.uniform(600.0, 6 * 3600.0, size=n)
    out = []
    for i in range(n):
        k = int(idx[i])
        submit = NOW_S - float(age[i])
        c = bool(committed[i])
        out.append(PendingJob(job_id=f"job-{i}", team=tr.team[k], priority=2 if high[i] else 1, submit_s=submit,
                              deadline_s=submit + float(tr.slack[k]), earliest_s=submit, work_s=float(tr.dur[k]),
                              gpus_per_node=int(tr.gpn[k]), nodes=int(tr.nodes[k]),
                              committed_pool=0 if c else None, review_s=float(review[i]) if c else 0.0))
    return out


def queued_snapshot(snap: Snapshot, cfg: PlannerConfig) -> Snapshot:
    """``snap`` with its committed jobs (a pool chosen, review later) moved from ``pending`` to ``queued``
    groups (:func:`queue_group` under ``cfg``, submission order) and their ``queued_demand`` (GPUs,
    GPU-seconds per pool) and ``queued_demand_by_urgency`` (the same per priority and urgency bucket), as the
    simulator passes a waiting queue (the live cycle passes the groups only: the planner sums them)."""
    fresh, groups, demand, by_urgency = [], {}, {}, {}
    every = list(snap.pending) + [j for g in (snap.queued or {}).values() for j in g]
    for j in sorted(every, key=lambda j: (j.submit_s, j.job_id)):
        if j.committed_pool is None or j.review_s <= snap.now_s:
            fresh.append(j)
            continue
        key = queue_group(j, cfg)
        groups.setdefault(key, []).append(j)
        g, gs = demand.get(j.committed_pool, (0.0, 0.0))
        demand[j.committed_pool] = (g + j.gpus, gs + j.gpus * j.work_s)
        g, gs = by_urgency.setdefault(j.committed_pool, {}).get((key[0], key[2]), (0.0, 0.0))
        by_urgency[j.committed_pool][(key[0], key[2])] = (g + j.gpus, gs + j.gpus * j.work_s)
    return Snapshot(now_s=snap.now_s, pending=fresh, free=snap.free, running=snap.running,
                    offer_available=snap.offer_available, team_usage=snap.team_usage, queued=groups,
                    queued_demand=demand, queued_demand_by_urgency=by_urgency)


# ----------------------------------------------------------------------------- measuring
def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def bench_one(snap: Snapshot, make_ctx, repeat: int, warm: bool, measure_mem: bool) -> dict:
    times, ctx_ms = [], []
    decisions = None
    ctx = None
    if warm:
        t0 = time.perf_counter()
        ctx = make_ctx()
        ctx_ms.append((time.perf_counter() - t0) * 1000.0)
        plan(snap, ctx)  # untimed warm-up fills the caches
    for _ in range(repeat):
        if not warm:
            t0 = time.perf_counter()
            ctx = make_ctx()
            ctx_ms.append((time.perf_counter() - t0) * 1000.0)
        gc.collect()
        t0 = time.perf_counter()
        decisions = plan(snap, ctx)
        times.append(time.perf_counter() - t0)
    kinds = Counter(d.kind.value for d in decisions)
    peak_mib = math.nan
    if measure_mem:
        mctx = ctx if warm else make_ctx()
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        res = plan(snap, mctx)
        peak_mib = (tracemalloc.get_traced_memory()[1] - base) / 2**20
        tracemalloc.stop()
        del res
    return {
        "times_s": times,
        "median_ms": statistics.median(times) * 1000.0,
        "p95_ms": float(np.percentile(times, 95)) * 1000.0,
        "min_ms": min(times) * 1000.0,
        "ctx_ms": statistics.median(ctx_ms),
        "decisions": len(decisions),
        "kinds": dict(sorted(kinds.items())),
        "peak_heap_mib": peak_mib,
        "maxrss_mib": maxrss_mib(),
    }


def profile_one(snap: Snapshot, make_ctx, top: int, label: str, out_dir: Path | None) -> None:
    import cProfile
    import io
    import pstats

    ctx = make_ctx()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    plan(snap, ctx)
    pr.disable()
    el = time.perf_counter() - t0
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("cumulative").print_stats(top)
    print(f"# cProfile {label} ({el:.1f} s under the profiler, cold context)\n{buf.getvalue()}", file=sys.stderr)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        st.dump_stats(str(out_dir / f"profile-{label}.pstats"))


def repeats_for(size: int, repeat: int) -> int:
    """Fewer repetitions for big queues: at most 5 at >= 10k jobs, 3 at >= 100k."""
    if size >= 100_000:
        return max(1, min(repeat, 3))
    if size >= 10_000:
        return max(1, min(repeat, 5))
    return max(1, repeat)


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="pending jobs, comma-separated")
    ap.add_argument("--gpus", default="1000,10000", help="on-prem GPUs (8-GPU V100 nodes), comma-separated")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policies")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions (capped at 5 for 10k, 3 for 100k)")
    ap.add_argument("--warm", action="store_true", help="reuse one PlannerContext after an untimed warm-up call")
    ap.add_argument("--busy", type=float, default=0.85, help="fraction of on-prem GPUs held by running jobs")
    ap.add_argument("--max-age-h", type=float, default=6.0, help="pending jobs were submitted up to this long ago")
    ap.add_argument("--high-frac", type=float, default=0.0, help="fraction of pending jobs at priority high")
    ap.add_argument("--committed-frac", type=float, default=0.0,
                    help="fraction of pending jobs already waiting for the on-prem pool")
    ap.add_argument("--queued", action="store_true",
                    help="pass the committed jobs in Snapshot.queued groups (as the simulator and the live cycle "
                         "do) instead of in Snapshot.pending")
    ap.add_argument("--wait-ahead", choices=("queue", "urgency"), default=None,
                    help="PlannerConfig.wait_ahead (default: the config's)")
    ap.add_argument("--no-mem", action="store_true", help="skip the extra tracemalloc call")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile one extra cold call per row with cProfile; print the top N "
                         "functions by cumulative time (stderr) and save OUT/profile-<row>.pstats next to --json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON to this path")
    args = ap.parse_args(argv)

    policies = parse_policies(ap, args.policies)
    sizes, gpus_list = _ints(args.sizes), _ints(args.gpus)

    t0 = time.perf_counter()
    scen = load_scenario()
    tr = TraceShapes(site_tz="America/Toronto")
    spot = SpotModel(scen.offers, scen.spot_traces, seed=args.seed)
    avail = spot.available(NOW_S)
    print(f"# setup: {len(scen.offers)} offers ({int(avail.sum())} available now), {tr.n} trace jobs, "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)

    info = machine_info()
    rows = []
    for n_gpus in gpus_list:
        rng = np.random.default_rng([args.seed, n_gpus])
        pool = make_pool(n_gpus)
        free, running = make_busy_state(pool, tr, rng, args.busy)
        for size in sizes:
            rng_j = np.random.default_rng([args.seed, n_gpus, size])
            pending = make_pending(size, tr, rng_j, args.max_age_h, args.high_frac, args.committed_frac)
            teams = sorted({j.team for j in pending})
            usage = {t: float(u) for t, u in zip(teams, rng_j.gamma(1.0, 500.0, size=len(teams)))}
            snap = Snapshot(now_s=NOW_S, pending=pending, free=[free], running=running, offer_available=avail,
                            team_usage=usage)
            for pol in policies:
                cfg = PlannerConfig(policy=pol, **({"wait_ahead": args.wait_ahead} if args.wait_ahead else {}))
                if args.queued:
                    snap = queued_snapshot(snap, cfg)
                offers = scen.offers if POLICIES[pol].uses_cloud else []  # as the simulator does

                def make_ctx(cfg=cfg, offers=offers, pool=pool):
                    return PlannerContext(cfg, [pool], offers, scen.signals, scen.gpus)

                rep = repeats_for(size, args.repeat)
                r = bench_one(snap, make_ctx, rep, args.warm, not args.no_mem)
                row = {"policy": pol, "gpus": pool.total_gpus, "nodes": len(pool.nodes), "pending": size,
                       "running": len(running), "free_gpus": int(free.sum()), "offers": len(offers),
                       "repeat": rep, "caches": "warm" if args.warm else "cold", **r}
                rows.append(row)
                if args.profile:
                    profile_one(snap, make_ctx, args.profile, f"{pol}-{pool.total_gpus}gpus-{size}jobs",
                                args.json.parent if args.json else None)
                print(f"# {pol:>9} gpus={pool.total_gpus:>6} pending={size:>7}: median {r['median_ms']:.1f} ms "
                      f"p95 {r['p95_ms']:.1f} ms, {r['decisions']} decisions {r['kinds']}", file=sys.stderr)
                sys.stderr.flush()

    print(f"\nMachine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, numpy {info['numpy']}; "
          f"code {info['git_head']}{'+dirty' if info['src_dirty'] else ''} (src {info['src_sha256']}). "
          f"Cycle at {datetime.fromtimestamp(NOW_S, tz=timezone.utc):%Y-%m-%d %H:%M} UTC, horizon 48 h, "
          f"slot 1 h, {args.busy:.0%} of on-prem GPUs busy, "
          f"{'warm' if args.warm else 'cold (fresh PlannerContext per repetition)'} caches"
          f"{'; committed jobs in Snapshot.queued groups (--queued)' if args.queued else ''}.\n")
    hdr = ("| policy | on-prem GPUs | pending | running | reps | median ms | p95 ms | ctx build ms "
           "| peak heap MiB | maxrss MiB | decisions | kinds |")
    print(hdr)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in r["kinds"].items())
        print(f"| {r['policy']} | {r['gpus']:,} | {r['pending']:,} | {r['running']:,} | {r['repeat']} "
              f"| {r['median_ms']:,.1f} | {r['p95_ms']:,.1f} | {r['ctx_ms']:,.1f} | {r['peak_heap_mib']:,.1f} "
              f"| {r['maxrss_mib']:,.0f} | {r['decisions']:,} | {kinds} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "planner_cycle", "machine": info, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "now_s": NOW_S, "results": rows}, indent=2))
        print(f"\nresults: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
