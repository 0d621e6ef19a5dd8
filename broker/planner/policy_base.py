"""What every policy shares: the cycle's working state, the on-prem queue pass, the common rules.

Rules of all policies (:class:`Cycle`, :func:`run_onprem_queue`):

* a job starts on-prem only where the whole gang fits now (all-or-nothing),
  on nodes of one GPU type in one pool (homogeneous gang), best-fit;
* a job that no pool and no offer can ever hold is rejected with the reason;
* on-prem queue order is priority class, then the multifactor priority (age
  weighed against team fair share, :mod:`broker.planner.fair_share`: no job is
  passed by a job of its class submitted more than ``priority_max_age_s /
  priority_weight_age`` after it that has waited less than ``priority_max_age_s x
  (1 - 1 / priority_weight_age)``), then submission time; ``fifo`` uses submission time;
* EASY backfill: the first blocked job gets a reservation (shadow time and
  nodes from the expected ends of running jobs); a later job may start now
  only if it ends before the shadow time or stays off the reserved nodes.

Each policy is its own module (:mod:`broker.planner.fifo`, :mod:`~broker.planner.backfill`,
:mod:`~broker.planner.cheapest`, :mod:`~broker.planner.federated`) stating its objective;
:mod:`broker.planner.registry` binds them to their names.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
from typing import Callable

import numpy as np

from broker.model import Decision, DecisionKind, OptionEstimate
from broker.planner.capacity import FreeIndex, shadow_time
from broker.planner.core import PendingJob, PlannerConfig, PlannerContext, Snapshot
from broker.planner.costs import onprem_kw, score
from broker.planner.fair_share import fair_share_factors

__all__ = ["Cycle", "QueueResult", "run_onprem_queue", "merged_queue", "queue_group", "urgency_bucket",
           "eligible_jobs", "submission_order",
           "never_fits_reason", "work_bucket", "INF", "NAN", "NO_OFFERS", "N_ALTERNATIVES"]

INF = float("inf")
NAN = float("nan")
#: an empty offer index array (no cloud offer to consider)
NO_OFFERS = np.zeros(0, np.int64)
#: how many rejected options a decision's explanation lists
N_ALTERNATIVES = 3
#: jobs whose work differs by less than this factor share one cached ranking and slot table
#: (log buckets); their exact costs are still computed per job
_LOG_BUCKET = math.log(1.5)


def work_bucket(work_s: float) -> int:
    """The x1.5 log bucket of ``work_s`` (seconds): jobs of one bucket share per-cycle rankings and slot tables."""
    return int(math.floor(math.log(max(work_s, 1.0)) / _LOG_BUCKET))


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
        # team -> fair-share factor in (0, 1] for this cycle, and the factor of a team without usage
        self._fair, self._fair_default = fair_share_factors(self.team_usage, self.weights)
        self._max_age, self._age_weight = ctx.config.priority_max_age_s, ctx.config.priority_weight_age
        self.reservation: dict[int, frozenset[int]] = {}
        self.shadow_s = INF
        #: the job holding the reservation (the top blocked job of the queue pass) when it is decided again this
        #: cycle (``federated``: due for review), else None
        self.reservation_holder: str | None = None
        self._cloud_rank: dict = {}
        self._avail: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._slot_scores: dict = {}
        self._rel_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def fit_now(self, job: PendingJob, pool: int, gpu_type: str) -> list[int] | None:
        """Nodes where ``job`` fits now on ``pool``/``gpu_type`` (best-fit), or None.

        Respects the cycle's reservation: a job ending after the shadow time may not use
        the reserved nodes.
        """
        excl = frozenset()
        if pool in self.reservation:
            runtime = job.work_s / self.ctx.gpus.throughput[gpu_type]
            if self.now + runtime > self.shadow_s:
                excl = self.reservation[pool]
        return self.index[pool].find(gpu_type, job.gpus_per_node, job.nodes, job.min_mem_gb, excl)

    def available(self, offers: np.ndarray) -> np.ndarray:
        """The subset of ``offers`` (a per-shape array cached by the context) provisionable now.

        Cached per input array for the cycle; the cache keeps both arrays alive, so
        ``id()`` keys cannot be reused by other arrays within the cycle.
        """
        avail = self.snap.offer_available
        if avail is None or offers.size == 0:
            return offers
        hit = self._avail.get(id(offers))
        if hit is None:
            hit = (offers, offers[avail[offers]])
            self._avail[id(offers)] = hit
        return hit[1]

    # ------------------------------------------------------------ per-shape caches (one cycle)
    def _rep_job(self, job: PendingJob) -> PendingJob:
        rep = copy.copy(job)
        rep.work_s = math.exp((work_bucket(job.work_s) + 0.5) * _LOG_BUCKET)
        return rep

    def cloud_ranking(self, job: PendingJob, offers: np.ndarray, by: str = "score") -> np.ndarray:
        """Offers ``offers`` (compatible and available) ranked by score for ``job``'s shape.

        Jobs of one shape (GPU types, gang, memory, market, regions, checkpointing,
        priority) and one work bucket (x1.5) share the ranking, computed once per
        cycle from a representative job (ARCHITECTURE.md §4: score per shape, not per job).
        """
        key = (job.gpu_types, job.gpus_per_node, job.nodes, job.min_mem_gb, job.spot_ok, job.regions,
               job.checkpointable, job.checkpoint_interval_s, job.priority, work_bucket(job.work_s), by, id(offers))
        hit = self._cloud_rank.get(key)
        if hit is None:
            ctx = self.ctx
            rep = self._rep_job(job)
            est = ctx.cloud_estimates(rep, offers, self.now)
            if by == "dollars":
                rank = est.dollars_usd
            else:
                rank = score(est.dollars_usd, est.carbon_kg, est.delay_s, ctx.value_of_time(rep),
                             ctx.config.carbon_price_usd_per_tonne)
            rank = np.where(np.isnan(rank), INF, rank)
            hit = offers[np.argsort(rank, kind="stable")]
            self._cloud_rank[key] = hit
        return hit

    def slot_scores(self, pool: int, gpu_type: str, job: PendingJob) -> np.ndarray:
        """Score per GPU (USD) of starting at slot ``k`` (``now + k x slot_s``, k = 0..horizon) for
        ``job``'s work bucket and priority: electricity at the window's tariff + carbon price x the
        window's emissions + value of time (the marginal score; the chosen slot is costed exactly
        afterwards). Cached per (pool, GPU type, bucket, priority) for the cycle; INF where data is missing."""
        key = (pool, gpu_type, work_bucket(job.work_s), job.priority)
        hit = self._slot_scores.get(key)
        if hit is None:
            ctx, cfg = self.ctx, self.ctx.config
            rep = self._rep_job(job)
            runtime = rep.work_s / ctx.gpus.throughput[gpu_type]
            k = np.arange(int(cfg.horizon_s // cfg.slot_s) + 1)
            starts = self.now + cfg.slot_s * k
            kw_per_gpu = onprem_kw(1, ctx.gpus.busy_kw[gpu_type], ctx.pools[pool].pue)
            # the per-kWh score series prices carbon already: the energy's score, then the wait's
            hit = score(kw_per_gpu * ctx.pool_kwh_score_integrals(pool, starts, runtime), 0.0, starts - self.now,
                        ctx.value_of_time(rep) / rep.gpus, cfg.carbon_price_usd_per_tonne)
            hit = np.where(np.isnan(hit), INF, hit)
            self._slot_scores[key] = hit
        return hit

    def release_arrays(self, pool: int) -> tuple[np.ndarray, np.ndarray]:
        """``(times, cumulative GPUs)`` freed by running jobs' expected ends in ``pool`` (cycle start)."""
        hit = self._rel_arrays.get(pool)
        if hit is None:
            rel = self.releases(pool)
            times = np.array([r[0] for r in rel])
            cum = np.cumsum(np.array([r[2] for r in rel], dtype=np.float64))
            hit = (times, cum)
            self._rel_arrays[pool] = hit
        return hit

    # ------------------------------------------------------------ ordering
    def urgency_key(self, job: PendingJob):
        """``federated``'s on-prem queue order: priority class, then least laxity (the job's
        :func:`urgency_bucket`), then :meth:`queue_key` (fair share, age) within a bucket."""
        return (-job.priority, urgency_bucket(job, self.ctx.config.urgency_bucket_s), self.queue_key(job))

    def queue_key(self, job: PendingJob):
        """Priority class (high first), the multifactor priority (age weighed against fair share, high
        first; :func:`broker.planner.fair_share.multifactor_priority`), submission time, id.

        Within a ``Snapshot.queued`` group (one class and team, in submission order) the key is
        non-decreasing, as :func:`merged_queue` needs: older jobs have the larger (or, past the cap,
        equal) age factor."""
        # multifactor_priority inlined (called once per job and merge step of a 100k-job queue)
        age = self.now - job.submit_s
        w = self._age_weight
        a = 0.0 if age <= 0.0 else (w if age >= self._max_age else w * (age / self._max_age))
        return (-job.priority, -(a + self._fair.get(job.team, self._fair_default)), job.submit_s, job.job_id)

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
        """(pool, gpu_type) pairs that could ever hold ``job`` (cached per job shape: pools are static)."""
        key = ("targets", job.gpu_types, job.gpus_per_node, job.nodes, job.min_mem_gb)
        cache = self.ctx._shape_cache_static
        hit = cache.get(key)
        if hit is not None:
            return hit
        out = []
        for p in range(len(self.ctx.pools)):
            for t in self.pool_types_for(job, p):
                if self.can_ever_fit(job, p, t):
                    out.append((p, t))
        cache[key] = out
        return out

    def releases(self, pool: int) -> list[tuple[float, int, int]]:
        """Sorted ``(expected_end_s, node, gpus)`` of running jobs in ``pool`` (computed once per cycle)."""
        if self._releases is None:
            rel: dict[int, list[tuple[float, int, int]]] = {p: [] for p in range(len(self.ctx.pools))}
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
        # the job's expected end now counts in later shadow-time and wait estimates of this cycle
        end = self.now + job.work_s / self.ctx.gpus.throughput[gpu_type]
        rel = self.releases(pool)
        for i in nodes:
            bisect.insort(rel, (end, i, job.gpus_per_node))
        if option is None:  # fifo, backfill, cheapest: the record's score is the marginal (or amortised) dollars
            runtime, e_cost, amort, energy, carbon = self.ctx.onprem_estimate(pool, gpu_type, job, self.now)
            option = OptionEstimate(kind="onprem", target=self.ctx.pools[pool].name, start_s=self.now, wait_s=0.0,
                                    runtime_s=runtime, dollars_usd=e_cost + amort, energy_kwh=energy, carbon_kg=carbon,
                                    score=e_cost + (amort if self.ctx.amortised_in_score() else 0.0))
        self.decisions.append(Decision(job.job_id, DecisionKind.start, option=option, pool=self.ctx.pools[pool].name,
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
        self.decisions.append(Decision(job.job_id, DecisionKind.reject, reason=reason))


# ---------------------------------------------------------------- on-prem queue
class QueueResult:
    """Outcome of one pass over the on-prem queue.

    Attributes:
        blocked: examined jobs that did not start, in queue order.
        started_gpus: pool -> (GPUs, GPU-seconds of work) of queued jobs started this cycle.
        reservation: pool -> node set reserved for the first blocked job (EASY backfill).
        shadow_s: that job's shadow time, POSIX seconds (inf if none).
    """

    __slots__ = ("blocked", "started", "reservation", "shadow_s")

    def __init__(self):
        self.blocked: list[PendingJob] = []
        self.started: dict[int, list[float]] = {}
        self.reservation: dict[int, frozenset[int]] = {}
        self.shadow_s = INF


def run_onprem_queue(cy: Cycle, queue, backfill: bool, target_fn: Callable, reject_unplaceable: bool = False,
                     late: list | None = None) -> QueueResult:
    """Start queued jobs in ``queue`` order (an iterable, consumed lazily).

    Without ``backfill`` the first job that does not fit blocks the rest (FIFO).
    With it, that job gets a reservation and at most ``backfill_depth`` later jobs
    are examined for EASY backfill. Jobs no target can ever hold are rejected
    when ``reject_unplaceable`` (on-prem-only policies) and skipped otherwise.
    Stops as soon as no GPU is free. Cost: O(started + examined), not O(queue).
    With ``late`` (a list), a job that would now finish on-prem after its deadline is
    not started but appended to ``late`` for a fresh decision (the cloud may still make it).
    """
    res = QueueResult()
    reserved: dict[int, frozenset[int]] | None = None
    examined_after_block = 0
    depth = cy.ctx.config.backfill_depth
    free = sum(sum(ix.total_free.values()) for ix in cy.index)
    for job in queue:
        if free <= 0 or (reserved is not None and examined_after_block >= depth):
            break
        targets = target_fn(job)
        if not targets:
            if reject_unplaceable:
                cy.reject(job, never_fits_reason(job, cloud=False))
            continue
        if late is not None:
            fastest = max(cy.ctx.gpus.throughput[t] for _, t in targets)
            if cy.now + job.work_s / fastest > job.deadline_s - cy.ctx.config.deadline_margin_s:
                late.append(job)
                continue
        if reserved is None:
            if cy.try_start_now(job, targets):
                free -= job.gpus
                _add_started(res, job)
                continue
            res.blocked.append(job)
            if not backfill:
                break
            best = (INF, None, None)
            for p, t in targets:
                ts, nodes = shadow_time(cy.index[p], cy.releases(p), t, job.gpus_per_node, job.nodes,
                                        job.min_mem_gb, cy.now)
                if ts < best[0]:
                    best = (ts, p, nodes)
            res.shadow_s = best[0]
            reserved = {best[1]: frozenset(best[2])} if best[1] is not None else {}
            res.reservation = reserved
        else:
            examined_after_block += 1
            if cy.try_start_now(job, targets, reserved, res.shadow_s):
                free -= job.gpus
                _add_started(res, job)
            else:
                res.blocked.append(job)
    return res


def _add_started(res: QueueResult, job: PendingJob) -> None:
    if job.committed_pool is not None:
        acc = res.started.setdefault(job.committed_pool, [0.0, 0.0])
        acc[0] += job.gpus
        acc[1] += job.gpus * job.work_s


def never_fits_reason(job: PendingJob, cloud: bool) -> str:
    """The reason of a rejection: no pool (and, with ``cloud``, no offer) can ever hold ``job``'s gang."""
    where = "no on-prem pool" + (" and no cloud offer" if cloud else "")
    return (f"{where} can ever hold {job.nodes}x{job.gpus_per_node} GPUs "
            f"(types={sorted(job.gpu_types) if job.gpu_types else 'any'}, min_mem={job.min_mem_gb} GB)")


def eligible_jobs(snap: Snapshot) -> list[PendingJob]:
    """The snapshot's pending jobs that may start now (``earliest_s`` has come)."""
    now = snap.now_s
    return [j for j in snap.pending if j.earliest_s <= now]


def urgency_bucket(job: PendingJob, bucket_s: float) -> float:
    """The job's latest on-prem start, ``deadline_s - work_s`` (POSIX s; runtime on a reference GPU),
    floored to a multiple of ``bucket_s`` seconds: a whole number, ``inf`` without a deadline, and 0
    for every job when ``bucket_s`` is 0 (ordering off). See ``PlannerConfig.urgency_bucket_s``."""
    if bucket_s <= 0:
        return 0.0
    latest = job.deadline_s - job.work_s
    return float(math.floor(latest / bucket_s)) if math.isfinite(latest) else INF


def queue_group(job: PendingJob, config: PlannerConfig) -> tuple[int, str, float]:
    """The group of :attr:`Snapshot.queued <broker.planner.core.Snapshot.queued>` a committed job
    belongs to: ``(priority, team, urgency bucket)``. Within a group jobs are kept in submission
    order, and every queue order of this module (:meth:`Cycle.queue_key`, :meth:`Cycle.urgency_key`)
    is then monotonic, so :func:`merged_queue` can merge groups lazily."""
    return (job.priority, job.team, urgency_bucket(job, config.urgency_bucket_s))


def merged_queue(cy: Cycle, extra: list[PendingJob], key):
    """Lazy merge of ``extra`` (sorted here) and the snapshot's queued groups, in ``key`` order.

    Each group of ``Snapshot.queued`` is already in submission order and shares one
    priority, team and urgency bucket (:func:`queue_group`), so ``key`` is monotonic within it: a k-way heap merge pulls
    the next job in O(log groups).
    """
    now = cy.now
    iters = [sorted(extra, key=key)]
    for group in (cy.snap.queued or {}).values():
        if group:
            iters.append(j for j in group if j.earliest_s <= now)
    if len(iters) == 1:
        return iter(iters[0])
    return heapq.merge(*iters, key=key)


def submission_order(j: PendingJob):
    """Sort key: submission time, then job id (``fifo``'s queue order)."""
    return (j.submit_s, j.job_id)
