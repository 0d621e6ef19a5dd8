"""Data hygiene: completeness, sub-hourly averaging after sign handling, short-gap interpolation, fallbacks."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pricing.hygiene import (CONSERVATIVE, DEFAULT_CONSERVATIVE_CARBON, INTERPOLATED, CheckedSeries, completeness,
                             conservative_value, fill_gaps, hour_grid, interpolate_short_gaps, to_hourly)
from pricing.series import HourlySeries, SeriesError

T0 = datetime(2024, 3, 31, 0, tzinfo=timezone.utc).timestamp()
H = 3600.0


def _checked(vals, source="feed", start=T0):
    return CheckedSeries.of(HourlySeries("Z", "u", start, np.array(vals, dtype=float)), source)


def test_quarter_hours_average_after_sign_handling_negative_prices_kept():
    # four 15-min prices of one hour: the mean keeps the negative quarters (clamping to 0 first would give 8.75)
    t = [T0, T0 + 900, T0 + 1800, T0 + 2700]
    out = to_hourly(t, [-10.0, -5.0, 5.0, 30.0], 900.0, start_s=T0, end_s=T0 + H, zone="DE-LU", unit="EUR/MWh",
                    source="entsoe")
    assert out.series.values.tolist() == [5.0]
    assert out.origin.tolist() == ["entsoe"] and out.estimated.tolist() == [False]


def test_a_partly_covered_hour_is_missing_and_completeness_counts_expected_hours():
    # hour 0: all four quarters; hour 1: three of four (one absent, so not complete); hour 2: one quarter is NaN
    t = [T0 + k * 900 for k in range(4)] + [T0 + H + k * 900 for k in range(3)] + [T0 + 2 * H + k * 900 for k in range(4)]
    v = [1, 2, 3, 4] + [10, 10, 10] + [7, float("nan"), 7, 7]
    out = to_hourly(t, v, 900.0, start_s=T0, end_s=T0 + 4 * H, zone="Z", unit="u")
    vals = out.series.values
    assert vals[0] == 2.5 and np.isnan(vals[1:]).all() and vals.size == 4
    assert completeness(out.series, T0, T0 + 4 * H) == 0.25
    assert out.origin.tolist() == ["", "", "", ""]  # no source name given; missing hours have none either


def test_an_empty_answer_is_all_missing_not_all_fine():
    out = to_hourly([], [], 3600.0, start_s=T0, end_s=T0 + 3 * H, zone="Z", unit="u")
    assert out.series.values.size == 3 and out.missing == 3
    assert completeness(out.series, T0, T0 + 3 * H) == 0.0
    assert out.counts() == {"missing": 3}


def test_half_hours_mixed_with_hours_and_estimated_flag_spreads_to_the_hour():
    t = [T0, T0 + 1800, T0 + H]
    out = to_hourly(t, [100, 200, 50], [1800, 1800, 3600], start_s=T0, end_s=T0 + 2 * H, zone="GB", unit="u",
                    estimated=[False, True, False], source="gb")
    assert out.series.values.tolist() == [150.0, 50.0]
    assert out.estimated.tolist() == [True, False]


def test_to_hourly_5_min_points_with_a_coverage_threshold():
    # hour 0: 10 of 12 points (>= 0.75): their mean, estimated; hour 1: 8 of 12 (< 0.75): missing; hour 2: whole
    t = ([T0 + k * 300 for k in range(10)] + [T0 + H + k * 300 for k in range(8)]
         + [T0 + 2 * H + k * 300 for k in range(12)])
    v = [1.0] * 5 + [-4.0] * 5 + [7.0] * 8 + [2.0] * 6 + [4.0] * 6
    out = to_hourly(t, v, 300.0, start_s=T0, end_s=T0 + 3 * H, zone="Z", unit="u", source="wt", min_coverage=0.75)
    assert out.series.values[0] == -1.5 and np.isnan(out.series.values[1]) and out.series.values[2] == 3.0
    assert out.estimated.tolist() == [True, False, False] and out.origin.tolist() == ["wt", "", "wt"]
    strict = to_hourly(t, v, 300.0, start_s=T0, end_s=T0 + 3 * H, zone="Z", unit="u")  # default: whole hours only
    assert np.isnan(strict.series.values[:2]).all() and strict.series.values[2] == 3.0
    with pytest.raises(SeriesError, match="min_coverage=0.0"):
        to_hourly(t, v, 300.0, start_s=T0, end_s=T0 + 3 * H, zone="Z", unit="u", min_coverage=0.0)


def test_to_hourly_rejects_misaligned_or_odd_intervals():
    with pytest.raises(SeriesError, match="durations_s: 600.0"):
        to_hourly([T0], [1.0], 600.0, start_s=T0, end_s=T0 + H, zone="Z", unit="u")
    with pytest.raises(SeriesError, match="not aligned inside one UTC hour"):
        to_hourly([T0 + 2700], [1.0], 1800.0, start_s=T0, end_s=T0 + H, zone="Z", unit="u")
    with pytest.raises(SeriesError, match="end_s="):
        hour_grid(T0, T0)


def test_short_gaps_are_interpolated_and_flagged_long_and_edge_gaps_stay():
    nan = float("nan")
    c = _checked([nan, 10, nan, nan, 40, nan, nan, nan, 0, nan])
    out = interpolate_short_gaps(c, max_gap_h=2)
    v = out.series.values
    assert v[1:5].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert np.isnan(v[0]) and np.isnan(v[5:8]).all() and np.isnan(v[9])  # edges and the 3-hour run stay missing
    assert out.estimated.tolist() == [False, False, True, True, False, False, False, False, False, False]
    assert out.origin[2] == out.origin[3] == INTERPOLATED and out.origin[1] == "feed" and out.origin[0] == ""


def test_long_gaps_take_the_next_source_then_a_conservative_value():
    nan = float("nan")
    primary = _checked([100, nan, nan, nan, nan, 200])
    # the fallback covers hours 1..3 only (hour 2 of it is missing too); it starts one hour later than the primary
    fb = CheckedSeries.of(HourlySeries("Z", "u", T0 + H, np.array([300.0, nan, 500.0])), "bundled")
    out = fill_gaps(primary, [fb], conservative=900.0, max_gap_h=2, kind="carbon")
    assert out.series.values.tolist() == [100.0, 300.0, 900.0, 500.0, 900.0, 200.0]
    assert out.origin.tolist() == ["feed", "bundled", CONSERVATIVE, "bundled", CONSERVATIVE, "feed"]
    assert out.estimated.tolist() == [False, True, True, True, True, False]
    assert out.counts() == {"bundled": 2, "conservative": 2, "feed": 2}


def test_a_plain_series_fallback_gets_its_name_and_units_must_match():
    nan = float("nan")
    primary = _checked([1, nan, nan, nan, 5])
    out = fill_gaps(primary, [HourlySeries("Z", "u", T0, np.array([0, 7, 8, 9, 0.0]))], fallback_names=["old"])
    assert out.series.values.tolist() == [1.0, 7.0, 8.0, 9.0, 5.0] and out.origin[2] == "old"
    with pytest.raises(SeriesError, match=r"fallbacks\[0\].unit='v'"):
        fill_gaps(primary, [HourlySeries("Z", "v", T0, np.ones(5))])


def test_carbon_is_never_filled_with_zero():
    with pytest.raises(SeriesError, match="conservative=0.0"):
        fill_gaps(_checked([1.0, float("nan")]), conservative=0.0, kind="carbon")
    zeros = HourlySeries("Z", "gCO2e/kWh", T0, np.zeros(3))
    assert conservative_value("carbon", [zeros]) == DEFAULT_CONSERVATIVE_CARBON == 820.0
    assert conservative_value("carbon", []) == 820.0
    # the 95th percentile of the known values, pooled: [50, 100, 300, 400, 500] -> 400 + 0.8 x 100 = 480
    refs = [HourlySeries("Z", "u", T0, np.array([50.0, 300.0, float("nan")])),
            HourlySeries("Z", "u", T0, np.array([500.0, 100.0, 400.0]))]
    assert conservative_value("carbon", refs) == pytest.approx(480.0, rel=1e-12)
    # prices: negative prices included ([-20, -5] -> -20 + 0.95 x 15 = -5.75), or None: no price is safe to invent
    assert conservative_value("price", [HourlySeries("Z", "u", T0, np.array([-20.0, -5.0]))]) == pytest.approx(-5.75)
    assert conservative_value("price", []) is None
    with pytest.raises(SeriesError, match="kind='water'"):
        conservative_value("water")


def test_checked_series_shapes_are_checked():
    s = HourlySeries("Z", "u", T0, np.ones(3))
    with pytest.raises(SeriesError, match=r"estimated: shape \(2,\)"):
        CheckedSeries(s, np.zeros(2, dtype=bool), np.array(["a", "b", "c"], dtype=object))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(-500, 500, allow_nan=False), st.just(float("nan"))), min_size=1, max_size=40),
       st.integers(0, 4))
def test_filled_series_has_no_gap_keeps_known_values_and_interpolates_inside_the_neighbours(vals, max_gap):
    c = _checked(vals)
    out = fill_gaps(c, conservative=999.0, max_gap_h=max_gap)
    v, src = out.series.values, np.array(vals)
    assert not np.isnan(v).any()
    known = ~np.isnan(src)
    assert np.array_equal(v[known], src[known]) and not out.estimated[known].any()
    assert out.estimated[~known].all()
    for i in np.flatnonzero(out.origin == INTERPOLATED):
        lo = max(j for j in range(i) if known[j])
        hi = min(j for j in range(i + 1, len(vals)) if known[j])
        assert hi - lo - 1 <= max_gap
        assert min(src[lo], src[hi]) - 1e-9 <= v[i] <= max(src[lo], src[hi]) + 1e-9
    assert math.isclose(float(np.sum(out.origin == CONSERVATIVE) + np.sum(out.origin == INTERPOLATED)),
                        float((~known).sum()))
