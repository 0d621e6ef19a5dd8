"""broker.usage.savings: the actual placements against "all on the cheapest cloud now" and "on-prem only", by hand."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from broker.usage import UsageError, UsageRecord, savings

T = datetime(2024, 3, 5, 9, tzinfo=timezone.utc)


def line(job: str, line: str, gpu_type: str, gpus: int, hours: float, usd: float | None, resource: str = "r",
         **kw) -> UsageRecord:
    unit = {"instance": "Hours", "disk": "GB-Months", "energy": "kWh", "amortised": "GPU-Hours", "idle": "Hours",
            "idle_amortised": "GPU-Hours"}[line]
    unknown = usd is None
    return UsageRecord(job_id=job, attempt=1, rank=0, line=line, resource=resource, team="t", start=T,
                       end=T + timedelta(hours=hours), provider=kw.pop("provider", "aws"), gpu_type=gpu_type,
                       gpu_count=gpus, run_s=hours * 3600, billed_s=hours * 3600, list_unit_price_usd=1.0,
                       pricing_unit=unit, billed_usd=usd, energy_kwh=0.0, carbon_kg=0.0, estimated=unknown,
                       estimate_reasons=("unknown",) if unknown else (), **kw)


def test_units_are_a_ranks_job_lines_idle_is_no_jobs_and_unknown_costs_are_left_out():
    recs = [
        # j1: a cloud instance, 2 x V100 for 3 h, 9.00 USD, and its disk 0.05 USD: 6 GPU-h, 9.05 USD
        line("j1", "instance", "V100", 2, 3, 9.0, "i-1"), line("j1", "disk", "V100", 0, 3, 0.05, "i-1"),
        line("j1", "idle", "V100", 2, 1, 3.0, "i-1"),  # unallocated: not the job's
        # j2: an on-prem rank, 4 x V100 for 1 h: energy 0.40 + amortised 2.00 USD: 4 GPU-h, 2.40 USD
        line("j2", "energy", "V100", 4, 1, 0.4, "n1", provider="onprem"),
        line("j2", "amortised", "V100", 4, 1, 2.0, "n1", provider="onprem"),
        # j3: cost unknown; j4: a type with no cloud rate
        line("j3", "instance", "V100", 1, 1, None, "i-3"), line("j4", "instance", "T4", 1, 2, 0.7, "i-4"),
        line("", "idle_amortised", "V100", 4, 1, 2.0, "n1", provider="onprem"),
    ]
    s = savings(recs, {"V100": 0.9}, {"V100": 0.6, "T4": 0.2})
    # compared: 10 GPU-h, 11.45 USD; cheapest cloud 10 x 0.90 = 9.00; on-prem 10 x 0.60 = 6.00
    assert (s.units, s.gpu_hours, s.actual_usd) == (2, pytest.approx(10.0), pytest.approx(11.45))
    assert (s.cheapest_cloud_usd, s.onprem_only_usd) == (pytest.approx(9.0), pytest.approx(6.0))
    assert (s.saved_vs_cheapest_cloud_usd, s.saved_vs_onprem_only_usd) == (pytest.approx(-2.45), pytest.approx(-5.45))
    assert (s.not_compared_units, s.not_compared_gpu_hours) == (2, pytest.approx(3.0))
    assert s.reasons == ("1 unit(s) left out: T4: no cloud rate", "1 unit(s) left out: a line of unknown cost")


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_a_bad_rate_is_named(bad):
    with pytest.raises(UsageError, match=r"onprem_usd_per_gpu_hour\['V100'\]=.*: must be a finite USD per GPU-hour"):
        savings([], {"V100": 1.0}, {"V100": bad})


def test_equal_costs_save_exactly_zero_not_float_noise():
    # an on-prem rank, 1 x A100 for 1 h: energy 0.1 + amortised 0.2 USD (0.30000000000000004 in float), against an
    # on-prem-only rate of 0.3 USD/GPU-h: saved exactly 0 (cb5ea98: -5.551115123125783e-17, shown as -5.6e-17)
    recs = [line("j", "energy", "A100", 1, 1, 0.1, "n1", provider="onprem"),
            line("j", "amortised", "A100", 1, 1, 0.2, "n1", provider="onprem")]
    s = savings(recs, {"A100": 0.3 + 0.6}, {"A100": 0.3})
    assert (s.actual_usd, s.onprem_only_usd, s.cheapest_cloud_usd) == (0.3, 0.3, 0.9)
    assert s.saved_vs_onprem_only_usd == 0.0 and str(s.saved_vs_onprem_only_usd) == "0.0"  # not -0.0
    assert s.saved_vs_cheapest_cloud_usd == 0.6
