"""The attempts repository: the SQL of attempt ends, node work and the reconciler's passes.

Functions take an open :class:`~sqlalchemy.orm.Session` (``s``, from :meth:`JobStore.session`) so the caller
decides the transaction; job state moves themselves stay :meth:`JobStore.cas` / :meth:`JobStore.bump`.

* attempts — :func:`job_row`, :func:`reload`, :func:`attempt_row`, :func:`add_attempt`, :func:`bump_with_event`;
* node work — :func:`onprem_work_rows` (what :func:`broker.service.attempts.node_work` lists);
* scheduler pools — :func:`scheduler_attempts`, :func:`set_external_id`;
* reconciler — :func:`jobs_in_states`, :func:`mark_silent_nodes_lost`, :func:`lost_node_names`,
  :func:`due_schedules`, :func:`skip_schedule_fire`, :func:`pause_schedule`, :func:`advance_schedule`, :func:`purge_finished`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Sequence

from sqlalchemy import LargeBinary, Text, cast, delete, func, insert, select, text, update
from sqlalchemy.orm import Session

from broker.service.store.core import JobStore, spec_bytes_expr
from broker.service.store.tables import Attempt, AuditEvent, CloudInstance, Job, JobEvent, JobLog, Node, Schedule

__all__ = ["job_row", "reload", "attempt_row", "add_attempt", "bump_with_event", "onprem_work_rows", "jobs_in_states",
           "scheduler_attempts", "set_external_id",
           "mark_silent_nodes_lost", "lost_node_names", "due_schedules", "skip_schedule_fire", "pause_schedule",
           "advance_schedule",
           "purge_finished", "spec_bytes_expr", "team_stored_spec_bytes"]


# ---------------------------------------------------------------------- attempts
def job_row(s: Session, job_id: str) -> Job | None:
    """Inside ``s``: the job's row (``None`` if there is none)."""
    return s.get(Job, job_id)


def reload(s: Session, row: Any) -> None:
    """Inside ``s``: read ``row`` (a job or attempt) again from the database (after a compare-and-set wrote it
    with a bulk ``UPDATE`` the ORM does not see)."""
    s.refresh(row)


def attempt_row(s: Session, job_id: str, number: int, lock: bool = False) -> Attempt | None:
    """Inside ``s``: attempt ``number`` of ``job_id``; ``lock`` takes a row lock (``SELECT ... FOR UPDATE``) so
    two reporters of one attempt update it one after the other (see :meth:`JobStore.attempt_row`)."""
    return JobStore.attempt_row(s, job_id, number, lock=lock)


def add_attempt(s: Session, **fields: Any) -> Attempt:
    """Inside ``s``: insert an ``attempts`` row with ``fields`` (the columns of
    :class:`~broker.service.store.tables.Attempt`); returns it."""
    a = Attempt(**fields)
    s.add(a)
    return a


def bump_with_event(s: Session, j: Job, now: datetime, reason: str, **fields: Any) -> bool:
    """Inside ``s``: compare-and-set ``fields`` of job ``j`` without a state change (:meth:`JobStore.bump` on the
    version ``j`` was read at) and record ``reason`` in its state history as a ``state -> state`` event (a
    gang asked to stop, a spot notice). Returns whether it applied."""
    version, state = j.version, j.state
    if not JobStore.bump(s, j.id, version, now, reason=reason, **fields):
        return False
    s.add(JobEvent(job_id=j.id, at=now, from_state=state, to_state=state, version=version + 1, reason=reason))
    return True


# ---------------------------------------------------------------------- node work
def onprem_work_rows(s: Session, node: str, states: Sequence[str]) -> tuple[list, dict[str, dict],
                                                                            dict[tuple[str, int], dict]]:
    """Inside ``s``: the on-prem jobs in ``states`` with a part placed on ``node``, as rows of (``id``,
    ``attempt``, ``state``, ``placement``, ``cancel_requested``, ``stop_reason``); their specs by job id; and
    the recorded rank ends (``rank_exits``) of their attempts by ``(job, attempt number)``. One indexed
    query on ``jobs.state`` (no specs), the placement filter in Python, then the specs and attempt
    records of this node's jobs only."""
    rows = s.execute(select(Job.id, Job.attempt, Job.state, Job.placement, Job.cancel_requested,
                            Job.stop_reason).where(Job.state.in_(list(states)))).all()
    mine = [j for j in rows if (j.placement or {}).get("kind", "onprem") == "onprem"
            and any(p.get("node") == node for p in (j.placement or {}).get("nodes", []))]
    if not mine:
        return [], {}, {}
    ids = [j.id for j in mine]
    specs = dict(s.execute(select(Job.id, Job.spec).where(Job.id.in_(ids))).all())
    ended = {(a.job_id, a.number): dict(a.rank_exits or {}) for a in s.execute(
        select(Attempt.job_id, Attempt.number, Attempt.rank_exits).where(Attempt.job_id.in_(ids))).all()}
    return mine, specs, ended


# ---------------------------------------------------------------------- scheduler pools
def scheduler_attempts(s: Session, kinds: Iterable[str], states: Iterable[str]) -> list[tuple[Any, str | None]]:
    """Inside ``s``: every job in ``states`` placed on a pool of one of ``kinds`` (``placement["kind"]``), as rows of
    (``id``, ``attempt``, ``state``, ``placement``, ``cancel_requested``, ``state_deadline_at``, ``dispatched_at``),
    each with its current attempt's ``external_id`` (``None``: not submitted, or no attempt), ordered by job id.
    Two narrow queries (no specs, no ORM objects): the jobs by ``jobs.state`` with the placement filter in Python,
    then the attempts' ids of those jobs."""
    kinds = set(kinds)
    jobs = [j for j in s.execute(select(Job.id, Job.attempt, Job.state, Job.placement, Job.cancel_requested,
                                        Job.state_deadline_at, Job.dispatched_at)
                                 .where(Job.state.in_(list(states))).order_by(Job.id)).all()
            if (j.placement or {}).get("kind") in kinds]
    if not jobs:
        return []
    ext = {(a.job_id, a.number): a.external_id for a in s.execute(
        select(Attempt.job_id, Attempt.number, Attempt.external_id).where(Attempt.job_id.in_([j.id for j in jobs])))}
    return [(j, ext.get((j.id, j.attempt))) for j in jobs]


def set_external_id(s: Session, job_id: str, number: int, external_id: str) -> bool:
    """Inside ``s``: record ``external_id`` (the scheduler's job id) on attempt ``number`` of ``job_id`` unless it
    already has one. Returns whether written."""
    return bool(s.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == number,
                                                Attempt.external_id.is_(None))
                          .values(external_id=external_id)).rowcount)


# ---------------------------------------------------------------------- reconciler
def jobs_in_states(s: Session, states: Iterable[str]) -> list[Job]:
    """Inside ``s``: every job whose state is one of ``states`` (ORM rows, changes are saved with ``s``)."""
    return list(s.execute(select(Job).where(Job.state.in_(list(states)))).scalars())


def mark_silent_nodes_lost(s: Session, cutoff: datetime) -> int:
    """Inside ``s``: nodes ``up`` whose last heartbeat is before ``cutoff`` (UTC) become ``lost``, each only if
    still silent when written (a heartbeat may land between the read and the write). Returns how many."""
    n = 0
    for name in s.execute(select(Node.name).where(Node.state == "up", Node.last_heartbeat_at < cutoff)).scalars().all():
        n += s.execute(update(Node).where(Node.name == name, Node.state == "up", Node.last_heartbeat_at < cutoff)
                       .values(state="lost")).rowcount
    return n


def lost_node_names(s: Session) -> set[str]:
    """Inside ``s``: the names of the nodes in state ``lost``."""
    return set(s.execute(select(Node.name).where(Node.state == "lost")).scalars())


def due_schedules(s: Session, now: datetime, limit: int | None = None) -> list[tuple]:
    """Inside ``s``: the enabled schedules whose next fire is at or before ``now``, as tuples ``(id, team, cron,
    timezone, spec, last_fire_at, created_at, next_fire_at)``.

    With ``limit``, at most that many, round-robin across teams: every team's earliest due schedule (by
    ``next_fire_at``, then id) before any team's second, and so on (``row_number()`` per team, one query), so
    a team with 1,000 due schedules and one with 1 share a pass of 100 as 99 + 1. Without it, all of them
    in that order."""
    rn = func.row_number().over(partition_by=Schedule.team,
                                order_by=(Schedule.next_fire_at, Schedule.id)).label("rn")
    ranked = (select(Schedule.id.label("id"), rn, Schedule.next_fire_at.label("at"))
              .where(Schedule.enabled.is_(True), Schedule.next_fire_at <= now).subquery())
    order = select(ranked.c.id).order_by(ranked.c.rn, ranked.c.at, ranked.c.id)
    if limit is not None:
        order = order.limit(limit)
    ids = list(s.execute(order).scalars())
    rows = {d.id: d for d in s.execute(select(Schedule).where(Schedule.id.in_(ids))).scalars()} if ids else {}
    return [(d.id, d.team, d.cron, d.timezone, d.spec, d.last_fire_at, d.created_at, d.next_fire_at)
            for d in (rows[i] for i in ids)]


def skip_schedule_fire(s: Session, schedule_id: str, team: str, fire: datetime, reason: str, limit: str,
                       now: datetime) -> None:
    """Inside ``s``: record that the reconciler skipped ``schedule_id``'s fire at ``fire`` (UTC) for ``reason``
    (at most 2000 characters kept): the schedule's ``last_skip_at``/``last_skip_reason`` (its ``list``/``get``)
    and one ``schedule.skip`` audit event (actor kind ``reconciler``; detail ``team``, ``fire``, ``limit``, the
    dotted setting that refused, and ``reason``)."""
    s.execute(update(Schedule).where(Schedule.id == schedule_id)
              .values(last_skip_at=fire, last_skip_reason=reason[:2000]))
    s.execute(insert(AuditEvent).values(at=now, actor_token_id=None, actor_team="", actor_kind="reconciler",
                                        action="schedule.skip", target=schedule_id,
                                        detail={"team": team, "fire": fire.isoformat(), "limit": limit,
                                                "reason": reason[:2000]}))


def pause_schedule(s: Session, schedule_id: str, last_error: str) -> None:
    """Inside ``s``: disable a schedule with ``last_error`` (at most 2000 characters kept)."""
    s.execute(update(Schedule).where(Schedule.id == schedule_id).values(enabled=False, last_error=last_error[:2000]))


def advance_schedule(s: Session, schedule_id: str, seen_next: datetime, next_fire_at: datetime,
                     last_fire_at: datetime | None) -> None:
    """Inside ``s``: move a schedule's next fire on, only if it is still ``seen_next`` (two passes at once
    advance it once)."""
    s.execute(update(Schedule).where(Schedule.id == schedule_id, Schedule.next_fire_at == seen_next)
              .values(next_fire_at=next_fire_at, last_fire_at=last_fire_at))


def team_stored_spec_bytes(s: Session) -> dict[str, int]:
    """Inside ``s``: team -> bytes of the stored specs of all of its jobs, finished ones included
    (``quotas.stored_spec_bytes``); teams holding none are left out. PostgreSQL: the ``team_usage.stored_spec_bytes``
    counters (triggers, migration 0017; O(teams)); SQLite: a sum over ``jobs``."""
    if s.get_bind().dialect.name == "postgresql":
        rows = s.execute(text("SELECT team, stored_spec_bytes FROM team_usage WHERE stored_spec_bytes > 0")).all()
    else:
        rows = s.execute(select(Job.team, func.sum(spec_bytes_expr(s))).group_by(Job.team)).all()
    return {t: int(b) for t, b in rows if b}


def purge_finished(s: Session, states: Iterable[str], cutoff: datetime | None, limit: int,
                   live_instance_states: Iterable[str], *, team: str | None = None,
                   free_bytes: int | None = None) -> dict[str, int]:
    """Inside ``s``: delete up to ``limit`` jobs in ``states`` finished before ``cutoff`` (UTC; ``None``: any time),
    oldest first, with their events, logs, attempts and cloud-instance records (their state history goes with them:
    ``ON DELETE CASCADE``); usage records (the ledger) are kept. Jobs with a cloud instance in
    ``live_instance_states`` and rows locked by another writer (``FOR UPDATE SKIP LOCKED``) are skipped.
    ``team``: only that team's jobs. ``free_bytes`` (``quotas.stored_spec_bytes``): only the oldest of them whose
    specs (:func:`spec_bytes_expr`) add up to at least that many bytes (fewer if there are not so many), and the
    result has their sum as ``spec_bytes``. Returns the rows deleted per table: ``jobs``, ``events``, ``logs``,
    ``attempts``, ``cloud_instances``."""
    out = {"jobs": 0, "events": 0, "logs": 0, "attempts": 0, "cloud_instances": 0}
    if free_bytes is not None:
        out["spec_bytes"] = 0
    live_cloud = select(CloudInstance.job_id).where(CloudInstance.state.in_(list(live_instance_states)))
    cols = [Job.id] if free_bytes is None else [Job.id, spec_bytes_expr(s)]
    q = select(*cols).where(Job.state.in_(list(states)), Job.id.not_in(live_cloud))
    if cutoff is not None:
        q = q.where(Job.finished_at < cutoff)
    if team is not None:
        q = q.where(Job.team == team)
    rows = s.execute(q.order_by(Job.finished_at, Job.id).limit(int(limit))
                     .with_for_update(skip_locked=True)).all()
    if free_bytes is None:
        ids = [r[0] for r in rows]
    else:
        ids = []
        for job_id, n in rows:
            if out["spec_bytes"] >= free_bytes:
                break
            ids.append(job_id)
            out["spec_bytes"] += int(n or 0)
    if not ids:
        return out
    for key, table in (("events", JobEvent), ("logs", JobLog), ("attempts", Attempt),
                       ("cloud_instances", CloudInstance)):
        out[key] = s.execute(delete(table).where(table.job_id.in_(ids))).rowcount
    out["jobs"] = s.execute(delete(Job).where(Job.id.in_(ids))).rowcount
    return out
