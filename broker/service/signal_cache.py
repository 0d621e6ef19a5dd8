"""The live signal cache: fetched hours of carbon intensity and electricity price, shared by every process.

One cache keyed by (source, zone, UTC hour) (issue 13 item 2):

* **Redis** is the fast copy the planner reads (hash ``<prefix>v:<source>:<zone>``: hour -> ``[value, estimated,
  forecast, fetched_at]``; ``<prefix>version`` goes up at every write, so a planner rebuilds its series only
  when something changed). After a Redis restart the first reader loads it back from the database.
* **The database** (``signal_values``, :mod:`broker.service.store.signals`) is the durable copy and decides
  merges: a measured hour replaces a cached one, a forecast replaces only a forecast.

**Refresh** (:meth:`SignalCache.refresh`, run from beat by ``fedbroker.signals_refresh`` every minute): for each
configured zone and kind, the first process to claim the period (``SET <prefix>refresh:<kind>:<zone> NX PX``,
TTL the zone's ``refresh_s``) fetches; every other process skips it, so there is one fetch per zone per period
however many workers and beats run (the single-leader rule). The claim is not released after the fetch: it
*is* the period. Each network source of the zone's chain is asked for ``history_h`` measured hours back and
``forecast_h`` forecast hours ahead (where it has a forecast).

**Limits** per source (:class:`broker.service.signal_settings.SourceSettings`): a token bucket in Redis
(:data:`broker.service.limits.TOKEN_BUCKET_LUA`, shared by every process); a 429 or a 401 that follows a
success (:class:`pricing.sources.RateLimited`) is retried after its ``Retry-After`` (else ``backoff_s x 2^n``);
a 5xx or a connection error (:class:`pricing.sources.SourceUnavailable` without a 4xx status) after
``backoff_s x 2^n``, at most ``max_retries`` times and never sleeping more than ``max_backoff_s`` at once. A
longer ``Retry-After`` (or retries used up on a rate limit) puts the source in back-off: no request until
then (``<prefix>backoff:<source>``). An answer with no value for the window (an empty ``200``) counts as a
failed fetch (``empty``), not as fresh data.

**Cloud prices** (``signals.cloud_prices``, :meth:`SignalCache.refresh_cloud`): per provider, under the same
claim (``<prefix>refresh:cloud:<provider>``), token buckets, retries and back-off, the AWS spot history, AWS Price
List and GCP Cloud Billing Catalog prices of the bundled offers in the listed regions are stored per offer
(kind ``cloud``, zone = the offer id, USD/h); :meth:`SignalCache.cloud_prices` reads them back for
:class:`broker.service.live.LiveEnvironment`.

**Health** per (source, zone, kind) is kept in ``signal_fetches``: last attempt, last success, last error,
error counts by class (:data:`ERROR_CLASSES`); it feeds ``fedbroker signals status`` and ``/metrics``.
A value is *fresh* while ``now - fetched_at <= stale_after_s`` (:func:`is_fresh`).

Keys are resolved by :meth:`broker.service.signal_settings.SignalsSettings.api_key` and handed to the source
clients; they never appear in an error, a log line or the database.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

import numpy as np

from broker.service.limits import CLOCK_SLACK_S, TOKEN_BUCKET_LUA
from broker.service.signal_settings import BUNDLED, CLOUD_SOURCES, KEY_ENVS, SignalsSettings
from broker.service.store import signals as rows
from broker.service.store.signals import CachedHour
from broker.utc import iso_seconds
from pricing.hygiene import CheckedSeries
from pricing.sources import (HasForecast, HasHistory, HasLatest, RateLimited, SignalSource, SourceAuthError,
                             SourceError, SourceUnavailable)

__all__ = ["SignalCache", "RefreshResult", "Hours", "ERROR_CLASSES", "UNITS", "USER_SOURCE", "is_fresh",
           "error_class", "build_source", "REDIS_PREFIX"]

log = logging.getLogger("fedbroker.signals")

#: default Redis key prefix of the cache
REDIS_PREFIX = "fedbroker:signals:"
#: the classes a failed fetch is counted under (a bounded label set of ``fedbroker_signal_fetch_errors``)
ERROR_CLASSES = ("rate_limited", "auth", "unavailable", "empty", "config", "other")
#: the unit of each kind the planner uses
UNITS = {"carbon": "gCO2e/kWh", "price": "USD/MWh", "cloud": "USD/h"}
#: the source name of hours seeded from ``--signals DIR`` files (:mod:`pricing.user_signals`)
USER_SOURCE = "user"
#: the Redis copy is reloaded from the database at least this often, seconds
WARM_S = 3600
#: cached hours older than this are dropped at each refresh, seconds (the planner looks back ``history_h`` at most)
KEEP_S = 15 * 86400.0


def is_fresh(fetched_s: float, now_s: float, stale_after_s: float) -> bool:
    """Whether a value fetched at ``fetched_s`` is still fresh at ``now_s`` (POSIX s): age <= ``stale_after_s``."""
    return now_s - fetched_s <= stale_after_s


def error_class(e: BaseException) -> str:
    """The :data:`ERROR_CLASSES` entry of a fetch error."""
    if isinstance(e, RateLimited):
        return "rate_limited"
    if isinstance(e, SourceAuthError):
        return "auth"
    if isinstance(e, SourceUnavailable):
        return "unavailable"
    if isinstance(e, ValueError):  # a zone the source does not serve: a configuration fault
        return "config"
    return "other"


def build_source(name: str, zone: str, settings: SignalsSettings, session: Any = None) -> SignalSource:
    """The client of network source ``name`` for broker ``zone`` (keys from ``settings``; ``session``: a
    ``requests.Session`` for the HTTP feeds). Raises ``ValueError`` naming an unknown source."""
    opts = settings.source(name)
    if name == "electricitymaps":
        from pricing.carbon_sources import ElectricityMaps

        kw = {"base_url": opts.base_url} if opts.base_url else {}
        return ElectricityMaps(api_key=settings.api_key(name) or "", session=session, timeout_s=opts.timeout_s, **kw)
    if name == "entsoe-day-ahead":
        from pricing.price_sources import EntsoeDayAhead

        key = settings.api_key(name)
        if not key:  # the source raises SourceAuthError naming the variable at its first fetch
            return EntsoeDayAhead(api_key="", timeout_s=opts.timeout_s)
        from entsoe import EntsoePandasClient

        # one try per call inside entsoe-py (its default is 3 tries 10 s apart): SignalCache.call retries
        client = EntsoePandasClient(api_key=key, retry_count=1, retry_delay=0, timeout=opts.timeout_s)
        return EntsoeDayAhead(client=client)
    if name == "tariff":
        from pricing.price_sources import Tariff

        return Tariff({"zone": zone, **settings.tariffs[zone]})
    if name in CLOUD_SOURCES["aws"] + CLOUD_SOURCES["gcp"]:
        from pricing import cloud_price_sources as cps

        if name == cps.AWS_SPOT:
            return cps.AwsSpotPrices(timeout_s=opts.timeout_s)
        if name == cps.AWS_PRICE_LIST:
            return cps.AwsPriceList(timeout_s=opts.timeout_s)
        return cps.GcpBillingCatalog(timeout_s=opts.timeout_s)
    raise ValueError(f"source={name!r}: not a network source")


@dataclass(frozen=True)
class Hours:
    """Cached hours of one (source, zone) on a grid: ``values`` (NaN = none), ``estimated``, ``forecast``,
    ``fetched_s`` (POSIX s, NaN = none), each shape ``(n,)``, hour ``i`` starting at ``start_s + 3600 i``."""

    start_s: float
    values: np.ndarray
    estimated: np.ndarray
    forecast: np.ndarray
    fetched_s: np.ndarray


@dataclass
class RefreshResult:
    """What one :meth:`SignalCache.refresh` of a zone and kind did: ``claimed`` (this process fetched),
    ``fetched`` (source -> hours written), ``errors`` (source -> ``"class: message"``), ``skipped`` (source ->
    why not asked)."""

    zone: str
    kind: str
    claimed: bool
    fetched: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


class SignalCache:
    """The shared cache over ``store`` and ``redis`` for ``settings`` (see the module docstring).

    Args:
        store: the :class:`broker.service.store.core.JobStore`.
        redis: a ``redis.Redis`` client.
        settings: the ``signals:`` section.
        prefix: Redis key prefix (tests use their own).
        clock: POSIX seconds now; sleep: waits that many seconds (tests pass fakes).
        sources: ``(name, zone) -> SignalSource`` overrides (tests); default :func:`build_source`.
        session: a ``requests.Session`` handed to the HTTP sources.
    """

    def __init__(self, store, redis, settings: SignalsSettings, *, prefix: str = REDIS_PREFIX,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 sources: dict[tuple[str, str], SignalSource] | None = None, session: Any = None):
        self.store, self.redis, self.settings, self.prefix = store, redis, settings, prefix
        self.clock, self.sleep = clock, sleep
        self._sources: dict[tuple[str, str], SignalSource] = dict(sources or {})
        self._session = session
        self._bucket = redis.register_script(TOKEN_BUCKET_LUA)
        self.holder = f"{socket.gethostname()}:{os.getpid()}"

    # ------------------------------------------------------------------ sources
    def source(self, name: str, zone: str) -> SignalSource:
        """The (cached) client of ``name`` for ``zone``."""
        for key in ((name, zone), (name, "")):
            if key in self._sources:
                return self._sources[key]
        key = (name, zone) if name == "tariff" else (name, "")
        self._sources[key] = build_source(name, zone, self.settings, self._session)
        return self._sources[key]

    def zones(self) -> list[tuple[str, str]]:
        """``(zone, kind)`` of every configured zone whose chain has a network source."""
        out = []
        for zone in self.settings.zones:
            for kind in ("carbon", "price"):
                if any(n != BUNDLED for n in self.settings.chain(zone, kind)):
                    out.append((zone, kind))
        return out

    # ------------------------------------------------------------------ limits
    def _take_token(self, name: str) -> None:
        """One request from ``name``'s bucket: waits for it up to ``max_backoff_s``, else raises
        :class:`RateLimited` (our own limit: nothing was sent)."""
        import redis as redis_lib

        opts = self.settings.source(name)
        while True:
            try:
                ok, value = self._bucket(keys=[f"{self.prefix}bucket:{name}"],
                                         # one request a call: its debt is at most 1 token (the script's
                                         # largest batch), a time ahead of Redis's clock is forged
                                         args=[repr(opts.requests_per_s), opts.burst, 1, 1, CLOCK_SLACK_S])
            except redis_lib.RedisError:
                return  # fail open: the source's own limit still answers 429
            if int(ok) == 1:
                return
            wait = float(value)
            if wait > opts.max_backoff_s:
                raise RateLimited(name, f"our request budget ({opts.requests_per_s:g}/s, burst {opts.burst}) "
                                  f"is spent for {wait:.0f} s", None, wait)
            self.sleep(wait)

    def backoff_until(self, name: str) -> float | None:
        """POSIX s until which source ``name`` is not asked (after a long ``Retry-After``), or ``None``."""
        v = self.redis.get(f"{self.prefix}backoff:{name}")
        if v is None:
            return None
        until = float(v)
        return until if until > self.clock() else None

    def _set_backoff(self, name: str, wait_s: float) -> None:
        until = self.clock() + wait_s
        self.redis.set(f"{self.prefix}backoff:{name}", repr(until), px=max(1, int(math.ceil(wait_s * 1000))))

    def call(self, name: str, fn: Callable[[], CheckedSeries]) -> CheckedSeries:
        """``fn()`` (one request of source ``name``) under its token bucket, with retries and back-off (module
        docstring). Raises the last :class:`SourceError` when retries are used up or the wait is too long."""
        opts = self.settings.source(name)
        for attempt in range(opts.max_retries + 1):
            self._take_token(name)
            try:
                return fn()
            except RateLimited as e:
                wait = e.retry_after_s if e.retry_after_s is not None else opts.backoff_s * 2 ** attempt
                if attempt == opts.max_retries or wait > opts.max_backoff_s:
                    self._set_backoff(name, wait)
                    raise
                log.info("%s: rate limited; retrying in %.1f s", name, wait)
                self.sleep(wait)
            except SourceUnavailable as e:
                if (e.status is not None and e.status < 500) or attempt == opts.max_retries:
                    raise
                wait = min(opts.backoff_s * 2 ** attempt, opts.max_backoff_s)
                log.info("%s: %s; retrying in %.1f s", name, e, wait)
                self.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ refresh
    def _claim(self, key: str, period_s: float, force: bool) -> bool:
        """Claim one refresh period (``SET key NX PX period``: the single-leader rule); ``force`` takes it anyway.
        True when this process fetches."""
        if force:
            self.redis.set(key, self.holder, px=int(period_s * 1000))
            return True
        return bool(self.redis.set(key, self.holder, nx=True, px=int(period_s * 1000)))

    def refresh(self, zone: str, kind: str, *, force: bool = False) -> RefreshResult:
        """Fetch ``zone``'s ``kind`` from its network sources if this process claims the period (or ``force``:
        the claim is taken anyway, e.g. ``fedbroker signals refresh --force``). Never raises for a feed fault:
        errors are recorded per source."""
        if not self._claim(f"{self.prefix}refresh:{kind}:{zone}", self.settings.refresh_for(zone), force):
            return RefreshResult(zone, kind, False)
        out = RefreshResult(zone, kind, True)
        now_s = self.clock()
        h0 = math.floor(now_s / 3600.0) * 3600.0
        stale = self.settings.stale_for(zone)
        for name in self.settings.chain(zone, kind):
            if name == BUNDLED:
                continue
            until = self.backoff_until(name)
            if until is not None:
                out.skipped[name] = f"backing off until {iso_seconds(until)} (rate limited)"
                continue
            try:
                got = self._fetch(name, zone, h0)
                if not got:
                    raise _Empty(name, f"no value for {zone} in the window (an empty answer)")
            except (SourceError, ValueError) as e:
                cls = "empty" if isinstance(e, _Empty) else error_class(e)
                msg = str(e).removeprefix(f"{name}: ")
                out.errors[name] = f"{cls}: {msg}"
                log.warning("signals: %s %s %s: %s", name, zone, kind, out.errors[name])
                with self.store.session() as s:
                    rows.record_fetch(s, name, zone, kind, _dt(now_s), stale, (cls, msg))
                continue
            with self.store.session() as s:
                rows.put_values(s, kind, UNITS[kind], got)
                rows.record_fetch(s, name, zone, kind, _dt(now_s), stale)
                rows.prune_values(s, _dt(h0 - KEEP_S))
            self._mirror(name, zone, h0 - self.settings.history_h * 3600.0,
                         h0 + self.settings.forecast_h * 3600.0 + 3600.0)
            out.fetched[name] = len(got)
        return out

    def refresh_all(self, *, force: bool = False, budget_s: float | None = None) -> list[RefreshResult]:
        """:meth:`refresh` every configured zone and kind with a network source. With ``budget_s`` (seconds), no
        further zone is started once that much time has passed: the rest are not claimed, so the next tick takes
        them (a feed timing out must not hold a worker that also plans for minutes)."""
        t0 = time.monotonic()
        out = []
        for z, k in self.zones():
            if budget_s is not None and out and time.monotonic() - t0 >= budget_s:
                break
            out.append(self.refresh(z, k, force=force))
        return out

    def _fetch(self, name: str, zone: str, h0: float) -> list[CachedHour]:
        src = self.source(name, zone)
        szone = self.settings.source_zone(zone, name)
        got: list[CheckedSeries] = []
        if isinstance(src, HasHistory):
            a = h0 - self.settings.history_h * 3600.0
            got.append(self.call(name, lambda: src.history(szone, a, h0 + 3600.0)))
        elif isinstance(src, HasLatest):
            got.append(self.call(name, lambda: src.latest(szone, h0)))
        if isinstance(src, HasForecast):
            b = h0 + self.settings.forecast_h * 3600.0
            got.append(self.call(name, lambda: src.forecast(szone, h0, b)))
        fetched = _dt(self.clock())
        out: dict[float, CachedHour] = {}
        for c in got:  # history first: a measured hour wins over the forecast of the same hour
            t = c.series.times_s()
            for i in np.flatnonzero(~np.isnan(c.series.values)):
                if float(t[i]) in out:
                    continue
                out[float(t[i])] = CachedHour(name, zone, _dt(float(t[i])), float(c.series.values[i]),
                                              bool(c.estimated[i]), c.forecast, fetched)
        return list(out.values())

    # ------------------------------------------------------------------ cloud prices
    def refresh_cloud(self, *, force: bool = False) -> list[RefreshResult]:
        """Fetch live cloud prices (``signals.cloud_prices``) of each provider whose period this process claims
        (key ``<prefix>refresh:cloud:<provider>``, TTL ``cloud_prices.refresh_s``: the single-leader rule), each
        request under :meth:`call` (token bucket, retries, back-off). Stored per offer (``zone`` = the offer id,
        kind ``cloud``, USD/h): every hour of the AWS spot series (:func:`pricing.cloud_price_sources.step_to_hourly`),
        the current hour of the AWS on-demand and GCP prices. Never raises for a feed fault: errors are recorded
        per source (``signal_fetches`` row ``(source, provider, "cloud")``)."""
        from pricing import cloud_price_sources as cps
        from pricing.catalog import load_offers

        cp = self.settings.cloud_prices
        out = []
        for provider in cp.providers:
            if not self._claim(f"{self.prefix}refresh:cloud:{provider}", cp.refresh_s, force):
                out.append(RefreshResult(provider, "cloud", False))
                continue
            res = RefreshResult(provider, "cloud", True)
            regions = cp.regions(provider)
            offers = [o for o in load_offers((provider,)).offers if o.region in regions]
            now_s = self.clock()
            h0 = math.floor(now_s / 3600.0) * 3600.0
            book = cps.CloudPriceBook()
            for name in CLOUD_SOURCES[provider]:
                until = self.backoff_until(name)
                if until is not None:
                    res.skipped[name] = f"backing off until {iso_seconds(until)} (rate limited)"
                    continue
                src = self.source(name, "")
                try:
                    hours = self._fetch_cloud(name, src, offers, regions, book, now_s, h0)
                    if not hours:
                        raise _Empty(name, f"no price for any {provider} offer in {', '.join(regions)}")
                except (SourceError, ValueError) as e:
                    cls = "empty" if isinstance(e, _Empty) else error_class(e)
                    msg = str(e).removeprefix(f"{name}: ")
                    res.errors[name] = f"{cls}: {msg}"
                    log.warning("signals: %s %s cloud: %s", name, provider, res.errors[name])
                    with self.store.session() as s:
                        rows.record_fetch(s, name, provider, "cloud", _dt(now_s), cp.stale_after_s, (cls, msg))
                    continue
                with self.store.session() as s:
                    rows.put_values(s, "cloud", UNITS["cloud"], hours)
                    rows.record_fetch(s, name, provider, "cloud", _dt(now_s), cp.stale_after_s)
                    rows.prune_values(s, _dt(h0 - KEEP_S))
                self._mirror_many({(h.source, h.zone) for h in hours}, h0 - cp.spot_history_h * 3600.0, h0 + 3600.0)
                res.fetched[name] = len(hours)
            out.append(res)
        return out

    def _fetch_cloud(self, name: str, src, offers, regions: list[str], book, now_s: float,
                     h0: float) -> list[CachedHour]:
        """One cloud source's prices of ``offers`` as cached hours (see :meth:`refresh_cloud`)."""
        from pricing import cloud_price_sources as cps
        from pricing.offers import Market

        mine = [o for o in offers if cps.live_source_for(o) == name]
        fetched = _dt(now_s)
        if name == cps.AWS_SPOT:
            a = h0 - self.settings.cloud_prices.spot_history_h * 3600.0
            for region in regions:
                itypes = sorted({o.instance_type for o in mine if o.region == region})
                if itypes:
                    book.aws_spot.update(self.call(name, lambda: src.history(region, itypes, a, h0 + 3600.0)))
            out = []
            for o in mine:
                c = book.aws_spot.get((o.zone, o.instance_type))
                if c is None:
                    continue
                t = c.series.times_s()
                out += [CachedHour(name, o.offer_id, _dt(float(t[i])), float(c.series.values[i]), bool(c.estimated[i]),
                                   False, fetched) for i in np.flatnonzero(~np.isnan(c.series.values))]
            return out
        if name == cps.AWS_PRICE_LIST:
            itypes = sorted({o.instance_type for o in mine if o.market is Market.on_demand})
            book.aws_on_demand = self.call(name, lambda: src.on_demand(itypes, regions)) if itypes else {}
            book.aws_on_demand_fetched_s = now_s
        else:
            book.gcp = self.call(name, lambda: src.rates(regions))
            book.gcp_fetched_s = now_s
        out = []
        for o in mine:
            got = book.price(o, h0)
            if got is not None:
                out.append(CachedHour(name, o.offer_id, _dt(h0), got[0].usd_per_hour, got[1], False, fetched))
        return out

    def cloud_prices(self, offers, now_s: float):
        """The live prices of ``offers`` cached at ``now_s`` (POSIX s), as a
        :class:`pricing.cloud_price_sources.OfferPrices`: per offer its source's value of the hour holding
        ``now_s``, else the latest cached hour of the :data:`KEEP_S` before it (a last-known price, however old:
        closer to the market than the bundled catalog). ``as_of_s`` is when it was fetched."""
        from pricing import cloud_price_sources as cps

        h0 = math.floor(now_s / 3600.0) * 3600.0
        n = int(KEEP_S // 3600.0) + 1
        pairs = [(cps.live_source_for(o), o.offer_id) for o in offers]
        hours = self.hours_many(pairs, h0 - (n - 1) * 3600.0, n)
        out = cps.OfferPrices()
        for (src, oid) in pairs:
            h = hours[(src, oid)]
            have = np.flatnonzero(~np.isnan(h.values))
            if have.size:
                i = int(have[-1])
                out.prices[oid] = (cps.LivePrice(float(h.values[i]), src, float(h.fetched_s[i])), bool(h.estimated[i]))
        return out

    def in_session(self, s) -> "SignalCache":
        """A view of this cache whose reads of the durable copy run inside the open session ``s`` (the caller's
        transaction: the usage ledger meters inside the one that ends an attempt, and a second connection would
        wait on SQLite's single writer). Reads only; the Redis copy is shared."""
        view = copy.copy(self)
        view.store = _InSession(s)
        return view

    # ------------------------------------------------------------------ Redis copy
    def _mirror_many(self, pairs, start_s: float, end_s: float) -> None:
        """:meth:`_mirror` of several (source, zone) pairs in one query."""
        with self.store.session() as s:
            hours = rows.value_rows(s, list(pairs), _dt(start_s), _dt(end_s))
        try:
            self._put_redis(hours)
            self.redis.incr(f"{self.prefix}version")
        except Exception as e:  # noqa: BLE001 - the database copy is enough; readers fall back to it
            log.warning("signals: could not write the Redis copy (%s); readers use the database", type(e).__name__)

    def _mirror(self, source: str, zone: str, start_s: float, end_s: float) -> None:
        """Copy the database's hours of (source, zone) in the window to Redis and bump the version."""
        self._mirror_many([(source, zone)], start_s, end_s)

    def _put_redis(self, hours: Iterable[CachedHour]) -> None:
        by: dict[str, dict[str, str]] = {}
        for h in hours:
            by.setdefault(f"{self.prefix}v:{h.source}:{h.zone}", {})[str(int(h.hour_at.timestamp()))] = json.dumps(
                [h.value, h.estimated, h.forecast, h.fetched_at.timestamp()])
        pipe = self.redis.pipeline()
        for k, mapping in by.items():
            pipe.hset(k, mapping=mapping)
            pipe.expire(k, int(KEEP_S))
        pipe.execute()

    def version(self) -> int:
        """The cache's write counter (0 when Redis has none or is unreachable)."""
        try:
            return int(self.redis.get(f"{self.prefix}version") or 0)
        except Exception:  # noqa: BLE001 - Redis down: the planner keeps its series
            return 0

    def hours(self, source: str, zone: str, start_s: float, n: int) -> Hours:
        """The cached hours of (``source``, ``zone``) on the ``n`` UTC hours from ``start_s`` (an hour start):
        from Redis; from the database when Redis lost the cache (loaded back) or cannot be reached."""
        return self.hours_many([(source, zone)], start_s, n)[(source, zone)]

    def hours_many(self, pairs: Iterable[tuple[str, str]], start_s: float, n: int) -> dict[tuple[str, str], Hours]:
        """:meth:`hours` of several (source, zone) pairs in one Redis round trip."""
        pairs = list(dict.fromkeys(pairs))
        items: dict[tuple[str, str], list] = {p: [] for p in pairs}
        try:
            self._warm(start_s, start_s + n * 3600.0)
            pipe = self.redis.pipeline(transaction=False)
            for src, zone in pairs:
                pipe.hgetall(f"{self.prefix}v:{src}:{zone}")
            for p, raw in zip(pairs, pipe.execute()):
                items[p] = [(float(k), json.loads(v)) for k, v in raw.items()]
        except Exception:  # noqa: BLE001 - Redis unreachable: read the durable copy
            with self.store.session() as s:
                got = rows.value_rows(s, pairs, _dt(start_s), _dt(start_s + n * 3600.0))
            for h in got:
                items[(h.source, h.zone)].append(
                    (h.hour_at.timestamp(), [h.value, h.estimated, h.forecast, h.fetched_at.timestamp()]))
        out = {}
        for p, its in items.items():
            vals = np.full(n, np.nan)
            est = np.zeros(n, dtype=bool)
            fc = np.zeros(n, dtype=bool)
            fetched = np.full(n, np.nan)
            for t, (v, e, f, at) in its:
                i = int(round((t - start_s) / 3600.0))
                if 0 <= i < n:
                    vals[i], est[i], fc[i], fetched[i] = v, e, f, at
            out[p] = Hours(start_s, vals, est, fc, fetched)
        return out

    def _warm(self, start_s: float, end_s: float) -> None:
        """After a Redis restart (no ``<prefix>warm`` key), and every :data:`WARM_S` anyway (keys Redis evicted under
        memory pressure), load the database's recent hours back into Redis."""
        if self.redis.exists(f"{self.prefix}warm"):
            return
        with self.store.session() as s:
            pairs = [(f.source, f.zone) for f in rows.fetch_rows(s)]
            pairs += [(USER_SOURCE, z) for z in self.settings.zones]
            if self.settings.cloud_enabled:
                pairs += rows.value_pairs(s, "cloud")
            hours = rows.value_rows(s, pairs, _dt(min(start_s, self.clock() - KEEP_S)), _dt(end_s + KEEP_S))
        if hours:
            self._put_redis(hours)
        self.redis.set(f"{self.prefix}warm", "1", ex=WARM_S)
        self.redis.incr(f"{self.prefix}version")

    # ------------------------------------------------------------------ seeding
    def seed(self, user) -> dict[str, int]:
        """Write the hours of a :class:`pricing.user_signals.UserSignals` (``--signals DIR`` files) into the cache
        as source :data:`USER_SOURCE` (measured, fetched now; interpolated or filled hours flagged estimated).
        Returns ``"kind zone" -> hours written``."""
        now = _dt(self.clock())
        out: dict[str, int] = {}
        for kind, d in (("carbon", user.carbon), ("price", user.price)):
            for zone, c in d.items():
                t = c.series.times_s()
                ok = np.flatnonzero(~np.isnan(c.series.values))
                hours = [CachedHour(USER_SOURCE, zone, _dt(float(t[i])), float(c.series.values[i]),
                                    bool(c.estimated[i]), False, now) for i in ok]
                with self.store.session() as s:
                    rows.put_values(s, kind, UNITS[kind], hours)
                self._put_redis(hours)
                out[f"{kind} {zone}"] = len(hours)
        self.redis.incr(f"{self.prefix}version")
        return out

    # ------------------------------------------------------------------ health
    def health(self) -> list[dict]:
        """Per (zone, kind, source) of the settings' chains: the last measured value cached (gCO2e/kWh or USD/MWh)
        and its hour, last success, age (s), last error, error counts and ``health`` (ok, stale, never fetched,
        backing off, no API key: never the key); then per cloud provider of ``cloud_prices`` and source
        (``kind`` = ``cloud``, no single last value: prices are per offer)."""
        now_s = self.clock()
        with self.store.session() as s:
            fetched = {(f.zone, f.kind, f.source): (f.last_success_at, f.last_attempt_at, f.last_error,
                                                    dict(f.error_counts or {})) for f in rows.fetch_rows(s)}
        out = []
        for zone in self.settings.zones:
            for kind in ("carbon", "price"):
                for name in self.settings.chain(zone, kind):
                    ent = {"zone": zone, "kind": kind, "source": name, "last_value": None, "last_hour": None,
                           "last_success": None, "age_s": None, "last_error": "", "errors": {}, "health": "ok"}
                    if name == BUNDLED:
                        ent["health"] = "fallback (bundled 2023-24 history, replayed by whole weeks)"
                        out.append(ent)
                        continue
                    h0 = math.floor(now_s / 3600.0) * 3600.0
                    h = self.hours(name, zone, h0 - 48 * 3600.0, 49)
                    have = np.flatnonzero(~np.isnan(h.values) & ~h.forecast)
                    if have.size:
                        i = int(have[-1])
                        ent["last_value"] = float(h.values[i])
                        ent["last_hour"] = iso_seconds(h0 - 48 * 3600.0 + i * 3600.0)
                    self._fill_health(ent, fetched.get((zone, kind, name)), self.settings.stale_for(zone), now_s)
                    out.append(ent)
        cp = self.settings.cloud_prices
        for provider in cp.providers:  # cloud prices: one entry per provider and source (values are per offer)
            for name in CLOUD_SOURCES[provider]:
                ent = {"zone": provider, "kind": "cloud", "source": name, "last_value": None, "last_hour": None,
                       "last_success": None, "age_s": None, "last_error": "", "errors": {}, "health": "ok"}
                self._fill_health(ent, fetched.get((provider, "cloud", name)), cp.stale_after_s, now_s)
                out.append(ent)
        return out

    def _fill_health(self, ent: dict, f: tuple | None, stale: float, now_s: float) -> None:
        """Fill ``ent``'s last success, age, errors and ``health`` from its ``signal_fetches`` row ``f``
        (``(last_success_at, last_attempt_at, last_error, error_counts)`` or ``None``) and staleness ``stale`` s."""
        name = ent["source"]
        if f is not None:
            ok_at, _, err, counts = f
            ent["last_error"], ent["errors"] = err, counts
            if ok_at is not None:
                ent["last_success"] = ok_at.isoformat(timespec="seconds")
                ent["age_s"] = round(now_s - ok_at.timestamp(), 1)
        until = self.backoff_until(name)
        if name in KEY_ENVS and not self.settings.api_key(name):
            ent["health"] = f"no API key ({self.settings.key_hint(name)})"
        elif until is not None:
            ent["health"] = f"backing off until {iso_seconds(until)}"
        elif ent["age_s"] is None:
            ent["health"] = "never fetched" + (f" ({ent['last_error']})" if ent["last_error"] else "")
        elif not is_fresh(now_s - ent["age_s"], now_s, stale):
            ent["health"] = f"stale (older than {stale:.0f} s)"
        elif ent["last_error"] and f[1] > f[0]:
            ent["health"] = "ok (last attempt failed: " + ent["last_error"] + ")"


class _InSession:
    """A store stand-in whose ``session()`` is an already open session (not committed or closed here)."""

    def __init__(self, s):
        self._s = s

    @contextmanager
    def session(self):
        """The open session."""
        yield self._s


class _Empty(SourceError):
    """A source answered without a single value for the window (counted as ``empty``)."""


def _dt(t_s: float) -> datetime:
    return datetime.fromtimestamp(t_s, tz=timezone.utc)

