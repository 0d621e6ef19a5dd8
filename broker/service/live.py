"""The live broker's planning inputs: pools, offers and grid signals for "now".

The simulator and the live broker call the same :func:`broker.planner.registry.plan`.
What differs is where the inputs come from:

* **Pools**: the site parameters (grid zones, PUE, $/GPU-h, time zone) come from
  a cluster YAML file (default ``broker/data/local_cluster.yaml``); the *nodes*
  are the hosts whose agents heartbeat into the store. A pool with no live node
  is left out of the cycle.
* **Offers**: the bundled AWS/GCP catalog (``pricing.catalog``). They are costed
  in every decision (so explain records show what the cloud would have cost),
  but provisionable only for providers listed in ``settings.cloud_providers``.
  When ``signals.cloud_prices`` lists regions, the offers there are re-priced from the cached live cloud
  prices (:meth:`broker.service.signal_cache.SignalCache.cloud_prices`,
  :func:`pricing.cloud_price_sources.reprice_offers`); every other offer keeps its bundled catalog price, and a
  provisioning decision's explain record says which (``cloud_price``: source, age, fallback).
* **Signals**: for zones the ``signals:`` settings section configures, :class:`LiveSignals`: the hours around
  now come from the shared cache (:mod:`broker.service.signal_cache`) through a
  :class:`pricing.sources.SourceChain`: each configured source's *fresh* values, then its *last-known* values
  (however old), then the forecast model hook (:func:`forecast_model`), then the bundled history replay; every
  hour keeps its origin, estimate flag, forecast flag and fetch time. Everywhere else (and for every zone when
  no section is configured) the bundled 2023-2024 history is *replayed*: every series is shifted forward by a
  whole number of weeks (:func:`replay_offset_s`), so hours of the week and the daily and weekly cycles line
  up with the present. Each decision's explain record carries a ``signals`` list saying, per zone and kind,
  which source the current hour came from, how old it is, whether it is a forecast or measured, and whether
  the planner is deciding on a fallback (:meth:`LiveSignals.explain`, :meth:`ReplayedSignals.explain`).
  The planner stays pure: it receives :class:`~pricing.series.HourlySeries`.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from broker import DATA_DIR
from broker.model import WEEK_S, CloudOffer, Pool, PoolNode
from broker.planner.core import GpuTable, PlannerConfig, PlannerContext
from broker.utc import iso_minutes
from pricing.hygiene import CheckedSeries
from pricing.sources import window_from_series
from pricing.series import HourlySeries

__all__ = ["LIVE_CLUSTER_PATH", "WEEK_S", "replay_offset_s", "live_replay_offset_s", "history_bounds", "replay_note",
           "REPLAY_MARGIN_S", "ReplayedSignals", "LiveSignals", "LiveEnvironment",
           "LiveNode", "forecast_model", "series_rows", "REPLAY", "LAST_KNOWN", "FORECAST_MODEL", "SIGNALS_REBUILD_S"]

#: origin label of hours from the bundled history replay
REPLAY = "bundled-replay"
#: origin label prefix of a source's values older than its zone's ``stale_after_s`` (``last-known:<source>``)
LAST_KNOWN = "last-known:"
#: origin label of hours from :func:`forecast_model`
FORECAST_MODEL = "forecast-model"
#: the live series are rebuilt at least this often (seconds) even when the cache did not change, so values
#: turn from fresh to last-known within this much of their staleness limit
SIGNALS_REBUILD_S = 300.0

LIVE_CLUSTER_PATH = DATA_DIR / "local_cluster.yaml"

log = logging.getLogger("fedbroker.live")


def replay_offset_s(series_start_s: float, series_end_s: float, now_s: float, ahead_s: float) -> float:
    """Whole-week shift (seconds, >= 0) that puts ``[now_s, now_s + ahead_s]`` inside the history.

    The smallest number of weeks ``k`` such that ``now_s + ahead_s - k x WEEK_S <= series_end_s``;
    0 when the history already covers the window. Raises ``ValueError`` when the history is
    shorter than ``ahead_s`` plus one week.
    """
    if series_end_s - series_start_s < ahead_s + WEEK_S:
        raise ValueError(f"ahead_s={ahead_s}: the history ({(series_end_s - series_start_s) / 86400:.0f} days) "
                         "is too short to replay that far ahead")
    over = now_s + ahead_s - series_end_s
    return 0.0 if over <= 0 else math.ceil(over / WEEK_S) * WEEK_S


#: how far past the planner's horizon the live broker's replayed history must reach (:func:`live_replay_offset_s`)
REPLAY_MARGIN_S = 8 * 86400.0


def history_bounds(signals) -> tuple[float, float]:
    """``(start_s, end_s)`` (POSIX s, UTC) that every carbon series of ``signals`` (a
    :class:`pricing.signals.GridSignals`, the bundled history) covers: the latest start and the earliest end."""
    series = [signals.carbon(z) for z in signals.zones]
    return max(s.start_s for s in series), min(s.end_s for s in series)


def live_replay_offset_s(hist_start_s: float, hist_end_s: float, now_s: float, horizon_s: float) -> float:
    """The whole-week shift (s) with which the live broker replays the bundled history at ``now_s``
    (:func:`replay_offset_s` over ``horizon_s`` plus :data:`REPLAY_MARGIN_S`): :meth:`LiveEnvironment.offset_for`
    and ``fedbroker offers`` price from the same series. E.g. on 2026-12-04 with the 2023-24 history and a 72 h
    horizon: +102 weeks."""
    return replay_offset_s(hist_start_s, hist_end_s, now_s, horizon_s + REPLAY_MARGIN_S)


def replay_note(offset_s: float, why: str = "no live source configured") -> str:
    """What priced a window replayed ``offset_s`` seconds forward (the ``note`` of :meth:`ReplayedSignals.explain`,
    without the zone): ``"bundled 2023-24 history replayed +102 weeks (no live source configured)"``."""
    return f"bundled 2023-24 history replayed +{offset_s / WEEK_S:.0f} weeks ({why})"


class ReplayedSignals:
    """A ``GridSignals``-like view whose series are shifted forward by ``offset_s`` seconds.

    ``carbon(zone)`` gives gCO2e/kWh, ``price(zone)`` USD/MWh or ``None``; raises like
    :class:`pricing.signals.GridSignals` for unknown zones.
    """

    def __init__(self, base, offset_s: float):
        self.base = base
        self.offset_s = float(offset_s)
        self._cache: dict[tuple[str, str], HourlySeries | None] = {}

    def _shift(self, s: HourlySeries | None) -> HourlySeries | None:
        if s is None or self.offset_s == 0:
            return s
        return HourlySeries(s.zone, s.unit, s.start_s + self.offset_s, s.values, s.interval_s)

    def carbon(self, zone: str) -> HourlySeries:
        """Carbon intensity of ``zone``, gCO2e/kWh, UTC hours, shifted by ``offset_s``."""

        key = ("c", zone)
        if key not in self._cache:
            self._cache[key] = self._shift(self.base.carbon(zone))
        return self._cache[key]

    def price(self, zone: str) -> HourlySeries | None:
        """Electricity price of ``zone``, USD/MWh, UTC hours, shifted by ``offset_s``; ``None`` if the zone has none."""

        key = ("p", zone)
        if key not in self._cache:
            self._cache[key] = self._shift(self.base.price(zone))
        return self._cache[key]

    def explain(self, zones: Sequence[tuple[str, str]], now_s: float) -> list[dict]:
        """Explain entries (see :meth:`LiveSignals.explain`) for ``(zone, kind)`` pairs: all from the replay."""
        return [_replay_entry(z, k, self.offset_s, "no live source configured") for z, k in zones]


def _replay_entry(zone: str, kind: str, offset_s: float, why: str) -> dict:
    return {"zone": zone, "kind": kind, "source": REPLAY, "age_s": None, "forecast": False, "estimated": True,
            "fallback": False, "replay_offset_s": offset_s, "hours": {},
            "note": f"{kind} {zone}: {replay_note(offset_s, why)}"}


def series_rows(signals, zone: str, kind: str, now_s: float, hours: int) -> list[dict]:
    """The ``hours`` UTC hours from the one holding ``now_s`` of the series the planner uses for ``zone``'s ``kind``
    (``signals``: :class:`LiveSignals` or :class:`ReplayedSignals`), one dict per hour: ``hour`` (ISO UTC),
    ``value`` (gCO2e/kWh or USD/MWh; ``None`` when missing), ``source`` (origin), ``estimated``, ``forecast``,
    ``age_s`` (seconds since fetched; ``None`` for replayed or filled hours). Raises
    :class:`pricing.errors.UnknownZoneError` for a zone the signals do not hold."""
    h0 = math.floor(now_s / 3600.0) * 3600.0
    series = signals.carbon(zone) if kind == "carbon" else signals.price(zone)
    live = isinstance(signals, LiveSignals) and signals.network_sources(zone, kind)
    if live:
        checked, fc, fetched = signals.checked(zone, kind)
        start = checked.series.start_s
    out = []
    for k in range(hours):
        t = h0 + k * 3600.0
        v = float("nan") if series is None else series.value_at(t)
        row = {"hour": iso_minutes(t),
               "value": None if math.isnan(v) else v, "source": REPLAY if series is not None else "",
               "estimated": series is not None, "forecast": False, "age_s": None}
        if live:
            i = int(round((t - start) / 3600.0))
            if 0 <= i < checked.series.values.size:
                row.update(source=str(checked.origin[i]), estimated=bool(checked.estimated[i]), forecast=bool(fc[i]),
                           age_s=None if np.isnan(fetched[i]) else round(now_s - float(fetched[i]), 1))
        out.append(row)
    return out


def forecast_model(zone: str, kind: str, recent: CheckedSeries, start_s: float, end_s: float) -> CheckedSeries | None:
    """The forecast model's hours of ``[start_s, end_s)`` (``start_s`` on the UTC hour) of ``zone``'s ``kind``
    (gCO2e/kWh or USD/MWh), from ``recent``: the zone's first source's cached hours of the planner's window,
    however old (only the hours before ``start_s`` are read: no peeking), missing = NaN.

    The model is :func:`pricing.forecast.forecast` (``blend``: the same hour yesterday and last week blended,
    plus the recent departure decaying; fitted on 2023, error measured on 2024 in docs/FORECASTS.md), asked
    only for hours no source has a fresh or last-known value for, before the bundled replay. An hour whose
    lags are all missing stays NaN (the replay then gives it); ``None`` when ``recent`` holds no value at all."""
    from pricing.forecast import forecast

    n = int(math.ceil((end_s - start_s) / 3600.0))
    if n < 1 or not np.isfinite(recent.series.values).any():
        return None
    return forecast(recent.series, start_s, n)


class _Layer:
    """One step of a zone's chain as a :class:`pricing.sources.SignalSource` with ``history``: fixed hours."""

    def __init__(self, name: str, kind: str, unit: str, checked: CheckedSeries):
        self.name, self.kind, self.unit, self._checked = name, kind, unit, checked

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """The layer's hours (already on the window's grid)."""
        return self._checked


class _ReplayLayer:
    """The bundled history source shifted forward by ``offset_s`` (whole weeks), origin :data:`REPLAY`."""

    def __init__(self, bundled, offset_s: float):
        self.bundled, self.offset_s = bundled, offset_s
        self.name, self.kind, self.unit = REPLAY, bundled.kind, bundled.unit

    def history(self, zone: str, start_s: float, end_s: float) -> CheckedSeries:
        """Hours of ``[start_s, end_s)`` from the bundled hours ``offset_s`` earlier; raises ``UnknownZoneError``."""
        c = self.bundled.history(zone, start_s - self.offset_s, end_s - self.offset_s)
        s = HourlySeries(zone, self.unit, c.series.start_s + self.offset_s, c.series.values)
        return CheckedSeries(s, c.estimated, np.where(c.origin == "", "", REPLAY).astype(object))


class LiveSignals:
    """The planner's signals when the ``signals:`` section is configured: a ``GridSignals``-like view.

    ``carbon(zone)`` (gCO2e/kWh) and ``price(zone)`` (USD/MWh or ``None``) are the bundled replay (offset
    ``offset_s``) with the window ``[hour(now) - history_h, hour(now) + ahead_s)`` replaced, for zones with a
    network source, by the chain result (module docstring). Built once per context; nothing here touches the
    network (the cache is filled by the refresh task).

    Args:
        base: the bundled ``GridSignals``; offset_s: the replay shift, seconds (whole weeks).
        cache: the :class:`broker.service.signal_cache.SignalCache`; settings: its ``signals:`` section.
        now_s: POSIX s of the build; ahead_s: seconds of hours after now to fill (the planner's horizon + 8 days).
        start_s: POSIX s the window starts at instead of ``history_h`` before now (the usage ledger's view of a
            past attempt, :meth:`LiveEnvironment.billing_signals`); floored to the UTC hour.
        per_hour: judge a cached value's freshness at the end of *its* hour (or ``now_s`` if earlier) rather
            than at ``now_s``: what the planner had for that hour plus the measurements fetched after it, so a
            past hour's measured value is not "last known" only because the bill is written later.
    """

    def __init__(self, base, offset_s: float, cache, settings, now_s: float, ahead_s: float,
                 start_s: float | None = None, per_hour: bool = False):
        self.replay = ReplayedSignals(base, offset_s)
        self.offset_s = float(offset_s)
        self.cache, self.settings = cache, settings
        self.now_s = float(now_s)
        self.per_hour = per_hour
        self.h0 = math.floor(now_s / 3600.0) * 3600.0
        self.start_s = (self.h0 - settings.history_h * 3600.0 if start_s is None
                        else min(self.h0, math.floor(start_s / 3600.0) * 3600.0))
        self.n = int((self.h0 + math.ceil(ahead_s / 3600.0) * 3600.0 - self.start_s) / 3600.0)
        self._built: dict[tuple, object] = {}
        self._hours: dict | None = None

    def carbon(self, zone: str) -> HourlySeries:
        """Carbon intensity of ``zone``, gCO2e/kWh, UTC hours."""
        return self._series(zone, "carbon")

    def price(self, zone: str) -> HourlySeries | None:
        """Electricity price of ``zone``, USD/MWh, UTC hours; ``None`` if neither the bundle nor a source has one."""
        return self._series(zone, "price")

    def network_sources(self, zone: str, kind: str) -> list[str]:
        """The zone's configured sources of ``kind`` other than the bundled history, in order."""
        from broker.service.signal_settings import BUNDLED

        return [n for n in self.settings.chain(zone, kind) if n != BUNDLED]

    def _series(self, zone: str, kind: str) -> HourlySeries | None:
        key = ("series", zone, kind)
        if key not in self._built:
            self._built[key] = self._merge(zone, kind)
        return self._built[key]

    def _merge(self, zone: str, kind: str) -> HourlySeries | None:
        """The replay with the window's hours replaced by the chain result (built once per zone and kind)."""
        base = self.replay.carbon(zone) if kind == "carbon" else self.replay.price(zone)
        if not self.network_sources(zone, kind):
            return base
        built = self.checked(zone, kind)[0].series
        if base is None:
            return built
        vals = base.values.copy()
        idx = np.rint((built.times_s() - base.start_s) / 3600.0).astype(np.int64)
        ok = (idx >= 0) & (idx < vals.size)
        if not ok.all():  # the window runs past the bundled series: extend it with NaN
            lo, hi = min(0, int(idx.min())), max(vals.size, int(idx.max()) + 1)
            ext = np.full(hi - lo, np.nan)
            ext[-lo:-lo + vals.size] = vals
            vals, idx, start = ext, idx - lo, base.start_s + lo * 3600.0
        else:
            start = base.start_s
        have = ~np.isnan(built.values)
        vals[idx[have]] = built.values[have]
        return HourlySeries(zone, base.unit, start, vals)

    def checked(self, zone: str, kind: str) -> tuple[CheckedSeries, np.ndarray, np.ndarray]:
        """The window's chain result of ``zone``'s ``kind``: ``(checked, forecast flags, fetched POSIX s)``, each
        per hour of the window (fetched NaN for replayed, interpolated or conservative hours)."""
        key = (zone, kind)
        if key in self._built:
            return self._built[key]
        from broker.service.signal_cache import UNITS, USER_SOURCE, is_fresh
        from pricing.sources import BundledCarbon, BundledPrice, SourceChain

        unit, n, start = UNITS[kind], self.n, self.start_s
        stale = self.settings.stale_for(zone)
        names = self.network_sources(zone, kind) + [USER_SOURCE]
        if self._hours is None:  # every configured zone's cached hours in one round trip
            pairs = [(nm, z) for z in self.settings.zones for k in ("carbon", "price")
                     for nm in self.network_sources(z, k) + [USER_SOURCE]]
            self._hours = self.cache.hours_many(pairs, start, n)
        hours = {nm: self._hours.get((nm, zone)) or self.cache.hours(nm, zone, start, n) for nm in names}

        def layer(label: str, vals, est, fc=False) -> _Layer:
            s = HourlySeries(zone, unit, start, vals)
            return _Layer(label, kind, unit, CheckedSeries.of(s, label, est, fc))

        layers = []
        meta: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        judged_at = (np.minimum(start + (np.arange(n) + 1) * 3600.0, self.now_s) if self.per_hour else self.now_s)
        for nm in names[:-1]:  # fresh values of each configured source, in order
            h = hours[nm]
            fresh = ~np.isnan(h.fetched_s) & is_fresh(h.fetched_s, judged_at, stale)
            layers.append(layer(nm, np.where(fresh, h.values, np.nan), h.estimated))
            meta[nm] = (h.forecast, h.fetched_s)
        for nm in names:  # then whatever each source (and the seeded files) last gave, however old
            h = hours[nm]
            layers.append(layer(LAST_KNOWN + nm, h.values, np.ones(n, dtype=bool)))
            meta[LAST_KNOWN + nm] = (h.forecast, h.fetched_s)
        recent = layers[len(names) - 1].history(zone, start, self.h0)  # the primary's cached hours, however old
        model = forecast_model(zone, kind, recent, self.h0, start + n * 3600.0)
        if model is not None:  # on the window's grid (NaN before now), labelled as this layer
            layers.append(_Layer(FORECAST_MODEL, kind, unit, window_from_series(
                model.series, start, start + n * 3600.0, FORECAST_MODEL, True, True)))
            meta[FORECAST_MODEL] = (np.ones(n, dtype=bool), np.full(n, np.nan))
        # the bundled replay is the last resort whether the chain lists it or not: the planner's series
        # outside the window is the replay anyway, and an hour inside it must not be left to a stand-in first
        layers.append(_ReplayLayer(BundledCarbon() if kind == "carbon" else BundledPrice(), self.offset_s))
        res = SourceChain(layers).window(zone, start, start + n * 3600.0)
        fc = np.zeros(n, dtype=bool)
        fetched = np.full(n, np.nan)
        for label, (f, t) in meta.items():
            m = res.checked.origin == label
            fc[m], fetched[m] = f[m], t[m]
        out = (res.checked, fc, fetched)
        self._built[key] = out
        return out

    def explain(self, zones: Sequence[tuple[str, str]], now_s: float) -> list[dict]:
        """Per ``(zone, kind)``: where the planner's value for the hour holding ``now_s`` came from.

        Each entry: ``zone``, ``kind``, ``source`` (a source name, ``last-known:<source>``, ``forecast-model``,
        ``bundled-replay``, ``interpolated`` or ``conservative``), ``age_s`` (seconds since it was fetched; ``None``
        for replayed or filled hours), ``forecast`` (a forecast rather than a measurement), ``estimated``,
        ``fallback`` (True when the zone has live sources but none gave a fresh value for this hour),
        ``hours`` (origin -> hours of the next ``horizon`` used by the planner), ``replay_offset_s`` and ``note``
        (one sentence). Never holds a key."""
        out = []
        for zone, kind in zones:
            net = self.network_sources(zone, kind)
            if not net:
                out.append(_replay_entry(zone, kind, self.offset_s, "no live source configured for the zone"))
                continue
            checked, fc, fetched = self.checked(zone, kind)
            i = min(max(int((math.floor(now_s / 3600.0) * 3600.0 - self.start_s) / 3600.0), 0), self.n - 1)
            org = str(checked.origin[i]) or "missing"
            age = None if np.isnan(fetched[i]) else round(now_s - float(fetched[i]), 1)
            ahead = checked.origin[i:i + 48]
            labels, counts = np.unique(np.where(ahead == "", "missing", ahead).astype(str), return_counts=True)
            hours = {str(k): int(c) for k, c in zip(labels, counts)}
            fallback = org not in net
            what = "forecast" if fc[i] else "measured"
            if not fallback:
                note = f"{kind} {zone}: {org} ({what}, {age / 3600.0:.1f} h old)"
            else:
                got = (f"{org.removeprefix(LAST_KNOWN)}'s last known value ({what}, {age / 3600.0:.1f} h old)"
                       if org.startswith(LAST_KNOWN) and age is not None else
                       f"the bundled 2023-24 history replayed +{self.offset_s / WEEK_S:.0f} weeks" if org == REPLAY
                       else f"the {org} value")
                note = (f"{kind} {zone}: no fresh value from {', '.join(net)}; deciding on {got}"
                        + f" (next 48 h: {', '.join(f'{k} {v} h' for k, v in sorted(hours.items()))})")
            out.append({"zone": zone, "kind": kind, "source": org, "age_s": age, "forecast": bool(fc[i]),
                        "estimated": bool(checked.estimated[i]), "fallback": fallback,
                        "replay_offset_s": self.offset_s, "hours": hours, "note": note})
        return out


@dataclass(frozen=True)
class LiveNode:
    """A node as one planning cycle sees it: ``healthy`` GPU indices of ``gpu_count``."""

    name: str
    pool: str
    gpu_type: str
    gpu_count: int
    gpu_memory_gb: float
    healthy: tuple[int, ...]


class LiveEnvironment:
    """Loads the static inputs once and builds a :class:`PlannerContext` per node topology.

    Args:
        planner: the planner settings.
        cluster: cluster YAML path (site parameters of the pools), default :data:`LIVE_CLUSTER_PATH`.
        providers: cloud providers whose offers may be provisioned (others are costed only).
        offer_allowed: optional further test per offer (``broker.service.cloud.offer_allowed``: the provider's
            settings have a network in the offer's zone).
        signals: the ``signals:`` settings section and cache: ``(SignalsSettings, SignalCache)``; ``None`` or a
            section with no zone = the bundled replay everywhere.

    Raises ``broker.cluster.ClusterError`` / ``ValueError`` for a bad cluster file.
    """

    def __init__(self, planner: PlannerConfig, cluster: str | Path | None = None, providers: Sequence[str] = (),
                 offer_allowed: Callable[[CloudOffer], bool] | None = None, signals: tuple | None = None):
        from broker.sim.scenario import load_scenario

        scen = load_scenario(cluster or LIVE_CLUSTER_PATH)
        self.planner = planner
        self.site_pools: dict[str, Pool] = {p.name: p for p in scen.pools}
        self.offers: list[CloudOffer] = list(scen.offers) if planner.cloud_enabled else []
        self.providers = frozenset(providers)
        self._allowed = [o.provider in self.providers and (offer_allowed is None or offer_allowed(o))
                         for o in self.offers]
        self.base_signals = scen.signals
        self.gpus: GpuTable = scen.gpus or GpuTable.from_pricing()
        self._hist_start, self._hist_end = history_bounds(scen.signals)
        self.signal_settings, self.signal_cache = signals if signals is not None else (None, None)
        self._live = bool(self.signal_settings is not None and self.signal_settings.enabled
                          and self.signal_cache is not None)
        self._cloud = bool(self.signal_settings is not None and self.signal_settings.cloud_enabled
                           and self.signal_cache is not None)
        self._offers_key = None
        self._priced: tuple[list[CloudOffer], dict] = (self.offers, {})
        self._lock = threading.Lock()
        self._sig_lock = threading.Lock()
        self._sig: tuple | None = None
        self._ctx_key = None
        self._ctx: PlannerContext | None = None

    def offset_for(self, now_s: float) -> float:
        """The replay offset (seconds) for a cycle at ``now_s``: covers the planner's horizon plus 8 days."""
        return live_replay_offset_s(self._hist_start, self._hist_end, now_s, self.planner.horizon_s)

    def pools_for(self, nodes: Sequence[LiveNode]) -> list[Pool]:
        """Pools of the cluster file that have at least one live node with a healthy GPU, nodes by name."""
        by_pool: dict[str, list[LiveNode]] = {}
        for n in nodes:
            if n.pool in self.site_pools and n.gpu_count > 0:
                by_pool.setdefault(n.pool, []).append(n)
        pools = []
        for name, site in self.site_pools.items():
            members = sorted(by_pool.get(name, []), key=lambda n: n.name)
            if not members:
                continue
            pools.append(site.model_copy(update={"nodes": tuple(
                PoolNode(name=n.name, gpu_type=n.gpu_type, gpu_count=n.gpu_count, gpu_memory_gb=n.gpu_memory_gb)
                for n in members)}))
        return pools

    def signals_at(self, now_s: float) -> ReplayedSignals | LiveSignals:
        """The planner's signals at ``now_s``: :class:`LiveSignals` when live sources are configured (the same
        object until the cache changes or :data:`SIGNALS_REBUILD_S` passes), else the bundled replay
        (:class:`ReplayedSignals`)."""
        offset = self.offset_for(now_s)
        if not self._live:
            return ReplayedSignals(self.base_signals, offset)
        key = (offset, self._signals_key(now_s))
        with self._sig_lock:
            if self._sig is None or self._sig[0] != key:  # one build per cache version and rebuild period
                self._sig = (key, LiveSignals(self.base_signals, offset, self.signal_cache, self.signal_settings,
                                              now_s, self.planner.horizon_s + 8 * 86400.0))
            return self._sig[1]

    def billing_signals(self, start_s: float, end_s: float, session=None) -> ReplayedSignals | LiveSignals:
        """The signals the usage ledger prices ``[start_s, end_s]`` (POSIX s, a past window) on: for the zones the
        ``signals:`` section configures, a :class:`LiveSignals` built at ``end_s`` whose window starts at
        ``start_s``'s hour, each hour's cached value judged fresh at that hour's end (``per_hour``): the same chain
        the planner uses (fresh, last known, forecast model, bundled replay) with the measurements fetched since;
        elsewhere the bundled replay at ``start_s``'s offset, as :meth:`signals_at`. Not memoised (one per
        metered attempt; reads the cache once). ``session``: an open store session the cache's database reads run
        in (:meth:`broker.service.signal_cache.SignalCache.in_session`)."""
        offset = self.offset_for(start_s)
        if not self._live:
            return ReplayedSignals(self.base_signals, offset)
        c = self.signal_cache if session is None else self.signal_cache.in_session(session)
        return LiveSignals(self.base_signals, offset, c, self.signal_settings, max(end_s, start_s), 3600.0,
                           start_s=start_s, per_hour=True)

    @property
    def live_cloud_prices(self):
        """The :class:`broker.service.signal_cache.SignalCache` holding live cloud prices when
        ``signals.cloud_prices`` is configured, else ``None``."""
        return self.signal_cache if self._cloud else None

    def _signals_key(self, now_s: float) -> tuple:
        """What the live series and the live-priced offers depend on besides the offset: the cache's version and
        the rebuild period (``()`` when neither is configured)."""
        if not (self._live or self._cloud):
            return ()
        return (self.signal_cache.version(), math.floor(now_s / SIGNALS_REBUILD_S))

    def offers_at(self, now_s: float) -> list[CloudOffer]:
        """The offers the planner prices at ``now_s``, in :attr:`offers` order: re-priced from the cached live
        cloud prices where ``signals.cloud_prices`` lists the region (rebuilt when the cache changes or
        :data:`SIGNALS_REBUILD_S` passes), else the bundled catalog's."""
        if not self._cloud or not self.offers:
            return self.offers
        key = self._signals_key(now_s)
        with self._sig_lock:
            if key != self._offers_key:
                from pricing.cloud_price_sources import reprice_offers

                cp = self.signal_settings.cloud_prices
                live = [o for o in self.offers if o.region in cp.regions(o.provider)]
                try:
                    prices = self.signal_cache.cloud_prices(live, now_s)
                except Exception as e:  # noqa: BLE001 - Redis and the database both down: decide on the catalog
                    log.warning("cloud prices: cache unreadable (%s); bundled catalog prices", type(e).__name__)
                    from pricing.cloud_price_sources import OfferPrices

                    prices = OfferPrices()
                out = reprice_offers(self.offers, prices, now_s)
                self._priced = ([o for o, _ in out], {o.offer_id: why for o, why in out})
                self._offers_key = key
            return self._priced[0]

    def cloud_price_note(self, offer: CloudOffer, now_s: float) -> dict | None:
        """Where ``offer``'s $/h came from, for an explain record: ``offer_id``, ``source`` (a live source or
        ``bundled-catalog``), ``usd_per_hour``, ``age_s`` (seconds since fetched; ``None`` for the catalog),
        ``last_known`` (older than ``cloud_prices.stale_after_s``), ``estimated``, ``fallback`` and ``note``.
        ``None`` when no cloud price source is configured."""
        if not self._cloud:
            return None
        self.offers_at(now_s)
        why = self._priced[1].get(offer.offer_id)
        if why is None:
            return None
        cp = self.signal_settings.cloud_prices
        live_region = offer.region in cp.regions(offer.provider)
        last_known = why.age_s is not None and why.age_s > cp.stale_after_s
        if why.fallback:
            note = (f"{offer.offer_id}: bundled catalog price" + (
                " (no live price cached for it)" if live_region else " (region not in signals.cloud_prices)"))
        else:
            note = (f"{offer.offer_id}: {why.price_source}, {why.age_s / 3600.0:.1f} h old"
                    + (" (last known: older than the staleness limit)" if last_known else ""))
        return {"offer_id": offer.offer_id, "source": why.price_source, "usd_per_hour": offer.usd_per_hour,
                "age_s": why.age_s, "last_known": last_known, "estimated": why.estimated,
                "fallback": why.fallback and live_region, "note": note}

    def context(self, pools: Sequence[Pool], now_s: float) -> PlannerContext:
        """The planner context for ``pools`` at ``now_s``; rebuilt only when the topology or replay offset changes,
        or (live signals) when the cache changed or :data:`SIGNALS_REBUILD_S` passed."""
        offset = self.offset_for(now_s)
        key = (tuple((p.name, p.nodes) for p in pools), offset, self._signals_key(now_s))
        with self._lock:
            if key != self._ctx_key:
                self._ctx = PlannerContext(self.planner, pools, self.offers_at(now_s), self.signals_at(now_s),
                                           self.gpus)
                self._ctx_key = key
            return self._ctx

    def offer_provisionable(self) -> list[bool]:
        """Per offer: may it be provisioned (its provider is configured and ``offer_allowed`` says yes: a
        network exists for its zone)?"""
        return list(self._allowed)
