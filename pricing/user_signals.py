"""Bring your own history: hourly carbon and price series from a folder of CSV files.

``fedbroker simulate --signals DIR`` replays these in place of the bundled
2023-2024 series, so a team can evaluate a policy on its own grid data.

**Schema.** Every ``*.csv`` file directly in ``DIR`` (any name) has a header row
and these columns, in any order (other columns are ignored)::

    zone,hour_utc,value,unit,quality
    DE-LU,2025-03-30T00:00Z,312.5,gCO2e/kWh,measured
    DE-LU,2025-03-30T01:00Z,,gCO2e/kWh,measured        <- empty value: a missing hour
    DE-LU,2025-03-30T00:00Z,-4.20,EUR/MWh,estimated      <- prices may be negative

* ``zone``: the grid zone id the pools and cloud regions use (``DE-LU``, ``US-CAL-CISO``, ...).
* ``hour_utc``: the start of the hour, ISO 8601, on the hour; a time with no offset is read as UTC, one with
  an offset is converted to UTC.
* ``value``: a number; empty for a missing hour (never write 0 for "unknown").
* ``unit``: ``gCO2e/kWh`` or ``kgCO2e/MWh`` (the same number) for carbon intensity; ``<CUR>/MWh`` or
  ``<CUR>/kWh`` for a price, ``CUR`` an ISO 4217 code of :data:`pricing.fx.USD_PER_UNIT` (converted to USD/MWh
  at that table's dated rate). The unit says whether a row is carbon or price.
* ``quality``: ``measured`` or ``estimated`` (estimated hours are counted and reported).

One zone keeps one unit per kind; a (zone, kind, hour) given twice with different values is an error naming
both lines.

**Hygiene** (the rules of :mod:`pricing.hygiene`): each (zone, kind) series spans its first to its last hour;
runs of at most :data:`pricing.hygiene.MAX_INTERPOLATED_GAP_H` missing hours between two values are
interpolated (estimated); longer gaps take the bundled series of the same zone for those hours if it has them,
then a conservative value (the 95th percentile of the zone's known values, never 0 for carbon:
:func:`pricing.hygiene.conservative_value`).

Errors: :class:`UserSignalsError` (a ``ValueError``) naming the file, line, field and value.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import numpy as np

from pricing.errors import UnknownCurrencyError
from pricing.fx import usd_per_unit
from pricing.hygiene import CheckedSeries, conservative_value, fill_gaps
from pricing.series import HourlySeries
from pricing.signals import GridSignals

__all__ = ["UserSignals", "UserSignalsError", "load_user_signals", "grid_signals_with", "COLUMNS", "CARBON_UNITS"]

#: Required columns of a user signal CSV.
COLUMNS = ("zone", "hour_utc", "value", "unit", "quality")
#: Accepted carbon units and the factor to gCO2e/kWh.
CARBON_UNITS = {"gCO2e/kWh": 1.0, "kgCO2e/MWh": 1.0}
_QUALITY = ("measured", "estimated")


class UserSignalsError(ValueError):
    """A user signal file is malformed: names the file, line, field and value."""


@dataclass
class UserSignals:
    """User-provided series after the hygiene rules.

    Attributes:
        carbon: zone -> carbon intensity, gCO2e/kWh.
        price: zone -> electricity price, USD/MWh.
        files: the CSV files read.
        rows: data rows read.
    """

    carbon: dict[str, CheckedSeries] = field(default_factory=dict)
    price: dict[str, CheckedSeries] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    rows: int = 0

    def summary(self) -> list[str]:
        """One line per series: kind, zone, UTC span, hours, estimated hours and how the gaps were filled."""
        out = []
        for kind, d in (("carbon", self.carbon), ("price", self.price)):
            for z, c in sorted(d.items()):
                s = c.series
                a = datetime.fromtimestamp(s.start_s, tz=timezone.utc).isoformat(timespec="minutes")
                b = datetime.fromtimestamp(s.end_s, tz=timezone.utc).isoformat(timespec="minutes")
                filled = {k: v for k, v in c.counts().items() if k not in ("user",)}
                out.append(f"{kind} {z}: {a}..{b}, {s.values.size} h, {int(c.estimated.sum())} estimated"
                           + (f" ({', '.join(f'{k} {v}' for k, v in sorted(filled.items()))})" if filled else ""))
        return out


def _kind_of(unit: str, where: str) -> tuple[str, float, str]:
    """``(kind, factor to the project unit, project unit)`` of a unit string."""
    if unit in CARBON_UNITS:
        return "carbon", CARBON_UNITS[unit], "gCO2e/kWh"
    cur, _, per = unit.partition("/")
    if per in ("MWh", "kWh") and cur:
        try:
            rate = usd_per_unit(cur)
        except UnknownCurrencyError as e:
            raise UserSignalsError(f"{where}: unit={unit!r}: {e}") from None
        return "price", rate * (1000.0 if per == "kWh" else 1.0), "USD/MWh"
    raise UserSignalsError(f"{where}: unit={unit!r}: use gCO2e/kWh, kgCO2e/MWh, <CUR>/MWh or <CUR>/kWh")


def _hour(text: str, where: str) -> float:
    s = text.strip()
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise UserSignalsError(f"{where}: hour_utc={text!r}: not an ISO 8601 time") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    x = t.timestamp()
    if x % 3600.0:
        raise UserSignalsError(f"{where}: hour_utc={text!r}: not on the hour (give hourly values)")
    return x


def load_user_signals(folder: str | Path, *, bundled_fallback: bool = True) -> UserSignals:
    """Read every ``*.csv`` in ``folder`` (schema in the module docstring) and apply the hygiene rules.

    ``bundled_fallback``: fill long gaps from the bundled series of the same zone where it has the hours.
    Raises :class:`UserSignalsError` for a missing folder, no CSV file, or a malformed row.
    """
    d = Path(folder)
    if not d.is_dir():
        raise UserSignalsError(f"signals={str(folder)!r}: not a folder")
    files = sorted(p for p in d.glob("*.csv") if p.is_file())
    if not files:
        raise UserSignalsError(f"signals={str(folder)!r}: no *.csv file (columns: {', '.join(COLUMNS)})")
    # (kind, zone) -> {"unit": project unit, "src": unit as given, "rows": {hour: (value, estimated, where)}}
    acc: dict[tuple[str, str], dict] = {}
    n_rows = 0
    for f in files:
        with f.open(newline="", encoding="utf-8-sig") as fh:
            rd = csv.DictReader(fh)
            missing = [c for c in COLUMNS if c not in (rd.fieldnames or [])]
            if missing:
                raise UserSignalsError(f"{f.name}: missing column(s) {', '.join(missing)} "
                                       f"(need {', '.join(COLUMNS)})")
            for line, row in enumerate(rd, start=2):
                where = f"{f.name}:{line}"
                zone = (row["zone"] or "").strip()
                if not zone:
                    raise UserSignalsError(f"{where}: zone is empty")
                unit = (row["unit"] or "").strip()
                kind, factor, punit = _kind_of(unit, where)
                q = (row["quality"] or "").strip().lower()
                if q not in _QUALITY:
                    raise UserSignalsError(f"{where}: quality={row['quality']!r}: use measured or estimated")
                t = _hour(row["hour_utc"] or "", where)
                raw = (row["value"] or "").strip()
                if raw:
                    try:
                        v = float(raw)
                    except ValueError:
                        raise UserSignalsError(f"{where}: value={raw!r}: not a number") from None
                    if not np.isfinite(v):
                        raise UserSignalsError(f"{where}: value={raw!r}: not finite")
                    if kind == "carbon" and v < 0:
                        raise UserSignalsError(f"{where}: value={raw!r}: a carbon intensity cannot be negative")
                    v *= factor
                else:
                    v = float("nan")
                ent = acc.setdefault((kind, zone), {"unit": punit, "src": unit, "rows": {}})
                if ent["src"] != unit:
                    raise UserSignalsError(f"{where}: unit={unit!r}: zone {zone!r} already has {kind} in "
                                           f"{ent['src']!r}")
                old = ent["rows"].get(t)
                if old is not None and not (old[0] == v or (np.isnan(old[0]) and np.isnan(v))):
                    raise UserSignalsError(f"{where}: zone {zone!r} hour {row['hour_utc']!r} already given "
                                           f"{kind} {old[0] / factor:g} at {old[2]}; value {raw!r} conflicts")
                ent["rows"][t] = (v, q == "estimated", where)
                n_rows += 1
    out = UserSignals(files=files, rows=n_rows)
    for (kind, zone), ent in sorted(acc.items()):
        hours = sorted(ent["rows"])
        t0 = hours[0]
        n = int((hours[-1] - t0) / 3600.0) + 1
        vals = np.full(n, np.nan)
        est = np.zeros(n, dtype=bool)
        for t, (v, e, _) in ent["rows"].items():
            i = int((t - t0) / 3600.0)
            vals[i], est[i] = v, e
        if np.isnan(vals).all():
            raise UserSignalsError(f"zone {zone!r}: every {kind} value is empty")
        s = CheckedSeries.of(HourlySeries(zone, ent["unit"], t0, vals), "user", est)
        fallbacks, refs = [], [s.series]
        if bundled_fallback:
            b = _bundled(kind, zone, t0, t0 + n * 3600.0)
            if b is not None:
                fallbacks.append(b)
                refs.append(b.series)
        cons = conservative_value(kind, refs)
        filled = fill_gaps(s, fallbacks, conservative=cons, kind=kind)
        (out.carbon if kind == "carbon" else out.price)[zone] = filled
    return out


def _bundled(kind: str, zone: str, start_s: float, end_s: float) -> CheckedSeries | None:
    """The bundled series of ``zone`` on ``[start_s, end_s)`` or ``None`` if the bundle has no such zone."""
    from pricing.errors import UnknownZoneError
    from pricing.sources import BundledCarbon, BundledPrice

    src = BundledCarbon() if kind == "carbon" else BundledPrice()
    try:
        return src.history(zone, start_s, end_s)
    except UnknownZoneError:
        return None


def grid_signals_with(zones: Iterable[str], user: UserSignals) -> GridSignals:
    """:class:`GridSignals` for ``zones``: the user's series where given, the bundled ones elsewhere.

    Raises :class:`pricing.errors.UnknownZoneError` for a zone with a carbon series in neither.
    """
    from pricing.carbon import load_carbon_intensity
    from pricing.electricity import available_price_zones, load_electricity_price

    carbon: dict[str, HourlySeries] = {}
    price: dict[str, HourlySeries] = {}
    priced = set(available_price_zones())
    for z in dict.fromkeys(zones):
        carbon[z] = user.carbon[z].series if z in user.carbon else load_carbon_intensity(z)
        if z in user.price:
            price[z] = user.price[z].series
        elif z in priced:
            price[z] = load_electricity_price(z)
    return GridSignals(carbon, price)
