"""Reconciliation of the usage ledger with a provider-side total (issue #12, item 2: the allocation invariant).

Each cost is allocated exactly once: for a period, ``allocated (the ledger's job lines) + unallocated =
provider total``, where *unallocated* is what the provider billed that no job line carries: the ledger's own
``idle`` lines (instance time no job used, :mod:`broker.service.ledger`) plus what the ledger does not know
(orphaned instances, costs with no resource: ``unexplained``). :func:`reconcile_cloud` checks it per resource against a provider's bill,
read by :func:`read_cur_csv` from an AWS Cost and Usage Report-like CSV; :func:`reconcile_energy` checks an
on-prem pool's energy lines against the pool's metered energy (the rest is idle or overhead energy).

A resource's ledger lines are matched to the bill by the resource id (the provider instance id); a line is
in the period when its window starts in ``[start, end)`` (UTC), as the bill's lines are by their usage start.
Ledger lines with no bill line are reported (``ledger_only``), never silently dropped or counted twice.

Errors: :class:`ReconcileError` (a ``ValueError``) naming the file, the row and the column; an unknown
currency raises :class:`pricing.errors.UnknownCurrencyError` naming it.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterable, NamedTuple

from broker.usage import UsageRecord
from broker.utc import NaiveTimeError, parse_utc
from pricing.fx import to_usd

__all__ = ["CUR_COLUMNS", "ReconcileError", "BillLine", "read_cur_csv", "ResourceDiff", "CloudReconciliation",
           "reconcile_cloud", "EnergyReconciliation", "reconcile_energy"]

#: The AWS Cost and Usage Report (legacy CUR) columns read: resource id, usage start and end (ISO 8601 UTC),
#: the unblended cost and its currency (``lineItem/CurrencyCode``, optional: USD when absent). Other columns
#: are ignored; rows with an empty resource id (taxes, support) are provider cost no job can carry.
CUR_COLUMNS = ("lineItem/ResourceId", "lineItem/UsageStartDate", "lineItem/UsageEndDate", "lineItem/UnblendedCost")
_CURRENCY = "lineItem/CurrencyCode"


class ReconcileError(ValueError):
    """A provider-side file could not be read: names the file, row and column."""


class BillLine(NamedTuple):
    """One line of a provider's bill: ``resource`` ("" for costs not tied to a resource), UTC usage window, USD."""

    resource: str
    start: datetime
    end: datetime
    usd: float


def _instant(text: str, where: str) -> datetime:
    try:
        return parse_utc(text.strip(), where)
    except NaiveTimeError:
        raise ReconcileError(f"{where}: {text!r} has no time zone (the CUR writes UTC with 'Z')") from None
    except ValueError:
        raise ReconcileError(f"{where}: {text!r} is not an ISO 8601 instant") from None


def read_cur_csv(path: str | Path) -> list[BillLine]:
    """The lines of a CUR-like CSV (:data:`CUR_COLUMNS`), costs converted to USD (:func:`pricing.fx.to_usd`).

    Raises :class:`ReconcileError` naming the file and the missing column, or the row (1-based, the header is
    row 1) and column of a bad value; :class:`pricing.errors.UnknownCurrencyError` for a currency with no rate.
    """
    path = Path(path)
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        rd = csv.DictReader(f)
        missing = [c for c in CUR_COLUMNS if c not in (rd.fieldnames or [])]
        if missing:
            raise ReconcileError(f"{path}: column {missing[0]!r} missing (need {', '.join(CUR_COLUMNS)})")
        for i, row in enumerate(rd, start=2):
            where = f"{path} row {i}"
            cost_text = row["lineItem/UnblendedCost"]
            try:
                cost = float(cost_text)
            except (TypeError, ValueError):
                raise ReconcileError(f"{where} column 'lineItem/UnblendedCost': {cost_text!r} is not a number"
                                     ) from None
            if not math.isfinite(cost):
                raise ReconcileError(f"{where} column 'lineItem/UnblendedCost': {cost_text!r} is not finite")
            cur = (row.get(_CURRENCY) or "USD").strip() or "USD"
            start = _instant(row["lineItem/UsageStartDate"], f"{where} column 'lineItem/UsageStartDate'")
            end = _instant(row["lineItem/UsageEndDate"], f"{where} column 'lineItem/UsageEndDate'")
            if end < start:
                raise ReconcileError(f"{where} column 'lineItem/UsageEndDate': {end.isoformat()} before the usage "
                                     f"start {start.isoformat()}")
            out.append(BillLine((row["lineItem/ResourceId"] or "").strip(), start, end, float(to_usd(cost, cur))))
    return out


@dataclass(frozen=True)
class ResourceDiff:
    """One resource: what the ledger allocated to jobs and what the provider billed, USD."""

    resource: str
    ledger_usd: float
    provider_usd: float
    #: the ledger's ``idle`` lines of the resource (billed, no job used it), USD
    idle_usd: float = 0.0

    @property
    def difference_usd(self) -> float:
        """Provider minus the ledger's job and idle lines, USD (positive: billed, not in the ledger)."""
        return self.provider_usd - self.ledger_usd - self.idle_usd


@dataclass(frozen=True)
class CloudReconciliation:
    """The ledger against a provider's bill for ``[start, end)``.

    Attributes:
        provider_total_usd: the bill's total.
        allocated_usd: the ledger's job lines on resources the bill has (each line once).
        unallocated_usd: ``provider_total - allocated``: billed, not carried by any job; of it,
            ``idle_usd`` the ledger's ``idle`` lines on billed resources and ``unexplained_usd`` the rest
            (orphaned instances, costs with no resource, and any per-resource difference).
        idle_usd: the ledger's ``idle`` lines on resources the bill has.
        resources: per billed or metered resource, sorted by id.
        ledger_only: ledger lines' resources the bill does not have (their USD is not in ``allocated``).
        unpriced: ledger lines whose cost is unknown (``billed_usd`` ``None``, flagged in the record).
    """

    start: datetime
    end: datetime
    provider_total_usd: float
    allocated_usd: float
    unallocated_usd: float
    resources: tuple[ResourceDiff, ...]
    ledger_only: tuple[ResourceDiff, ...] = field(default_factory=tuple)
    unpriced: int = 0
    idle_usd: float = 0.0

    @property
    def unexplained_usd(self) -> float:
        """Billed, and in no ledger line (job or idle), USD: ``unallocated - idle``."""
        return self.unallocated_usd - self.idle_usd

    @property
    def mismatched(self) -> tuple[ResourceDiff, ...]:
        """Resources on both sides whose USD differ by more than half a cent."""
        return tuple(r for r in self.resources if r.ledger_usd + r.idle_usd > 0 and abs(r.difference_usd) > 0.005)


def _in(t: datetime, start: datetime, end: datetime) -> bool:
    return start <= t < end


def reconcile_cloud(records: Iterable[UsageRecord], bill: Iterable[BillLine], start: datetime,
                    end: datetime, provider: str | None = None) -> CloudReconciliation:
    """Match the ledger's ``instance`` and ``idle`` lines (of ``provider``, all when ``None``) starting in
    ``[start, end)`` with the bill's lines starting there, by resource id (the instance id). Disk lines are not
    matched: a bill names a volume by its own id, which the ledger does not know. See
    :class:`CloudReconciliation`."""
    if end <= start:
        raise ValueError(f"end={end.isoformat()!r}: not after start={start.isoformat()!r}")
    ledger: dict[str, float] = defaultdict(float)
    idle: dict[str, float] = defaultdict(float)
    unpriced = 0
    for r in records:
        if r.line not in ("instance", "idle") or (provider and r.provider != provider) or not _in(r.start, start, end):
            continue
        if r.billed_usd is None:
            unpriced += 1
            continue
        (ledger if r.line == "instance" else idle)[r.resource] += r.billed_usd
    billed: dict[str, float] = defaultdict(float)
    for b in bill:
        if _in(b.start, start, end):
            billed[b.resource] += b.usd
    both = tuple(ResourceDiff(k, ledger.get(k, 0.0), billed[k], idle.get(k, 0.0)) for k in sorted(billed))
    only = tuple(ResourceDiff(k, ledger.get(k, 0.0), 0.0, idle.get(k, 0.0))
                 for k in sorted(set(ledger) | set(idle)) if k not in billed)
    total = math.fsum(billed.values())
    allocated = math.fsum(ledger[k] for k in ledger if k in billed)
    idle_usd = math.fsum(idle[k] for k in idle if k in billed)
    return CloudReconciliation(start, end, total, allocated, total - allocated, both, only, unpriced, idle_usd)


@dataclass(frozen=True)
class EnergyReconciliation:
    """A pool's energy lines against its metered energy for ``[start, end)``, kWh.

    ``unallocated_kwh = metered - allocated``: idle GPUs, hosts, cooling beyond the PUE; negative means the
    ledger allocated more than was metered (a counter or PUE error to look at)."""

    pool: str
    start: datetime
    end: datetime
    metered_kwh: float
    allocated_kwh: float
    unknown_lines: int

    @property
    def unallocated_kwh(self) -> float:
        return self.metered_kwh - self.allocated_kwh


def reconcile_energy(records: Iterable[UsageRecord], pool: str, metered_kwh: float, start: datetime,
                     end: datetime) -> EnergyReconciliation:
    """Sum the ledger's ``energy`` lines of ``pool`` starting in ``[start, end)`` against ``metered_kwh`` (the
    pool's facility meter, kWh). Raises ``ValueError`` naming ``metered_kwh`` when negative or not finite."""
    if not isinstance(metered_kwh, (int, float)) or not math.isfinite(metered_kwh) or metered_kwh < 0:
        raise ValueError(f"metered_kwh={metered_kwh!r}: must be a finite number of kWh >= 0")
    lines = [r for r in records if r.line == "energy" and r.pool == pool and _in(r.start, start, end)]
    known = [r.energy_kwh for r in lines if r.energy_kwh is not None]
    return EnergyReconciliation(pool, start, end, float(metered_kwh), math.fsum(known), len(lines) - len(known))
