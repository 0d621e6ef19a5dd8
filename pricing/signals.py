"""Grid signals per zone for the planner: carbon intensity and electricity price.

``load_grid_signals(zones) -> GridSignals``; ``GridSignals.carbon(zone)`` is an
:class:`~pricing.series.HourlySeries` in gCO2e/kWh, ``GridSignals.price(zone)``
one in USD/MWh or ``None`` when the zone has no bundled price series (e.g.
BR-SP, IN-WE, CL-SIC, ZA: carbon only). Both on UTC hours, 2023-2024, from
the bundle (see :mod:`pricing.carbon`, :mod:`pricing.electricity`).

Errors: :class:`pricing.errors.UnknownZoneError` (a ``ValueError``) when a
zone has no carbon series, or is asked of a ``GridSignals`` that does not hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from pricing.carbon import load_carbon_intensity
from pricing.electricity import available_price_zones, load_electricity_price
from pricing.errors import UnknownZoneError
from pricing.series import HourlySeries

__all__ = ["GridSignals", "load_grid_signals"]


@dataclass(frozen=True)
class GridSignals:
    """Carbon (gCO2e/kWh) and price (USD/MWh) hourly series by grid zone.

    Attributes:
        carbon_series: zone -> carbon-intensity series, gCO2e/kWh.
        price_series: zone -> electricity price series, USD/MWh (only zones that have one).
    """

    carbon_series: Mapping[str, HourlySeries] = field(default_factory=dict)
    price_series: Mapping[str, HourlySeries] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "carbon_series", MappingProxyType(dict(self.carbon_series)))
        object.__setattr__(self, "price_series", MappingProxyType(dict(self.price_series)))

    @property
    def zones(self) -> tuple[str, ...]:
        """Sorted zones held (every zone has a carbon series)."""
        return tuple(sorted(self.carbon_series))

    def carbon(self, zone: str) -> HourlySeries:
        """Carbon intensity of ``zone``, gCO2e/kWh, UTC hours. Raises :class:`UnknownZoneError` if not held."""
        try:
            return self.carbon_series[zone]
        except KeyError:
            raise UnknownZoneError(zone, "carbon-intensity (in these GridSignals)", self.carbon_series) from None

    def price(self, zone: str) -> HourlySeries | None:
        """Electricity price of ``zone``, USD/MWh, UTC hours; ``None`` if the zone has no price series.

        Raises :class:`UnknownZoneError` if the zone is not held at all.
        """
        if zone not in self.carbon_series:
            raise UnknownZoneError(zone, "grid-signal (in these GridSignals)", self.carbon_series)
        return self.price_series.get(zone)


def load_grid_signals(zones: Iterable[str]) -> GridSignals:
    """Load bundled carbon (required) and price (when available) series for ``zones``.

    Duplicates are loaded once; series are shared with the loaders' caches.
    Raises :class:`UnknownZoneError` naming a zone with no carbon series.
    """
    carbon: dict[str, HourlySeries] = {}
    price: dict[str, HourlySeries] = {}
    priced = set(available_price_zones())
    for z in dict.fromkeys(zones):
        carbon[z] = load_carbon_intensity(z)
        if z in priced:
            price[z] = load_electricity_price(z)
    return GridSignals(carbon, price)
