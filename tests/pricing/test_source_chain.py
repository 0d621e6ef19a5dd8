"""SourceChain: sources of one kind in order; a failing feed counts as missing; the gap rules fill the rest."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import responses

from pricing.carbon_sources import ElectricityMaps, GbCarbonIntensity
from pricing.hygiene import CONSERVATIVE, DEFAULT_CONSERVATIVE_CARBON, INTERPOLATED
from pricing.price_sources import Tariff
from pricing.sources import BundledCarbon, BundledPrice, RateLimited, SourceChain, SourceUnavailable
from tests.pricing.recorded import em_point, utc

EM = "https://api.electricitymap.org/v3"
A = utc(2023, 6, 1)
H = 3600.0


@pytest.fixture
def rsps():
    with responses.RequestsMock(assert_all_requests_are_fired=True) as r:
        yield r


def test_feed_down_falls_back_to_the_bundled_history(rsps):
    rsps.get(f"{EM}/carbon-intensity/past-range", status=503)
    res = SourceChain([ElectricityMaps(api_key="k"), BundledCarbon()]).window("DE-LU", A.timestamp(), A.timestamp() + 3 * H)
    bundled = BundledCarbon().history("DE-LU", A.timestamp(), A.timestamp() + 3 * H)
    assert res.checked.series.values.tolist() == bundled.series.values.tolist()
    assert res.checked.origin.tolist() == ["bundled-carbon"] * 3 and res.checked.estimated.all()
    assert isinstance(res.errors["electricitymaps"], SourceUnavailable) and res.skipped == ()


def test_rate_limit_after_success_then_the_feed_recovers(rsps):
    chain = SourceChain([ElectricityMaps(api_key="k"), BundledCarbon()])
    rows = [em_point("DE-LU", A + timedelta(hours=k), 100.0 + k) for k in range(3)]
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE-LU", "data": rows})
    rsps.get(f"{EM}/carbon-intensity/past-range", status=401)
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE-LU", "data": rows})
    w = (A.timestamp(), A.timestamp() + 3 * H)
    first = chain.window("DE-LU", *w)
    assert first.checked.series.values.tolist() == [100.0, 101.0, 102.0] and not first.errors
    second = chain.window("DE-LU", *w)
    assert isinstance(second.errors["electricitymaps"], RateLimited)
    assert second.checked.origin.tolist() == ["bundled-carbon"] * 3
    third = chain.window("DE-LU", *w)
    assert third.checked.origin.tolist() == ["electricitymaps"] * 3 and not third.errors


def test_a_null_hour_is_interpolated_and_a_long_outage_takes_the_next_source(rsps):
    rows = [em_point("DE-LU", A, 100), em_point("DE-LU", A + timedelta(hours=1), None),
            em_point("DE-LU", A + timedelta(hours=2), 300)]  # hours 3..5: not delivered
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE-LU", "data": rows})
    res = SourceChain([ElectricityMaps(api_key="k"), BundledCarbon()]).window("DE-LU", A.timestamp(),
                                                                              A.timestamp() + 6 * H)
    v = res.checked.series.values
    bundled = BundledCarbon().history("DE-LU", A.timestamp(), A.timestamp() + 6 * H).series.values
    assert v[:3].tolist() == [100.0, 200.0, 300.0] and v[3:].tolist() == bundled[3:].tolist()
    assert res.checked.origin.tolist() == ["electricitymaps", INTERPOLATED, "electricitymaps"] + ["bundled-carbon"] * 3


def test_nothing_anywhere_is_the_conservative_carbon_never_zero(rsps):
    a = utc(2030, 1, 1)
    rsps.get(f"{EM}/carbon-intensity/past-range", json={"zone": "DE-LU", "data": []})
    res = SourceChain([ElectricityMaps(api_key="k"), BundledCarbon()]).window("DE-LU", a.timestamp(), a.timestamp() + 2 * H)
    assert res.checked.series.values.tolist() == [DEFAULT_CONSERVATIVE_CARBON] * 2
    assert res.checked.origin.tolist() == [CONSERVATIVE] * 2 and res.checked.estimated.all()


def test_forecast_skips_history_only_sources_and_prices_stay_missing_with_nothing_known():
    t = Tariff({"zone": "site", "timezone": "UTC", "currency": "USD", "per": "MWh", "default": 42})
    res = SourceChain([t, BundledPrice()]).window("site", A.timestamp(), A.timestamp() + 2 * H, want="forecast")
    assert res.checked.series.values.tolist() == [42.0, 42.0] and res.checked.forecast
    assert res.skipped == ("bundled-price",)
    none = SourceChain([BundledPrice()]).window("XX-NONE", A.timestamp(), A.timestamp() + H)
    assert np.isnan(none.checked.series.values).all() and "XX-NONE" in str(none.errors["bundled-price"])


def test_a_chain_mixes_no_units_or_kinds():
    with pytest.raises(ValueError, match="'bundled-carbon' serves carbon in 'gCO2e/kWh', the chain carbon in 'gCO2/kWh'"):
        SourceChain([GbCarbonIntensity(), BundledCarbon()])
    with pytest.raises(ValueError, match="'bundled-price' serves price"):
        SourceChain([BundledCarbon(), BundledPrice()])
    with pytest.raises(ValueError, match="want='now'"):
        SourceChain([BundledCarbon()]).window("DE-LU", 0, H, want="now")
