"""GridSignals: carbon always, price when the zone has one."""

import pytest

from pricing.carbon import load_carbon_intensity
from pricing.electricity import load_electricity_price
from pricing.errors import UnknownZoneError
from pricing.signals import GridSignals, load_grid_signals


def test_load_grid_signals():
    s = load_grid_signals(["DE-LU", "BR-SP", "DE-LU"])
    assert s.zones == ("BR-SP", "DE-LU")
    assert s.carbon("DE-LU") is load_carbon_intensity("DE-LU")
    assert s.price("DE-LU") is load_electricity_price("DE-LU")
    assert s.price("DE-LU").unit == "USD/MWh" and s.carbon("BR-SP").unit == "gCO2e/kWh"
    assert s.price("BR-SP") is None


def test_errors():
    s = load_grid_signals(["GB"])
    with pytest.raises(UnknownZoneError, match="zone='KR'"):
        s.carbon("KR")
    with pytest.raises(UnknownZoneError, match="zone='KR'"):
        s.price("KR")
    with pytest.raises(UnknownZoneError, match="zone='XX'"):
        load_grid_signals(["XX"])
    assert GridSignals().zones == ()
