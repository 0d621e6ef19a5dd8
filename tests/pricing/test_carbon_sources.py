"""GB Carbon Intensity API and Electricity Maps sources against recorded responses (no network)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import responses
from responses import matchers

from pricing.carbon_sources import ElectricityMaps, GbCarbonIntensity
from pricing.hygiene import completeness, fill_gaps
from pricing.sources import (BundledCarbon, RateLimited, SourceAuthError, SourceUnavailable, capabilities)
from tests.pricing.recorded import em_forecast, em_point, gb_national, gb_period, gb_regional, utc

GB = "https://api.carbonintensity.org.uk"
EM = "https://api.electricitymap.org/v3"
T0 = utc(2024, 3, 31, 0)
H = 3600.0


@pytest.fixture
def rsps():
    with responses.RequestsMock(assert_all_requests_are_fired=True) as r:
        yield r


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_capabilities_are_what_each_source_implements():
    assert capabilities(GbCarbonIntensity()) == ("latest", "history", "forecast")
    assert capabilities(ElectricityMaps(api_key="k")) == ("latest", "history", "forecast")
    assert capabilities(BundledCarbon()) == ("history",)


# ------------------------------------------------------------------------------------------------ GB national
def test_gb_history_averages_half_hours_and_a_null_actual_takes_the_forecast_flagged(rsps):
    rows = [gb_period(T0, 200, 190), gb_period(T0 + timedelta(minutes=30), 210, 170),
            gb_period(T0 + timedelta(hours=1), 150, None),  # null actual: its forecast, estimated
            gb_period(T0 + timedelta(minutes=90), 160, 140),
            gb_period(T0 + timedelta(hours=2), None, None),  # null hour: missing
            gb_period(T0 + timedelta(minutes=150), 120, 118)]
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/2024-03-31T03:00Z", json=gb_national(rows))
    got = GbCarbonIntensity().history("GB", T0.timestamp(), T0.timestamp() + 3 * H)
    v = got.series.values
    assert got.series.unit == "gCO2/kWh" and got.series.start_s == T0.timestamp()
    assert v[:2].tolist() == [180.0, 145.0] and np.isnan(v[2])
    assert got.estimated.tolist() == [False, True, False] and not got.forecast
    assert got.origin.tolist() == ["gb-carbon-intensity", "gb-carbon-intensity", ""]
    assert completeness(got.series, T0.timestamp(), T0.timestamp() + 3 * H) == pytest.approx(2 / 3)
    # the null hour is a short gap: interpolated between 145 and... nothing after it -> stays missing at the edge
    assert np.isnan(fill_gaps(got).series.values[2])


def test_gb_duplicate_half_hour_records_count_once_as_their_mean_flagged(rsps):
    # carbon-intensity/api-definitions#17: two records for 2021-04-19 19:00-19:30 with different values
    t = utc(2021, 4, 19, 19)
    rows = [gb_period(t, 200, 180), gb_period(t, 200, 220), gb_period(t + timedelta(minutes=30), 210, 240)]
    rsps.get(f"{GB}/intensity/2021-04-19T19:00Z/2021-04-19T20:00Z", json=gb_national(rows))
    got = GbCarbonIntensity().history("GB", t.timestamp(), t.timestamp() + H)
    assert got.series.values.tolist() == [220.0] and got.estimated.tolist() == [True]  # (200 + 240) / 2


def test_gb_empty_200_is_missing_data(rsps):
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/2024-03-31T02:00Z", json={"data": []})
    got = GbCarbonIntensity().history("GB", T0.timestamp(), T0.timestamp() + 2 * H)
    assert got.missing == 2 and completeness(got.series, T0.timestamp(), T0.timestamp() + 2 * H) == 0.0


def test_gb_long_window_is_split_into_14_day_requests(rsps):
    a = utc(2024, 1, 1)
    rsps.get(f"{GB}/intensity/2024-01-01T00:00Z/2024-01-15T00:00Z",
             json=gb_national([gb_period(a, 100, 100), gb_period(a + timedelta(minutes=30), 100, 120)]))
    b = utc(2024, 1, 20, 23)
    rsps.get(f"{GB}/intensity/2024-01-15T00:00Z/2024-01-21T00:00Z",
             json=gb_national([gb_period(b, 90, 80), gb_period(b + timedelta(minutes=30), 90, 60)]))
    got = GbCarbonIntensity().history("GB", a.timestamp(), utc(2024, 1, 21).timestamp())
    v = got.series.values
    assert v.size == 480 and v[0] == 110.0 and v[-1] == 70.0 and got.missing == 478


def test_gb_latest_is_the_hour_holding_now(rsps):
    now = T0.timestamp() + 5 * H + 1234
    rsps.get(f"{GB}/intensity/2024-03-31T05:00Z/2024-03-31T06:00Z",
             json=gb_national([gb_period(T0 + timedelta(hours=5), 100, 98),
                               gb_period(T0 + timedelta(hours=5, minutes=30), 100, 102)]))
    got = GbCarbonIntensity(clock=Clock(now)).latest("GB")
    assert got.series.start_s == T0.timestamp() + 5 * H and got.series.values.tolist() == [100.0]


def test_gb_national_forecast_48h(rsps):
    rows = [gb_period(T0 + timedelta(minutes=30 * k), 100 + k, None) for k in range(96)]
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/fw48h", json=gb_national(rows))
    got = GbCarbonIntensity().forecast("GB", T0.timestamp(), T0.timestamp() + 50 * H)
    v = got.series.values
    assert got.forecast and v.size == 50
    assert v[0] == 100.5 and v[47] == 100 + 94.5  # hour k: mean of forecasts 100+2k and 100+2k+1
    assert np.isnan(v[48:]).all()  # past the 48-h horizon
    assert not got.estimated.any()


# ------------------------------------------------------------------------------------------------ GB regional
def test_gb_regional_forecast_and_history_both_object_and_list_shapes(rsps):
    rows = [gb_period(T0, 50, regional=True), gb_period(T0 + timedelta(minutes=30), 70, regional=True)]
    rsps.get(f"{GB}/regional/intensity/2024-03-31T00:00Z/fw48h/regionid/13", json=gb_regional(13, rows))
    rsps.get(f"{GB}/regional/intensity/2024-03-31T00:00Z/2024-03-31T01:00Z/regionid/13",
             json=gb_regional(13, rows, as_list=True))
    src = GbCarbonIntensity()
    f = src.forecast("GB-13", T0.timestamp(), T0.timestamp() + H)
    h = src.history("GB-13", T0.timestamp(), T0.timestamp() + H)
    assert f.series.values.tolist() == h.series.values.tolist() == [60.0]
    assert f.forecast and not f.estimated[0]
    assert not h.forecast and h.estimated[0]  # regional figures are forecast-only: as history they are estimates


def test_gb_zone_ids_are_checked():
    with pytest.raises(ValueError, match="zone='GB-18'"):
        GbCarbonIntensity().history("GB-18", 0, H)
    with pytest.raises(ValueError, match="zone='DE'"):
        GbCarbonIntensity().forecast("DE", 0, H)


# ------------------------------------------------------------------------------------------------ GB errors
def test_gb_429_carries_retry_after_seconds(rsps):
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/fw48h", status=429, headers={"Retry-After": "120"})
    with pytest.raises(RateLimited) as e:
        GbCarbonIntensity().forecast("GB", T0.timestamp(), T0.timestamp() + H)
    assert e.value.retry_after_s == 120.0 and e.value.status == 429


def test_gb_429_with_an_http_date_retry_after(rsps):
    now = utc(2024, 3, 31, 12).timestamp()
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/fw48h", status=429,
             headers={"Retry-After": "Sun, 31 Mar 2024 12:01:30 GMT"})
    with pytest.raises(RateLimited) as e:
        GbCarbonIntensity(clock=Clock(now)).forecast("GB", T0.timestamp(), T0.timestamp() + H)
    assert e.value.retry_after_s == 90.0


def test_gb_5xx_and_garbage_are_unavailable(rsps):
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/fw48h", status=503)
    rsps.get(f"{GB}/intensity/2024-03-31T00:00Z/2024-03-31T01:00Z", body="<html>oops</html>")
    src = GbCarbonIntensity()
    with pytest.raises(SourceUnavailable, match="HTTP 503"):
        src.forecast("GB", T0.timestamp(), T0.timestamp() + H)
    with pytest.raises(SourceUnavailable, match="not JSON"):
        src.history("GB", T0.timestamp(), T0.timestamp() + H)


def test_an_unregistered_url_never_reaches_the_network(rsps):
    with pytest.raises(SourceUnavailable, match="ConnectionError"):
        GbCarbonIntensity().forecast("GB", T0.timestamp(), T0.timestamp() + H)


# ------------------------------------------------------------------------------------------------ Electricity Maps
KEY = "s3cret-key-value"


def test_em_sends_the_key_header_and_reads_history_with_a_null_hour_and_estimates(rsps):
    rows = [em_point("DE", T0, 310), em_point("DE", T0 + timedelta(hours=1), None),
            em_point("DE", T0 + timedelta(hours=2), 290, estimated=True)]
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE", "data": rows},
             match=[matchers.header_matcher({"auth-token": KEY}),
                    matchers.query_param_matcher({"zone": "DE", "start": "2024-03-31T00:00Z",
                                                  "end": "2024-03-31T03:00Z"})])
    got = ElectricityMaps(api_key=KEY).history("DE", T0.timestamp(), T0.timestamp() + 3 * H)
    v = got.series.values
    assert got.series.unit == "gCO2e/kWh" and v[0] == 310.0 and np.isnan(v[1]) and v[2] == 290.0
    assert got.estimated.tolist() == [False, False, True]
    filled = fill_gaps(got)  # the null hour lies between two values: interpolated and flagged
    assert filled.series.values.tolist() == [310.0, 300.0, 290.0] and filled.estimated.tolist() == [False, True, True]


def test_em_401_after_a_success_is_a_rate_limit_and_a_first_401_is_an_auth_error(rsps):
    clock = Clock(T0.timestamp())
    rsps.get(f"{EM}/carbon-intensity/latest", json=em_point("DE", T0, 300))
    rsps.get(f"{EM}/carbon-intensity/latest", status=401, json={"message": "Unauthorized"})
    rsps.get(f"{EM}/carbon-intensity/latest", status=401, json={"message": "Unauthorized"})
    rsps.get(f"{EM}/carbon-intensity/latest", status=401, json={"message": "Unauthorized"})
    src = ElectricityMaps(api_key=KEY, clock=clock)
    got = src.latest("DE")
    assert got.series.values.tolist() == [300.0] and got.series.start_s == T0.timestamp()
    clock.t += 60
    with pytest.raises(RateLimited) as e:
        src.latest("DE")
    assert e.value.status == 401 and e.value.retry_after_s is None and KEY not in str(e.value)
    clock.t += 3600  # more than an hour after the last success: the key itself is refused
    with pytest.raises(SourceAuthError, match="HTTP 401"):
        src.latest("DE")
    with pytest.raises(SourceAuthError) as e2:  # a fresh source whose first answer is 401
        ElectricityMaps(api_key=KEY, clock=clock).latest("DE")
    assert KEY not in str(e2.value)


def test_em_429_retry_after_and_missing_key(rsps, monkeypatch):
    rsps.get(f"{EM}/carbon-intensity/forecast", status=429, headers={"Retry-After": "30"})
    with pytest.raises(RateLimited) as e:
        ElectricityMaps(api_key=KEY).forecast("DE", T0.timestamp(), T0.timestamp() + H)
    assert e.value.retry_after_s == 30.0
    monkeypatch.delenv("ELECTRICITYMAPS_API_KEY", raising=False)
    with pytest.raises(SourceAuthError, match="ELECTRICITYMAPS_API_KEY"):
        ElectricityMaps().forecast("DE", T0.timestamp(), T0.timestamp() + H)


def test_em_key_from_environment_and_forecast(rsps, monkeypatch):
    monkeypatch.setenv("ELECTRICITYMAPS_API_KEY", "env-key")
    pts = [(T0 + timedelta(hours=k), 200.0 + 10 * k) for k in range(3)]
    rsps.get(f"{EM}/carbon-intensity/forecast", json=em_forecast("DE", pts),
             match=[matchers.header_matcher({"auth-token": "env-key"}), matchers.query_param_matcher({"zone": "DE"})])
    got = ElectricityMaps().forecast("DE", T0.timestamp() + H, T0.timestamp() + 4 * H)
    assert got.forecast and got.series.start_s == T0.timestamp() + H
    v = got.series.values
    assert v[:2].tolist() == [210.0, 220.0] and np.isnan(v[2])


def test_em_empty_answers_are_missing(rsps):
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE", "data": []})
    rsps.get(f"{EM}/carbon-intensity/forecast", body="")
    src = ElectricityMaps(api_key=KEY)
    assert src.history("DE", T0.timestamp(), T0.timestamp() + 4 * H).missing == 4
    assert src.forecast("DE", T0.timestamp(), T0.timestamp() + 2 * H).missing == 2


def test_em_feed_down_falls_back_to_bundled_history_then_conservative(rsps):
    # Electricity Maps has hour 0 only; the bundled DE-LU 2023 history fills the rest
    a = utc(2023, 6, 1)
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE-LU", "data": [em_point("DE-LU", a, 400)]})
    got = ElectricityMaps(api_key=KEY).history("DE-LU", a.timestamp(), a.timestamp() + 5 * H)
    bundled = BundledCarbon().history("DE-LU", a.timestamp(), a.timestamp() + 5 * H)
    out = fill_gaps(got, [bundled], conservative=820.0, kind="carbon")
    assert out.series.values[0] == 400.0
    assert out.series.values[1:].tolist() == bundled.series.values[1:].tolist()
    assert out.origin.tolist() == ["electricitymaps"] + ["bundled-carbon"] * 4 and out.estimated[1:].all()
