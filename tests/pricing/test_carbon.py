"""Carbon-intensity loader: exact bundled values of known hours, zones, errors."""

import math
from datetime import datetime, timezone

import pytest

from pricing.carbon import available_carbon_zones, load_carbon_intensity
from pricing.errors import UnknownZoneError

UTC = timezone.utc


def test_all_16_zones():
    assert set(available_carbon_zones()) == {
        "US-CAL-CISO", "US-MIDA-PJM", "US-NY-NYIS", "US-TEX-ERCO", "DE-LU", "GB", "CA-ON", "BR-SP",
        "CL-SIC", "JP-TK", "KR", "SG", "IN-WE", "AU-NSW", "AU-VIC", "ZA"}


def test_known_hours_lca_column():
    de = load_carbon_intensity("DE-LU")
    assert de.unit == "gCO2e/kWh"
    assert de.values.size == 17544 and de.missing_count() == 0
    assert de.start_s == datetime(2023, 1, 1, tzinfo=UTC).timestamp()
    # DE-LU_2021-2024_hourly.csv.gz line 21878:
    # 2023-07-01 12:00:00,Germany,Germany,DE,86.33,132.45,88.64,85.42,entsoe.eu,false,   (direct 86.33, LCA 132.45)
    # bundled rounded to 0.1 (132.45 is 132.4499... in binary -> 132.4)
    assert de.value_at(datetime(2023, 7, 1, 12, tzinfo=UTC)) == pytest.approx(132.45, abs=0.05)
    # JP-TK_2021-2024_hourly.csv.gz line 27703 (leap day, estimated):
    # 2024-02-29 05:00:00,Japan,Tōkyō,JP-TK,427.53,515.32,21.84,21.84,Electricity Maps Estimation,true,...
    assert load_carbon_intensity("JP-TK").value_at(datetime(2024, 2, 29, 5, tzinfo=UTC)) == pytest.approx(515.3)
    assert math.isnan(de.value_at(datetime(2025, 1, 1, tzinfo=UTC)))


def test_loader_is_cached():
    assert load_carbon_intensity("GB") is load_carbon_intensity("GB")


def test_unknown_zone_error_lists_available():
    with pytest.raises(UnknownZoneError) as e:
        load_carbon_intensity("US-NW-BPAT")
    msg = str(e.value)
    assert "zone='US-NW-BPAT'" in msg and "DE-LU" in msg and "US-CAL-CISO" in msg
    assert isinstance(e.value, ValueError)
