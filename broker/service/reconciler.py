"""The reconciler: makes the store's view true again after faults (DESIGN.md §5, "every state has a deadline").

One pass (:meth:`Reconciler.run`, every ``reconcile_interval_s`` from beat; idempotent):

1. **Lost nodes**: a node silent for ``node_lost_after_s`` is marked ``lost``; its
   ``running`` jobs become ``interrupted`` then ``queued`` (keeping checkpointed work),
   its ``starting`` jobs go back to ``queued``. If the node comes back, its agent
   stops the stale processes (their attempt is no longer the job's current one).
2. **Re-dispatch**: a ``provisioning`` job whose provision message was lost (Redis
   restarted, worker killed) is sent again. On-prem ``starting`` jobs need no message:
   node agents poll the node API for their work.
3. **State deadlines**: ``starting`` past ``starting_deadline_s`` (cloud: ``cloud.start_deadline_s``)
   and ``provisioning`` past ``provisioning_deadline_s`` go back to ``queued`` with the reason;
   a ``provisioning`` job whose provision message was lost is sent again after 5 minutes.
3b. **Cloud attempts** (when a :class:`broker.service.cloud.CloudBroker` is given): cancels, instances gone
   (spot reclaimed), instances of dead attempts, the orphan sweep (:meth:`CloudBroker.watch`).
4. **Recurring runs**: every due schedule creates its job, with the idempotency key
   ``schedule:<id>:<fire instant>`` — two beats or a retried pass create it once.
5. **Retention** (``retention_days`` > 0): jobs finished (succeeded, failed, cancelled) more than
   ``retention_days`` ago are deleted with their events, logs, attempts and cloud-instance records,
   oldest first, at most ``retention_batch`` jobs per pass in one short transaction (rows another
   writer holds are skipped, ``FOR UPDATE SKIP LOCKED``); a job with a cloud instance not yet
   terminated is kept until it is. Nothing is archived (see ``BrokerSettings.retention_days``).
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta
from typing import Callable

from sqlalchemy import delete, select, update

from broker.service.store.tables import Attempt, CloudInstance, Job, JobEvent, JobLog, Node, Schedule, utcnow
from broker.model import DEFAULT_CHECKPOINT_INTERVAL_S, JobSpec
from broker.states import JobState
from broker.service.store.core import JobStore

__all__ = ["Reconciler", "checkpointed_work_s", "requeue_lost"]

log = logging.getLogger("fedbroker.reconciler")
S = JobState


def checkpointed_work_s(spec: dict, ran_s: float, throughput: float = 1.0) -> float:
    """Reference-GPU seconds kept by a job stopped after ``ran_s`` seconds: whole checkpoint
    intervals times the GPU's relative throughput; 0 for a job that does not checkpoint."""
    if not spec.get("checkpointable", True) or ran_s <= 0:
        return 0.0
    every = float(spec.get("checkpoint_interval_s") or DEFAULT_CHECKPOINT_INTERVAL_S)
    return math.floor(ran_s / every) * every * throughput


def requeue_lost(s, j: Job, now: datetime, why: str, outcome: str = "lost", max_attempts: int | None = None) -> bool:
    """Inside session ``s``: end the job's current attempt with ``outcome`` and put the job back
    in the queue (``running -> interrupted -> queued`` or ``starting -> queued``). A job that has
    used ``max_attempts`` attempts fails instead (``None``: no limit). The work kept is counted from
    the attempt's own start; the job's ``started_at`` is cleared (the next attempt sets it again).
    Returns whether applied."""
    a = JobStore.attempt_row(s, j.id, j.attempt)
    if a is not None and a.ended_at is None:
        a.ended_at, a.outcome, a.reason = now, outcome, why
    version, state = j.version, j.state  # the ORM may refresh ``j`` after the first compare-and-set
    if max_attempts is not None and j.attempt >= max_attempts and state in (
            S.starting.value, S.running.value, S.provisioning.value):
        return JobStore.cas(s, j.id, version, state, S.failed.value,
                            f"gave up after {j.attempt} attempts; the last: {why}", now, finished_at=now)
    if state == S.running.value:
        started = (a.started_at if a is not None and a.started_at else None) or j.started_at
        ran = (now - started).total_seconds() if started else 0.0
        kept = checkpointed_work_s(j.spec, ran)
        if not JobStore.cas(s, j.id, version, S.running.value, S.interrupted.value, why, now,
                            work_done_s=(j.work_done_s or 0.0) + kept):
            return False
        return JobStore.cas(s, j.id, version + 1, S.interrupted.value, S.queued.value,
                            f"requeued after interruption ({why}); {kept:.0f} s of work kept from checkpoints", now,
                            placement=None, stop_reason=None, dispatched_at=None, state_deadline_at=None,
                            committed_pool=None, review_at=None, started_at=None)
    if state in (S.starting.value, S.provisioning.value):
        return JobStore.cas(s, j.id, version, state, S.queued.value, why, now, placement=None, stop_reason=None,
                            dispatched_at=None, state_deadline_at=None, committed_pool=None, review_at=None)
    return False


class Reconciler:
    """Runs reconciler passes against a :class:`JobStore` (see the module docstring).

    Args:
        store: the job store.
        settings: :class:`broker.service.settings.BrokerSettings` (timeouts).
        dispatch: ``dispatch(job_id, attempt)`` to re-send a provisioning job's message.
    """

    def __init__(self, store: JobStore, settings, dispatch: Callable[[str, int], None] | None = None, cloud=None):
        self.store = store
        self.settings = settings
        self.dispatch = dispatch
        self.cloud = cloud

    def run(self, now: datetime | None = None) -> dict:
        """One pass at ``now``. Returns counts: ``lost_nodes``, ``requeued``, ``redispatched``,
        ``timed_out``, ``scheduled``, and ``changed`` (their sum less re-dispatches); with retention on,
        ``purged``: rows deleted by :meth:`purge_finished` (``jobs``, ``events``, ``logs``, ``attempts``,
        ``cloud_instances``)."""
        now = now or utcnow()
        out = {"lost_nodes": 0, "requeued": 0, "redispatched": 0, "timed_out": 0, "scheduled": 0}
        self._lost_nodes(now, out)
        self._deadlines(now, out)
        if self.cloud is not None:
            try:
                got = self.cloud.watch(now)
            except Exception:  # a provider outage must not stop the rest of the pass
                log.exception("cloud watch failed; next pass tries again")
            else:
                out["cloud"] = got
                out["requeued"] += got.get("changed", 0)
        self._schedules(now, out)
        if self.settings.retention_days > 0:
            out["purged"] = self.purge_finished(now)
        out["changed"] = out["lost_nodes"] + out["requeued"] + out["timed_out"] + out["scheduled"]
        if out["changed"] or out["redispatched"] or out.get("purged", {}).get("jobs"):
            log.info("reconciler: %s", out)
        return out

    # ------------------------------------------------------------------ 5. retention
    def purge_finished(self, now: datetime | None = None) -> dict[str, int]:
        """Delete up to ``settings.retention_batch`` jobs that finished (``finished_at``) more than
        ``settings.retention_days`` days before ``now``, oldest first, with their events, logs, attempts
        and cloud-instance records, in one transaction. Jobs with a cloud instance still live (``intent``,
        ``running``, ``terminating``) and rows locked by another writer are skipped. A no-op when
        ``retention_days`` is 0. Returns the rows deleted per table: ``jobs``, ``events``, ``logs``,
        ``attempts``, ``cloud_instances``."""
        from broker.service.cloud import LIVE_ROW_STATES

        out = {"jobs": 0, "events": 0, "logs": 0, "attempts": 0, "cloud_instances": 0}
        days = float(self.settings.retention_days)
        if days <= 0:
            return out
        cutoff = (now or utcnow()) - timedelta(days=days)
        live_cloud = select(CloudInstance.job_id).where(CloudInstance.state.in_(LIVE_ROW_STATES))
        with self.store.session() as s:
            ids = s.execute(select(Job.id).where(
                Job.state.in_([S.succeeded.value, S.failed.value, S.cancelled.value]), Job.finished_at < cutoff,
                Job.id.not_in(live_cloud)).order_by(Job.finished_at, Job.id).limit(int(self.settings.retention_batch))
                .with_for_update(skip_locked=True)).scalars().all()
            if not ids:
                return out
            for key, table in (("events", JobEvent), ("logs", JobLog), ("attempts", Attempt),
                               ("cloud_instances", CloudInstance)):
                out[key] = s.execute(delete(table).where(table.job_id.in_(ids))).rowcount
            out["jobs"] = s.execute(delete(Job).where(Job.id.in_(ids))).rowcount
        return out

    # ------------------------------------------------------------------ 1. lost nodes
    def _lost_nodes(self, now: datetime, out: dict) -> None:
        cutoff = now - timedelta(seconds=self.settings.node_lost_after_s)
        with self.store.session() as s:
            lost = s.execute(select(Node.name).where(Node.state == "up", Node.last_heartbeat_at < cutoff)).scalars().all()
            for name in lost:
                # only if still silent (a heartbeat may have landed since the read)
                r = s.execute(update(Node).where(Node.name == name, Node.state == "up", Node.last_heartbeat_at < cutoff)
                              .values(state="lost"))
                out["lost_nodes"] += r.rowcount
            down = set(s.execute(select(Node.name).where(Node.state == "lost")).scalars())
            if not down:
                return
            active = s.execute(select(Job).where(Job.state.in_([S.starting.value, S.running.value]))).scalars().all()
            for j in active:
                pl = j.placement or {}
                if pl.get("kind") != "onprem":
                    continue
                gone = [p["node"] for p in pl.get("nodes", []) if p["node"] in down]
                if gone:
                    out["requeued"] += requeue_lost(s, j, now, f"node {', '.join(gone)} stopped heartbeating",
                                                    max_attempts=self.settings.max_attempts)

    # ------------------------------------------------------------------ 2-3. dispatch and state deadlines
    def _deadlines(self, now: datetime, out: dict) -> None:
        # provisioning takes minutes (and the provision task holds a per-job lock): re-send only after 5 min
        provision_before = now - timedelta(seconds=max(self.settings.dispatch_retry_s, 300.0))
        resend = []
        with self.store.session() as s:
            rows = s.execute(select(Job).where(Job.state.in_([S.starting.value, S.provisioning.value]))).scalars().all()
            for j in rows:
                cloud = (j.placement or {}).get("kind") == "cloud"
                if j.state_deadline_at is not None and j.state_deadline_at < now:
                    limit = (self.settings.provisioning_deadline_s if j.state == S.provisioning.value
                             else self.settings.cloud.start_deadline_s if cloud else self.settings.starting_deadline_s)
                    what = "its instances created" if j.state == S.provisioning.value else (
                        f"a running report from its instances (they report to {self.settings.effective_report_url}:"
                        " is it reachable from their subnets?)" if cloud else "a running report from its node agents")
                    if cloud and j.state == S.starting.value and self.cloud is not None:
                        self.cloud.mark_attempt(s, j.id, j.attempt, f"StartTimeout: no running report in {limit:.0f} s", now)
                    out["timed_out"] += requeue_lost(s, j, now, f"still {j.state} after {limit:.0f} s without "
                                                     f"{what}", "timed_out", max_attempts=self.settings.max_attempts)
                elif (j.dispatched_at is not None and j.state == S.provisioning.value
                      and j.dispatched_at < provision_before):
                    # a lost provision message (Redis restarted, worker killed): send it again
                    if JobStore.bump(s, j.id, j.version, now, dispatched_at=now):
                        resend.append((j.id, j.attempt))
        if self.dispatch is not None:
            for job_id, attempt in resend:
                try:
                    self.dispatch(job_id, attempt)
                    out["redispatched"] += 1
                except Exception:
                    log.exception("re-dispatch of %s failed", job_id)

    # ------------------------------------------------------------------ 4. recurring runs
    def _schedules(self, now: datetime, out: dict) -> None:
        from broker.recurring import due_fires, next_fire

        with self.store.session() as s:
            due = s.execute(select(Schedule).where(Schedule.enabled.is_(True), Schedule.next_fire_at <= now)).scalars().all()
            due = [(d.id, d.team, d.cron, d.timezone, d.spec, d.last_fire_at, d.created_at, d.next_fire_at) for d in due]
        for sid, team, cron, tz, spec, last, created, nxt in due:
            fires = []
            try:
                fires = due_fires(cron, tz, last, created, now, max_catchup=1)
                for fire in fires:
                    run_spec = JobSpec.model_validate({**spec, "team": team})
                    _, created_job = self.store.submit(team, run_spec, now=now, schedule_id=sid,
                                                       idempotency_key=f"schedule:{sid}:{fire.isoformat()}")
                    out["scheduled"] += created_job
                new_next = next_fire(cron, tz, now)
            except Exception as e:  # one bad schedule must not stop the others; it is paused with the reason
                log.exception("schedule %s (team %s) could not create its run; pausing it", sid, team)
                out.setdefault("schedule_errors", {})[sid] = f"{type(e).__name__}: {e}"
                with self.store.session() as s:
                    s.execute(update(Schedule).where(Schedule.id == sid).values(
                        enabled=False, last_error=f"paused at {now.isoformat(timespec='seconds')}: "
                                                  f"its run could not be created ({type(e).__name__}: {e})"[:2000]))
                continue
            with self.store.session() as s:
                s.execute(update(Schedule).where(Schedule.id == sid, Schedule.next_fire_at == nxt)
                          .values(next_fire_at=new_next, last_fire_at=fires[-1] if fires else last))
