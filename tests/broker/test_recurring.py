"""Recurring schedules: cron read in local wall-clock time, DST gaps and folds, catch-up collapse."""

from __future__ import annotations

import functools
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.recurring import ScheduleError, due_fires, next_fire, validate_cron, validate_timezone

UTC = timezone.utc
NY = "America/New_York"


def z(*args) -> datetime:
    """Aware UTC datetime."""
    return datetime(*args, tzinfo=UTC)


def fires(cron: str, tz: str, after: datetime, n: int) -> list[datetime]:
    out = []
    for _ in range(n):
        after = next_fire(cron, tz, after)
        out.append(after)
    return out


# ----------------------------------------------------------------------------- validation
def test_validate_cron_normalises():
    assert validate_cron("  30   2 * *  * ") == "30 2 * * *"
    assert validate_cron("0 9 * * MON-FRI") == "0 9 * * mon-fri"
    assert validate_cron("@daily") == "0 0 * * *"
    assert validate_cron("@hourly") == "0 * * * *"
    assert validate_cron("*/15 * * * *") == "*/15 * * * *"


@pytest.mark.parametrize(
    "cron",
    ["61 * * * *", "* * *", "", "   ", "0 24 * * *", "* * * * * *", "0 0 30 2 *", "@reboot", "H * * * *", "R 1 * * *", "x y z a b"],
)
def test_invalid_cron(cron):
    with pytest.raises(ScheduleError) as e:
        validate_cron(cron)
    assert str(e.value).startswith(f"cron={cron!r}: ")
    assert isinstance(e.value, ValueError)


def test_invalid_cron_type():
    with pytest.raises(ScheduleError, match=r"cron=None"):
        validate_cron(None)  # type: ignore[arg-type]


def test_validate_timezone():
    assert validate_timezone("Europe/London") == "Europe/London"
    assert validate_timezone("UTC") == "UTC"
    for bad in ["Mars/Base", "", "../etc/passwd", "localtime"]:
        with pytest.raises(ScheduleError) as e:
            validate_timezone(bad)
        assert str(e.value).startswith(f"timezone={bad!r}: ")


def test_next_fire_rejects_bad_input():
    with pytest.raises(ScheduleError, match=r"^after='2026-03-01T00:00:00': naive"):
        next_fire("0 * * * *", NY, datetime(2026, 3, 1))
    with pytest.raises(ScheduleError, match=r"^timezone='Mars/Base'"):
        next_fire("0 * * * *", "Mars/Base", z(2026, 3, 1))
    with pytest.raises(ScheduleError, match=r"^cron='61 \* \* \* \*'"):
        next_fire("61 * * * *", NY, z(2026, 3, 1))
    with pytest.raises(ScheduleError, match=r"^after=1\.0"):
        next_fire("0 * * * *", NY, 1.0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- New York DST
def test_daily_0230_across_spring_forward_new_york():
    # 2026-03-08 02:00 EST -> 03:00 EDT: 02:30 does not exist and fires at 03:00 EDT = 07:00Z
    got = fires("30 2 * * *", NY, z(2026, 3, 6, 12), 4)
    assert got == [z(2026, 3, 7, 7, 30), z(2026, 3, 8, 7, 0), z(2026, 3, 9, 6, 30), z(2026, 3, 10, 6, 30)]
    assert all(t.tzinfo is UTC for t in got)


def test_daily_0130_across_fall_back_new_york_fires_once():
    # 2026-11-01 01:30 happens at 05:30Z (EDT) and 06:30Z (EST): fires once, at the first
    got = fires("30 1 * * *", NY, z(2026, 10, 30, 12), 4)
    assert got == [z(2026, 10, 31, 5, 30), z(2026, 11, 1, 5, 30), z(2026, 11, 2, 6, 30), z(2026, 11, 3, 6, 30)]
    # asking from between the two occurrences gives the next day, not the second occurrence
    assert next_fire("30 1 * * *", NY, z(2026, 11, 1, 5, 30)) == z(2026, 11, 2, 6, 30)
    assert next_fire("30 1 * * *", NY, z(2026, 11, 1, 6, 0)) == z(2026, 11, 2, 6, 30)


def test_hourly_across_fall_back_fires_once_per_real_hour():
    # 00:00 EDT, 01:00 EDT, 01:00 EST, 02:00 EST, 03:00 EST
    got = fires("0 * * * *", NY, z(2026, 11, 1, 3, 30), 5)
    assert got == [z(2026, 11, 1, h) for h in (4, 5, 6, 7, 8)]


def test_hourly_across_spring_forward_no_duplicate_instant():
    # 01:00 EST = 06:00Z; 02:00 does not exist -> 03:00 EDT = 07:00Z, the same instant as 03:00 itself: once
    got = fires("0 * * * *", NY, z(2026, 3, 8, 5, 30), 4)
    assert got == [z(2026, 3, 8, h) for h in (6, 7, 8, 9)]


def test_fixed_hour_range_across_fall_back_first_occurrence_only():
    # hour field 1-3 is not "every hour": 01:00 fires only as EDT
    got = fires("0 1-3 * * *", NY, z(2026, 11, 1, 0), 3)
    assert got == [z(2026, 11, 1, 5), z(2026, 11, 1, 7), z(2026, 11, 1, 8)]


def test_every_15_minutes_across_spring_forward():
    # 01:45 EST = 06:45Z; 02:00..02:45 and 03:00 all map to 03:00 EDT = 07:00Z (once); then 03:15 EDT
    got = fires("*/15 * * * *", NY, z(2026, 3, 8, 6, 30), 4)
    assert got == [z(2026, 3, 8, 6, 45), z(2026, 3, 8, 7, 0), z(2026, 3, 8, 7, 15), z(2026, 3, 8, 7, 30)]


def test_every_15_minutes_across_fall_back_keeps_real_time_spacing():
    got = fires("*/15 * * * *", NY, z(2026, 11, 1, 5, 30), 12)
    start = z(2026, 11, 1, 5, 45)
    assert got == [start + timedelta(minutes=15 * i) for i in range(12)]


def test_every_15_minutes_fixed_hour_across_fall_back():
    # "*/15 1 * * *": 01:00..01:45 fire once each, as EDT (05:00Z..05:45Z), then the next day as EST
    got = fires("*/15 1 * * *", NY, z(2026, 11, 1, 4), 5)
    assert got == [z(2026, 11, 1, 5, 0), z(2026, 11, 1, 5, 15), z(2026, 11, 1, 5, 30), z(2026, 11, 1, 5, 45),
                   z(2026, 11, 2, 6, 0)]


def test_after_in_any_zone_and_strictly_after():
    after = datetime(2026, 3, 7, 2, 30, tzinfo=ZoneInfo(NY))  # exactly a fire (07:30Z)
    assert next_fire("30 2 * * *", NY, after) == z(2026, 3, 8, 7, 0)
    tokyo = datetime(2026, 3, 7, 16, 29, 59, tzinfo=ZoneInfo("Asia/Tokyo"))  # 07:29:59Z
    assert next_fire("30 2 * * *", NY, tokyo) == z(2026, 3, 7, 7, 30)


# ----------------------------------------------------------------------------- London and UTC
def test_london_spring_forward_and_fall_back():
    # 2026-03-29 01:00 GMT -> 02:00 BST: 01:30 does not exist, fires at 02:00 BST = 01:00Z
    assert fires("30 1 * * *", "Europe/London", z(2026, 3, 28, 12), 3) == [
        z(2026, 3, 29, 1, 0), z(2026, 3, 30, 0, 30), z(2026, 3, 31, 0, 30)]
    # 2026-10-25 02:00 BST -> 01:00 GMT: 01:30 fires once, as BST (00:30Z)
    assert fires("30 1 * * *", "Europe/London", z(2026, 10, 24, 12), 3) == [
        z(2026, 10, 25, 0, 30), z(2026, 10, 26, 1, 30), z(2026, 10, 27, 1, 30)]
    # 01:00 itself is the gap's start (does not exist): fires at 01:00Z, same as 02:00 BST
    assert fires("0 1 * * *", "Europe/London", z(2026, 3, 28, 12), 2) == [z(2026, 3, 29, 1), z(2026, 3, 30, 0)]


def test_utc_zone_is_plain_cron():
    assert fires("0 9 * * mon", "UTC", z(2026, 3, 4), 2) == [z(2026, 3, 9, 9), z(2026, 3, 16, 9)]
    assert fires("*/15 * * * *", "UTC", z(2026, 3, 8, 6, 50), 3) == [z(2026, 3, 8, 7), z(2026, 3, 8, 7, 15),
                                                                      z(2026, 3, 8, 7, 30)]
    assert next_fire("0 0 29 2 *", "UTC", z(2026, 1, 1)) == z(2028, 2, 29)


# ----------------------------------------------------------------------------- due_fires
def test_due_fires_collapses_missed_fires():
    created = z(2026, 3, 1, 0, 0)
    now = z(2026, 3, 1, 5, 20)  # fires at 00:15 .. 05:15 were missed (21 of them)
    assert due_fires("*/15 * * * *", "UTC", None, created, now) == [z(2026, 3, 1, 5, 15)]
    assert due_fires("*/15 * * * *", "UTC", None, created, now, max_catchup=3) == [
        z(2026, 3, 1, 4, 45), z(2026, 3, 1, 5, 0), z(2026, 3, 1, 5, 15)]
    # all of them when max_catchup is large; created itself is excluded (open interval)
    allf = due_fires("*/15 * * * *", "UTC", None, created, now, max_catchup=1000)
    assert len(allf) == 21 and allf[0] == z(2026, 3, 1, 0, 15) and allf[-1] == z(2026, 3, 1, 5, 15)


def test_due_fires_interval_bounds():
    created = z(2026, 3, 1)
    # last_fire takes over from created; now is inclusive
    assert due_fires("0 * * * *", "UTC", z(2026, 3, 1, 4), created, z(2026, 3, 1, 5), 5) == [z(2026, 3, 1, 5)]
    assert due_fires("0 * * * *", "UTC", z(2026, 3, 1, 5), created, z(2026, 3, 1, 5, 59), 5) == []
    assert due_fires("0 * * * *", "UTC", None, created, created) == []
    assert due_fires("0 * * * *", "UTC", None, created, z(2026, 2, 1)) == []  # now before created


def test_due_fires_matches_next_fire_across_dst():
    created = z(2026, 10, 31, 12)
    now = z(2026, 11, 1, 9)
    want, t = [], created
    while (t := next_fire("0 * * * *", NY, t)) <= now:
        want.append(t)
    got = due_fires("0 * * * *", NY, None, created, now, max_catchup=100)
    # one fire per real hour 13:00Z .. 09:00Z (the repeated 01:00 fires as EDT and as EST)
    assert got == want == [z(2026, 10, 31, 13) + timedelta(hours=i) for i in range(21)]
    assert due_fires("0 * * * *", NY, None, created, now, max_catchup=4) == [z(2026, 11, 1, h) for h in (6, 7, 8, 9)]


def test_due_fires_sparse_cron_long_outage():
    # daily 02:30 New York, broker down for a month: the single latest fire
    got = due_fires("30 2 * * *", NY, z(2026, 2, 20, 7, 30), z(2026, 1, 1), z(2026, 3, 20, 12))
    assert got == [z(2026, 3, 20, 6, 30)]
    got = due_fires("30 2 * * *", NY, z(2026, 3, 6, 7, 30), z(2026, 1, 1), z(2026, 3, 9, 6, 30), max_catchup=5)
    assert got == [z(2026, 3, 7, 7, 30), z(2026, 3, 8, 7, 0), z(2026, 3, 9, 6, 30)]


def test_due_fires_errors():
    with pytest.raises(ScheduleError, match=r"^max_catchup=0"):
        due_fires("0 * * * *", "UTC", None, z(2026, 1, 1), z(2026, 1, 2), max_catchup=0)
    with pytest.raises(ScheduleError, match=r"^now='2026-01-02T00:00:00': naive"):
        due_fires("0 * * * *", "UTC", None, z(2026, 1, 1), datetime(2026, 1, 2))
    with pytest.raises(ScheduleError, match=r"^created="):
        due_fires("0 * * * *", "UTC", None, datetime(2026, 1, 1), z(2026, 1, 2))
    with pytest.raises(ScheduleError, match=r"^last_fire="):
        due_fires("0 * * * *", "UTC", datetime(2026, 1, 1), z(2026, 1, 1), z(2026, 1, 2))


# ----------------------------------------------------------------------------- brute-force oracle
@functools.lru_cache(maxsize=None)
def _transitions_2026(tz: str) -> list[int]:
    """UTC instants (POSIX s) in 2026 where the zone's offset changes, found by a minute-level scan."""
    zi = ZoneInfo(tz)
    t, end, out = int(z(2026, 1, 1).timestamp()), int(z(2027, 1, 1).timestamp()), []
    off = datetime.fromtimestamp(t, zi).utcoffset()
    while t < end:
        t += 3600
        o = datetime.fromtimestamp(t, zi).utcoffset()
        if o != off:
            lo = t - 3600
            while datetime.fromtimestamp(lo + 60, zi).utcoffset() == off:
                lo += 60
            out.append(lo + 60)
            off = o
    return out


def _oracle(cron: str, tz: str, start: int, end: int) -> list[datetime]:
    """Fires in (start, end] by the documented rules, checked minute by minute in UTC (independent of next_fire).

    Only for crons "M H * * *": croniter just expands the minute and hour fields to sets.
    """
    from croniter import croniter

    mins, hrs = croniter(cron).expanded[:2]
    mins = set(range(60)) if mins == ["*"] else set(mins)
    hrs = set(range(24)) if hrs == ["*"] else set(hrs)
    every_hour = len(hrs) == 24

    def match(w: datetime) -> bool:
        return w.minute in mins and w.hour in hrs

    zi = ZoneInfo(tz)
    out = []
    for u in range(start - start % 60 + 60, end + 1, 60):
        loc = datetime.fromtimestamp(u, zi)
        wall = loc.replace(tzinfo=None)
        fire = match(wall) and (loc.fold == 0 or every_hour)
        jump = loc.utcoffset() - datetime.fromtimestamp(u - 60, zi).utcoffset()
        if jump > timedelta(0):  # u ends a gap: the skipped wall times [wall - jump, wall) fire here
            n = int(jump.total_seconds() // 60)
            fire = fire or any(match(wall - timedelta(minutes=m + 1)) for m in range(n))
        if fire:
            out.append(datetime.fromtimestamp(u, UTC))
    return out


@pytest.mark.parametrize("tz", [NY, "Europe/London", "Australia/Lord_Howe", "America/Santiago"])
@pytest.mark.parametrize("cron", ["0 * * * *", "*/15 * * * *", "30 1 * * *", "0 0 * * *", "45 2 * * *", "*/20 1-3 * * *"])
def test_next_fire_matches_minute_oracle_around_every_2026_transition(tz, cron):
    for tr in _transitions_2026(tz):
        start, end = tr - 2 * 86400, tr + 2 * 86400
        want = _oracle(cron, tz, start, end)
        got, t = [], datetime.fromtimestamp(start, UTC)
        while (t := next_fire(cron, tz, t)) <= datetime.fromtimestamp(end, UTC):
            got.append(t)
        assert got == want, (tz, cron, datetime.fromtimestamp(tr, UTC))
        assert due_fires(cron, tz, None, datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC),
                         max_catchup=10_000) == want


# ----------------------------------------------------------------------------- property
MINUTES = st.sampled_from(["0", "30", "59", "*/15", "*/7", "5,35", "0-10/5", "*"])
HOURS = st.sampled_from(["*", "0", "1", "2", "3", "1-3", "*/2", "*/6", "0,12", "1,2,23"])
ZONES = [NY, "Europe/London", "Australia/Lord_Howe", "America/Santiago", "UTC"]
T2026 = (int(z(2026, 1, 1).timestamp()), int(z(2027, 1, 1).timestamp()))


@st.composite
def zone_and_instant(draw):
    """A zone and an instant over 2026: uniform, or within 3 days before / 1 day after one of its DST changes."""
    tz = draw(st.sampled_from(ZONES))
    trans = _transitions_2026(tz)
    if trans and draw(st.booleans()):
        return tz, draw(st.sampled_from(trans)) + draw(st.integers(-3 * 86400, 86400))
    return tz, draw(st.integers(*T2026))


@settings(max_examples=80, deadline=None)
@given(minute=MINUTES, hour=HOURS, zt=zone_and_instant())
def test_property_next_fire_strictly_increasing(minute, hour, zt):
    tz, t0 = zt
    cron = f"{minute} {hour} * * *"
    after = datetime.fromtimestamp(t0, UTC)
    daily = hour in ("0", "1", "2", "3") and minute in ("0", "30", "59")
    prev = after
    dates = []
    for _ in range(50):
        nxt = next_fire(cron, tz, prev)
        assert nxt.tzinfo is UTC
        assert nxt > prev
        dates.append(nxt.astimezone(ZoneInfo(tz)).date())
        prev = nxt
    if daily:
        # a daily cron fires exactly once on each local date, never skipping one
        assert all((b - a).days == 1 for a, b in zip(dates, dates[1:]))


@pytest.mark.parametrize("cron", ["5-1 * * * *", "* 23-2 * * *", "0 0 * * 5-1/2"])
def test_a_backwards_range_is_rejected(cron):
    """Standard cron rejects "5-1"; croniter would wrap it around (found by a fresh user)."""
    with pytest.raises(ScheduleError, match="runs backwards"):
        validate_cron(cron)


# ----------------------------------------------------------------------------- the steady-offset fast path
@pytest.mark.parametrize("tz", ["UTC", "America/New_York", "Europe/London", "Australia/Lord_Howe", "Antarctica/Troll"])
def test_fast_path_gives_the_general_walks_fires_around_2026_transitions(tz, monkeypatch):
    """Away from an offset change a fire is the cron's wall-clock match (one croniter step instead of the
    ~360 of the MAX_SHIFT walk: an every-minute schedule took 36 ms a fire); near one, the general walk.
    Both give the same instants every 7 minutes across +-7 h of each 2026 transition of ``tz``."""
    import broker.recurring as rec

    z = ZoneInfo(tz)
    starts = [datetime(2026, 1, 1, tzinfo=timezone.utc)]
    t = starts[0]
    while t.year == 2026:  # the 2026 transitions of tz, to the minute
        nxt = t + timedelta(hours=6)
        if t.astimezone(z).utcoffset() != nxt.astimezone(z).utcoffset():
            lo, hi = t, nxt
            while hi - lo > timedelta(minutes=1):
                mid = lo + (hi - lo) / 2
                lo, hi = (mid, hi) if mid.astimezone(z).utcoffset() == lo.astimezone(z).utcoffset() else (lo, mid)
            starts.append(hi)
        t = nxt
    crons = ["* * * * *", "*/15 * * * *", "30 2 * * *", "0 * * * *", "5 1-3 * * *"]
    fast = {}
    for c in starts:
        for k in range(-60, 61):
            base = c + timedelta(minutes=7 * k)
            for cron in crons:
                fast[(base, cron)] = (next_fire(cron, tz, base),
                                      due_fires(cron, tz, base - timedelta(minutes=61), base - timedelta(days=9), base))
    monkeypatch.setattr(rec, "_steady", lambda *a: False)
    slow = {(base, cron): (next_fire(cron, tz, base),
                           due_fires(cron, tz, base - timedelta(minutes=61), base - timedelta(days=9), base))
            for base, cron in fast}
    assert fast == slow and len(fast) == len(starts) * 121 * len(crons)
