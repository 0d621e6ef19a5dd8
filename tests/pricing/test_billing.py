"""pricing.billing: the per-provider billing rules table and billed seconds."""

import pytest

from pricing.billing import BILLING_RULES, billed_seconds


def test_billing_rules_name_their_source_and_round_as_documented():
    assert {p: (r.min_billed_s, r.increment_s) for p, r in BILLING_RULES.items()} == {
        "aws": (60.0, 1.0), "gcp": (60.0, 1.0), "onprem": (0.0, 1.0)}
    assert all(r.source for r in BILLING_RULES.values())
    assert billed_seconds("aws", 45) == 60.0
    assert billed_seconds("gcp", 61.2) == 62.0
    assert billed_seconds("aws", 120.0000001) == 120.0  # float noise of datetime arithmetic is not a new second
    assert billed_seconds("onprem", 45) == 45.0
    with pytest.raises(ValueError, match=r"provider='azure': no billing rule"):
        billed_seconds("azure", 10)
    with pytest.raises(ValueError, match=r"run_s=-1: must be a finite number"):
        billed_seconds("aws", -1)
