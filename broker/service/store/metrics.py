"""Metrics repository: the counts the Prometheus endpoint (:mod:`broker.service.metrics`) reads at each scrape.

Every function reads in the session it is given and filters to one team when ``team`` is set (a team
token sees its own series only). Label values come from bounded sets (teams, states, pools, providers):
never a job id.

* :func:`job_state_counts` — jobs per (team, state);
* :func:`queue_depth` — queued jobs per (team, committed pool);
* :func:`cloud_instance_counts` — cloud instance records per (provider, state);
* :func:`attempt_gpu_seconds` — GPU-seconds of attempts per (team, kind, pool or provider), running ones up to now;
* :func:`wait_histogram` — per team, started jobs by wait (submission to start) bucket, their count and sum;
* :func:`usage_sums` — the usage ledger's billed USD, kWh and kgCO2e per (team, provider, line).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from broker.service.store.tables import Attempt, CloudInstance, Job, UsageRow

__all__ = ["job_state_counts", "queue_depth", "cloud_instance_counts", "attempt_gpu_seconds", "wait_histogram",
           "usage_sums"]


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


def _seconds(s: Session, later, earlier):
    """SQL for ``later - earlier`` in seconds (PostgreSQL ``extract(epoch ...)``, SQLite ``julianday``)."""
    if s.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", later - earlier)
    # julianday is a float of days (~1e-9 d resolution): rounded to the millisecond the stored instants carry
    return func.round((func.julianday(later) - func.julianday(earlier)) * 86400.0, 3)


def attempt_gpu_seconds(s: Session, team: str | None, now: datetime) -> list[tuple[str, str, str, float]]:
    """``(team, kind, place, GPU-seconds)``: attempts' GPUs x (end, or ``now`` while running, - start),
    summed in SQL per team, kind (``onprem``/``cloud``) and place (the pool, or the provider: the offer id's
    first field). Attempts that never started count 0."""
    held = Attempt.gpus * _seconds(s, func.coalesce(Attempt.ended_at, now), Attempt.started_at)
    q = (select(Job.team, Attempt.kind, Attempt.pool, Attempt.offer_id, func.sum(held))
         .join(Job, Job.id == Attempt.job_id).where(Attempt.started_at.is_not(None))
         .group_by(Job.team, Attempt.kind, Attempt.pool, Attempt.offer_id))
    if team is not None:
        q = q.where(Job.team == team)
    out: dict[tuple[str, str, str], float] = {}
    for t, kind, pool, offer, sec in s.execute(q):  # one row per pool or offer: folded to places here
        place = (pool or "") if kind == "onprem" else (offer or "").split(":", 1)[0]
        out[(t, kind, place)] = out.get((t, kind, place), 0.0) + max(float(sec or 0.0), 0.0)
    return [(t, k, p, v) for (t, k, p), v in sorted(out.items())]


def wait_histogram(s: Session, team: str | None, bounds_s: tuple[float, ...]) -> list[tuple[str, list[int], int, float]]:
    """Per team, ``(team, jobs with wait <= each bound, jobs, sum of waits s)`` over the jobs that have started;
    the wait is submission to start (``jobs.started_at``: the current run's start; a requeue clears it).
    Counted in SQL."""
    wait = _seconds(s, Job.started_at, Job.created_at)
    cols = [func.sum(case((wait <= b, 1), else_=0)) for b in bounds_s]
    q = (select(Job.team, func.count(), func.sum(wait), *cols).where(Job.started_at.is_not(None))
         .group_by(Job.team).order_by(Job.team))
    if team is not None:
        q = q.where(Job.team == team)
    return [(r[0], [int(c or 0) for c in r[3:]], int(r[1]), max(float(r[2] or 0.0), 0.0)) for r in s.execute(q)]


def usage_sums(s: Session, team: str | None) -> list[tuple[str, str, str, float | None, float | None, float | None]]:
    """``(team, provider, line, billed USD, kWh, kgCO2e)`` summed over every usage record on record (the
    ledger keeps them past job retention, so the sums only grow). Unknown figures (NULL, flagged in the ledger)
    are left out of a sum, and a figure no record of the group knows is ``None``, never 0."""
    def known_sum(col):
        return case((func.count(col) > 0, func.sum(col)), else_=None)

    q = (select(UsageRow.team, UsageRow.provider, UsageRow.line, known_sum(UsageRow.billed_usd),
                known_sum(UsageRow.energy_kwh), known_sum(UsageRow.carbon_kg))
         .group_by(UsageRow.team, UsageRow.provider, UsageRow.line)
         .order_by(UsageRow.team, UsageRow.provider, UsageRow.line))
    if team is not None:
        q = q.where(UsageRow.team == team)
    return [(t, p, ln, *(None if v is None else float(v) for v in (usd, kwh, kg)))
            for t, p, ln, usd, kwh, kg in s.execute(q)]
