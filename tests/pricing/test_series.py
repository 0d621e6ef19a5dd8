"""HourlySeries: window integrals (fractional, negative, missing, DST) and input errors."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pricing.series import HourlySeries, SeriesError, to_epoch_s

UTC = timezone.utc
T0 = datetime(2023, 1, 1, tzinfo=UTC)
H = 3600.0


def hours(h: float) -> datetime:
    return T0 + timedelta(hours=h)


def series(values, start=T0) -> HourlySeries:
    return HourlySeries(zone="Z", unit="USD/MWh", start_s=start.timestamp(), values=np.asarray(values, float))


def test_integral_fractional_hours():
    s = series([10, 20, 30, 40])
    # [00:30, 02:15]: 0.5 h x 10 + 1 h x 20 + 0.25 h x 30 = 5 + 20 + 7.5
    assert s.integral(hours(0.5), hours(2.25)) == pytest.approx(32.5)
    assert s.mean(hours(0.5), hours(2.25)) == pytest.approx(32.5 / 1.75)
    assert s.integral(hours(0), hours(4)) == pytest.approx(100.0)


def test_integral_negative_prices():
    s = series([-10, 5, -20])
    # [00:15, 02:30]: 0.75 x -10 + 1 x 5 + 0.5 x -20 = -7.5 + 5 - 10
    assert s.integral(hours(0.25), hours(2.5)) == pytest.approx(-12.5)
    assert s.mean(hours(0.25), hours(2.5)) == pytest.approx(-12.5 / 2.25)


def test_missing_hour_is_nan_never_zero():
    s = HourlySeries.from_utc([hours(0), hours(2)], [1.0, 3.0], zone="Z", unit="u")
    assert s.values.size == 3 and math.isnan(s.values[1])
    assert s.missing_count() == 1
    assert s.integral(hours(0), hours(1)) == pytest.approx(1.0)  # ends exactly where the gap starts
    assert s.integral(hours(2), hours(3)) == pytest.approx(3.0)
    assert math.isnan(s.integral(hours(0), hours(1.5)))
    assert math.isnan(s.integral(hours(0.5), hours(2.5)))
    assert math.isnan(s.integral(hours(1.2), hours(1.2)))  # zero-length inside the gap
    assert math.isnan(s.value_at(hours(1.5)))
    assert math.isnan(s.integral(hours(-1), hours(0.5)))  # leaves the series


def test_spring_forward_day_has_23_hours_los_angeles():
    # local hours of 2023-03-12 in America/Los_Angeles: 02:00 does not exist
    local = [datetime(2023, 3, 12, h) for h in range(24) if h != 2]
    vals = [float(h) for h in range(24) if h != 2]
    s = HourlySeries.from_local(local, vals, tz="America/Los_Angeles", zone="US-CAL-CISO", unit="USD/MWh")
    assert s.values.size == 23 and s.missing_count() == 0
    assert s.start_s == datetime(2023, 3, 12, 8, tzinfo=UTC).timestamp()  # 00:00 PST = 08:00Z
    assert s.value_at(datetime(2023, 3, 12, 10, tzinfo=UTC)) == 3.0  # 03:00 PDT = 10:00Z
    # whole local day = 23 h; sum(0..23) - 2 = 274
    assert s.integral(s.start_s, s.end_s) == pytest.approx(274.0)
    assert s.end_s - s.start_s == 23 * H


def test_fall_back_day_has_25_hours_los_angeles():
    # 2023-11-05: 01:00 happens twice (PDT then PST)
    local = [datetime(2023, 11, 5, 0), datetime(2023, 11, 5, 1), datetime(2023, 11, 5, 1)]
    local += [datetime(2023, 11, 5, h) for h in range(2, 24)]
    vals = [float(i) for i in range(25)]
    s = HourlySeries.from_local(local, vals, tz="America/Los_Angeles", zone="Z", unit="u")
    assert s.values.size == 25 and s.missing_count() == 0
    assert s.start_s == datetime(2023, 11, 5, 7, tzinfo=UTC).timestamp()  # 00:00 PDT
    assert s.value_at(datetime(2023, 11, 5, 8, tzinfo=UTC)) == 1.0  # 01:00 PDT
    assert s.value_at(datetime(2023, 11, 5, 9, tzinfo=UTC)) == 2.0  # 01:00 PST
    assert s.integral(s.start_s, s.end_s) == pytest.approx(300.0)  # sum(0..24)
    # 01:30 PDT (08:30Z) -> 01:30 PST (09:30Z): 0.5 x 1 + 0.5 x 2
    assert s.integral(datetime(2023, 11, 5, 8, 30, tzinfo=UTC), datetime(2023, 11, 5, 9, 30, tzinfo=UTC)) == pytest.approx(1.5)


def test_from_local_nonexistent_hour_collides_and_is_averaged():
    # EU market files label the non-existent 02:00 of 2023-03-26 (Paris); it maps onto 03:00 CEST
    local = [datetime(2023, 3, 26, h) for h in range(4)]
    s = HourlySeries.from_local(local, [1.0, 2.0, 3.0, 5.0], tz="Europe/Paris", zone="DE-LU", unit="EUR/MWh")
    assert s.start_s == datetime(2023, 3, 25, 23, tzinfo=UTC).timestamp()
    np.testing.assert_allclose(s.values, [1.0, 2.0, 4.0])


def test_from_utc_duplicates_are_averaged_and_order_free():
    s = HourlySeries.from_utc([hours(1), hours(0), hours(1)], [4.0, 1.0, 6.0], zone="Z", unit="u")
    np.testing.assert_allclose(s.values, [1.0, 5.0])


def test_from_utc_accepts_datetime64_as_utc():
    t = np.array(["2023-01-01T00", "2023-01-01T01"], dtype="datetime64[h]")
    s = HourlySeries.from_utc(t, [1.0, 2.0], zone="Z", unit="u")
    assert s.start_s == T0.timestamp()


def test_vectorised_integrals_and_nan_inputs():
    s = series([1.0, 2.0, 3.0])
    t0 = T0.timestamp()
    out = s.integrals(np.array([t0, t0 + H, np.nan, t0 + 2.5 * H]), np.array([2 * H, 0.5 * H, H, H]))
    np.testing.assert_allclose(out[:2], [3.0, 1.0])
    assert math.isnan(out[2]) and math.isnan(out[3])
    assert math.isnan(s.value_at(float("nan")))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: to_epoch_s(datetime(2023, 1, 1)), ["time=", "naive"]),
        (lambda: HourlySeries.from_utc([hours(0), hours(0.5)], [1, 2], zone="Z", unit="u"), ["times:", "grid"]),
        (lambda: HourlySeries.from_utc([hours(0)], [1, 2], zone="Z", unit="u"), ["times/values", "1 vs 2"]),
        (lambda: HourlySeries.from_utc([], [], zone="Z", unit="u"), ["times", "empty"]),
        (lambda: HourlySeries.from_utc([0.0, float("nan")], [1, 2], zone="Z", unit="u"), ["times", "nan"]),
        (lambda: series([1.0, float("inf")]), ["values", "infinite"]),
        (lambda: series([]), ["values", "non-empty"]),
        (lambda: HourlySeries("Z", "u", 0.0, np.ones(2), interval_s=0), ["interval_s=0"]),
        (lambda: series([1.0]).integral(hours(1), hours(0)), ["end=", "before start"]),
        (lambda: series([1.0]).integrals([T0.timestamp()], -5.0), ["duration_s", "-5"]),
        (lambda: HourlySeries.from_local([datetime(2023, 1, 1, tzinfo=UTC)], [1], tz="UTC", zone="Z", unit="u"),
         ["local_times", "aware"]),
    ],
)
def test_bad_input_errors_name_field_and_value(call, words):
    with pytest.raises(SeriesError) as e:
        call()
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w.lower() in str(e.value).lower()


def _brute(values: np.ndarray, start_min: int, dur_min: int) -> float:
    """Sum of value x overlap over minutes-resolution windows; NaN rules of HourlySeries."""
    n = values.size
    a, b = start_min / 60.0, (start_min + dur_min) / 60.0
    if a < 0 or b > n:
        return float("nan")
    first = int(math.floor(a))
    last = max(int(math.ceil(b)), first + 1)  # zero-length window looks at its interval
    total = 0.0
    for i in range(first, min(last, n)):
        if math.isnan(values[i]):
            return float("nan")
        total += values[i] * max(0.0, min(b, i + 1) - max(a, i))
    return total


@settings(max_examples=150, deadline=None)
@given(
    vals=st.lists(st.one_of(st.floats(-500, 500, allow_nan=False), st.just(float("nan"))), min_size=1, max_size=40),
    windows=st.lists(st.tuples(st.integers(-120, 45 * 60), st.integers(0, 20 * 60)), min_size=1, max_size=20),
)
def test_integrals_match_brute_force(vals, windows):
    v = np.asarray(vals, float)
    s = HourlySeries("Z", "u", 1_700_000_000.0, v)
    starts = np.array([s.start_s + w[0] * 60.0 for w in windows])
    durs = np.array([w[1] * 60.0 for w in windows])
    got = s.integrals(starts, durs)
    want = np.array([_brute(v, a, d) for a, d in windows])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-9, atol=1e-6)
