"""Signal source interfaces: one per kind of signal, each source implementing only what it can.

A *source* serves one kind of signal — ``"carbon"`` (grid carbon intensity) or
``"price"`` (electricity price, USD/MWh) — for some zones, through up to three
capabilities, each a method returning a :class:`~pricing.hygiene.CheckedSeries`
on UTC hours (missing = ``NaN``, estimates flagged):

* ``latest(zone, now_s)``: the hour holding ``now_s`` (one interval);
* ``history(zone, start_s, end_s)``: measured hours of ``[start_s, end_s)``;
* ``forecast(zone, start_s, end_s)``: forecast hours of ``[start_s, end_s)``.

A source class defines only the methods it supports (:class:`HasLatest`,
:class:`HasHistory`, :class:`HasForecast` are runtime-checkable protocols;
:func:`capabilities` lists them). Every window result holds exactly the hours of
the window asked for: hours the source did not deliver are ``NaN``, so an empty
``200 OK`` shows up as missing data (:func:`pricing.hygiene.completeness`).

Sources here: :class:`BundledCarbon` and :class:`BundledPrice` (the 2023-2024
history in ``pricing/data``, history only). Feeds: :mod:`pricing.carbon_sources`
(GB Carbon Intensity API, Electricity Maps), :mod:`pricing.price_sources`
(operator tariff, ENTSO-E day-ahead).

Fetch failures are :class:`SourceError` subclasses (``RuntimeError``: a fault of
the feed, not bad input): :class:`RateLimited` (429, or a 401 that follows a
recent success: Electricity Maps answers a rate limit so, electricitymaps-contrib
#8047) with ``retry_after_s``; :class:`SourceAuthError` (401/403 with no recent
success: a bad or missing key); :class:`SourceUnavailable` (5xx, connection
error, unreadable body). This step does not retry; the caller (item 2's refresh
task) decides. API keys are read from the environment and never put in an
error message or log line.
"""

from __future__ import annotations

import email.utils
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pricing.hygiene import CheckedSeries, hour_grid
from pricing.series import HourlySeries, SeriesError

__all__ = ["SourceError", "RateLimited", "SourceAuthError", "SourceUnavailable", "HasLatest", "HasHistory",
           "HasForecast", "SignalSource", "capabilities", "window_from_series", "HttpJson", "BundledCarbon",
           "BundledPrice", "retry_after_seconds"]


class SourceError(RuntimeError):
    """A signal source could not deliver (a fault of the feed, not of the caller's input).

    Attributes:
        source: the source's name.
        status: the HTTP status, if any.
    """

    def __init__(self, source: str, message: str, status: int | None = None):
        self.source = source
        self.status = status
        super().__init__(f"{source}: {message}")


class RateLimited(SourceError):
    """The source asks us to slow down (HTTP 429, or a 401 after a recent success).

    Attributes:
        retry_after_s: seconds to wait (from ``Retry-After``), or ``None`` when the source did not say.
    """

    def __init__(self, source: str, message: str, status: int | None, retry_after_s: float | None):
        self.retry_after_s = retry_after_s
        super().__init__(source, message, status)


class SourceAuthError(SourceError):
    """The source refused our credentials (401/403 with no recent success): a missing, wrong or expired key."""


class SourceUnavailable(SourceError):
    """The source is down or answered something unreadable (5xx, connection error, malformed body)."""


@runtime_checkable
class HasLatest(Protocol):
    """A source that can give the current hour's value."""

    def latest(self, zone: str, now_s: float | None = None) -> CheckedSeries: ...


@runtime_checkable
class HasHistory(Protocol):
    """A source that can give measured values of a past window."""

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries: ...


@runtime_checkable
class HasForecast(Protocol):
    """A source that can give forecast values of a coming window."""

    def forecast(self, zone: str, start_s: float, end_s: float) -> CheckedSeries: ...


class SignalSource:
    """Base of every source: its ``name``, signal ``kind`` (``"carbon"`` or ``"price"``) and ``unit``.

    Subclasses add the capability methods they support and nothing else.
    """

    name: str = ""
    kind: str = ""
    unit: str = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind!r}, unit={self.unit!r})"


def capabilities(source: object) -> tuple[str, ...]:
    """The capabilities ``source`` implements, in the order latest, history, forecast."""
    caps = (("latest", HasLatest), ("history", HasHistory), ("forecast", HasForecast))
    return tuple(name for name, proto in caps if isinstance(source, proto))


def window_from_series(series: HourlySeries, start_s: float, end_s: float, source: str,
                       estimated: np.ndarray | bool = False, forecast: bool = False) -> CheckedSeries:
    """The UTC hours of ``[start_s, end_s)`` read from an hourly ``series`` (``NaN`` outside it).

    ``estimated`` is the series' per-interval estimate flag (or one flag for all).
    """
    if series.interval_s != 3600.0:
        raise SeriesError(f"series.interval_s={series.interval_s}: need an hourly series")
    grid = hour_grid(start_s, end_s)
    idx = np.rint((grid - series.start_s) / 3600.0).astype(np.int64)
    ok = (idx >= 0) & (idx < series.values.size)
    vals = np.full(grid.size, np.nan)
    vals[ok] = series.values[idx[ok]]
    est_all = np.broadcast_to(np.asarray(estimated, dtype=bool), series.values.shape)
    est = np.zeros(grid.size, dtype=bool)
    est[ok] = est_all[idx[ok]]
    out = HourlySeries(series.zone, series.unit, float(grid[0]), vals)
    return CheckedSeries.of(out, source, est, forecast)


def retry_after_seconds(value: str | None, now_s: float | None = None) -> float | None:
    """``Retry-After`` header as seconds to wait: a number of seconds or an HTTP date (RFC 9110 §10.2.3).

    ``None`` when absent or unreadable; never negative.
    """
    if value is None or not value.strip():
        return None
    v = value.strip()
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    now = time.time() if now_s is None else now_s
    return max(0.0, when.timestamp() - now)


class HttpJson:
    """GET JSON from one API with the error mapping every feed shares.

    Args:
        source: the source's name (in errors).
        base_url: e.g. ``https://api.carbonintensity.org.uk``.
        headers: sent with every request (may hold a key: never logged, never in an error).
        timeout_s: per-request timeout, seconds.
        recent_success_s: a 401 within this many seconds of a success is read as a rate limit
            (:class:`RateLimited`), else as :class:`SourceAuthError`. ``None``: a 401 is always an auth error.
        session: a ``requests.Session`` (default: a new one).
        clock: returns POSIX seconds (tests pass a fake).
    """

    def __init__(self, source: str, base_url: str, headers: dict[str, str] | None = None, *, timeout_s: float = 20.0,
                 recent_success_s: float | None = None, session: Any = None, clock: Any = time.time):
        import requests

        self.source = source
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers or {})
        self.timeout_s = timeout_s
        self.recent_success_s = recent_success_s
        self._session = session or requests.Session()
        self._clock = clock
        self.last_success_s: float | None = None

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """GET ``base_url + path`` and return the decoded JSON body (``None`` for an empty body).

        Raises :class:`RateLimited`, :class:`SourceAuthError` or :class:`SourceUnavailable`.
        """
        import requests

        url = self.base_url + path
        try:
            r = self._session.get(url, params=params, headers=self._headers, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise SourceUnavailable(self.source, f"GET {path}: {type(e).__name__}") from None
        now = self._clock()
        st = r.status_code
        if st == 429:
            raise RateLimited(self.source, f"GET {path}: HTTP 429", st, retry_after_seconds(r.headers.get("Retry-After"), now))
        if st in (401, 403):
            recent = (self.recent_success_s is not None and self.last_success_s is not None
                      and now - self.last_success_s <= self.recent_success_s)
            if recent:
                raise RateLimited(self.source, f"GET {path}: HTTP {st} after a success "
                                  f"{now - self.last_success_s:.0f} s ago (read as a rate limit)", st,
                                  retry_after_seconds(r.headers.get("Retry-After"), now))
            raise SourceAuthError(self.source, f"GET {path}: HTTP {st} (check the API key)", st)
        if st >= 400:
            raise SourceUnavailable(self.source, f"GET {path}: HTTP {st}", st)
        self.last_success_s = now
        if not r.content or not r.content.strip():
            return None
        try:
            return r.json()
        except ValueError:
            raise SourceUnavailable(self.source, f"GET {path}: body is not JSON", st) from None


class BundledCarbon(SignalSource):
    """The bundled 2023-2024 hourly carbon intensity (:mod:`pricing.carbon`), gCO2e/kWh: history only.

    Hours of zones whose figure is our estimate (:func:`pricing.carbon.carbon_estimated`) are flagged estimated.
    """

    name = "bundled-carbon"
    kind = "carbon"
    unit = "gCO2e/kWh"

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` of ``zone`` (``NaN`` outside 2023-2024); raises ``UnknownZoneError``."""
        from pricing.carbon import carbon_estimated, load_carbon_intensity

        s = load_carbon_intensity(zone)
        return window_from_series(s, start_s, end_s, self.name, estimated=carbon_estimated(zone))


class BundledPrice(SignalSource):
    """The bundled 2023-2024 hourly electricity prices (:mod:`pricing.electricity`), USD/MWh: history only."""

    name = "bundled-price"
    kind = "price"
    unit = "USD/MWh"

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` of ``zone`` (``NaN`` outside 2023-2024); raises ``UnknownZoneError``."""
        from pricing.electricity import load_electricity_price

        return window_from_series(load_electricity_price(zone), start_s, end_s, self.name)
