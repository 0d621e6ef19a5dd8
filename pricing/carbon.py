"""Grid carbon intensity per zone, from the bundle: hourly series, or one annual figure.

Hourly data: Electricity Maps **life-cycle (LCA)** carbon intensity in
gCO2e/kWh (see ``pricing/data/SOURCES.md`` §1), hourly UTC 2023-01-01 00:00 ..
2024-12-31 23:00, rounded to 0.1 gCO2e/kWh. Zones JP-TK, IN-WE and IE are
estimated by Electricity Maps for every hour, SG for ~13% of hours
(``pricing/data/carbon_zones.csv`` gives the share per zone). Some zones have
source data for one year only (US-MIDW-MISO, US-NW-BPAT, US-NW-NEVP, CA-QC: 2023;
NL, US-CAR-SC: 2022); their other hours are copied from the same hour 52 weeks
earlier and the zone is flagged ``carbon_estimated``.

Annual data (``pricing/data/carbon_annual_zones.csv``): zones with no hourly
series get one published annual figure (Google Cloud region carbon data via
codecarbon, gCO2e/kWh), served as a constant series on the same 2023-2024 hourly
grid, and flagged ``carbon_estimated``.

:func:`carbon_estimated` says whether a zone's figure is such an estimate (our
substitution: an annual figure or another year's hours), so every offer and
option record that uses it can say so.

Errors: :class:`pricing.errors.UnknownZoneError` (a ``ValueError``) names the
zone and lists the available ones.
"""

from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

import numpy as np
import pandas as pd

from pricing._data import data_path
from pricing._wide import read_wide
from pricing.errors import UnknownZoneError
from pricing.series import HourlySeries

__all__ = ["CARBON_FILE", "CARBON_ANNUAL_FILE", "CARBON_ZONES_FILE", "CARBON_UNIT", "available_carbon_zones",
           "hourly_carbon_zones", "annual_carbon_zones", "carbon_estimated", "load_carbon_intensity"]

CARBON_FILE = "carbon_intensity_lca_2023-2024_utc.csv.gz"
CARBON_ZONES_FILE = "carbon_zones.csv"
CARBON_ANNUAL_FILE = "carbon_annual_zones.csv"
CARBON_UNIT = "gCO2e/kWh"


def hourly_carbon_zones() -> tuple[str, ...]:
    """Sorted grid-zone ids that have a bundled hourly carbon-intensity series."""
    return tuple(sorted(read_wide(CARBON_FILE)[1]))


@lru_cache(maxsize=1)
def annual_carbon_zones() -> MappingProxyType[str, float]:
    """Zone -> annual carbon intensity, gCO2e/kWh, for zones with no hourly series (``carbon_annual_zones.csv``)."""
    t = pd.read_csv(data_path(CARBON_ANNUAL_FILE))
    return MappingProxyType({str(z): float(v) for z, v in zip(t["zone"], t["gco2e_per_kwh"])})


def available_carbon_zones() -> tuple[str, ...]:
    """Sorted grid-zone ids with a carbon figure: hourly series and annual figures."""
    return tuple(sorted(set(hourly_carbon_zones()) | set(annual_carbon_zones())))


@lru_cache(maxsize=1)
def _estimated_hourly() -> frozenset[str]:
    t = pd.read_csv(data_path(CARBON_ZONES_FILE))
    return frozenset(str(z) for z, e in zip(t["zone"], t["carbon_estimated"]) if bool(e))


def carbon_estimated(zone: str) -> bool:
    """True when ``zone``'s carbon figure is our estimate: an annual figure, or an hourly series partly copied
    from another year (``carbon_zones.csv`` ``carbon_estimated``). Raises :class:`UnknownZoneError` if the zone
    has no carbon figure at all."""
    if zone in annual_carbon_zones():
        return True
    if zone in hourly_carbon_zones():
        return zone in _estimated_hourly()
    raise UnknownZoneError(zone, "carbon-intensity", available_carbon_zones())


@lru_cache(maxsize=None)
def load_carbon_intensity(zone: str) -> HourlySeries:
    """Carbon intensity of grid ``zone`` (e.g. ``"DE-LU"``), gCO2e/kWh, UTC hours.

    Returns a cached :class:`HourlySeries` (do not mutate its values) of 17,544
    hours starting 2023-01-01 00:00 UTC; for an annual-figure zone every hour
    holds that figure. Raises :class:`UnknownZoneError` if ``zone`` has no figure.
    """
    start_s, cols = read_wide(CARBON_FILE)
    if zone in cols:
        return HourlySeries(zone=zone, unit=CARBON_UNIT, start_s=start_s, values=cols[zone])
    annual = annual_carbon_zones()
    if zone in annual:
        n = next(iter(cols.values())).size
        values = np.full(n, annual[zone])
        values.setflags(write=False)
        return HourlySeries(zone=zone, unit=CARBON_UNIT, start_s=start_s, values=values)
    raise UnknownZoneError(zone, "carbon-intensity", available_carbon_zones())
