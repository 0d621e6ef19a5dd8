"""The live-signal repository: the SQL of ``signal_values`` and ``signal_fetches``
(:class:`~broker.service.store.tables.SignalValue`, :class:`~broker.service.store.tables.SignalFetch`).

Functions take an open :class:`~sqlalchemy.orm.Session` (``s``) so the caller decides the transaction; the
rules (what is fresh, what the planner uses) live in :mod:`broker.service.signal_cache`.

* :func:`put_values` — upsert hours of one (source, zone): a measured hour replaces whatever was cached, a
  forecast hour replaces only a forecast (a later forecast never overwrites a measurement);
* :func:`value_rows` — the cached hours of some (source, zone) pairs in a window;
* :func:`prune_values` — drop hours older than an instant;
* :func:`record_fetch`, :func:`fetch_rows` — fetch health per (source, zone, kind).
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable, NamedTuple

from sqlalchemy import delete, or_, select, tuple_
from sqlalchemy.orm import Session

from broker.service.store.tables import SignalFetch, SignalValue

__all__ = ["CachedHour", "put_values", "value_rows", "prune_values", "record_fetch", "fetch_rows"]


class CachedHour(NamedTuple):
    """One cached hour: ``hour_at`` (UTC start), ``value`` (gCO2e/kWh or USD/MWh), flags, ``fetched_at`` (UTC)."""

    source: str
    zone: str
    hour_at: datetime
    value: float
    estimated: bool
    forecast: bool
    fetched_at: datetime


def _insert(s: Session):
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def put_values(s: Session, kind: str, unit: str, hours: Iterable[CachedHour]) -> int:
    """Inside ``s``: upsert ``hours`` (``kind`` ``carbon``/``price`` in ``unit``). A measured hour replaces the
    cached one; a forecast hour replaces only a cached forecast. Returns how many rows were given."""
    rows = [dict(source=h.source, zone=h.zone, hour_at=h.hour_at, kind=kind, value=float(h.value), unit=unit,
                 estimated=bool(h.estimated), forecast=bool(h.forecast), fetched_at=h.fetched_at) for h in hours]
    if not rows:
        return 0
    insert = _insert(s)
    for i in range(0, len(rows), 500):
        q = insert(SignalValue).values(rows[i:i + 500])
        ex = q.excluded
        q = q.on_conflict_do_update(
            index_elements=["source", "zone", "hour_at"],
            set_={"kind": ex.kind, "value": ex.value, "unit": ex.unit, "estimated": ex.estimated,
                  "forecast": ex.forecast, "fetched_at": ex.fetched_at},
            where=or_(ex.forecast.is_(False), SignalValue.forecast.is_(True)))
        s.execute(q)
    return len(rows)


def value_rows(s: Session, pairs: Iterable[tuple[str, str]], start: datetime, end: datetime) -> list[CachedHour]:
    """Inside ``s``: the cached hours of the ``(source, zone)`` pairs with ``start <= hour_at < end`` (UTC),
    by source, zone and hour."""
    pairs = list(dict.fromkeys(pairs))
    if not pairs:
        return []
    q = (select(SignalValue.source, SignalValue.zone, SignalValue.hour_at, SignalValue.value, SignalValue.estimated,
                SignalValue.forecast, SignalValue.fetched_at)
         .where(tuple_(SignalValue.source, SignalValue.zone).in_(pairs), SignalValue.hour_at >= start,
                SignalValue.hour_at < end)
         .order_by(SignalValue.source, SignalValue.zone, SignalValue.hour_at))
    return [CachedHour(*r) for r in s.execute(q)]


def prune_values(s: Session, before: datetime) -> int:
    """Inside ``s``: delete cached hours that start before ``before`` (UTC). Returns how many."""
    return s.execute(delete(SignalValue).where(SignalValue.hour_at < before)).rowcount or 0


def record_fetch(s: Session, source: str, zone: str, kind: str, now: datetime, stale_after_s: float,
                 error: tuple[str, str] | None = None) -> SignalFetch:
    """Inside ``s``: a fetch of (``source``, ``zone``, ``kind``) at ``now`` succeeded (``error`` None) or failed
    with ``(error class, message)``; the class's count goes up by one. Returns the row."""
    row = s.get(SignalFetch, (source, zone, kind))
    if row is None:
        row = SignalFetch(source=source, zone=zone, kind=kind, last_attempt_at=now, last_success_at=None,
                          last_error="", error_counts={}, stale_after_s=stale_after_s)
        s.add(row)
    row.last_attempt_at, row.stale_after_s = now, float(stale_after_s)
    if error is None:
        row.last_success_at, row.last_error = now, ""
    else:
        cls, msg = error
        counts = dict(row.error_counts or {})
        counts[cls] = int(counts.get(cls, 0)) + 1
        row.error_counts = counts
        row.last_error = f"{cls}: {msg}"[:500]
    s.flush()
    return row


def fetch_rows(s: Session) -> list[SignalFetch]:
    """Inside ``s``: every fetch-health row, by zone, kind and source."""
    return list(s.execute(select(SignalFetch).order_by(SignalFetch.zone, SignalFetch.kind,
                                                       SignalFetch.source)).scalars())
