"""best_start: cheapest/cleanest start windows over hand-built hourly series, missing data, ties, errors."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import numpy as np
import pytest

from broker.planner.windows import WindowChoice, best_start, candidate_starts
from pricing.series import HourlySeries

UTC = timezone.utc
T0 = datetime(2023, 1, 1, tzinfo=UTC).timestamp()
H = 3600.0
NAN = float("nan")


def price(values) -> HourlySeries:
    return HourlySeries(zone="Z", unit="USD/MWh", start_s=T0, values=np.asarray(values, float))


def carbon(values) -> HourlySeries:
    return HourlySeries(zone="Z", unit="gCO2e/kWh", start_s=T0, values=np.asarray(values, float))


FLAT_CI = carbon([300.0] * 8)


def test_cheapest_two_hour_job():
    # 2 h at 10 kW over [50, 40, 10, 20, 90]: windows 90, 50, 30, 110 (USD/MWh x h) -> hour 2
    w = best_start(earliest_s=T0, latest_start_s=T0 + 3 * H, runtime_s=2 * H, power_kw=10.0,
                   price=price([50, 40, 10, 20, 90]), carbon=FLAT_CI, prefer="cheapest")
    assert isinstance(w, WindowChoice)
    assert w.start_s == T0 + 2 * H
    assert w.cost_usd == pytest.approx(0.30)  # 10 kW x (10 + 20) USD/MWh x 1 h / 1000
    assert w.energy_kwh == pytest.approx(20.0)  # 10 kW x 2 h
    assert w.carbon_kg == pytest.approx(6.0)  # 10 kW x 300 g/kWh x 2 h / 1000
    assert w.candidates == 4
    assert "cheapest" in w.reason and "2023-01-01T02:00:00Z" in w.reason
    with pytest.raises(AttributeError):
        w.start_s = 0.0  # type: ignore[misc]  # frozen


def test_latest_start_is_inclusive_and_bounds_the_choice():
    p = price([50, 40, 10, 20, 90])
    # latest = 1 h: only starts 0 h (90) and 1 h (50)
    w = best_start(earliest_s=T0, latest_start_s=T0 + H, runtime_s=2 * H, power_kw=10.0,
                   price=p, carbon=FLAT_CI, prefer="cheapest")
    assert (w.start_s, w.candidates) == (T0 + H, 2)
    assert w.cost_usd == pytest.approx(0.50)
    # latest == earliest: one candidate
    w = best_start(earliest_s=T0, latest_start_s=T0, runtime_s=2 * H, power_kw=10.0,
                   price=p, carbon=FLAT_CI, prefer="cheapest")
    assert (w.start_s, w.candidates) == (T0, 1)
    assert w.cost_usd == pytest.approx(0.90)


def test_non_aligned_earliest_wins():
    # 1 h at 10 kW over [90, 10, 20, 50, 60]; candidates 01:30 (0.5x10 + 0.5x20 = 15), 02:00 (20), 03:00 (50)
    w = best_start(earliest_s=T0 + 1.5 * H, latest_start_s=T0 + 3 * H, runtime_s=H, power_kw=10.0,
                   price=price([90, 10, 20, 50, 60]), carbon=FLAT_CI, prefer="cheapest")
    assert w.start_s == T0 + 1.5 * H
    assert w.candidates == 3
    assert w.cost_usd == pytest.approx(0.15)
    assert w.energy_kwh == pytest.approx(10.0)


def test_non_aligned_earliest_then_slot_boundary_wins():
    # 2 h at 10 kW over [50, 40, 10, 20, 90] from 00:30: 00:30 -> 25+40+5 = 70; 01:00 -> 50; 02:00 -> 30
    w = best_start(earliest_s=T0 + 0.5 * H, latest_start_s=T0 + 2.5 * H, runtime_s=2 * H, power_kw=10.0,
                   price=price([50, 40, 10, 20, 90]), carbon=FLAT_CI, prefer="cheapest")
    assert (w.start_s, w.candidates) == (T0 + 2 * H, 3)
    assert w.cost_usd == pytest.approx(0.30)


def test_candidate_grid():
    assert candidate_starts(T0, T0 + 3 * H, H).tolist() == [T0 + i * H for i in range(4)]
    assert candidate_starts(T0 + 0.5 * H, T0 + 2.5 * H, H).tolist() == [T0 + 0.5 * H, T0 + H, T0 + 2 * H]
    assert candidate_starts(T0 + 10, T0 + 20, H).tolist() == [T0 + 10]
    assert candidate_starts(T0, T0 + H, 1800.0).tolist() == [T0, T0 + 1800, T0 + 3600]


def test_half_hour_slots():
    # 30-min slots, 1.5 h job at 2 kW over [20, 10, 30, 30] (USD/MWh x h per window):
    # 00:00 -> 20 + 5 = 25; 00:30 -> 10 + 10 = 20; 01:00 -> 10 + 15 = 25; 01:30 -> 5 + 30 = 35; 02:00 -> 30 + 15 = 45
    w = best_start(earliest_s=T0, latest_start_s=T0 + 2 * H, runtime_s=1.5 * H, power_kw=2.0,
                   price=price([20, 10, 30, 30]), carbon=carbon([1, 1, 1, 1]), prefer="cheapest", slot_s=1800.0)
    assert (w.start_s, w.candidates) == (T0 + 0.5 * H, 5)
    assert w.cost_usd == pytest.approx(2.0 * 20 / 1000)
    assert w.energy_kwh == pytest.approx(3.0)


def test_missing_hours_are_skipped_never_zero():
    # 2 h at 10 kW over [50, 5, NaN, 20, 30, 40]: windows 55, NaN, NaN, 50, 70 -> hour 3 (not the gap)
    p = price([50, 5, NAN, 20, 30, 40])
    w = best_start(earliest_s=T0, latest_start_s=T0 + 4 * H, runtime_s=2 * H, power_kw=10.0,
                   price=p, carbon=FLAT_CI, prefer="cheapest")
    assert w.start_s == T0 + 3 * H
    assert w.cost_usd == pytest.approx(0.50)
    assert w.candidates == 5
    assert "2 skipped" in w.reason
    # a window running past the series' end has no data: 6 h series, latest start 5 h -> the search is
    # clamped to the last start whose run fits (4 h): candidates 3 h and 4 h, and the reason says so
    w = best_start(earliest_s=T0 + 3 * H, latest_start_s=T0 + 5 * H, runtime_s=2 * H, power_kw=10.0,
                   price=p, carbon=FLAT_CI, prefer="cheapest")
    assert (w.start_s, w.candidates) == (T0 + 3 * H, 2)
    assert "skipped" not in w.reason
    assert w.reason.endswith("window clamped to the price series' end 2023-01-01T06:00:00Z")


def test_a_deadline_centuries_away_is_clamped_to_the_series():
    # latest start in 2199 with 1 h slots would be ~1.5 million candidates (over MAX_CANDIDATES); the search
    # stops at the ranked series' end instead: carbon [300, 100, 200, 50] -> 1 h runs at 00..03 h, 03 h wins
    far = datetime(2199, 12, 31, tzinfo=UTC).timestamp()
    w = best_start(earliest_s=T0, latest_start_s=far, runtime_s=H, power_kw=2.0, price=None,
                   carbon=carbon([300, 100, 200, 50]), prefer="cleanest")
    assert (w.start_s, w.candidates) == (T0 + 3 * H, 4)
    assert w.carbon_kg == pytest.approx(0.1)  # 2 kW x 50 g/kWh x 1 h / 1000
    assert "window clamped to the carbon series' end 2023-01-01T04:00:00Z" in w.reason
    # earliest start already past the series: one candidate (earliest), data missing, no error
    w = best_start(earliest_s=T0 + 10 * H, latest_start_s=far, runtime_s=H, power_kw=2.0, price=price([1, 2]),
                   carbon=FLAT_CI, prefer="cheapest")
    assert (w.start_s, w.candidates) == (T0 + 10 * H, 1)
    assert math.isnan(w.cost_usd) and "price data missing" in w.reason


def test_missing_carbon_hour_is_not_the_cleanest():
    ci = carbon([400, NAN, 350, 500])
    w = best_start(earliest_s=T0, latest_start_s=T0 + 3 * H, runtime_s=H, power_kw=4.0,
                   price=None, carbon=ci, prefer="cleanest")
    assert w.start_s == T0 + 2 * H
    assert w.carbon_kg == pytest.approx(4.0 * 350 / 1000)
    assert math.isnan(w.cost_usd)  # no price series


def test_secondary_series_missing_is_reported_nan():
    # cheapest ranks by price only; the chosen hour's carbon is missing and reported as NaN, not 0
    w = best_start(earliest_s=T0, latest_start_s=T0 + 2 * H, runtime_s=H, power_kw=1.0,
                   price=price([30, 10, 20]), carbon=carbon([100, NAN, 100]), prefer="cheapest")
    assert w.start_s == T0 + H
    assert w.cost_usd == pytest.approx(0.01)
    assert math.isnan(w.carbon_kg)


def test_all_missing_returns_earliest_and_says_so():
    w = best_start(earliest_s=T0 + 0.25 * H, latest_start_s=T0 + 2 * H, runtime_s=H, power_kw=3.0,
                   price=price([NAN, NAN, NAN, NAN]), carbon=carbon([200, 200, 200, 200]), prefer="cheapest")
    assert w.start_s == T0 + 0.25 * H
    assert w.candidates == 3
    assert math.isnan(w.cost_usd)
    assert w.carbon_kg == pytest.approx(3.0 * 200 / 1000)
    assert w.energy_kwh == pytest.approx(3.0)
    assert "missing" in w.reason and "price" in w.reason
    # a window entirely outside the series is missing as well
    w = best_start(earliest_s=T0 + 100 * H, latest_start_s=T0 + 102 * H, runtime_s=H, power_kw=3.0,
                   price=None, carbon=carbon([200, 200]), prefer="cleanest")
    assert w.start_s == T0 + 100 * H and math.isnan(w.carbon_kg) and "carbon data missing" in w.reason


def test_cleanest_and_cheapest_choose_different_hours():
    p = price([10, 50, 40])
    ci = carbon([500, 100, 200])
    kw = dict(earliest_s=T0, latest_start_s=T0 + 2 * H, runtime_s=H, power_kw=2.0, price=p, carbon=ci)
    cheap = best_start(**kw, prefer="cheapest")
    clean = best_start(**kw, prefer="cleanest")
    assert cheap.start_s == T0 and clean.start_s == T0 + H
    assert cheap.cost_usd == pytest.approx(0.02) and cheap.carbon_kg == pytest.approx(1.0)
    assert clean.cost_usd == pytest.approx(0.10) and clean.carbon_kg == pytest.approx(0.2)


def test_negative_prices():
    w = best_start(earliest_s=T0, latest_start_s=T0 + 2 * H, runtime_s=H, power_kw=10.0,
                   price=price([10, -20, 5]), carbon=carbon([1, 1, 1]), prefer="cheapest")
    assert w.start_s == T0 + H
    assert w.cost_usd == pytest.approx(-0.20)


def test_ties_go_to_the_earliest_candidate():
    w = best_start(earliest_s=T0, latest_start_s=T0 + 3 * H, runtime_s=H, power_kw=1.0,
                   price=price([20, 10, 10, 10]), carbon=carbon([1, 1, 1, 1]), prefer="cheapest")
    assert w.start_s == T0 + H
    # exact ties that prefix-sum rounding splits: windows (0.1+0.1) from 01:00 and 02:00 come out as
    # 0.2 and 0.19999999999999996; still the earliest wins
    p = price([0.3, 0.1, 0.1, 0.1, 0.6])
    assert np.argmin(p.integrals(T0 + np.arange(4) * H, 2 * H)) == 2  # the raw argmin would pick 02:00
    w = best_start(earliest_s=T0, latest_start_s=T0 + 3 * H, runtime_s=2 * H, power_kw=1.0,
                   price=p, carbon=carbon([1] * 5), prefer="cheapest")
    assert w.start_s == T0 + H


def test_fractional_runtime_energy():
    # 1.5 h at 4 kW from 00:00 over carbon [100, 300]: 4 x (100 + 0.5 x 300) / 1000 = 1.0 kg, 6 kWh
    w = best_start(earliest_s=T0, latest_start_s=T0, runtime_s=5400.0, power_kw=4.0,
                   price=None, carbon=carbon([100, 300]), prefer="cleanest")
    assert w.energy_kwh == pytest.approx(6.0)
    assert w.carbon_kg == pytest.approx(1.0)


@pytest.mark.parametrize(
    "override, field",
    [
        (dict(latest_start_s=T0 - 1), "latest_start_s"),
        (dict(runtime_s=0.0), "runtime_s"),
        (dict(runtime_s=-5.0), "runtime_s"),
        (dict(power_kw=0.0), "power_kw"),
        (dict(power_kw=-1.0), "power_kw"),
        (dict(earliest_s=NAN), "earliest_s"),
        (dict(latest_start_s=NAN), "latest_start_s"),
        (dict(runtime_s=NAN), "runtime_s"),
        (dict(power_kw=NAN), "power_kw"),
        (dict(power_kw=float("inf")), "power_kw"),
        (dict(slot_s=0.0), "slot_s"),
        (dict(slot_s=NAN), "slot_s"),
        (dict(slot_s=1e-3, latest_start_s=T0 + 10 * H), "slot_s"),  # 36 million candidates
        (dict(prefer="greenest"), "prefer"),
        (dict(price=None), "price"),
        (dict(carbon=[1, 2, 3]), "carbon"),
    ],
)
def test_bad_input_names_the_field(override, field):
    kw = dict(earliest_s=T0, latest_start_s=T0 + 2 * H, runtime_s=H, power_kw=1.0,
              price=price([1, 2, 3, 4]), carbon=carbon([1, 2, 3, 4]), prefer="cheapest")
    kw.update(override)
    with pytest.raises(ValueError) as e:
        best_start(**kw)
    assert str(e.value).startswith(f"{field}=")
