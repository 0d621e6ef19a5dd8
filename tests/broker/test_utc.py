"""broker.utc: the UTC text formats, worked out by hand, and parse_utc's round trip."""

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.utc import NaiveTimeError, iso_minutes, iso_seconds, iso_z, iso_z_exact, parse_utc

UTC = timezone.utc
T = 1796353200  # 2026-12-04T03:00:00Z: 20791 days (1970-01-01 .. 2026-12-04) x 86400 + 3 x 3600


def test_epoch_zero():
    assert iso_z(0) == "1970-01-01T00:00:00Z"
    assert iso_z_exact(0) == "1970-01-01T00:00:00Z"
    assert iso_seconds(0) == "1970-01-01T00:00:00+00:00"
    assert iso_minutes(0) == "1970-01-01T00:00+00:00"
    assert iso_z(0.0) == "1970-01-01T00:00:00Z"
    assert iso_z(-1) == "1969-12-31T23:59:59Z"


def test_epoch_seconds_and_the_same_instant_as_a_datetime():
    assert iso_z(T) == "2026-12-04T03:00:00Z"
    assert iso_seconds(T + 59) == "2026-12-04T03:00:59+00:00"
    assert iso_minutes(T + 59) == "2026-12-04T03:00+00:00"
    dt = datetime(2026, 12, 4, 3, 0, tzinfo=UTC)
    assert (iso_z(dt), iso_z_exact(dt), iso_seconds(dt), iso_minutes(dt)) == (
        "2026-12-04T03:00:00Z", "2026-12-04T03:00:00Z", "2026-12-04T03:00:00+00:00", "2026-12-04T03:00+00:00")


def test_a_non_utc_offset_is_converted():
    plus_2_30 = timezone(timedelta(hours=2, minutes=30))
    dt = datetime(2026, 12, 4, 5, 30, 15, tzinfo=plus_2_30)  # 05:30:15 at +02:30 = 03:00:15 UTC
    assert iso_z(dt) == "2026-12-04T03:00:15Z"
    assert iso_seconds(dt) == "2026-12-04T03:00:15+00:00"
    assert iso_minutes(dt) == "2026-12-04T03:00+00:00"
    # across midnight and the day before: 01:00 at +05:00 is 20:00 UTC on the 3rd
    assert iso_z(datetime(2026, 12, 4, 1, 0, tzinfo=timezone(timedelta(hours=5)))) == "2026-12-03T20:00:00Z"
    assert iso_z(datetime(2026, 12, 3, 22, 0, tzinfo=timezone(timedelta(hours=-5)))) == "2026-12-04T03:00:00Z"


def test_microseconds_are_dropped_not_rounded_except_by_iso_z_exact():
    dt = datetime(2026, 12, 4, 3, 0, 59, 999999, tzinfo=UTC)
    assert iso_z(dt) == "2026-12-04T03:00:59Z"
    assert iso_seconds(dt) == "2026-12-04T03:00:59+00:00"
    assert iso_minutes(dt) == "2026-12-04T03:00+00:00"
    assert iso_z_exact(dt) == "2026-12-04T03:00:59.999999Z"
    assert iso_z(T + 0.75) == "2026-12-04T03:00:00Z"
    assert iso_z_exact(T + 0.75) == "2026-12-04T03:00:00.750000Z"


def test_a_naive_datetime_is_refused():
    with pytest.raises(NaiveTimeError, match=r"'2026-12-04T03:00:00' has no time zone"):
        iso_z(datetime(2026, 12, 4, 3, 0))
    for f in (iso_z_exact, iso_seconds, iso_minutes):
        with pytest.raises(ValueError):
            f(datetime(2026, 12, 4, 3, 0))


def test_parse_utc():
    assert parse_utc("2026-12-04T03:00:00Z", "--from") == datetime(2026, 12, 4, 3, 0, tzinfo=UTC)
    got = parse_utc("2026-12-04T05:30:15+02:30", "--from")
    assert got == datetime(2026, 12, 4, 3, 0, 15, tzinfo=UTC) and got.tzinfo is UTC
    assert parse_utc("2026-12-04", "--from", naive="utc") == datetime(2026, 12, 4, tzinfo=UTC)
    assert parse_utc("2026-12-04T03:00", "--from", naive="utc").tzinfo is UTC


def test_parse_utc_errors_name_the_field_and_the_text():
    with pytest.raises(NaiveTimeError, match=r"^--from='2026-12-04': no time zone"):
        parse_utc("2026-12-04", "--from")
    with pytest.raises(ValueError, match=r"^--to='yesterday': not an ISO 8601 date/time"):
        parse_utc("yesterday", "--to")
    with pytest.raises(ValueError, match=r"^--to=' 2026-12-04Z': not an ISO 8601"):  # not stripped
        parse_utc(" 2026-12-04Z", "--to")
    with pytest.raises(OverflowError):  # UTC cannot hold year 1 at +01:00
        parse_utc("0001-01-01T00:00:00+01:00", "--from")
    with pytest.raises(ValueError, match="naive='local'"):
        parse_utc("2026-12-04", "--from", naive="local")


offsets = st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: timezone(timedelta(minutes=m)))
instants = st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31), timezones=offsets)


@given(instants)
def test_round_trip(t):
    assert parse_utc(iso_z_exact(t), "t") == t
    whole = t.replace(microsecond=0)  # the offsets are whole minutes: dropping in UTC = dropping here
    assert parse_utc(iso_z(t), "t") == whole
    assert parse_utc(iso_seconds(t), "t") == whole
    assert parse_utc(iso_minutes(t), "t") == whole.replace(second=0)
    assert parse_utc(iso_z(t), "t").tzinfo is UTC


@given(st.floats(min_value=0.0, max_value=253402300799.0))  # 1970 .. the last second of 9999
def test_the_same_bytes_as_the_expressions_it_replaced(t):
    dt = datetime.fromtimestamp(t, tz=UTC)
    assert iso_z(t) == dt.strftime("%Y-%m-%dT%H:%M:%SZ")  # planner/windows.py, sim/synth.py
    assert iso_z(dt) == dt.isoformat(timespec="seconds").replace("+00:00", "Z")  # cli/console.py utc_text
    assert iso_z_exact(dt) == dt.isoformat().replace("+00:00", "Z")  # service/api_finance.py
    assert iso_seconds(t) == dt.isoformat(timespec="seconds")  # service/signal_cache.py, sim/report.py
    assert iso_minutes(t) == dt.isoformat(timespec="minutes")  # cli/main.py, service/live.py
