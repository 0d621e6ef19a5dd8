"""The reconciler: makes the store's view true again after faults (ARCHITECTURE.md §5, "every state has a deadline").

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
3a. **Scheduler pools** (when :class:`broker.service.schedulers.SchedulerPools` are given): one poll per
   pool follows every job placed there, ends, cancels, requeues and sweeps (:meth:`SchedulerPools.watch`); their
   ``starting`` deadline is checked there (the job must also be cancelled in its cluster), not in step 3.
3b. **Cloud attempts** (when a :class:`broker.service.cloud.CloudBroker` is given): cancels, instances gone
   (spot reclaimed), instances of dead attempts, the orphan sweep (:meth:`CloudBroker.watch`).
4. **Recurring runs**: every due schedule creates its job, with the idempotency key
   ``schedule:<id>:<fire instant>`` — two beats or a retried pass create it once. At most
   ``schedule_runs_per_pass`` schedules per pass, round-robin across teams (each team's earliest due fire
   first, :func:`broker.service.store.attempts.due_schedules`); the others fire in the next passes. A run
   counts against its team's ``quotas.max_queued_jobs`` and ``quotas.max_queued_spec_bytes`` like any submit,
   and its priority class must be within the team's ``quotas.priority_classes`` and its time limit within
   ``quotas.max_time_limit_s``: otherwise the fire is skipped (no job), the schedule moves on to its next fire,
   and the skip is recorded on the schedule (``last_skip_at``, ``last_skip_reason``) and as a ``schedule.skip``
   audit event.
4b. **Idle on-prem GPUs**: each closed UTC hour, one ``idle_amortised`` usage line per registered node with GPUs
   no running attempt held (:func:`broker.service.ledger.meter_pool_idle`), written once (the ledger's key);
   the first pass meters the last :data:`IDLE_LOOKBACK_H` hours, later ones the hours since the last line
   (at most that many per pass).
5. **Retention** (``retention_days`` > 0): jobs finished (succeeded, failed, cancelled) more than
   ``retention_days`` ago are deleted with their events, logs, attempts and cloud-instance records,
   oldest first, at most ``retention_batch`` jobs per pass in one short transaction (rows another
   writer holds are skipped, ``FOR UPDATE SKIP LOCKED``); a job with a cloud instance not yet
   terminated is kept until it is. Nothing is archived (see ``BrokerSettings.retention_days``).
5a. **Audit retention** (``audit_retention_days`` > 0, default 400): audit events recorded more than
   ``audit_retention_days`` ago are deleted, oldest first, at most ``audit_retention_batch`` per pass in one
   short transaction (:func:`broker.service.store.tokens.purge_audit_events`). Independent of job retention:
   the audit log outlives the jobs it names.
5b. **Stored spec budgets**: a team whose stored jobs' specs (finished ones included, ``team_usage.stored_spec_bytes``)
   pass its ``quotas.stored_spec_bytes`` has its oldest finished jobs deleted as retention deletes them (the same
   store function, the usage ledger kept) until it is within it, at most ``retention_batch`` jobs a pass over all
   teams, one transaction per team; unfinished jobs are never deleted (``quotas.max_queued_spec_bytes`` bounds
   them), nor jobs with a live cloud instance; one log line per team (:meth:`Reconciler.purge_over_spec_budget`).
6. **Log budgets**: a team whose stored logs pass its ``quotas.log_bytes`` has its oldest logs trimmed to
   their head and tail (``log_trim_keep_bytes`` each), then to a marker, until it is within it
   (:mod:`broker.service.log_budget`).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Callable

from broker.instance_states import LIVE_INSTANCE_STATES
from broker.model import JobSpec
from broker.service import ledger
from broker.service.lifecycle import requeue_lost
from broker.service.log_throttle import LogThrottle
from broker.service.store import attempts as repo
from broker.service.store import tokens as audit_repo
from broker.service.store import usage as usage_repo
from broker.service.store.core import JobStore
from broker.service.store.tables import utcnow
from broker.states import TERMINAL_STATES, JobState

__all__ = ["Reconciler", "IDLE_LOOKBACK_H", "LOG_TRIMS_PER_PASS"]

#: hours of idle on-prem GPU time the reconciler meters back at most (the first pass, or after a downtime)
IDLE_LOOKBACK_H = 24
#: most logs one pass trims for the teams over their ``quotas.log_bytes`` (each up to 16 MiB freed; 100 logs took
#: ~1 s in one transaction on 2 loaded cores)
LOG_TRIMS_PER_PASS = 100

log = logging.getLogger("fedbroker.reconciler")
S = JobState


class Reconciler:
    """Runs reconciler passes against a :class:`JobStore` (see the module docstring).

    Args:
        store: the job store.
        settings: :class:`broker.service.settings.BrokerSettings` (timeouts).
        dispatch: ``dispatch(job_id, attempt)`` to re-send a provisioning job's message.
    """

    def __init__(self, store: JobStore, settings, dispatch: Callable[[str, int], None] | None = None, cloud=None,
                 schedulers=None):
        self.store = store
        self.schedulers = schedulers
        self.settings = settings
        self.dispatch = dispatch
        self.cloud = cloud
        self._skip_log = LogThrottle(60.0)

    def run(self, now: datetime | None = None) -> dict:
        """One pass at ``now``. Returns counts: ``lost_nodes``, ``requeued``, ``redispatched``,
        ``timed_out``, ``scheduled``, ``schedule_skips`` (fires skipped over a quota or entitlement),
        ``schedules_left`` (1 when the pass stopped at ``schedule_runs_per_pass``: more may be due),
        ``idle_lines`` (:meth:`meter_idle`), and ``changed`` (their sum less
        re-dispatches, idle lines not counted); with retention on,
        ``purged``: rows deleted by :meth:`purge_finished` (``jobs``, ``events``, ``logs``, ``attempts``,
        ``cloud_instances``); with audit retention on, ``audit_purged``: audit events deleted by
        :meth:`purge_audit`; ``spec_budget``: :meth:`purge_over_spec_budget`'s counts; ``log_budget``:
        :meth:`trim_logs`'s counts."""
        now = now or utcnow()
        out = {"lost_nodes": 0, "requeued": 0, "redispatched": 0, "timed_out": 0, "scheduled": 0,
               "schedule_skips": 0, "schedules_left": 0}
        self._lost_nodes(now, out)
        self._deadlines(now, out)
        if self.schedulers:
            try:
                got = self.schedulers.watch(self.store, now)
            except Exception:  # a cluster outage must not stop the rest of the pass
                log.exception("scheduler pools' watch failed; next pass tries again")
            else:
                out["schedulers"] = got
                out["requeued"] += got.get("changed", 0)
        if self.cloud is not None:
            try:
                got = self.cloud.watch(now)
            except Exception:  # a provider outage must not stop the rest of the pass
                log.exception("cloud watch failed; next pass tries again")
            else:
                out["cloud"] = got
                out["requeued"] += got.get("changed", 0)
        self._schedules(now, out)
        out["idle_lines"] = self.meter_idle(now)
        if self.settings.retention_days > 0:
            out["purged"] = self.purge_finished(now)
        if float(getattr(self.settings, "audit_retention_days", 0.0)) > 0:
            out["audit_purged"] = self.purge_audit(now)
        out["spec_budget"] = self.purge_over_spec_budget()
        out["log_budget"] = self.trim_logs()
        out["changed"] = out["lost_nodes"] + out["requeued"] + out["timed_out"] + out["scheduled"]
        if (out["changed"] or out["redispatched"] or out.get("purged", {}).get("jobs") or out.get("audit_purged")
                or out["spec_budget"]["jobs_deleted"] or out["log_budget"]["logs_trimmed"]):
            log.info("reconciler: %s", out)
        return out

    # ------------------------------------------------------------------ 4b. idle on-prem GPUs
    def meter_idle(self, now: datetime | None = None) -> int:
        """Write the ``idle_amortised`` lines of the closed UTC hours not metered yet (at most
        :data:`IDLE_LOOKBACK_H` of them, back from the last whole hour before ``now``), one transaction per
        hour. Returns the lines written."""
        now = now or utcnow()
        top = now.replace(minute=0, second=0, microsecond=0)
        with self.store.session() as s:
            if not usage_repo.registered_nodes(s, top):
                return 0
            last = usage_repo.last_line_start(s, "idle_amortised")
        h = top - timedelta(hours=IDLE_LOOKBACK_H)
        if last is not None:
            h = max(h, last.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1))
        n = 0
        while h < top:
            with self.store.session() as s:
                n += usage_repo.add_usage(s, ledger.meter_pool_idle(s, h, h + timedelta(hours=1), ledger.prices()),
                                          now)
            h += timedelta(hours=1)
        return n

    # ------------------------------------------------------------------ 6. log budgets
    def trim_logs(self) -> dict[str, int]:
        """Keep every team's stored logs within its ``quotas.log_bytes``, oldest first
        (:func:`broker.service.log_budget.enforce_log_budgets`, at most :data:`LOG_TRIMS_PER_PASS` logs a pass).
        Returns its counts; a failure is logged and the rest of the pass goes on."""
        from broker.service.log_budget import enforce_log_budgets

        try:
            return enforce_log_budgets(self.store, self.settings.quotas,
                                       int(getattr(self.settings, "log_trim_keep_bytes", 64 * 1024)),
                                       LOG_TRIMS_PER_PASS)
        except Exception:
            log.exception("log budgets: trimming failed; the next pass tries again")
            return {"teams_over": 0, "logs_trimmed": 0, "bytes_freed": 0}

    # ------------------------------------------------------------------ 5. retention
    def purge_finished(self, now: datetime | None = None) -> dict[str, int]:
        """Delete up to ``settings.retention_batch`` jobs that finished (``finished_at``) more than
        ``settings.retention_days`` days before ``now``, oldest first, with their events, logs, attempts
        and cloud-instance records, in one transaction. Jobs with a cloud instance still live (``intent``,
        ``running``, ``terminating``) and rows locked by another writer are skipped. A no-op when
        ``retention_days`` is 0. Returns the rows deleted per table: ``jobs``, ``events``, ``logs``,
        ``attempts``, ``cloud_instances``."""
        days = float(self.settings.retention_days)
        if days <= 0:
            return {"jobs": 0, "events": 0, "logs": 0, "attempts": 0, "cloud_instances": 0}
        cutoff = (now or utcnow()) - timedelta(days=days)
        with self.store.session() as s:
            return repo.purge_finished(s, sorted(x.value for x in TERMINAL_STATES), cutoff,
                                       int(self.settings.retention_batch), LIVE_INSTANCE_STATES)

    # ------------------------------------------------------------------ 5a. audit retention
    def purge_audit(self, now: datetime | None = None) -> int:
        """Delete up to ``settings.audit_retention_batch`` audit events recorded (``at``) more than
        ``settings.audit_retention_days`` days before ``now`` (one exactly at the cutoff is kept), oldest first,
        in one transaction. A no-op when ``audit_retention_days`` is 0. Returns the events deleted."""
        days = float(getattr(self.settings, "audit_retention_days", 0.0))
        if days <= 0:
            return 0
        cutoff = (now or utcnow()) - timedelta(days=days)
        with self.store.session() as s:
            return audit_repo.purge_audit_events(s, cutoff, int(self.settings.audit_retention_batch))

    # ------------------------------------------------------------------ 5b. stored spec budgets
    def purge_over_spec_budget(self) -> dict[str, int]:
        """For every team whose stored jobs' specs pass its ``quotas.stored_spec_bytes``: delete its oldest finished
        jobs (``finished_at``, then id) with their events, logs, attempts and cloud-instance records, as retention
        does (:func:`broker.service.store.attempts.purge_finished`; usage records kept), until it is within it; at
        most ``settings.retention_batch`` jobs in this call, one transaction per team, teams in name order. Jobs
        with a live cloud instance and rows another writer holds are skipped. Returns ``{"teams_over",
        "jobs_deleted", "bytes_freed"}``; a failure is logged and the rest of the pass goes on."""
        out = {"teams_over": 0, "jobs_deleted": 0, "bytes_freed": 0}
        left = int(self.settings.retention_batch)
        try:
            with self.store.session() as s:
                held = repo.team_stored_spec_bytes(s)
            for team in sorted(held):
                budget = self.settings.quotas.for_team(team).stored_spec_bytes
                if not budget or held[team] <= budget:
                    continue
                out["teams_over"] += 1
                if left <= 0:
                    continue
                with self.store.session() as s:
                    got = repo.purge_finished(s, sorted(x.value for x in TERMINAL_STATES), None, left,
                                              LIVE_INSTANCE_STATES, team=team, free_bytes=held[team] - budget)
                left -= got["jobs"]
                out["jobs_deleted"] += got["jobs"]
                out["bytes_freed"] += got["spec_bytes"]
                log.info("stored spec budget: team %r held %d bytes of job specs over its quotas.stored_spec_bytes "
                         "%d; deleted its %d oldest finished jobs (%d bytes)%s", team, held[team], budget,
                         got["jobs"], got["spec_bytes"],
                         "" if held[team] - got["spec_bytes"] <= budget else "; still over, the next pass goes on")
        except Exception:
            log.exception("stored spec budgets: deleting failed; the next pass tries again")
        return out

    # ------------------------------------------------------------------ 1. lost nodes
    def _lost_nodes(self, now: datetime, out: dict) -> None:
        cutoff = now - timedelta(seconds=self.settings.node_lost_after_s)
        with self.store.session() as s:
            out["lost_nodes"] += repo.mark_silent_nodes_lost(s, cutoff)
            down = repo.lost_node_names(s)
            if not down:
                return
            active = repo.jobs_in_states(s, [S.starting.value, S.running.value])
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
            rows = repo.jobs_in_states(s, [S.starting.value, S.provisioning.value])
            for j in rows:
                if (j.placement or {}).get("kind") not in ("onprem", "cloud"):
                    continue  # a scheduler pool's job: SchedulerPools.watch (its cluster must cancel it too)
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
        from broker.service.limits import QuotaExceeded, priority_refusal, time_limit_refusal

        per_pass = int(getattr(self.settings, "schedule_runs_per_pass", 100))
        quotas = self.settings.quotas
        with self.store.session() as s:
            due = repo.due_schedules(s, now, per_pass)
        out["schedules_left"] = int(len(due) >= per_pass)
        for sid, team, cron, tz, spec, last, created, nxt in due:
            fires = []
            try:
                fires = due_fires(cron, tz, last, created, now, max_catchup=1)
                for fire in fires:
                    run_spec = JobSpec.model_validate({**spec, "team": team})
                    refused = priority_refusal(quotas, team, run_spec.priority_class)
                    if refused is not None:
                        self._skip(sid, team, fire, f"fire at {fire.isoformat()} skipped: {refused}",
                                   "quotas.priority_classes", now, out)
                        continue
                    too_long = time_limit_refusal(quotas, team, run_spec)
                    if too_long is not None:  # the ceiling was lowered after the schedule was created
                        f, v, why = too_long
                        self._skip(sid, team, fire, f"fire at {fire.isoformat()} skipped: {f}={v!r}: {why}",
                                   "quotas.max_time_limit_s", now, out)
                        continue
                    lim = quotas.for_team(team)
                    try:
                        _, created_job = self.store.submit(
                            team, run_spec, now=now, schedule_id=sid,
                            idempotency_key=f"schedule:{sid}:{fire.isoformat()}",
                            max_unfinished=lim.max_queued_jobs, max_spec_bytes=lim.max_queued_spec_bytes,
                            quota_retry_after_s=quotas.quota_retry_after_s)
                    except QuotaExceeded as e:
                        self._skip(sid, team, fire, f"fire at {fire.isoformat()} skipped: {e}", e.limit, now, out)
                        continue
                    out["scheduled"] += created_job
                new_next = next_fire(cron, tz, now)
            except Exception as e:  # one bad schedule must not stop the others; it is paused with the reason
                log.exception("schedule %s (team %s) could not create its run; pausing it", sid, team)
                out.setdefault("schedule_errors", {})[sid] = f"{type(e).__name__}: {e}"
                with self.store.session() as s:
                    repo.pause_schedule(s, sid, f"paused at {now.isoformat(timespec='seconds')}: "
                                                f"its run could not be created ({type(e).__name__}: {e})")
                continue
            with self.store.session() as s:
                repo.advance_schedule(s, sid, nxt, new_next, fires[-1] if fires else last)

    def _skip(self, sid: str, team: str, fire: datetime, reason: str, limit: str, now: datetime, out: dict) -> None:
        """Record a skipped fire (:func:`broker.service.store.attempts.skip_schedule_fire`) and count it."""
        if self._skip_log.due():  # a team over quota skips every fire: one line a minute, the rest in the audit log
            log.warning("schedule %s (team %s): %s", sid, team, reason)
        with self.store.session() as s:
            repo.skip_schedule_fire(s, sid, team, fire, reason, limit, now)
        out["schedule_skips"] += 1
