"""One live planning cycle: store -> snapshot -> ``plan()`` -> fenced compare-and-set -> dispatches.

This module holds the cycle's steps and rules; the rows are read and written by the store
(:mod:`broker.service.store.planning`, and :class:`JobStore` for the fence and single-job compare-and-sets)
in the transactions this module opens.

:meth:`PlanningCycle.run` does, in order:

1. **Intake** (per-job compare-and-set, safe to repeat): ``submitted`` jobs become
   ``queued``, or ``deferred`` until their window opens (``not_before``) — for a job
   with ``window: cheapest|cleanest`` the start is the cheapest/cleanest slot of its
   window (:func:`broker.planner.windows.best_start`); ``deferred`` jobs whose ``not_before``
   has come are ``queued`` again; waiting jobs past their ``not_after`` fail. At most
   ``settings.intake_per_cycle`` jobs a cycle, round-robin across teams (:meth:`PlanningCycle.intake`).
2. **Snapshot**: the planner fence version, live nodes (fresh heartbeat; a scheduler pool's nodes, free GPUs,
   running jobs' releases and own queue ahead from its cluster: :meth:`broker.service.schedulers.SchedulerPools.read`,
   before the store is read), each budgeted team's and project's remaining cloud budget (``cap - spent -
   committed``, :func:`broker.service.budgets.planner_budgets`, which also raises a soft alert once a month) as
   ``PlannerConfig.team_budget_usd`` / ``project_budget_usd``, queued
   jobs and the jobs holding GPUs, turned into the planner's :class:`Snapshot`
   exactly as the simulator builds it (``pending`` = new, requeued or due for
   review; ``queued`` = jobs committed to an on-prem pool, by (priority, team)).
   Queued jobs' rows and planner views are kept between cycles by version
   (:meth:`PlanningCycle._waiting_jobs`): only new or changed jobs are read in full.
   A waiting job whose expected start has passed is due for review at once, so its expected start is
   worked out again every cycle until it starts; a running job past its estimate holds its GPUs until its
   time limit at the latest (:func:`providers.base.pool_time_limit_s`, what the agent enforces), not "in 1 s".
   A team's ``quotas.max_running_gpus``: walking the waiting jobs in planning order, a job whose GPUs would bring
   its team's active jobs' GPUs plus those of its jobs admitted so far this cycle over the cap is left out of the
   snapshot for this cycle, with the reason written (once, when it changes) in step 6.
3. **Plan**: :func:`broker.planner.registry.plan`, the same pure function the simulator runs.
4. **Apply** in one transaction that first advances the planner fence from the
   version read in step 2 (:meth:`JobStore.advance_fence`); if another cycle
   applied meanwhile (two planners after a lost Redis lock, a task delivered
   twice), nothing is applied. Each decision is a compare-and-set on the job's
   version, so a job cancelled meanwhile is left alone.
5. **Dispatch** (after commit): ``dispatch(job_id, attempt)`` for every job sent to a cloud
   (``provisioning``). On-prem placements need none: node agents poll the node API. A job placed on an existing
   scheduler's pool (``kind: slurm``) is submitted to its cluster (:meth:`broker.service.schedulers.
   SchedulerPools.submit`).
6. **Notes** (after commit, only if applied): decisions that hold nothing — ``wait`` (the
   pool, review time, record and reason) and the reason of a job given no decision — are
   written in batches of ``settings.intake_batch``, one bulk ``UPDATE`` each, skipping rows
   another writer holds or that changed since the snapshot (:meth:`PlanningCycle._write_notes`).

No job can stop the cycle: every per-job step is isolated. Intake works in batches of
``settings.intake_batch`` jobs, one short transaction each, skipping rows a cancel holds
(``FOR UPDATE SKIP LOCKED``); a job whose intake (window search), planner view, planning
(found by bisection when ``plan()`` raises) or apply step raises is moved to ``failed``
with the step and the error as its reason and event, logged once with its id, and the
cycle goes on for every other job. An apply that raises is retried decision by decision,
each in a savepoint. Only store-wide errors (the database unreachable) end a cycle.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta, timezone
from typing import Callable, NamedTuple, Sequence

import numpy as np
from broker.service.store import planning as planning_rows
from broker.service.store.tables import Job, utcnow
from broker.service.live import LiveEnvironment, LiveNode
from broker.model import DEFAULT_CHECKPOINT_INTERVAL_S, FAIR_SHARE_HALF_LIFE_S, DecisionKind, JobSpec, wait_text
from broker.planner.core import PendingJob, RunningJob, Snapshot
from broker.planner.costs import onprem_kw, score
from broker.planner.fair_share import decayed_usage
from broker.planner.federated import BUDGET_CAP_NOTE, PROJECT_CAP_NOTE
from broker.service.budgets import planner_budgets
from broker.planner.policy_base import queue_group
from broker.planner.registry import plan
from broker.schemas import with_earlier
from broker.states import JobState, check_transition
from broker.service.store.core import JobStore
from providers.base import pool_time_limit_s
from providers.launch import DIGEST_RE as _DIGEST_RE

#: the field names of :class:`PendingJob`, in order (its views are cached as tuples of them)
_PJ_FIELDS = tuple(f.name for f in fields(PendingJob))

__all__ = ["PlanningCycle", "CycleResult", "pending_job", "json_safe"]

log = logging.getLogger("fedbroker.cycle")
S = JobState


class _Waiting(NamedTuple):
    """A queued job kept between cycles (:meth:`PlanningCycle._waiting_jobs`): its ``version``, its detached
    ``row`` and its planner ``view`` (``(PendingJob field values, cloud offers left out)``, or the exception
    building it raised), and the row's fields a cycle reads (:class:`_Fields`), valid while the job stays at
    ``version`` (every change of a job's row bumps it)."""

    version: int
    row: Job
    view: tuple | Exception
    fields: "_Fields"


class _Fields(NamedTuple):
    """The columns of a queued job's row that every cycle reads, as plain values (an ORM attribute read
    costs a microsecond; a cycle over 10,000 queued jobs made 80,000 of them)."""

    committed_pool: str | None
    review_at: datetime | None
    team: str
    project: str | None
    reason: str | None
    #: the start its last wait decision expected (POSIX s; ``None``: none): once passed, the job is reviewed
    expected_start_s: float | None = None


@dataclass
class CycleResult:
    """What one cycle did. ``stale``: the plan was dropped because another cycle applied first;
    ``intake_capped``: intake took ``settings.intake_per_cycle`` jobs and left more for the next cycle;
    ``submitted``: ``(job, attempt)`` -> what submitting it to its scheduler pool did."""

    applied: bool = False
    stale: bool = False
    intake: int = 0
    intake_capped: bool = False
    decisions: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    dispatched: list[tuple[str, int]] = field(default_factory=list)
    submitted: dict[tuple[str, int], str] = field(default_factory=dict)
    plan_s: float = 0.0
    total_s: float = 0.0


def _ts(dt: datetime | None) -> float | None:
    return None if dt is None else dt.timestamp()


def _job_gpus(spec: dict | None) -> int:
    """The GPUs a job's ``spec`` holds once placed (``gpus_per_node x nodes``); 0 for a spec without them."""
    try:
        return int((spec or {}).get("gpus_per_node") or 0) * int((spec or {}).get("nodes") or 1)
    except (TypeError, ValueError):
        return 0


def _dt(s: float) -> datetime:
    return datetime.fromtimestamp(s, timezone.utc)


def pending_job(j: Job, pool_index: dict[str, int], canon: Callable[[str], str]) -> PendingJob:
    """The planner's view of a stored job (times in POSIX seconds, work in reference-GPU seconds).

    A start window's end (``not_after``) tightens the deadline the planner sees to
    ``not_after + remaining work`` so the planner never holds it past its window.
    """
    spec = j.spec
    work = max(float(spec["estimated_duration_s"]) - float(j.work_done_s or 0.0), 1.0)
    deadline = j.deadline.timestamp()
    if j.not_after is not None:
        deadline = min(deadline, j.not_after.timestamp() + work)
    created = j.created_at.timestamp()
    earliest = max(created, _ts(j.not_before) or created)
    types = spec.get("gpu_types") or ()
    regions = spec.get("allowed_regions") or ()
    committed = pool_index.get(j.committed_pool) if j.committed_pool else None
    return PendingJob(
        job_id=j.id, team=j.team, priority=j.priority, submit_s=created, deadline_s=deadline, earliest_s=earliest,
        work_s=work, gpus_per_node=int(spec["gpus_per_node"]), nodes=int(spec["nodes"]),
        gpu_types=frozenset(canon(t) for t in types) if types else None,
        min_mem_gb=float(spec.get("min_gpu_memory_gb") or 0.0), spot_ok=bool(spec.get("spot_allowed", True)),
        preemptible=bool(spec.get("preemptible", False)), checkpointable=bool(spec.get("checkpointable", True)),
        checkpoint_interval_s=float(spec.get("checkpoint_interval_s") or DEFAULT_CHECKPOINT_INTERVAL_S),
        regions=frozenset(regions) if regions else None, max_usd_per_hour=spec.get("max_price_usd_per_hour"),
        deferrable=bool(spec.get("deferrable", True)) and spec.get("window", "planner") == "planner",
        committed_pool=committed, deferred_once=bool(j.deferred_once), project=spec.get("project"),
        review_s=_ts(j.review_at) if j.review_at is not None else (math.inf if committed is not None else 0.0))


def _expected_start_s(record: dict | None) -> float | None:
    """The start a stored ``wait`` decision record expected (its option's ``start_s``, POSIX s), else ``None``."""
    if not isinstance(record, dict) or record.get("kind") != "wait":
        return None
    start = (record.get("option") or {}).get("start_s")
    return float(start) if isinstance(start, (int, float)) and math.isfinite(start) else None


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by ``None`` (JSON has no NaN; PostgreSQL rejects it).
    In explain records an infeasible option's ``score`` is NaN: it has no score."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class PlanningCycle:
    """Runs planning cycles against a :class:`JobStore`.

    Args:
        store: the job store.
        env: static planning inputs (:class:`LiveEnvironment`).
        settings: :class:`broker.service.settings.BrokerSettings` (deadlines, heartbeat timeouts).
        dispatch: called after commit with ``(job_id, attempt)`` for each job sent to provisioning.
        leader: a name for this planner, recorded with the fence.
        schedulers: the pools of existing schedulers (:class:`broker.service.schedulers.SchedulerPools`), or None.
    """

    def __init__(self, store: JobStore, env: LiveEnvironment, settings, dispatch: Callable[[str, int], None] | None = None,
                 leader: str = "planner", cloud=None, schedulers=None):
        self.store = store
        self.schedulers = schedulers
        self._views: dict = {}  # pool name -> this cycle's PoolView of a scheduler pool
        self.env = env
        self.settings = settings
        self.dispatch = dispatch
        self.leader = leader
        self.cloud = cloud
        from pricing.power import canonical_or_same

        self.canon = canonical_or_same
        self._failed_logged: set[str] = set()  # jobs whose per-job failure was logged
        self._bad: list[tuple[Job, str, Exception]] = []  # (job, step, error) to fail after the read / plan
        self.intake_capped = False  # the last intake left due jobs for the next cycle (intake_per_cycle)
        # team or (team, project) -> BudgetState of the teams and projects whose cloud budget is spent (this cycle)
        self._capped: dict = {}
        self._waiting: dict[str, _Waiting] = {}  # queued job id -> its row and planner view at a version

    # ------------------------------------------------------------------ public
    def run(self, now: datetime | None = None) -> CycleResult:
        """One cycle at ``now`` (default: the clock). Returns a :class:`CycleResult`.

        The cyclic garbage collector is paused during the cycle (as in :func:`broker.planner.registry.plan`):
        intake, the snapshot and the notes make tens of thousands of short-lived objects, none in
        cycles, and with 10,000 queued jobs' rows kept between cycles each full collection scanned
        them all (a third of an intake cycle in ``cProfile``)."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(now)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, now: datetime | None) -> CycleResult:
        t0 = time.perf_counter()
        now = now or utcnow()
        res = CycleResult()
        res.intake = self.intake(now)
        res.intake_capped = self.intake_capped
        version = self.store.planner_version()
        self._bad = []
        self._views = self.schedulers.read() if self.schedulers else {}
        self._submit: list[tuple[str, int]] = []
        with self.store.session() as s:
            snap_parts = self._read(s, now)
        self._fail_bad(now)
        if snap_parts is None:
            res.total_s = time.perf_counter() - t0
            return res
        snapshot, ctx, jobs, nodes_by_pool, used = snap_parts
        t1 = time.perf_counter()
        decisions = self._plan_isolated(snapshot, ctx, jobs) if snapshot.pending or snapshot.queued else []
        res.plan_s = time.perf_counter() - t1
        self._fail_bad(now)
        res.decisions = len(decisions)
        for isolate in (False, True):  # fast path: one transaction; on an error, again decision by decision
            kinds: dict[str, int] = {}
            notes: list[tuple[Job, dict]] = []
            held = defaultdict(set, {k: set(v) for k, v in used.items()})
            try:
                with self.store.session() as s:
                    if not JobStore.advance_fence(s, version, self.leader, now):
                        res.stale = True
                        log.info("planning cycle dropped: another cycle applied since fence version %d", version)
                        break
                    dispatched = self._apply(s, now, decisions, jobs, ctx, nodes_by_pool, held, kinds, isolate, notes)
            except Exception as e:
                if isolate:
                    raise
                log.warning("applying %d decisions failed (%s: %s); applying them again one by one",
                            len(decisions), type(e).__name__, e)
                self._submit = []
                continue
            res.dispatched, res.kinds, res.applied = dispatched, kinds, True
            break
        if res.applied and self.dispatch is not None:
            for job_id, attempt in res.dispatched:
                try:
                    self.dispatch(job_id, attempt)
                except Exception:  # the reconciler re-dispatches starting jobs
                    log.exception("dispatch of %s attempt %d failed; the reconciler will retry", job_id, attempt)
        if res.applied:
            for job_id, attempt in self._submit:  # a failed submit is tried again by the reconciler's watch
                try:
                    res.submitted[(job_id, attempt)] = self.schedulers.submit(self.store, job_id, attempt)
                except Exception:
                    log.exception("submit of %s attempt %d to its scheduler pool failed; the reconciler retries",
                                  job_id, attempt)
            self._write_notes(notes, now)
        res.total_s = time.perf_counter() - t0
        return res

    # ------------------------------------------------------------------ intake
    def intake(self, now: datetime) -> int:
        """Step 1 (see module docstring). Returns how many jobs changed state.

        At most ``settings.intake_per_cycle`` jobs are taken per cycle (0: all), fairly across teams:
        round-robin by team, oldest first within a team (``row_number() over (partition by team order
        by created_at, id)``), so another team's new job is taken in the very next cycle whatever one
        team queued; ``self.intake_capped`` tells whether jobs were left for the next cycle. They are
        handled in batches of ``settings.intake_batch``, each worked out outside any transaction and
        applied in one short transaction that first locks the batch's rows with
        ``FOR UPDATE SKIP LOCKED`` (PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serialises writers):
        a row a cancel holds is skipped, left for the next cycle, and a cancel waits at most for
        one batch. A job whose step raises is moved to ``failed`` with the reason
        (:meth:`_fail_in`); the other jobs go on.
        """
        n = 0
        size = int(self.settings.intake_batch)
        cap = int(getattr(self.settings, "intake_per_cycle", 0) or 0)
        with self.store.session() as s:
            ids = planning_rows.intake_ids(s, now, cap + 1 if cap > 0 else None)
        self.intake_capped = cap > 0 and len(ids) > cap
        if self.intake_capped:
            ids = ids[:cap]
        for k in range(0, len(ids), size):
            chunk = ids[k:k + size]
            with self.store.session() as s:
                rows = planning_rows.intake_rows(s, chunk, now)
            if rows:
                n += self._intake_batch(rows, now)
        return n

    def _intake_batch(self, rows: Sequence[Job], now: datetime) -> int:
        moves: list[tuple[Job, str, str, dict]] = []
        for j in rows:
            try:
                moves.append((j, *self._intake_move(j, now)))
            except Exception as e:  # a window search (or a stored spec) that raises fails this job only
                moves.append((j, S.failed.value, self._failure_reason("intake", e), {"finished_at": now}))
                self._log_failure(j.id, "intake", e)
        try:
            with self.store.session() as s:
                written = self._apply_moves(s, moves, now, isolate=False)
        except Exception as e:
            log.warning("intake batch of %d jobs failed (%s: %s); applying it again job by job",
                        len(moves), type(e).__name__, e)
        else:
            self._queued_now(written, now)
            return len(written)
        with self.store.session() as s:
            return self._apply_moves(s, moves, now, isolate=True)

    def _queued_now(self, written: Sequence[tuple[Job, str, str, dict]], now: datetime) -> None:
        """After an intake batch committed ``written``: the rows of the jobs it queued take the fields and
        version written (as the store now holds them) and join the snapshot's kept rows
        (:meth:`_waiting_jobs`), so this cycle's snapshot does not read them again."""
        for j, to_state, why, fields in written:
            if to_state != S.queued.value:
                continue
            j.state, j.version, j.updated_at, j.reason = to_state, j.version + 1, now, why
            j.not_before = fields.get("not_before", j.not_before)
            j.finished_at = fields.get("finished_at")
            self._remember(j)

    def _apply_moves(self, s, moves, now: datetime, isolate: bool):
        """Apply intake ``moves`` inside session ``s``: lock the rows not held by another writer, keep the
        moves whose job still has the version read, and write them with one bulk ``UPDATE`` (by primary
        key, under the locks) and one bulk event ``INSERT``; returns the moves written. With ``isolate``,
        job by job instead, each a compare-and-set in a savepoint; a job whose move raises is failed;
        returns how many moves were applied."""
        held = planning_rows.lock_free_rows(s, [j.id for j, *_ in moves])
        if not isolate:
            todo = []
            for move in moves:
                j, to_state, _, _ = move
                r = held.get(j.id)
                if r is not None and (r.version, r.state) == (j.version, j.state):
                    check_transition(j.id, j.state, to_state)
                    todo.append(move)
            planning_rows.write_moves(s, todo, now)
            return todo
        n = 0
        for j, to_state, why, fields in moves:
            if j.id not in held:  # a cancel (or another writer) holds it: next cycle
                continue
            try:
                with s.begin_nested():
                    n += JobStore.cas(s, j.id, j.version, j.state, to_state, why, now, **fields)
            except Exception as e:
                n += self._fail_in(s, j, "intake", e, now)
        return n

    def _intake_move(self, j: Job, now: datetime) -> tuple[str, str, dict]:
        """``(to_state, reason, fields)`` for one job found by intake; pure (no store access)."""
        if j.state in (S.queued.value, S.deferred.value) and j.not_after is not None and j.not_after < now:
            return (S.failed.value, f"start window closed at {j.not_after.isoformat()} before the job could start",
                    {"finished_at": now})
        if j.state == S.deferred.value:
            return S.queued.value, f"window opened at {j.not_before.isoformat()}", {}
        spec = j.spec
        start = j.not_before
        reason = "accepted"
        if spec.get("window", "planner") in ("cheapest", "cleanest"):
            chosen, why = self._best_window(j, now)
            if chosen is not None:
                start = chosen
                reason = why
        if start is not None and start > now:
            return (S.deferred.value,
                    reason if reason != "accepted" else f"waiting for its window to open at {start.isoformat()}",
                    {"not_before": start})
        return S.queued.value, reason, {}

    # ------------------------------------------------------------------ per-job failures
    @staticmethod
    def _failure_reason(step: str, e: BaseException) -> str:
        """The failed job's reason: the step and the error (a database error's driver message, without the
        SQL statement and its parameters), at most 2,000 characters."""
        e = getattr(e, "orig", None) or e
        return f"the planning cycle's {step} step failed for this job: {type(e).__name__}: {e}"[:2000]

    def _log_failure(self, job_id: str, step: str, e: BaseException, failed: bool = True) -> None:
        """Log a job's per-job failure once, one line with the job id (the traceback only at DEBUG):
        a failed job is not seen again, and the set keeps a job that is not failed from repeating it."""
        seen = self._failed_logged
        if job_id in seen:
            return
        if len(seen) > 10_000:
            seen.clear()
        seen.add(job_id)
        e = getattr(e, "orig", None) or e
        log.error("job %s: the planning cycle's %s step failed (%s: %s); %s, the cycle goes on",
                  job_id, step, type(e).__name__, e, "the job is failed" if failed else "the job is left as it is",
                  exc_info=log.isEnabledFor(logging.DEBUG))

    def _fail_in(self, s, j: Job, step: str, e: BaseException, now: datetime) -> bool:
        """Inside session ``s`` (in a savepoint): move waiting job ``j`` to ``failed`` because ``step``
        raised ``e`` for it; the event records the reason. Returns whether applied (False if the job
        changed meanwhile, e.g. was cancelled)."""
        self._log_failure(j.id, step, e)
        try:
            with s.begin_nested():
                return JobStore.cas(s, j.id, j.version, j.state, S.failed.value, self._failure_reason(step, e), now,
                                    finished_at=now)
        except Exception as e2:
            log.error("job %s: could not be failed after its %s step failed (%s: %s)", j.id, step,
                      type(e2).__name__, e2)
            return False

    def _best_window(self, j: Job, now: datetime) -> tuple[datetime | None, str]:
        """Cheapest/cleanest start in the job's window on the first pool that can hold it."""
        from broker.planner.windows import best_start

        spec = JobSpec.model_validate(j.spec)
        types = {self.canon(t) for t in spec.gpu_types}
        pool = None
        gpu_type = None
        for p in self.env.site_pools.values():
            for nd in p.nodes:
                t = self.canon(nd.gpu_type)
                if not types or t in types:
                    pool, gpu_type = p, t
                    break
            if pool is not None:
                break
        if pool is None or gpu_type not in self.env.gpus.throughput:
            return None, ""
        runtime = spec.estimated_duration_s / self.env.gpus.throughput[gpu_type]
        earliest = max(now, spec.earliest_start or now).timestamp()
        latest = j.deadline.timestamp() - runtime
        if j.not_after is not None:
            latest = min(latest, j.not_after.timestamp())
        if latest < earliest:
            return None, ""
        sig = self.env.signals_at(now.timestamp())
        kw = onprem_kw(spec.total_gpus, self.env.gpus.busy_kw[gpu_type], pool.pue)
        choice = best_start(earliest_s=earliest, latest_start_s=latest, runtime_s=runtime, power_kw=kw,
                            price=sig.price(pool.price_zone), carbon=sig.carbon(pool.carbon_zone),
                            prefer=spec.window, slot_s=self.env.planner.slot_s)
        return _dt(choice.start_s), (f"{spec.window} window on pool {pool.name}: {choice.reason} "
                                     f"(electricity ${choice.cost_usd:.4f}, {choice.carbon_kg:.4f} kgCO2e over the run)")

    def _write_notes(self, notes: Sequence[tuple[Job, dict]], now: datetime) -> int:
        """Write decisions that hold nothing (``(job, fields)``: a wait's pool, review time, record and reason)
        after the fenced apply, in batches of ``settings.intake_batch``, one short transaction each: rows
        another writer holds (``FOR UPDATE SKIP LOCKED``) or that changed since the snapshot (version) are
        left alone; the rest get one bulk ``UPDATE`` per set of fields. If a batch raises, it is written again
        job by job, and a job whose write raises is failed. Returns how many were written."""
        size = int(self.settings.intake_batch)
        n = 0
        for k in range(0, len(notes), size):
            chunk = notes[k:k + size]
            try:
                with self.store.session() as s:
                    written, held = planning_rows.write_notes(s, chunk, now)
                n += written
                self._noted(chunk, held)
                continue
            except Exception as e:
                log.warning("writing %d wait decisions or reasons failed (%s: %s); writing them again one by one",
                            len(chunk), type(e).__name__, e)
            with self.store.session() as s:
                for j, fields in chunk:
                    try:
                        with s.begin_nested():
                            n += JobStore.bump(s, j.id, j.version, now, **fields)
                    except Exception as e:
                        self._fail_in(s, j, "apply", e, now)
        return n

    def _noted(self, chunk: Sequence[tuple[Job, dict]], held: dict[str, int]) -> None:
        """After :meth:`_write_notes` committed ``chunk``: the cached rows of the jobs written (version
        ``held[id] + 1``) take the written fields and version, so the next snapshot reuses them instead of
        reading them again (see :meth:`_waiting_jobs`). Their planner views do not depend on these fields."""
        known = self._waiting
        for j, fields_ in chunk:
            ent = known.get(j.id)
            if ent is None or ent.row is not j or held.get(j.id) != j.version:
                continue
            for k, v in fields_.items():  # the record too: the next one carries its kind (with_earlier)
                setattr(j, k, v)
            j.version = ent.version + 1
            known[j.id] = ent._replace(version=j.version, fields=ent.fields._replace(
                **{k: v for k, v in fields_.items() if k in _Fields._fields},
                **({"expected_start_s": _expected_start_s(fields_["decision"])} if "decision" in fields_ else {})))

    # ------------------------------------------------------------------ planning, isolated per job
    def _plan_isolated(self, snapshot: Snapshot, ctx, jobs: dict[str, Job]) -> list:
        """``plan(snapshot, ctx)``; if it raises, find the jobs that make it raise by bisection
        (O(k log n) calls of ``plan`` on sub-snapshots for k such jobs), queue them in ``self._bad``
        to be failed with the reason, and plan the others. If no single job is to blame, this cycle
        places nothing (logged) and the next one tries again."""
        try:
            return plan(snapshot, ctx)
        except Exception as e:
            first = e
        waiting = list(snapshot.pending) + [pj for g in (snapshot.queued or {}).values() for pj in g]
        blamed: dict[str, Exception] = {}
        mid = len(waiting) // 2
        for half in (waiting[:mid], waiting[mid:]):
            self._bisect(snapshot, ctx, half, blamed)
        for jid, e in blamed.items():  # failed after planning; no decision or explanation is written for them
            self._bad.append((jobs.pop(jid), "planning", e))
        if blamed:
            try:
                return plan(self._subset(snapshot, [pj for pj in waiting if pj.job_id not in blamed]), ctx)
            except Exception as e:
                first = e
        log.error("planning failed and no single job is to blame (%s: %s); nothing placed this cycle",
                  type(first).__name__, first, exc_info=log.isEnabledFor(logging.DEBUG))
        return []

    def _bisect(self, snapshot: Snapshot, ctx, sub: list[PendingJob], blamed: dict[str, Exception]) -> None:
        if not sub:
            return
        try:
            plan(self._subset(snapshot, sub), ctx)
            return
        except Exception as e:
            if len(sub) == 1:
                blamed[sub[0].job_id] = e
                return
        mid = len(sub) // 2
        self._bisect(snapshot, ctx, sub[:mid], blamed)
        self._bisect(snapshot, ctx, sub[mid:], blamed)

    @staticmethod
    def _subset(snapshot: Snapshot, keep: Sequence[PendingJob]) -> Snapshot:
        """``snapshot`` with only the waiting jobs in ``keep`` (pending and queued alike)."""
        ids = {pj.job_id for pj in keep}
        queued = {k: [pj for pj in g if pj.job_id in ids] for k, g in (snapshot.queued or {}).items()}
        return replace(snapshot, pending=[pj for pj in snapshot.pending if pj.job_id in ids],
                       queued={k: g for k, g in queued.items() if g}, queued_demand=None)

    def _fail_bad(self, now: datetime) -> None:
        """Fail the jobs queued in ``self._bad`` (one short transaction, each in a savepoint)."""
        if not self._bad:
            return
        bad, self._bad = self._bad, []
        with self.store.session() as s:
            for j, step, e in bad:
                self._fail_in(s, j, step, e, now)

    # ------------------------------------------------------------------ snapshot
    def live_nodes(self, s, now: datetime) -> list[LiveNode]:
        """Nodes that heartbeated within ``node_lost_after_s`` and are not marked lost."""
        cutoff = now - timedelta(seconds=self.settings.node_lost_after_s)
        out = []
        for n in planning_rows.live_node_rows(s, cutoff):
            out.append(LiveNode(n.name, n.pool, self.canon(n.gpu_type), n.gpu_count, n.gpu_memory_gb,
                                tuple(sorted(n.healthy_gpus))))
        return out

    def _read(self, s, now: datetime):
        now_s = now.timestamp()
        self._now_s = now_s
        self._top_rank: dict[str, int] = {}  # team -> its highest entitled priority rank, this cycle (_entitled)
        views = self._views
        nodes = self.live_nodes(s, now) + [n for v in views.values() for n in v.nodes]
        pools = self.env.pools_for(nodes)
        remaining, by_project, states = planner_budgets(s, now)  # also with no job waiting: the alert is raised
        self._capped = {(st.team if st.project is None else (st.team, st.project)): st for st in states if st.capped}
        waiting = self._waiting_jobs(s)
        if not waiting:
            return None
        ctx = self.env.context(pools, now_s)
        if remaining or by_project:  # this cycle's copy of the (cached) context: only the config differs
            ctx = copy.copy(ctx)
            ctx.config = ctx.config.model_copy(update={
                "team_budget_usd": {**ctx.config.team_budget_usd, **remaining},
                "project_budget_usd": {**ctx.config.project_budget_usd, **by_project}})
        pool_index = {p.name: i for i, p in enumerate(pools)}
        node_pos = {(p.name, nd.name): k for p in pools for k, nd in enumerate(p.nodes)}
        live = {n.name: n for n in nodes}
        # GPUs held by active attempts, per node: set of GPU indices
        used: dict[str, set[int]] = defaultdict(set)
        running: list[RunningJob] = []
        held_gpus: dict[str, int] = defaultdict(int)  # team -> GPUs its active jobs hold (quotas.max_running_gpus)
        admitted_gpus: dict[str, int] = defaultdict(int)  # team -> GPUs of its jobs admitted to this cycle's plan
        for j in planning_rows.active_job_rows(s):
            held_gpus[j.team] += _job_gpus(j.spec)
            try:
                self._running_job(j, now_s, ctx, pools, pool_index, node_pos, used, running)
            except Exception as e:  # a job holding GPUs is not failed for this (logged once); the others go on
                self._log_failure(j.id, "snapshot (running job)", e, failed=False)
        self._scheduler_releases(views, pools, pool_index, live, now_s, running)
        free = []
        for p in pools:
            arr = np.zeros(len(p.nodes), dtype=np.int64)
            for k, nd in enumerate(p.nodes):
                arr[k] = len(set(live[nd.name].healthy) - used[nd.name])
            free.append(arr)
        pending: list[PendingJob] = []
        queued: dict[tuple, list[PendingJob]] = defaultdict(list)
        jobs: dict[str, Job] = {}
        self._tag_only = tag_only = set()
        self._fields = fields_of = {}
        self._gpu_capped = gpu_capped = []  # (job, fields, reason): left out of this cycle (quotas.max_running_gpus)
        gpu_caps: dict[str, int | None] = {}
        for _, j, view, f in waiting:
            if isinstance(view, Exception):  # a stored spec the planner cannot read fails this job only
                self._bad.append((j, "planning", view))
                continue
            args, tag = view
            pj = PendingJob(*args)  # as pending_job(j, pool_index, ...) would build it
            pj.priority = self._entitled(pj.team, pj.priority)
            pj.committed_pool = committed = pool_index.get(f.committed_pool) if f.committed_pool else None
            pj.review_s = (f.review_at.timestamp() if f.review_at is not None
                           else (math.inf if committed is not None else 0.0))
            if committed is not None and f.expected_start_s is not None and f.expected_start_s < now_s:
                pj.review_s = 0.0  # its expected start has passed (the jobs ahead outran their estimates): again now
            jid = pj.job_id
            cap = gpu_caps[pj.team] if pj.team in gpu_caps else gpu_caps.setdefault(pj.team, self._gpu_cap(pj.team))
            if cap is not None:  # in planning order: admitted jobs count against the cap for the ones after them
                need = pj.gpus_per_node * pj.nodes
                have, ahead = held_gpus[pj.team], admitted_gpus[pj.team]
                if have + ahead + need > cap:
                    gpu_capped.append((j, f, f"waiting: team {pj.team!r} holds {have} of its "
                                              f"quotas.max_running_gpus {cap} GPUs (this job needs {need}"
                                              + (f"; {ahead} more are planned for its jobs ahead of it)" if ahead
                                                 else ")")))
                    continue
                admitted_gpus[pj.team] = ahead + need
            if tag:
                tag_only.add(jid)
            jobs[jid] = j
            fields_of[jid] = f
            if pj.committed_pool is not None and pj.review_s > now_s:
                queued[queue_group(pj, ctx.config)].append(pj)
            else:  # new, or due for review: a reviewed job keeps its pool
                pending.append(pj)  # keeps it in the queue pass, so the top blocked job keeps its reservation)
        # fair share: decayed reference-GPU-hours of attempts in the last 8 half-lives
        since = now - timedelta(seconds=8 * FAIR_SHARE_HALF_LIFE_S)
        thr = ctx.gpus.throughput
        usage = decayed_usage([(r.team, r.gpus * thr.get(self.canon(r.gpu_type or ""), 1.0), r.started_at.timestamp(),
                                _ts(r.ended_at) if r.ended_at else math.nan)
                               for r in planning_rows.gpu_usage_rows(s, since)], now_s)
        avail = np.array(self.env.offer_provisionable(), dtype=bool) if ctx.offers else None
        if avail is not None and self.cloud is not None:
            cooling = self.cloud.cooling_offers(s, now)  # no capacity / quota just now: not again for a while
            if cooling:
                avail &= np.array([o.offer_id not in cooling for o in ctx.offers], dtype=bool)
        self._pending_by_id = {pj.job_id: pj for pj in pending}
        for group in queued.values():
            for pj in group:
                self._pending_by_id[pj.job_id] = pj
        snap = Snapshot(now_s=now_s, pending=pending, free=free, running=running, queued=dict(queued),
                        foreign_demand=self._foreign_demand(views, pool_index), offer_available=avail,
                        team_usage=usage, healthy=[None] * len(pools))
        nodes_by_pool = {p.name: [(nd.name, live[nd.name]) for nd in p.nodes] for p in pools}
        return snap, ctx, jobs, nodes_by_pool, used

    def _waiting_jobs(self, s) -> list[_Waiting]:
        """The ``queued`` jobs in planning order (priority, then age), each with its planner view:
        ``(PendingJob field values without the committed pool, cloud offers left out for an unpinned
        image)``, or the exception that building it raised, and its row's plain fields.

        One narrow query of ``(id, version)`` per cycle; the rows and views of jobs whose version this
        cycle already knows are reused (``self._waiting``, detached rows), only new or changed jobs are
        read in full and turned into views. With 10,000 queued jobs this is what keeps the snapshot
        short: loading and converting them all took ~1.5 s a cycle on 2 cores (ORM rows, JSON specs,
        :func:`pending_job`); a job's row and view change only with its version."""
        order = planning_rows.queued_order(s)
        known = self._waiting
        miss = []
        for jid, version in order:
            ent = known.get(jid)
            if ent is None or ent.version != version:
                miss.append(jid)
        for j in planning_rows.queued_rows(s, miss):
            self._remember(j)
        out, keep = [], {}
        for jid, version in order:
            ent = known.get(jid)
            if ent is not None and ent.version == version:
                keep[jid] = ent
                out.append(ent)
        self._waiting = keep
        return out

    def _remember(self, j: Job) -> None:
        """Keep the queued row ``j`` (as stored at ``j.version``) with its planner view for the snapshots."""
        try:
            pj = pending_job(j, {}, self.canon)
            tag = self.cloud is not None and not _DIGEST_RE.search(str(j.spec.get("image", "")))
            if tag:
                pj.regions = frozenset()  # cloud launches need the image pinned by digest: no offer fits
            view = (tuple(getattr(pj, f) for f in _PJ_FIELDS), tag)
        except Exception as e:  # noqa: BLE001 - failed by the snapshot's caller, with the reason
            view = e
        self._waiting[j.id] = _Waiting(j.version, j, view, _Fields(j.committed_pool, j.review_at, j.team,
                                                                   (j.spec or {}).get("project"), j.reason,
                                                                   _expected_start_s(j.decision)))

    @staticmethod
    def _scheduler_releases(views, pools, pool_index, live, now_s: float, running: list) -> None:
        """Each scheduler pool's running jobs as :class:`RunningJob` s holding their GPUs until their time limit
        (``PoolView.releases``), so the planner knows when the pool's GPUs come back. The scheduler does not say
        which node a release frees by type here: each is laid on the nodes of its GPU type that have GPUs in use,
        in node order (the pool's totals are exact; which node frees first is an approximation). Not preemptible;
        the broker's own running jobs there are among them (their store rows add nothing: :meth:`_running_job`)."""
        for v in views.values():
            p = pool_index.get(v.name)
            if p is None or not v.releases:
                continue
            nodes = pools[p].nodes
            busy = [nd.gpu_count - len(live[nd.name].healthy) for nd in nodes]
            for i, (end_s, gtype, gpus) in enumerate(sorted(v.releases)):
                alloc = []
                for k, nd in enumerate(nodes):
                    if gpus <= 0:
                        break
                    if nd.gpu_type == gtype and busy[k] > 0:
                        take = min(busy[k], gpus)
                        busy[k] -= take
                        gpus -= take
                        alloc.append((k, take))
                if alloc:
                    running.append(RunningJob(job_id=f"{v.kind}:{v.name}:{i}", pool=p, allocation=alloc,
                                              expected_end_s=max(end_s, now_s + 1.0), started_s=now_s, priority=1 << 30,
                                              preemptible=False, team=f"{v.kind}:{v.name}"))

    @staticmethod
    def _foreign_demand(views, pool_index) -> dict | None:
        """The planner's ``foreign_demand`` (pool -> ``(GPUs, GPU-seconds)``): each scheduler pool's pending jobs
        that are not the broker's (``PoolView.backlog_gpus``/``backlog_gpu_s``), which compete for the same GPUs
        ahead of the broker's queue. ``None`` when no scheduler pool has a queue."""
        out = {pool_index[v.name]: (v.backlog_gpus, v.backlog_gpu_s) for v in views.values()
               if v.name in pool_index and (v.backlog_gpus or v.backlog_gpu_s)}
        return out or None

    def _gpu_cap(self, team: str) -> int | None:
        """``team``'s ``quotas.max_running_gpus`` (``None``: unlimited, or no quotas section)."""
        quotas = getattr(self.settings, "quotas", None)
        return quotas.for_team(team).max_running_gpus if quotas is not None else None

    def _explain_gpu_capped(self, j: Job, f: _Fields, why: str, notes: list) -> None:
        """A waiting job left out of this cycle by its team's ``quotas.max_running_gpus``: note why (for
        :meth:`_write_notes`) when the reason changes, and drop its pool commitment, so that once admitted again
        it is planned afresh (and its reason rewritten) instead of waiting out a review time."""
        if f.reason == why and f.committed_pool is None:
            return
        rec = with_earlier({"kind": "undecided", "reason": why, "option": None, "alternatives": []}, j.decision,
                           _dt(self._now_s))
        notes.append((j, {"reason": why, "decision": rec, "committed_pool": None, "review_at": None}))

    def _entitled(self, team: str, priority: int) -> int:
        """``priority`` (a stored :attr:`broker.model.PriorityClass.rank`) capped at ``team``'s highest entitled class
        (``settings.quotas.priority_classes``): a job stored as ``critical`` before its team's grant was revoked (or
        straight into the store) is planned, and preempts or is preempted, as its team's highest class."""
        quotas = getattr(self.settings, "quotas", None)
        if quotas is None:
            return priority
        top = self._top_rank.get(team)
        if top is None:
            top = self._top_rank[team] = quotas.for_team(team).max_priority_rank
        return min(priority, top)

    def _running_job(self, j: Job, now_s: float, ctx, pools, pool_index, node_pos, used, running: list) -> None:
        """Adds active job ``j``'s GPUs to ``used`` and, when on-prem, its :class:`RunningJob` to ``running``.
        A job on a scheduler pool holds GPUs here only while ``starting`` (submitted, maybe not yet allocated
        by the cluster: counted against the free GPUs its cluster reports; once it runs there, the cluster's own
        count and release profile have it)."""
        pl = j.placement or {}
        if pl.get("pool") in self._views:
            if j.state == S.starting.value:
                for part in pl.get("nodes", []):
                    held = used[part["node"]]
                    k = len(held)
                    held.update(range(k, k + len(part["gpus"])))
            return
        if pl.get("kind") != "onprem":
            return
        alloc = []
        for part in pl.get("nodes", []):
            used[part["node"]].update(part["gpus"])
            k = node_pos.get((pl.get("pool"), part["node"]))
            if k is not None:
                alloc.append((k, len(part["gpus"])))
        p = pool_index.get(pl.get("pool"))
        if p is None or not alloc:
            return
        gtype = pools[p].nodes[alloc[0][0]].gpu_type
        started = _ts(j.started_at) or _ts(j.dispatched_at) or now_s
        work = max(float(j.spec["estimated_duration_s"]) - float(j.work_done_s or 0.0), 1.0)
        end = started + work / ctx.gpus.throughput.get(gtype, 1.0)
        if end <= now_s:  # it outran its estimate: it holds its GPUs until its time limit at the latest (the agent's)
            end = started + pool_time_limit_s(float(j.spec["estimated_duration_s"]),
                                              time_limit_s=j.spec.get("time_limit_s"))
        running.append(RunningJob(
            job_id=j.id, pool=p, allocation=alloc,
            expected_end_s=max(end, now_s + 1.0),
            started_s=started, priority=self._entitled(j.team, j.priority),
            preemptible=bool(j.spec.get("preemptible", False)) and j.stop_reason is None and not j.cancel_requested,
            team=j.team, checkpoint_interval_s=float(j.spec.get("checkpoint_interval_s") or DEFAULT_CHECKPOINT_INTERVAL_S),
            checkpointable=bool(j.spec.get("checkpointable", True))))

    def _tag_note(self, job_id: str) -> str:
        """Why a job got no cloud offer, when its image is not pinned by digest."""
        if job_id not in getattr(self, "_tag_only", ()):
            return ""
        return ("; cloud offers were not considered: cloud launches need the image pinned by digest "
                "(image: repo@sha256:<64 hex>), so all ranks of a gang run the same bits")

    def _unprovisionable_cloud(self, ctx, j: Job, pj: PendingJob | None, k: int = 3) -> list[dict]:
        """The ``k`` best cloud offers for the job, costed from now, as infeasible explain alternatives
        (their provider is not configured): what bursting would have cost, in $, kWh, kgCO2e and wait."""
        if pj is None or not ctx.offers:
            return []
        idx = ctx.compatible_offers(pj)
        if idx.size == 0:
            return []
        now_s = self._now_s
        est = ctx.cloud_estimates(pj, idx, now_s)
        # ranked by the score of dollars and carbon only: these offers cannot be provisioned, so no value of time
        rank = score(est.dollars_usd, est.carbon_kg, est.delay_s, 0.0, ctx.config.carbon_price_usd_per_tonne)
        rank = np.where(np.isnan(rank), np.inf, rank)
        out = []
        for i in np.argsort(rank, kind="stable")[:k]:
            if not np.isfinite(rank[i]):
                break
            o = ctx.offers[int(idx[i])]
            delay = float(est.delay_s[i])
            out.append({"kind": "cloud", "target": o.offer_id, "start_s": now_s + delay, "wait_s": delay,
                        "runtime_s": float(est.runtime_s[i]), "dollars_usd": float(est.dollars_usd[i]),
                        "energy_kwh": float(est.energy_kwh[i]), "carbon_kg": float(est.carbon_kg[i]),
                        "score": None, "feasible": False,
                        "note": f"not provisionable: provider {o.provider!r} is not configured (cloud_providers)"})
        return out

    # ------------------------------------------------------------------ apply
    def _apply(self, s, now: datetime, decisions, jobs: dict[str, Job], ctx, nodes_by_pool, used, kinds,
               isolate: bool = False, notes: list | None = None) -> list:
        """Step 4 inside session ``s`` (the fence already advanced). With ``isolate``, each decision runs in
        its own savepoint and a decision that raises fails its job (:meth:`_fail_in`); the others apply.
        Decisions that hold nothing (``wait``, and the reason of a job given no decision) are appended to
        ``notes`` as ``(job, fields)`` for :meth:`_write_notes`, after this transaction: a burst's thousands
        of them never hold row locks in the fenced transaction. Returns ``[(job_id, attempt)]`` to dispatch."""
        notes = [] if notes is None else notes
        dispatched: list[tuple[str, int]] = []
        for d in decisions:
            j = jobs.get(d.job_id)
            if j is None:
                continue
            if not isolate:
                self._apply_one(s, now, d, j, ctx, nodes_by_pool, used, kinds, dispatched, notes)
                continue
            try:
                with s.begin_nested():
                    self._apply_one(s, now, d, j, ctx, nodes_by_pool, used, kinds, dispatched, notes)
            except Exception as e:
                self._fail_in(s, j, "apply", e, now)
        # jobs the planner left without a decision (nothing can hold them now): say why
        decided = {d.job_id for d in decisions}
        fields_of = getattr(self, "_fields", {})
        whys: dict[tuple, str] = {}  # one note per (team, project, image not pinned) this cycle
        for jid, j in jobs.items():
            f = fields_of.get(jid)
            if jid in decided or (f.committed_pool if f is not None else j.committed_pool) is not None:
                continue
            if not isolate:
                self._explain_undecided(j, notes, f, whys)
                continue
            try:
                with s.begin_nested():
                    self._explain_undecided(j, notes, f, whys)
            except Exception as e:
                self._fail_in(s, j, "apply", e, now)
        for j, f, why in getattr(self, "_gpu_capped", ()):  # left out by quotas.max_running_gpus: say so
            self._explain_gpu_capped(j, f, why, notes)
        return dispatched

    def _apply_one(self, s, now: datetime, d, j: Job, ctx, nodes_by_pool, used, kinds, dispatched: list,
                   notes: list) -> None:
        """One decision ``d`` for job ``j`` inside session ``s``; placed jobs are appended to ``dispatched``,
        a ``wait`` to ``notes``."""
        st = self.settings
        pending_by_id = self._pending_by_id
        kind = d.kind
        kinds[kind.value] = kinds.get(kind.value, 0) + 1
        rec = d.record()
        if kind != DecisionKind.provision and not any(a["kind"] == "cloud" for a in rec["alternatives"]):
            rec["alternatives"].extend(self._unprovisionable_cloud(ctx, j, pending_by_id.get(j.id)))
        rec["signals"] = self._signals_note(ctx, d)
        rec = with_earlier(json_safe(rec), j.decision, now)  # explain shows the latest decision of every kind
        if kind == DecisionKind.preempt:
            for vid in d.victims:
                v = JobStore.job_row(s, vid)
                if v is not None and v.state in (S.starting.value, S.running.value) and v.stop_reason is None:
                    planning_rows.flag(s, v, now, f"preemption requested for {d.job_id}", stop_reason="preempt",
                                 reason=f"preemption requested for higher-priority job {d.job_id}")
            review = now + timedelta(seconds=st.cancel_grace_s + 30.0)
            JobStore.bump(s, j.id, j.version, now, decision=rec, committed_pool=d.pool, review_at=review,
                          reason=f"preempting {', '.join(d.victims)}; starts when their GPUs are free")
        elif kind == DecisionKind.start:
            nodes = nodes_by_pool[d.pool]
            parts = []
            ok = True
            for rank, (k, g) in enumerate(d.allocation):
                name, ln = nodes[k]
                freeg = sorted(set(ln.healthy) - used[name])
                if len(freeg) < g:
                    ok = False
                    break
                pick = freeg[:g]
                used[name].update(pick)
                parts.append({"node": name, "gpus": pick, "rank": rank})
            if not ok:
                log.error("planner placed %s on more GPUs than free; left queued", d.job_id)
                return
            attempt = j.attempt + 1
            gtype = nodes[d.allocation[0][0]][1].gpu_type
            placement = {"kind": "onprem", "pool": d.pool, "gpu_type": gtype, "nodes": parts}
            where = ", ".join(f"{p['node']} GPUs {p['gpus']}" for p in parts)
            view = self._views.get(d.pool)
            if view is not None:  # an existing scheduler's pool: it picks the nodes; submitted after commit
                placement.update(kind=view.kind, scheduler_gpu_type=view.gres[parts[0]["node"]])
                where = (f"{len(parts)} node(s) x {len(parts[0]['gpus'])} {gtype}, submitted to its {view.kind} "
                         f"cluster (planned on {', '.join(p['node'] for p in parts)})")
            placed = f"placed on pool {d.pool}: {where} (attempt {attempt})"
            rec["reason"] = rec.get("reason") or placed
            if JobStore.cas(s, j.id, j.version, S.queued.value, S.starting.value, placed, now,
                            placement=placement, attempt=attempt, decision=rec, dispatched_at=now,
                            state_deadline_at=now + timedelta(seconds=st.starting_deadline_s),
                            committed_pool=None, review_at=None):
                planning_rows.add_onprem_attempt(s, j.id, attempt, d.pool, parts, gtype, now, kind=placement["kind"])
                if view is not None:
                    self._submit.append((j.id, attempt))
        elif kind == DecisionKind.provision:
            offer = ctx.offers[d.offer_index]
            note = self.env.cloud_price_note(offer, self._now_s) if hasattr(self.env, "cloud_price_note") else None
            if note is not None:
                rec["cloud_price"] = json_safe(note)
            attempt = j.attempt + 1
            rec["reason"] = rec.get("reason") or f"provisioning {offer.offer_id} (attempt {attempt})"
            if JobStore.cas(s, j.id, j.version, S.queued.value, S.provisioning.value,
                            f"provisioning {offer.offer_id} (attempt {attempt})", now,
                            placement={"kind": "cloud", "offer_id": offer.offer_id, "provider": offer.provider,
                                       "region": offer.region, "zone": offer.zone, "gpu_type": offer.gpu_type,
                                       "instance_type": offer.instance_type, "market": offer.market.value},
                            attempt=attempt, decision=rec, dispatched_at=now, committed_pool=None, review_at=None,
                            state_deadline_at=now + timedelta(seconds=st.provisioning_deadline_s)):
                dispatched.append((j.id, attempt))  # the dispatch task hands it to provisioning
        elif kind == DecisionKind.defer:
            o = d.option
            why = (f"deferred to a cheaper/cleaner window on pool {d.pool} starting {_dt(d.not_before).isoformat()}"
                   + (f" (${o.dollars_usd:.4f}, {o.carbon_kg:.4f} kgCO2e)" if o is not None else ""))
            rec["reason"] = rec.get("reason") or why
            JobStore.cas(s, j.id, j.version, S.queued.value, S.deferred.value, why, now,
                         not_before=_dt(d.not_before), deferred_once=True, decision=rec, committed_pool=None,
                         review_at=None)
        elif kind == DecisionKind.wait:
            review = _dt(d.not_before) if d.not_before is not None and math.isfinite(d.not_before) else None
            o = d.option
            why = (f"waiting for {j.spec['gpus_per_node'] * j.spec['nodes']} GPU(s) in pool {d.pool}"
                   + (f"; expected start {_dt(o.start_s).isoformat(timespec='seconds')} (in {wait_text(o.wait_s)})"
                      if o is not None and math.isfinite(o.start_s) else "")
                   + self._passing_note(ctx, pending_by_id.get(j.id))
                   + (f"; options reviewed again at {review.isoformat(timespec='seconds')}" if review else ""))
            if d.reason.startswith((BUDGET_CAP_NOTE, PROJECT_CAP_NOTE)):
                why = f"{d.reason}; {why}"
            rec["reason"] = why if not d.reason or why.startswith(d.reason) else f"{d.reason}; {why}"
            notes.append((j, dict(committed_pool=d.pool, review_at=review, decision=rec, reason=why)))
        elif kind == DecisionKind.reject:
            why = d.reason or "no pool or offer can hold it"
            if self._tag_note(j.id):  # cloud offers were left out, not found wanting
                why = why.replace("no on-prem pool and no cloud offer can", "no on-prem pool can") + self._tag_note(j.id)
                rec["reason"] = why
            JobStore.cas(s, j.id, j.version, S.queued.value, S.failed.value, why, now, decision=rec,
                         finished_at=now)

    def _signals_note(self, ctx, d) -> list[dict]:
        """Where the grid signals of decision ``d``'s place came from (its pool's carbon and price zones, or its
        cloud offer's carbon zone): the ``signals`` entries of the explain record (``explain`` of
        :class:`broker.service.live.LiveSignals`), memoised per context and cycle."""
        if d.kind == DecisionKind.provision and d.offer_index is not None:
            zones = [(ctx.offers[d.offer_index].carbon_zone, "carbon")]
        elif d.pool is not None and d.pool in self.env.site_pools:
            p = self.env.site_pools[d.pool]
            zones = [(p.carbon_zone, "carbon"), (p.price_zone, "price")]
        else:
            return []
        memo = self.__dict__.setdefault("_signal_memo", {})
        mkey = (id(ctx.signals), self._now_s)
        if memo.get("key") != mkey:
            memo.clear()
            memo["key"] = mkey
        missing = [z for z in zones if z not in memo]
        explain = getattr(ctx.signals, "explain", None)
        if missing and explain is not None:
            memo.update(zip(missing, explain(missing, self._now_s)))
        return [memo[z] for z in zones if z in memo]

    @staticmethod
    def _passing_note(ctx, pj: PendingJob | None) -> str:
        """Until when jobs of lighter teams may still go ahead of a waiting job: those submitted less than
        ``priority_max_age_s / priority_weight_age`` after it (:mod:`broker.planner.fair_share`, "The bound");
        empty when age does not weigh (weight 0) or the job is unknown."""
        cfg = ctx.config
        if pj is None or cfg.priority_weight_age <= 0:
            return ""
        until = _dt(pj.submit_s + cfg.priority_max_age_s / cfg.priority_weight_age)
        return f"; jobs of lighter teams submitted before {until.isoformat(timespec='seconds')} may go first (fair share)"

    def _explain_undecided(self, j: Job, notes: list, f: _Fields | None = None, whys: dict | None = None) -> None:
        """A job the planner gave no decision (nothing can hold it now): note why (for :meth:`_write_notes`).
        ``f``: the row's fields as this cycle read them; ``whys``: this cycle's notes by
        ``(team, project, image not pinned)`` (the note depends on nothing else)."""
        jid = j.id
        if f is None:
            f = _Fields(j.committed_pool, j.review_at, j.team, (j.spec or {}).get("project"), j.reason)
        key = (f.team, f.project, jid in getattr(self, "_tag_only", ()))
        why = whys.get(key) if whys is not None else None
        if why is None:
            why = self._undecided_note(jid, f.team, f.project)
            if whys is not None:
                whys[key] = why
        if f.reason != why:  # a record of its own: explain shows it with the earlier kinds (with_earlier)
            rec = with_earlier({"kind": "undecided", "reason": why, "option": None, "alternatives": []}, j.decision,
                               _dt(self._now_s))
            notes.append((j, {"reason": why, "decision": rec}))

    def _undecided_note(self, jid: str, team: str, project: str | None) -> str:
        """Why a job of ``team`` (and ``project``) got no decision this cycle (:meth:`_explain_undecided`)."""
        why = ("no live pool can hold it now and no cloud provider is configured; "
               "waiting for a node that fits (gpus_per_node, nodes, gpu_types, min_gpu_memory_gb)")
        if self.cloud is not None:
            why = ("no live pool can hold it now and no cloud offer is available (cooling down after a failure, "
                   "or none fits); waiting for a node or an offer that fits" + self._tag_note(jid))
        caps = [c for c in (self._capped.get(team), self._capped.get((team, project)) if project else None)
                if c is not None]
        if caps:
            cap = min(caps, key=lambda c: c.remaining_usd)  # the team's on a tie, as the planner names it
            head, who = ((BUDGET_CAP_NOTE, f"team {team}") if cap.project is None
                         else (PROJECT_CAP_NOTE, f"project {cap.project} of team {team}"))
            why = (f"{head}: {who} has ${max(cap.remaining_usd, 0.0):.2f} of its "
                   f"${cap.cap_usd:.2f} cloud budget left for {cap.month}; no new cloud spend, the job waits for "
                   f"on-prem capacity or its deadline; " + why)
        return why
