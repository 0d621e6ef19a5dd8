"""Planning repository: the rows the planning cycle (:mod:`broker.service.cycle`) reads and writes.

The cycle keeps its steps and rules (what a job becomes, which decision applies); these functions only read
and write rows, each inside the :class:`~sqlalchemy.orm.Session` the cycle gives, so the cycle keeps its
transactions (one short transaction per intake or notes batch; the apply in one fenced transaction,
:meth:`broker.service.store.core.JobStore.advance_fence`). Job state changes of single jobs go through
:meth:`~broker.service.store.core.JobStore.cas` / :meth:`~broker.service.store.core.JobStore.bump`.

* intake: :func:`intake_ids` (due jobs, round-robin across teams), :func:`intake_rows`, :func:`lock_free_rows`
  (``FOR UPDATE SKIP LOCKED``), :func:`write_moves` (one bulk compare-and-set batch);
* snapshot: :func:`live_node_rows`, :func:`queued_order`, :func:`queued_rows`, :func:`active_job_rows`,
  :func:`gpu_usage_rows` (fair share);
* apply (rows read with :meth:`~broker.service.store.core.JobStore.job_row`): :func:`flag`, :func:`add_onprem_attempt`, :func:`write_notes`.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Iterable, Sequence

from sqlalchemy import JSON, func, insert, or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session

from broker.service.store.core import JobStore
from broker.service.store.tables import Attempt, Job, JobEvent, Node
from broker.states import ACTIVE_STATE_VALUES, JobState

__all__ = ["INTAKE_STATES", "intake_ids", "intake_rows", "lock_free_rows", "write_moves", "live_node_rows",
           "queued_order", "queued_rows", "active_job_rows", "gpu_usage_rows", "flag",
           "add_onprem_attempt", "write_notes"]

S = JobState
#: the states a job passes through intake from (``submitted``; ``deferred`` when due; ``queued`` past its window)
INTAKE_STATES = (S.submitted.value, S.deferred.value, S.queued.value)
#: ids per ``IN (...)`` list
_IN_CHUNK = 1000


def _due(now: datetime):
    """The intake condition at ``now``: ``submitted``; ``deferred`` with ``not_before <= now``; ``queued`` or
    ``deferred`` with ``not_after < now`` (their start window closed)."""
    return or_(
        Job.state == S.submitted.value,
        (Job.state == S.deferred.value) & (Job.not_before <= now),
        (Job.state.in_([S.queued.value, S.deferred.value])) & (Job.not_after < now),
    )


# ----------------------------------------------------------------------------- intake
def intake_ids(s: Session, now: datetime, limit: int | None = None) -> list[str]:
    """The ids of the jobs due for intake at ``now`` (:func:`_due`), fairly across teams: round-robin by team,
    oldest first within a team (``row_number() over (partition by team order by created_at, id)``, then
    ``created_at``, then id). At most ``limit`` ids (``None``: all)."""
    rn = func.row_number().over(partition_by=Job.team, order_by=(Job.created_at, Job.id)).label("rn")
    sub = select(Job.id, Job.created_at, rn).where(_due(now)).subquery()
    q = select(sub.c.id).order_by(sub.c.rn, sub.c.created_at, sub.c.id)
    if limit is not None:
        q = q.limit(limit)
    return list(s.execute(q).scalars())


def intake_rows(s: Session, ids: Sequence[str], now: datetime) -> list[Job]:
    """The rows of those of ``ids`` that are still due for intake at ``now``, oldest first (then by id)."""
    return list(s.execute(select(Job).where(Job.id.in_(ids), _due(now))
                          .order_by(Job.created_at, Job.id)).scalars())


def lock_free_rows(s: Session, ids: Sequence[str]) -> dict[str, Row]:
    """Lock, until ``s`` ends, the rows of ``ids`` that no other transaction holds (``FOR UPDATE SKIP
    LOCKED``; SQLite's ``BEGIN IMMEDIATE`` already serialises writers) and return them by id, each a row with
    the named columns ``id, version, state``. A row another writer holds (e.g. a cancel) is left out."""
    return {r.id: r for r in s.execute(select(Job.id, Job.version, Job.state).where(Job.id.in_(ids))
                                       .with_for_update(skip_locked=True))}


def write_moves(s: Session, moves: Sequence[tuple[Job, str, str, dict]], now: datetime) -> int:
    """Inside ``s``, apply intake moves already checked (the transition allowed, the row locked and still at
    the version read): per ``(job as read, to_state, reason, fields)`` set ``state``, ``version + 1``,
    ``updated_at = now``, ``reason``, ``not_before`` (``fields["not_before"]`` or the job's) and
    ``finished_at`` (``fields.get("finished_at")``), and record the event. One bulk ``UPDATE`` by primary key
    and one bulk event ``INSERT``. Returns how many moves were written."""
    if not moves:
        return 0
    _update_by_id(s, [
        dict(id=j.id, state=to_state, version=j.version + 1, updated_at=now, reason=why,
             not_before=fields.get("not_before", j.not_before), finished_at=fields.get("finished_at"))
        for j, to_state, why, fields in moves])
    s.execute(insert(JobEvent), [
        dict(job_id=j.id, at=now, from_state=j.state, to_state=to_state, version=j.version + 1, reason=why)
        for j, to_state, why, _ in moves])
    return len(moves)


# ----------------------------------------------------------------------------- snapshot
def live_node_rows(s: Session, heard_since: datetime) -> list[Node]:
    """Nodes in state ``up`` whose last heartbeat is at or after ``heard_since``."""
    return list(s.execute(select(Node).where(Node.state == "up", Node.last_heartbeat_at >= heard_since)).scalars())


def queued_order(s: Session) -> list[tuple[str, int]]:
    """Every ``queued`` job in planning order (priority descending, then age, then id): ``(id, version)``
    tuples only (a narrow index read, no JSON; PostgreSQL: fetched as plain tuples, without SQLAlchemy's
    row objects, which were most of this read's time at 10,000 queued jobs)."""
    q = (select(Job.id, Job.version).where(Job.state == S.queued.value)
         .order_by(Job.priority.desc(), Job.created_at, Job.id))
    if s.get_bind().dialect.name != "postgresql":
        return [tuple(r) for r in s.execute(q)]
    compiled = q.compile(dialect=s.get_bind().dialect)
    raw = s.connection().connection.driver_connection
    with raw.cursor() as cur:
        cur.execute(str(compiled), compiled.params)
        return cur.fetchall()


def queued_rows(s: Session, ids: Sequence[str]) -> Iterable[Job]:
    """The full rows of those of ``ids`` that are still ``queued``, read :data:`_IN_CHUNK` ids a query (in no
    particular order)."""
    for k in range(0, len(ids), _IN_CHUNK):
        yield from s.execute(select(Job).where(Job.id.in_(ids[k:k + _IN_CHUNK]), Job.state == S.queued.value)
                             ).scalars()


def active_job_rows(s: Session) -> list[Job]:
    """The jobs that hold (or are acquiring) GPUs or instances (:data:`broker.states.ACTIVE_STATES`)."""
    return list(s.execute(select(Job).where(Job.state.in_(ACTIVE_STATE_VALUES))).scalars())


def gpu_usage_rows(s: Session, ended_since: datetime) -> list[Row]:
    """The attempts that started and are still running or ended at or after ``ended_since``: rows with the
    named columns ``team, gpus, gpu_type, started_at, ended_at`` (UTC; ``ended_at`` ``None`` while running)."""
    return list(s.execute(select(Job.team, Attempt.gpus, Attempt.gpu_type, Attempt.started_at, Attempt.ended_at)
                          .join(Job, Job.id == Attempt.job_id)
                          .where(Attempt.started_at.is_not(None),
                                 or_(Attempt.ended_at.is_(None), Attempt.ended_at >= ended_since))))


# ----------------------------------------------------------------------------- apply
def flag(s: Session, j: Job, now: datetime, event_reason: str, **fields) -> bool:
    """Inside ``s``: compare-and-set ``fields`` on job ``j`` without a state change (:meth:`JobStore.bump`
    from ``j.version``) and, when it applied, record a same-state event with ``event_reason`` (e.g. a
    preemption request). Returns whether it applied."""
    if not JobStore.bump(s, j.id, j.version, now, **fields):
        return False
    s.add(JobEvent(job_id=j.id, at=now, from_state=j.state, to_state=j.state, version=j.version + 1,
                   reason=event_reason))
    return True


def add_onprem_attempt(s: Session, job_id: str, number: int, pool: str, nodes: list[dict], gpu_type: str,
                       now: datetime, kind: str = "onprem") -> None:
    """Inside ``s``: record attempt ``number`` of ``job_id`` placed on on-prem ``pool``; ``nodes`` is the
    placement's ``[{"node", "gpus", "rank"}]`` (its GPU count is the attempt's ``gpus``); created at ``now``.
    ``kind``: ``"onprem"`` (node agents), or the pool kind of an existing scheduler's pool (``"slurm"``)."""
    s.add(Attempt(job_id=job_id, number=number, kind=kind, pool=pool, offer_id=None, nodes=nodes,
                  gpu_type=gpu_type, gpus=sum(len(p["gpus"]) for p in nodes), created_at=now,
                  rank_exits={}, reason=""))


def write_notes(s: Session, notes: Sequence[tuple[Job, dict]], now: datetime) -> tuple[int, dict[str, int]]:
    """Inside ``s``: write fields that change no state (``(job as read, fields)``, e.g. a wait decision's pool,
    review time, record and reason) on the jobs whose rows no other transaction holds (:func:`lock_free_rows`)
    and that are still at the version read: each gets ``fields``, ``version + 1`` and ``updated_at = now``, one
    bulk ``UPDATE`` by primary key per set of field names.

    Returns ``(written, held)``: how many were written, and ``id -> version`` of the rows locked (the jobs
    of ``notes`` whose version there equals the one read were written)."""
    held = {jid: r.version for jid, r in lock_free_rows(s, [j.id for j, _ in notes]).items()}
    groups: dict[tuple[str, ...], list[dict]] = defaultdict(list)
    for j, fields in notes:
        if held.get(j.id) == j.version:
            groups[tuple(sorted(fields))].append(dict(id=j.id, version=j.version + 1, updated_at=now, **fields))
    n = 0
    for rows in groups.values():
        _update_by_id(s, rows)
        n += len(rows)
    return n, held


def _update_by_id(s: Session, rows: list[dict]) -> None:
    """``UPDATE jobs`` by primary key inside ``s``: each of ``rows`` (dicts with the same keys, ``id`` among
    them) sets its other keys' columns on the job ``id``. PostgreSQL: one statement joining ``unnest()`` of one
    array per column (at 200 rows half the time of the ORM's per-row bulk UPDATE, which is what SQLite, and
    a row with a JSON column, get)."""
    if not rows:
        return
    dialect = s.get_bind().dialect
    cols = [c for c in rows[0] if c != "id"]
    table = Job.__table__
    if dialect.name != "postgresql" or any(isinstance(table.c[c].type, JSON) for c in cols):
        s.execute(update(Job), rows)
        return
    names = ["id", *cols]
    arrays = ", ".join(f"%s::{table.c[c].type.compile(dialect=dialect)}[]" for c in names)
    sql = (f"UPDATE jobs SET {', '.join(f'{c} = v.{c}' for c in cols)} "
           f"FROM unnest({arrays}) AS v({', '.join(names)}) WHERE jobs.id = v.id")
    raw = s.connection().connection.driver_connection
    with raw.cursor() as cur:
        cur.execute(sql, [[r[c] for r in rows] for c in names])
