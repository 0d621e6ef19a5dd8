"""Metrics repository: the counts the Prometheus endpoint (:mod:`broker.service.metrics`) reads at each scrape.

Every function reads in the session it is given and filters to one team when ``team`` is set (a team
token sees its own series only). Label values come from bounded sets (teams, states, pools, providers):
never a job id.

* :func:`job_state_counts` — jobs per (team, state);
* :func:`queue_depth` — queued jobs per (team, committed pool);
* :func:`cloud_instance_counts` — cloud instance records per (provider, state);
* :func:`attempt_gpu_seconds` — GPU-seconds of attempts per (team, kind, pool or provider), running ones up to now;
* :func:`first_waits` — seconds from submission to start, per started job (team, seconds).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.service.store.tables import Attempt, CloudInstance, Job

__all__ = ["job_state_counts", "queue_depth", "cloud_instance_counts", "attempt_gpu_seconds", "first_waits"]


def job_state_counts(s: Session, team: str | None) -> list[tuple[str, str, int]]:
    """``(team, state, jobs)`` for every (team, state) with at least one job."""
    q = select(Job.team, Job.state, func.count()).group_by(Job.team, Job.state)
    if team is not None:
        q = q.where(Job.team == team)
    return [(t, st, int(n)) for t, st, n in s.execute(q)]


def queue_depth(s: Session, team: str | None) -> list[tuple[str, str, int]]:
    """``(team, pool, jobs)`` of ``queued`` jobs; ``pool`` is the committed pool, ``""`` while undecided."""
    q = select(Job.team, Job.committed_pool, func.count()).where(Job.state == "queued").group_by(Job.team,
                                                                                                Job.committed_pool)
    if team is not None:
        q = q.where(Job.team == team)
    out: dict[tuple[str, str], int] = {}
    for t, p, n in s.execute(q):  # NULL and "" are one label value
        out[(t, p or "")] = out.get((t, p or ""), 0) + int(n)
    return [(t, p, n) for (t, p), n in sorted(out.items())]


def cloud_instance_counts(s: Session, team: str | None) -> list[tuple[str, str, int]]:
    """``(provider, state, instance records)``; with ``team``, only that team's jobs' instances."""
    q = select(CloudInstance.provider, CloudInstance.state, func.count()).group_by(CloudInstance.provider,
                                                                                  CloudInstance.state)
    if team is not None:
        q = q.join(Job, Job.id == CloudInstance.job_id).where(Job.team == team)
    return [(pr, st, int(n)) for pr, st, n in s.execute(q)]


def attempt_gpu_seconds(s: Session, team: str | None, now: datetime) -> list[tuple[str, str, str, float]]:
    """``(team, kind, place, GPU-seconds)``: attempts' GPUs x (end, or ``now`` while running, - start),
    summed per team, kind (``onprem``/``cloud``) and place (the pool, or the provider: the offer id's first
    field). Attempts that never started count 0. Summed in Python: portable across PostgreSQL and SQLite."""
    q = (select(Job.team, Attempt.kind, Attempt.pool, Attempt.offer_id, Attempt.gpus, Attempt.started_at,
                Attempt.ended_at).join(Job, Job.id == Attempt.job_id).where(Attempt.started_at.is_not(None)))
    if team is not None:
        q = q.where(Job.team == team)
    out: dict[tuple[str, str, str], float] = {}
    for t, kind, pool, offer, gpus, start, end in s.execute(q):
        place = (pool or "") if kind == "onprem" else (offer or "").split(":", 1)[0]
        held = max(((end or now) - start).total_seconds(), 0.0)
        out[(t, kind, place)] = out.get((t, kind, place), 0.0) + gpus * held
    return [(t, k, p, v) for (t, k, p), v in sorted(out.items())]


def first_waits(s: Session, team: str | None) -> list[tuple[str, float]]:
    """``(team, seconds from submission to start)`` of every job that has started (``jobs.started_at``: the
    current run's start; a requeue clears it)."""
    q = select(Job.team, Job.created_at, Job.started_at).where(Job.started_at.is_not(None))
    if team is not None:
        q = q.where(Job.team == team)
    return [(t, max((st - c).total_seconds(), 0.0)) for t, c, st in s.execute(q)]
