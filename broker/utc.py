"""UTC instants as text and back: the one home of the broker's timestamp formats (pure, no I/O).

Every function takes an aware :class:`~datetime.datetime` (any offset: converted to UTC) or epoch seconds
(``int``/``float``, read as UTC); a naive datetime is refused with :class:`NaiveTimeError`, since its zone is
unknown. The name says the shape of the text:

============================  ==============================  =============================================
function                      shape                           used for
============================  ==============================  =============================================
:func:`iso_z`                 ``2026-12-04T03:00:00Z``        CLI tables, planner notes, synthetic traces
:func:`iso_z_exact`           ``2026-12-04T03:00:00.25Z``     the finance page's period (microseconds kept)
:func:`iso_seconds`           ``2026-12-04T03:00:00+00:00``   signal health, simulator reports
:func:`iso_minutes`           ``2026-12-04T03:00+00:00``      hourly rows, CLI replay windows
:func:`parse_utc`             text -> aware UTC datetime      CLI options, bill (CUR) rows
============================  ==============================  =============================================

Seconds and minutes are truncated, never rounded (as :meth:`datetime.isoformat` does); epoch seconds are first
rounded to the microsecond by :meth:`datetime.fromtimestamp`.
"""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = ["NaiveTimeError", "iso_z", "iso_z_exact", "iso_seconds", "iso_minutes", "parse_utc"]


class NaiveTimeError(ValueError):
    """A datetime (or ISO 8601 text) without a time zone where one is needed."""


def _utc(t: datetime | float) -> datetime:
    if isinstance(t, datetime):
        if t.utcoffset() is None:
            raise NaiveTimeError(f"{t.isoformat()!r} has no time zone (pass an aware datetime, e.g. with "
                                 f"tzinfo=timezone.utc, or epoch seconds)")
        return t.astimezone(timezone.utc)
    return datetime.fromtimestamp(t, tz=timezone.utc)


def iso_z(t: datetime | float) -> str:
    """``YYYY-MM-DDTHH:MM:SSZ``: UTC, whole seconds (microseconds dropped), ``Z`` for the zone.

    >>> iso_z(1796353200)
    '2026-12-04T03:00:00Z'
    """
    return _utc(t).isoformat(timespec="seconds")[:-6] + "Z"


def iso_z_exact(t: datetime | float) -> str:
    """``YYYY-MM-DDTHH:MM:SSZ``, or ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` when the instant has microseconds: UTC,
    nothing dropped, ``Z`` for the zone.

    >>> iso_z_exact(datetime(2026, 12, 4, 3, 0, 0, 250000, tzinfo=timezone.utc))
    '2026-12-04T03:00:00.250000Z'
    """
    return _utc(t).isoformat()[:-6] + "Z"


def iso_seconds(t: datetime | float) -> str:
    """``YYYY-MM-DDTHH:MM:SS+00:00``: UTC, whole seconds (microseconds dropped), ``+00:00`` for the zone.

    >>> iso_seconds(1796353200)
    '2026-12-04T03:00:00+00:00'
    """
    return _utc(t).isoformat(timespec="seconds")


def iso_minutes(t: datetime | float) -> str:
    """``YYYY-MM-DDTHH:MM+00:00``: UTC, whole minutes (seconds dropped), ``+00:00`` for the zone.

    >>> iso_minutes(1796353259)
    '2026-12-04T03:00+00:00'
    """
    return _utc(t).isoformat(timespec="minutes")


def parse_utc(text: str, field: str, *, naive: str = "refuse") -> datetime:
    """ISO 8601 ``text`` (a date, or a date and time; ``Z`` or an offset) -> aware UTC datetime.

    Text without a zone raises :class:`NaiveTimeError` (``naive="refuse"``) or is taken as UTC (``naive="utc"``);
    text that is no ISO 8601 date/time raises :class:`ValueError`; both name ``field`` and the text. The text is
    not stripped. An instant UTC cannot hold (year 1 or 9999 with an offset) raises :class:`OverflowError`.

    >>> parse_utc("2026-12-04T05:00:00+02:00", "--from")
    datetime.datetime(2026, 12, 4, 3, 0, tzinfo=datetime.timezone.utc)
    """
    if naive not in ("refuse", "utc"):
        raise ValueError(f"naive={naive!r}: 'refuse' or 'utc'")
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{field}={text!r}: not an ISO 8601 date/time (e.g. 2026-12-04T03:00:00Z)") from None
    if t.tzinfo is None:
        if naive == "refuse":
            raise NaiveTimeError(f"{field}={text!r}: no time zone (e.g. 2026-12-04T03:00:00Z)")
        return t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)
