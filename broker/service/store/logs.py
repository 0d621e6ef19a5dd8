"""The job-log repository: the sizes of stored log chunks and the trim that keeps a log's head and tail.

A log is the chunks (``job_logs`` rows) of one ``(job_id, attempt, rank)``, in ``seq`` order; each row carries its
UTF-8 size (``bytes``). Trimming a log keeps its leading chunks up to ``head_bytes`` and its trailing chunks up
to ``tail_bytes`` (whole chunks) and replaces everything between them by ONE marker chunk
(:func:`broker.log_marker.dropped_marker`, ``dropped_bytes`` = the bytes it stands for, an earlier marker's
included), stored under the ``seq`` of the first dropped chunk so the order holds. The rules of when to trim are
:mod:`broker.service.log_budget`.
"""

from __future__ import annotations

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from broker.log_marker import dropped_marker
from broker.service.store.tables import Job, JobLog

__all__ = ["log_bytes", "trim_log", "team_log_bytes", "team_logs_oldest_first"]


def log_bytes(s: Session, job_id: str, attempt: int, rank: int) -> int:
    """Inside ``s``: the bytes (UTF-8) stored for one attempt rank's log, markers included."""
    return int(s.execute(select(func.coalesce(func.sum(JobLog.bytes), 0)).where(
        JobLog.job_id == job_id, JobLog.attempt == attempt, JobLog.rank == rank)).scalar_one())


def trim_log(s: Session, job_id: str, attempt: int, rank: int, head_bytes: int, tail_bytes: int) -> int:
    """Inside ``s``: keep the head (leading chunks while they total <= ``head_bytes``) and the tail (trailing
    chunks while they total <= ``tail_bytes``) of one log and put one marker chunk for the rest (see the module
    docstring); a marker is never part of a head or tail. Returns the bytes freed (>= 0; 0 when nothing lies
    between head and tail, or only one marker does)."""
    rows = s.execute(select(JobLog.id, JobLog.bytes, JobLog.dropped_bytes).where(
        JobLog.job_id == job_id, JobLog.attempt == attempt, JobLog.rank == rank).order_by(JobLog.seq)).all()
    h, used = 0, 0
    while h < len(rows) and not rows[h].dropped_bytes and used + rows[h].bytes <= head_bytes:
        used += rows[h].bytes
        h += 1
    t, used = len(rows), 0
    while t > h and not rows[t - 1].dropped_bytes and used + rows[t - 1].bytes <= tail_bytes:
        used += rows[t - 1].bytes
        t -= 1
    middle = rows[h:t]
    if not middle or (len(middle) == 1 and middle[0].dropped_bytes):
        return 0
    dropped = sum(r.dropped_bytes if r.dropped_bytes else r.bytes for r in middle)
    marker = dropped_marker(dropped)
    size = len(marker.encode())
    s.execute(update(JobLog).where(JobLog.id == middle[0].id).values(data=marker, bytes=size, dropped_bytes=dropped))
    if len(middle) > 1:
        s.execute(delete(JobLog).where(JobLog.id.in_([r.id for r in middle[1:]])))
    return max(sum(r.bytes for r in middle) - size, 0)


def team_log_bytes(s: Session) -> dict[str, int]:
    """Inside ``s``: team -> the bytes of its stored logs (every job, attempt and rank; markers included)."""
    q = (select(Job.team, func.sum(JobLog.bytes)).join(Job, Job.id == JobLog.job_id).group_by(Job.team))
    return {team: int(n or 0) for team, n in s.execute(q)}


def team_logs_oldest_first(s: Session, team: str, more_than: int, limit: int) -> list[tuple[str, int, int, int]]:
    """Inside ``s``: up to ``limit`` logs of ``team`` holding more than ``more_than`` bytes, as ``(job_id, attempt,
    rank, bytes)``, oldest first (by their first stored chunk)."""
    total = func.sum(JobLog.bytes)
    q = (select(JobLog.job_id, JobLog.attempt, JobLog.rank, total)
         .join(Job, Job.id == JobLog.job_id).where(Job.team == team)
         .group_by(JobLog.job_id, JobLog.attempt, JobLog.rank).having(total > more_than)
         .order_by(func.min(JobLog.id)).limit(limit))
    return [(j, int(a), int(r), int(n)) for j, a, r, n in s.execute(q)]
