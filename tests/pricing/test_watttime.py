"""WattTime API v3 source (marginal CO2 rate) against recorded responses (no network)."""

from __future__ import annotations

import base64
from datetime import timedelta

import numpy as np
import pytest
import responses
from responses import matchers

from pricing.carbon_sources import LB_CO2_PER_MWH_TO_G_PER_KWH, WATTTIME_TOKEN_TTL_S, GbCarbonIntensity, WattTime
from pricing.hygiene import completeness, fill_gaps
from pricing.sources import MARGINAL, RateLimited, SourceAuthError, SourceChain, SourceUnavailable, capabilities
from tests.pricing.recorded import utc, wt_body

WT = "https://api.watttime.org"
T0 = utc(2024, 3, 31, 0)
H = 3600.0
USER, PASSWORD = "fed-user", "pa55-not-logged"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.fixture
def rsps():
    with responses.RequestsMock(assert_all_requests_are_fired=True) as r:
        yield r


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _login(rsps, token: str) -> None:
    rsps.get(f"{WT}/login", json={"token": token}, match=[matchers.header_matcher({"Authorization": BASIC})])


def _bearer(token: str) -> list:
    return [matchers.header_matcher({"Authorization": f"Bearer {token}"})]


def _five_min(start, values):
    return [(start + timedelta(minutes=5 * k), v) for k, v in enumerate(values)]


def test_watttime_is_a_marginal_carbon_source_with_all_three_capabilities():
    src = WattTime(USER, PASSWORD)
    assert (src.kind, src.unit, src.signal) == ("carbon", "gCO2/kWh", MARGINAL)
    assert capabilities(src) == ("latest", "history", "forecast")
    assert LB_CO2_PER_MWH_TO_G_PER_KWH == 0.45359237


def test_history_averages_5_min_points_to_hours_with_a_null_point_and_missing_points(rsps):
    pts = (_five_min(T0, [900.0 + 10 * k for k in range(12)])  # mean 955 lbs/MWh
           + _five_min(T0 + timedelta(hours=1), [1000.0, 1000.0, 1000.0, None] + [1000.0] * 6 + [1110.0, 1000.0])
           + _five_min(T0 + timedelta(hours=2), [1000.0] * 8)  # 8 of 12 points: too thin
           + _five_min(T0 + timedelta(hours=3), [1200.0] * 9))  # 9 of 12: the least that still counts
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/historical", json=wt_body("CAISO_NORTH", pts),
             match=_bearer("tok-1") + [matchers.query_param_matcher(
                 {"region": "CAISO_NORTH", "start": "2024-03-31T00:00Z", "end": "2024-03-31T04:00Z",
                  "signal_type": "co2_moer"})])
    got = WattTime(USER, PASSWORD).history("CAISO_NORTH", T0.timestamp(), T0.timestamp() + 4 * H)
    v = got.series.values
    assert got.series.unit == "gCO2/kWh" and got.series.start_s == T0.timestamp() and not got.forecast
    # 955 x 0.45359237; the null point is left out: (10 x 1000 + 1110) / 11 = 1010 -> x 0.45359237; 1200 x ...
    assert v[0] == pytest.approx(433.18071335, abs=1e-9)
    assert v[1] == pytest.approx(458.1282937, abs=1e-9)
    assert np.isnan(v[2])
    assert v[3] == pytest.approx(544.310844, abs=1e-9)
    assert got.estimated.tolist() == [False, True, False, True]  # short hours are flagged
    assert got.origin.tolist() == ["watttime", "watttime", "", "watttime"]
    assert completeness(got.series, T0.timestamp(), T0.timestamp() + 4 * H) == 0.75
    filled = fill_gaps(got)  # the thin hour is a short gap between two hours: interpolated
    assert filled.series.values[2] == pytest.approx((458.1282937 + 544.310844) / 2, abs=1e-9)


def test_login_once_and_token_reused_until_it_expires(rsps):
    clock = Clock(T0.timestamp())
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/historical", json=wt_body("CAISO_NORTH", _five_min(T0, [1000.0] * 12)),
             match=_bearer("tok-1"))
    rsps.get(f"{WT}/v3/forecast", json=wt_body("CAISO_NORTH", _five_min(T0, [500.0] * 12), forecast=True),
             match=_bearer("tok-1") + [matchers.query_param_matcher(
                 {"region": "CAISO_NORTH", "signal_type": "co2_moer", "horizon_hours": "72"})])
    src = WattTime(USER, PASSWORD, clock=clock)
    assert src.history("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H).series.values[0] == pytest.approx(
        453.59237, abs=1e-9)
    clock.t += WATTTIME_TOKEN_TTL_S - 1  # still inside the token's life: no second login
    f = src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + 2 * H)
    assert f.forecast and f.series.values[0] == pytest.approx(226.796185, abs=1e-9) and np.isnan(f.series.values[1])
    assert src.logins == 1
    clock.t += 2  # past it: log in before asking
    _login(rsps, "tok-2")
    rsps.get(f"{WT}/v3/forecast", json=wt_body("CAISO_NORTH", [], forecast=True), match=_bearer("tok-2"))
    assert src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H).missing == 1
    assert src.logins == 2


def test_a_401_on_a_token_we_thought_valid_logs_in_again_once(rsps):
    clock = Clock(T0.timestamp())
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/forecast", json=wt_body("CAISO_NORTH", _five_min(T0, [1000.0] * 12), forecast=True),
             match=_bearer("tok-1"))
    src = WattTime(USER, PASSWORD, clock=clock)
    src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    clock.t += 600  # the token should live 29 min more, but WattTime revoked it
    rsps.get(f"{WT}/v3/forecast", status=401, body="Unauthorized", match=_bearer("tok-1"))
    _login(rsps, "tok-2")
    rsps.get(f"{WT}/v3/forecast", json=wt_body("CAISO_NORTH", _five_min(T0, [1100.0] * 12), forecast=True),
             match=_bearer("tok-2"))
    got = src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    assert got.series.values[0] == pytest.approx(498.951607, abs=1e-9) and src.logins == 2
    # refused again right after a fresh login: one re-login only, then an auth error with no secret in it
    clock.t += 60
    rsps.get(f"{WT}/v3/forecast", status=401, body="Unauthorized", match=_bearer("tok-2"))
    _login(rsps, "tok-3")
    rsps.get(f"{WT}/v3/forecast", status=401, body="Unauthorized", match=_bearer("tok-3"))
    with pytest.raises(SourceAuthError, match="HTTP 401") as e:
        src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    assert src.logins == 3 and PASSWORD not in str(e.value) and "tok-3" not in str(e.value)


def test_a_429_carries_retry_after_and_a_refused_login_is_an_auth_error(rsps):
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/historical", status=429, headers={"Retry-After": "45"}, match=_bearer("tok-1"))
    with pytest.raises(RateLimited) as e:
        WattTime(USER, PASSWORD).history("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    assert e.value.retry_after_s == 45.0 and e.value.status == 429
    rsps.get(f"{WT}/login", status=403, json={"error": "bad credentials"})
    with pytest.raises(SourceAuthError, match="GET /login: HTTP 403") as e2:
        WattTime(USER, PASSWORD).history("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    assert PASSWORD not in str(e2.value)


def test_empty_200_is_missing_data(rsps):
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/historical", json={"data": [], "meta": {"units": "lbs_co2_per_mwh"}}, match=_bearer("tok-1"))
    rsps.get(f"{WT}/v3/forecast", body="", match=_bearer("tok-1"))
    src = WattTime(USER, PASSWORD)
    h = src.history("CAISO_NORTH", T0.timestamp(), T0.timestamp() + 3 * H)
    assert h.missing == 3 and completeness(h.series, T0.timestamp(), T0.timestamp() + 3 * H) == 0.0
    assert src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + 2 * H).missing == 2


def test_latest_is_the_hour_holding_now(rsps):
    now = T0.timestamp() + 5 * H + 50 * 60  # 05:50: ten 5-minute points so far
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/historical", json=wt_body("CAISO_NORTH", _five_min(T0 + timedelta(hours=5), [800.0] * 10)),
             match=[matchers.query_param_matcher({"region": "CAISO_NORTH", "start": "2024-03-31T05:00Z",
                                                  "end": "2024-03-31T06:00Z", "signal_type": "co2_moer"})])
    got = WattTime(USER, PASSWORD, clock=Clock(now)).latest("CAISO_NORTH")
    assert got.series.start_s == T0.timestamp() + 5 * H
    assert got.series.values[0] == pytest.approx(362.873896, abs=1e-9) and got.estimated.tolist() == [True]


def test_long_history_is_split_into_31_day_requests(rsps):
    a, mid, b = utc(2024, 1, 1), utc(2024, 2, 1), utc(2024, 2, 3)
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/historical", json=wt_body("CAISO_NORTH", _five_min(a, [1000.0] * 12)),
             match=[matchers.query_param_matcher({"region": "CAISO_NORTH", "start": "2024-01-01T00:00Z",
                                                  "end": "2024-02-01T00:00Z", "signal_type": "co2_moer"})])
    rsps.get(f"{WT}/v3/historical", json=wt_body("CAISO_NORTH", _five_min(b - timedelta(hours=1), [2000.0] * 12)),
             match=[matchers.query_param_matcher({"region": "CAISO_NORTH", "start": "2024-02-01T00:00Z",
                                                  "end": "2024-02-03T00:00Z", "signal_type": "co2_moer"})])
    got = WattTime(USER, PASSWORD).history("CAISO_NORTH", a.timestamp(), b.timestamp())
    v = got.series.values
    assert v.size == 33 * 24 and v[0] == pytest.approx(453.59237, abs=1e-9)
    assert v[-1] == pytest.approx(907.18474, abs=1e-9) and got.missing == 33 * 24 - 2
    assert mid.timestamp() - a.timestamp() == 31 * 86400


def test_no_account_other_units_and_garbage(rsps, monkeypatch):
    monkeypatch.delenv("WATTTIME_USER", raising=False)
    monkeypatch.delenv("WATTTIME_PASSWORD", raising=False)
    with pytest.raises(SourceAuthError, match="WATTTIME_USER and WATTTIME_PASSWORD"):
        WattTime().forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    monkeypatch.setenv("WATTTIME_USER", USER)
    monkeypatch.setenv("WATTTIME_PASSWORD", PASSWORD)
    _login(rsps, "tok-1")
    rsps.get(f"{WT}/v3/forecast", json=wt_body("CAISO_NORTH", _five_min(T0, [1.0] * 12), units="kg_co2_per_mwh"))
    rsps.get(f"{WT}/v3/historical", body="<html>oops</html>")
    src = WattTime()
    with pytest.raises(SourceUnavailable, match="meta.units='kg_co2_per_mwh'"):
        src.forecast("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)
    with pytest.raises(SourceUnavailable, match="not JSON"):
        src.history("CAISO_NORTH", T0.timestamp(), T0.timestamp() + H)


def test_a_chain_refuses_to_splice_marginal_and_average_hours():
    # same unit (gCO2/kWh) but one is an average (GB operational), the other a marginal rate
    with pytest.raises(ValueError, match="'watttime' serves marginal values, 'gb-carbon-intensity' \\(first in the chain\\) average ones"):
        SourceChain([GbCarbonIntensity(), WattTime(USER, PASSWORD)])
