"""broker.money: the one rounding of money (and the ledger's other figures) for FOCUS, the API, the CLI and the page."""

from __future__ import annotations

from decimal import Decimal

import pytest

from broker.money import decimals_for, exact, exact_float, exact_text, figure_text


def test_exact_rounds_to_1e10_half_to_even_and_drops_the_sign_of_zero():
    assert exact(0.1 + 0.2) == Decimal("0.3000000000")
    assert str(exact(-1e-12)) == "0E-10"  # not -0E-10
    assert exact_float(0.1 + 0.2) == 0.3 and exact_float(None) is None
    assert (exact_text(12.5), exact_text(100.0), exact_text(-0.25), exact_text(None)) == ("12.5", "100", "-0.25", "")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), Decimal("NaN"), "1", True, 1e300])
def test_exact_refuses_what_is_no_ledger_figure(bad):
    with pytest.raises(ValueError, match="not a finite number|not a number|too large"):
        exact(bad)


def test_a_column_keeps_two_significant_digits_of_its_smallest_figure():
    # the walk-through's cost report by pool: hpc 0.0125 + local 0.0287 = 0.0412 showed 0.01 + 0.03 = 0.03
    col = [0.0125, 0.0287, 0.0125 + 0.0287]
    places = decimals_for(col)
    assert places == 3
    assert [figure_text(v, places) for v in col] == ["0.013", "0.029", "0.041"]
    assert decimals_for([17.2, 0.6, 10.0]) == 2 and decimals_for([]) == 2 and decimals_for([0, None]) == 2
    assert decimals_for([1e-12, 3e-10]) == 10  # at most QUANTUM's decimals; 1e-12 is 0 there
    assert figure_text(1234567.891, 2) == "1,234,567.89" and figure_text(1234.5, 2, grouped=False) == "1234.50"


def test_a_shown_figure_is_never_minus_zero_and_unknown_is_a_dash():
    assert figure_text(-0.001, 2) == "0.00" and figure_text(-0.0) == "0.00"
    assert figure_text(None) == "-"


def test_an_exact_quantity_keeps_15_significant_digits():
    from broker.money import exact_quantity_text

    assert exact_quantity_text(60 / 3600) == "0.0166666666666667"
    assert exact_quantity_text(0.1 + 0.2) == "0.3" and exact_quantity_text(1234.5 + 0.1) == "1234.6"
    assert exact_quantity_text(-0.0) == "0" and exact_quantity_text(None) == "" and exact_quantity_text(3) == "3"
