"""Boot-disk prices (pricing/storage.py): hand-worked bills, the month rule of each provider, bad input named."""

from __future__ import annotations

import inspect
from datetime import datetime, timedelta, timezone

import pytest

from pricing.storage import BOOT_DISKS, DISK_RATES, disk_bill, disk_rate
from providers.gcp import GcpCompute

UTC = timezone.utc


def test_every_rate_and_disk_names_its_source():
    assert set(DISK_RATES) == set(BOOT_DISKS) == {"aws", "gcp"}
    assert all(r.source and d.source for r, d in zip(DISK_RATES.values(), BOOT_DISKS.values()))
    assert (DISK_RATES["aws"].disk_type, DISK_RATES["gcp"].disk_type) == ("gp3", "pd-balanced")


def test_the_gcp_disk_is_the_one_the_adapter_creates():
    params = inspect.signature(GcpCompute.__init__).parameters
    assert (params["boot_disk_gb"].default, params["boot_disk_type"].default) == (
        BOOT_DISKS["gcp"].size_gb, BOOT_DISKS["gcp"].disk_type)


def test_aws_prorates_by_the_calendar_month_and_bills_60_s_at_least():
    t = datetime(2024, 3, 5, 9, tzinfo=UTC)
    # 200 GB x 3 h in March (31 d = 2,678,400 s) = 0.80645 GB-months x 0.08 = 0.0645161 USD
    b = disk_bill("aws", 200, t, t + timedelta(hours=3))
    assert (b.billed_s, b.gb_months, b.usd) == (10800.0, pytest.approx(200 * 10800 / 2678400),
                                                pytest.approx(0.0645161290, abs=1e-10))
    # 20 s is billed 60 s: 200 x 60 / 2,678,400 x 0.08
    assert disk_bill("aws", 200, t, t + timedelta(seconds=20)).usd == pytest.approx(200 * 60 / 2678400 * 0.08)
    # 2 h across Feb 29 -> Mar 1 2024: 1 h of February (29 d = 2,505,600 s) + 1 h of March
    f = datetime(2024, 2, 29, 23, tzinfo=UTC)
    assert disk_bill("aws", 100, f, f + timedelta(hours=2)).gb_months == pytest.approx(
        100 * (3600 / 2505600 + 3600 / 2678400), rel=1e-12)


def test_gcp_uses_its_31_day_gib_month_and_no_minimum():
    t = datetime(2024, 2, 10, tzinfo=UTC)
    b = disk_bill("gcp", 200, t, t + timedelta(seconds=20))
    assert (b.billed_s, b.usd) == (20.0, pytest.approx(200 * 20 / 2678400 * 0.10))


def test_bad_input_is_named():
    t = datetime(2024, 3, 5, tzinfo=UTC)
    with pytest.raises(ValueError, match=r"provider='azure': no disk rate \(known: aws, gcp\)"):
        disk_rate("azure")
    with pytest.raises(ValueError, match=r"size_gb=0: must be a finite number of GB > 0"):
        disk_bill("aws", 0, t, t)
    with pytest.raises(ValueError, match=r"end='2024-03-04T00:00:00\+00:00': before start"):
        disk_bill("aws", 10, t, t - timedelta(days=1))
    with pytest.raises(ValueError, match=r"start=.*timezone-aware"):
        disk_bill("aws", 10, datetime(2024, 3, 5), t)
