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
* **Signals**: bundled hourly carbon intensity and electricity price history
  (2023-2024). Until a live signal source is configured, the broker *replays*
  that history as its forecast: every series is shifted forward by a whole
  number of weeks (:func:`replay_offset_s`), so hours of the week and the daily
  and weekly cycles line up with the present. The offset is shown in explain
  records' context and in ``fedbroker serve`` logs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from broker import DATA_DIR
from broker.model import WEEK_S, CloudOffer, Pool, PoolNode
from broker.planner.core import GpuTable, PlannerConfig, PlannerContext
from pricing.series import HourlySeries

__all__ = ["LIVE_CLUSTER_PATH", "WEEK_S", "replay_offset_s", "ReplayedSignals", "LiveEnvironment", "LiveNode"]

LIVE_CLUSTER_PATH = DATA_DIR / "local_cluster.yaml"


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

    Raises ``broker.cluster.ClusterError`` / ``ValueError`` for a bad cluster file.
    """

    def __init__(self, planner: PlannerConfig, cluster: str | Path | None = None, providers: Sequence[str] = (),
                 offer_allowed: Callable[[CloudOffer], bool] | None = None):
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
        series = [scen.signals.carbon(z) for z in scen.signals.zones]
        self._hist_start = max(s.start_s for s in series)
        self._hist_end = min(s.end_s for s in series)
        self._lock = threading.Lock()
        self._ctx_key = None
        self._ctx: PlannerContext | None = None

    def offset_for(self, now_s: float) -> float:
        """The replay offset (seconds) for a cycle at ``now_s``: covers the planner's horizon plus 8 days."""
        return replay_offset_s(self._hist_start, self._hist_end, now_s, self.planner.horizon_s + 8 * 86400.0)

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

    def context(self, pools: Sequence[Pool], now_s: float) -> PlannerContext:
        """The planner context for ``pools`` at ``now_s``; rebuilt only when the topology or replay offset changes."""
        offset = self.offset_for(now_s)
        key = (tuple((p.name, p.nodes) for p in pools), offset)
        with self._lock:
            if key != self._ctx_key:
                self._ctx = PlannerContext(self.planner, pools, self.offers, ReplayedSignals(self.base_signals, offset),
                                           self.gpus)
                self._ctx_key = key
            return self._ctx

    def offer_provisionable(self) -> list[bool]:
        """Per offer: may it be provisioned (its provider is configured and ``offer_allowed`` says yes: a
        network exists for its zone)?"""
        return list(self._allowed)
