"""FX table: known conversions and unknown-currency errors."""

import math

import numpy as np
import pytest

from pricing.errors import UnknownCurrencyError
from pricing.fx import FX_PERIOD, USD_PER_UNIT, to_usd, usd_per_unit


def test_required_currencies_present_and_positive():
    for cur in ("USD", "EUR", "GBP", "CAD", "JPY", "KRW", "SGD", "AUD", "BRL", "INR", "CLP"):
        assert USD_PER_UNIT[cur] > 0
    assert "2023" in FX_PERIOD


def test_known_row_conversion():
    # DE-LU day-ahead 2023-07-01 12:00 Paris (source line 30497 of DE-LU_prices_hourly.csv.gz: "...,16.83")
    assert to_usd(16.83, "EUR") == pytest.approx(16.83 * 1.0813)
    # JEPX Tokyo 2023-07-01 12:00 JST: 10110.0 JPY/MWh at 140.49 JPY per USD
    assert to_usd(10110.0, "JPY") == pytest.approx(10110.0 / 140.49)
    assert to_usd(-5.0, "usd") == -5.0  # case-insensitive; negative prices pass through
    np.testing.assert_allclose(to_usd(np.array([1.0, np.nan]), "AUD"), [0.6644, np.nan])


def test_unknown_currency_names_it():
    with pytest.raises(UnknownCurrencyError) as e:
        to_usd(1.0, "XYZ")
    assert "currency='XYZ'" in str(e.value) and "EUR" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="currency=None"):
        usd_per_unit(None)  # type: ignore[arg-type]
    assert not math.isnan(usd_per_unit(" eur "))
