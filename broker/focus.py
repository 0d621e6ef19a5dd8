"""The usage ledger as a FOCUS 1.2 cost and usage dataset (CSV), issue #12 item 5.

FOCUS (FinOps Open Cost and Usage Specification) 1.2, https://focus.finops.org; the column definitions read
from the specification's repository (FinOps-Open-Cost-and-Usage-Spec/FOCUS_Spec, tag ``v1.2``,
``specification/columns/*.md`` and ``specification/attributes/*.md``):

* every column 1.2 marks **Mandatory** (:data:`MANDATORY`: 21 columns, with their data type and whether
  they allow nulls), in the specification's order of presentation;
* the Conditional and Recommended columns the ledger can fill (:data:`OPTIONAL`): ResourceId, ResourceType,
  RegionId, AvailabilityZone, SkuId, PricingCategory, ListUnitPrice, ContractedUnitPrice,
  ConsumedQuantity/ConsumedUnit, ChargeFrequency and Tags (``team``, ``project``, ``job``);
* extension columns with FOCUS's ``x_`` prefix, after every FOCUS column (:data:`EXTENSIONS`): facility
  energy (kWh), emissions (kgCO2e, location-based), estimate flags and the attempt the line meters.

Values follow the attributes: date/times ``YYYY-MM-DDTHH:mm:ssZ`` (UTC; a charge period's start is rounded
down and its end up to the second), numbers plain decimals (no exponent, no ``+``, no thousands separator)
without float noise (:mod:`broker.money`: money at 1e-10 USD, ``BilledCost=0.0003168785``; quantities to 15
significant digits; never ``-0``),
currency ISO 4217 (``USD``: the ledger's one currency), a null an empty field, Tags a JSON object.

Per line (:data:`broker.usage.LINES`): ChargeCategory ``Usage``; ChargeClass null (no corrections);
ServiceCategory ``Compute`` (``Storage`` for a boot disk); PricingQuantity the billed hours (instance and
idle: ``billed_s`` / 3600, after the provider's minimum), the GB-months (disk: ``billed_usd`` /
ListUnitPrice, the size x the billed share of a month), the kWh (energy) or the GPU-hours (amortised,
idle_amortised), in the ledger's PricingUnit; ListCost = ContractedCost = ListUnitPrice x PricingQuantity
(no negotiated prices); BilledCost = EffectiveCost = the ledger's ``billed_usd`` (no commitments to
amortise). ConsumedQuantity is what ran: instance hours (``run_s`` / 3600, before the minimum), kWh,
GPU-hours, GB-months. The unallocated lines (``idle``, ``idle_amortised``) are rows like the others, told
apart by ``x_UsageLine`` and their ChargeDescription; an on-prem pool's ``idle_amortised`` row has empty
``team``/``job`` tags.

Who: a cloud line's InvoiceIssuerName, ProviderName and PublisherName are the cloud (``AWS``, ``Google
Cloud``); an on-prem line's are the operator's organisation (:attr:`FocusAccounts.organisation`). A line
whose cost is unknown (``billed_usd`` ``None``, flagged in the ledger) cannot be a FOCUS row (BilledCost is
not nullable, and a placeholder 0 is forbidden): it is left out and counted (:attr:`FocusExport.skipped`).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import IO, Iterable, Mapping

from broker.money import exact, exact_quantity, exact_quantity_text, exact_text
from broker.usage import UsageRecord

__all__ = ["FOCUS_VERSION", "MANDATORY", "OPTIONAL", "EXTENSIONS", "COLUMNS", "ALLOWED_VALUES", "DATETIME_FORMAT",
           "FocusAccounts", "FocusExport", "focus_row", "write_focus_csv"]

FOCUS_VERSION = "1.2"

#: FOCUS 1.2's Mandatory columns: column id -> (data type, allows nulls), from ``specification/columns``
MANDATORY: dict[str, tuple[str, bool]] = {
    "BilledCost": ("Decimal", False),
    "BillingAccountId": ("String", False),
    "BillingAccountName": ("String", True),
    "BillingCurrency": ("String", False),
    "BillingPeriodEnd": ("Date/Time", False),
    "BillingPeriodStart": ("Date/Time", False),
    "ChargeCategory": ("String", False),
    "ChargeClass": ("String", True),
    "ChargeDescription": ("String", True),
    "ChargePeriodEnd": ("Date/Time", False),
    "ChargePeriodStart": ("Date/Time", False),
    "ContractedCost": ("Decimal", False),
    "EffectiveCost": ("Decimal", False),
    "InvoiceIssuerName": ("String", False),
    "ListCost": ("Decimal", False),
    "PricingQuantity": ("Decimal", True),
    "PricingUnit": ("String", True),
    "ProviderName": ("String", False),
    "PublisherName": ("String", False),
    "ServiceCategory": ("String", False),
    "ServiceName": ("String", False),
}

#: the Conditional/Recommended FOCUS 1.2 columns filled: column id -> (data type, allows nulls)
OPTIONAL: dict[str, tuple[str, bool]] = {
    "AvailabilityZone": ("String", True),
    "ChargeFrequency": ("String", False),
    "ConsumedQuantity": ("Decimal", True),
    "ConsumedUnit": ("String", True),
    "ContractedUnitPrice": ("Decimal", True),
    "ListUnitPrice": ("Decimal", True),
    "PricingCategory": ("String", True),
    "RegionId": ("String", True),
    "ResourceId": ("String", True),
    "ResourceType": ("String", True),
    "SkuId": ("String", True),
    "Tags": ("JSON", True),
}

#: the extension columns (``x_`` prefix: ``specification/attributes/column_handling.md``)
EXTENSIONS: dict[str, tuple[str, bool]] = {
    "x_EnergyKilowattHours": ("Decimal", True),   # facility energy (IT x PUE), kWh; null: unknown
    "x_CarbonKilogramsCo2e": ("Decimal", True),   # kgCO2e, location-based (the grid zone's hourly mean)
    "x_CarbonMethod": ("String", False),          # "location-based"
    "x_GpuHours": ("Decimal", False),             # gpu_count x run_s / 3600
    "x_GpuType": ("String", False),
    "x_GpuCount": ("Decimal", False),
    "x_Pool": ("String", True),
    "x_UsageLine": ("String", False),             # instance | energy | amortised
    "x_JobId": ("String", False),
    "x_Attempt": ("Decimal", False),
    "x_Rank": ("Decimal", False),
    "x_Estimated": ("Boolean", False),
    "x_EstimateReasons": ("String", True),
    "x_Source": ("String", False),                # live | sim
    "x_PriceSource": ("String", True),            # where the price came from (UsageRecord.price_source)
}

COLUMNS: list[str] = [*MANDATORY, *OPTIONAL, *EXTENSIONS]

#: allowed values of the columns whose value format is "Allowed values" (FOCUS 1.2)
ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "ChargeCategory": ("Usage", "Purchase", "Tax", "Credit", "Adjustment"),
    "ChargeClass": ("Correction",),
    "ChargeFrequency": ("One-Time", "Recurring", "Usage-Based"),
    "PricingCategory": ("Standard", "Dynamic", "Committed", "Other"),
    "ServiceCategory": ("AI and Machine Learning", "Analytics", "Business Applications", "Compute", "Databases",
                        "Developer Tools", "Multicloud", "Identity", "Integration", "Internet of Things",
                        "Management and Governance", "Media", "Migration", "Mobile", "Networking", "Security",
                        "Storage", "Web", "Other"),
}

#: FOCUS's Date/Time format (``specification/attributes/datetime_format.md``)
DATETIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

#: per cloud provider: (ProviderName = PublisherName = InvoiceIssuerName, ServiceName of an instance)
_CLOUDS = {"aws": ("AWS", "Amazon Elastic Compute Cloud"), "gcp": ("Google Cloud", "Compute Engine")}
#: ServiceName of the on-prem lines
_ONPREM_SERVICE = {"energy": "On-premises GPU electricity", "amortised": "On-premises GPU capacity",
                   "idle_amortised": "On-premises GPU capacity"}


@dataclass(frozen=True)
class FocusAccounts:
    """Who bills whom (``settings.finance``).

    Attributes:
        organisation: the operator's organisation: InvoiceIssuerName, ProviderName and PublisherName of the
            on-prem lines.
        billing_account_id: the operator's billing account (BillingAccountId of on-prem lines, and of a
            cloud's lines when ``cloud_accounts`` names none).
        billing_account_name: its display name (``None``: ``organisation``).
        cloud_accounts: provider (``aws``, ``gcp``) -> the billing account the cloud invoices (AWS payer
            account, GCP billing account id).
    """

    organisation: str
    billing_account_id: str
    billing_account_name: str | None = None
    cloud_accounts: Mapping[str, str] = field(default_factory=dict)


@dataclass
class FocusExport:
    """What :func:`write_focus_csv` wrote: ``rows`` written, ``skipped`` the lines left out (cost unknown)."""

    rows: int = 0
    skipped: list[UsageRecord] = field(default_factory=list)


def _dt(t: datetime, up: bool = False) -> str:
    t = t.astimezone(timezone.utc)
    if up and t.microsecond:
        t = t.replace(microsecond=0) + timedelta(seconds=1)
    return t.replace(microsecond=0).strftime(DATETIME_FORMAT)


def _num(v: float | int | None) -> str:
    """FOCUS Numeric Format of money: a plain decimal (no exponent, no ``+``), ``""`` (null) for ``None``; at
    :data:`broker.money.QUANTUM` (1e-10 USD), so no binary noise (:func:`broker.money.exact_text`)."""
    return exact_text(v)


def _qty(v: float | int | None) -> str:
    """FOCUS Numeric Format of a quantity (hours, kWh, kgCO2e, GPU-hours): 15 significant digits, no binary
    noise (:func:`broker.money.exact_quantity_text`); ``""`` (null) for ``None``."""
    return exact_quantity_text(v)


def _month(t: datetime) -> tuple[datetime, datetime]:
    t = t.astimezone(timezone.utc)
    start = datetime(t.year, t.month, 1, tzinfo=timezone.utc)
    end = datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start, end


def _disk_gb_months(r: UsageRecord) -> float | None:
    if r.billed_usd is None or not r.list_unit_price_usd:
        return None
    return r.billed_usd / r.list_unit_price_usd


def _pricing_quantity(r: UsageRecord) -> float:
    if r.line in ("instance", "idle"):
        return r.billed_s / 3600.0
    if r.line == "disk":
        q = _disk_gb_months(r)
        return q if q is not None else math.nan
    if r.line == "energy":
        return r.energy_kwh if r.energy_kwh is not None else math.nan
    return r.gpu_count * r.billed_s / 3600.0


def _consumed_quantity(r: UsageRecord) -> float | None:
    if r.line in ("instance", "idle"):
        return r.run_s / 3600.0
    if r.line == "disk":
        return _disk_gb_months(r)
    if r.line == "energy":
        return r.energy_kwh
    return r.gpu_hours


def focus_row(r: UsageRecord, accounts: FocusAccounts) -> dict[str, str]:
    """The FOCUS row of one ledger line, as CSV text by column. Raises ``ValueError`` naming the line when its
    cost is unknown (``billed_usd`` ``None``): such a line is not a FOCUS row."""
    if r.billed_usd is None:
        raise ValueError(f"billed_usd=None: {r.job_id} attempt {r.attempt} rank {r.rank} {r.line} line has no "
                         f"known cost ({'; '.join(r.estimate_reasons)})")
    cloud = r.provider != "onprem"
    if cloud:
        who, service = _CLOUDS.get(r.provider, (r.provider, f"{r.provider} compute"))
        account = accounts.cloud_accounts.get(r.provider, accounts.billing_account_id)
        account_name = None if r.provider in accounts.cloud_accounts else (
            accounts.billing_account_name or accounts.organisation)
        desc = (f"{r.instance_type or 'instance'} {r.market or ''} instance, {r.gpu_count} x {r.gpu_type}, "
                f"billed per the {r.provider} rule").replace("  ", " ")
        sku = f"{r.provider}/{r.region or '-'}/{r.instance_type or '-'}"
        category = "Dynamic" if r.market == "spot" else "Standard"
        resource_type = "Virtual Machine"
        if r.line == "idle":
            desc = "idle (unallocated): billed, no job running; " + desc
        elif r.line == "disk":
            desc = f"boot disk of {r.instance_type or 'an'} instance {r.resource}, billed until deleted"
            sku, category, resource_type = f"{r.provider}/{r.region or '-'}/boot-disk", "Standard", "Disk"
    else:
        who, service = accounts.organisation, _ONPREM_SERVICE[r.line]
        account, account_name = accounts.billing_account_id, accounts.billing_account_name or accounts.organisation
        what = {"energy": "electricity (IT energy x PUE, at the zone's hourly tariff)",
                "amortised": "amortised capital",
                "idle_amortised": "idle (unallocated): amortised capital of GPUs no job held"}[r.line]
        desc = f"{what} of {r.gpu_count} x {r.gpu_type} on {r.resource} (pool {r.pool})"
        sku = f"onprem/{r.pool or '-'}/{r.line}" + (f"/{r.gpu_type}" if r.line != "energy" else "")
        category = "Standard"
        resource_type = "GPU Server"
    qty = _pricing_quantity(r)
    unit_price = r.list_unit_price_usd
    # ListCost = ListUnitPrice x PricingQuantity in decimal (the float product would carry binary noise)
    if unit_price is None:
        list_cost = r.billed_usd
    else:  # nan (an unknown quantity) stays nan: _num refuses it
        list_cost = exact(Decimal(repr(unit_price)) * exact_quantity(qty)) if math.isfinite(qty) else math.nan
    consumed = _consumed_quantity(r)
    period = _month(r.start)
    row = {
        "BilledCost": _num(r.billed_usd), "BillingAccountId": account, "BillingAccountName": account_name or "",
        "BillingCurrency": "USD", "BillingPeriodEnd": _dt(period[1]), "BillingPeriodStart": _dt(period[0]),
        "ChargeCategory": "Usage", "ChargeClass": "", "ChargeDescription": desc,
        "ChargePeriodEnd": _dt(r.end, up=True), "ChargePeriodStart": _dt(r.start),
        "ContractedCost": _num(list_cost), "EffectiveCost": _num(r.billed_usd), "InvoiceIssuerName": who,
        "ListCost": _num(list_cost), "PricingQuantity": _qty(qty), "PricingUnit": r.pricing_unit,
        "ProviderName": who, "PublisherName": who,
        "ServiceCategory": "Storage" if r.line == "disk" else "Compute", "ServiceName": service,
        "AvailabilityZone": r.zone or "", "ChargeFrequency": "Usage-Based",
        "ConsumedQuantity": _qty(consumed), "ConsumedUnit": "" if consumed is None else r.pricing_unit,
        "ContractedUnitPrice": _num(unit_price), "ListUnitPrice": _num(unit_price), "PricingCategory": category,
        "RegionId": r.region or "", "ResourceId": r.resource, "ResourceType": resource_type, "SkuId": sku,
        "Tags": json.dumps({"team": r.team, "project": r.project, "job": r.job_id}, separators=(",", ":")),
        "x_EnergyKilowattHours": _qty(r.energy_kwh), "x_CarbonKilogramsCo2e": _qty(r.carbon_kg),
        "x_CarbonMethod": "location-based", "x_GpuHours": _qty(r.gpu_hours), "x_GpuType": r.gpu_type,
        "x_GpuCount": _num(r.gpu_count), "x_Pool": r.pool or "", "x_UsageLine": r.line, "x_JobId": r.job_id,
        "x_Attempt": _num(r.attempt), "x_Rank": _num(r.rank), "x_Estimated": "true" if r.estimated else "false",
        "x_EstimateReasons": "; ".join(r.estimate_reasons), "x_Source": r.source,
        "x_PriceSource": r.price_source or "",
    }
    if r.line == "energy" and r.energy_kwh is None:  # priced but kWh unknown cannot happen: the cost needs the kWh
        raise ValueError(f"energy_kwh=None: {r.job_id} attempt {r.attempt} rank {r.rank} energy line has a cost "
                         f"but no kWh")
    return row


def write_focus_csv(records: Iterable[UsageRecord], accounts: FocusAccounts, out: IO[str]) -> FocusExport:
    """Write ``records`` as a FOCUS 1.2 CSV (header :data:`COLUMNS`) to ``out``; lines of unknown cost are left
    out and returned in :attr:`FocusExport.skipped`."""
    w = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    done = FocusExport()
    for r in records:
        if r.billed_usd is None:
            done.skipped.append(r)
            continue
        w.writerow(focus_row(r, accounts))
        done.rows += 1
    return done
