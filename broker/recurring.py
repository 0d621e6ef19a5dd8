"""Recurring schedules: 5-field cron expressions read in a local IANA time zone, DST-safe.

A recurring job template carries a cron expression (``"30 2 * * *"``) and a time
zone (``"America/New_York"``); the cron is read in that zone's **local
wall-clock time**. All instants that come out of this module are aware UTC
datetimes (ARCHITECTURE.md §5: state and time series are kept in UTC).

How fires are computed
----------------------
croniter is only ever given *naive* wall-clock datetimes, so it does pure
calendar arithmetic and never sees a UTC offset. Each wall-clock match ``W`` is
then mapped to UTC instants with :mod:`zoneinfo`:

* **ordinary time**: ``W`` exists once -> one fire at ``W`` in local time.
* **non-existent time** (spring forward, e.g. 02:30 on 2026-03-08 in
  America/New_York, where clocks jump 02:00 EST -> 03:00 EDT): detected by a
  round trip (``W`` -> UTC -> local does not give ``W`` back). It fires at the
  first instant after the gap, i.e. the transition instant (03:00 EDT =
  07:00Z). Several wall times inside one gap (``*/15``: 02:00, 02:15, 02:30,
  02:45) and the wall time at the end of the gap (03:00) all map to that same
  instant and fire **once** there. So a daily cron never skips a day, and an
  hourly cron fires once per real hour (01:00 EST, 03:00 EDT, 04:00 EDT).
* **repeated time** (fall back, e.g. 01:30 on 2026-11-01 in New York, which
  happens at 05:30Z as EDT and again at 06:30Z as EST): fires at the **first
  occurrence** (``fold=0``) only; so a daily 01:30 fires once that day
  (05:30Z). Exception, as in Vixie/ISC cron: when the cron's hour field matches
  every hour (``*``, ``*/1``, ``0-23``), the wall time also fires at its second
  occurrence (``fold=1``), because such a cron is about elapsed real time:
  ``0 * * * *`` fires at 00:00 EDT, 01:00 EDT, 01:00 EST, 02:00 EST (04:00Z,
  05:00Z, 06:00Z, 07:00Z) -- once per real hour, never skipping one, and
  ``*/15 * * * *`` keeps firing every 15 real minutes.

The fire instants form a set; :func:`next_fire` returns the smallest one
strictly after a given instant, so iterating it gives strictly increasing UTC
instants and never the same instant twice.

Assumption: no UTC offset change moves clocks *back* by more than 3 hours
(:data:`MAX_SHIFT`); true of every DST rule in tzdata (1 h, 30 min on Lord
Howe, 2 h on Troll). Forward jumps of any size are handled.

Errors: :class:`ScheduleError` (a ``ValueError``) naming the field and value.
"""

from __future__ import annotations

import functools
import re
import heapq
import math
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, CroniterError, croniter

__all__ = ["ScheduleError", "MAX_SHIFT", "validate_cron", "validate_timezone", "next_fire", "due_fires"]

UTC = timezone.utc

#: largest backward jump of local clocks that the search window allows for (see module docstring).
MAX_SHIFT = timedelta(hours=3)
_MAX_SHIFT_S = MAX_SHIFT.total_seconds()

_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

#: instant from which :func:`validate_cron` checks that a cron fires at all (a leap year follows).
_PROBE = datetime(2000, 1, 1)


class ScheduleError(ValueError):
    """A cron expression, time zone or instant was rejected: names the field and the value."""


# --------------------------------------------------------------------------- validation
def _parse_cron(cron: str) -> tuple[str, bool]:
    """(normalised cron, hour field matches every hour). Raises :class:`ScheduleError`."""
    if not isinstance(cron, str):
        raise ScheduleError(f"cron={cron!r}: not a string")
    return _parse_cron_cached(cron)


@functools.lru_cache(maxsize=1024)
def _parse_cron_cached(cron: str) -> tuple[str, bool]:
    text = " ".join(cron.split()).lower()
    text = _MACROS.get(text, text)
    fields = text.split(" ") if text else []
    if len(fields) != 5:
        raise ScheduleError(
            f"cron={cron!r}: need 5 fields (minute hour day-of-month month day-of-week), got {len(fields)}"
        )
    for f in fields:
        for tok in f.split(","):
            # croniter's Jenkins-style "H" (hashed) and "R" (random) fields are not deterministic schedules
            if tok in ("h", "r") or tok.startswith(("h(", "h/", "r(")):
                raise ScheduleError(f"cron={cron!r}: hashed/random field {tok.upper()!r} is not supported")
            # a reversed numeric range ("5-1") is an error in standard cron; croniter wraps it around
            rng = re.fullmatch(r"(\d+)-(\d+)(/\d+)?", tok)
            if rng and int(rng.group(1)) > int(rng.group(2)):
                raise ScheduleError(f"cron={cron!r}: range {tok!r} runs backwards")
    try:
        it = croniter(text, _PROBE)
        it.get_next(datetime)
    except CroniterBadDateError:
        raise ScheduleError(f"cron={cron!r}: never fires (no matching date)") from None
    except (CroniterError, ValueError, KeyError, TypeError) as e:
        raise ScheduleError(f"cron={cron!r}: {e}") from None
    every_hour = it.expanded[1] == ["*"]
    return text, every_hour


def validate_cron(cron: str) -> str:
    """Check a 5-field cron expression and return it normalised.

    Args:
        cron: ``"minute hour day-of-month month day-of-week"`` as croniter reads
            it (ranges, steps, lists, month/day names, ``L``, ``#``), or one of
            the macros ``@yearly @annually @monthly @weekly @daily @midnight
            @hourly``. Seconds/year columns (6-7 fields), ``@reboot`` and
            croniter's hashed/random ``H``/``R`` fields are rejected.

    Returns:
        str: the expression with whitespace collapsed to single spaces,
        lower-cased, macros expanded (``"@daily"`` -> ``"0 0 * * *"``).

    Raises:
        ScheduleError: ``"cron='...': <why>"`` for a wrong field count, an
            out-of-range or malformed field, or a cron that never fires
            (``"0 0 30 2 *"``).
    """
    return _parse_cron(cron)[0]


def _zone(tz: str) -> ZoneInfo:
    if not isinstance(tz, str):
        raise ScheduleError(f"timezone={tz!r}: need an IANA zone name such as 'Europe/London'")
    return _zone_cached(tz)


@functools.lru_cache(maxsize=256)
def _zone_cached(tz: str) -> ZoneInfo:
    if not tz.strip():
        raise ScheduleError(f"timezone={tz!r}: need an IANA zone name such as 'Europe/London'")
    if tz in ("localtime", "posixrules"):
        raise ScheduleError(f"timezone={tz!r}: machine-dependent zone; give an IANA zone name")
    try:
        return ZoneInfo(tz)
    except Exception as e:  # ZoneInfoNotFoundError (a KeyError), ValueError for malformed keys, ...
        raise ScheduleError(f"timezone={tz!r}: unknown IANA time zone ({type(e).__name__})") from None


def validate_timezone(tz: str) -> str:
    """Check an IANA time-zone name (``"America/New_York"``, ``"UTC"``) with :mod:`zoneinfo`.

    Returns:
        str: ``tz`` unchanged.

    Raises:
        ScheduleError: ``"timezone='...': ..."`` for an empty, unknown or
            malformed name, or the machine-dependent ``localtime``.
    """
    _zone(tz)
    return tz


def _epoch(name: str, t: datetime) -> float:
    """POSIX seconds of an aware datetime; :class:`ScheduleError` naming ``name`` otherwise."""
    if not isinstance(t, datetime):
        raise ScheduleError(f"{name}={t!r}: need an aware datetime")
    if t.tzinfo is None or t.utcoffset() is None:
        raise ScheduleError(f"{name}={t.isoformat()!r}: naive datetime; give an aware one (e.g. UTC)")
    return t.timestamp()


# --------------------------------------------------------------------------- wall time -> UTC
def _gap_end(wall: datetime, z: ZoneInfo) -> float:
    """POSIX seconds of the transition that skips the non-existent local time ``wall`` (first instant after the gap)."""
    a = wall.replace(tzinfo=z, fold=0).timestamp()
    b = wall.replace(tzinfo=z, fold=1).timestamp()
    lo, hi = math.floor(min(a, b)), math.ceil(max(a, b))
    off_lo = datetime.fromtimestamp(lo, z).utcoffset()
    # invariant: offset at lo is the pre-transition one, at hi it is not; transitions fall on whole seconds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, z).utcoffset() == off_lo:
            lo = mid
        else:
            hi = mid
    return float(hi)


def _instants(wall: datetime, z: ZoneInfo, every_hour: bool) -> tuple[float, ...]:
    """Fire instants (POSIX s, ascending) of the matching wall-clock time ``wall`` (naive), per the DST rules."""
    u0 = wall.replace(tzinfo=z, fold=0).timestamp()
    u1 = wall.replace(tzinfo=z, fold=1).timestamp()
    if u0 == u1:
        return (u0,)
    if datetime.fromtimestamp(u0, z).replace(tzinfo=None) != wall:
        return (_gap_end(wall, z),)  # does not exist: first instant after the gap
    # occurs twice: fold=0 is the first occurrence
    first, second = min(u0, u1), max(u0, u1)
    return (first, second) if every_hour else (first,)


def _wall(ts: float, z: ZoneInfo) -> datetime:
    return datetime.fromtimestamp(ts, z).replace(tzinfo=None)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


#: seconds between the samples of a zone's UTC offset by which :func:`_steady` finds a window without a transition
_STEADY_STEP_S = 900.0
#: the longest window :func:`_steady` vouches for (longer ones take the general search)
_STEADY_MAX_S = 86400.0


def _steady(z: ZoneInfo, lo_s: float, hi_s: float) -> bool:
    """Whether ``z`` keeps one UTC offset over ``[lo_s, hi_s]`` (POSIX s, at most :data:`_STEADY_MAX_S` long),
    sampled every :data:`_STEADY_STEP_S` (15 min) and at both ends: no tzdata zone changes its offset and back
    within 15 minutes. In such a window local wall time and UTC map one to one, so a cron's fires there are
    its wall-clock matches; the fast paths of :func:`_next_ts` and :func:`due_fires` rest on it (an
    every-minute cron otherwise walks the :data:`MAX_SHIFT` window, ~360 croniter steps, 36 ms a fire)."""
    if hi_s - lo_s > _STEADY_MAX_S:
        return False
    off = datetime.fromtimestamp(lo_s, z).utcoffset()
    t = lo_s + _STEADY_STEP_S
    while t < hi_s:
        if datetime.fromtimestamp(t, z).utcoffset() != off:
            return False
        t += _STEADY_STEP_S
    return datetime.fromtimestamp(hi_s, z).utcoffset() == off


def _next_ts(cron: str, every_hour: bool, z: ZoneInfo, after_s: float) -> float:
    """Smallest fire instant strictly after ``after_s`` (POSIX s)."""
    try:  # fast path: the first wall-clock match after wall(after), when no offset change is near it
        cand = croniter(cron, _wall(after_s, z)).get_next(datetime).replace(tzinfo=z, fold=0).timestamp()
        if cand > after_s and _steady(z, after_s - _MAX_SHIFT_S, cand + _MAX_SHIFT_S):
            return cand
    except (CroniterError, OverflowError, ValueError):
        pass  # the general search below says why
    # The first-occurrence instant of a wall time is non-decreasing in the wall time (gaps collapse to their
    # end), and a second occurrence is at most MAX_SHIFT after its first. So every wall time with a fire after
    # ``after_s`` lies after wall(after) - MAX_SHIFT, and once a wall time's first instant is past ``after_s``
    # no later wall time can fire earlier.
    it = croniter(cron, _wall(after_s, z) - MAX_SHIFT)
    best = math.inf
    try:
        while True:
            w = it.get_next(datetime)
            inst = _instants(w, z, every_hour)
            for u in inst:
                if after_s < u < best:
                    best = u
            if inst[0] > after_s:
                return best
    except (CroniterError, OverflowError, ValueError) as e:  # runs past year 9999 etc.
        raise ScheduleError(f"cron={cron!r}: no fire after {_utc(after_s).isoformat()} ({e})") from None


# --------------------------------------------------------------------------- public API
def next_fire(cron: str, tz: str, after: datetime) -> datetime:
    """First fire instant of ``cron`` (read in local time of ``tz``) strictly after ``after``.

    Args:
        cron: 5-field cron expression (see :func:`validate_cron`).
        tz: IANA time zone the cron is read in (see :func:`validate_timezone`).
        after: aware datetime, any zone.

    Returns:
        datetime: aware, UTC, ``> after``. DST rules (module docstring): a
        non-existent wall time fires at the first instant after the gap (once,
        however many wall times fall in the gap); a repeated wall time fires at
        its first occurrence only, except for crons whose hour field matches
        every hour, which also fire at the second occurrence (once per real hour).

    Raises:
        ScheduleError: invalid ``cron`` or ``tz``; ``after`` naive or not a datetime.
    """
    text, every_hour = _parse_cron(cron)
    z = _zone(tz)
    a = _epoch("after", after)
    return _utc(_next_ts(text, every_hour, z, a))


def due_fires(
    cron: str,
    tz: str,
    last_fire: datetime | None,
    created: datetime,
    now: datetime,
    max_catchup: int = 1,
) -> list[datetime]:
    """Fire instants due in ``(last_fire or created, now]``, at most the latest ``max_catchup`` of them.

    Catch-up collapse: if the broker was down and several fires were missed,
    only the latest ``max_catchup`` are returned (the default 1 runs a missed
    schedule once, at its most recent fire, not once per missed fire); the
    older ones are dropped for good. Store the last returned instant as the
    next call's ``last_fire``.

    Args:
        cron: 5-field cron expression (see :func:`validate_cron`).
        tz: IANA time zone the cron is read in.
        last_fire: aware datetime of the last fire handled, or ``None`` if the
            schedule never fired; then ``created`` bounds the interval.
        created: aware datetime the schedule was created (fires at exactly
            ``created`` are not due: the interval is open on the left).
        now: aware datetime, the current instant (a fire at exactly ``now`` is due).
        max_catchup: int >= 1.

    Returns:
        list[datetime]: aware UTC datetimes, ascending, distinct; empty if
        ``now <= last_fire or created`` or nothing fell due. Same instants as
        iterating :func:`next_fire` from the interval's start.

    Raises:
        ScheduleError: invalid ``cron``/``tz``, a naive datetime (names
            ``last_fire``, ``created`` or ``now``), or ``max_catchup < 1``.
    """
    text, every_hour = _parse_cron(cron)
    z = _zone(tz)
    if isinstance(max_catchup, bool) or not isinstance(max_catchup, int) or max_catchup < 1:
        raise ScheduleError(f"max_catchup={max_catchup!r}: need an int >= 1")
    c = _epoch("created", created)
    s = _epoch("last_fire", last_fire) if last_fire is not None else c
    n = _epoch("now", now)
    if n <= s:
        return []
    if max_catchup == 1:  # fast path: the latest wall-clock match at or before wall(now), no offset change near it
        try:
            last = croniter(text, _wall(n, z) + timedelta(microseconds=1)).get_prev(datetime)
            cand = last.replace(tzinfo=z, fold=0).timestamp()
            if cand <= n and _steady(z, min(cand, s) - _MAX_SHIFT_S, n + _MAX_SHIFT_S):
                return [_utc(cand)] if cand > s else []
        except (CroniterError, OverflowError, ValueError):
            pass  # the general walk below
    # Walk wall times backwards from wall(now) + MAX_SHIFT (every wall time firing at or before ``now`` lies
    # below it). A wall time's first instant bounds all of its own and every earlier wall time's instants
    # from above by first + MAX_SHIFT, so stop once that falls to the k-th latest fire found (or to ``s``).
    it = croniter(text, _wall(n, z) + MAX_SHIFT)
    seen: set[float] = set()
    latest: list[float] = []  # min-heap of the max_catchup latest fires found so far
    try:
        while True:
            w = it.get_prev(datetime)
            inst = _instants(w, z, every_hour)
            for u in inst:
                if s < u <= n and u not in seen:
                    seen.add(u)
                    if len(latest) < max_catchup:
                        heapq.heappush(latest, u)
                    elif u > latest[0]:
                        heapq.heapreplace(latest, u)
            floor = max(s, latest[0]) if len(latest) == max_catchup else s
            if inst[0] + _MAX_SHIFT_S <= floor:
                break
    except (CroniterError, OverflowError, ValueError):
        pass  # ran past year 1 or croniter's search range: nothing earlier fires
    return [_utc(u) for u in sorted(latest)]
