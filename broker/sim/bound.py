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

**The frontier.** :class:`BoundLP` builds the LP once; only the objective changes between the cost LP, the carbon
LP and the score LP at any carbon price ``p`` (:meth:`BoundLP.score_point`, ``simulate --sweep-carbon-price``). In
the score LP each variable is priced at its alternative of least score (the hour of its block; for cloud work, the
offer and hour of its window), which is the LP with one variable per alternative; the solution's point is that
alternative's dollars and kgCO2e, so ``score = cost + p / 1000 x carbon`` holds exactly for it. Every schedule
meeting every deadline has ``dollars + p / 1000 x kgCO2e >= score(p)``: its (carbon, cost) point lies on or above
the line of slope ``-p / 1000`` through the bound's point at ``p``, for every ``p``. As ``p`` rises the point's carbon does not rise and
its cost does not fall (parametric LP: optimality at ``p1 < p2`` gives ``(p2 - p1)(carbon1 - carbon2) >= 0``).

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

__all__ = ["BoundLP", "FrontierPoint", "LowerBound", "lower_bound", "policy_dollars_usd", "policy_score_usd",
           "ratios_to_bound", "CLI_BLOCK_H"]

_H = 3600.0
#: hours per LP time step that ``fedbroker simulate --bound`` uses: on the demo (whole Philly trace) 6 h solves
#: the three LPs in ~20 s with HiGHS's simplex, ~7 s with its interior point method (what :class:`BoundLP` uses;
#: cost bound $39.8k), 3 h in ~90 s with the simplex ($40.6k), 1 h takes many minutes (measured on a 2-core
#: machine, scipy 1.17's HiGHS)
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


def policy_dollars_usd(metrics: dict[str, float], config: PlannerConfig) -> float:
    """The dollars a simulated run's score counts, USD: ``cost_usd`` (+ ``onprem_amortised_usd`` when
    ``config.onprem_cost_basis == "amortised"``)."""
    return metrics["cost_usd"] + (metrics["onprem_amortised_usd"] if config.onprem_cost_basis == "amortised" else 0.0)


def policy_score_usd(metrics: dict[str, float], config: PlannerConfig) -> float:
    """A simulated run's score in the bound's terms, USD-equivalent.

    :func:`policy_dollars_usd` + ``carbon_price_usd_per_tonne`` / 1000 x ``carbon_kg``
    (:func:`broker.planner.costs.score`, no value of time: waiting is free within the deadline in the bound).
    """
    return float(score(policy_dollars_usd(metrics, config), metrics["carbon_kg"], 0.0, 0.0,
                       config.carbon_price_usd_per_tonne))


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


def _pareto(usd: np.ndarray, kg_per_ci: np.ndarray, zone: np.ndarray) -> np.ndarray:
    """Indices of the offers that some carbon price could make the best in their zone: those no other offer of
    the same carbon zone matches or beats in both USD and kgCO2e per unit of work (first of exact ties kept).

    Exact for the LP: an offer's kgCO2e is ``kg_per_ci x`` its zone's carbon intensity (>= 0), so a dominated
    offer's score is never below its dominator's, at any hour and any carbon price >= 0."""
    keep = []
    for z in np.unique(zone):
        idx = np.flatnonzero(zone == z)
        best_kg = math.inf
        for i in idx[np.lexsort((kg_per_ci[idx], usd[idx]))]:  # by USD, then kg
            if kg_per_ci[i] < best_kg:
                keep.append(i)
                best_kg = kg_per_ci[i]
    return np.sort(np.asarray(keep, dtype=np.int64))


@dataclass(frozen=True)
class FrontierPoint:
    """The score LP's optimum at one carbon price: a point of the bound's cost-carbon frontier.

    Every schedule meeting every deadline has ``dollars + price / 1000 x kgCO2e >= score_usd`` at that price, so the
    lines through these points bound the (cost, carbon) region any schedule can reach from below.

    Attributes:
        carbon_price_usd_per_t: the carbon price of the score, USD per tCO2e.
        cost_usd: dollars of the LP solution, USD: on-prem electricity + cloud bills (+ the pools' amortised
            capital when ``onprem_cost_basis == "amortised"``: the dollars the score counts, as in
            :func:`policy_dollars_usd`).
        carbon_kg: emissions of the LP solution, kgCO2e.
        score_usd: the LP optimum, USD-equivalent: ``cost_usd + carbon_price_usd_per_t / 1000 x carbon_kg``.
        onprem_work_fraction: share of the work done on-prem in the solution.
        solve_s: wall seconds of the solve (HiGHS and the objective's coefficients).
    """

    carbon_price_usd_per_t: float
    cost_usd: float
    carbon_kg: float
    score_usd: float
    onprem_work_fraction: float = math.nan
    solve_s: float = 0.0

    def as_json(self) -> dict[str, float]:
        """The bound's part of a results.json ``"frontier"`` entry."""
        return {"cost_usd": self.cost_usd, "carbon_kg": self.carbon_kg, "score_usd": self.score_usd,
                "onprem_work_fraction": self.onprem_work_fraction}


class BoundLP:
    """The relaxation's LP (module docstring) for one trace, built once and solved for cost, for carbon, or for the
    score at any carbon price: the constraints stay, only the objective changes.

    Args: as :func:`lower_bound`. Raises ``ValueError`` for a ``block_h`` that is not a whole number >= 1;
    :class:`broker.planner.core.PlannerError` for a pool without series. :meth:`solve_cost`,
    :meth:`solve_carbon` and :meth:`score_point` raise ``RuntimeError`` when HiGHS reports no optimum
    (infeasible: no schedule meets every deadline).

    Attributes: ``excluded``, ``classes``, ``variables``, ``constraints``, ``nonzeros`` (as :class:`LowerBound`),
    ``build_s`` (wall seconds to build), ``config`` (the :class:`PlannerConfig` of the score), ``block_h``.
    """

    def __init__(self, trace: Trace, pools: Sequence[Pool], offers: Sequence[CloudOffer], signals,
                 planner_config: PlannerConfig | None = None, gpus: GpuTable | None = None, block_h: int = 1):
        t_wall = time.perf_counter()
        if block_h < 1 or int(block_h) != block_h:
            raise ValueError(f"block_h={block_h!r}: a whole number of hours >= 1")
        self.block_h = bh = int(block_h)
        blk = bh * _H
        cfg = self.config = planner_config or PlannerConfig()
        gpus = gpus or GpuTable.from_pricing()
        ctx = PlannerContext(cfg, pools, offers, signals, gpus)
        amortised = ctx.amortised_in_score()

        # ---- classes: (release block, last block, shape) -> [work ref-GPU-hours, GPUs]
        self.excluded: dict[str, int] = {}
        classes: dict[tuple, list[float]] = {}
        shapes: dict[tuple, tuple[list[tuple[int, str]], np.ndarray, PendingJob]] = {}
        for tj in trace.jobs:
            if tj.deadline_s <= tj.submit_s:
                self.excluded["deadline not after submission"] = self.excluded.get("deadline not after submission", 0) + 1
                continue
            pj = pending_job(tj)
            shape = (pj.gpu_types, pj.gpus_per_node, pj.nodes, pj.min_mem_gb, pj.spot_ok, pj.regions)
            if shape not in shapes:
                shapes[shape] = (_targets(ctx, pj), ctx.compatible_offers(pj), pj)
            targets, compat, _ = shapes[shape]
            if not targets and compat.size == 0:
                self.excluded["no pool or offer can hold the job"] = \
                    self.excluded.get("no pool or offer can hold the job", 0) + 1
                continue
            key = (math.floor(tj.submit_s / blk), math.ceil(tj.deadline_s / blk) - 1, shape)
            acc = classes.setdefault(key, [0.0, 0.0])
            acc[0] += tj.num_gpus * tj.duration_s / _H
            acc[1] += tj.num_gpus
        self.classes = len(classes)
        self.variables = self.constraints = self.nonzeros = 0
        self.empty = not classes
        if self.empty:
            self.build_s = time.perf_counter() - t_wall
            return

        h0 = min(k[0] for k in classes)
        h1 = max(k[1] for k in classes)
        n_blk = h1 - h0 + 1  # blocks; the coefficients are computed per hour, then the least per block
        starts = np.arange(h0 * blk, (h1 + 1) * blk, _H)
        one_h = np.full(starts.size, _H)

        def per_block(a: np.ndarray) -> np.ndarray:
            """Least value of each block of hourly values (last axis)."""
            return a.reshape(a.shape[:-1] + (n_blk, bh)).min(axis=-1)

        # ---- per (pool, type): cost, carbon (and the score's dollars) of one GPU-hour in each hour (costs.onprem_cost)
        pt_list = sorted({pt for tg, _, _ in shapes.values() for pt in tg})
        pt_index = {pt: i for i, pt in enumerate(pt_list)}
        pt_cap = np.array([sum(n.gpu_count for n in ctx.pools[p].nodes if n.gpu_type == t) for p, t in pt_list],
                          float) * bh
        pt_thr = np.array([gpus.throughput[t] for _, t in pt_list])
        pt_usd, pt_kg, pt_dollars = (np.zeros((len(pt_list), starts.size)) for _ in range(3))
        for k, (p, t) in enumerate(pt_list):
            pool = ctx.pools[p]
            c = onprem_cost(one_h, gpus=1, kw=onprem_kw(1, gpus.busy_kw[t], pool.pue),
                            usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour,
                            tariff_integral=_nan0(signals.price(pool.price_zone).integrals(starts, one_h)),
                            carbon_integral=_nan0(signals.carbon(pool.carbon_zone).integrals(starts, one_h)))
            pt_usd[k] = c.energy_usd
            pt_kg[k] = c.carbon_kg
            pt_dollars[k] = c.energy_usd + (c.amortised_usd if amortised else 0.0)
        # hourly dollars and kg of the score per (pool-type, block, hour of the block)
        self._pt_dollars = pt_dollars.reshape(len(pt_list), n_blk, bh)
        self._pt_kg = pt_kg.reshape(len(pt_list), n_blk, bh)

        # ---- per offer zone: carbon intensity integral of each hour (NaN -> 0, as accounted)
        zone_ci = np.array([_nan0(s.integrals(starts, one_h)) for s in ctx.zone_carbon]) if ctx.zones \
            else np.zeros((0, 0))

        # ---- per shape, cloud per reference-GPU-hour of work (costs.cloud_cost of one job-hour, no delay, no
        # minimum) of the offers some carbon price could pick (_pareto): the bill, and kgCO2e per hour
        self._cloud: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for shape, (_, compat, rep) in shapes.items():
            if not compat.size:
                continue
            per_work = rep.nodes * rep.gpus_per_node * ctx.offer_thr[compat]  # ref-GPU-hours per job-hour
            kw = cloud_kw(rep.nodes, rep.gpus_per_node, ctx.offer_gpu_count[compat], ctx.offer_busy_kw[compat],
                          ctx.offer_idle_kw[compat], ctx.offer_pue[compat])
            usd = rep.nodes * ctx.offer_price[compat] / per_work  # cloud_cost's bill of one job-hour, per work
            keep = _pareto(usd, kw / per_work, ctx.offer_zone[compat])
            o = compat[keep]
            c = cloud_cost(_H, 0.0, usd_per_hour=rep.nodes * ctx.offer_price[o], min_billed_s=0.0, kw=kw[keep][:, None],
                           carbon_integral=zone_ci[ctx.offer_zone[o]])
            self._cloud[shape] = (c.dollars_usd / per_work[keep], c.carbon_kg / per_work[keep][:, None])

        # ---- columns
        cols_cost, cols_carbon = [], []
        eq_rows, eq_cols, eq_vals, b_eq = [], [], [], []
        ub_rows, ub_cols, ub_vals, b_ub = [], [], [], []
        n_cap = len(pt_list) * n_blk  # capacity rows first: row = pt * n_blk + block
        n_var = 0
        on_idx, on_pt, on_blk = [], [], []  # on-prem variables: index, pool-type, block
        self._cloud_vars: list[tuple[int, tuple, int, int]] = []  # cloud variables: index, shape, first/last block
        upper: list[np.ndarray] = []  # variables' upper bounds
        for ci_, ((r, d, shape), (work_h, class_gpus)) in enumerate(classes.items()):
            targets, compat, rep = shapes[shape]
            hi = np.arange(r - h0, d - h0 + 1)
            # on-prem variables: per target, per block of the window; with one target the parallelism limit is
            # the variables' upper bound, else one row per block
            par_base = len(b_ub) + n_cap
            par_rows = len(targets) > 1
            for p, t in targets:
                k = pt_index[(p, t)]
                idx = np.arange(n_var, n_var + hi.size)
                n_var += hi.size
                on_idx.append(idx)
                on_pt.append(np.full(hi.size, k))
                on_blk.append(hi)
                cols_cost.append(per_block(pt_usd[k])[hi])
                cols_carbon.append(per_block(pt_kg[k])[hi])
                eq_rows.append(np.full(hi.size, ci_))
                eq_cols.append(idx)
                eq_vals.append(np.full(hi.size, pt_thr[k]))
                ub_rows.append(k * n_blk + hi)  # capacity
                ub_cols.append(idx)
                ub_vals.append(np.ones(hi.size))
                if par_rows:
                    ub_rows.append(par_base + np.arange(hi.size))  # parallelism
                    ub_cols.append(idx)
                    ub_vals.append(np.ones(hi.size))
                upper.append(np.full(hi.size, np.inf if par_rows else class_gpus * bh))
            if par_rows:
                b_ub.extend([class_gpus * bh] * hi.size)
            # cloud: one variable, priced at the best (offer, hour) of the window for each objective
            if compat.size:
                usd, kg = self._cloud[shape]
                cols_cost.append(np.array([usd.min()]))
                cols_carbon.append(np.array([per_block(kg.min(axis=0))[hi].min()]))
                eq_rows.append(np.array([ci_]))
                eq_cols.append(np.array([n_var]))
                eq_vals.append(np.array([1.0]))
                self._cloud_vars.append((n_var, shape, int(hi[0]), int(hi[-1])))
                upper.append(np.array([np.inf]))
                n_var += 1
            b_eq.append(work_h)

        self._on = tuple(np.concatenate(a) if a else np.zeros(0, np.int64) for a in (on_idx, on_pt, on_blk))
        b_ub = np.concatenate([np.repeat(pt_cap, n_blk), np.asarray(b_ub, float)])
        self._a_ub = sp.csr_matrix((np.concatenate(ub_vals), (np.concatenate(ub_rows), np.concatenate(ub_cols))),
                                   shape=(b_ub.size, n_var)) if ub_vals else None
        self._b_ub = b_ub if self._a_ub is not None else None
        self._a_eq = sp.csr_matrix((np.concatenate(eq_vals), (np.concatenate(eq_rows), np.concatenate(eq_cols))),
                                   shape=(len(b_eq), n_var))
        self._b_eq = np.asarray(b_eq, float)
        self._bounds = np.column_stack([np.zeros(n_var), np.concatenate(upper)])
        self._c_cost, self._c_carbon = np.concatenate(cols_cost), np.concatenate(cols_carbon)
        self._cloud_idx = np.array([v for v, _, _, _ in self._cloud_vars], dtype=np.int64)
        self.variables = n_var
        self.constraints = (b_ub.size if self._b_ub is not None else 0) + self._b_eq.size
        self.nonzeros = (self._a_ub.nnz if self._a_ub is not None else 0) + self._a_eq.nnz
        self.build_s = time.perf_counter() - t_wall

    def _solve(self, cost_vec: np.ndarray):
        # interior point with crossover (a vertex solution): on the demo's LPs ~3 s each where the dual simplex
        # takes ~10 s, with the same optimum to ~1e-14 relative
        res = linprog(cost_vec, A_ub=self._a_ub, b_ub=self._b_ub, A_eq=self._a_eq, b_eq=self._b_eq,
                      bounds=self._bounds, method="highs-ipm")
        if res.status != 0:
            raise RuntimeError(f"LP bound: HiGHS status {res.status}: {res.message}")
        return res

    def solve_cost(self) -> float:
        """The least cost (on-prem electricity + cloud bills), USD."""
        return 0.0 if self.empty else float(self._solve(self._c_cost).fun)

    def solve_carbon(self) -> float:
        """The least emissions, kgCO2e."""
        return 0.0 if self.empty else float(self._solve(self._c_carbon).fun)

    def score_coefficients(self, carbon_price_usd_per_t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(score, dollars, kg)`` per variable at a carbon price (USD per tCO2e): each variable priced at the
        alternative of least score (the hour of its block; for cloud the offer and hour of its window), with
        that alternative's dollars (USD) and kgCO2e, so ``score = dollars + price / 1000 x kg`` per variable."""
        cp = carbon_price_usd_per_t
        n = self.variables
        c, d, k = np.zeros(n), np.zeros(n), np.zeros(n)
        idx, pt, blk = self._on
        if idx.size:
            s = score(self._pt_dollars, self._pt_kg, 0.0, 0.0, cp)
            j = s.argmin(axis=-1)[..., None]
            pick = lambda a: np.take_along_axis(a, j, axis=-1)[..., 0]  # noqa: E731
            c[idx], d[idx], k[idx] = pick(s)[pt, blk], pick(self._pt_dollars)[pt, blk], pick(self._pt_kg)[pt, blk]
        best: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for shape, (usd, kg) in self._cloud.items():
            s = score(usd[:, None], kg, 0.0, 0.0, cp)  # offers x hours
            o = s.argmin(axis=0)
            hrs = np.arange(s.shape[1])
            s_h, d_h, k_h = (a.reshape(-1, self.block_h) for a in (s[o, hrs], usd[o], kg[o, hrs]))
            j = s_h.argmin(axis=1)
            rows = np.arange(s_h.shape[0])
            best[shape] = (s_h[rows, j], d_h[rows, j], k_h[rows, j])
        for v, shape, lo, hi in self._cloud_vars:
            s_b, d_b, k_b = best[shape]
            i = lo + int(s_b[lo:hi + 1].argmin())
            c[v], d[v], k[v] = s_b[i], d_b[i], k_b[i]
        return c, d, k

    def score_point(self, carbon_price_usd_per_t: float) -> FrontierPoint:
        """Solve the score LP at a carbon price (USD per tCO2e, >= 0): the bound's :class:`FrontierPoint` there."""
        if not (math.isfinite(carbon_price_usd_per_t) and carbon_price_usd_per_t >= 0):
            raise ValueError(f"carbon_price_usd_per_t={carbon_price_usd_per_t!r}: a finite number >= 0")
        t0 = time.perf_counter()
        cp = float(carbon_price_usd_per_t)
        if self.empty:
            return FrontierPoint(cp, 0.0, 0.0, 0.0, solve_s=time.perf_counter() - t0)
        c, d, k = self.score_coefficients(cp)
        res = self._solve(c)
        total = float(self._b_eq.sum())
        on_work = total - float(res.x[self._cloud_idx].sum()) if self._cloud_idx.size else total
        return FrontierPoint(cp, float(d @ res.x), float(k @ res.x), float(res.fun),
                             on_work / total if total else math.nan, time.perf_counter() - t0)

    def bound(self, cost_usd: float, carbon_kg: float, point: FrontierPoint, solve_s: float = 0.0) -> LowerBound:
        """The :class:`LowerBound` of solved parts: :meth:`solve_cost`, :meth:`solve_carbon` and the score at the
        config's carbon price (:meth:`score_point`); ``solve_s``: their seconds, added to the build's."""
        return LowerBound(cost_usd=cost_usd, carbon_kg=carbon_kg, score_usd=point.score_usd,
                          carbon_price_usd_per_t=point.carbon_price_usd_per_t,
                          onprem_work_fraction=point.onprem_work_fraction, excluded=dict(self.excluded),
                          classes=self.classes, variables=self.variables, constraints=self.constraints,
                          nonzeros=self.nonzeros, solve_s=self.build_s + solve_s, block_h=self.block_h)

    def lower_bound(self) -> LowerBound:
        """Solve the three LPs (cost, carbon, score at the config's carbon price) and return the :class:`LowerBound`."""
        t0 = time.perf_counter()
        cost, carbon = self.solve_cost(), self.solve_carbon()
        point = self.score_point(self.config.carbon_price_usd_per_tonne)
        return self.bound(cost, carbon, point, time.perf_counter() - t0)


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
    a pool without series. :class:`BoundLP` builds the LP once for several objectives (the frontier).
    """
    return BoundLP(trace, pools, offers, signals, planner_config, gpus, block_h).lower_bound()
