"""The ``federated`` policy: the product's decision (ARCHITECTURE.md §4).

For every job needing a decision it minimises, over on-prem (start now, a later
cheaper/cleaner slot, or waiting in the queue) and every available cloud offer::

    score = dollars + carbon_price x kgCO2e + value_of_time x wait

subject to the deadline (pessimistic spot finish), the remaining cloud budgets of the job's team and project
(``PlannerConfig.team_budget_usd``, ``project_budget_usd``: cloud options only; a capped team or project runs
on-prem), price cap and
gang rules, and preempts lower-priority preemptible jobs when that scores better
(single-node jobs, hysteresis: strictly lower class, a minimum run since start).

How a 100k-job cycle stays near a second (measured in BENCHMARKS.md):

* jobs are scanned in queue order; jobs that fit now get their nodes set aside,
  jobs that may preempt are decided at once;
* the rest are decided per *shape* (GPU types, gang, memory, market, regions,
  checkpointing, priority, a x1.5 work bucket) with NumPy: wait estimates from the
  release profile, exact on-prem costs, the best start slot from a per-shape slot
  table, exact costs on the shape's top-ranked cloud offers, and the choice;
* explanations (the best rejected options) of batch decisions are built on read;
* a team's (and a project's) remaining cloud budget is charged by the batch's cloud decisions in queue
  order; one that does not fit is decided again alone against what is left.

The budget rule has one home here: the caps that hold a job are its team's and its project's
(:func:`_budget_keys`); what it may still spend is the smaller of what they have left (:func:`_budget_left`,
the team's on a tie), and a cloud decision is charged to every one of them (:func:`_spend`).

Shared machinery (capacity index, queue pass, reservations) is in :mod:`broker.planner.policy_base`;
the cost model and the score in :mod:`broker.planner.costs`.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from broker.model import Decision, DecisionKind, LazyOptions, OptionEstimate
from broker.planner.capacity import shadow_time
from broker.planner.core import PendingJob, PlannerContext, Snapshot
from broker.planner.costs import load_tariff_usd, onprem_kw, score
from broker.planner.policy_base import (INF, N_ALTERNATIVES, NAN, NO_OFFERS, Cycle, eligible_jobs, merged_queue,
                                        never_fits_reason, run_onprem_queue, urgency_bucket, work_bucket)

__all__ = ["plan_federated", "CLOUD_TOP", "BUDGET_CAP_NOTE", "PROJECT_CAP_NOTE", "MISSES_DEADLINE_NOTE"]

#: the top offers of a shape's ranking costed exactly for every job of the shape
CLOUD_TOP = 16
_NOTE_NOW = "start now"
#: how an explanation starts when a team's cloud budget (``PlannerConfig.team_budget_usd``) kept the cloud out
BUDGET_CAP_NOTE = "team budget cap reached"
#: how an explanation starts when a project's cloud budget (``PlannerConfig.project_budget_usd``) kept it out
PROJECT_CAP_NOTE = "project budget cap reached"
#: how a decision's reason starts when every option misses the job's deadline (the earliest finish was chosen)
MISSES_DEADLINE_NOTE = "misses the deadline: no option finishes by it, the earliest finish was chosen; "
#: notes of feasible on-prem options (the record's wait_s / start_s carry the numbers)
_NOTES = {"now": _NOTE_NOW, "wait": "wait in the on-prem queue",
          "defer": "deferred to a cheaper/cleaner window"}

class _PoolQueueState:
    """Demand ahead in one pool's queue, for wait estimates (fluid + release profile).

    ``gpus`` and ``gpu_seconds``: the whole queue (GPUs; reference-GPU-seconds x GPUs). With
    ``PlannerConfig.wait_ahead == "urgency"``, ``keys`` (sorted ``(-priority, urgency bucket)``) and
    the cumulative ``cum_gpus`` / ``cum_gpu_seconds`` over them give the part a job queues behind
    (:meth:`for_jobs`)."""

    __slots__ = ("gpus", "gpu_seconds", "keys", "cum_gpus", "cum_gpu_seconds", "started", "foreign")

    def __init__(self):
        self.gpus = 0
        self.gpu_seconds = 0.0
        self.keys: list[tuple[int, float]] | None = None
        self.cum_gpus = self.cum_gpu_seconds = None
        self.started = (0.0, 0.0)
        #: the pool's own scheduler queue (``Snapshot.foreign_demand``), included in ``gpus``/``gpu_seconds``
        self.foreign = (0.0, 0.0)

    def add_foreign(self, gpus: float, gpu_seconds: float) -> None:
        """Work in the pool's own queue that is not the broker's: ahead of every job (:meth:`for_jobs`)."""
        self.foreign = (gpus, gpu_seconds)
        self.gpus += gpus
        self.gpu_seconds += gpu_seconds

    def set_urgency(self, demand: dict[tuple[int, float], list[float]], started: tuple[float, float]) -> None:
        """Per ``(priority, bucket)`` demand ``[GPUs, GPU-seconds]`` of the queue, and what of it started this cycle."""
        items = sorted(((-pr, b), v) for (pr, b), v in demand.items())
        self.keys = [k for k, _ in items]
        self.cum_gpus = np.cumsum([v[0] for _, v in items]) if items else np.zeros(0)
        self.cum_gpu_seconds = np.cumsum([v[1] for _, v in items]) if items else np.zeros(0)
        self.started = started

    def for_jobs(self, jobs: list[PendingJob], bucket_s: float) -> tuple[np.ndarray, np.ndarray]:
        """``(GPUs, GPU-seconds)`` ahead of each of ``jobs`` (arrays ``(n,)``): the whole queue, or with
        urgency keys the jobs of a higher class or of its class with an urgency bucket at most its own, less
        what started this cycle (started jobs are the queue's head), plus the foreign queue, never above the
        whole queue."""
        n = len(jobs)
        if self.keys is None:
            return np.full(n, float(self.gpus)), np.full(n, float(self.gpu_seconds))
        g, gs = np.zeros(n), np.zeros(n)
        for i, j in enumerate(jobs):
            k = bisect.bisect_right(self.keys, (-j.priority, urgency_bucket(j, bucket_s)))
            if k:
                g[i], gs[i] = self.cum_gpus[k - 1], self.cum_gpu_seconds[k - 1]
        return (np.minimum(np.maximum(g - self.started[0], 0.0) + self.foreign[0], self.gpus),
                np.minimum(np.maximum(gs - self.started[1], 0.0) + self.foreign[1], self.gpu_seconds))


def plan_federated(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """The unified objective over on-prem and cloud, now or in a later window (module docstring).

    1. The on-prem queue (jobs that chose to wait, those due for review among them) starts
       what fits, with EASY backfill; the top blocked job holds the reservation.
    2. Every job needing a decision (new, woken from a deferral, requeued, or due for
       review) is costed over all options and gets one decision. Fresh jobs that fit
       now may not take the reserved nodes unless they end before the shadow time.
    """
    cy = Cycle(snap, ctx)
    cfg = ctx.config
    now = cy.now
    eligible = eligible_jobs(snap)
    committed = [j for j in eligible if j.committed_pool is not None and j.review_s > now]
    review = [j for j in eligible if j.committed_pool is not None and j.review_s <= now]
    fresh = [j for j in eligible if j.committed_pool is None]
    late: list[PendingJob] = []
    # jobs due for review stay in the queue pass: one that fits now starts, and the top blocked job holds
    # its reservation even in the cycle it is reviewed (else fresh jobs of any team could take its nodes)
    res = run_onprem_queue(cy, merged_queue(cy, committed + review, cy.urgency_key), backfill=True,
                           target_fn=lambda j: [(p, t) for p, t in cy.onprem_targets(j) if p == j.committed_pool],
                           late=late)
    if review:
        started = {d.job_id for d in cy.decisions}  # the pass decides starts only
        for j in review:  # a review job is not in the queue's demand: its start is not subtracted from it
            if j.job_id in started:
                acc = res.started[j.committed_pool]
                acc[0] -= j.gpus
                acc[1] -= j.gpus * j.work_s
        late_ids = {j.job_id for j in late}
        review = [j for j in review if j.job_id not in started and j.job_id not in late_ids]
    review = review + late
    cy.reservation, cy.shadow_s = res.reservation, res.shadow_s
    if res.reservation and res.blocked and res.blocked[0].review_s <= now:
        cy.reservation_holder = res.blocked[0].job_id  # due for review: decided below, starts at the shadow time
    # demand ahead per pool: everything still waiting in the committed queue
    ahead = [_PoolQueueState() for _ in ctx.pools]
    qd = snap.queued_demand
    # per (priority, urgency bucket) for wait_ahead="urgency"; it also gives the totals when the caller keeps none
    urg = _urgency_demand(snap, committed, cfg.urgency_bucket_s) if cfg.wait_ahead == "urgency" else None
    if qd is None and urg is not None:
        qd = {p: [sum(v[0] for v in d.values()), sum(v[1] for v in d.values())] for p, d in urg.items()}
    elif qd is None:
        qd = {}
        for j in committed:
            acc = qd.setdefault(j.committed_pool, [0.0, 0.0])
            acc[0] += j.gpus
            acc[1] += j.gpus * j.work_s
        for group in (snap.queued or {}).values():
            for j in group:
                if j.committed_pool is not None:
                    acc = qd.setdefault(j.committed_pool, [0.0, 0.0])
                    acc[0] += j.gpus
                    acc[1] += j.gpus * j.work_s
    else:  # the caller's totals cover ``queued``; add the committed jobs passed in ``pending``
        qd = {p: list(v) for p, v in qd.items()}
        for j in committed:
            acc = qd.setdefault(j.committed_pool, [0.0, 0.0])
            acc[0] += j.gpus
            acc[1] += j.gpus * j.work_s
    for j in late:
        acc = res.started.setdefault(j.committed_pool, [0.0, 0.0])
        acc[0] += j.gpus
        acc[1] += j.gpus * j.work_s
    for p, (g, gs) in qd.items():
        st = res.started.get(p, (0.0, 0.0))
        ahead[p].gpus = max(g - st[0], 0.0)
        ahead[p].gpu_seconds = max(gs - st[1], 0.0)
    for p, (g, gs) in (snap.foreign_demand or {}).items():
        ahead[p].add_foreign(float(g), float(gs))
    if urg is not None:
        for p, demand in urg.items():
            st = res.started.get(p, (0.0, 0.0))
            ahead[p].set_urgency(demand, (st[0], st[1]))
    todo = sorted(fresh + review, key=cy.urgency_key)
    cloud_ok = cfg.cloud_enabled and len(ctx.offers) > 0
    budgets = _budgets(cfg)
    batches: dict[tuple, list] = {}
    tentative: list[tuple[int, list[int], int]] = []  # (pool, nodes, GPUs per node) set aside while batching
    by_shape: dict[tuple, tuple] = {}  # placement shape -> (on-prem targets, compatible offers, available offers)
    for job in todo:
        sk = (job.gpu_types, job.gpus_per_node, job.nodes, job.min_mem_gb, job.spot_ok, job.regions)
        hit = by_shape.get(sk)
        if hit is None:
            compat = ctx.compatible_offers(job) if cloud_ok else NO_OFFERS
            hit = by_shape[sk] = (cy.onprem_targets(job), compat, cy.available(compat))
        targets, compat, offers = hit
        if not targets and compat.size == 0:
            cy.reject(job, never_fits_reason(job, cloud=cloud_ok))
            continue
        if not targets and offers.size == 0:
            continue  # only the cloud can hold it and no offer is available now: no decision this cycle
        # Jobs that may preempt are decided at once, in queue order. The others cannot change
        # the capacity (jobs that fit now set their nodes aside) or each other's options this
        # cycle: they are decided together, per shape, vectorised; a budgeted team's cloud
        # decisions are then charged to its budget in order (_charge_budgets).
        free_now, fits, ti = [], [], None
        for k, (p, t) in enumerate(targets):
            f = cy.index[p].total_free.get(t, 0)
            free_now.append(f)
            nodes = cy.fit_now(job, p, t) if f >= job.gpus else None
            fits.append(nodes)
            if ti is None and nodes is not None:
                ti = k
        if job.priority >= 2:
            _decide_federated(cy, [job], targets, offers, ahead, budgets, [fits], [free_now])
        else:
            if ti is not None:
                # it fits now: set its nodes aside (they are handed back before its batch is
                # decided, and taken again if it starts now), keep one target to fit on
                p, t = targets[ti]
                cy.index[p].take(fits[ti], job.gpus_per_node)
                tentative.append((p, fits[ti], job.gpus_per_node))
                fits = [f if k == ti else None for k, f in enumerate(fits)]
            key = (sk, job.checkpointable, job.checkpoint_interval_s, job.priority, job.deferrable, job.deferred_once,
                   job.max_usd_per_hour, work_bucket(job.work_s), ti is not None)
            b = batches.get(key)
            if b is None:
                b = batches[key] = [[], targets, offers, [], []]
            b[0].append(job)
            b[3].append(fits)
            b[4].append(free_now)
    for p, nodes, g in tentative:  # hand back what was set aside: the decisions below take it again
        for i in nodes:
            cy.index[p].give(i, g)
    for jobs, targets, offers, fits, free_now in batches.values():
        n0 = len(cy.decisions)
        _decide_federated(cy, jobs, targets, offers, ahead, {}, fits, free_now)
        if budgets:
            _charge_budgets(cy, n0, jobs, targets, offers, ahead, budgets)
    return cy.decisions


def _urgency_demand(snap: Snapshot, committed: list[PendingJob], bucket_s: float) -> dict[int, dict]:
    """Pool -> ``(priority, urgency bucket)`` -> ``[GPUs, GPU-seconds]`` of the committed jobs: the caller's
    ``Snapshot.queued_demand_by_urgency``, or sums over ``Snapshot.queued`` (O(queue); each group's key,
    :func:`~broker.planner.policy_base.queue_group`, gives its priority and bucket) when the caller keeps none;
    plus ``committed`` (committed jobs passed in ``pending``)."""
    out: dict[int, dict] = {}
    by = snap.queued_demand_by_urgency
    if by is not None:
        for p, d in by.items():
            out[p] = {k: [v[0], v[1]] for k, v in d.items()}
    else:
        for (prio, _team, bucket), group in (snap.queued or {}).items():
            last, g_sum, gs_sum = None, 0.0, 0.0  # a group's jobs mostly share a pool: add per run of one pool
            for j in group:
                p = j.committed_pool
                if p is None:
                    continue
                if p != last:
                    if last is not None:
                        acc = out.setdefault(last, {}).setdefault((prio, bucket), [0.0, 0.0])
                        acc[0] += g_sum
                        acc[1] += gs_sum
                    last, g_sum, gs_sum = p, 0.0, 0.0
                g = j.gpus_per_node * j.nodes
                g_sum += g
                gs_sum += g * j.work_s
            if last is not None:
                acc = out.setdefault(last, {}).setdefault((prio, bucket), [0.0, 0.0])
                acc[0] += g_sum
                acc[1] += gs_sum
    for j in committed:
        if j.committed_pool is not None:
            acc = out.setdefault(j.committed_pool, {}).setdefault((j.priority, urgency_bucket(j, bucket_s)), [0.0, 0.0])
            acc[0] += j.gpus
            acc[1] += j.gpus * j.work_s
    return out


def _budgets(cfg) -> dict:
    """The cycle's working copy of the caps, USD left: ``team -> USD`` and ``(team, project) -> USD``."""
    out: dict = dict(cfg.team_budget_usd)
    for team, projects in cfg.project_budget_usd.items():
        for project, left in projects.items():
            out[(team, project)] = left
    return out


def _budget_keys(job: PendingJob, budgets: dict) -> list:
    """The caps that hold ``job``'s cloud spend: its team's and its project's, those that have a budget."""
    keys = [job.team] if job.team in budgets else []
    if job.project is not None and (job.team, job.project) in budgets:
        keys.append((job.team, job.project))
    return keys


def _budget_left(job: PendingJob, budgets: dict) -> tuple[float, object]:
    """``(USD the job may still spend on the cloud, the cap that bounds it)``: the least left of its caps (the
    team's on a tie); ``(inf, None)`` when neither its team nor its project has a budget."""
    keys = _budget_keys(job, budgets)
    if not keys:
        return INF, None
    key = min(keys, key=lambda k: budgets[k])
    return budgets[key], key


def _spend(job: PendingJob, budgets: dict, usd: float) -> None:
    """Charge a cloud decision of ``usd`` to every cap of ``job`` (its later jobs see what is left)."""
    for k in _budget_keys(job, budgets):
        budgets[k] -= usd


def _cap_name(key) -> str:
    """``"team T"`` or ``"project P of team T"`` for a key of :func:`_budgets`."""
    return f"project {key[1]} of team {key[0]}" if isinstance(key, tuple) else f"team {key}"


def _cap_note(key, left: float, blocked=None) -> str:
    """The start of an explanation when a cloud budget (``key``: a team or a ``(team, project)``) kept the cloud
    out (``blocked``: the cheapest cloud option it ruled out)."""
    head = PROJECT_CAP_NOTE if isinstance(key, tuple) else BUDGET_CAP_NOTE
    return (f"{head}: {_cap_name(key)} has ${max(left, 0.0):.2f} of its cloud budget left this month"
            + (f" and cloud offer {blocked.target} would cost ${blocked.dollars_usd:.2f}" if blocked is not None else "")
            + "; no new cloud spend, the job waits for on-prem capacity or its deadline; ")


def _charge_budgets(cy: Cycle, n0: int, jobs: list[PendingJob], targets, offers: np.ndarray, ahead, budgets) -> None:
    """Charge the cloud decisions of a batch (``cy.decisions[n0:]``, decided without budgets) to their teams'
    and projects' budgets (:func:`_spend`), in queue order. A decision over what is left is taken back and its job decided again, alone,
    against the budget (:func:`_choose`): with the offers when some budget is left (a cheaper offer may fit),
    among its on-prem options only when none is. On-prem decisions are unchanged: a budget only removes cloud
    options, and the best option of a set stays the best of any subset holding it."""
    by_id = {j.job_id: j for j in jobs}
    keep, over = [], []
    for d in cy.decisions[n0:]:
        j = by_id.get(d.job_id)
        if d.kind is DecisionKind.provision and j is not None and _budget_keys(j, budgets):
            if d.option.dollars_usd <= _budget_left(j, budgets)[0]:
                _spend(j, budgets, d.option.dollars_usd)
            else:
                over.append((j, d))
                continue
        keep.append(d)
    if not over:
        return
    del cy.decisions[n0:]
    cy.decisions.extend(keep)
    for j, d in over:
        left, key = _budget_left(j, budgets)
        free_now, fits = [], []
        for p, t in targets:
            f = cy.index[p].total_free.get(t, 0)
            free_now.append(f)
            fits.append(cy.fit_now(j, p, t) if f >= j.gpus else None)
        n1 = len(cy.decisions)
        _decide_federated(cy, [j], targets, offers if left > 0 else NO_OFFERS, ahead, budgets, [fits], [free_now])
        if left <= 0:
            for nd in cy.decisions[n1:]:  # name the cloud option the spent budget ruled out
                if nd.job_id == j.job_id and nd.reason.startswith(_cap_note(key, left)):
                    nd.reason = _cap_note(key, left, d.option) + nd.reason[len(_cap_note(key, left)):]


#: codes of on-prem option kinds in the vectorised decision
_NOW, _WAIT, _DEFER = 0, 1, 2
_KIND_NAMES = ("now", "wait", "defer")


def _onprem_columns(cy: Cycle, jobs, targets, ahead, fits, free_now, work, latest_finish, vot_h):
    """On-prem option per (job, target), vectorised over ``jobs`` of one shape.

    Two waits of a job that does not fit now:

    * the options are judged on an optimistic wait: a job short enough to backfill (it would end
      before the reservation's shadow time), or any job when the pool has no reservation, waits
      only until running jobs' expected ends free its own GPUs; otherwise also the queue ahead:
      the later of (a) the release time of the GPUs of the queue ahead plus its own and (b) the
      queue's work spread over the pool (fluid estimate). Optimism is safe here: the estimate only
      picks between waiting and the cloud, and a waiting job is reviewed again at the latest
      instant the cloud can still meet its deadline;
    * the record of a wait (its start, wait, costs; what ``explain`` shows) gives the expected
      start: the reservation's shadow time (:func:`shadow_time`, node by node) when the job would
      hold it (nobody waits for the pool) or holds it (reviewed this cycle); the release of its own
      GPUs when it could backfill; else the queue ahead as above. A pool without a reservation
      whose queue is full of waiting jobs no longer counts as "backfillable" here, which is how a
      job that could not start once said "expected wait 0 min". (Judging on the expected start
      instead moved the demo: federated +11 % carbon, mean wait -82 %; see the h11-fair report.)

    A job may instead be deferred to the best start slot of the horizon.

    Returns a list of dicts of arrays over jobs, one per target.
    """
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    cp = cfg.carbon_price_usd_per_tonne
    amort_in = ctx.amortised_in_score()
    job0 = jobs[0]
    n = len(jobs)
    cols = []
    deferrable = job0.deferrable and not job0.deferred_once and cfg.horizon_s > 0
    ahead_by_pool = {p: ahead[p].for_jobs(jobs, cfg.urgency_bucket_s) for p in {p for p, _ in targets}}
    for ti, (p, t) in enumerate(targets):
        runtime = work / ctx.gpus.throughput[t]
        fit = np.array([f[ti] is not None for f in fits], dtype=bool)
        fnow = np.array([f[ti] for f in free_now], dtype=np.float64)
        # Two waits of a job that does not fit now (docstring): ``wait_opt``, on which the options are
        # judged, and ``expect``, the expected start its record shows.
        reserved = p in cy.reservation
        ends_before = now + runtime <= cy.shadow_s
        times, cum = cy.release_arrays(p)
        opt = np.full(n, not reserved) | ends_before
        ahead_g, ahead_gs = ahead_by_pool[p]  # per job: the whole queue, or what it queues behind (wait_ahead)
        # the pool's own scheduler queue (not the broker's) is ahead even of a job nobody of ours blocks
        own_g, own_gs = ahead[p].foreign
        wait_opt = _release_wait(cy, p, np.where(opt, own_g, ahead_g) + job0.gpus - fnow, times, cum)
        wait_opt = np.maximum(wait_opt, np.where(opt, own_gs, ahead_gs) / max(ctx.pool_capacity[p], 1))
        backfillable = np.full(n, reserved) & ends_before
        alone = np.full(n, not reserved) & (ahead_g <= 0)
        t_rel = _release_wait(cy, p, np.where(backfillable | alone, own_g, ahead_g) + job0.gpus - fnow, times, cum)
        if (alone & ~fit).any():
            # nobody waits for this pool: a job that does not fit now is the top blocked job and
            # holds the reservation from its shadow time (node by node, not only GPU counts)
            ts, _ = shadow_time(cy.index[p], cy.releases(p), t, job0.gpus_per_node, job0.nodes, job0.min_mem_gb, now)
            if ts < INF:
                t_rel = np.where(alone, np.maximum(t_rel, ts - now), t_rel)
        fluid = np.where(backfillable | alone, own_gs, ahead_gs) / max(ctx.pool_capacity[p], 1)
        expect = np.where(fit, 0.0, np.maximum(np.maximum(t_rel, fluid), 0.0))
        if reserved and cy.reservation_holder is not None:
            # the job holding the reservation (a job due for review) starts at its shadow time
            held = np.array([j.job_id == cy.reservation_holder for j in jobs], dtype=bool)
            expect = np.where(held & ~fit, cy.shadow_s - now, expect)
        wait = np.where(fit, 0.0, np.maximum(wait_opt, 0.0))
        first = now + wait
        e, am, en, c = ctx.onprem_costs(p, t, job0.gpus, runtime, first)
        score_first = score(e + (am if amort_in else 0.0), c, wait, vot_h, cp)
        s, r = first, runtime
        kind = np.where(fit, _NOW, _WAIT)
        if deferrable:
            # free GPUs when each job was examined, less its own
            roomy = (ahead[p].gpus <= 0) & (fnow - job0.gpus >= cfg.defer_min_free_fraction * ctx.pool_capacity[p])
            allowed = ~fit | roomy
            k0 = np.where(wait > 0, np.ceil(wait / cfg.slot_s), 1).astype(np.int64)
            kmax = (np.minimum(cfg.horizon_s, np.maximum(latest_finish - runtime - now, 0.0)) // cfg.slot_s).astype(np.int64)
            table = cy.slot_scores(p, t, job0)  # per GPU, per slot k = 0..K
            k = np.arange(table.size)
            vals = np.where((k[None, :] >= k0[:, None]) & (k[None, :] <= kmax[:, None]), table[None, :], INF)
            kbest = np.argmin(vals, axis=1)
            ok = allowed & (kmax >= k0) & (vals[np.arange(n), kbest] < INF)
            if ok.any():
                s_k = now + kbest * cfg.slot_s
                e2, am2, en2, c2 = ctx.onprem_costs(p, t, job0.gpus, runtime, s_k)
                score_k = score(e2 + (am2 if amort_in else 0.0), c2, s_k - now, vot_h, cp)
                gain = score_first - score_k
                thresh = np.maximum(cfg.min_defer_saving_usd, cfg.min_defer_saving_fraction * np.abs(score_first))
                take = ok & (np.isnan(score_first) | (~np.isnan(score_k) & (gain >= thresh)))
                s = np.where(take, s_k, s)
                e, am, en, c = (np.where(take, x2, x) for x, x2 in ((e, e2), (am, am2), (en, en2), (c, c2)))
                kind = np.where(take, _DEFER, kind)
        dollars = e + am
        feasible = (s + r <= latest_finish) & ~np.isnan(dollars) & ~np.isnan(c)  # budgets bound cloud spend only
        sc = np.where(feasible, score(e + (am if amort_in else 0.0), c, s - now, vot_h, cp), INF)
        # the record of a wait: its expected start, costed there (the choice above stands)
        waits = (kind == _WAIT) & (expect != wait)
        if waits.any():
            s_x = np.where(waits, now + expect, s)
            e_x, am_x, en_x, c_x = ctx.onprem_costs(p, t, job0.gpus, runtime, s_x)
            s, dollars, en, c = s_x, np.where(waits, e_x + am_x, dollars), np.where(waits, en_x, en), np.where(waits, c_x, c)
            wait = np.where(waits, expect, wait)
        cols.append({"p": p, "t": t, "start": s, "runtime": r, "dollars": dollars, "energy": en, "carbon": c,
                     "score": sc, "feasible": feasible, "finish": s + r, "kind": kind, "wait": wait})
    return cols


def _release_wait(cy: Cycle, p: int, need: np.ndarray, times: np.ndarray, cum: np.ndarray) -> np.ndarray:
    """Seconds from now until running jobs' expected ends in pool ``p`` free ``need`` more GPUs (0 where
    ``need <= 0``; the last release where they never free that many): the pool's release profile."""
    if not times.size:
        return np.zeros(need.shape)
    i = np.minimum(np.searchsorted(cum, need), times.size - 1)
    return np.where(need > 0, times[i] - cy.now, 0.0)


def _cloud_columns(cy: Cycle, jobs, offers, work, latest_finish, vot_h, budget):
    """The best cloud offers per job, vectorised over ``jobs`` of one shape.

    Costs the top ``CLOUD_TOP`` offers of the shape's ranking exactly for every job and keeps,
    per job, the first ``N_ALTERNATIVES + 1`` that meet its deadline and caps. A job with none
    there is costed over the whole ranking (tight deadlines need the fast, dear GPUs).
    Returns ``(index, kept)``: ``index`` maps a column to an offer id, ``kept`` a dict of
    ``(n, m)`` arrays with ``mask`` marking the options kept per job.
    """
    ctx, now = cy.ctx, cy.now
    job0 = jobs[0]
    order = cy.cloud_ranking(job0, offers)
    cand = order[:CLOUD_TOP]
    est = _cloud_matrix(ctx, job0, work, cand, now, vot_h)
    feas = _cloud_feasible(est, latest_finish, budget, job0.max_usd_per_hour, now)
    keep = feas & (np.cumsum(feas, axis=1) <= N_ALTERNATIVES + 1)
    est["mask"] = keep
    est["feasible"] = feas
    est["offer"] = np.broadcast_to(cand[None, :], keep.shape)
    none = ~keep.any(axis=1)
    extra = {}
    for i in np.flatnonzero(none):
        # whole ranking for this job: the best feasible offers, else the earliest finisher
        one = _cloud_matrix(ctx, job0, work[i:i + 1], order, now, vot_h)
        f = _cloud_feasible(one, latest_finish[i:i + 1], budget, job0.max_usd_per_hour, now)[0]
        if f.any():
            pick = np.flatnonzero(f)[np.argsort(one["score"][0][f], kind="stable")[:N_ALTERNATIVES + 1]]
        else:
            pick = np.array([int(np.argmin(np.where(np.isnan(one["carbon"][0]), INF, one["finish"][0])))])
        extra[int(i)] = [(int(order[k]), {name: float(one[name][0][k]) for name in _CLOUD_FIELDS}, bool(f[k]))
                         for k in pick]
    return est, extra


_CLOUD_FIELDS = ("runtime", "finish", "dollars", "energy", "carbon", "usd_h", "score", "delay")


def _cloud_matrix(ctx: PlannerContext, job0: PendingJob, work: np.ndarray, cand: np.ndarray, now: float, vot_h: float):
    """Costs and scores of jobs (``work``, shape ``(n,)``) on offers ``cand`` (``(m,)``): dict of ``(n, m)`` arrays
    (:meth:`PlannerContext.cloud_estimates`; the score waits out the provisioning delay)."""
    est = ctx.cloud_estimates(job0, cand, now, work_s=work)
    return {"runtime": est.runtime_s, "finish": est.finish_bound_s, "dollars": est.dollars_usd,
            "energy": est.energy_kwh, "carbon": est.carbon_kg, "usd_h": est.usd_per_hour,
            "score": score(est.dollars_usd, est.carbon_kg, est.delay_s, vot_h, ctx.config.carbon_price_usd_per_tonne),
            "delay": est.delay_s}


def _cloud_feasible(est, latest_finish: np.ndarray, budget: float, max_usd_h: float | None, now: float) -> np.ndarray:
    f = (now + est["finish"] <= latest_finish[:, None]) & (est["dollars"] <= budget) & ~np.isnan(est["carbon"])
    if max_usd_h is not None:
        f &= est["usd_h"] <= max_usd_h
    return f


def _decide_federated(cy: Cycle, jobs: list[PendingJob], targets, offers: np.ndarray, ahead, budgets,
                      fits: list, free_now: list) -> None:
    """Decide for ``jobs`` of one shape (or one job): the ARCHITECTURE.md §4 score over every option.

    ``fits[i][k]`` is the node list where job ``i`` fits target ``k`` now (or None) and
    ``free_now[i][k]`` the free GPUs of that target when the job was examined.
    """
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    job0 = jobs[0]
    n = len(jobs)
    vot_h = ctx.value_of_time(job0)
    work = np.array([j.work_s for j in jobs])
    latest_finish = np.array([j.deadline_s for j in jobs]) - cfg.deadline_margin_s
    budget, bkey = _budget_left(job0, budgets) if n == 1 else (INF, None)
    onprem = _onprem_columns(cy, jobs, targets, ahead, fits, free_now, work, latest_finish, vot_h)
    cloud, cloud_extra = (_cloud_columns(cy, jobs, offers, work, latest_finish, vot_h, budget)
                          if offers.size else (None, {}))
    # plain lists: per-job Python below indexes them ~30 times per job
    on = []
    for col in onprem:
        on.append((col["p"], col["t"], ctx.pools[col["p"]].name, targets.index((col["p"], col["t"])),
                   *(col[k].tolist() for k in ("start", "runtime", "dollars", "energy", "carbon", "score",
                                                "feasible", "kind", "wait"))))
    if cloud is not None:
        mask = cloud["mask"]
        kidx = np.argsort(~mask, axis=1, kind="stable")[:, :N_ALTERNATIVES + 1]
        kcount = np.minimum(mask.sum(axis=1), N_ALTERNATIVES + 1).tolist()
        rows_i = np.arange(n)[:, None]
        cl = {name: cloud[name][rows_i, kidx].tolist() for name in _CLOUD_FIELDS if name != "usd_h"}
        cl_offer = cloud["offer"][rows_i, kidx].tolist()
    lf = latest_finish.tolist()
    vector_rows = n > 1  # a batch (no job preempts or spends a budget): choose vectorised
    if vector_rows:
        _choose_batch(cy, jobs, on, cloud is not None and (cl, cl_offer, kcount), cloud_extra, onprem, fits,
                      latest_finish)
    for i in (sorted(cloud_extra) if vector_rows else range(n)):
        job = jobs[i]
        options = []  # (score, infeasible, option, how, finish)
        for p, t, pname, ti, st, rt, dl, en, cb, sc, fe, kd, wt in on:
            s_, r_, f = st[i], rt[i], fe[i]
            kind = _KIND_NAMES[kd[i]]
            if f:
                note = _NOTES[kind]
            else:
                note = "misses the deadline" if s_ + r_ > lf[i] else "no price/carbon data"
            opt = OptionEstimate("onprem", pname, s_, s_ - now, r_, dl[i], en[i], cb[i], sc[i] if f else NAN, f, note)
            options.append((sc[i], 0 if f else 1, opt, {"p": p, "t": t, "nodes": fits[i][ti], "wait": wt[i], "kind": kind},
                            s_ + r_))
        if cloud is not None:
            if i in cloud_extra:
                rows = cloud_extra[i]
            else:
                rows = [(cl_offer[i][k], {name: cl[name][i][k] for name in cl}, True) for k in range(kcount[i])]
            for o, v, f in rows:
                over = not v["dollars"] <= budget  # never chosen, not even to minimise lateness (_choose)
                if f:
                    note = ""
                elif now + v["finish"] > lf[i]:
                    note = "misses the deadline"
                elif over:
                    note = (f"{PROJECT_CAP_NOTE if isinstance(bkey, tuple) else BUDGET_CAP_NOTE}: costs "
                            f"${v['dollars']:.2f}, ${max(budget, 0.0):.2f} of the "
                            f"{'project' if isinstance(bkey, tuple) else 'team'}'s cloud budget left")
                else:
                    note = "over the job's price cap or no carbon data"
                opt = OptionEstimate("cloud", ctx.offer_ids[o], now + v["delay"], v["delay"], v["runtime"],
                                     v["dollars"], v["energy"], v["carbon"], v["score"] if f else NAN, f, note,
                                     ctx.offer_carbon_estimated[o])
                options.append((v["score"] if f else INF, 0 if f else 1, opt, {"offer": o, "over_budget": over},
                                now + v["finish"]))
        _choose(cy, job, targets, options, ahead, budgets)


def _choose_batch(cy: Cycle, jobs: list[PendingJob], on, cl, cloud_extra: dict, onprem_cols, fits: list,
                  latest_finish: np.ndarray) -> None:
    """Vectorised :func:`_choose` for a batch of one shape: same rules, same records.

    Jobs here do not preempt and have no budget; those that fit now had their nodes
    set aside when they were examined, so each one's choice is independent of the
    others'. Rows with a whole-ranking cloud fallback (``cloud_extra``) are left to
    :func:`_choose`.
    """
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    n = len(jobs)
    T = len(on)
    if onprem_cols:
        S_on = np.stack([c["score"] for c in onprem_cols], axis=1)
        F_on = np.stack([c["feasible"] for c in onprem_cols], axis=1)
        fin_on = np.stack([c["finish"] for c in onprem_cols], axis=1)
        kind_on = np.stack([c["kind"] for c in onprem_cols], axis=1)
    else:  # no pool can hold this shape: only cloud columns
        S_on, fin_on = np.empty((n, 0)), np.empty((n, 0))
        F_on, kind_on = np.empty((n, 0), dtype=bool), np.empty((n, 0), dtype=np.int64)
    if cl:
        clf, cl_offer, kcount = cl
        C = len(cl_offer[0])  # the ranked columns gathered: min(compatible offers, N_ALTERNATIVES + 1)
        kmask = np.arange(C)[None, :] < np.array(kcount)[:, None]
        S_cl = np.where(kmask, np.array(clf["score"]), INF)
        fin_cl = np.where(kmask, now + np.array(clf["finish"]), INF)
        committed = np.array([j.committed_pool is not None for j in jobs])
        recheck = committed & kmask.any(axis=1)
        F_on = F_on & ~(recheck[:, None] & (kind_on == _WAIT))
        F = np.concatenate([F_on, kmask], axis=1)
        S = np.concatenate([S_on, S_cl], axis=1)
        fin = np.concatenate([fin_on, fin_cl], axis=1)
        considered = np.concatenate([np.ones_like(F_on), kmask], axis=1)
        cf = (fin_cl - now).min(axis=1)
    else:
        F, S, fin, considered = F_on, S_on, fin_on, np.ones_like(F_on)
        cf = np.full(n, INF)
    key = np.where(F, S, np.where(considered, 1e15 + fin, INF))
    order = np.argsort(key, axis=1, kind="stable")[:, :N_ALTERNATIVES + 1]
    okey = np.take_along_axis(key, order, axis=1)
    order_l, okey_l = order.tolist(), okey.tolist()
    # review of a waiting job: when the cloud must be chosen to still meet the deadline (see _choose)
    review_l = np.where(cf < INF, np.maximum(latest_finish - cf - (cfg.review_margin_s + 0.2 * cf),
                                             now + cfg.min_review_s), INF).tolist()
    pool_names = [p.name for p in ctx.pools]
    lf = latest_finish.tolist()

    offer_ids = ctx.offer_ids
    if cl:
        c_delay, c_run, c_usd, c_kwh, c_kg, c_score = (clf[k] for k in ("delay", "runtime", "dollars", "energy",
                                                                          "carbon", "score"))

    F_l = F.tolist()

    def option(i: int, c: int):
        if c < T:
            p, t, pname, ti, st, rt, dl, en, cb, sc, fe, kd, wt = on[c]
            s_, r_ = st[i], rt[i]
            f = F_l[i][c]
            kind = _KIND_NAMES[kd[i]]
            if fe[i] and f:
                note = _NOTES[kind]  # the wait and start are in the record's fields
            elif fe[i]:
                note = "already waited; the cloud can still meet the deadline"
            else:
                note = "misses the deadline" if s_ + r_ > lf[i] else "no price/carbon data"
            return OptionEstimate("onprem", pname, s_, s_ - now, r_, dl[i], en[i], cb[i], sc[i] if f else NAN, f,
                                  note), (p, t, kind, wt[i], ti)
        k = c - T
        o = cl_offer[i][k]
        d = c_delay[i][k]
        return OptionEstimate("cloud", offer_ids[o], now + d, d, c_run[i][k], c_usd[i][k], c_kwh[i][k], c_kg[i][k],
                              c_score[i][k], True, "", ctx.offer_carbon_estimated[o]), o

    def alternatives(i: int) -> list[OptionEstimate]:
        """The best rejected options of job ``i``, in order (built when the record is read)."""
        out = []
        for c, kv in zip(order_l[i][1:], okey_l[i][1:]):
            if kv >= INF:  # keys are sorted: the rest were not considered
                break
            out.append(option(i, c)[0])
        return out

    for i, job in enumerate(jobs):
        if i in cloud_extra:
            continue
        c0 = order_l[i][0]
        best, how = option(i, c0)
        alts = LazyOptions(alternatives, i)
        late = "" if best.feasible else MISSES_DEADLINE_NOTE
        if c0 >= T:
            cy.decisions.append(Decision(job.job_id, DecisionKind.provision, option=best, offer_index=how,
                                         alternatives=alts, reason=late + "best score: cloud"))
            continue
        p, t, kind, wait, ti = how
        if kind == "now":
            cy.start(job, p, t, fits[i][ti], option=best, alternatives=alts, reason=late + "best score: on-prem now")
        elif kind == "defer":
            cy.decisions.append(Decision(job.job_id, DecisionKind.defer, option=best, pool=ctx.pools[p].name,
                                         not_before=best.start_s, alternatives=alts, reason=best.note))
        else:  # wait; review as in _choose
            review = review_l[i] if review_l[i] < INF else now + max(wait, cfg.min_review_s)
            cy.decisions.append(Decision(job.job_id, DecisionKind.wait, best, pool_names[p], None, (), review, (),
                                         alts, best.note))


def _choose(cy: Cycle, job: PendingJob, targets, options, ahead, budgets) -> None:
    """Pick the best option of one job and record the decision with its alternatives."""
    ctx, cfg, now = cy.ctx, cy.ctx.config, cy.now
    if not options:
        if targets:
            p = targets[0][0]
            cy.decisions.append(Decision(job.job_id, DecisionKind.wait, pool=ctx.pools[p].name,
                                         not_before=now + 3600.0, reason="no cloud offer available now"))
        return
    shown = options  # the explanation lists the options the cap ruled out too
    left, key = _budget_left(job, budgets)
    if key is not None:
        # a hard cap: a cloud option over what the team (or the project) has left is never chosen, not even to
        # minimise lateness below; with nothing else the job gets no decision this cycle and waits (none dropped)
        blocked = [o for o in options if o[3].get("over_budget")]
        options = [o for o in options if not o[3].get("over_budget")]
        cap_note = ""
        if blocked or left <= 0:
            cap_note = _cap_note(key, left,
                                 min((o[2] for o in blocked), key=lambda x: x.dollars_usd) if blocked else None)
        if not options:
            return
    else:
        cap_note = ""
    feasible_opts = [o for o in options if o[1] == 0]
    if job.committed_pool is not None and any(o[2].kind == "cloud" for o in feasible_opts):
        # it already waited once and was reviewed: waiting again (the estimate proved
        # optimistic) would risk the deadline, so only starting now or the cloud remain
        feasible_opts = [o for o in feasible_opts if not (o[2].kind == "onprem" and o[3].get("kind") == "wait")]
    if feasible_opts:
        best = min(feasible_opts, key=lambda o: (o[0], o[2].target))
    else:  # every option misses the deadline: minimise lateness
        best = min(options, key=lambda o: (o[4], o[2].target))
        cap_note += MISSES_DEADLINE_NOTE
    alts = tuple(o[2] for o in sorted(shown, key=lambda o: (o[1], o[0], o[4])) if o is not best)[:N_ALTERNATIVES]
    opt, how = best[2], best[3]

    # --- preemption for higher-priority jobs that would otherwise wait or go to the cloud
    if (cfg.preemption and job.priority >= 2 and targets and not (opt.kind == "onprem" and how.get("kind") == "now")):
        if _try_preempt(cy, job, targets, opt, alts):
            return

    if "offer" in how:
        o = how["offer"]
        _spend(job, budgets, opt.dollars_usd)  # the cycle's later jobs of the team and project see what is left
        cy.decisions.append(Decision(job.job_id, DecisionKind.provision, option=opt, offer_index=o,
                                     alternatives=alts, reason=(MISSES_DEADLINE_NOTE if not feasible_opts else "")
                                     + "best score: cloud"))
        return
    p, t = how["p"], how["t"]
    if how["kind"] == "now":
        cy.start(job, p, t, how["nodes"], option=opt, alternatives=alts, reason=cap_note + "best score: on-prem now")
    elif how["kind"] == "defer":
        cy.decisions.append(Decision(job.job_id, DecisionKind.defer, option=opt, pool=ctx.pools[p].name,
                                     not_before=opt.start_s, alternatives=alts, reason=cap_note + opt.note))
    else:
        # Look again when the cloud must be chosen to still meet the deadline (with a margin
        # for spot rework and capacity), or after the expected wait if there is no cloud
        # option. Starting on-prem needs no review: the queue pass starts the job as soon
        # as it fits. (The queue ahead is fixed for the cycle: jobs decided in one cycle
        # do not see each other's waits; the review bounds the optimism.)
        cloud_finish = min((o[4] - now for o in options if o[2].kind == "cloud"), default=None)
        if cloud_finish is not None:
            margin = cfg.review_margin_s + 0.2 * cloud_finish
            review = max(job.deadline_s - cfg.deadline_margin_s - cloud_finish - margin, now + cfg.min_review_s)
        else:
            review = now + max(how["wait"], cfg.min_review_s)
        cy.decisions.append(Decision(job.job_id, DecisionKind.wait, option=opt, pool=ctx.pools[p].name,
                                     not_before=review, alternatives=alts, reason=cap_note + opt.note))


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
            if any(r.job_id in d.victims for d in cy.decisions if d.kind == DecisionKind.preempt):
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
                # lost GPU-hours re-done later, at the amortised rate plus one GPU-hour's electricity at
                # today's price (the tariff integral of one hour is the price x 1 h)
                gpu_hour_usd = pool.amortised_usd_per_gpu_hour + load_tariff_usd(
                    onprem_kw(1, ctx.gpus.busy_kw[t], pool.pue), ctx.pool_price_now(p, now))
                cost = lost_gpu_s / 3600.0 * gpu_hour_usd
                if best is None or cost < best[0]:
                    best = (cost, node, victims)
        if best is None:
            continue
        cost, node, victims = best
        r_, e_cost, amort, energy, carbon = ctx.onprem_estimate(p, t, job, now)
        dollars = e_cost + amort
        sc = score(e_cost + (amort if ctx.amortised_in_score() else 0.0) + cost, carbon, 0.0, ctx.value_of_time(job),
                   cfg.carbon_price_usd_per_tonne)
        if not (sc < (best_opt.score if best_opt.feasible else INF)):
            continue
        for r, g in victims:
            for n2, g2 in r.allocation:
                ix.give(n2, g2)
        ix.take([node], job.gpus_per_node)
        bisect.insort(cy.releases(p), (now + r_, node, job.gpus_per_node))
        opt = OptionEstimate(kind="onprem", target=pool.name, start_s=now, wait_s=0.0, runtime_s=r_,
                             dollars_usd=dollars + cost, energy_kwh=energy, carbon_kg=carbon, score=sc,
                             note=f"preempts {len(victims)} job(s)")
        cy.decisions.append(Decision(job.job_id, DecisionKind.preempt, option=opt, pool=pool.name,
                                     allocation=((node, job.gpus_per_node),),
                                     victims=tuple(r.job_id for r, _ in victims), alternatives=(best_opt,) + tuple(alts),
                                     reason=f"preemption costs ${cost:.2f} in lost work, less than the best alternative"))
        return True
    return False


