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
history in ``pricing/data``, history only). :class:`SourceChain` asks several
sources of one kind and unit in order and applies the gap rules of
:mod:`pricing.hygiene` (a source that fails counts as all missing). Feeds: :mod:`pricing.carbon_sources`
(GB Carbon Intensity API, Electricity Maps, WattTime), :mod:`pricing.price_sources`
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
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pricing.hygiene import MAX_INTERPOLATED_GAP_H, CheckedSeries, conservative_value, fill_gaps, hour_grid
from pricing.series import HourlySeries, SeriesError

__all__ = ["SourceError", "RateLimited", "SourceAuthError", "SourceUnavailable", "HasLatest", "HasHistory",
           "HasForecast", "SignalSource", "capabilities", "window_from_series", "HttpJson", "BundledCarbon",
           "BundledPrice", "retry_after_seconds", "SourceChain", "ChainResult", "AVERAGE", "MARGINAL"]

#: Signal of a carbon source whose values are the *average* intensity of the zone's generation (what every
#: planner series is: the bundled life-cycle gCO2e/kWh, Electricity Maps). Price sources are ``average`` too.
AVERAGE = "average"
#: Signal of a carbon source whose values are a *marginal* emission rate (WattTime's MOER: the emissions of the
#: generators that answer a change in load), not comparable with an average intensity.
MARGINAL = "marginal"


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
    """Base of every source: its ``name``, signal ``kind`` (``"carbon"`` or ``"price"``), ``unit`` and ``signal``
    (:data:`AVERAGE`, the default, or :data:`MARGINAL`).

    Subclasses add the capability methods they support and nothing else.
    """

    name: str = ""
    kind: str = ""
    unit: str = ""
    signal: str = AVERAGE

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, kind={self.kind!r}, unit={self.unit!r}, "
                f"signal={self.signal!r})")


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

    def get(self, path: str, params: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
            auth: Any = None) -> Any:
        """GET ``base_url + path`` and return the decoded JSON body (``None`` for an empty body).

        ``headers`` are added to the client's for this request (e.g. a bearer token); ``auth`` is handed to
        ``requests`` (e.g. a ``(user, password)`` pair for HTTP basic auth). Neither is ever put in an error.
        Raises :class:`RateLimited`, :class:`SourceAuthError` or :class:`SourceUnavailable`.
        """
        import requests

        url = self.base_url + path
        hdrs = {**self._headers, **headers} if headers else self._headers
        try:
            r = self._session.get(url, params=params, headers=hdrs, auth=auth, timeout=self.timeout_s)
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


def _signal(source: object) -> str:
    """``source.signal``; a duck-typed source without one (e.g. the live broker's cached layers) is :data:`AVERAGE`."""
    return getattr(source, "signal", AVERAGE)


@dataclass(frozen=True)
class ChainResult:
    """What :meth:`SourceChain.window` found.

    Attributes:
        checked: the series after the gap rules (origin per hour: source name, ``interpolated``, ``conservative``).
        errors: source name -> the error that source raised (its hours counted as missing).
        skipped: sources without the capability asked for.
    """

    checked: CheckedSeries
    errors: dict[str, SourceError]
    skipped: tuple[str, ...]


class SourceChain:
    """Sources of one kind and unit in order of preference, with the gap rules applied to their answers.

    Args:
        sources: e.g. ``[ElectricityMaps(), BundledCarbon()]``; all must share ``kind`` and ``unit``.
        max_gap_h: see :func:`pricing.hygiene.interpolate_short_gaps`.
        conservative: the value of hours no source has; default :func:`pricing.hygiene.conservative_value`
            of the series the sources returned (carbon: never <= 0; price: none when nothing came back).

    Raises ``ValueError`` naming the source whose kind, unit or signal (average/marginal) differs.
    """

    def __init__(self, sources: list[SignalSource], *, max_gap_h: int = MAX_INTERPOLATED_GAP_H,
                 conservative: float | None = None):
        if not sources:
            raise ValueError("sources: empty chain")
        k, u, g = sources[0].kind, sources[0].unit, _signal(sources[0])
        for src in sources[1:]:
            if (src.kind, src.unit) != (k, u):
                raise ValueError(f"sources: {src.name!r} serves {src.kind} in {src.unit!r}, the chain {k} in {u!r}")
            if _signal(src) != g:  # a marginal rate filled with average hours (or back) is a silent mix
                raise ValueError(f"sources: {src.name!r} serves {_signal(src)} values, {sources[0].name!r} "
                                 f"(first in the chain) {g} ones")
        self.sources = list(sources)
        self.kind, self.unit = k, u
        self.max_gap_h = max_gap_h
        self.conservative = conservative

    def window(self, zone: str, start_s: float, end_s: float, want: str = "history") -> ChainResult:
        """The hours of ``[start_s, end_s)`` from the first source that has each (``want``: history or forecast).

        A source that raises :class:`SourceError` or has no such zone (``ValueError``) contributes no hour;
        its error is kept in :attr:`ChainResult.errors`. Hours no source has get the conservative value.
        """
        if want not in ("history", "forecast"):
            raise ValueError(f"want={want!r}: choose history or forecast")
        proto = HasHistory if want == "history" else HasForecast
        grid = hour_grid(start_s, end_s)
        empty = CheckedSeries.of(HourlySeries(zone, self.unit, float(grid[0]), np.full(grid.size, np.nan)), "",
                                 forecast=want == "forecast")
        got: list[CheckedSeries] = []  # one per capable source; a failed one is all missing
        errors: dict[str, SourceError] = {}
        skipped: list[str] = []
        for src in self.sources:
            if not isinstance(src, proto):
                skipped.append(src.name)
                continue
            try:
                got.append(getattr(src, want)(zone, start_s, end_s))
            except SourceError as e:
                errors[src.name] = e
                got.append(empty)
            except ValueError as e:  # a zone the source does not serve
                errors[src.name] = SourceError(src.name, str(e))
                got.append(empty)
        primary, rest = (got[0], got[1:]) if got else (empty, [])
        cons = self.conservative
        if cons is None:
            cons = conservative_value(self.kind, [c.series for c in got])
        # the first capable source is the primary: every hour another source fills is flagged estimated
        out = fill_gaps(primary, rest, conservative=cons, max_gap_h=self.max_gap_h, kind=self.kind)
        return ChainResult(out, errors, tuple(skipped))
