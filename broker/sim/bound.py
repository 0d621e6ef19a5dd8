"""A lower bound on the cost, carbon and score of any schedule of a trace: a fluid LP relaxation.

:func:`lower_bound` answers "how much could the best possible schedule of these jobs on these pools
and offers cost?" so a policy's result can be read as a ratio to it (issue 11, item 2).

**The relaxation.** A job's work ``W = num_gpus x duration_s`` (reference-GPU seconds, as the
simulator's :class:`~broker.sim.traces.TraceJob` and :class:`~broker.planner.core.PendingJob` define it)
is a fluid that may be split across hours and between on-prem pools and cloud offers, inside the
whole UTC hours that its window ``[submit_s, deadline_s]`` touches, with perfect foresight:

* variables ``x[c, (p, t), h]`` >= 0: GPU-hours of pool ``p``'s GPU type ``t`` given to job class ``c``
  in hour ``h``; they do ``throughput(t) x x`` reference-GPU-hours of work. ``y[c]`` >= 0:
  reference-GPU-hours of class ``c`` done in the cloud;
* work: ``sum_{p,t,h} throughput(t) x[c,p,t,h] + y[c] = W_c / 3600`` for every class;
* on-prem capacity: ``sum_c x[c,p,t,h] <= GPUs of type t in pool p`` (GPU-hours per hour);
* parallelism: ``sum_{p,t} x[c,p,t,h] <= GPUs of the class's jobs`` (a job holds at most its
  gang's GPUs at once; a bound on the variable when the class has one target);
* objective (one LP each): cost (what the simulator's ``cost_usd`` counts: on-prem electricity
  at each hour's tariff + cloud bills), carbon (kgCO2e), or score = cost (+ the pools' amortised
  $/GPU-h when ``PlannerConfig.onprem_cost_basis == "amortised"``) + carbon price x kgCO2e.
  Every coefficient comes from :mod:`broker.planner.costs` (:func:`~broker.planner.costs.onprem_cost`,
  :func:`~broker.planner.costs.cloud_cost`) for one hour of load, the cost model the simulator
  accounts with. Cloud has no capacity limit, so a class's cloud work goes, for each objective,
  to the cheapest (compatible offer, hour of its window) pair: one variable per class suffices.

**Why it is a lower bound.** Every schedule the simulator can produce that finishes every job by
its deadline maps to a feasible LP point of no greater objective: take the GPU-hours each job used
per (pool, type, hour), and its cloud work. Capacity and parallelism hold because a schedule
respects them; its cost is at least the LP's because everything a real run pays beyond the fluid
is relaxed away, never added: provisioning delays and minimum billed seconds are not charged
(``delay_s = 0``, ``min_billed_s = 0``), spot rework and preemption losses are not charged, spot
offers are always available, jobs may start in the part of an hour before their submission, a gang
may use any GPUs of a compatible type (node sizes ignored), and cloud work is priced at the
cheapest hour of the window. A missing signal hour counts 0 (as the simulator's accounting does).

**Time steps.** With ``block_h > 1`` the hours above become blocks of ``block_h`` hours: windows widen to
whole blocks, capacity and parallelism are per block, each coefficient is the least over its block's
hours. A schedule's GPU-hours summed per block form a feasible point costing no more, so the bound
stays valid (weaker, from an LP ``block_h`` times smaller; ``simulate --bound`` uses :data:`CLI_BLOCK_H`).

**Why the aggregation keeps it.** Jobs of one class share release hour, last hour, placement shape
(GPU types, GPUs per node, nodes) and hence every coefficient; a per-job LP solution summed over a
class is a feasible point of the class LP with the same objective (constraints and costs are linear
and identical within the class; each job's parallelism limit sums to the class's), so the class LP's
optimum is at most the per-job LP's. (The two are in fact equal: split a class solution in proportion
to the jobs' work.)

**What it does not cover.** Jobs no pool and no offer can hold, and jobs whose deadline is not after
their submission, are left out of the LP and reported in :attr:`LowerBound.excluded` (reason ->
jobs): compare only runs over the same jobs. The bound is for schedules meeting every deadline: a
policy that misses deadlines can run work later (and cheaper) than the LP allows. The simulator
counts a whole on-prem run as 0 when any part of its window leaves the signal data, the bound
prices the covered hours: runs near the end of the data are the only place this differs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from broker.model import CloudOffer, Pool
from broker.planner.core import GpuTable, PendingJob, PlannerConfig, PlannerContext
from broker.planner.costs import cloud_cost, cloud_kw, onprem_cost, onprem_kw, score
from broker.sim.simulator import pending_job
from broker.sim.traces import Trace

__all__ = ["LowerBound", "lower_bound", "policy_score_usd", "ratios_to_bound", "CLI_BLOCK_H"]

_H = 3600.0
#: hours per LP time step that ``fedbroker simulate --bound`` uses: on the demo (whole Philly trace) 6 h solves
#: the three LPs in ~20 s (cost bound $39.8k), 3 h in ~90 s ($40.6k), 1 h takes many minutes (measured on a
#: 2-core machine, scipy 1.17's HiGHS)
CLI_BLOCK_H = 6


@dataclass
class LowerBound:
    """Lower bounds of one trace on one scenario (each its own LP optimum).

    Attributes:
        cost_usd: least on-prem electricity + cloud bills, USD (bounds the simulator's ``cost_usd``).
        carbon_kg: least emissions, kgCO2e.
        score_usd: least score, USD-equivalent: cost (+ amortised on-prem capital when
            ``onprem_cost_basis == "amortised"``) + carbon price x tCO2e (:func:`policy_score_usd`).
        carbon_price_usd_per_t: the carbon price of the score, USD per tCO2e.
        onprem_work_fraction: share of the work done on-prem in the score LP's solution.
        excluded: reason -> jobs left out of the LP (they can run nowhere, or have no window).
        classes: job classes (release hour, last hour, placement shape) in the LP.
        variables, constraints, nonzeros: the LP's size.
        solve_s: wall seconds for building and solving the three LPs.
        block_h: hours per LP time step.
    """

    cost_usd: float
    carbon_kg: float
    score_usd: float
    carbon_price_usd_per_t: float
    onprem_work_fraction: float = math.nan
    excluded: dict[str, int] = field(default_factory=dict)
    classes: int = 0
    variables: int = 0
    constraints: int = 0
    nonzeros: int = 0
    solve_s: float = 0.0
    block_h: int = 1

    def as_json(self) -> dict[str, float]:
        """The ``"bound"`` object of results.json: cost, carbon, score and the carbon price."""
        return {"cost_usd": self.cost_usd, "carbon_kg": self.carbon_kg, "score_usd": self.score_usd,
                "carbon_price_usd_per_t": self.carbon_price_usd_per_t}


def policy_score_usd(metrics: dict[str, float], config: PlannerConfig) -> float:
    """A simulated run's score in the bound's terms, USD-equivalent.

    ``cost_usd`` (+ ``onprem_amortised_usd`` when ``config.onprem_cost_basis == "amortised"``)
    + ``carbon_price_usd_per_tonne`` / 1000 x ``carbon_kg`` (:func:`broker.planner.costs.score`,
    no value of time: waiting is free within the deadline in the bound).
    """
    dollars = metrics["cost_usd"] + (metrics["onprem_amortised_usd"] if config.onprem_cost_basis == "amortised" else 0.0)
    return float(score(dollars, metrics["carbon_kg"], 0.0, 0.0, config.carbon_price_usd_per_tonne))


def ratios_to_bound(metrics: dict[str, float], bound: LowerBound, config: PlannerConfig) -> dict[str, float]:
    """A run's ``cost_ratio_to_bound`` (``cost_usd`` / the cost bound) and ``score_ratio_to_bound``
    (:func:`policy_score_usd` / the score bound); NaN where the bound is not positive (a ratio to
    zero or to a negative cost, possible with negative tariffs, says nothing)."""
    cost = metrics["cost_usd"] / bound.cost_usd if bound.cost_usd > 0 else math.nan
    sc = policy_score_usd(metrics, config) / bound.score_usd if bound.score_usd > 0 else math.nan
    return {"cost_ratio_to_bound": cost, "score_ratio_to_bound": sc}


def _nan0(a: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(a), 0.0, a)


def _targets(ctx: PlannerContext, job: PendingJob) -> list[tuple[int, str]]:
    """(pool, GPU type) pairs whose empty nodes could hold the whole gang (the planner's "can ever fit")."""
    out = []
    for p, pool in enumerate(ctx.pools):
        for t in ctx.pool_types(p):
            if job.gpu_types is not None and t not in job.gpu_types:
                continue
            fit = sum(1 for n in pool.nodes if n.gpu_type == t and n.gpu_count >= job.gpus_per_node
                      and n.gpu_memory_gb >= job.min_mem_gb)
            if fit >= job.nodes:
                out.append((p, t))
    return out


def lower_bound(trace: Trace, pools: Sequence[Pool], offers: Sequence[CloudOffer], signals,
                planner_config: PlannerConfig | None = None, gpus: GpuTable | None = None,
                block_h: int = 1) -> LowerBound:
    """Solve the fluid LP relaxation (module docstring) for ``trace`` on ``pools`` and ``offers``.

    Args:
        trace: the jobs (their ``submit_s``, ``deadline_s``, ``duration_s``, gang shape and GPU type).
        pools, offers: on-prem pools and cloud offers (pass no offers for an on-prem-only bound).
        signals: ``carbon(zone)`` / ``price(zone)`` hourly series provider.
        planner_config: carbon price and ``onprem_cost_basis`` of the score (default :class:`PlannerConfig`).
        gpus: GPU throughput and power (default :meth:`GpuTable.from_pricing`).
        block_h: hours per time step of the LP (>= 1). Blocks of ``block_h`` UTC hours (aligned on
            multiples of ``block_h`` hours since the epoch) replace hours: windows widen to whole blocks,
            capacity and parallelism are per block (x ``block_h``) and each coefficient is the least of its
            block's hours, so the bound stays valid and gets weaker but the LP ``block_h`` times smaller.

    Returns a :class:`LowerBound` (all zeros when no job is left). Raises ``RuntimeError`` when HiGHS
    reports no optimum: infeasible when jobs without a compatible offer cannot all finish on-prem by
    their deadlines (no schedule meets every deadline); :class:`broker.planner.core.PlannerError` for
    a pool without series.
    """
    t_wall = time.perf_counter()
    if block_h < 1 or int(block_h) != block_h:
        raise ValueError(f"block_h={block_h!r}: a whole number of hours >= 1")
    blk = int(block_h) * _H
    cfg = planner_config or PlannerConfig()
    gpus = gpus or GpuTable.from_pricing()
    ctx = PlannerContext(cfg, pools, offers, signals, gpus)
    cp = cfg.carbon_price_usd_per_tonne
    amortised = ctx.amortised_in_score()

    # ---- classes: (release hour, last hour, shape) -> [work ref-GPU-hours, GPUs]
    excluded: dict[str, int] = {}
    classes: dict[tuple, list[float]] = {}
    shapes: dict[tuple, tuple[list[tuple[int, str]], np.ndarray, PendingJob]] = {}
    for tj in trace.jobs:
        if tj.deadline_s <= tj.submit_s:
            excluded["deadline not after submission"] = excluded.get("deadline not after submission", 0) + 1
            continue
        pj = pending_job(tj)
        shape = (pj.gpu_types, pj.gpus_per_node, pj.nodes, pj.min_mem_gb, pj.spot_ok, pj.regions)
        if shape not in shapes:
            shapes[shape] = (_targets(ctx, pj), ctx.compatible_offers(pj), pj)
        targets, compat, _ = shapes[shape]
        if not targets and compat.size == 0:
            excluded["no pool or offer can hold the job"] = excluded.get("no pool or offer can hold the job", 0) + 1
            continue
        key = (math.floor(tj.submit_s / blk), math.ceil(tj.deadline_s / blk) - 1, shape)
        acc = classes.setdefault(key, [0.0, 0.0])
        acc[0] += tj.num_gpus * tj.duration_s / _H
        acc[1] += tj.num_gpus
    if not classes:
        return LowerBound(0.0, 0.0, 0.0, cp, excluded=excluded, solve_s=time.perf_counter() - t_wall,
                          block_h=int(block_h))

    h0 = min(k[0] for k in classes)
    h1 = max(k[1] for k in classes)
    hours = np.arange(h0, h1 + 1)  # blocks; the coefficients are computed per hour, then the least per block
    starts = np.arange(h0 * blk, (h1 + 1) * blk, _H)
    one_h = np.full(starts.size, _H)

    def per_block(a: np.ndarray) -> np.ndarray:
        """Least value of each block of hourly values (last axis)."""
        return a.reshape(a.shape[:-1] + (hours.size, int(block_h))).min(axis=-1)

    # ---- per (pool, type): cost, carbon, amortised of one GPU-hour in each hour (costs.onprem_cost)
    pt_list = sorted({pt for tg, _, _ in shapes.values() for pt in tg})
    pt_index = {pt: i for i, pt in enumerate(pt_list)}
    pt_cap = np.array([sum(n.gpu_count for n in ctx.pools[p].nodes if n.gpu_type == t) for p, t in pt_list],
                      float) * block_h
    pt_thr = np.array([gpus.throughput[t] for _, t in pt_list])
    pt_cost, pt_carbon, pt_score = [], [], []
    for p, t in pt_list:
        pool = ctx.pools[p]
        c = onprem_cost(one_h, gpus=1, kw=onprem_kw(1, gpus.busy_kw[t], pool.pue),
                        usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour,
                        tariff_integral=_nan0(signals.price(pool.price_zone).integrals(starts, one_h)),
                        carbon_integral=_nan0(signals.carbon(pool.carbon_zone).integrals(starts, one_h)))
        pt_cost.append(per_block(c.energy_usd))
        pt_carbon.append(per_block(c.carbon_kg))
        pt_score.append(per_block(score(c.energy_usd + (c.amortised_usd if amortised else 0.0), c.carbon_kg,
                                        0.0, 0.0, cp)))

    # ---- per offer zone: carbon intensity integral of each hour (NaN -> 0, as accounted)
    zone_ci = np.array([_nan0(s.integrals(starts, one_h)) for s in ctx.zone_carbon]) if ctx.zones else np.zeros((0, 0))

    # ---- per shape, cloud per reference-GPU-hour of work (costs.cloud_cost of one job-hour, no delay, no
    # minimum): the cheapest bill, and per hour the least kgCO2e and the least score over compatible offers
    cloud_best: dict[tuple, tuple[float, np.ndarray, np.ndarray]] = {}
    for shape, (_, compat, rep) in shapes.items():
        if not compat.size:
            continue
        per_work = rep.nodes * rep.gpus_per_node * ctx.offer_thr[compat]  # ref-GPU-hours per job-hour
        c = cloud_cost(_H, 0.0, usd_per_hour=rep.nodes * ctx.offer_price[compat], min_billed_s=0.0,
                       kw=cloud_kw(rep.nodes, rep.gpus_per_node, ctx.offer_gpu_count[compat],
                                   ctx.offer_busy_kw[compat], ctx.offer_idle_kw[compat], ctx.offer_pue[compat])[:, None],
                       carbon_integral=zone_ci[ctx.offer_zone[compat]])
        usd = c.dollars_usd / per_work
        kg = c.carbon_kg / per_work[:, None]
        cloud_best[shape] = (float(usd.min()), per_block(kg.min(axis=0)),
                             per_block(score(usd[:, None], kg, 0.0, 0.0, cp).min(axis=0)))

    # ---- columns
    cols_cost, cols_carbon, cols_score = [], [], []
    eq_rows, eq_cols, eq_vals, b_eq = [], [], [], []
    ub_rows, ub_cols, ub_vals, b_ub = [], [], [], []
    n_cap = len(pt_list) * hours.size  # capacity rows first: row = pt * n_hours + hour
    n_var = 0
    cloud_vars: list[int] = []
    upper: list[np.ndarray] = []  # variables' upper bounds
    for ci_, ((r, d, shape), (work_h, class_gpus)) in enumerate(classes.items()):
        targets, compat, rep = shapes[shape]
        hi = np.arange(r - h0, d - h0 + 1)
        # on-prem variables: per target, per hour of the window; with one target the parallelism limit is
        # the variables' upper bound, else one row per hour
        par_base = len(b_ub) + n_cap
        par_rows = len(targets) > 1
        for p, t in targets:
            k = pt_index[(p, t)]
            idx = np.arange(n_var, n_var + hi.size)
            n_var += hi.size
            cols_cost.append(pt_cost[k][hi])
            cols_carbon.append(pt_carbon[k][hi])
            cols_score.append(pt_score[k][hi])
            eq_rows.append(np.full(hi.size, ci_))
            eq_cols.append(idx)
            eq_vals.append(np.full(hi.size, pt_thr[k]))
            ub_rows.append(k * hours.size + hi)  # capacity
            ub_cols.append(idx)
            ub_vals.append(np.ones(hi.size))
            if par_rows:
                ub_rows.append(par_base + np.arange(hi.size))  # parallelism
                ub_cols.append(idx)
                ub_vals.append(np.ones(hi.size))
            upper.append(np.full(hi.size, np.inf if par_rows else class_gpus * block_h))
        if par_rows:
            b_ub.extend([class_gpus * block_h] * hi.size)
        # cloud: one variable, priced at the best (offer, hour) of the window for each objective
        if compat.size:
            usd, kg_h, score_h = cloud_best[shape]
            cols_cost.append(np.array([usd]))
            cols_carbon.append(np.array([kg_h[hi].min()]))
            cols_score.append(np.array([score_h[hi].min()]))
            eq_rows.append(np.array([ci_]))
            eq_cols.append(np.array([n_var]))
            eq_vals.append(np.array([1.0]))
            cloud_vars.append(n_var)
            upper.append(np.array([np.inf]))
            n_var += 1
        b_eq.append(work_h)

    b_ub = np.concatenate([np.repeat(pt_cap, hours.size), np.asarray(b_ub, float)])
    a_ub = sp.csr_matrix((np.concatenate(ub_vals), (np.concatenate(ub_rows), np.concatenate(ub_cols))),
                         shape=(b_ub.size, n_var)) if ub_vals else None
    a_eq = sp.csr_matrix((np.concatenate(eq_vals), (np.concatenate(eq_rows), np.concatenate(eq_cols))),
                         shape=(len(b_eq), n_var))
    b_eq = np.asarray(b_eq, float)
    if a_ub is None:
        b_ub = None

    var_bounds = np.column_stack([np.zeros(n_var), np.concatenate(upper)])

    def solve(cost_vec: np.ndarray):
        res = linprog(cost_vec, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=var_bounds, method="highs")
        if res.status != 0:
            raise RuntimeError(f"LP bound: HiGHS status {res.status}: {res.message}")
        return res

    c_cost, c_carbon, c_score = (np.concatenate(c) for c in (cols_cost, cols_carbon, cols_score))
    r_cost, r_carbon, r_score = solve(c_cost), solve(c_carbon), solve(c_score)
    total_work = float(b_eq.sum())
    on_work = total_work - float(r_score.x[cloud_vars].sum()) if cloud_vars else total_work
    nnz = (a_ub.nnz if a_ub is not None else 0) + a_eq.nnz
    return LowerBound(cost_usd=float(r_cost.fun), carbon_kg=float(r_carbon.fun), score_usd=float(r_score.fun),
                      carbon_price_usd_per_t=cp, onprem_work_fraction=on_work / total_work if total_work else math.nan,
                      excluded=excluded, classes=len(classes), variables=n_var,
                      constraints=(b_ub.size if b_ub is not None else 0) + b_eq.size, nonzeros=nnz,
                      solve_s=time.perf_counter() - t_wall, block_h=int(block_h))
