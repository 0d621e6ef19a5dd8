"""broker.focus (the ledger as FOCUS 1.2 rows) and broker.usage.summarise, without a database."""

from __future__ import annotations

import csv
import io
import re
from decimal import Decimal
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.focus import COLUMNS, FocusAccounts, _num, focus_row, write_focus_csv
from broker.usage import UsageError, UsageRecord, summarise

UTC = timezone.utc
ACCOUNTS = FocusAccounts(organisation="Example Lab Ltd", billing_account_id="lab-0001")
NUMERIC = re.compile(r"-?\d+(\.\d+)?")  # FOCUS Numeric Format as this export writes it: no exponent, no '+'


def energy_line(start: datetime, run_s: float = 3600, usd: float | None = 0.6, kwh: float | None = 3.0,
                price: float | None = 0.2, **kw) -> UsageRecord:
    unknown = usd is None or kwh is None
    return UsageRecord(job_id="job-0000000000000003", attempt=1, rank=0, line="energy", resource="node-1", team="beta",
                       start=start, end=start + timedelta(seconds=run_s), provider="onprem", gpu_type="A100",
                       gpu_count=2, run_s=run_s, billed_s=run_s, list_unit_price_usd=price, billed_usd=usd,
                       energy_kwh=kwh, carbon_kg=None if unknown else 0.6, pricing_unit="kWh", region="GB",
                       pool="lab", estimated=unknown, estimate_reasons=("pool unknown",) if unknown else (), **kw)


@pytest.mark.parametrize("value,text", [(0.6, "0.6"), (1e-07, "0.0000001"), (1e20, "100000000000000000000"),
                                        (-0.0, "0"), (-2.5, "-2.5"), (3, "3"), (3.0, "3"), (None, "")])
def test_numbers_are_plain_decimals(value, text):
    assert _num(value) == text


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12))
def test_any_finite_number_is_written_in_numeric_format_and_reads_back_to_the_nearest_1e10(v):
    text = _num(v)
    assert NUMERIC.fullmatch(text), text
    assert text != "-0"
    assert abs(Decimal(text) - Decimal(repr(v))) <= Decimal("0.5E-10")  # broker.money.QUANTUM, half to even
    assert len(text.partition(".")[2]) <= 10


@pytest.mark.parametrize("value,text", [
    (0.00031687852777777774, "0.0003168785"),  # the walk-through's BilledCost (issue #20 finding 10)
    (0.1 + 0.2, "0.3"),                         # 0.30000000000000004 on cb5ea98
    (1.1 - 1.0, "0.1"),                         # 0.10000000000000009
    (2.2e-16, "0"), (-2.2e-16, "0"),            # noise of a zero difference: neither 2.2e-16 nor -0
    (0.00000000005, "0"), (0.00000000015, "0.0000000002"),  # half to even at the 1e-10 resolution
])
def test_money_has_no_float_noise(value, text):
    assert _num(value) == text


def test_a_rows_money_columns_are_exact_decimals():
    # 1 s of a 1.1407627 USD/h instance: 0.00031687852777777774 in float; ListCost = unit price x billed hours
    t = datetime(2026, 12, 4, 2, tzinfo=UTC)
    r = UsageRecord(job_id="job-0000000000000009", attempt=1, rank=0, line="instance", resource="i-1", team="vision",
                    start=t, end=t + timedelta(seconds=1), provider="aws", gpu_type="V100", gpu_count=1, run_s=1.0,
                    billed_s=1.0, list_unit_price_usd=1.1407627, billed_usd=1.1407627 / 3600, energy_kwh=0.1 + 0.2,
                    carbon_kg=0.0, region="us-east-1", instance_type="p3.2xlarge", market="on_demand")
    row = focus_row(r, ACCOUNTS)
    money = {c: row[c] for c in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "ListUnitPrice",
                                 "PricingQuantity", "x_EnergyKilowattHours")}
    assert money == {"BilledCost": "0.0003168785", "EffectiveCost": "0.0003168785", "ListCost": "0.0003168785",
                     "ContractedCost": "0.0003168785", "ListUnitPrice": "1.1407627", "PricingQuantity": "0.000277777777777778",
                     "x_EnergyKilowattHours": "0.3"}


def test_a_december_line_bills_in_december_and_its_period_rounds_outward():
    t = datetime(2024, 12, 31, 23, 30, 0, 250_000, tzinfo=UTC)
    row = focus_row(energy_line(t, run_s=1799.5), ACCOUNTS)
    assert (row["BillingPeriodStart"], row["BillingPeriodEnd"]) == ("2024-12-01T00:00:00Z", "2025-01-01T00:00:00Z")
    # 23:30:00.25 + 1799.5 s = 23:59:59.75: start rounded down, end up to the second
    assert (row["ChargePeriodStart"], row["ChargePeriodEnd"]) == ("2024-12-31T23:30:00Z", "2025-01-01T00:00:00Z")


def test_a_negative_price_hour_gives_a_negative_cost_not_a_clamped_one():
    row = focus_row(energy_line(datetime(2024, 5, 12, 13, tzinfo=UTC), usd=-0.15, price=-0.05), ACCOUNTS)
    assert (row["BilledCost"], row["ListUnitPrice"], row["PricingQuantity"]) == ("-0.15", "-0.05", "3")
    assert float(row["ListCost"]) == pytest.approx(-0.15)  # ListUnitPrice x PricingQuantity, as FOCUS defines it


def test_a_line_of_unknown_cost_is_left_out_and_counted_never_written_as_0():
    t = datetime(2024, 3, 5, tzinfo=UTC)
    lines = [energy_line(t), energy_line(t, usd=None, kwh=None, price=None)]
    with pytest.raises(ValueError, match="billed_usd=None"):
        focus_row(lines[1], ACCOUNTS)
    buf = io.StringIO()
    done = write_focus_csv(lines, ACCOUNTS, buf)
    assert done.rows == 1 and done.skipped == [lines[1]]
    header, *rows = list(csv.reader(io.StringIO(buf.getvalue())))
    assert header == COLUMNS and len(rows) == 1


def test_summarise_names_an_unknown_dimension():
    with pytest.raises(UsageError, match=r"^by='week': not one of team, project, provider, region, pool, line, day$"):
        summarise([], "week")


def test_summarise_counts_unknown_figures_apart_from_the_sums():
    t = datetime(2024, 3, 5, tzinfo=UTC)
    groups, total = summarise([energy_line(t), energy_line(t, usd=None, kwh=None, price=None)], "pool")
    assert [(g.key, g.cost_usd, g.energy_kwh, g.gpu_hours, g.lines, g.unpriced_lines, g.unknown_energy_lines)
            for g in groups] == [("lab", 0.6, 3.0, 4.0, 2, 1, 1)]
    assert (total.key, total.cost_usd, total.lines) == (None, 0.6, 2)
