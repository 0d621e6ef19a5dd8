"""The usage-ledger repository: the SQL of ``usage_records`` (:class:`~broker.service.store.tables.UsageRow`).

Functions take an open :class:`~sqlalchemy.orm.Session` (``s``) so the caller decides the transaction: the
ledger writes in the transaction that ends the attempt (:mod:`broker.service.ledger`).

* :func:`billed_instances` — the cloud instances of an attempt that a provider bills (created ones);
* :func:`deleted_at` — when a cloud instance was deleted (its row's move to a terminal state);
* :func:`ran_onprem`, :func:`registered_nodes`, :func:`last_line_start` — what the pools' idle lines are
  worked from (:func:`broker.service.ledger.meter_pool_idle`);
* :func:`add_usage` — insert records, skipping any already written (the same key: meters once);
* :func:`usage_rows` — read records back, by job or by period;
* :func:`usage_totals` — the sums of a period's records by one dimension, in SQL (what
  :func:`broker.usage.summarise` computes from records, without loading them).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from broker.instance_states import TERMINAL_INSTANCE_STATES
from broker.service.store.tables import Attempt, CloudInstance, CloudInstanceEvent, Node, UsageRow
from broker.usage import GPU_HOUR_LINES, SUMMARY_DIMENSIONS, UsageError, UsageRecord, UsageTotals

__all__ = ["billed_instances", "deleted_at", "ran_onprem", "registered_nodes", "last_line_start", "add_usage", "usage_rows", "usage_totals", "record_of"]

_TERMINAL = sorted(st.value for st in TERMINAL_INSTANCE_STATES)
_FIELDS = [f for f in UsageRecord.__dataclass_fields__]


def billed_instances(s: Session, job_id: str, attempt: int) -> list[CloudInstance]:
    """Inside ``s``: the ``cloud_instances`` rows of attempt ``attempt`` of ``job_id`` that the provider created
    (a provider instance id is recorded), whatever their state now, by rank then row id."""
    return list(s.execute(select(CloudInstance).where(
        CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
        CloudInstance.provider_instance_id.is_not(None)).order_by(CloudInstance.rank, CloudInstance.id)).scalars())


def _utc(t: datetime) -> datetime:
    """``t`` as an aware UTC instant (SQLite gives back naive UTC)."""
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def ran_onprem(s: Session, start: datetime, end: datetime) -> list[tuple[str | None, datetime, datetime | None,
                                                                           list[dict]]]:
    """Inside ``s``: the on-prem attempts that ran within ``[start, end)`` (UTC; started before ``end``, not ended
    by ``start``): ``(pool, started_at, ended_at or None while running, nodes)`` each, ``nodes`` the placement's
    ``{"node", "gpus", "rank"}`` parts."""
    q = select(Attempt.pool, Attempt.started_at, Attempt.ended_at, Attempt.nodes).where(
        Attempt.kind == "onprem", Attempt.started_at.is_not(None), Attempt.started_at < end,
        or_(Attempt.ended_at.is_(None), Attempt.ended_at > start))
    return [(p, _utc(a), _utc(b) if b is not None else None, list(n or [])) for p, a, b, n in s.execute(q)]


def registered_nodes(s: Session, before: datetime) -> list[tuple[str, str, str, int, datetime]]:
    """Inside ``s``: ``(name, pool, GPU type, GPUs, registered_at)`` of the on-prem nodes registered before
    ``before``."""
    return [(n, p, t, g, _utc(r)) for n, p, t, g, r in s.execute(
        select(Node.name, Node.pool, Node.gpu_type, Node.gpu_count, Node.registered_at)
        .where(Node.registered_at < before).order_by(Node.name))]


def last_line_start(s: Session, line: str) -> datetime | None:
    """Inside ``s``: the latest start of the ledger's ``line`` lines (``None``: none yet)."""
    t = s.scalar(select(func.max(UsageRow.start)).where(UsageRow.line == line))
    return _utc(t) if t is not None else None


def deleted_at(s: Session, row: CloudInstance) -> datetime | None:
    """Inside ``s``: when ``row``'s instance was deleted: the time of its row's move to ``terminated`` or
    ``abandoned`` (its state history), else its ``updated_at``; ``None`` while the row is live."""
    if row.state not in _TERMINAL:
        return None
    at = s.scalar(select(func.min(CloudInstanceEvent.at)).where(
        CloudInstanceEvent.instance_row_id == row.id, CloudInstanceEvent.to_state.in_(_TERMINAL)))
    return at or row.updated_at


def add_usage(s: Session, records: Iterable[UsageRecord], now: datetime) -> int:
    """Inside ``s``: insert ``records`` (recorded at ``now``, UTC), skipping those whose key (job, attempt, rank,
    line, resource, start) is already in the ledger; the unique constraint ``uq_usage_records_line`` backs this up.
    Returns how many were inserted."""
    records = list(records)
    if not records:
        return 0
    have = {(r.job_id, r.attempt, r.rank, r.line, r.resource, _utc(r.start)) for r in s.execute(
        select(UsageRow.job_id, UsageRow.attempt, UsageRow.rank, UsageRow.line, UsageRow.resource, UsageRow.start)
        .where(UsageRow.job_id.in_({r.job_id for r in records}), UsageRow.line.in_({r.line for r in records}),
               UsageRow.start >= min(r.start for r in records), UsageRow.start <= max(r.start for r in records)))}
    n = 0
    for r in records:
        key = (r.job_id, r.attempt, r.rank, r.line, r.resource, _utc(r.start))
        if key in have:
            continue
        have.add(key)
        d = r.to_dict()
        s.add(UsageRow(**d, recorded_at=now))
        n += 1
    return n


def record_of(row: UsageRow) -> UsageRecord:
    """The :class:`UsageRecord` of a row."""
    d = {f: getattr(row, f) for f in _FIELDS}
    d["estimate_reasons"] = tuple(d["estimate_reasons"] or ())
    return UsageRecord(**d)


def usage_rows(s: Session, job_id: str | None = None, start: datetime | None = None,
               end: datetime | None = None, team: str | None = None) -> list[UsageRecord]:
    """Inside ``s``: the usage records of ``job_id`` (all jobs: ``None``) whose window starts in
    ``[start, end)`` (UTC; either bound may be ``None``), of ``team`` (every team: ``None``), by job, attempt,
    rank, line."""
    q = select(UsageRow)
    if team is not None:
        q = q.where(UsageRow.team == team)
    if job_id is not None:
        q = q.where(UsageRow.job_id == job_id)
    if start is not None:
        q = q.where(UsageRow.start >= start)
    if end is not None:
        q = q.where(UsageRow.start < end)
    q = q.order_by(UsageRow.job_id, UsageRow.attempt, UsageRow.rank, UsageRow.line, UsageRow.resource)
    return [record_of(r) for r in s.execute(q).scalars()]


def _day(s: Session):
    """The UTC day (``YYYY-MM-DD``) a record starts, in SQL."""
    if s.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", UsageRow.start), "YYYY-MM-DD")
    return func.substr(UsageRow.start, 1, 10)  # SQLite keeps UTC instants as 'YYYY-MM-DD HH:MM:SS.ffffff'


def usage_totals(s: Session, by: str, start: datetime, end: datetime, team: str | None = None) -> list[UsageTotals]:
    """Inside ``s``: the records of ``team`` (every team: ``None``) that start in ``[start, end)`` (UTC), summed
    by ``by`` (one of :data:`broker.usage.SUMMARY_DIMENSIONS`) in one ``GROUP BY``: the same figures as
    :func:`broker.usage.summarise` (known figures summed, unknown ones counted apart; GPU-hours of the
    :data:`broker.usage.GPU_HOUR_LINES`), groups by key with ``None`` last. Raises
    :class:`~broker.usage.UsageError` naming ``by`` for an unknown dimension."""
    if by not in SUMMARY_DIMENSIONS:
        raise UsageError(f"by={by!r}: not one of {', '.join(SUMMARY_DIMENSIONS)}")
    key = _day(s) if by == "day" else getattr(UsageRow, by)
    n = func.count()
    q = (select(key, func.sum(UsageRow.billed_usd),
                func.sum(case((UsageRow.line.in_(GPU_HOUR_LINES), UsageRow.gpu_count * UsageRow.run_s), else_=0.0)),
                func.sum(UsageRow.energy_kwh), func.sum(UsageRow.carbon_kg), n,
                func.sum(case((UsageRow.estimated, 1), else_=0)),
                n - func.count(UsageRow.billed_usd), n - func.count(UsageRow.energy_kwh),
                n - func.count(UsageRow.carbon_kg))
         .where(UsageRow.start >= start, UsageRow.start < end).group_by(key))
    if team is not None:
        q = q.where(UsageRow.team == team)
    out = [UsageTotals(key=k, cost_usd=float(usd or 0.0), gpu_hours=float(gpu_s or 0.0) / 3600.0,
                       energy_kwh=float(kwh or 0.0), carbon_kg=float(kg or 0.0), lines=int(lines),
                       estimated_lines=int(est or 0), unpriced_lines=int(nu), unknown_energy_lines=int(ne),
                       unknown_carbon_lines=int(nc))
           for k, usd, gpu_s, kwh, kg, lines, est, nu, ne, nc in s.execute(q)]
    return sorted(out, key=lambda g: (g.key is None, g.key or ""))
