"""Forecast models (pricing/forecast.py) and their error measurement (pricing/forecast_eval.py): hand-worked values."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pricing.forecast import (CARBON_BLEND, MODELS, PRICE_BLEND, BlendParams, ForecastError, blend_params_for,
                              forecast, forecast_matrix, forecast_origin)
from pricing.forecast_eval import bucket_errors, fit_blend, year_issues, zone_errors
from pricing.series import HourlySeries

H = 3600.0
#: 2024-03-25 00:00 UTC: the series below cross the EU spring-forward day (2024-03-31, 23 local hours)
START = datetime(2024, 3, 25, tzinfo=timezone.utc).timestamp()
P = BlendParams(alpha=0.5, phi=0.5, level_h=1)


def _ramp(n=336, unit="gCO2e/kWh", start=START):
    """y[i] = i: every lag is its own index, so forecasts can be read off by hand."""
    return HourlySeries("Z", unit, start, np.arange(n, dtype=float))


# ---------------------------------------------------------------------------------------------- seasonal naive
def test_seasonal_naive_day_and_week_on_a_ramp():
    y = np.arange(336, dtype=float)
    # issued at hour 200: yesterday's hours are 176..199, last week's 32..199
    day = forecast_matrix(y, np.array([200]), 30, "naive_day")[0]
    week = forecast_matrix(y, np.array([200]), 30, "naive_week")[0]
    assert day.tolist() == [176.0 + h % 24 for h in range(30)]  # hour 24 repeats yesterday's first hour: 176
    assert day[24] == 176.0 and day[29] == 181.0
    assert week.tolist() == [32.0 + h for h in range(30)]


def test_seasonal_naive_takes_the_day_before_when_yesterdays_hour_is_missing():
    y = np.arange(336, dtype=float)
    y[176] = np.nan  # yesterday's hour 0 of the issue at 200
    y[152] = np.nan  # ... and the day before's
    day = forecast_matrix(y, np.array([200]), 25, "naive_day")[0]
    assert day[0] == 128.0 and day[24] == 128.0  # three days back
    assert day[1] == 177.0


def test_blend_formula_on_a_tiny_example():
    y = np.arange(336, dtype=float)
    # S(h) = 0.5 * (176 + h % 24) + 0.5 * (32 + h); e_1 = y[199] - (0.5 y[175] + 0.5 y[31]) = 199 - 103 = 96
    f = forecast_matrix(y, np.array([200]), 3, "blend", P)[0]
    assert f.tolist() == [104.0 + 0.5 * 96, 105.0 + 0.25 * 96, 106.0 + 0.125 * 96]  # 152, 129, 118
    # level over two hours: e_1 = 300 - 103 = 197, e_2 = 198 - (0.5 * 174 + 0.5 * 30) = 96 -> a = 146.5
    y[199] = 300.0
    f2 = forecast_matrix(y, np.array([200]), 1, "blend", BlendParams(0.5, 0.5, 2))[0]
    assert f2.tolist() == [104.0 + 0.5 * 146.5]  # 177.25


def test_blend_with_one_profile_missing_uses_the_other_and_skips_missing_departures():
    y = np.arange(336, dtype=float)
    y[32] = np.nan
    # W(0) is missing (y[32], and 32 - 168 < 0 is before the series): S(0) = D(0) = 176; e_1 = 96 as before
    f = forecast_matrix(y, np.array([200]), 1, "blend", P)[0]
    assert f.tolist() == [176.0 + 0.5 * 96]
    # e_1 missing (y[199] is NaN): no level correction, a = 0; D(23) falls back to y[175]
    y = np.arange(336, dtype=float)
    y[199] = np.nan
    f = forecast_matrix(y, np.array([200]), 24, "blend", P)[0]
    assert f[0] == 104.0 and f[23] == 0.5 * 175 + 0.5 * 55


def test_forecast_flags_the_series_and_floors_t0_to_the_hour():
    hist = _ramp()
    out = forecast(hist, START + 200 * H + 1800, 3, "blend", P)  # 30 minutes into hour 200
    assert out.forecast is True
    assert out.series.start_s == START + 200 * H and out.series.values.tolist() == [152.0, 129.0, 118.0]
    assert out.origin.tolist() == [forecast_origin("blend")] * 3 and out.estimated.all()
    assert out.series.zone == "Z" and out.series.unit == "gCO2e/kWh"


def test_forecast_uses_the_fitted_parameters_of_the_unit():
    hist = _ramp(unit="USD/MWh")
    a = forecast(hist, START + 200 * H, 5)
    b = forecast(hist, START + 200 * H, 5, "blend", PRICE_BLEND)
    assert a.series.values.tolist() == b.series.values.tolist()
    assert blend_params_for("gCO2e/kWh") is CARBON_BLEND and blend_params_for("EUR/MWh") is PRICE_BLEND


def test_utc_hours_ignore_dst_same_hour_yesterday_is_24_hours_earlier():
    # issued 2024-04-01 00:00 UTC, the day after Europe's 23-hour local day: yesterday's hour 0 is
    # 2024-03-31 00:00 UTC (index 144 of the ramp), 24 UTC hours back, whatever the local clocks did
    t0 = datetime(2024, 4, 1, tzinfo=timezone.utc)
    out = forecast(_ramp(), t0, 48, "naive_day")
    assert out.series.start_s == t0.timestamp()
    assert np.array_equal(out.series.times_s(), t0.timestamp() + np.arange(48) * H)
    assert out.series.values[0] == 144.0 and out.series.values[23] == 167.0 and out.series.values[24] == 144.0


def test_history_hours_after_t0_are_never_read_and_hours_before_t0_it_lacks_are_missing():
    hist = _ramp(n=210)
    # history ends at hour 210; issue at 220: yesterday (196..219) has 196..209 only; the rest comes a day earlier
    out = forecast(hist, START + 220 * H, 24, "naive_day").series.values
    assert out[0] == 196.0 and out[13] == 209.0 and out[14] == 210.0 - 24 and out[23] == 219.0 - 24


def test_a_missing_history_is_forecast_as_missing_never_as_zero():
    hist = HourlySeries("DE-LU", "gCO2e/kWh", START, np.full(400, np.nan))
    for m in MODELS:
        out = forecast(hist, START + 300 * H, 72, m)
        assert np.isnan(out.series.values).all(), m
        assert (out.origin == "").all() and not out.estimated.any()
    # a week of history with a missing day: those hours come from the week before or the day before, never 0
    v = 100.0 + np.arange(400) % 24
    v[276:300] = np.nan  # the whole day before the issue at 300
    hist = HourlySeries("DE-LU", "gCO2e/kWh", START, v)
    for m in MODELS:
        out = forecast(hist, START + 300 * H, 72, m).series.values
        assert np.isfinite(out).all() and out.min() >= 100.0, m


def test_issue_before_the_history_starts_is_all_missing():
    out = forecast(_ramp(), START - 10 * H, 5, "blend")
    assert np.isnan(out.series.values).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), t0=st.integers(0, 420), horizon=st.integers(1, 200),
       model=st.sampled_from(MODELS), nan_share=st.floats(0, 0.5))
def test_no_peeking_values_at_or_after_t0_never_change_the_forecast(seed, t0, horizon, model, nan_share):
    rng = np.random.default_rng(seed)
    v = rng.normal(300.0, 80.0, 400)
    v[rng.random(400) < nan_share] = np.nan
    w = v.copy()
    if t0 < 400:  # change every value at or after the issue hour (some to missing)
        w[t0:] = rng.normal(-50.0, 500.0, 400 - t0)
        w[t0:][rng.random(400 - t0) < 0.3] = np.nan
    a = forecast(HourlySeries("Z", "gCO2e/kWh", START, v), START + t0 * H, horizon, model)
    b = forecast(HourlySeries("Z", "gCO2e/kWh", START, w), START + t0 * H, horizon, model)
    assert np.array_equal(a.series.values, b.series.values, equal_nan=True)
    # the vectorised form agrees with the public one
    m = forecast_matrix(v, np.array([t0]), horizon, model, CARBON_BLEND)[0]
    assert np.array_equal(m, a.series.values, equal_nan=True)


def test_bad_arguments_name_the_field():
    with pytest.raises(ForecastError, match="model='arima'"):
        forecast(_ramp(), START + 200 * H, 5, "arima")
    with pytest.raises(ForecastError, match="horizon_h=0"):
        forecast(_ramp(), START + 200 * H, 0)
    with pytest.raises(ForecastError, match="interval_s=900"):
        forecast(HourlySeries("Z", "gCO2e/kWh", START, np.ones(10), 900.0), START, 5)
    with pytest.raises(ForecastError, match="unit='kW'"):
        forecast(HourlySeries("Z", "kW", START, np.ones(10)), START, 5)
    with pytest.raises(ForecastError, match="start_s="):
        forecast(HourlySeries("Z", "gCO2e/kWh", START + 60, np.ones(10)), START, 5)
    with pytest.raises(ForecastError, match="alpha=1.5"):
        BlendParams(1.5, 0.5, 1)
    with pytest.raises(ForecastError, match="phi=-0.1"):
        BlendParams(0.5, -0.1, 1)
    with pytest.raises(ForecastError, match="level_h=0"):
        BlendParams(0.5, 0.5, 0)
    with pytest.raises(ForecastError, match="params=None"):
        forecast_matrix(np.ones(10), np.array([5]), 3, "blend")


# ---------------------------------------------------------------------------------------------- error measurement
def test_bucket_errors_hand_worked():
    pred = np.array([[10.0, 20.0, 30.0, 40.0]])
    actual = np.array([[8.0, 25.0, 5.0, 40.0]])
    b0, b1 = bucket_errors(pred, actual, 10.0, ((0, 2), (2, 4)))
    # bucket 0: |errors| 2, 5 -> MAE 3.5; |8| < 10 is left out of MAPE: 5 / 25 = 20 %
    assert (b0.mae, b0.mape, b0.pairs, b0.mape_left_out) == (3.5, 20.0, 2, 0.5)
    # bucket 1: 25, 0 -> MAE 12.5; 5 left out: 0 / 40 = 0 %
    assert (b1.mae, b1.mape, b1.pairs, b1.mape_left_out) == (12.5, 0.0, 2, 0.5)
    pred[0, 0] = np.nan  # a missing forecast hour is no pair (never an error of 0 or of the whole value)
    b0, _ = bucket_errors(pred, actual, 10.0, ((0, 2), (2, 4)))
    assert (b0.mae, b0.mape, b0.pairs, b0.mape_left_out) == (5.0, 20.0, 1, 0.0)


def test_year_issues_keep_the_whole_horizon_in_the_year():
    s = HourlySeries("Z", "u", datetime(2023, 12, 31, tzinfo=timezone.utc).timestamp(), np.zeros(72))
    iss = year_issues(s, 2024, horizon_h=24)
    assert iss[0] == 24 and iss[-1] == 48 and iss.size == 25
    assert year_issues(s, 2024, horizon_h=24, stride_h=7).tolist() == [24, 31, 38, 45]


def test_zone_errors_of_a_daily_cycle_naive_day_is_exact():
    v = 200.0 + 50.0 * np.sin(2 * np.pi * np.arange(24 * 400) / 24)
    s = HourlySeries("Z", "gCO2e/kWh", datetime(2024, 1, 1, tzinfo=timezone.utc).timestamp(), v)
    e = zone_errors(s, "carbon", year=2024)
    assert all(b.mae < 1e-9 for b in e["naive_day"]) and all(b.mae < 1e-9 for b in e["naive_week"])
    with pytest.raises(ValueError, match="kind='wind'"):
        zone_errors(s, "wind")


def test_fit_never_does_worse_than_naive_day_which_is_in_its_grid():
    # alpha = 1, phi = 0 is naive_day exactly (0 ** (h + 1) = 0), so the best relative MAE is at most 1
    rng = np.random.default_rng(3)
    n = 24 * 200
    v = 300 + 80 * np.sin(2 * np.pi * np.arange(n) / 24) + np.cumsum(rng.normal(0, 5, n))
    s = HourlySeries("Z", "gCO2e/kWh", datetime(2023, 1, 1, tzinfo=timezone.utc).timestamp(), v)
    r = fit_blend([s], 2023, alphas=(0.5, 1.0), phis=(0.0, 0.9), levels=(1, 3))
    assert r.relative_mae <= 1.0 and r.zones == ("Z",)
    # a random walk on a daily cycle: the recent level persists, so the best fit keeps a level term
    assert r.params.phi == 0.9 and r.relative_mae < 1.0


# ---------------------------------------------------------------------------------------------- simulator views
def test_forecast_view_is_measured_before_the_issue_hour_and_forecast_after():
    from pricing.forecast import ForecastedSignals, forecast_view

    s = _ramp()
    v = forecast_view(s, START + 200 * H + 59, "naive_day")
    assert v.start_s == s.start_s and v.values.size == 336
    assert v.values[:200].tolist() == list(range(200))
    assert v.values[200:203].tolist() == [176.0, 177.0, 178.0] and v.values[335] == 176.0 + 135 % 24
    assert forecast_view(s, START + 200 * H, "perfect") is s
    assert forecast_view(s, START + 999 * H, "blend") is s  # issued after the series: all measured
    sig = ForecastedSignals(_FakeSignals(s), START + 200 * H, "naive_week")
    assert sig.carbon("Z").values[200] == 32.0 and sig.price("Z") is None
    assert sig.carbon("Z") is sig.carbon("Z")  # built once
    with pytest.raises(ForecastError, match="model='oracle'"):
        ForecastedSignals(_FakeSignals(s), START, "oracle")


class _FakeSignals:
    def __init__(self, s):
        self.s = s

    def carbon(self, zone):
        return self.s

    def price(self, zone):
        return None


def test_less_than_a_week_of_history_keeps_the_level_term_on_yesterday_alone():
    # 72 hours of history (the live cache may hold no more): no week lag anywhere, so S = D and
    # e_1 = y[71] - y[47] = 24 (the ramp rose 24 in a day); F(0) = D(0) + 0.5 * 24 = 48 + 12
    hist = HourlySeries("Z", "gCO2e/kWh", START, np.arange(72, dtype=float))
    out = forecast(hist, START + 72 * H, 2, "blend", P).series.values
    assert out.tolist() == [48.0 + 12.0, 49.0 + 6.0]
