"""Block storage that keeps billing while its instance is stopped: the boot disks of the broker's cloud instances.

A cloud instance's root volume is billed from the create call until the volume is deleted, whatever the
instance does meanwhile (running, stopped, or still up after its job ended because a terminate call failed).
The broker creates every boot disk to be deleted with its instance (AWS ``DeleteOnTermination``, GCP
``autoDelete``), so a disk lives exactly as long as its instance: from the create call to the instance's
deletion. :data:`BOOT_DISKS` says what disk each provider's instances get; :data:`DISK_RATES` what it costs;
:func:`disk_bill` prices one disk over one window.

========  ============  =================  ============  ==========  ===========================================
provider  disk          list price         minimum, s    GB-month    source
========  ============  =================  ============  ==========  ===========================================
aws       gp3 (3,000    0.08 USD per       60            the         Amazon EBS pricing (aws.amazon.com/ebs/
          IOPS and 125  GB-month,                        calendar    pricing/), General Purpose SSD (gp3),
          MB/s free     US East (N.                      month's     US East (N. Virginia): 0.08 USD/GB-month;
          baseline)     Virginia)                        seconds     "billed in per-second increments, with a
                                                                     60-second minimum"; Example 1 prorates
                                                                     GB-months by seconds / (86,400 x the days
                                                                     of the month).
gcp       pd-balanced   0.10 USD per       0             2,678,400   Compute Engine "Disk and image pricing"
                        GiB-month,                       s (31 d)    (cloud.google.com/compute/disks-image-
                        us-central1                                  pricing), Balanced provisioned space,
                                                                     Iowa: 0.100 USD per GiB-month; "all
                                                                     disk-related charges ... are prorated
                                                                     based on a granularity of seconds"; the
                                                                     Cloud Billing Catalog's PD capacity SKUs
                                                                     price usageUnit ``GiBy.mo`` with
                                                                     baseUnitConversionFactor 2.8759101014016e15
                                                                     byte-seconds = 2^30 B x 2,678,400 s.
========  ============  =================  ============  ==========  ===========================================

One price per provider, the region named (``priced_region``): the broker's catalogs do not carry disk prices
per region, so a disk in another region is priced at this figure and its ledger line is flagged an
estimate (regional disk prices differ by up to ~40 %). Prices as published in 2024-2025; re-check before
relying on them.

Addresses: not metered, because the broker's instances get none that bills: AWS instances start in private
subnets (``terraform/aws``: ``map_public_ip_on_launch = false``; the public IPv4 charge, 0.005 USD per
address-hour since 2024-02-01, does not apply), GCP instances without an external IP unless
``GcpCompute(external_ip=True)`` is passed, which the broker's wiring does not do. An ephemeral address
would be released with its instance anyway; a static one is not something the broker creates.

Errors: ``ValueError`` naming ``provider`` (no rate), ``size_gb`` (not a finite number > 0) or ``end``
(before ``start``).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["DiskRate", "DISK_RATES", "BootDisk", "BOOT_DISKS", "DiskBill", "disk_rate", "disk_bill"]


class DiskRate(NamedTuple):
    """The list price of one provider's boot-disk type.

    Attributes:
        provider: ``"aws"`` or ``"gcp"``.
        disk_type: the volume type (``gp3``, ``pd-balanced``).
        usd_per_gb_month: USD per GB-month (AWS GB; GCP GiB: each provider's own unit of disk size).
        priced_region: the region the price is the list price of.
        min_billed_s: the minimum billed seconds per volume.
        month_s: seconds in one billing GB-month; ``None``: the length of the calendar month (UTC) the second
            falls in (a window across two months is prorated in each).
        source: where the figures come from.
    """

    provider: str
    disk_type: str
    usd_per_gb_month: float
    priced_region: str
    min_billed_s: float
    month_s: float | None
    source: str


DISK_RATES: MappingProxyType = MappingProxyType({
    "aws": DiskRate("aws", "gp3", 0.08, "us-east-1", 60.0, None,
                    "Amazon EBS pricing, gp3, US East (N. Virginia): 0.08 USD/GB-month, per second with a "
                    "60-second minimum, prorated over the month's seconds"),
    "gcp": DiskRate("gcp", "pd-balanced", 0.10, "us-central1", 0.0, 2_678_400.0,
                    "Compute Engine disk pricing, Balanced PD, us-central1: 0.100 USD/GiB-month, prorated per "
                    "second; Cloud Billing Catalog GiBy.mo = 2^30 B x 2,678,400 s"),
})


class BootDisk(NamedTuple):
    """The boot disk a provider's broker-created instance gets: ``disk_type``, ``size_gb`` (the provider's GB),
    and where that is set (``source``)."""

    provider: str
    disk_type: str
    size_gb: float
    source: str


#: the boot disks of the broker's instances. AWS: the launch template of ``terraform/aws`` (``root_volume_size_gb``
#: default 200, gp3, ``delete_on_termination = true``); GCP: :class:`providers.gcp.GcpCompute`'s defaults
#: (``boot_disk_gb=200``, ``boot_disk_type="pd-balanced"``, ``auto_delete=True``; a test keeps the two equal).
BOOT_DISKS: MappingProxyType = MappingProxyType({
    "aws": BootDisk("aws", "gp3", 200.0, "terraform/aws root_volume_size_gb (default 200), gp3, deleted with the "
                                         "instance"),
    "gcp": BootDisk("gcp", "pd-balanced", 200.0, "providers.gcp.GcpCompute boot_disk_gb=200, pd-balanced, "
                                                 "auto-deleted with the instance"),
})


class DiskBill(NamedTuple):
    """One disk over one window: ``billed_s`` (seconds billed, the minimum applied), ``gb_months`` (GB-months
    billed) and ``usd`` (USD at the list price)."""

    billed_s: float
    gb_months: float
    usd: float


def disk_rate(provider: str) -> DiskRate:
    """The :class:`DiskRate` of ``provider``. Raises ``ValueError`` naming the provider and the known ones."""
    try:
        return DISK_RATES[provider]
    except (KeyError, TypeError):
        raise ValueError(f"provider={provider!r}: no disk rate (known: {', '.join(sorted(DISK_RATES))})") from None


def _month_s(t: datetime) -> tuple[float, datetime]:
    """Seconds of the UTC calendar month of ``t`` and the start of the next month."""
    start = datetime(t.year, t.month, 1, tzinfo=timezone.utc)
    nxt = datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=timezone.utc)
    return (nxt - start).total_seconds(), nxt


def disk_bill(provider: str, size_gb: float, start: datetime, end: datetime) -> DiskBill:
    """What ``provider`` bills for a disk of ``size_gb`` (its GB) provisioned over ``[start, end]`` (UTC).

    ``billed_s = max(min_billed_s, end - start)`` (a short window billed to the minimum is extended past
    ``end``); ``gb_months = size_gb x billed seconds / month_s`` summed over the calendar months the billed
    seconds fall in when ``month_s`` is ``None``; ``usd = gb_months x usd_per_gb_month``. Example (AWS gp3):
    200 GB for 3 h in March (31 days): 200 x 10,800 / 2,678,400 = 0.806452 GB-months = 0.0645161 USD.
    Raises ``ValueError`` naming ``provider``, ``size_gb`` or ``end``."""
    rate = disk_rate(provider)
    if not isinstance(size_gb, (int, float)) or not math.isfinite(size_gb) or size_gb <= 0:
        raise ValueError(f"size_gb={size_gb!r}: must be a finite number of GB > 0")
    for name, t in (("start", start), ("end", end)):
        if not isinstance(t, datetime) or t.tzinfo is None:
            raise ValueError(f"{name}={t!r}: needs a timezone-aware UTC datetime")
    if end < start:
        raise ValueError(f"end={end.isoformat()!r}: before start={start.isoformat()!r}")
    billed_s = max(rate.min_billed_s, (end - start).total_seconds())
    if rate.month_s is not None:
        months = billed_s / rate.month_s
    else:
        months, t, left = 0.0, start.astimezone(timezone.utc), billed_s
        while left > 0:
            month_s, nxt = _month_s(t)
            part = min(left, (nxt - t).total_seconds())
            months += part / month_s
            left -= part
            t += timedelta(seconds=part)
    gb_months = size_gb * months
    return DiskBill(float(billed_s), float(gb_months), float(gb_months * rate.usd_per_gb_month))
