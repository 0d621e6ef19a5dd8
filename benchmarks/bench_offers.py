"""Benchmark the single-request answer: the function under ``fedbroker offers``.

Times :func:`broker.cli.main.request_job` + :func:`broker.cli.main.ranked_options` (every compatible cloud
offer and on-prem pool costed from the start instant and ranked by total USD) for a seeded grid of requests
(GPU type x GPUs per node x nodes x market x hours), on one ``PlannerContext`` built once (as a live broker
or a CLI process holds it; its build time is reported separately). The shape cache of the context is
cleared before each timed call unless ``--warm``, so every request pays its offer filtering.

Usage::

    PYTHONPATH=. python3 benchmarks/bench_offers.py [--repeat 3] [--warm]

Prints offers in the catalog, requests timed, and the median / p95 / max milliseconds per request.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from datetime import datetime, timezone

from _machine import machine_info  # noqa: E402  (benchmarks/ is the script's directory)

from broker.cli.main import ranked_options, request_job
from broker.planner.core import PlannerConfig, PlannerContext
from broker.sim.scenario import load_scenario

GPUS = ["V100", "T4", "A100", "A100-80GB", "H100", "L4", "P100", "H200", "B200", "L40S"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over the grid")
    ap.add_argument("--warm", action="store_true", help="keep the per-shape offer cache between requests")
    args = ap.parse_args(argv)
    start_s = datetime(2023, 9, 4, 12, tzinfo=timezone.utc).timestamp()
    t0 = time.perf_counter()
    scen = load_scenario()
    ctx = PlannerContext(PlannerConfig(), scen.pools, scen.offers, scen.signals, scen.gpus)
    build_ms = (time.perf_counter() - t0) * 1e3
    grid = list(itertools.product(GPUS, [1, 2, 4, 8], [1, 2], [True, False], [1.0, 24.0]))
    times = []
    for _ in range(args.repeat):
        for gpu, count, nodes, spot, hours in grid:
            if not args.warm:
                ctx._shape_cache_static.clear()
            t = time.perf_counter()
            ranked_options(ctx, request_job(ctx, frozenset([gpu]), count, nodes, spot, hours, start_s), start_s)
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    m = machine_info()
    print(f"Machine: {m['nproc']} CPUs ({m['cpu']}), Python {m['python']}, numpy {m['numpy']}; code {m['git_head']} (src {m['src_sha256']})"
          f"{' dirty' if m['src_dirty'] else ''}")
    p95 = times[int(0.95 * (len(times) - 1))]
    print(f"offers={len(scen.offers)} requests={len(times)} scenario+ctx build {build_ms:.0f} ms "
          f"{'warm' if args.warm else 'cold shape cache'}: median {statistics.median(times):.3f} ms, "
          f"p95 {p95:.3f} ms, max {times[-1]:.3f} ms per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
