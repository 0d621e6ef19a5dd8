"""Scheduling policies: each states its objective; shared constraints live in :class:`Cycle`.

Shared rules (all policies):

* a job starts on-prem only where the whole gang fits now (all-or-nothing),
  on nodes of one GPU type in one pool (homogeneous gang), best-fit;
* a job that no pool and no offer can ever hold is rejected with the reason;
* on-prem queue order is priority class, then team fair share (decayed
  GPU-hours / team weight), then submission time; ``fifo`` uses submission time;
* EASY backfill: the first blocked job gets a reservation (shadow time and
  nodes from the expected ends of running jobs); a later job may start now
  only if it ends before the shadow time or stays off the reserved nodes.

Policy objectives:

* ``fifo``: start in submission order; the first job that does not fit blocks the rest.
* ``backfill``: on-prem only; EASY backfill over the priority/fair-share order.
* ``cheapest``: on-prem if it fits now, else the cheapest cloud offer now (total USD).
* ``federated``: minimise the DESIGN.md §4 score over on-prem (now, a later
  window, or waiting in the queue) and every cloud offer, subject to the
  deadline, budget, price cap and gang rules; preempt lower-priority
  preemptible jobs when that scores better.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from broker.capacity import FreeIndex, shadow_time
from broker.model import Decision, DecisionKind, OptionEstimate
from broker.planner import PendingJob, PlannerContext, Snapshot
from pricing.series import window_integral

__all__ = ["POLICY_FUNCS", "Cycle"]

INF = float("inf")
N_ALTERNATIVES = 3


def _decision(job_id: str, kind: DecisionKind, **kw) -> Decision:
    return Decision.model_construct(job_id=job_id, kind=kind, option=kw.pop("option", None), pool=kw.pop("pool", None),
                                    offer_index=kw.pop("offer_index", None), allocation=kw.pop("allocation", ()),
                                    not_before=kw.pop("not_before", None), victims=kw.pop("victims", ()),
                                    alternatives=kw.pop("alternatives", ()), reason=kw.pop("reason", ""))


def _option(**kw) -> OptionEstimate:
    kw.setdefault("feasible", True)
    kw.setdefault("note", "")
    return OptionEstimate.model_construct(**kw)


class Cycle:
    """Working state of one planning cycle: a copy of free capacity plus the decisions so far."""

    def __init__(self, snap: Snapshot, ctx: PlannerContext):
        self.snap = snap
        self.ctx = ctx
        self.now = snap.now_s
        healthy = snap.healthy or [None] * len(ctx.pools)
        self.index = [FreeIndex(snap.free[p], ctx.pool_node_types(p), ctx.pool_node_mem(p), healthy[p])
                      for p in range(len(ctx.pools))]
        # per pool, per GPU type: (gpus per node) -> eligible node count, for "can it ever fit"
        self.node_sizes = []
        for p, pool in enumerate(ctx.pools):
            sizes: dict[str, list[tuple[int, float]]] = {}
            for n in pool.nodes:
                sizes.setdefault(n.gpu_type, []).append((n.gpu_count, n.gpu_memory_gb))
            self.node_sizes.append(sizes)
        self.decisions: list[Decision] = []
        self._releases: dict[int, list[tuple[float, int, int]]] | None = None
        self.team_usage = snap.team_usage
        self.weights = ctx.config.team_weight

    # ------------------------------------------------------------ ordering
    def queue_key(self, job: PendingJob):
        """Priority class (high first), fair share (low usage/weight first), age, id."""
        share = self.team_usage.get(job.team, 0.0) / self.weights.get(job.team, 1.0)
        return (-job.priority, share, job.submit_s, job.job_id)

    # ------------------------------------------------------------ capacity
    def pool_types_for(self, job: PendingJob, pool: int) -> list[str]:
        types = self.ctx.pool_types(pool)
        if job.gpu_types is None:
            return types
        return [t for t in types if t in job.gpu_types]

    def can_ever_fit(self, job: PendingJob, pool: int, gpu_type: str) -> bool:
        """True if the empty pool could hold the whole gang on ``gpu_type`` nodes."""
        n = 0
        for count, mem in self.node_sizes[pool].get(gpu_type, ()):
            if count >= job.gpus_per_node and mem >= job.min_mem_gb:
                n += 1
                if n >= job.nodes:
                    return True
        return False

    def onprem_targets(self, job: PendingJob) -> list[tuple[int, str]]:
        """(pool, gpu_type) pairs that could ever hold ``job``."""
        out = []
        for p in range(len(self.ctx.pools)):
            for t in self.pool_types_for(job, p):
                if self.can_ever_fit(job, p, t):
                    out.append((p, t))
        return out

    def releases(self, pool: int) -> list[tuple[float, int, int]]:
        """Sorted ``(expected_end_s, node, gpus)`` of running jobs in ``pool`` (computed once per cycle)."""
        if self._releases is None:
            rel: dict[int, list[tuple[float, int, int]]] = {}
            for r in self.snap.running:
                lst = rel.setdefault(r.pool, [])
                end = max(r.expected_end_s, self.now)
                for node, g in r.allocation:
                    lst.append((end, node, g))
            for lst in rel.values():
                lst.sort()
            self._releases = rel
        return self._releases.get(pool, [])

    def start(self, job: PendingJob, pool: int, gpu_type: str, nodes: list[int], option=None, alternatives=(),
              reason: str = "") -> None:
        self.index[pool].take(nodes, job.gpus_per_node)
        if option is None:
            runtime, e_cost, amort, energy, carbon = self.ctx.onprem_estimate(pool, gpu_type, job, self.now)
            option = _option(kind="onprem", target=self.ctx.pools[pool].name, start_s=self.now, wait_s=0.0,
                             runtime_s=runtime, dollars_usd=e_cost + amort, energy_kwh=energy, carbon_kg=carbon,
                             score=e_cost + (amort if self.ctx.amortised_in_score() else 0.0))
        self.decisions.append(_decision(job.job_id, DecisionKind.start, option=option, pool=self.ctx.pools[pool].name,
                                        allocation=tuple((i, job.gpus_per_node) for i in nodes),
                                        alternatives=tuple(alternatives), reason=reason))

    def try_start_now(self, job: PendingJob, targets, exclude_nodes=None, before_s: float = INF) -> bool:
        """Start ``job`` on the first target where it fits now (best-fit); respects a reservation.

        ``exclude_nodes`` maps pool -> reserved node set, ignored if the job would
        end by ``before_s`` (the reservation's shadow time).
        """
        for p, t in targets:
            excl = frozenset()
            if exclude_nodes and p in exclude_nodes:
                runtime = job.work_s / self.ctx.gpus.throughput[t]
                if self.now + runtime > before_s:
                    excl = exclude_nodes[p]
            nodes = self.index[p].find(t, job.gpus_per_node, job.nodes, job.min_mem_gb, excl)
            if nodes is not None:
                self.start(job, p, t, nodes)
                return True
        return False

    def reject(self, job: PendingJob, reason: str) -> None:
        self.decisions.append(_decision(job.job_id, DecisionKind.reject, reason=reason))


# ---------------------------------------------------------------- on-prem queue
def _run_onprem_queue(cy: Cycle, queue: list[PendingJob], backfill: bool, target_fn: Callable) -> list[PendingJob]:
    """Start queued jobs in order; with ``backfill``, EASY backfill behind the first blocked job.

    Returns the jobs still waiting, in queue order.
    """
    waiting: list[PendingJob] = []
    reservation: dict[int, frozenset[int]] | None = None
    shadow = INF
    examined_after_block = 0
    depth = cy.ctx.config.backfill_depth
    for i, job in enumerate(queue):
        targets = target_fn(job)
        if not targets:
            continue  # handled by the caller (reject / cloud)
        total_free = sum(sum(ix.total_free.values()) for ix in cy.index)
        if total_free == 0 or (reservation is not None and examined_after_block >= depth):
            waiting.extend(queue[i:])
            return waiting
        if reservation is None:
            if cy.try_start_now(job, targets):
                continue
            waiting.append(job)
            if not backfill:
                waiting.extend(queue[i + 1:])
                return waiting
            best = (INF, None, None)
            for p, t in targets:
                ts, nodes = shadow_time(cy.index[p], cy.releases(p), t, job.gpus_per_node, job.nodes,
                                        job.min_mem_gb, cy.now)
                if ts < best[0]:
                    best = (ts, p, nodes)
            shadow = best[0]
            reservation = {best[1]: frozenset(best[2])} if best[1] is not None else {}
        else:
            examined_after_block += 1
            if not cy.try_start_now(job, targets, reservation, shadow):
                waiting.append(job)
    return waiting


def _eligible(snap: Snapshot) -> list[PendingJob]:
    now = snap.now_s
    return [j for j in snap.pending if j.earliest_s <= now]


# ---------------------------------------------------------------- fifo / backfill
def plan_fifo(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """On-prem only, strict submission order, no backfill."""
    cy = Cycle(snap, ctx)
    queue = sorted(_eligible(snap), key=lambda j: (j.submit_s, j.job_id))
    queue = _reject_unplaceable(cy, queue, cloud=False)
    _run_onprem_queue(cy, queue, backfill=False, target_fn=cy.onprem_targets)
    return cy.decisions


def plan_backfill(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """On-prem only; priority, fair share, age; EASY backfill."""
    cy = Cycle(snap, ctx)
    queue = sorted(_eligible(snap), key=cy.queue_key)
    queue = _reject_unplaceable(cy, queue, cloud=False)
    _run_onprem_queue(cy, queue, backfill=True, target_fn=cy.onprem_targets)
    return cy.decisions


def _reject_unplaceable(cy: Cycle, queue: list[PendingJob], cloud: bool) -> list[PendingJob]:
    out = []
    for j in queue:
        if cy.onprem_targets(j):
            out.append(j)
        elif cloud and cy.ctx.compatible_offers(j).size:
            out.append(j)
        else:
            where = "no on-prem pool" + ("" if not cloud else " and no cloud offer")
            cy.reject(j, f"{where} can ever hold {j.nodes}x{j.gpus_per_node} GPUs "
                         f"(types={sorted(j.gpu_types) if j.gpu_types else 'any'}, min_mem={j.min_mem_gb} GB)")
    return out


# ---------------------------------------------------------------- cheapest
def plan_cheapest(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """On-prem if it fits now, else the cheapest available cloud offer now (spot where allowed)."""
    cy = Cycle(snap, ctx)
    eligible = _eligible(snap)
    committed = sorted((j for j in eligible if j.committed_pool is not None), key=lambda j: (j.submit_s, j.job_id))
    fresh = sorted((j for j in eligible if j.committed_pool is None), key=lambda j: (j.submit_s, j.job_id))
    _run_onprem_queue(cy, committed, backfill=False, target_fn=cy.onprem_targets)
    avail = snap.offer_available
    for job in _reject_unplaceable(cy, fresh, cloud=ctx.config.cloud_enabled):
        targets = cy.onprem_targets(job)
        if targets and cy.try_start_now(job, targets):
            continue
        idx = ctx.compatible_offers(job) if ctx.config.cloud_enabled else np.zeros(0, np.int64)
        if avail is not None and idx.size:
            idx = idx[avail[idx]]
        if idx.size:
            est = ctx.cloud_estimates(job, idx, cy.now)
            k = int(np.argmin(est[2]))
            opt = _cloud_option(ctx, job, idx[k], est, k, cy.now, 0.0)
            cy.decisions.append(_decision(job.job_id, DecisionKind.provision, option=opt, offer_index=int(idx[k]),
                                          reason="on-prem full; cheapest offer now"))
        elif targets:
            cy.decisions.append(_decision(job.job_id, DecisionKind.wait, pool=ctx.pools[targets[0][0]].name,
                                          not_before=INF, reason="on-prem full and no cloud offer available"))
        else:
            cy.reject(job, "no on-prem pool fits and no cloud offer is available")
    return cy.decisions


def _cloud_option(ctx: PlannerContext, job: PendingJob, offer: int, est, k: int, now: float, score: float,
                  feasible: bool = True, note: str = "") -> OptionEstimate:
    runtime, finish, dollars, energy, carbon, _ = est
    delay = float(ctx.offer_delay[offer])
    return _option(kind="cloud", target=ctx.offers[offer].offer_id, start_s=now + delay, wait_s=delay,
                   runtime_s=float(runtime[k]), dollars_usd=float(dollars[k]), energy_kwh=float(energy[k]),
                   carbon_kg=float(carbon[k]), score=float(score), feasible=feasible, note=note)


# ---------------------------------------------------------------- federated
class _PoolQueueState:
    """Demand ahead in one pool's queue, for wait estimates (fluid + release profile)."""

    __slots__ = ("gpus", "gpu_seconds")

    def __init__(self):
        self.gpus = 0
        self.gpu_seconds = 0.0


def _wait_estimate(cy: Cycle, pool: int, job: PendingJob, gpu_type: str, ahead: _PoolQueueState) -> float:
    """Expected seconds until ``job`` starts on ``pool``: the later of (a) when running jobs'
    ends free the GPUs of the queue ahead plus this job, and (b) the queue's work ahead
    spread over the pool (fluid estimate)."""
    rel = cy.releases(pool)
    need = ahead.gpus + job.gpus - cy.index[pool].total_free.get(gpu_type, 0)
    t_rel = 0.0
    if need > 0:
        got = 0
        t_rel = INF
        for end, _, g in rel:
            got += g
            if got >= need:
                t_rel = end - cy.now
                break
        if t_rel == INF:
            t_rel = (rel[-1][0] - cy.now) if rel else 0.0
    fluid = ahead.gpu_seconds / max(cy.ctx.pool_capacity[pool], 1)
    return max(t_rel, fluid, 0.0)


def plan_federated(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """The unified objective over on-prem and cloud, now or in a later window (module docstring)."""
    cy = Cycle(snap, ctx)
    cfg = ctx.config
    now = cy.now
    eligible = _eligible(snap)
    committed = sorted((j for j in eligible if j.committed_pool is not None), key=cy.queue_key)
    started_before = len(cy.decisions)
    still = _run_onprem_queue(cy, committed, backfill=True,
                              target_fn=lambda j: [(p, t) for p, t in cy.onprem_targets(j) if p == j.committed_pool])
    started_ids = {d.job_id for d in cy.decisions[started_before:]}
    # demand ahead per pool from the jobs that keep waiting
    ahead = [_PoolQueueState() for _ in ctx.pools]
    review = []
    for j in still:
        if j.review_s <= now:
            review.append(j)
        else:
            a = ahead[j.committed_pool]
            a.gpus += j.gpus
            a.gpu_seconds += j.gpus * j.work_s
    fresh = [j for j in eligible if j.committed_pool is None and j.job_id not in started_ids]
    todo = sorted(fresh + review, key=cy.queue_key)
    cloud_ok = cfg.cloud_enabled and len(ctx.offers) > 0
    avail = snap.offer_available
    budgets = dict(cfg.team_budget_usd)
    for job in todo:
        targets = cy.onprem_targets(job)
        offers = ctx.compatible_offers(job) if cloud_ok else np.zeros(0, np.int64)
        if not targets and offers.size == 0:
            cy.reject(job, f"no on-prem pool and no cloud offer can ever hold {job.nodes}x{job.gpus_per_node} GPUs "
                           f"(types={sorted(job.gpu_types) if job.gpu_types else 'any'}, min_mem={job.min_mem_gb} GB)")
            continue
        if avail is not None and offers.size:
            offers = offers[avail[offers]]
        _decide_federated(cy, job, targets, offers, ahead, budgets)
    return cy.decisions


def _decide_federated(cy: Cycle, job: PendingJob, targets, offers: np.ndarray, ahead, budgets) -> None:
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    vot_h = ctx.value_of_time(job)
    cp_kg = cfg.carbon_price_usd_per_tonne / 1000.0
    latest_finish = job.deadline_s - cfg.deadline_margin_s
    budget = budgets.get(job.team, INF)
    options: list[tuple[float, int, OptionEstimate, dict]] = []  # (score, feasibility rank, option, how)

    # --- on-prem: now, a later slot, or wait in the queue
    for p, t in targets:
        pool = ctx.pools[p]
        runtime = job.work_s / ctx.gpus.throughput[t]
        kw = job.gpus * ctx.gpus.busy_kw[t] * pool.pue
        nodes_now = cy.index[p].find(t, job.gpus_per_node, job.nodes, job.min_mem_gb)
        wait = 0.0 if nodes_now is not None else _wait_estimate(cy, p, job, t, ahead[p])
        first = now + wait
        latest_start = latest_finish - runtime
        amort = job.gpus * runtime / 3600.0 * pool.amortised_usd_per_gpu_hour
        amort_score = amort if ctx.amortised_in_score() else 0.0
        if job.deferrable and cfg.horizon_s > 0:
            k0 = math.ceil(wait / cfg.slot_s) if wait > 0 else 1
            kmax = int(min(cfg.horizon_s, max(latest_start - now, 0.0)) // cfg.slot_s)
            slots = now + cfg.slot_s * np.arange(k0, kmax + 1) if kmax >= k0 else np.zeros(0)
            starts = np.concatenate(([first], slots))
        else:
            starts = np.array([first])
        eff = ctx.pool_effective_integrals(p, starts, runtime)  # USD per kW over the window
        scores = kw * eff + amort_score + vot_h * (starts - now) / 3600.0
        scores = np.where(np.isnan(scores), INF, scores)
        k = int(np.argmin(scores))
        if k > 0 and scores[0] - scores[k] < cfg.min_defer_saving_usd:
            k = 0
        if scores[k] == INF:
            k = 0
        s = float(starts[k])
        r, e_cost, amort, energy, carbon = ctx.onprem_estimate(p, t, job, s)
        dollars = e_cost + amort
        feasible = s + r <= latest_finish and dollars <= budget
        if math.isnan(dollars) or math.isnan(carbon):
            feasible = False
        score = (e_cost + amort_score + cp_kg * carbon + vot_h * (s - now) / 3600.0) if feasible else INF
        how = {"p": p, "t": t, "nodes": nodes_now if (k == 0 and nodes_now is not None) else None,
               "wait": wait, "kind": "now" if (k == 0 and nodes_now is not None) else ("wait" if k == 0 else "defer")}
        note = {"now": "start now", "wait": f"queue; expected wait {wait / 3600:.1f} h",
                "defer": f"deferred {(s - now) / 3600:.1f} h to a cheaper/cleaner window"}[how["kind"]]
        if not feasible:
            note = "misses the deadline" if s + r > latest_finish else ("no price/carbon data" if math.isnan(score) else "over budget")
        opt = _option(kind="onprem", target=pool.name, start_s=s, wait_s=s - now, runtime_s=r, dollars_usd=dollars,
                      energy_kwh=energy, carbon_kg=carbon, score=score if feasible else float("nan"),
                      feasible=feasible, note=note)
        options.append((score, 0 if feasible else 1, opt, how, s + r))

    # --- cloud offers, provisioned now
    if offers.size:
        est = ctx.cloud_estimates(job, offers, now)
        runtime, finish, dollars, energy, carbon, usd_h = est
        score = dollars + cp_kg * carbon + vot_h * ctx.offer_delay[offers] / 3600.0
        feasible = (now + finish <= latest_finish) & (dollars <= budget) & ~np.isnan(carbon)
        if job.max_usd_per_hour is not None:
            feasible &= usd_h <= job.max_usd_per_hour
        ranked = np.where(feasible, score, INF)
        order = np.argsort(ranked, kind="stable")[:N_ALTERNATIVES + 1]
        for k in order:
            f = bool(feasible[k])
            note = "" if f else ("misses the deadline" if now + finish[k] > latest_finish else "over price cap or budget")
            opt = _cloud_option(ctx, job, int(offers[k]), est, int(k), now, score[k] if f else float("nan"), f, note)
            options.append((float(ranked[k]), 0 if f else 1, opt, {"offer": int(offers[k])}, now + float(finish[k])))
        if not feasible.any():
            # nothing meets the deadline: keep the earliest finisher as a fallback
            k = int(np.nanargmin(np.where(np.isnan(carbon), INF, finish)))
            opt = _cloud_option(ctx, job, int(offers[k]), est, k, now, float("nan"), False, "misses the deadline")
            options.append((INF, 1, opt, {"offer": int(offers[k])}, now + float(finish[k])))

    if not options:
        if targets:
            p = targets[0][0]
            cy.decisions.append(_decision(job.job_id, DecisionKind.wait, pool=ctx.pools[p].name,
                                          not_before=now + 3600.0, reason="no cloud offer available now"))
        return
    feasible_opts = [o for o in options if o[1] == 0]
    if feasible_opts:
        best = min(feasible_opts, key=lambda o: (o[0], o[2].target))
    else:  # every option misses the deadline: minimise lateness
        best = min(options, key=lambda o: (o[4], o[2].target))
    alts = tuple(o[2] for o in sorted(options, key=lambda o: (o[1], o[0], o[4])) if o is not best)[:N_ALTERNATIVES]
    opt, how = best[2], best[3]

    # --- preemption for higher-priority jobs that would otherwise wait or go to the cloud
    if (cfg.preemption and job.priority >= 2 and targets and not (opt.kind == "onprem" and how.get("kind") == "now")):
        if _try_preempt(cy, job, targets, opt, alts):
            return

    if "offer" in how:
        o = how["offer"]
        if job.team in budgets:
            budgets[job.team] -= opt.dollars_usd
        cy.decisions.append(_decision(job.job_id, DecisionKind.provision, option=opt, offer_index=o,
                                      alternatives=alts, reason="best score: cloud"))
        return
    p, t = how["p"], how["t"]
    if job.team in budgets:
        budgets[job.team] -= opt.dollars_usd
    if how["kind"] == "now":
        cy.start(job, p, t, how["nodes"], option=opt, alternatives=alts, reason="best score: on-prem now")
    elif how["kind"] == "defer":
        cy.decisions.append(_decision(job.job_id, DecisionKind.defer, option=opt, pool=ctx.pools[p].name,
                                      not_before=opt.start_s, alternatives=alts, reason=opt.note))
    else:
        a = ahead[p]
        a.gpus += job.gpus
        a.gpu_seconds += job.gpus * job.work_s
        # look again when the expected wait is over, or when the cloud must be chosen to meet the deadline
        cloud_finish = min((o[4] - now for o in options if o[2].kind == "cloud"), default=None)
        latest_switch = (job.deadline_s - cfg.deadline_margin_s - cloud_finish) if cloud_finish is not None else INF
        review = min(max(now + how["wait"], now + 600.0), max(latest_switch, now + 600.0))
        cy.decisions.append(_decision(job.job_id, DecisionKind.wait, option=opt, pool=ctx.pools[p].name,
                                      not_before=review, alternatives=alts, reason=opt.note))


def _try_preempt(cy: Cycle, job: PendingJob, targets, best_opt: OptionEstimate, alts) -> bool:
    """Preempt lower-priority preemptible on-prem jobs if that scores better than ``best_opt``.

    Only single-node jobs are placed by preemption. Victims: strictly lower priority
    class, preemptible, running for at least ``min_run_before_preempt_s`` (hysteresis:
    a job can never preempt its preemptor back). Cost: the victims' lost work since
    their last checkpoint plus the restart overhead, at the pool's cost per GPU-hour.
    """
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    if job.nodes != 1:
        return False
    for p, t in targets:
        pool = ctx.pools[p]
        ix = cy.index[p]
        by_node: dict[int, list] = {}
        for r in cy.snap.running:
            if (r.pool != p or not r.preemptible or r.priority >= job.priority
                    or now - r.started_s < cfg.min_run_before_preempt_s):
                continue
            if any(d.job_id == r.job_id for d in cy.decisions if d.kind == DecisionKind.preempt):
                continue
            for node, g in r.allocation:
                by_node.setdefault(node, []).append((r, g))
        best = None
        for node, lst in by_node.items():
            if ix.gpu_types[node] != t or ix.mem[node] < job.min_mem_gb:
                continue
            free = int(ix.free[node])
            lst = sorted(lst, key=lambda x: (now - x[0].started_s) % x[0].checkpoint_interval_s)
            victims, lost_gpu_s = [], 0.0
            for r, g in lst:
                if free >= job.gpus_per_node:
                    break
                since_ckpt = (now - r.started_s) % r.checkpoint_interval_s if r.checkpointable else now - r.started_s
                lost_gpu_s += g * (since_ckpt + cfg.restart_overhead_s)
                victims.append((r, g))
                free += g
            if free >= job.gpus_per_node and victims:
                # lost GPU-hours re-done later, at the amortised rate plus energy at today's price
                price_now = ctx.pool_price_now(p, now)
                cost = lost_gpu_s / 3600.0 * (pool.amortised_usd_per_gpu_hour
                                              + ctx.gpus.busy_kw[t] * pool.pue * price_now / 1000.0)
                if best is None or cost < best[0]:
                    best = (cost, node, victims)
        if best is None:
            continue
        cost, node, victims = best
        r_, e_cost, amort, energy, carbon = ctx.onprem_estimate(p, t, job, now)
        dollars = e_cost + amort
        score = e_cost + (amort if ctx.amortised_in_score() else 0.0) + cost + cfg.carbon_price_usd_per_tonne / 1000.0 * carbon
        if not (score < (best_opt.score if best_opt.feasible else INF)):
            continue
        for r, g in victims:
            for n2, g2 in r.allocation:
                ix.give(n2, g2)
        ix.take([node], job.gpus_per_node)
        opt = _option(kind="onprem", target=pool.name, start_s=now, wait_s=0.0, runtime_s=r_, dollars_usd=dollars + cost,
                      energy_kwh=energy, carbon_kg=carbon, score=score, note=f"preempts {len(victims)} job(s)")
        cy.decisions.append(_decision(job.job_id, DecisionKind.preempt, option=opt, pool=pool.name,
                                      allocation=((node, job.gpus_per_node),),
                                      victims=tuple(r.job_id for r, _ in victims), alternatives=(best_opt,) + tuple(alts),
                                      reason=f"preemption costs ${cost:.2f} in lost work, less than the best alternative"))
        return True
    return False


POLICY_FUNCS: dict[str, Callable[[Snapshot, PlannerContext], list[Decision]]] = {
    "fifo": plan_fifo,
    "backfill": plan_backfill,
    "cheapest": plan_cheapest,
    "federated": plan_federated,
}
