"""The attempt lifecycle: what the end of an attempt, or of one rank of a gang, means for its job.

One set of rules for every runtime (on-prem node agents through :mod:`broker.service.attempts`, cloud
instances through :mod:`broker.service.cloud.reports`, the reconciler and the cloud watch):

* :func:`mark_running` — the first rank runs (or ends before it said so): ``starting -> running``;
* :func:`rank_ended` — one rank ended with an exit code (``None``: lost). While other ranks still run,
  a failed rank (or any rank of a gang already asked to stop) keeps its exit code on the attempt and asks
  the rest of the gang to stop (``stop_reason="peer-ended"``: all or nothing, ARCHITECTURE.md §5); once every
  rank has ended, :func:`end_attempt`;
* :func:`end_attempt` — the job's outcome: ``cancelled`` (cancel requested), requeued from its checkpoint
  (``interrupted``: a spot notice or a preemption, not counted against ``max_attempts``; or a rank lost
  without an exit code, counted), ``succeeded`` (every rank 0) or ``failed`` with the exit code of the
  rank that failed first (not the 143 of the ranks stopped after it);
* :func:`requeue_lost` — the attempt ends without an outcome from its ranks (node lost, instance gone,
  launch failed, a deadline passed): the job goes back to the queue keeping its checkpointed work
  (:func:`checkpointed_work_s`), or fails after ``max_attempts``;
* :func:`cancel_attempt` — the attempt is stopped by the broker for a cancel;
* :func:`scheduler_ended` — an existing scheduler (a Slurm pool) says the attempt's job ended: succeeded,
  failed (exit code, time limit, ...), cancelled (by the broker, or in the cluster by its admin: the job
  fails with the cluster's reason), or interrupted (node failure, preemption: requeued).

Every ended attempt goes through :func:`close_attempt`, which calls :func:`record_usage` once per
attempt in the transaction that ends it: the one place the finance ledger (issue #12,
:mod:`broker.service.ledger`) writes its usage records; :func:`mark_running` keeps the on-prem energy
counters read at the attempt's start. Functions run inside the caller's session ``s`` and move job states with compare-and-set
(:meth:`broker.service.store.core.JobStore.cas`); none runs SQL of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from broker.model import DEFAULT_CHECKPOINT_INTERVAL_S, JobSpec
from broker.service import ledger
from broker.service.store import attempts as repo
from broker.service.store import usage
from broker.service.store.core import JobStore
from broker.service.store.tables import Attempt, Job
from broker.states import JobState

__all__ = ["Place", "RankEnd", "STOP_REASONS", "checkpointed_work_s", "requeue_lost", "mark_running", "rank_ended",
           "end_attempt", "cancel_attempt", "close_attempt", "record_usage", "record_instance_usage",
           "note_instance_stopped", "scheduler_ended"]

S = JobState
#: ``jobs.stop_reason`` values that stop an attempt for reasons not its own -> the requeue's reason. An attempt
#: stopped so is requeued whatever its exit code (exit 0 after SIGTERM usually means "checkpointed", not
#: "finished") and does not count against ``max_attempts``.
STOP_REASONS = {"spot": "spot interruption", "preempt": "preempted by a higher-priority job"}


@dataclass(frozen=True)
class Place:
    """Where a rank ran, for the reasons written on the job.

    ``cloud``: a cloud instance (its ranks are stopped by the broker terminating their instances) or an
    on-prem node (its agent stops the ranks when it sees ``stop_reason``); ``where``: ``"rank R on HOST"``
    (or a description of several ranks); ``host``: the on-prem node name."""

    cloud: bool
    where: str
    host: str = ""
    stopped: str = ""

    @classmethod
    def node(cls, rank: int, node: str) -> "Place":
        """Rank ``rank`` on on-prem node ``node``."""
        return cls(False, f"rank {rank} on {node}", node)

    @classmethod
    def scheduler(cls, where: str, stopped: str) -> "Place":
        """A job of an existing scheduler (``where``: ``"Slurm job 123 on a001"``), stopped by ``stopped``
        (``"scancel: SIGTERM, then kill after the grace"``): like a cloud rank, the broker stops it itself."""
        return cls(True, where, stopped=stopped)

    @classmethod
    def instance(cls, where: str) -> "Place":
        """A cloud rank (``where``: ``"rank R on provider/instance-id"``) or ranks."""
        return cls(True, where)

    def exit_text(self, code: int | None) -> str:
        """The reason of a one-rank job that failed with ``code``."""
        return f"exit code {code} ({self.where})" if self.cloud else f"exit code {code} on {self.host}"

    def lost_text(self) -> str:
        """The reason of an attempt whose rank ended without an exit code."""
        return f"{self.where} ended without an exit code" if self.cloud else f"process lost on {self.host}"

    def stopped_text(self) -> str:
        """What the broker did to stop a cancelled attempt's ranks."""
        return self.stopped or ("instances terminated" if self.cloud else "process stopped")


@dataclass
class RankEnd:
    """What :func:`rank_ended` did. ``outcome``: ``"rank done"`` (others still run), ``"stopping the other
    ranks"``, or the job's outcome (``"succeeded"``, ``"failed"``, ``"cancelled"``, ``"requeued"``);
    ``ended``: the attempt ended; ``stop_ranks``: ranks still running that must be stopped (a cloud caller
    terminates their instances; on-prem agents stop them on seeing ``stop_reason``); ``retry``: a
    compare-and-set lost a race: read the job again and call again."""

    outcome: str
    ended: bool = False
    stop_ranks: list[int] = field(default_factory=list)
    retry: bool = False


def checkpointed_work_s(spec: dict, ran_s: float, throughput: float = 1.0) -> float:
    """Reference-GPU seconds kept by a job stopped after ``ran_s`` seconds: whole checkpoint intervals
    (``spec["checkpoint_interval_s"]``, default :data:`DEFAULT_CHECKPOINT_INTERVAL_S`) times the GPU's relative
    ``throughput``; 0 for a job that does not checkpoint (``spec["checkpointable"]`` false)."""
    if not spec.get("checkpointable", True) or ran_s <= 0:
        return 0.0
    every = float(spec.get("checkpoint_interval_s") or DEFAULT_CHECKPOINT_INTERVAL_S)
    return math.floor(ran_s / every) * every * throughput


def record_usage(s, att: Attempt, now: datetime) -> int:
    """The usage-record hook: called once per ended attempt, inside the transaction that ends it, after
    ``att.ended_at``/``outcome``/``exit_code`` are set. Writes the finance ledger's records of the attempt
    (:func:`broker.service.ledger.meter_attempt`: one per cloud instance, or an energy and an amortised line
    per on-prem rank) at this process's prices (:func:`broker.service.ledger.prices`), skipping any already
    written (:func:`broker.service.store.usage.add_usage`). Returns how many were written."""
    job = repo.job_row(s, att.job_id)
    return usage.add_usage(s, ledger.meter_attempt(s, att, job, now, ledger.prices()), now)


def note_instance_stopped(att: Attempt | None, instance_id: str, at: datetime) -> None:
    """Keep on cloud attempt ``att`` (``att.meter["stopped"]``) that the provider reported its instance
    ``instance_id`` stopped at ``at`` (UTC, when the watch saw it): a stopped instance bills its disk until it is
    deleted, not its compute (:func:`broker.service.ledger.meter_instance_ends`). The first instant is kept."""
    if att is None or att.kind != "cloud":
        return
    stopped = dict((att.meter or {}).get("stopped") or {})
    stopped.setdefault(instance_id, at.isoformat())
    att.meter = {**(att.meter or {}), "stopped": stopped}


def record_instance_usage(s, job_id: str, attempt: int, now: datetime) -> int:
    """The usage hook of a cloud instance's deletion: called inside the transaction that moves an instance row of
    ``(job_id, attempt)`` to ``terminated`` or ``abandoned``. Once the attempt has ended, writes the lines only the
    deletion decides (the boot disk, idle instance time: :func:`broker.service.ledger.meter_instance_ends`),
    skipping any already written; before the attempt ends, nothing (:func:`record_usage` writes them then).
    Returns how many were written."""
    att = repo.attempt_row(s, job_id, attempt)
    if att is None or att.ended_at is None:
        return 0
    job = repo.job_row(s, job_id)
    return usage.add_usage(s, ledger.meter_instance_ends(s, att, job, ledger.prices()), now)


def close_attempt(s, att: Attempt | None, now: datetime, outcome: str, reason: str | None = None,
                  exit_code: int | None = None, *, final: bool = False) -> bool:
    """End ``att`` at ``now`` with ``outcome`` (and ``reason``) unless it has already ended, then
    :func:`record_usage`. ``final``: the outcome its ranks' ends decided (:func:`end_attempt`): ``ended_at``,
    ``outcome`` and ``exit_code`` are written even over an earlier try of the same end that lost a race (the
    usage is still recorded once). Returns whether this call ended it."""
    if att is None or (att.ended_at is not None and not final):
        return False
    first = att.ended_at is None
    att.ended_at, att.outcome = now, outcome
    if reason is not None:
        att.reason = reason
    if final:
        att.exit_code = exit_code
    if first:
        record_usage(s, att, now)
    return first


def requeue_lost(s, j: Job, now: datetime, why: str, outcome: str = "lost", max_attempts: int | None = None) -> bool:
    """Inside session ``s``: end the job's current attempt with ``outcome`` and put the job back
    in the queue (``running -> interrupted -> queued`` or ``starting``/``provisioning -> queued``). A job that
    has used ``max_attempts`` attempts fails instead (``None``: no limit). The work kept (seconds, from
    :func:`checkpointed_work_s`) is counted from the attempt's own start; the job's ``started_at`` is cleared
    (the next attempt sets it again). Returns whether applied."""
    a = repo.attempt_row(s, j.id, j.attempt)
    close_attempt(s, a, now, outcome, why)
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


def mark_running(s, j: Job, att: Attempt | None, now: datetime, reason: str) -> bool:
    """Inside ``s``: ``starting -> running`` for job ``j`` (``reason``: where it runs), setting the job's
    ``started_at`` (if unset) and the attempt's, and clearing the start deadline. Returns whether it
    applied (``False``: the job was not ``starting`` at the version read, or lost a race); on success ``j``
    is re-read."""
    if j.state != S.starting.value:
        return False
    if not JobStore.cas(s, j.id, j.version, S.starting.value, S.running.value, reason, now,
                        started_at=j.started_at or now, state_deadline_at=None):
        return False
    repo.reload(s, j)
    if att is not None and att.started_at is None:
        att.started_at = now
        ledger.snapshot_counters(s, att, now)  # the energy counters at the start of the attempt's energy line
    return True


def rank_ended(s, j: Job, att: Attempt, rank: int, code: int | None, now: datetime, place: Place, *,
               max_attempts: int | None, stop_window: timedelta | None = None, stopped_why: str | None = None) -> RankEnd:
    """Inside ``s``: rank ``rank`` of job ``j``'s current attempt ``att`` ended with exit ``code`` (``None``:
    lost, no exit code); ``j`` is ``running`` (see :func:`mark_running`). Records the rank's end on the
    attempt, then:

    * other ranks still run and this one succeeded while nobody asked the gang to stop, or a cancel is
      requested on-prem (the agents stop every rank): ``"rank done"``;
    * other ranks still run otherwise (all or nothing): the first failed rank's exit code is kept on the
      attempt (the job's exit code), and the gang is asked to stop: ``stop_reason`` set (``"peer-ended"``
      unless one is set already) with an event in the job's history; a cloud gang also gets
      ``state_deadline_at = now + stop_window`` (the cloud watch ends the attempt when it passes) and its
      still-running ranks are returned in ``stop_ranks``. A cloud rank ending while a cancel is requested
      ends the attempt at once (the broker terminates the instances);
    * every rank has ended: :func:`end_attempt`.

    ``stopped_why``: the node stopped the rank itself, e.g. ``"time limit of 60 s exceeded"`` (the agent's
    wall-clock limit, :func:`providers.base.pool_time_limit_s`): the rank counts as failed whatever its exit
    code, and the sentence is kept on the attempt (its ``reason``) to lead the job's failure reason.
    """
    exits = dict(att.rank_exits or {})
    exits[str(rank)] = code if code is not None else "lost"
    att.rank_exits = exits
    if stopped_why and not att.reason:
        att.reason = stopped_why
    # on a node an active attempt has no reason but this one (close_attempt writes it at the end)
    stopped = stopped_why or (att.reason if not place.cloud else None)
    nranks = len((j.placement or {}).get("nodes", [])) or 1
    failed = code is None or code != 0 or bool(stopped)
    if len(exits) < nranks and not (j.cancel_requested and place.cloud):
        if j.cancel_requested or (not failed and not j.stop_reason):
            return RankEnd("rank done")
        if not j.stop_reason and isinstance(exits[str(rank)], int):
            att.exit_code = code  # the failing rank's code is the job's
        if not j.stop_reason or (place.cloud and (j.state_deadline_at is None or len(exits) == 1)):  # the first to end
            why = (f"{place.where} ended ({exits[str(rank)]}); stopping the other ranks" if not j.stop_reason
                   else f"{place.where} ended after the spot notice; stopping the other ranks")
            fields = {"stop_reason": j.stop_reason or "peer-ended"}
            if stop_window is not None:
                fields["state_deadline_at"] = j.state_deadline_at or now + stop_window
            if not repo.bump_with_event(s, j, now, why, **fields):
                return RankEnd("retry", retry=True)
        return RankEnd("stopping the other ranks", stop_ranks=[r for r in range(nranks) if str(r) not in exits])
    ok, outcome = end_attempt(s, j, att, now, code, exits, place, max_attempts=max_attempts, stopped_why=stopped)
    return RankEnd(outcome, ended=True) if ok else RankEnd("retry", retry=True)


def end_attempt(s, j: Job, att: Attempt, now: datetime, code: int | None, exits: dict, place: Place, *,
                max_attempts: int | None, stopped_why: str | None = None) -> tuple[bool, str]:
    """Inside ``s``: end running job ``j``'s attempt ``att`` whose ranks ended with ``exits`` (``{"rank": code
    or "lost"}``; ``code``: the last rank's code) and give the job its outcome (see the module docstring).
    After a failed rank stopped the gang (``peer-ended``) the job fails with that rank's exit code, not with
    the stopped ranks' 143. Returns ``(applied, outcome)``: ``outcome`` one of ``"cancelled"``,
    ``"requeued"``, ``"succeeded"``, ``"failed"``; ``applied`` False when a compare-and-set lost a race.
    ``stopped_why``: the node stopped a rank itself (its time limit): the job fails, the sentence first in its
    reason (``"time limit of 60 s exceeded; exit code 143 on n1"``)."""
    if j.stop_reason == "peer-ended" and att.exit_code is not None:
        code = att.exit_code
    nranks = len((j.placement or {}).get("nodes", [])) or 1
    if j.cancel_requested:
        close_attempt(s, att, now, "cancelled", exit_code=code, final=True)
        return JobStore.cas(s, j.id, j.version, S.running.value, S.cancelled.value,
                            f"cancelled by user; {place.stopped_text()}", now, finished_at=now,
                            exit_code=code), "cancelled"
    if j.stop_reason in STOP_REASONS or code is None:
        close_attempt(s, att, now, "interrupted", exit_code=code, final=True)
        why = STOP_REASONS.get(j.stop_reason or "") or place.lost_text()
        return requeue_lost(s, j, now, why, "interrupted",
                            max_attempts=None if j.stop_reason in STOP_REASONS else max_attempts), "requeued"
    if all(v == 0 for v in exits.values()) and len(exits) >= nranks and not stopped_why:
        close_attempt(s, att, now, "succeeded", exit_code=code, final=True)
        return JobStore.cas(s, j.id, j.version, S.running.value, S.succeeded.value, "exit code 0", now,
                            finished_at=now, exit_code=0), "succeeded"
    close_attempt(s, att, now, "failed", exit_code=code, final=True)
    bad = {r: c for r, c in exits.items() if c != 0}
    why = place.exit_text(code) if len(exits) == 1 else f"ranks ended with {bad}"
    if stopped_why:  # the node stopped it: that is why it failed
        why = f"{stopped_why}; {why}"
    return JobStore.cas(s, j.id, j.version, S.running.value, S.failed.value, why,
                        now, finished_at=now, exit_code=code), "failed"


def cancel_attempt(s, j: Job, now: datetime, place: Place) -> bool:
    """Inside ``s``: the broker stopped job ``j``'s current attempt for a requested cancel (the cloud watch:
    its instances are terminated): the attempt ends ``cancelled``, the job moves to ``cancelled``. Returns
    whether it applied."""
    close_attempt(s, repo.attempt_row(s, j.id, j.attempt), now, "cancelled", "cancelled by user")
    return JobStore.cas(s, j.id, j.version, j.state, S.cancelled.value,
                        f"cancelled by user; {place.stopped_text()}", now, finished_at=now)


def scheduler_ended(s, j: Job, att: Attempt, now: datetime, outcome: str, code: int | None, why: str, place: Place,
                    *, ran: bool, max_attempts: int | None) -> tuple[bool, str]:
    """Inside ``s``: an existing scheduler says job ``j``'s current attempt ``att`` ended (``j`` is ``starting`` or
    ``running``). ``outcome``: the adapter's lifecycle state (``"succeeded"``, ``"failed"``, ``"cancelled"``,
    ``"interrupted"``); ``code`` the exit code (``None`` if none); ``why`` the scheduler's reason sentence
    (:attr:`providers.slurm.SlurmJobInfo.reason`); ``ran``: the job ran (a job that ended from the queue did not:
    its attempt gets no start). Then:

    * a cancel was requested: the attempt ends ``cancelled``, the job ``cancelled`` (:func:`cancel_attempt`);
    * ``interrupted`` (node failure, preemption, requeued by the scheduler): requeued from its checkpoint
      (:func:`requeue_lost`, counted against ``max_attempts``);
    * ``cancelled`` in the cluster (its admin or the job's owner, not the broker): the job fails with the reason;
    * ``succeeded``: the job succeeds with exit code 0 (:func:`end_attempt`);
    * ``failed``: the job fails with the exit code and the reason (a time limit ends with code 0 and signal 15:
      still a failure).

    Returns ``(applied, outcome)`` with ``outcome`` one of ``"cancelled"``, ``"requeued"``, ``"failed"``,
    ``"succeeded"``; ``applied`` False when a compare-and-set lost a race (read the job again)."""
    if ran and j.state == S.starting.value:
        if not mark_running(s, j, att, now, f"running: {place.where}"):
            return False, "retry"
    if j.cancel_requested:
        return cancel_attempt(s, j, now, place), "cancelled"
    att.reason = f"{place.where}: {why}"
    if outcome == "interrupted":
        close_attempt(s, att, now, "interrupted", exit_code=code, final=True)
        return requeue_lost(s, j, now, f"{place.where}: {why}", "interrupted", max_attempts=max_attempts), "requeued"
    if outcome == "succeeded" and j.state == S.running.value:
        exits = {str(r): 0 for r in range(len((j.placement or {}).get("nodes", [])) or 1)}
        att.rank_exits = exits
        return end_attempt(s, j, att, now, 0, exits, place, max_attempts=max_attempts)
    close_attempt(s, att, now, "cancelled" if outcome == "cancelled" else "failed", exit_code=code, final=True)
    return JobStore.cas(s, j.id, j.version, j.state, S.failed.value, f"{why} ({place.where})", now,
                        finished_at=now, exit_code=code), "failed"
