"""Where does ``federated`` spend the cloud dollars the LP bound does not? (issue 11, item 3)

Replays the first ``--jobs`` jobs of the Philly trace (or ``--trace`` CSV) on the bundled Toronto pool
(or ``--cluster``) under one policy
(``federated`` by default, planner settings from ``--set key=value``), records every cloud decision
the planner makes (wrapping :func:`broker.planner.registry.plan` as the simulator calls it), solves
the LP bound of the same jobs, and prints a breakdown:

* cloud dollars and V100-hours of work by why the job burst: decided at arrival or after a spot
  interruption (``fresh``: the on-prem wait looked too long for its deadline or dearer than the
  cloud), at a review of a job that had waited in the on-prem queue (``review``: the last safe
  instant), or when the queue pass found a waiting job that could no longer finish on-prem in time
  (``late in the queue``); by gang size, by slack left at the burst, by offer;
* USD per V100-hour of cloud work against the bound's;
* on-prem GPU-hours left idle while the burst jobs ran in the cloud (from the run's timeline of busy
  on-prem GPUs): capacity a look-ahead could have given them.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/profile_gap.py --jobs 20000 [--step 60] [--set urgency_bucket_s=0]

Prints a plain-text report; no files written.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import numpy as np

import broker.sim.simulator as simmod
from broker.model import DecisionKind
from broker.planner.core import PlannerConfig
from broker.sim.bound import CLI_BLOCK_H, BoundLP
from broker.sim.scenario import load_scenario
from broker.sim.simulator import SimulationConfig, simulate
from broker.sim.traces import load_generic_csv, load_philly

_H = 3600.0


def _parse_set(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, _, v = it.partition("=")
        try:
            out[k] = float(v) if v not in ("true", "false") else v == "true"
        except ValueError:
            out[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=20000, help="first N jobs; 0 = the whole trace")
    ap.add_argument("--step", type=float, default=60.0)
    ap.add_argument("--policy", default="federated")
    ap.add_argument("--set", action="append", default=[], help="PlannerConfig field=value")
    ap.add_argument("--no-bound", action="store_true")
    ap.add_argument("--cluster", default=None, help="on-prem cluster YAML (default: the bundled Toronto pool)")
    ap.add_argument("--trace", default="philly", help="'philly' or a CSV path in the generic schema")
    a = ap.parse_args()

    scen = load_scenario(a.cluster)
    if a.trace == "philly":
        tr = load_philly(site_tz=scen.pools[0].timezone, limit=a.jobs or None)  # 0: the whole trace
    else:
        tr = load_generic_csv(a.trace, limit=a.jobs or None)
    pc = PlannerConfig(**_parse_set(a.set))
    by_id = {j.job_id: j for j in tr.jobs}

    bursts: dict[str, dict] = {}
    real_plan = simmod.plan

    def spy(snap, ctx):
        ds = real_plan(snap, ctx)
        pend = {j.job_id: j for j in snap.pending}
        queued = None
        for d in ds:
            if d.kind is DecisionKind.provision and d.job_id not in bursts:
                pj = pend.get(d.job_id)
                if pj is None:  # a queued job the queue pass found late (it would now miss its deadline on-prem)
                    if queued is None:
                        queued = {j.job_id: j for g in (snap.queued or {}).values() for j in g}
                    pj = queued.get(d.job_id)
                why = ("fresh" if pj is None or pj.committed_pool is None else
                       "review" if pj.review_s <= snap.now_s else "late in the queue")
                off = ctx.offers[d.offer_index]
                onp = [o for o in d.alternatives if o.kind == "onprem"]
                # not among the 3 best rejected options: every one listed is a feasible cloud offer, so the
                # on-prem option was infeasible (it misses the deadline) or scored worse than 3 offers
                why_on = (onp[0].note or "?") if onp else "not listed (behind 3 feasible offers)"
                wait_on = onp[0].wait_s / _H if onp else math.nan
                bursts[d.job_id] = dict(t=snap.now_s, why=why,
                                        slack_h=(pj.deadline_s - snap.now_s - pj.work_s) / _H if pj else math.nan,
                                        usd=d.option.dollars_usd, gpu=off.gpu_type, count=off.gpu_count,
                                        market=off.market.value, run_s=d.option.runtime_s,
                                        why_on=why_on, wait_on=wait_on, queue_len=len(snap.queued or {}))
        return ds

    simmod.plan = spy
    t0 = time.perf_counter()
    run = simulate(tr, scen.pools, scen.offers, scen.signals, a.policy, pc, scen.gpus, scen.spot_traces,
                   SimulationConfig(tick_s=a.step, usage_records=False))
    simmod.plan = real_plan
    m = run.metrics
    print(f"{a.policy} on {len(tr.jobs)} jobs ({a.set}): cost ${m['cost_usd']:,.0f} (cloud ${m['cloud_cost_usd']:,.0f}, "
          f"on-prem electricity ${m['onprem_energy_cost_usd']:,.0f}), carbon {m['carbon_kg']:,.0f} kg, "
          f"misses {m['deadline_misses']}, cloud jobs {m['cloud_jobs']}, interruptions {m['spot_interruptions']}, "
          f"on-prem utilisation {m['onprem_gpu_utilization']:.1%}, mean wait {m['mean_wait_s'] / _H:.1f} h, "
          f"{time.perf_counter() - t0:.0f} s")

    if not a.no_bound:
        t0 = time.perf_counter()
        lp = BoundLP(tr, scen.pools, scen.offers, scen.signals, pc, scen.gpus, block_h=CLI_BLOCK_H)
        lb = lp.lower_bound()
        ratio_s = (m["cost_usd"] + pc.carbon_price_usd_per_tonne / 1000 * m["carbon_kg"]) / lb.score_usd
        print(f"bound ({CLI_BLOCK_H}-h steps): cost ${lb.cost_usd:,.0f}, score ${lb.score_usd:,.0f}, on-prem work "
              f"{lb.onprem_work_fraction:.1%}; ratios cost {m['cost_usd'] / lb.cost_usd:.2f}x, score {ratio_s:.2f}x "
              f"({time.perf_counter() - t0:.0f} s)")

    # work per job (V100-hours) and its cloud record
    total_work = sum(j.num_gpus * j.duration_s for j in tr.jobs) / _H
    recs = {r.job_id: r for r in run.jobs}
    cloud_ids = [jid for jid in bursts]
    cloud_work = sum(by_id[j].num_gpus * by_id[j].duration_s for j in cloud_ids) / _H
    cloud_usd = sum(recs[j].dollars_usd for j in cloud_ids)
    print(f"\nwork {total_work:,.0f} V100-h; sent to the cloud: {cloud_work:,.0f} ({cloud_work / total_work:.1%}) "
          f"for ${cloud_usd:,.0f} = ${cloud_usd / max(cloud_work, 1e-9):.3f} per V100-hour of work")

    # idle on-prem GPU-hours while each burst job ran in the cloud
    tl_t, busy, cap = run.timeline_t_s, run.onprem_busy_gpus, run.onprem_total_gpus

    def idle_gpu_h(t0_: float, t1_: float) -> float:
        if t1_ <= t0_ or tl_t.size == 0:
            return 0.0
        edges = np.concatenate([[t0_], tl_t[(tl_t > t0_) & (tl_t < t1_)], [t1_]])
        i = np.searchsorted(tl_t, edges[:-1], side="right") - 1
        b = np.where(i >= 0, busy[np.maximum(i, 0)], 0)
        return float(np.sum((cap - b) * np.diff(edges)) / _H)

    groups: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    slack_bins = [(-1e9, 2), (2, 12), (12, 48), (48, 1e9)]
    for jid, b in bursts.items():
        tj, r = by_id[jid], recs[jid]
        work = tj.num_gpus * tj.duration_s / _H
        end = r.end_s if not math.isnan(r.end_s) else b["t"] + b["run_s"]
        idle = idle_gpu_h(b["t"], end)
        gang = f"{tj.num_gpus} GPU" if tj.num_gpus <= 8 else ">8 GPU"
        sb = next(f"{lo:g}-{hi:g} h" if hi < 1e9 else f">{lo:g} h" for lo, hi in slack_bins if lo <= b["slack_h"] < hi) \
            if not math.isnan(b["slack_h"]) else "?"
        wb = "?" if math.isnan(b["wait_on"]) else ("<1 h" if b["wait_on"] < 1 else "1-12 h" if b["wait_on"] < 12 else
                                                    "12-48 h" if b["wait_on"] < 48 else ">48 h")
        for key in (("why", b["why"]),
                    ("on-prem option", f"{b['why']}: {b['why_on']}"),
                    ("fresh, on-prem wait estimate", wb if b["why"] == "fresh" else "(not fresh)"), ("gang", gang), ("slack at burst", sb),
                    ("offer", f"{b['gpu']}x{b['count']} {b['market']}")):
            g = groups[key]
            g[0] += 1
            g[1] += work
            g[2] += r.dollars_usd
            g[3] += idle
            g[4] += min(idle, work)
    print(f"\n{'group':<34} {'jobs':>6} {'V100-h':>9} {'USD':>9} {'USD/V100-h':>10} {'idle on-prem GPU-h':>18}")
    for dim in ("why", "on-prem option", "fresh, on-prem wait estimate", "gang", "slack at burst", "offer"):
        rows = sorted(((k, v) for k, v in groups.items() if k[0] == dim), key=lambda kv: -kv[1][2])
        for (d, name), (n, w, usd, idle, _) in rows[:8]:
            print(f"{d + ': ' + name:<34} {n:>6} {w:>9,.0f} {usd:>9,.0f} {usd / max(w, 1e-9):>10.3f} {idle:>18,.0f}")
    # how much of the cloud work could have run on-prem in the idle GPU-hours during its own cloud run
    fit = sum(v[4] for k, v in groups.items() if k[0] == "why")
    print(f"\ncloud work that the idle on-prem GPU-hours during its own cloud run could have held (min of the two, "
          f"summed per job; an upper bound: idle GPUs are shared): {fit:,.0f} V100-h of {cloud_work:,.0f}")
    # idle on-prem capacity over the whole run while jobs waited
    print(f"on-prem allocated while jobs waited: {m['onprem_allocated_while_waiting']:.1%}")


if __name__ == "__main__":
    main()
