"""Hourly wholesale electricity prices per grid zone, in USD/MWh, from the bundle.

The bundle (``pricing/data/electricity_prices_2023-2024_utc.csv.gz``) keeps
each market's ORIGINAL currency per MWh on UTC interval-start hours,
2023-01-01 00:00 .. 2024-12-31 23:00; ``electricity_price_zones.csv`` records
per zone its currency, market/node and how its source timestamps were read.
Conversion to USD happens here, at load time, with the single 2023-average
rate of :mod:`pricing.fx` — so a EUR price series is scaled by one constant.

Units of origin worth knowing (``pricing/data/SOURCES.md``): JP-TK is JEPX
JPY/kWh x 1000 = JPY/MWh; KR is KPX KRW/kWh x 1000 = KRW/MWh; AU-NSW/AU-VIC are
AEMO prices in AUD/MWh although the origin's column says USD; GB is EUR/MWh.
Prices can be negative. Missing hours are ``NaN`` (never 0).

Errors: :class:`pricing.errors.UnknownZoneError` (a ``ValueError``) names the
zone and lists the available ones.
"""

from __future__ import annotations

from functools import lru_cache

import pandas as pd

from pricing._data import data_path
from pricing._wide import read_wide
from pricing.errors import UnknownZoneError
from pricing.fx import usd_per_unit
from pricing.series import HourlySeries

__all__ = ["PRICE_FILE", "PRICE_UNIT", "available_price_zones", "price_currency", "load_electricity_price",
           "load_electricity_price_native"]

PRICE_FILE = "electricity_prices_2023-2024_utc.csv.gz"
PRICE_META_FILE = "electricity_price_zones.csv"
PRICE_UNIT = "USD/MWh"


@lru_cache(maxsize=1)
def _meta() -> dict[str, dict[str, str]]:
    df = pd.read_csv(data_path(PRICE_META_FILE), dtype=str)
    return {r["zone"]: r for r in df.to_dict("records")}


def available_price_zones() -> tuple[str, ...]:
    """Sorted grid-zone ids that have a bundled electricity price series."""
    return tuple(sorted(read_wide(PRICE_FILE)[1]))


def price_currency(zone: str) -> str:
    """ISO currency of ``zone``'s original price series (e.g. ``"EUR"``); raises :class:`UnknownZoneError`."""
    meta = _meta()
    if zone not in meta:
        raise UnknownZoneError(zone, "electricity-price", meta)
    return meta[zone]["currency"]


@lru_cache(maxsize=None)
def load_electricity_price_native(zone: str) -> HourlySeries:
    """Price series of ``zone`` in its original currency per MWh (unit e.g. ``"EUR/MWh"``), UTC hours.

    Raises :class:`UnknownZoneError` if ``zone`` has no bundled series.
    """
    start_s, cols = read_wide(PRICE_FILE)
    if zone not in cols:
        raise UnknownZoneError(zone, "electricity-price", cols)
    cur = price_currency(zone)
    return HourlySeries(zone=zone, unit=f"{cur}/MWh", start_s=start_s, values=cols[zone])


@lru_cache(maxsize=None)
def load_electricity_price(zone: str) -> HourlySeries:
    """Hourly electricity price of grid ``zone`` in **USD/MWh**, UTC hours (cached; do not mutate).

    ``native value x pricing.fx.usd_per_unit(currency)``; 17,544 hours from
    2023-01-01 00:00 UTC; ``NaN`` where the market file has no value.
    Raises :class:`UnknownZoneError` if ``zone`` has no bundled series.
    """
    native = load_electricity_price_native(zone)
    cur = price_currency(zone)
    return native.shifted(factor=usd_per_unit(cur), unit=PRICE_UNIT)
