"""The cloud repository: the SQL of cloud instance records (``cloud_instances``), their state history
(``cloud_instance_events``) and the cloud attempts' job reads.

Functions take an open :class:`~sqlalchemy.orm.Session` ``s`` (from :meth:`JobStore.session`). Every change
of an instance row's state goes through :func:`move`: checked against
:data:`broker.instance_states.INSTANCE_TRANSITIONS` (raises
:class:`broker.instance_states.InvalidInstanceTransition`) and recorded in the row's state history.

* intents and creates — :func:`record_intent`, :func:`record_failures`, :func:`mark_created`,
  :func:`mark_gang_rank_dropped`, :func:`add_cloud_attempt`;
* reports — :func:`report_row`, :func:`claim_report_seq`, :func:`note_report`;
* cooldown — :func:`recent_errors`, :func:`mark_attempt_error`;
* watch and teardown — :func:`active_cloud_jobs`, :func:`live_attempts`, :func:`silent_ranks`,
  :func:`live_rows`, :func:`end_teardown`, :func:`attempts_with_live_rows`, :func:`mark_swept`;
* reading — :func:`instance_rows`, :func:`instance_history`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Callable, Iterable

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from broker.instance_states import LIVE_INSTANCE_STATES, InstanceState, check_instance_transition
from broker.service.store.tables import Attempt, CloudInstance, CloudInstanceEvent, Job

__all__ = ["move", "record_intent", "record_failures", "mark_created", "mark_gang_rank_dropped",
           "add_cloud_attempt", "report_row", "claim_report_seq", "note_report", "recent_errors", "mark_attempt_error",
           "active_cloud_jobs", "live_attempts", "silent_ranks", "live_rows", "end_teardown",
           "attempts_with_live_rows", "mark_swept", "instance_rows", "instance_history"]

I = InstanceState


def move(s: Session, row: CloudInstance, to_state: InstanceState | str, reason: str, now: datetime) -> None:
    """Inside ``s``: move instance ``row`` to ``to_state`` and record the move (time ``now``, UTC, and ``reason``)
    in its state history; a move to its own state changes nothing. Raises
    :class:`broker.instance_states.InvalidInstanceTransition` for a move not in the table (nothing written)."""
    to = InstanceState(to_state).value
    if row.state == to:
        return
    check_instance_transition(row.id, row.state, to)
    s.add(CloudInstanceEvent(instance_row_id=row.id, job_id=row.job_id, attempt=row.attempt, rank=row.rank, at=now,
                             from_state=row.state, to_state=to, reason=(reason or "")[:2000]))
    row.state = to


# ---------------------------------------------------------------------- intents and creates
def record_intent(s: Session, req: Any, now: datetime, launch_usd_per_hour: float | None = None) -> None:
    """Inside ``s``: the intent record of one create call (a :class:`providers.base.InstanceRequest`),
    idempotent on the request's token: a new row in state ``intent``; a ``failed`` row of the same option
    tried again goes back to ``intent`` (a later attempt cannot share the token). ``launch_usd_per_hour``: the
    USD/h the provisioner priced the offer at now (kept on the row, refreshed when the option is tried again; the
    usage ledger's fallback price, :mod:`broker.service.ledger`)."""
    row = s.execute(select(CloudInstance).where(CloudInstance.idempotency_token == req.token)).scalar_one_or_none()
    if row is None:
        row = CloudInstance(job_id=req.job_id, attempt=req.attempt, rank=req.rank, offer_id=req.offer_id,
                            provider=req.offer_id.split(":", 1)[0], region=req.region, zone=req.zone,
                            instance_type=req.instance_type, market=req.market, idempotency_token=req.token,
                            state=I.intent.value, created_at=now, updated_at=now, history=[],
                            launch_usd_per_hour=launch_usd_per_hour)
        check_instance_transition(None, None, row.state)
        s.add(row)
        s.flush()  # the row's id, for its history
        s.add(CloudInstanceEvent(instance_row_id=row.id, job_id=row.job_id, attempt=row.attempt, rank=row.rank,
                                 at=now, from_state=None, to_state=row.state,
                                 reason=f"intent to create on {req.offer_id}"))
    elif row.state == I.failed.value:
        move(s, row, I.intent, f"{req.offer_id} tried again", now)
        row.updated_at = now
        if launch_usd_per_hour is not None:
            row.launch_usd_per_hour = launch_usd_per_hour


def record_failures(s: Session, job_id: str, attempt: int, failed: dict[tuple[str, int | None], Any],
                    now: datetime) -> None:
    """Inside ``s``: intent rows of the attempt's ``(offer id, rank)`` tries in ``failed`` (values: the last
    :class:`providers.base.FailoverAttempt` of the try; rank ``None``: every rank) that have no instance get
    state ``failed``, the error (``"Class: message"``) and an entry in their ``history`` JSON."""
    rows = s.execute(select(CloudInstance).where(
        CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
        CloudInstance.offer_id.in_(list({o for o, _ in failed})))).scalars().all()
    for row in rows:
        a = failed.get((row.offer_id, row.rank)) or failed.get((row.offer_id, None))
        if a is not None and row.state == I.intent.value and row.provider_instance_id is None:
            error = f"{a.error}: {a.message}"[:2000]
            move(s, row, I.failed, error, now)
            row.error, row.updated_at = error, now
            row.history = [*(row.history or []), {"at": a.at, "error": a.error, "message": a.message}]


def mark_created(s: Session, job_id: str, attempt: int, rank: int, offer_id: str, instance_id: str,
                 private_ip: str | None, now: datetime) -> None:
    """Inside ``s``: the intent row of ``(job, attempt, rank)`` on ``offer_id`` got its instance: ``running``
    with the provider's id and private address."""
    row = s.execute(select(CloudInstance).where(
        CloudInstance.job_id == job_id, CloudInstance.attempt == attempt, CloudInstance.rank == rank,
        CloudInstance.offer_id == offer_id)).scalar_one_or_none()
    if row is not None:
        row.provider_instance_id, row.private_ip = instance_id, private_ip
        move(s, row, I.running, f"created {instance_id}", now)
        row.updated_at = now


def mark_gang_rank_dropped(s: Session, token: str, instance_id: str, private_ip: str | None, now: datetime,
                           error: str) -> None:
    """Inside ``s``: the instance created for the request of idempotency ``token`` is terminated because
    another rank of its gang could not be created on the same option: ``terminated`` with ``error``."""
    row = s.execute(select(CloudInstance).where(CloudInstance.idempotency_token == token)).scalar_one_or_none()
    if row is not None:
        row.provider_instance_id, row.private_ip = instance_id, private_ip
        move(s, row, I.terminated, error, now)
        row.updated_at, row.error = now, error


def add_cloud_attempt(s: Session, job_id: str, attempt: int, offer_id: str, gpu_type: str | None, gpus: int,
                      now: datetime) -> None:
    """Inside ``s``: the ``attempts`` row of a cloud attempt (no ranks placed yet), unless it exists."""
    if s.execute(select(Attempt.id).where(Attempt.job_id == job_id, Attempt.number == attempt)).first() is None:
        s.add(Attempt(job_id=job_id, number=attempt, kind="cloud", pool=None, offer_id=offer_id, nodes=[],
                      gpu_type=gpu_type, gpus=gpus, created_at=now, rank_exits={}, reason="", failover=[]))


# ---------------------------------------------------------------------- reports
def report_row(s: Session, job_id: str, attempt: int, rank: int) -> CloudInstance | None:
    """Inside ``s``: the newest instance row of that rank of that attempt that has an instance id."""
    return s.execute(select(CloudInstance).where(
        CloudInstance.job_id == job_id, CloudInstance.attempt == attempt, CloudInstance.rank == rank,
        CloudInstance.provider_instance_id.is_not(None)).order_by(CloudInstance.id.desc())).scalars().first()


def claim_report_seq(s: Session, row_id: int, seq: int) -> bool:
    """Inside ``s``: take report sequence number ``seq`` for instance row ``row_id`` if it is above the highest
    taken (one atomic compare-and-set: two copies of one report cannot both pass). Returns whether taken."""
    return s.execute(update(CloudInstance).where(
        CloudInstance.id == row_id, or_(CloudInstance.report_seq.is_(None), CloudInstance.report_seq < seq)
    ).values(report_seq=seq)).rowcount == 1


def note_report(row: CloudInstance, event: str, now: datetime) -> None:
    """The instance of ``row`` reported ``event`` at ``now`` (UTC): its last report (a rank that never reported is
    silent, see :func:`silent_ranks`)."""
    row.last_report_at, row.last_event = now, event


# ---------------------------------------------------------------------- cooldown
def recent_errors(s: Session, since: datetime) -> list[tuple[str, str, datetime]]:
    """Inside ``s``: ``(offer id, error, updated_at)`` of instance rows with an error changed at or after ``since``."""
    return [tuple(r) for r in s.execute(select(CloudInstance.offer_id, CloudInstance.error, CloudInstance.updated_at)
                                        .where(CloudInstance.error.is_not(None), CloudInstance.updated_at >= since))]


def mark_attempt_error(s: Session, job_id: str, attempt: int, error: str, now: datetime) -> None:
    """Inside ``s``: ``error`` (at most 2000 characters) and ``updated_at = now`` on every row of the attempt
    that has an instance (its offer cools down from ``now``)."""
    for row in s.execute(select(CloudInstance).where(CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
                                                     CloudInstance.provider_instance_id.is_not(None))).scalars():
        row.error, row.updated_at = error[:2000], now


# ---------------------------------------------------------------------- watch and teardown
def active_cloud_jobs(s: Session, states: Iterable[str]) -> list[Job]:
    """Inside ``s``: the jobs in ``states`` whose placement is a cloud one."""
    return [j for j in s.execute(select(Job).where(Job.state.in_(list(states)))).scalars()
            if (j.placement or {}).get("kind") == "cloud"]


def live_attempts(s: Session, states: Iterable[str]) -> set[tuple[str, int]]:
    """Inside ``s``: ``(job, attempt)`` of every job in ``states`` (its current attempt may hold instances)."""
    return {(jid, att) for jid, att in s.execute(select(Job.id, Job.attempt).where(Job.state.in_(list(states))))}


def silent_ranks(s: Session, created_before: datetime, running_state: str) -> dict[tuple[str, int], list[int]]:
    """Inside ``s``: ``(job, attempt) -> ranks`` of jobs in ``running_state`` not asked to stop, dispatched before
    ``created_before`` (UTC), with a ``running`` instance that never reported (one query)."""
    out: dict[tuple[str, int], list[int]] = {}
    rows = s.execute(select(CloudInstance.job_id, CloudInstance.attempt, CloudInstance.rank)
                     .join(Job, (Job.id == CloudInstance.job_id) & (Job.attempt == CloudInstance.attempt))
                     .where(Job.state == running_state, Job.dispatched_at < created_before, Job.stop_reason.is_(None),
                            CloudInstance.state == I.running.value, CloudInstance.provider_instance_id.is_not(None),
                            CloudInstance.last_report_at.is_(None)))
    for job_id, attempt, rank in rows:
        out.setdefault((job_id, attempt), []).append(rank)
    return {k: sorted(v) for k, v in out.items()}


def live_rows(s: Session, job_id: str, attempt: int) -> list[tuple[int, int, str, str | None, str]]:
    """Inside ``s``: ``(row id, rank, provider, instance id, zone)`` of the attempt's rows whose instance may still
    exist (:data:`broker.instance_states.LIVE_INSTANCE_STATES`)."""
    return [(r.id, r.rank, r.provider, r.provider_instance_id, r.zone) for r in s.execute(select(CloudInstance).where(
        CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
        CloudInstance.state.in_(LIVE_INSTANCE_STATES))).scalars()]


def end_teardown(s: Session, row_id: int, state: InstanceState | str, error: str, now: datetime,
                 keeps_error: Callable[[str | None], bool]) -> None:
    """Inside ``s``: after a terminate call, instance row ``row_id`` (if still live) moves to ``state``
    (``terminated``, ``terminating`` when the call failed, ``abandoned`` without an instance id) with ``error``,
    unless it is ``terminated`` and ``keeps_error(its error)``: then its error and ``updated_at`` stay (they say
    why and since when its offer cools down)."""
    r = s.get(CloudInstance, row_id)
    if r is None or r.state not in LIVE_INSTANCE_STATES:
        return
    keep = keeps_error(r.error) and InstanceState(state) is I.terminated
    move(s, r, state, error, now)
    if not keep:
        r.error, r.updated_at = error[:2000], now


def attempts_with_live_rows(s: Session) -> set[tuple[str, int]]:
    """Inside ``s``: ``(job, attempt)`` of every instance row whose instance may still exist."""
    return {(r.job_id, r.attempt) for r in s.execute(select(CloudInstance.job_id, CloudInstance.attempt).where(
        CloudInstance.state.in_(LIVE_INSTANCE_STATES)))}


def mark_swept(s: Session, instance_ids: Iterable[str], now: datetime) -> set[tuple[str, int]]:
    """Inside ``s``: rows of the instances the orphan sweep terminated become ``terminated`` with the reason.
    Returns the ``(job, attempt)`` of the rows it moved (their usage lines are written next)."""
    why = "terminated by the orphan sweep"
    moved = set()
    for row in s.execute(select(CloudInstance).where(CloudInstance.provider_instance_id.in_(list(instance_ids))
                                                     )).scalars():
        if row.state != I.terminated.value:
            moved.add((row.job_id, row.attempt))
        move(s, row, I.terminated, why, now)
        row.error, row.updated_at = why, now
    return moved


# ---------------------------------------------------------------------- reading
def instance_rows(s: Session, limit: int, live_only: bool) -> list[dict]:
    """Inside ``s``: the newest ``limit`` instance records (only live ones when ``live_only``), newest first, as
    dicts: ``job_id``, ``attempt``, ``rank``, ``offer_id``, ``state``, ``instance_id``, ``private_ip``,
    ``created_at``, ``updated_at`` (UTC), ``last_event``, ``error``."""
    q = select(CloudInstance).order_by(CloudInstance.id.desc()).limit(limit)
    if live_only:
        q = q.where(CloudInstance.state.in_(LIVE_INSTANCE_STATES))
    return [{"job_id": r.job_id, "attempt": r.attempt, "rank": r.rank, "offer_id": r.offer_id, "state": r.state,
             "instance_id": r.provider_instance_id, "private_ip": r.private_ip, "created_at": r.created_at,
             "updated_at": r.updated_at, "last_event": r.last_event, "error": r.error}
            for r in s.execute(q).scalars()]


def instance_history(s: Session, job_id: str) -> list[dict]:
    """Inside ``s``: the state history of every instance row of ``job_id``, oldest first, as dicts: ``attempt``,
    ``rank``, ``offer_id``, ``at`` (UTC), ``from_state`` (``None``: the row was written), ``to_state``,
    ``reason``."""
    rows = s.execute(select(CloudInstanceEvent, CloudInstance.offer_id)
                     .join(CloudInstance, CloudInstance.id == CloudInstanceEvent.instance_row_id)
                     .where(CloudInstanceEvent.job_id == job_id).order_by(CloudInstanceEvent.id)).all()
    return [{"attempt": e.attempt, "rank": e.rank, "offer_id": offer, "at": e.at, "from_state": e.from_state,
             "to_state": e.to_state, "reason": e.reason} for e, offer in rows]
