"""The usage record: one line of the finance ledger (issue #12), the same type for live use and simulated runs.

A :class:`UsageRecord` is one metered resource of one attempt rank over ``[start, end]`` (UTC): a cloud
instance (``line="instance"``), its boot disk (``line="disk"``: billed from the create call until the disk is
deleted with the instance, stopped or not), the electricity an on-prem rank drew (``line="energy"``) or its
amortised capital (``line="amortised"``). Two lines are *unallocated* (:data:`UNALLOCATED_LINES`: billed or
paid for, used by no job): ``idle`` (cloud instance time no job used: an instance of an attempt that never ran
or that the job's placement did not take, and the time from an attempt's end until its instance is deleted)
and ``idle_amortised`` (on-prem pool GPUs no running attempt held, at the pool's amortised USD per GPU-hour;
``job_id`` and ``team`` empty). So ``sum(job lines) + sum(unallocated lines) = what was billed or paid``. The live broker writes them in the transaction that ends the attempt
(:func:`broker.service.lifecycle.record_usage` -> :mod:`broker.service.ledger`); the simulator can build
the same records from its realised runs (``source="sim"``), so one report reads both.

Money is USD, energy kWh (facility: IT energy x PUE), emissions kgCO2e (location-based: the grid zone's
hourly average intensity, not market-based contracts). A figure that could not be computed is ``None``
with the reason in ``estimate_reasons``, never 0; a figure that is an estimate (modelled power, a missing
counter, an interpolated hour) has ``estimated=True`` and the reason.

Errors: :class:`UsageError` (a ``ValueError``) naming the field and the value.
"""

from __future__ import annotations

import csv
import gzip
import math
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from operator import attrgetter
from pathlib import Path
from typing import Iterable, Mapping

from broker.money import exact

__all__ = ["LINES", "UNALLOCATED_LINES", "GPU_HOUR_LINES", "PRICING_UNITS", "SUMMARY_DIMENSIONS", "UsageError", "UsageRecord", "UsageTotals", "summarise",
           "total_of", "USAGE_CSV_COLUMNS", "write_usage_csv", "read_usage_csv", "CHARGEBACK_COLUMNS", "chargeback",
           "Savings", "savings"]

#: the kinds of usage line: a cloud instance's bill; its boot disk's; an on-prem rank's electricity; its amortised
#: capital; cloud instance time no job used; on-prem GPU time no attempt held (the last two: :data:`UNALLOCATED_LINES`)
LINES = ("instance", "disk", "energy", "amortised", "idle", "idle_amortised")
#: lines that are no job's cost (idle capacity): with the job lines they add up to the provider's or pool's total
UNALLOCATED_LINES = ("idle", "idle_amortised")
#: lines whose GPU-hours are GPU time used by a job (an on-prem rank's amortised line covers its energy line's GPUs
#: again; a disk has no GPU; idle lines are GPU time nobody used)
GPU_HOUR_LINES = ("instance", "energy")
#: the unit each line's list price is per, by line (FOCUS ``PricingUnit`` values)
PRICING_UNITS = {"instance": "Hours", "disk": "GB-Months", "energy": "kWh", "amortised": "GPU-Hours",
                 "idle": "Hours", "idle_amortised": "GPU-Hours"}


class UsageError(ValueError):
    """A usage record could not be built: names the field and the value."""


def _check_amount(name: str, v: float | None, *, signed: bool = False) -> None:
    if v is None:
        return
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UsageError(f"{name}={v!r}: not a finite number (give None with a reason for an unknown figure)")
    if v < 0 and not signed:
        raise UsageError(f"{name}={v!r}: must be >= 0")


@dataclass(frozen=True)
class UsageRecord:
    """One metered resource of one attempt rank.

    Attributes:
        job_id, attempt, rank: the attempt rank metered.
        line: one of :data:`LINES`.
        resource: the resource's id (cloud instance id, or on-prem node name).
        team, project: whom it is charged to (``project`` ``None`` while jobs carry none).
        start, end: UTC instants of the metered window (``end >= start``).
        provider: ``"aws"``, ``"gcp"`` or ``"onprem"``.
        region, zone: cloud region and zone; on-prem: the pool's price zone as region, ``None`` zone.
        pool: the on-prem pool (``None`` for cloud).
        instance_type, market: the cloud instance type and ``"spot"``/``"on_demand"`` (``None`` on-prem).
        gpu_type, gpu_count: the rank's GPUs.
        run_s: seconds in the window.
        billed_s: seconds billed (:func:`pricing.billing.billed_seconds`); on-prem: ``run_s``.
        list_unit_price_usd: the list price of one ``pricing_unit``, USD (FOCUS ``ListUnitPrice``): the
            instance's USD per hour; energy: the mean tariff over the window, USD per kWh; amortised: USD
            per GPU-hour.
        pricing_unit: what ``list_unit_price_usd`` is per (FOCUS ``PricingUnit``): ``"Hours"``,
            ``"kWh"``, ``"GPU-Hours"`` (:data:`PRICING_UNITS`).
        billed_usd: what the line costs, USD (energy may be negative at negative prices); ``None``: unknown.
        energy_kwh: facility energy, kWh (0 for the amortised line); ``None``: unknown.
        carbon_kg: kgCO2e, location-based; ``None``: unknown.
        estimated: some figure is an estimate or unknown; ``estimate_reasons`` says which and why.
        source: ``"live"`` (the broker) or ``"sim"`` (a simulated run).
        price_source: where the line's price came from (:mod:`broker.service.ledger`): a cloud line's live
            cloud price source (``aws-spot-history``, ``aws-price-list``, ``gcp-billing-catalog``),
            ``launch-price`` (the USD/h the provisioner priced the offer at) or ``bundled-catalog``; an energy
            line's tariff origins as the live planner labels them (a source name, ``last-known:<source>``,
            ``forecast-model``, ``interpolated``, ``conservative``, ``bundled-replay``); several joined by ``+``
            in order of first use. ``None`` on lines priced at fixed rates (a disk's list price, a pool's
            amortised USD/GPU-h), on simulated records and on records written before the field existed.
            A price that was not the measured or live one also sets ``estimated`` with the reason.
    """

    job_id: str
    attempt: int
    rank: int
    line: str
    resource: str
    team: str
    start: datetime
    end: datetime
    provider: str
    gpu_type: str
    gpu_count: int
    run_s: float
    billed_s: float
    list_unit_price_usd: float | None
    billed_usd: float | None
    energy_kwh: float | None
    carbon_kg: float | None
    pricing_unit: str = "Hours"
    project: str | None = None
    region: str | None = None
    zone: str | None = None
    pool: str | None = None
    instance_type: str | None = None
    market: str | None = None
    estimated: bool = False
    estimate_reasons: tuple[str, ...] = field(default_factory=tuple)
    source: str = "live"
    price_source: str | None = None

    def __post_init__(self) -> None:
        if self.line not in LINES:
            raise UsageError(f"line={self.line!r}: not one of {', '.join(LINES)}")
        for name in ("start", "end"):
            v = getattr(self, name)
            if not isinstance(v, datetime) or v.tzinfo is None:
                raise UsageError(f"{name}={v!r}: needs a timezone-aware UTC datetime")
        if self.end < self.start:
            raise UsageError(f"end={self.end.isoformat()!r}: before start={self.start.isoformat()!r} "
                             f"({self.job_id} attempt {self.attempt} rank {self.rank})")
        if self.pricing_unit != PRICING_UNITS[self.line]:
            raise UsageError(f"pricing_unit={self.pricing_unit!r}: {'an' if self.line[0] in 'aeiou' else 'a'} "
                             f"{self.line} line is priced per "
                             f"{PRICING_UNITS[self.line]!r}")
        if not self.provider:
            raise UsageError(f"provider={self.provider!r}: empty")
        if self.gpu_count < 0:
            raise UsageError(f"gpu_count={self.gpu_count!r}: must be >= 0")
        for name in ("run_s", "billed_s", "energy_kwh", "carbon_kg", "list_unit_price_usd"):
            _check_amount(name, getattr(self, name), signed=name == "list_unit_price_usd")
        _check_amount("billed_usd", self.billed_usd, signed=True)
        unknown = [n for n in ("billed_usd", "energy_kwh", "carbon_kg") if getattr(self, n) is None]
        if unknown and not (self.estimated and self.estimate_reasons):
            raise UsageError(f"{unknown[0]}=None: an unknown figure needs estimated=True and a reason")
        if self.estimated and not self.estimate_reasons:
            raise UsageError("estimate_reasons=(): an estimated record must say why")
        if self.source not in ("live", "sim"):
            raise UsageError(f"source={self.source!r}: not 'live' or 'sim'")

    @property
    def gpu_hours(self) -> float:
        """GPU-hours of the window, ``gpu_count x run_s / 3600``. An on-prem rank has two lines over the same
        GPUs (``energy`` and ``amortised``): count GPU-hours used by jobs from :data:`GPU_HOUR_LINES` only."""
        return self.gpu_count * self.run_s / 3600.0

    def to_dict(self) -> dict:
        """The record as a dict of plain values (datetimes kept; ``estimate_reasons`` a list)."""
        d = asdict(self)
        d["estimate_reasons"] = list(self.estimate_reasons)
        return d


#: what :func:`summarise` groups by: a record's team, project, provider, region, pool, line (:data:`LINES`: the
#: unallocated lines apart), or UTC day of its start
SUMMARY_DIMENSIONS = ("team", "project", "provider", "region", "pool", "line", "day")


@dataclass
class UsageTotals:
    """The sums of a group of usage records (one key of :func:`summarise`).

    Attributes:
        key: the group's value of the dimension (``None``: records without one, e.g. the pool of a cloud line;
            ``day``: ``YYYY-MM-DD``, the UTC day the record starts); ``None`` for the total of all groups.
        cost_usd: the sum of the known ``billed_usd``, USD.
        gpu_hours: GPU-hours of the :data:`GPU_HOUR_LINES` (not ``amortised``: the same GPUs again; not idle).
        energy_kwh: the sum of the known ``energy_kwh`` (facility energy, kWh).
        carbon_kg: the sum of the known ``carbon_kg`` (kgCO2e, location-based).
        lines: records in the group.
        estimated_lines: records with ``estimated=True`` (some figure modelled, interpolated or unknown).
        unpriced_lines, unknown_energy_lines, unknown_carbon_lines: records whose ``billed_usd``,
            ``energy_kwh`` or ``carbon_kg`` is unknown (``None``): not in the sums, never counted as 0.
    """

    key: str | None = None
    cost_usd: float = 0.0
    gpu_hours: float = 0.0
    energy_kwh: float = 0.0
    carbon_kg: float = 0.0
    lines: int = 0
    estimated_lines: int = 0
    unpriced_lines: int = 0
    unknown_energy_lines: int = 0
    unknown_carbon_lines: int = 0

    def add(self, r: UsageRecord) -> None:
        """Add one record to the sums."""
        self.lines += 1
        self.estimated_lines += r.estimated
        if r.billed_usd is None:
            self.unpriced_lines += 1
        else:
            self.cost_usd += r.billed_usd
        if r.energy_kwh is None:
            self.unknown_energy_lines += 1
        else:
            self.energy_kwh += r.energy_kwh
        if r.carbon_kg is None:
            self.unknown_carbon_lines += 1
        else:
            self.carbon_kg += r.carbon_kg
        if r.line in GPU_HOUR_LINES:
            self.gpu_hours += r.gpu_hours


def total_of(groups: Iterable[UsageTotals]) -> UsageTotals:
    """The sum of ``groups`` (key ``None``)."""
    t = UsageTotals()
    for g in groups:
        for name in ("cost_usd", "gpu_hours", "energy_kwh", "carbon_kg", "lines", "estimated_lines",
                     "unpriced_lines", "unknown_energy_lines", "unknown_carbon_lines"):
            setattr(t, name, getattr(t, name) + getattr(g, name))
    return t


def _key(r: UsageRecord, by: str) -> str | None:
    if by == "day":
        return r.start.astimezone(timezone.utc).date().isoformat()
    return getattr(r, by)


def summarise(records: Iterable[UsageRecord], by: str) -> tuple[list[UsageTotals], UsageTotals]:
    """Cost (USD), GPU-hours, kWh and kgCO2e of ``records`` grouped by ``by`` (one of
    :data:`SUMMARY_DIMENSIONS`). Returns ``(groups, total)``: the groups by key (``None`` last), and their sum.
    Raises :class:`UsageError` naming ``by`` for an unknown dimension."""
    if by not in SUMMARY_DIMENSIONS:
        raise UsageError(f"by={by!r}: not one of {', '.join(SUMMARY_DIMENSIONS)}")
    groups: dict[str | None, UsageTotals] = {}
    total = UsageTotals()
    for r in records:
        k = _key(r, by)
        groups.setdefault(k, UsageTotals(key=k)).add(r)
        total.add(r)
    return sorted(groups.values(), key=lambda g: (g.key is None, g.key or "")), total


#: the ledger's CSV columns: the :class:`UsageRecord` fields in declaration order (instants UTC ISO 8601,
#: ``estimate_reasons`` joined with ``"; "``, an unknown figure an empty cell). Live and simulated records
#: (``source``) are written alike, so one report reads both.
USAGE_CSV_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(UsageRecord))
_FLOATS = ("run_s", "billed_s", "list_unit_price_usd", "billed_usd", "energy_kwh", "carbon_kg")
_INTS = ("attempt", "rank", "gpu_count")
_OPTIONAL = ("project", "region", "zone", "pool", "instance_type", "market", "price_source")
#: columns a file may lack (written before the column existed): read as ``None``
_ADDED = ("price_source",)


_GET = attrgetter(*USAGE_CSV_COLUMNS)
_AT = {n: i for i, n in enumerate(USAGE_CSV_COLUMNS)}
_FLOAT_AT = tuple(_AT[n] for n in _FLOATS)


def _open(path: Path, mode: str):
    if str(path).endswith(".gz"):  # level 6: ~2.5x faster than 9 for ~4 % more bytes (the demo's records)
        return gzip.open(path, mode + "t", encoding="utf-8", newline="", compresslevel=6)
    return open(path, mode, encoding="utf-8", newline="")


def _row(r: UsageRecord) -> list:
    row = list(_GET(r))  # None is written as an empty cell, ints as digits
    for i in _FLOAT_AT:
        if row[i] is not None:
            row[i] = round(row[i], 9)  # 1e-9 USD/kWh/kg: far below a cent, keeps the file short
    row[_AT["start"]] = row[_AT["start"]].isoformat()
    row[_AT["end"]] = row[_AT["end"]].isoformat()
    row[_AT["estimated"]] = "true" if row[_AT["estimated"]] else "false"
    row[_AT["estimate_reasons"]] = "; ".join(row[_AT["estimate_reasons"]])
    return row


def write_usage_csv(records: Iterable[UsageRecord], path: str | Path) -> Path:
    """Write ``records`` to ``path`` as CSV with :data:`USAGE_CSV_COLUMNS` (gzip-compressed when the name ends in
    ``.gz``). Returns the path. Raises ``OSError`` if it cannot be written."""
    path = Path(path)
    with _open(path, "w") as f:
        w = csv.writer(f)
        w.writerow(USAGE_CSV_COLUMNS)
        w.writerows(map(_row, records))
    return path


def read_usage_csv(path: str | Path) -> list[UsageRecord]:
    """The records of a file written by :func:`write_usage_csv` (``.gz`` read compressed). Raises
    :class:`UsageError` naming the column and row for a missing column or a bad value."""
    path = Path(path)
    out = []
    with _open(path, "r") as f:
        rd = csv.DictReader(f)
        missing = [c for c in USAGE_CSV_COLUMNS if c not in (rd.fieldnames or ()) and c not in _ADDED]
        if missing:
            raise UsageError(f"{path}: column {missing[0]!r} missing")
        for i, row in enumerate(rd, start=2):
            try:
                d: dict = {k: row.get(k) or "" if k in _ADDED else row[k] for k in USAGE_CSV_COLUMNS}
                for k in _FLOATS:
                    d[k] = float(d[k]) if d[k] != "" else None
                for k in _INTS:
                    d[k] = int(d[k])
                for k in _OPTIONAL:
                    d[k] = d[k] or None
                d["start"], d["end"] = datetime.fromisoformat(d["start"]), datetime.fromisoformat(d["end"])
                d["estimated"] = d["estimated"] == "true"
                d["estimate_reasons"] = tuple(x for x in d["estimate_reasons"].split("; ") if x)
                out.append(UsageRecord(**d))
            except (ValueError, TypeError) as e:
                raise UsageError(f"{path} line {i}: {e}") from None
    return out


#: the chargeback table's figures per team (:func:`chargeback`): units in the names
CHARGEBACK_COLUMNS = ("cloud_usd", "onprem_energy_usd", "amortised_usd", "total_usd", "idle_usd", "energy_kwh",
                      "carbon_kg", "gpu_hours", "unknown_lines")


def chargeback(records: Iterable[UsageRecord]) -> dict[str, dict[str, float]]:
    """Per team, what its usage lines add up to (:data:`CHARGEBACK_COLUMNS`): ``cloud_usd`` (instance and disk
    lines), ``onprem_energy_usd`` (energy lines), ``amortised_usd`` (amortised lines), ``total_usd`` (their sum),
    ``idle_usd`` (cloud ``idle`` lines of the team's instances: unallocated, not in ``total_usd``; the pools'
    ``idle_amortised`` lines have no team and are left out),
    ``energy_kwh``, ``carbon_kg`` (kgCO2e, location-based), ``gpu_hours`` (instance and energy lines: an
    on-prem rank's amortised line covers the same GPUs) and ``unknown_lines`` (lines with some figure unknown,
    counted as 0 here and flagged in the record). Teams sorted by ``total_usd``, highest first."""
    teams: dict[str, dict[str, float]] = {}
    key = {"instance": "cloud_usd", "disk": "cloud_usd", "energy": "onprem_energy_usd", "amortised": "amortised_usd",
           "idle": "idle_usd"}
    for r in records:
        if r.line == "idle_amortised":
            continue
        t = teams.get(r.team)
        if t is None:
            t = teams[r.team] = dict.fromkeys(CHARGEBACK_COLUMNS, 0.0)
        if r.billed_usd is not None:
            t[key[r.line]] += r.billed_usd
            if r.line not in UNALLOCATED_LINES:
                t["total_usd"] += r.billed_usd
        t["energy_kwh"] += r.energy_kwh or 0.0
        t["carbon_kg"] += r.carbon_kg or 0.0
        if r.line in GPU_HOUR_LINES:
            t["gpu_hours"] += r.gpu_hours
        if r.billed_usd is None or r.energy_kwh is None or r.carbon_kg is None:
            t["unknown_lines"] += 1
    return dict(sorted(teams.items(), key=lambda kv: (-kv[1]["total_usd"], kv[0])))


@dataclass(frozen=True)
class Savings:
    """The actual cost of a set of usage records against two counterfactual placements of the same work
    (:func:`savings`). USD; GPU-hours of the work compared.

    Attributes:
        gpu_hours: GPU-hours of the units compared (their :data:`GPU_HOUR_LINES`).
        actual_usd: what those units cost where they ran: their job lines (instance, disk, energy, amortised).
        cheapest_cloud_usd: the same GPU-hours at the cheapest cloud USD per GPU-hour of their GPU type.
        onprem_only_usd: the same GPU-hours at the on-prem USD per GPU-hour of their GPU type.
        saved_vs_cheapest_cloud_usd, saved_vs_onprem_only_usd: ``cheapest_cloud_usd - actual_usd`` and
            ``onprem_only_usd - actual_usd`` (positive when the actual placements cost less).
        The money figures are summed exactly at :data:`broker.money.QUANTUM` (1e-10 USD): no float noise, so
        equal costs save exactly 0.
        units, not_compared_units, not_compared_gpu_hours: units (one attempt rank's lines on one resource)
            compared, and left out: a unit with a line of unknown cost, or whose GPU type has no rate on one
            side (``reasons`` says which).
        cloud_usd_per_gpu_hour, onprem_usd_per_gpu_hour: the rates used, by GPU type.
        reasons: why units were left out, one line per cause.
    """

    gpu_hours: float = 0.0
    actual_usd: float = 0.0
    cheapest_cloud_usd: float = 0.0
    onprem_only_usd: float = 0.0
    units: int = 0
    not_compared_units: int = 0
    not_compared_gpu_hours: float = 0.0
    saved_vs_cheapest_cloud_usd: float = 0.0
    saved_vs_onprem_only_usd: float = 0.0
    cloud_usd_per_gpu_hour: dict[str, float] = field(default_factory=dict)
    onprem_usd_per_gpu_hour: dict[str, float] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()



def savings(records: Iterable[UsageRecord], cloud_usd_per_gpu_hour: Mapping[str, float],
            onprem_usd_per_gpu_hour: Mapping[str, float]) -> Savings:
    """What ``records``' jobs cost where they ran against "all on the cheapest cloud now" and "on-prem only".

    The work is grouped in units: one attempt rank's job lines on one resource (a cloud instance with its
    disk, or an on-prem rank's energy and amortised lines); unallocated lines (:data:`UNALLOCATED_LINES`) are
    no job's and are left out. A unit's work is its GPU-hours (:data:`GPU_HOUR_LINES`) of its GPU type; the
    counterfactuals price that work at ``cloud_usd_per_gpu_hour[type]`` and ``onprem_usd_per_gpu_hour[type]``
    (USD per GPU-hour). A unit with a line of unknown cost, or a type missing from either rate table, is left
    out of all three sums (counted, with the reason), so the three figures always cover the same work.
    Raises :class:`UsageError` naming a rate that is negative or not finite."""
    for name, table in (("cloud_usd_per_gpu_hour", cloud_usd_per_gpu_hour),
                        ("onprem_usd_per_gpu_hour", onprem_usd_per_gpu_hour)):
        for k, v in table.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UsageError(f"{name}[{k!r}]={v!r}: must be a finite USD per GPU-hour >= 0")
    units: dict[tuple, list[UsageRecord]] = {}
    for r in records:
        if r.line in UNALLOCATED_LINES:
            continue
        units.setdefault((r.job_id, r.attempt, r.rank, r.resource), []).append(r)
    out = dict(gpu_hours=0.0, units=0, not_compared_units=0, not_compared_gpu_hours=0.0)
    # the money sums in decimal at broker.money's resolution: a saving that is 0 is 0, not 2.2e-16
    actual = cheapest = onprem = exact(0)
    why: dict[str, int] = {}
    for lines in units.values():
        gh = sum(r.gpu_hours for r in lines if r.line in GPU_HOUR_LINES)
        gpu_type = next((r.gpu_type for r in lines if r.line in GPU_HOUR_LINES), lines[0].gpu_type)
        if any(r.billed_usd is None for r in lines):
            cause = "a line of unknown cost"
        elif gpu_type not in cloud_usd_per_gpu_hour:
            cause = f"{gpu_type}: no cloud rate"
        elif gpu_type not in onprem_usd_per_gpu_hour:
            cause = f"{gpu_type}: no on-prem rate"
        else:
            cause = None
        if cause is not None:
            why[cause] = why.get(cause, 0) + 1
            out["not_compared_units"] += 1
            out["not_compared_gpu_hours"] += gh
            continue
        out["units"] += 1
        out["gpu_hours"] += gh
        actual += sum((exact(r.billed_usd) for r in lines), exact(0))
        cheapest += exact(gh * cloud_usd_per_gpu_hour[gpu_type])
        onprem += exact(gh * onprem_usd_per_gpu_hour[gpu_type])
    out.update(actual_usd=float(actual), cheapest_cloud_usd=float(cheapest), onprem_only_usd=float(onprem),
               saved_vs_cheapest_cloud_usd=float(cheapest - actual), saved_vs_onprem_only_usd=float(onprem - actual))
    return Savings(**out, cloud_usd_per_gpu_hour=dict(cloud_usd_per_gpu_hour),
                   onprem_usd_per_gpu_hour=dict(onprem_usd_per_gpu_hour),
                   reasons=tuple(f"{n} unit(s) left out: {c}" for c, n in sorted(why.items())))
