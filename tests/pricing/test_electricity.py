"""Electricity prices: UTC conversion per market, USD conversion, gaps, duplicates, errors."""

import math
from datetime import datetime, timezone

import numpy as np
import pytest

from pricing.electricity import (
    available_price_zones, load_electricity_price, load_electricity_price_native, price_currency)
from pricing.errors import UnknownZoneError

UTC = timezone.utc


def at(zone: str, *ymdh: int) -> float:
    return load_electricity_price(zone).value_at(datetime(*ymdh, tzinfo=UTC))


def test_zones_and_currencies():
    assert set(available_price_zones()) == {
        "US-CAL-CISO", "US-MIDA-PJM", "US-NY-NYIS", "US-TEX-ERCO", "DE-LU", "GB", "CA-ON", "JP-TK", "KR",
        "SG", "AU-NSW", "AU-VIC"}
    assert price_currency("AU-NSW") == "AUD"  # origin column says USD: mislabel
    assert price_currency("GB") == "EUR"
    assert price_currency("JP-TK") == "JPY"
    assert load_electricity_price("KR").unit == "USD/MWh"
    assert load_electricity_price_native("KR").unit == "KRW/MWh"


def test_naive_utc_markets():
    # US-CAL-CISO_prices_hourly.csv.gz line 30302: "2023-06-15 20:00:00,10.64841" (naive = UTC)
    assert at("US-CAL-CISO", 2023, 6, 15, 20) == pytest.approx(10.64841)


def test_ercot_offsets_and_dst():
    # US-TEX-ERCO lines 27988, 33698-33699:
    # "2023-03-12 03:00:00-05:00,16.91"  -> 08:00Z
    # "2023-11-05 01:00:00-05:00,22.49"  -> 06:00Z ; "2023-11-05 01:00:00-06:00,25.61" -> 07:00Z
    assert at("US-TEX-ERCO", 2023, 3, 12, 8) == pytest.approx(16.91)
    assert at("US-TEX-ERCO", 2023, 11, 5, 6) == pytest.approx(22.49)
    assert at("US-TEX-ERCO", 2023, 11, 5, 7) == pytest.approx(25.61)


def test_eu_paris_local_time_and_fx():
    # DE-LU line 30497: "2023-07-01 12:00:00,16.83" (EUR, Paris CEST) -> 10:00Z, x 1.0813 USD/EUR
    assert at("DE-LU", 2023, 7, 1, 10) == pytest.approx(16.83 * 1.0813)
    # 2023-03-26: non-existent 02:00 row (40.12) duplicates 03:00 CEST (40.12) -> 01:00Z
    assert load_electricity_price_native("DE-LU").value_at(datetime(2023, 3, 26, 1, tzinfo=UTC)) == pytest.approx(40.12)
    # 2023-10-29: one of the two 02:00 hours is absent in the origin -> 01:00Z missing, not 0
    assert math.isnan(at("DE-LU", 2023, 10, 29, 1))


def test_gb_london_local_time():
    # GB line 21350: "2023-07-01 12:00:00,25.63" (EUR; read as Europe/London BST) -> 11:00Z
    assert load_electricity_price_native("GB").value_at(datetime(2023, 7, 1, 11, tzinfo=UTC)) == pytest.approx(25.63)


def test_asia_pacific_local_times_and_units():
    # JP-TK line 30662: "2023-07-01 12:00:00,10110.0" JPY/MWh (JPY/kWh x 1000), JST -> 03:00Z
    assert at("JP-TK", 2023, 7, 1, 3) == pytest.approx(10110.0 / 140.49)
    # KR line 29194: "2023-05-01 08:00:00,123510.0" KRW/MWh, KST -> 2023-04-30 23:00Z
    assert at("KR", 2023, 4, 30, 23) == pytest.approx(123510.0 / 1306.7)
    # SG line 29194: "2023-05-01 08:00:00,126.74" SGD/MWh, SGT -> 00:00Z
    assert at("SG", 2023, 5, 1, 0) == pytest.approx(126.74 / 1.3433)
    # CA-ON line 30281: "2023-06-15 15:00:00,38.4" CAD, hour-beginning EST (UTC-5, no DST) -> 20:00Z
    assert at("CA-ON", 2023, 6, 15, 20) == pytest.approx(38.4 / 1.3495)


def test_aemo_conflicting_duplicates_are_averaged():
    # AU-NSW lines 27086-27087, both "2023-02-01 00:00:00" (UTC+10): 128.0 and 121.3190909090909 AUD
    native = load_electricity_price_native("AU-NSW").value_at(datetime(2023, 1, 31, 14, tzinfo=UTC))
    assert native == pytest.approx((128.0 + 121.3190909090909) / 2, abs=1e-5)
    assert at("AU-NSW", 2023, 1, 31, 14) == pytest.approx(native * 0.6644)


def test_pjm_missing_last_local_day_stays_missing():
    # origin lacks 2023-12-31 05:00Z .. 2024-01-01 04:00Z (line 34969 "2023-12-31 04:00:00", next 2024-01-01 05:00)
    p = load_electricity_price("US-MIDA-PJM")
    assert math.isnan(at("US-MIDA-PJM", 2023, 12, 31, 12))
    assert math.isnan(p.integral(datetime(2023, 12, 31, 4, tzinfo=UTC), datetime(2023, 12, 31, 6, tzinfo=UTC)))
    assert at("US-MIDA-PJM", 2023, 12, 31, 4) == pytest.approx(19.41533)
    assert p.missing_count() == 48


def test_negative_prices_survive():
    v = load_electricity_price("DE-LU").values
    assert np.nanmin(v) < 0 and np.isnan(v).sum() == 27


def test_unknown_zone():
    with pytest.raises(UnknownZoneError) as e:
        load_electricity_price("BR-SP")
    assert "zone='BR-SP'" in str(e.value) and "US-CAL-CISO" in str(e.value)
    with pytest.raises(ValueError, match="zone='nope'"):
        price_currency("nope")
