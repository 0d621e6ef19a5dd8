"""Live carbon-intensity sources: the GB Carbon Intensity API and Electricity Maps.

Both follow :mod:`pricing.sources` (capability methods returning a
:class:`~pricing.hygiene.CheckedSeries` on the UTC hours asked for).

**GB Carbon Intensity API** (NESO, https://api.carbonintensity.org.uk, no key,
CC BY 4.0): half-hourly values in **gCO2/kWh** — the operational CO2 of GB
generation, not a life-cycle figure, so its unit is kept as ``"gCO2/kWh"`` and it
is not mixed with the bundled life-cycle ``gCO2e/kWh`` series. Zones: ``"GB"``
(national) and ``"GB-<regionid>"`` for the 17 regions (1 North Scotland … 13
London … 17 Wales). Half-hours are averaged to hours (both halves needed).
National history uses ``actual``; a half-hour whose ``actual`` is null takes its
``forecast`` flagged estimated; regional figures are forecast-only, so regional
history is flagged estimated; a half-hour served twice (api-definitions#17)
counts once, as the mean of its records, flagged estimated if they differ. Endpoints: ``/intensity/{from}/{to}``,
``/intensity/{from}/fw48h``, ``/regional/intensity/{from}/{to}/regionid/{id}``,
``/regional/intensity/{from}/fw48h/regionid/{id}``; a range request spans at
most 14 days (longer windows are split).

**Electricity Maps** (https://api.electricitymap.org/v3, key in the
``auth-token`` header from ``ELECTRICITYMAPS_API_KEY``): hourly life-cycle
**gCO2e/kWh** (the API's default emission factor type) per Electricity Maps zone
id (``DE``, ``US-CAL-CISO``, …). Endpoints: ``/carbon-intensity/latest``,
``/carbon-intensity/past-range`` (at most 10 days per request; longer windows
are split), ``/carbon-intensity/forecast``. ``isEstimated`` flags estimates; a
null ``carbonIntensity`` is a missing hour. A 401 within an hour of a success is
read as a rate limit (electricitymaps-contrib#8047).

**WattTime** (https://api.watttime.org, API v3, account from ``WATTTIME_USER`` and ``WATTTIME_PASSWORD``, the
variable names of WattTime's own SDK): the **marginal** operating emission rate (MOER, ``signal_type=co2_moer``)
of a WattTime region (``CAISO_NORTH``, ``PJM_DC``, …; configured, so ``/v3/region-from-loc`` is not used).
``/login`` (HTTP basic auth) returns a bearer token, valid 30 minutes (docs.watttime.org); it is reused until
:data:`WATTTIME_TOKEN_TTL_S` after login, and a 401 on a data request (a token expired early) logs in again
once. ``/v3/historical`` (at most :data:`_WT_MAX_RANGE_S` per request; longer windows are split) and
``/v3/forecast`` answer ``{"data": [{"point_time", "value"}], "meta": {"units": "lbs_co2_per_mwh",
"data_point_period_seconds": 300, …}}``: 5-minute points averaged to UTC hours by
:func:`pricing.hygiene.to_hourly` with :data:`pricing.hygiene.FIVE_MIN_MIN_COVERAGE` (an hour short of some
points is the mean of those it has, flagged estimated). Values are converted from lbs CO2/MWh to **gCO2/kWh**
(:data:`LB_CO2_PER_MWH_TO_G_PER_KWH`). The source's ``signal`` is :data:`pricing.sources.MARGINAL`: a marginal
rate answers "what does one more kWh here, now, emit", an average intensity "what does the mix emit per kWh";
they differ by a factor of 2 or more on many grids and must not be compared or spliced together, so the live
settings refuse it in a planner chain (:mod:`broker.service.signal_settings`).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from pricing.hygiene import CheckedSeries, hour_grid, to_hourly
from pricing.hygiene import FIVE_MIN_MIN_COVERAGE
from pricing.sources import MARGINAL, HttpJson, SignalSource, SourceAuthError, SourceUnavailable

__all__ = ["GbCarbonIntensity", "ElectricityMaps", "WattTime", "GB_UNIT", "GB_REGIONS", "ELECTRICITYMAPS_KEY_ENV",
           "WATTTIME_USER_ENV", "WATTTIME_PASSWORD_ENV", "WATTTIME_UNIT", "WATTTIME_TOKEN_TTL_S",
           "LB_CO2_PER_MWH_TO_G_PER_KWH"]

#: Unit of the GB Carbon Intensity API: operational gCO2 per kWh (not life-cycle).
GB_UNIT = "gCO2/kWh"
#: Region ids of the GB Carbon Intensity API (``/regional``), 1..17.
GB_REGIONS = range(1, 18)
#: Environment variable holding the Electricity Maps API key.
ELECTRICITYMAPS_KEY_ENV = "ELECTRICITYMAPS_API_KEY"

#: Environment variables of the WattTime account (the names WattTime's own Python SDK reads).
WATTTIME_USER_ENV = "WATTTIME_USER"
WATTTIME_PASSWORD_ENV = "WATTTIME_PASSWORD"
#: Unit of the WattTime source after conversion: marginal CO2 (not CO2e) per kWh.
WATTTIME_UNIT = "gCO2/kWh"
#: lbs CO2/MWh -> gCO2/kWh: 1 lb = 453.59237 g exactly (international avoirdupois pound, US/UK 1959 agreement;
#: NIST SP 811 App. B) and 1 MWh = 1000 kWh, so x 453.59237 / 1000.
LB_CO2_PER_MWH_TO_G_PER_KWH = 453.59237 / 1000.0
#: Seconds a WattTime token is reused: it is valid 30 min (docs.watttime.org, "Login"); renewed 1 min early so a
#: request never leaves with a token about to expire.
WATTTIME_TOKEN_TTL_S = 29 * 60.0

_GB_MAX_RANGE_S = 14 * 86400.0
#: WattTime /v3/historical serves at most 32 days per request (docs.watttime.org); we ask 31 to stay inside it.
_WT_MAX_RANGE_S = 31 * 86400.0
_WT_UNITS = "lbs_co2_per_mwh"
_EM_MAX_RANGE_S = 10 * 86400.0


def _parse_utc(text: Any, field: str, source: str) -> float:
    """POSIX seconds of an ISO 8601 UTC instant such as ``2018-01-20T12:00Z`` or ``2019-05-21T00:00:00.000Z``."""
    try:
        t = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        raise SourceUnavailable(source, f"{field}={text!r}: not an ISO 8601 instant") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def _iso_minute(t_s: float) -> str:
    return datetime.fromtimestamp(t_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def _num(x: Any) -> float:
    """A JSON number as float; ``None`` (a null hour) and non-numbers as ``NaN``."""
    if isinstance(x, bool) or x is None:
        return float("nan")
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v if np.isfinite(v) else float("nan")


def _chunks(start_s: float, end_s: float, max_s: float) -> list[tuple[float, float]]:
    grid = hour_grid(start_s, end_s)
    a, b = float(grid[0]), float(grid[-1]) + 3600.0
    out = []
    while a < b:
        out.append((a, min(b, a + max_s)))
        a += max_s
    return out


class GbCarbonIntensity(SignalSource):
    """GB Carbon Intensity API (national and regional): latest, history and the 48-h forecast, gCO2/kWh.

    Args:
        base_url: API root (tests point it at recorded responses).
        session: a ``requests.Session``; clock: POSIX seconds now (for ``latest``).
    """

    name = "gb-carbon-intensity"
    kind = "carbon"
    unit = GB_UNIT

    def __init__(self, base_url: str = "https://api.carbonintensity.org.uk", *, session: Any = None,
                 timeout_s: float = 20.0, clock: Any = time.time):
        self.http = HttpJson(self.name, base_url, {"Accept": "application/json"}, timeout_s=timeout_s,
                             session=session, clock=clock)
        self._clock = clock

    @staticmethod
    def region_of(zone: str) -> int | None:
        """``None`` for ``"GB"`` (national), the region id for ``"GB-<id>"``; ``ValueError`` naming the zone else."""
        if zone == "GB":
            return None
        if zone.startswith("GB-"):
            try:
                rid = int(zone[3:])
            except ValueError:
                rid = -1
            if rid in GB_REGIONS:
                return rid
        raise ValueError(f"zone={zone!r}: the GB Carbon Intensity API serves 'GB' (national) and 'GB-1'..'GB-17' "
                         "(regions)")

    def _rows(self, body: Any, regional: bool) -> list[dict]:
        if body is None:
            return []
        if not isinstance(body, dict) or "data" not in body:
            raise SourceUnavailable(self.name, "response has no 'data'")
        data = body["data"]
        if regional:  # /regional/...: data is an object {regionid, shortname, data: [...]} or a list of one
            if isinstance(data, list):
                data = data[0] if data else {}
            data = data.get("data", []) if isinstance(data, dict) else []
        if not isinstance(data, list):
            raise SourceUnavailable(self.name, "'data' is not a list")
        return data

    def _hourly(self, zone: str, rows: list[dict], start_s: float, end_s: float, field: str,
                forecast: bool, regional: bool) -> CheckedSeries:
        t, v, est = [], [], []
        for r in rows:
            inten = r.get("intensity") or {}
            val = _num(inten.get(field))
            e = regional and field == "forecast" and not forecast  # regional history is forecast-only
            if np.isnan(val) and field == "actual":  # a null actual: the half-hour's forecast, flagged estimated
                val, e = _num(inten.get("forecast")), True
            t.append(_parse_utc(r.get("from"), "from", self.name))
            v.append(val)
            est.append(e)
        out = to_hourly(t, v, 1800.0, start_s=start_s, end_s=end_s, zone=zone, unit=self.unit, estimated=est,
                        source=self.name)
        return CheckedSeries(out.series, out.estimated, out.origin, forecast)

    def _range(self, zone: str, start_s: float, end_s: float) -> list[dict]:
        rid = self.region_of(zone)
        rows: list[dict] = []
        for a, b in _chunks(start_s, end_s, _GB_MAX_RANGE_S):
            path = (f"/intensity/{_iso_minute(a)}/{_iso_minute(b)}" if rid is None
                    else f"/regional/intensity/{_iso_minute(a)}/{_iso_minute(b)}/regionid/{rid}")
            rows += self._rows(self.http.get(path), rid is not None)
        return rows

    def latest(self, zone: str, now_s: float | None = None) -> CheckedSeries:
        """The UTC hour holding ``now_s`` (default: the clock), from its two half-hours (``actual`` where known)."""
        now = self._clock() if now_s is None else now_s
        h = float(np.floor(now / 3600.0) * 3600.0)
        return self.history(zone, h, h + 3600.0)

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)``: national ``actual`` (null: ``forecast``, estimated); regional forecasts."""
        rid = self.region_of(zone)
        return self._hourly(zone, self._range(zone, start_s, end_s), start_s, end_s,
                            "actual" if rid is None else "forecast", False, rid is not None)

    def forecast(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """The forecast from ``start_s`` (``fw48h``: 48 h ahead); hours past the API's horizon are ``NaN``."""
        rid = self.region_of(zone)
        a = float(np.floor(start_s / 3600.0) * 3600.0)
        path = (f"/intensity/{_iso_minute(a)}/fw48h" if rid is None
                else f"/regional/intensity/{_iso_minute(a)}/fw48h/regionid/{rid}")
        return self._hourly(zone, self._rows(self.http.get(path), rid is not None), start_s, end_s, "forecast",
                            True, rid is not None)


class ElectricityMaps(SignalSource):
    """Electricity Maps API v3: latest, past-range history and forecast, life-cycle gCO2e/kWh.

    Args:
        api_key: the key (default: the ``ELECTRICITYMAPS_API_KEY`` environment variable); never logged.
        base_url: API root (tests point it at recorded responses).
        recent_success_s: a 401 this soon after a success is a rate limit (s; default 3600).
    """

    name = "electricitymaps"
    kind = "carbon"
    unit = "gCO2e/kWh"

    def __init__(self, api_key: str | None = None, base_url: str = "https://api.electricitymap.org/v3", *,
                 session: Any = None, timeout_s: float = 20.0, recent_success_s: float = 3600.0,
                 clock: Any = time.time):
        key = api_key if api_key is not None else os.environ.get(ELECTRICITYMAPS_KEY_ENV)
        self._has_key = bool(key)
        self.http = HttpJson(self.name, base_url, {"auth-token": key or ""}, timeout_s=timeout_s,
                             recent_success_s=recent_success_s, session=session, clock=clock)
        self._clock = clock

    def _get(self, path: str, params: dict) -> Any:
        if not self._has_key:
            raise SourceAuthError(self.name, f"no API key: set {ELECTRICITYMAPS_KEY_ENV}")
        return self.http.get(path, params)

    def _hourly(self, zone: str, rows: list[dict], start_s: float, end_s: float, forecast: bool) -> CheckedSeries:
        t, v, est = [], [], []
        for r in rows:
            if not isinstance(r, dict):
                raise SourceUnavailable(self.name, f"row {r!r} is not an object")
            t.append(_parse_utc(r.get("datetime"), "datetime", self.name))
            v.append(_num(r.get("carbonIntensity")))
            est.append(bool(r.get("isEstimated", False)))
        out = to_hourly(t, v, 3600.0, start_s=start_s, end_s=end_s, zone=zone, unit=self.unit, estimated=est,
                        source=self.name)
        return CheckedSeries(out.series, out.estimated, out.origin, forecast)

    def _list(self, body: Any, key: str) -> list[dict]:
        if body is None:
            return []
        if not isinstance(body, dict):
            raise SourceUnavailable(self.name, "response is not an object")
        rows = body.get(key, [])
        if rows is None:
            return []
        if not isinstance(rows, list):
            raise SourceUnavailable(self.name, f"'{key}' is not a list")
        return rows

    def latest(self, zone: str, now_s: float | None = None) -> CheckedSeries:
        """The latest hour the API has for ``zone`` (its ``datetime``), one interval."""
        body = self._get("/carbon-intensity/latest", {"zone": zone})
        if not body:
            now = self._clock() if now_s is None else now_s
            h = float(np.floor(now / 3600.0) * 3600.0)
            return self._hourly(zone, [], h, h + 3600.0, False)
        t = _parse_utc(body.get("datetime"), "datetime", self.name)
        return self._hourly(zone, [body], t, t + 3600.0, False)

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` from ``/carbon-intensity/past-range`` (split into 10-day requests)."""
        rows: list[dict] = []
        for a, b in _chunks(start_s, end_s, _EM_MAX_RANGE_S):
            body = self._get("/carbon-intensity/past-range", {"zone": zone, "start": _iso_minute(a),
                                                               "end": _iso_minute(b)})
            rows += self._list(body, "data")
        return self._hourly(zone, rows, start_s, end_s, False)

    def forecast(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` from ``/carbon-intensity/forecast`` (hours it does not cover: ``NaN``)."""
        body = self._get("/carbon-intensity/forecast", {"zone": zone})
        return self._hourly(zone, self._list(body, "forecast"), start_s, end_s, True)


class WattTime(SignalSource):
    """WattTime API v3: marginal CO2 rate (MOER) of a WattTime region, latest, history and forecast, gCO2/kWh.

    Args:
        username, password: the WattTime account (default: ``WATTTIME_USER`` / ``WATTTIME_PASSWORD``); never
            logged, never in an error.
        base_url: API root (tests point it at recorded responses).
        session: a ``requests.Session``; clock: POSIX seconds now (token expiry and ``latest``).

    Attributes:
        logins: how many times ``/login`` answered with a token (one per :data:`WATTTIME_TOKEN_TTL_S`, plus one
            per data request refused with 401).

    ``zone`` is the WattTime region (e.g. ``"CAISO_NORTH"``). Errors: :class:`SourceAuthError` (no account, or
    login refused, or a data request still refused after one re-login), :class:`pricing.sources.RateLimited`
    (429, with ``Retry-After``), :class:`SourceUnavailable` (5xx, unreadable body, units other than lbs CO2/MWh).
    """

    name = "watttime"
    kind = "carbon"
    unit = WATTTIME_UNIT
    signal = MARGINAL

    def __init__(self, username: str | None = None, password: str | None = None,
                 base_url: str = "https://api.watttime.org", *, session: Any = None, timeout_s: float = 20.0,
                 clock: Any = time.time):
        self._user = username if username is not None else os.environ.get(WATTTIME_USER_ENV, "")
        self._password = password if password is not None else os.environ.get(WATTTIME_PASSWORD_ENV, "")
        self.http = HttpJson(self.name, base_url, {"Accept": "application/json"}, timeout_s=timeout_s,
                             session=session, clock=clock)
        self._clock = clock
        self._token: str | None = None
        self._token_until_s = float("-inf")
        self.logins = 0

    def _login(self) -> str:
        if not (self._user and self._password):
            raise SourceAuthError(self.name, f"no account: set {WATTTIME_USER_ENV} and {WATTTIME_PASSWORD_ENV}")
        now = self._clock()
        body = self.http.get("/login", auth=(self._user, self._password))
        self.logins += 1
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise SourceUnavailable(self.name, "GET /login: no 'token' in the answer")
        self._token, self._token_until_s = token, now + WATTTIME_TOKEN_TTL_S
        return token

    def _get(self, path: str, params: dict) -> Any:
        token = self._token if self._token and self._clock() < self._token_until_s else self._login()
        try:
            return self.http.get(path, params, headers={"Authorization": f"Bearer {token}"})
        except SourceAuthError:  # the token expired before we thought: log in again, once
            self._token = None
            token = self._login()
            return self.http.get(path, params, headers={"Authorization": f"Bearer {token}"})

    def _points(self, body: Any) -> list[dict]:
        if body is None:
            return []
        if not isinstance(body, dict):
            raise SourceUnavailable(self.name, "response is not an object")
        meta = body.get("meta") or {}
        units = meta.get("units") if isinstance(meta, dict) else None
        if units is not None and units != _WT_UNITS:
            raise SourceUnavailable(self.name, f"meta.units={units!r}: expected {_WT_UNITS!r}")
        rows = body.get("data") or []
        if not isinstance(rows, list):
            raise SourceUnavailable(self.name, "'data' is not a list")
        return rows

    def _hourly(self, zone: str, rows: list[dict], start_s: float, end_s: float, forecast: bool) -> CheckedSeries:
        t, v = [], []
        for r in rows:
            if not isinstance(r, dict):
                raise SourceUnavailable(self.name, f"row {r!r} is not an object")
            t.append(_parse_utc(r.get("point_time"), "point_time", self.name))
            v.append(_num(r.get("value")) * LB_CO2_PER_MWH_TO_G_PER_KWH)
        out = to_hourly(t, v, 300.0, start_s=start_s, end_s=end_s, zone=zone, unit=self.unit, source=self.name,
                        min_coverage=FIVE_MIN_MIN_COVERAGE)
        return CheckedSeries(out.series, out.estimated, out.origin, forecast)

    def latest(self, zone: str, now_s: float | None = None) -> CheckedSeries:
        """The UTC hour holding ``now_s`` (default: the clock), from its 5-minute points so far (``NaN`` until
        :data:`pricing.hygiene.FIVE_MIN_MIN_COVERAGE` of the hour has points)."""
        now = self._clock() if now_s is None else now_s
        h = float(np.floor(now / 3600.0) * 3600.0)
        return self.history(zone, h, h + 3600.0)

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` from ``/v3/historical`` (split into 31-day requests)."""
        rows: list[dict] = []
        for a, b in _chunks(start_s, end_s, _WT_MAX_RANGE_S):
            body = self._get("/v3/historical", {"region": zone, "start": _iso_minute(a), "end": _iso_minute(b),
                                                "signal_type": "co2_moer"})
            rows += self._points(body)
        return self._hourly(zone, rows, start_s, end_s, False)

    def forecast(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` from the latest ``/v3/forecast`` (72 h ahead asked; hours it does not
        cover: ``NaN``)."""
        body = self._get("/v3/forecast", {"region": zone, "signal_type": "co2_moer", "horizon_hours": 72})
        return self._hourly(zone, self._points(body), start_s, end_s, True)
