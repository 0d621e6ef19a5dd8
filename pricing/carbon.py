"""Hourly grid carbon intensity per zone, from the bundle.

Data: Electricity Maps hourly **life-cycle (LCA)** carbon intensity in
gCO2e/kWh, via HewlettPackard/green-dcc (see ``pricing/data/SOURCES.md``),
hourly UTC 2023-01-01 00:00 .. 2024-12-31 23:00, rounded to 0.1 gCO2e/kWh.
Zones JP-TK and IN-WE are estimated by Electricity Maps for every hour, SG for
~13% of hours (``pricing/data/carbon_zones.csv`` gives the share per zone).

Errors: :class:`pricing.errors.UnknownZoneError` (a ``ValueError``) names the
zone and lists the available ones.
"""

from __future__ import annotations

from functools import lru_cache

from pricing._wide import read_wide
from pricing.errors import UnknownZoneError
from pricing.series import HourlySeries

__all__ = ["CARBON_FILE", "CARBON_UNIT", "available_carbon_zones", "load_carbon_intensity"]

CARBON_FILE = "carbon_intensity_lca_2023-2024_utc.csv.gz"
CARBON_UNIT = "gCO2e/kWh"


def available_carbon_zones() -> tuple[str, ...]:
    """Sorted grid-zone ids that have a bundled carbon-intensity series."""
    return tuple(sorted(read_wide(CARBON_FILE)[1]))


@lru_cache(maxsize=None)
def load_carbon_intensity(zone: str) -> HourlySeries:
    """Hourly carbon intensity of grid ``zone`` (e.g. ``"DE-LU"``), gCO2e/kWh, UTC hours.

    Returns a cached :class:`HourlySeries` (do not mutate its values) of 17,544
    hours starting 2023-01-01 00:00 UTC.
    Raises :class:`UnknownZoneError` if ``zone`` has no bundled series.
    """
    start_s, cols = read_wide(CARBON_FILE)
    if zone not in cols:
        raise UnknownZoneError(zone, "carbon-intensity", cols)
    return HourlySeries(zone=zone, unit=CARBON_UNIT, start_s=start_s, values=cols[zone])
