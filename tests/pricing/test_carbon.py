"""Carbon-intensity loader: exact bundled values of known hours, zones, errors."""

import math
from datetime import datetime, timezone

import pytest

from pricing.carbon import (
    annual_carbon_zones, available_carbon_zones, carbon_estimated, hourly_carbon_zones, load_carbon_intensity)
from pricing.errors import UnknownZoneError

UTC = timezone.utc


HOURLY = {"US-CAL-CISO", "US-MIDA-PJM", "US-NY-NYIS", "US-TEX-ERCO", "DE-LU", "GB", "CA-ON", "BR-SP",
          "CL-SIC", "JP-TK", "KR", "SG", "IN-WE", "AU-NSW", "AU-VIC", "ZA",
          "BE", "FI", "FR", "IE", "SE", "US-MIDW-MISO", "US-NW-BPAT", "US-NW-NEVP", "CA-QC", "NL", "US-CAR-SC"}
ANNUAL = {"TW", "HK", "IN-NO", "ID", "PL", "CH", "SA", "IL", "US-NW-PACE", "JP-KN", "ES", "AE"}


def test_zones_hourly_and_annual():
    assert set(hourly_carbon_zones()) == HOURLY
    assert set(annual_carbon_zones()) == ANNUAL
    assert set(available_carbon_zones()) == HOURLY | ANNUAL


def test_annual_zone_is_a_constant_series_on_the_same_grid():
    # carbon_annual_zones.csv: TW = codecarbon_cloud_impact_gcp.csv "gcp,...,asia-east1,...,451,..."
    tw, de = load_carbon_intensity("TW"), load_carbon_intensity("DE-LU")
    assert tw.start_s == de.start_s and tw.values.size == de.values.size == 17544
    assert tw.value_at(datetime(2023, 3, 1, 7, tzinfo=UTC)) == 451.0 and set(tw.values) == {451.0}


def test_one_year_zones_copy_52_weeks_earlier():
    # US-MIDW-MISO_2023_hourly.csv.gz line 26: "2023-01-02 00:00:00,...,507.07,576.14,..." (LCA 576.14);
    # 2024-01-01 00:00 (a Monday) is copied from 2023-01-02 00:00 (364 days earlier, also a Monday)
    miso = load_carbon_intensity("US-MIDW-MISO")
    assert miso.value_at(datetime(2024, 1, 1, 0, tzinfo=UTC)) == pytest.approx(576.1)
    # line 8761: 2023-12-31 23:00 LCA 568.93 is its own value (source year)
    assert miso.value_at(datetime(2023, 12, 31, 23, tzinfo=UTC)) == pytest.approx(568.9)
    # NL_2022_hourly.csv.gz line 4430: "2022-07-04 12:00:00,...,107.18,151.42,..." -> 2023-07-03 12:00
    assert load_carbon_intensity("NL").value_at(datetime(2023, 7, 3, 12, tzinfo=UTC)) == pytest.approx(151.4)


def test_carbon_estimated_flags():
    assert not carbon_estimated("DE-LU") and not carbon_estimated("FI") and not carbon_estimated("SE")
    assert carbon_estimated("TW") and carbon_estimated("NL") and carbon_estimated("US-MIDW-MISO")
    with pytest.raises(UnknownZoneError, match="zone='XX-NOPE'"):
        carbon_estimated("XX-NOPE")


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
        load_carbon_intensity("US-NW-PACW")
    msg = str(e.value)
    assert "zone='US-NW-PACW'" in msg and "DE-LU" in msg and "US-CAL-CISO" in msg
    assert isinstance(e.value, ValueError)
