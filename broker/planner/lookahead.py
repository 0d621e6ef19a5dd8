"""On-prem capacity prices per future hour, from an LP over the waiting work (``federated``'s look-ahead).

``PlannerConfig.capacity_prices_period_s > 0`` turns it on. At the first cycle of each period (``floor(now /
period)``) :func:`capacity_prices` solves a fluid LP over every job the cycle sees waiting (fresh, due for
review, and the committed queue) and the signals' horizon, and ``federated`` adds, between solves, to the score
of each on-prem option the price of the GPU-hours it would hold: ``gpus x integral of the hourly price over
[start, start + runtime]`` (O(1) per job against the cached prices, :meth:`CapacityPrices.charge`).

**The LP** (one solve; all in GPU-seconds and reference-GPU-seconds of work):

* blocks ``k = 0..K-1`` of one hour from the solve instant (``K = PlannerConfig.horizon_s / 3600``) and one
  tail block from the end of the horizon to the latest deadline;
* ``x[c, (p, t), k] >= 0``: GPU-seconds of pool ``p``'s GPU type ``t`` given to job class ``c`` in block ``k``,
  doing ``throughput(t) x`` of its work; ``y[c] >= 0``: its work done in the cloud;
* work: ``sum throughput(t) x[c, ., .] + y[c] = W_c`` (the class's GPUs x remaining reference-GPU-seconds);
* capacity: ``sum_c x[c, (p, t), k] <= GPUs of type t x block length - what running jobs hold in the block``
  (their expected ends, :meth:`~broker.planner.policy_base.Cycle.releases`);
* parallelism: ``x[c, (p, t), k] <= GPUs of the class x the part of the block before its deadline``;
* cost: on-prem, the block's score of the energy (electricity + carbon price x kgCO2e; the per-kWh score series
  the slot tables use, :meth:`~broker.planner.core.PlannerContext.pool_kwh_score_integrals`; the tail at the
  horizon's mean); cloud, the best score per unit of work of the shape's available offers now
  (:meth:`~broker.planner.policy_base.Cycle.cloud_ranking`, then exact
  :meth:`~broker.planner.core.PlannerContext.cloud_scalar` costs with the expected spot rework), or
  :data:`NO_CLOUD_USD_PER_GPU_HOUR` where no offer can hold the class.

The capacity rows' duals are the prices: USD per GPU-hour of type ``t`` in pool ``p`` in block ``k``: what one more
GPU-hour there would save the waiting work (0 where the pool has room for it all). They see only the jobs waiting
now (no arrival forecast) and relax gangs, node shapes and contiguous runs as the bound does
(:mod:`broker.sim.bound`).

State between cycles: the prices live in the context (``PlannerContext.capacity_prices_cache``), keyed by the
period; a cycle's decisions then depend on the snapshot and on the snapshot of the period's first cycle (the
simulator and the live broker both plan in time order, so a run stays deterministic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from broker.planner.core import PendingJob, PlannerContext
from broker.planner.costs import onprem_kw, score
from broker.planner.policy_base import Cycle, work_bucket

__all__ = ["CapacityPrices", "capacity_prices", "prices_for_cycle", "NO_CLOUD_USD_PER_GPU_HOUR"]

_H = 3600.0
#: the cloud price of work no offer can hold, USD per reference-GPU-hour: far above any offer (the catalog's dearest
#: is ~$15 per GPU-hour), so the LP keeps such work on-prem whenever capacity allows
NO_CLOUD_USD_PER_GPU_HOUR = 1000.0


@dataclass(frozen=True)
class CapacityPrices:
    """Prices of on-prem GPU-hours per future block, from one solve.

    Attributes:
        start_s: POSIX seconds (UTC) where block 0 starts (the solve instant).
        horizon_s: seconds covered by the hourly blocks (``K x 3600``); after it one tail price holds.
        prices: ``(pool, GPU type)`` -> float array ``(K + 1,)``: USD per GPU-hour in each hourly block, then
            the tail's.
        solve_s: wall seconds of the build and solve (0 when there was nothing to solve).
    """

    start_s: float
    horizon_s: float
    prices: dict[tuple[int, str], np.ndarray]
    solve_s: float = 0.0

    def charge(self, pool: int, gpu_type: str, gpus: int, starts_s: np.ndarray, runtime_s) -> np.ndarray:
        """USD of ``gpus`` GPUs of ``gpu_type`` in ``pool`` held over ``[starts_s, starts_s + runtime_s]`` (arrays
        ``(n,)``, or a scalar runtime; seconds) at these prices: ``gpus x integral of the price (USD per GPU-hour)
        over the window``. Time before ``start_s`` costs nothing; a target without prices costs 0."""
        lam = self.prices.get((pool, gpu_type))
        starts_s = np.asarray(starts_s, dtype=np.float64)
        if lam is None or not lam.any():
            return np.zeros(starts_s.shape)
        k = lam.size - 1
        edges_s = np.arange(k + 1) * _H
        cum_usd = np.concatenate([[0.0], np.cumsum(lam[:k])])  # USD per GPU from start_s to each hourly edge

        def usd_until(t: np.ndarray) -> np.ndarray:
            x = np.clip(t - self.start_s, 0.0, None)
            return (np.interp(np.minimum(x, self.horizon_s), edges_s, cum_usd)
                    + np.maximum(x - self.horizon_s, 0.0) / _H * lam[k])

        return gpus * (usd_until(starts_s + runtime_s) - usd_until(starts_s))


def _cloud_price(cy: Cycle, job: PendingJob, cache: dict) -> float:
    """Best score per reference-GPU-hour of work of ``job``'s shape on the available offers now, USD."""
    ctx = cy.ctx
    key = (job.gpu_types, job.gpus_per_node, job.nodes, job.min_mem_gb, job.spot_ok, job.regions,
           job.checkpointable, job.checkpoint_interval_s, job.priority, work_bucket(job.work_s))
    hit = cache.get(key)
    if hit is not None:
        return hit
    price = NO_CLOUD_USD_PER_GPU_HOUR
    if ctx.config.cloud_enabled and len(ctx.offers):
        offers = cy.available(ctx.compatible_offers(job))
        if offers.size:
            best = math.inf
            for o in cy.cloud_ranking(job, offers)[:4].tolist():
                est = ctx.cloud_scalar(job, o, cy.now)
                s = float(score(est.dollars_usd, est.carbon_kg, 0.0, 0.0, ctx.config.carbon_price_usd_per_tonne))
                if not math.isnan(s):
                    best = min(best, s)
            if best < math.inf:
                price = best / (job.gpus * job.work_s / _H)
    cache[key] = price
    return price


def capacity_prices(cy: Cycle, jobs: list[PendingJob]) -> CapacityPrices:
    """Solve the module's LP over ``jobs`` (the work waiting now) at ``cy.now``: the :class:`CapacityPrices`.

    Raises ``RuntimeError`` if HiGHS reports no optimum (it cannot happen: the cloud variable keeps every class
    feasible)."""
    import time

    t_wall = time.perf_counter()
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    K = max(int(cfg.horizon_s // _H), 1)
    hz_end = now + K * _H
    # ---- classes: (targets, GPUs, last block, cloud price) -> [work, GPUs]
    cloud_cache: dict = {}
    classes: dict[tuple, list[float]] = {}
    t_end = hz_end
    for j in jobs:
        targets = tuple(cy.onprem_targets(j))
        if not targets:
            continue
        dl = j.deadline_s - cfg.deadline_margin_s
        if dl <= now:
            continue
        t_end = max(t_end, dl) if math.isfinite(dl) else t_end
        key = (targets, min(dl, 1e18), _cloud_price(cy, j, cloud_cache))
        acc = classes.setdefault(key, [0.0, 0.0])
        acc[0] += j.gpus * j.work_s
        acc[1] += j.gpus
    if not classes:
        return CapacityPrices(now, K * _H, {}, time.perf_counter() - t_wall)
    t_end = min(t_end, now + 60 * 86400.0)  # a tail of at most 60 days
    b_start = np.concatenate([now + np.arange(K) * _H, [hz_end]])
    b_len = np.concatenate([np.full(K, _H), [max(t_end - hz_end, 0.0)]])
    b_end = b_start + b_len
    nb = K + 1
    # ---- per target: free GPU-seconds per block, energy score per GPU-second per block
    tgts = sorted({t for key in classes for t in key[0]})
    ti = {t: i for i, t in enumerate(tgts)}
    cap = np.zeros((len(tgts), nb))
    cost = np.zeros((len(tgts), nb))
    for i, (p, t) in enumerate(tgts):
        types = ctx.pool_node_types(p)
        gpus = sum(n.gpu_count for n in ctx.pools[p].nodes if n.gpu_type == t)
        cap[i] = gpus * b_len
        for end, node, g in cy.releases(p):
            if types[node] == t:
                cap[i] -= g * np.clip(np.minimum(end, b_end) - b_start, 0.0, None)
        kw = onprem_kw(1, ctx.gpus.busy_kw[t], ctx.pools[p].pue)
        integ = ctx.pool_kwh_score_integrals(p, b_start[:K], _H)  # USD per kW over each hour
        hourly = kw * integ / _H  # USD per GPU-second
        mean = float(np.nanmean(hourly)) if np.isfinite(hourly).any() else 0.0
        cost[i, :K] = np.where(np.isnan(hourly), mean, hourly)
        cost[i, K] = mean
    cap = np.maximum(cap, 0.0)
    # ---- columns
    c_vec, ub, eq_r, eq_c, eq_v, in_r, in_c, b_eq = [], [], [], [], [], [], [], []
    n = 0
    for ci, ((targets, dl, cloud_usd_h), (work, gpus)) in enumerate(classes.items()):
        room = np.clip(np.minimum(dl, b_end) - b_start, 0.0, None)  # seconds of each block before the deadline
        ks = np.flatnonzero(room > 0)
        for tg in targets:
            i = ti[tg]
            thr = ctx.gpus.throughput[tg[1]]
            idx = np.arange(n, n + ks.size)
            n += ks.size
            c_vec.append(cost[i, ks])
            ub.append(gpus * room[ks])
            eq_r.append(np.full(ks.size, ci))
            eq_c.append(idx)
            eq_v.append(np.full(ks.size, thr))
            in_r.append(i * nb + ks)
            in_c.append(idx)
        c_vec.append(np.array([cloud_usd_h / _H]))
        ub.append(np.array([np.inf]))
        eq_r.append(np.array([ci]))
        eq_c.append(np.array([n]))
        eq_v.append(np.array([1.0]))
        n += 1
        b_eq.append(work)
    a_eq = sp.csr_matrix((np.concatenate(eq_v), (np.concatenate(eq_r), np.concatenate(eq_c))), shape=(len(b_eq), n))
    rows = np.concatenate(in_r)
    a_ub = sp.csr_matrix((np.ones(rows.size), (rows, np.concatenate(in_c))), shape=(len(tgts) * nb, n))
    res = linprog(np.concatenate(c_vec), A_ub=a_ub, b_ub=cap.ravel(), A_eq=a_eq, b_eq=np.asarray(b_eq),
                  bounds=np.column_stack([np.zeros(n), np.concatenate(ub)]), method="highs")
    if res.status != 0:
        raise RuntimeError(f"capacity prices: HiGHS status {res.status}: {res.message}")
    lam = np.maximum(-np.asarray(res.ineqlin.marginals), 0.0).reshape(len(tgts), nb) * _H  # USD per GPU-hour
    return CapacityPrices(now, K * _H, {tg: lam[i] for i, tg in enumerate(tgts)}, time.perf_counter() - t_wall)


def prices_for_cycle(cy: Cycle, jobs: Callable[[], list[PendingJob]]) -> CapacityPrices | None:
    """The prices the cycle decides against (None when ``capacity_prices_period_s`` is 0): those of this period,
    solved now over ``jobs()`` (called only then) when the period has none yet (cached in
    ``PlannerContext.capacity_prices_cache``)."""
    period = cy.ctx.config.capacity_prices_period_s
    if period <= 0:
        return None
    ctx: PlannerContext = cy.ctx
    key = math.floor(cy.now / period)
    hit = ctx.capacity_prices_cache
    if hit is None or hit[0] != key:
        hit = ctx.capacity_prices_cache = (key, capacity_prices(cy, jobs()))
    return hit[1]
