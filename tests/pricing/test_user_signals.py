"""Bring your own history: the CSV schema, unit conversion and the hygiene rules on user series."""

from __future__ import annotations

import numpy as np
import pytest

from pricing.carbon import load_carbon_intensity
from pricing.electricity import load_electricity_price
from pricing.fx import usd_per_unit
from pricing.hygiene import CONSERVATIVE, INTERPOLATED
from pricing.user_signals import UserSignalsError, grid_signals_with, load_user_signals
from tests.pricing.recorded import utc

HEAD = "zone,hour_utc,value,unit,quality\n"


def _write(tmp_path, name, rows, head=HEAD):
    (tmp_path / name).write_text(head + "".join(r + "\n" for r in rows))


def test_carbon_and_prices_with_gaps_negative_prices_and_offsets(tmp_path):
    _write(tmp_path, "carbon.csv", [
        "XX-TEST,2030-03-31T00:00Z,100,gCO2e/kWh,measured",
        "XX-TEST,2030-03-31T01:00Z,,gCO2e/kWh,measured",          # one-hour gap: interpolated
        "XX-TEST,2030-03-31T04:00+02:00,300,gCO2e/kWh,estimated",  # = 02:00Z
        "XX-TEST,2030-03-31T06:00Z,250,gCO2e/kWh,measured",
    ])
    _write(tmp_path, "prices.csv", [
        "XX-TEST,2030-03-31T00:00:00,-12.5,EUR/MWh,measured",     # no offset: UTC; negative kept
        "XX-TEST,2030-03-31T01:00:00,40,EUR/MWh,measured",
    ])
    u = load_user_signals(tmp_path)
    assert [f.name for f in u.files] == ["carbon.csv", "prices.csv"] and u.rows == 6
    c = u.carbon["XX-TEST"]
    # 00 100 measured | 01 interpolated 200 | 02 300 (estimated in the file) | 03..05: 3-hour gap, no bundled
    # XX-TEST series -> the conservative value, the 95th percentile of [100, 250, 300] = 250 + 0.9 x 50 = 295 | 06 250
    assert c.series.values.tolist() == pytest.approx([100.0, 200.0, 300.0, 295.0, 295.0, 295.0, 250.0], rel=1e-12)
    assert c.estimated.tolist() == [False, True, True, True, True, True, False]
    assert c.origin.tolist() == ["user", INTERPOLATED, "user", CONSERVATIVE, CONSERVATIVE, CONSERVATIVE, "user"]
    p = u.price["XX-TEST"]
    assert p.series.unit == "USD/MWh"
    assert p.series.values.tolist() == pytest.approx([-12.5 * usd_per_unit("EUR"), 40 * usd_per_unit("EUR")])
    assert u.summary()[0].startswith("carbon XX-TEST: 2030-03-31T00:00+00:00..2030-03-31T07:00+00:00, 7 h, 5 estimated")


def test_per_kwh_prices_and_a_long_gap_filled_from_the_bundled_zone(tmp_path):
    # CA-ON 2023-06-01: hours 00 and 06 given, 01..05 from the bundled CA-ON price and carbon history
    _write(tmp_path, "on.csv", [
        "CA-ON,2023-06-01T00:00Z,0.05,CAD/kWh,measured",
        "CA-ON,2023-06-01T06:00Z,0.07,CAD/kWh,measured",
        "CA-ON,2023-06-01T00:00Z,40,gCO2e/kWh,measured",
        "CA-ON,2023-06-01T06:00Z,60,gCO2e/kWh,measured",
    ])
    u = load_user_signals(tmp_path)
    t0 = utc(2023, 6, 1).timestamp()
    bp = load_electricity_price("CA-ON")
    bc = load_carbon_intensity("CA-ON")
    p, c = u.price["CA-ON"].series.values, u.carbon["CA-ON"].series.values
    cad = usd_per_unit("CAD")
    assert p[0] == pytest.approx(50.0 * cad) and p[6] == pytest.approx(70.0 * cad)
    assert p[1:6].tolist() == [bp.value_at(t0 + k * 3600) for k in range(1, 6)]
    assert c[1:6].tolist() == [bc.value_at(t0 + k * 3600) for k in range(1, 6)]
    assert u.price["CA-ON"].origin[1:6].tolist() == ["bundled-price"] * 5
    # without the bundle: the conservative value, the 95th percentile of [40, 60] = 59
    u2 = load_user_signals(tmp_path, bundled_fallback=False)
    assert u2.carbon["CA-ON"].series.values[1:6].tolist() == pytest.approx([59.0] * 5, rel=1e-12)


def test_grid_signals_with_user_series_in_place_of_the_bundled_ones(tmp_path):
    _write(tmp_path, "c.csv", ["CA-ON,2023-06-01T00:00Z,40,gCO2e/kWh,measured"])
    u = load_user_signals(tmp_path)
    g = grid_signals_with(["CA-ON", "DE-LU"], u)
    assert g.carbon("CA-ON") is u.carbon["CA-ON"].series
    assert g.price("CA-ON") is load_electricity_price("CA-ON")  # no user price: bundled
    assert g.carbon("DE-LU") is load_carbon_intensity("DE-LU")


@pytest.mark.parametrize("rows, needle", [
    (["Z,2030-01-01T00:30Z,1,gCO2e/kWh,measured"], "bad.csv:2: hour_utc='2030-01-01T00:30Z': not on the hour"),
    (["Z,yesterday,1,gCO2e/kWh,measured"], "bad.csv:2: hour_utc='yesterday'"),
    (["Z,2030-01-01T00:00Z,1,lbs,measured"], "bad.csv:2: unit='lbs'"),
    (["Z,2030-01-01T00:00Z,1,XYZ/MWh,measured"], "bad.csv:2: unit='XYZ/MWh': currency='XYZ'"),
    (["Z,2030-01-01T00:00Z,1,gCO2e/kWh,guessed"], "bad.csv:2: quality='guessed'"),
    (["Z,2030-01-01T00:00Z,abc,gCO2e/kWh,measured"], "bad.csv:2: value='abc'"),
    (["Z,2030-01-01T00:00Z,-5,gCO2e/kWh,measured"], "bad.csv:2: value='-5': a carbon intensity cannot be negative"),
    ([",2030-01-01T00:00Z,5,gCO2e/kWh,measured"], "bad.csv:2: zone is empty"),
    (["Z,2030-01-01T00:00Z,5,gCO2e/kWh,measured", "Z,2030-01-01T00:00Z,6,gCO2e/kWh,measured"],
     "bad.csv:3: zone 'Z' hour '2030-01-01T00:00Z' already given carbon 5 at bad.csv:2; value '6' conflicts"),
    (["Z,2030-01-01T00:00Z,5,EUR/MWh,measured", "Z,2030-01-01T01:00Z,6,USD/MWh,measured"],
     "bad.csv:3: unit='USD/MWh': zone 'Z' already has price in 'EUR/MWh'"),
    (["Z,2030-01-01T00:00Z,,gCO2e/kWh,measured"], "zone 'Z': every carbon value is empty"),
])
def test_bad_rows_name_file_line_field_and_value(tmp_path, rows, needle):
    _write(tmp_path, "bad.csv", rows)
    with pytest.raises(UserSignalsError) as e:
        load_user_signals(tmp_path)
    assert needle in str(e.value)


def test_same_value_twice_is_fine_and_bad_folders_are_named(tmp_path):
    _write(tmp_path, "a.csv", ["Z,2030-01-01T00:00Z,5,gCO2e/kWh,measured", "Z,2030-01-01T00:00Z,5,gCO2e/kWh,measured"])
    assert load_user_signals(tmp_path).carbon["Z"].series.values.tolist() == [5.0]
    with pytest.raises(UserSignalsError, match="not a folder"):
        load_user_signals(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserSignalsError, match=r"no \*.csv file"):
        load_user_signals(empty)
    _write(empty, "x.csv", ["Z,2030-01-01T00:00Z,5"], head="zone,hour_utc,value\n")
    with pytest.raises(UserSignalsError, match="x.csv: missing column"):
        load_user_signals(empty)


def test_dst_day_in_local_offsets_lands_on_consecutive_utc_hours(tmp_path):
    # Europe/Berlin 2030-10-27: local 02:00 happens twice (+02:00 then +01:00); with offsets they are distinct hours
    _write(tmp_path, "dst.csv", [
        "DE-X,2030-10-27T01:00+02:00,10,gCO2e/kWh,measured",  # 23:00Z
        "DE-X,2030-10-27T02:00+02:00,20,gCO2e/kWh,measured",  # 00:00Z
        "DE-X,2030-10-27T02:00+01:00,30,gCO2e/kWh,measured",  # 01:00Z
        "DE-X,2030-10-27T03:00+01:00,40,gCO2e/kWh,measured",  # 02:00Z
    ])
    c = load_user_signals(tmp_path).carbon["DE-X"]
    assert c.series.start_s == utc(2030, 10, 26, 23).timestamp()
    assert c.series.values.tolist() == [10.0, 20.0, 30.0, 40.0] and not np.any(c.estimated)
