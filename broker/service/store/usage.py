"""The usage-ledger repository: the SQL of ``usage_records`` (:class:`~broker.service.store.tables.UsageRow`).

Functions take an open :class:`~sqlalchemy.orm.Session` (``s``) so the caller decides the transaction: the
ledger writes in the transaction that ends the attempt (:mod:`broker.service.ledger`).

* :func:`billed_instances` — the cloud instances of an attempt that a provider bills (created ones);
* :func:`add_usage` — insert records, skipping any already written (the same key: meters once);
* :func:`usage_rows` — read records back, by job or by period.
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.service.store.tables import CloudInstance, UsageRow
from broker.usage import UsageRecord

__all__ = ["billed_instances", "add_usage", "usage_rows", "record_of"]

_FIELDS = [f for f in UsageRecord.__dataclass_fields__]


def billed_instances(s: Session, job_id: str, attempt: int) -> list[CloudInstance]:
    """Inside ``s``: the ``cloud_instances`` rows of attempt ``attempt`` of ``job_id`` that the provider created
    (a provider instance id is recorded), whatever their state now, by rank then row id."""
    return list(s.execute(select(CloudInstance).where(
        CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
        CloudInstance.provider_instance_id.is_not(None)).order_by(CloudInstance.rank, CloudInstance.id)).scalars())


def add_usage(s: Session, records: Iterable[UsageRecord], now: datetime) -> int:
    """Inside ``s``: insert ``records`` (recorded at ``now``, UTC), skipping those whose key (job, attempt, rank,
    line, resource) is already in the ledger; the unique constraint ``uq_usage_records_line`` backs this up.
    Returns how many were inserted."""
    records = list(records)
    if not records:
        return 0
    have = {(r.job_id, r.attempt, r.rank, r.line, r.resource) for r in s.execute(
        select(UsageRow.job_id, UsageRow.attempt, UsageRow.rank, UsageRow.line, UsageRow.resource).where(
            UsageRow.job_id.in_({r.job_id for r in records})))}
    n = 0
    for r in records:
        key = (r.job_id, r.attempt, r.rank, r.line, r.resource)
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
