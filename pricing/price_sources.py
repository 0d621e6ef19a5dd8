"""Electricity price sources: an operator's tariff from config, and ENTSO-E day-ahead prices.

Both follow :mod:`pricing.sources` and return **USD/MWh** on UTC hours.

**Tariff** (:class:`Tariff`): the common on-prem case — a utility contract, not a
wholesale market. A fixed price, or time-of-use periods on *local* wall-clock
time in the site's IANA zone. Config (a mapping, e.g. read from YAML)::

    zone: toronto-site          # the price zone the pool names
    timezone: America/Toronto   # IANA zone of the periods
    currency: CAD               # ISO 4217, converted with pricing.fx
    per: kWh                    # the prices are per kWh or per MWh
    default: 0.098              # price outside every period (a fixed tariff: only this)
    periods:                    # optional; the first period that matches an hour wins
      - {name: on-peak, days: weekdays, start: "07:00", end: "19:00", price: 0.151}

``days`` is a list of ``mon``..``sun`` or one of ``all``, ``weekdays``,
``weekends``; ``start``/``end`` are ``HH:MM`` local (``end`` may be ``24:00``; an
``end`` before ``start`` wraps past midnight). An hour is priced by the local
time at its start, computed per UTC hour, so a 23-hour spring day and a 25-hour
autumn day come out with the hours they have. The tariff knows every hour:
``latest``, ``history`` and ``forecast`` are all exact (not estimated).

**ENTSO-E day-ahead** (:class:`EntsoeDayAhead`): the SDAC day-ahead prices of a
bidding zone through the maintained ``entsoe-py`` client
(``EntsoePandasClient.query_day_ahead_prices``; key from ``ENTSOE_API_KEY``).
Prices are EUR/MWh (converted with :mod:`pricing.fx`'s dated rate); hourly
before the 15-minute market time unit went live (2025-10-01, the client's
``QUARTER_MTU_SDAC_GOLIVE``), 15-minute after, averaged to hours with their
signs kept. The day-ahead prices of a past window are its ``history``; those
published for the coming day are the ``forecast``. Zone ids are the project's
(``DE-LU``) mapped to the client's areas (``DE_LU``) unless ``areas`` says
otherwise. ``entsoe-py`` logs each request's parameters, token included, at DEBUG: those records are
dropped by a filter on its logger.

Errors: :class:`TariffError` (a ``ValueError``) names the config field and value;
feed faults are :class:`pricing.sources.SourceError` subclasses.
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import datetime, timezone
from typing import Any, Mapping
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np

from pricing.errors import UnknownCurrencyError
from pricing.fx import usd_per_unit
from pricing.hygiene import CheckedSeries, hour_grid, to_hourly
from pricing.series import HourlySeries
from pricing.sources import (RateLimited, SignalSource, SourceAuthError, SourceUnavailable,
                             retry_after_seconds)

__all__ = ["Tariff", "TariffPeriod", "TariffError", "EntsoeDayAhead", "ENTSOE_KEY_ENV", "PRICE_UNIT"]

PRICE_UNIT = "USD/MWh"
#: Environment variable holding the ENTSO-E Transparency Platform security token.
ENTSOE_KEY_ENV = "ENTSOE_API_KEY"

_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_DAY_SETS = {"all": _DAYS, "weekdays": _DAYS[:5], "weekends": _DAYS[5:]}


class TariffError(ValueError):
    """A tariff config is malformed: names the field and the value."""


def _minutes(text: Any, field: str) -> int:
    """``"HH:MM"`` -> minutes after local midnight (``24:00`` -> 1440)."""
    s = str(text).strip()
    try:
        hh, mm = s.split(":")
        h, m = int(hh), int(mm)
    except ValueError:
        raise TariffError(f"{field}={text!r}: not HH:MM") from None
    if not (0 <= m < 60 and (0 <= h < 24 or (h == 24 and m == 0))):
        raise TariffError(f"{field}={text!r}: not a time of day between 00:00 and 24:00")
    return h * 60 + m


class TariffPeriod:
    """One time-of-use period: local ``days``, ``[start_min, end_min)`` minutes after midnight, price in USD/MWh."""

    def __init__(self, name: str, days: frozenset[int], start_min: int, end_min: int, usd_per_mwh: float):
        self.name, self.days, self.start_min, self.end_min, self.usd_per_mwh = (name, days, start_min, end_min,
                                                                                usd_per_mwh)

    def matches(self, weekday: int, minute: int) -> bool:
        """True if local ``weekday`` (0 = Monday) and ``minute`` after midnight fall in the period.

        A period that wraps past midnight (``end < start``) belongs to the day it starts on.
        """
        if self.start_min < self.end_min:
            return weekday in self.days and self.start_min <= minute < self.end_min
        if minute >= self.start_min:
            return weekday in self.days
        return (weekday - 1) % 7 in self.days and minute < self.end_min


class Tariff(SignalSource):
    """An operator's fixed or time-of-use electricity tariff (see the module docstring for the config)."""

    name = "tariff"
    kind = "price"
    unit = PRICE_UNIT

    def __init__(self, config: Mapping[str, Any]):
        if not isinstance(config, Mapping):
            raise TariffError(f"tariff: expected a mapping, got {type(config).__name__}")
        unknown = set(config) - {"zone", "timezone", "currency", "per", "default", "periods"}
        if unknown:
            raise TariffError(f"tariff: unknown field(s) {', '.join(sorted(unknown))}")
        for f in ("zone", "timezone", "currency", "default"):
            if f not in config:
                raise TariffError(f"tariff.{f}: missing")
        self.zone = str(config["zone"])
        try:
            self.tz = ZoneInfo(str(config["timezone"]))
        except (ZoneInfoNotFoundError, ValueError):
            raise TariffError(f"tariff.timezone={config['timezone']!r}: not an IANA time zone") from None
        try:
            rate = usd_per_unit(str(config["currency"]))
        except UnknownCurrencyError as e:
            raise TariffError(f"tariff.currency: {e}") from None
        per = str(config.get("per", "kWh"))
        if per not in ("kWh", "MWh"):
            raise TariffError(f"tariff.per={per!r}: choose kWh or MWh")
        self._scale = rate * (1000.0 if per == "kWh" else 1.0)
        self.default_usd_per_mwh = self._price(config["default"], "tariff.default")
        self.periods: list[TariffPeriod] = []
        periods = config.get("periods") or []
        if not isinstance(periods, list):
            raise TariffError(f"tariff.periods: expected a list, got {type(periods).__name__}")
        for i, p in enumerate(periods):
            f = f"tariff.periods[{i}]"
            if not isinstance(p, Mapping):
                raise TariffError(f"{f}: expected a mapping")
            for k in ("days", "start", "end", "price"):
                if k not in p:
                    raise TariffError(f"{f}.{k}: missing")
            days = p["days"]
            names = _DAY_SETS.get(days) if isinstance(days, str) else days
            if not isinstance(names, (list, tuple)) or not names or any(d not in _DAYS for d in names):
                raise TariffError(f"{f}.days={days!r}: give all, weekdays, weekends or a list of mon..sun")
            a, b = _minutes(p["start"], f"{f}.start"), _minutes(p["end"], f"{f}.end")
            if a == b:
                raise TariffError(f"{f}.end={p['end']!r}: equals start (an empty period)")
            self.periods.append(TariffPeriod(str(p.get("name", f"period{i}")), frozenset(_DAYS.index(d) for d in names),
                                             a, b, self._price(p["price"], f"{f}.price")))

    def _price(self, v: Any, field: str) -> float:
        if isinstance(v, bool):
            raise TariffError(f"{field}={v!r}: not a number")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise TariffError(f"{field}={v!r}: not a number") from None
        if not np.isfinite(x):
            raise TariffError(f"{field}={v!r}: not finite")
        return x * self._scale

    def price_at(self, t_s: float) -> float:
        """USD/MWh of the hour starting at POSIX second ``t_s``, by the local time at ``t_s``."""
        lt = datetime.fromtimestamp(t_s, tz=timezone.utc).astimezone(self.tz)
        minute = lt.hour * 60 + lt.minute
        for p in self.periods:
            if p.matches(lt.weekday(), minute):
                return p.usd_per_mwh
        return self.default_usd_per_mwh

    def _window(self, zone: str, start_s: float, end_s: float, forecast: bool) -> CheckedSeries:
        if zone != self.zone:
            raise ValueError(f"zone={zone!r}: this tariff prices zone {self.zone!r}")
        grid = hour_grid(start_s, end_s)
        vals = np.array([self.price_at(float(t)) for t in grid])
        return CheckedSeries.of(HourlySeries(zone, self.unit, float(grid[0]), vals), self.name, forecast=forecast)

    def latest(self, zone: str, now_s: float | None = None) -> CheckedSeries:
        """The hour holding ``now_s`` (default: now)."""
        import time

        now = time.time() if now_s is None else now_s
        h = float(np.floor(now / 3600.0) * 3600.0)
        return self._window(zone, h, h + 3600.0, False)

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """The tariff's price for each UTC hour of ``[start_s, end_s)``."""
        return self._window(zone, start_s, end_s, False)

    def forecast(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """As :meth:`history`, flagged as a forecast (the contract price is known ahead)."""
        return self._window(zone, start_s, end_s, True)


class _DropTokenRecords(logging.Filter):
    """Drop ``entsoe-py`` log records that carry the security token (it logs each request's params at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "securityToken" not in record.getMessage()


def _guard_entsoe_logs() -> None:
    lg = logging.getLogger("entsoe.entsoe")
    if not any(isinstance(f, _DropTokenRecords) for f in lg.filters):
        lg.addFilter(_DropTokenRecords())


class EntsoeDayAhead(SignalSource):
    """ENTSO-E SDAC day-ahead prices through ``entsoe-py``: history and forecast, USD/MWh.

    Args:
        api_key: security token (default: ``ENTSOE_API_KEY``); never logged.
        client: an ``entsoe.EntsoePandasClient`` to use instead of building one (tests pass one with
            ``retry_count=1``).
        areas: project zone -> ``entsoe`` area name (default: ``-`` replaced by ``_``, ``DE-LU`` -> ``DE_LU``).
        currency: the prices' currency (EUR for the SDAC zones).
    """

    name = "entsoe-day-ahead"
    kind = "price"
    unit = PRICE_UNIT

    def __init__(self, api_key: str | None = None, *, client: Any = None, areas: Mapping[str, str] | None = None,
                 currency: str = "EUR", timeout_s: float = 30.0):
        self._client = client
        self._key = api_key if api_key is not None else os.environ.get(ENTSOE_KEY_ENV)
        self._timeout_s = timeout_s
        self.areas = dict(areas or {})
        self.currency = currency
        self._rate = usd_per_unit(currency)

    def _get_client(self) -> Any:
        if self._client is None:
            if not self._key:
                raise SourceAuthError(self.name, f"no API key: set {ENTSOE_KEY_ENV}")
            from entsoe import EntsoePandasClient

            self._client = EntsoePandasClient(api_key=self._key, timeout=self._timeout_s)
        return self._client

    def _fetch(self, zone: str, start_s: float, end_s: float, forecast: bool) -> CheckedSeries:
        import pandas as pd
        import requests
        from entsoe.entsoe import QUARTER_MTU_SDAC_GOLIVE
        from bs4 import XMLParsedAsHTMLWarning
        from entsoe.exceptions import NoMatchingDataError
        from entsoe.mappings import lookup_area

        grid = hour_grid(start_s, end_s)
        a, b = float(grid[0]), float(grid[-1]) + 3600.0
        name = self.areas.get(zone, zone.replace("-", "_"))
        try:
            area = lookup_area(name)
        except (ValueError, KeyError):
            raise ValueError(f"zone={zone!r}: no ENTSO-E area {name!r}; pass areas={{zone: area}}") from None
        client = self._get_client()
        _guard_entsoe_logs()
        try:
            with warnings.catch_warnings():  # entsoe-py parses the XML with html.parser and says so each time
                warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
                s = client.query_day_ahead_prices(area, start=pd.Timestamp(a, unit="s", tz="UTC"),
                                                  end=pd.Timestamp(b, unit="s", tz="UTC"))
        except NoMatchingDataError:
            s = pd.Series(dtype=float)
        except requests.HTTPError as e:
            r = e.response
            st = r.status_code if r is not None else None
            if st == 429:
                raise RateLimited(self.name, "HTTP 429", st, retry_after_seconds(r.headers.get("Retry-After"))) from None
            if st in (401, 403):
                raise SourceAuthError(self.name, f"HTTP {st} (check {ENTSOE_KEY_ENV})", st) from None
            raise SourceUnavailable(self.name, f"HTTP {st}", st) from None
        except requests.RequestException as e:
            raise SourceUnavailable(self.name, type(e).__name__) from None
        if len(s):
            idx = s.index.tz_convert("UTC")
            t = ((idx - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(float)
            golive = QUARTER_MTU_SDAC_GOLIVE.timestamp()
            dur = np.where(t >= golive, 900.0, 3600.0)  # the client's own rule: hourly before go-live, 15 min after
            vals = s.to_numpy(dtype=float) * self._rate  # signs kept; converted before averaging (a linear map)
        else:
            t, vals, dur = np.zeros(0), np.zeros(0), np.zeros(0)
        out = to_hourly(t, vals, dur, start_s=start_s, end_s=end_s, zone=zone, unit=self.unit, source=self.name)
        return CheckedSeries(out.series, out.estimated, out.origin, forecast)

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Cleared day-ahead prices of ``[start_s, end_s)``, hourly means of the market time units."""
        return self._fetch(zone, start_s, end_s, False)

    def forecast(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Published day-ahead prices for ``[start_s, end_s)`` (hours not yet published: ``NaN``)."""
        return self._fetch(zone, start_s, end_s, True)
