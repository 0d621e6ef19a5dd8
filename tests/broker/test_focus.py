"""broker.focus (the ledger as FOCUS 1.2 rows) and broker.usage.summarise, without a database."""

from __future__ import annotations

import csv
import io
import re
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
def test_any_finite_number_is_written_in_numeric_format_and_reads_back(v):
    text = _num(v)
    assert NUMERIC.fullmatch(text), text
    assert float(text) == v


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
