"""Fluent builders for planner/simulator test objects (Kueue ``wrappers.go`` style).

Every number here is chosen by hand so tests can assert exact values:

* :data:`T0` = 2023-09-04T00:00:00Z (a Monday, inside the bundled 2023 data; a
  multiple of 60 s and of 3600 s, so simulator ticks and signal hours align).
* :func:`gpu_table` — V100 throughput 1.0 / busy 0.3 kW / idle 0.05 kW,
  A100 throughput 2.0 / busy 0.4 kW / idle 0.06 kW.
* :class:`FakeSignals` — an in-memory ``carbon(zone)`` / ``price(zone)``
  provider of :class:`pricing.series.HourlySeries` built from literal lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from broker.model import CloudOffer, Market, Pool, PoolNode, PriorityClass
from broker.planner.core import GpuTable, PendingJob, PlannerConfig, PlannerContext, RunningJob, Snapshot
from broker.sim.traces import Trace, TraceJob
from pricing.series import HourlySeries

T0 = datetime(2023, 9, 4, tzinfo=timezone.utc).timestamp()  # 1693785600.0
H = 3600.0


def gpu_table() -> GpuTable:
    """Hand-made GPU table (numbers are ours, not pricing.power's)."""
    return GpuTable(throughput={"V100": 1.0, "A100": 2.0},
                    busy_kw={"V100": 0.3, "A100": 0.4},
                    idle_kw={"V100": 0.05, "A100": 0.06})


def hourly(zone: str, values, unit: str = "USD/MWh", start_s: float = T0) -> HourlySeries:
    return HourlySeries(zone=zone, unit=unit, start_s=start_s, values=np.asarray(values, dtype=float))


def pad(head: list[float], fill: float, n: int = 72) -> list[float]:
    """``head`` followed by ``fill`` up to ``n`` hourly values."""
    return list(head) + [fill] * (n - len(head))


@dataclass
class FakeSignals:
    """Tiny in-memory grid signals: zone -> list of hourly values from :data:`T0`."""

    carbon_values: dict[str, list[float]] = field(default_factory=dict)
    price_values: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        self._c = {z: hourly(z, v, "gCO2e/kWh") for z, v in self.carbon_values.items()}
        self._p = {z: hourly(z, v, "USD/MWh") for z, v in self.price_values.items()}

    def carbon(self, zone: str):
        return self._c.get(zone)

    def price(self, zone: str):
        return self._p.get(zone)


# --------------------------------------------------------------------------- jobs
class JobBuilder:
    def __init__(self, job_id: str):
        self._kw = dict(job_id=job_id, team="default", priority=1, submit_s=T0, deadline_s=T0 + 100 * H,
                        earliest_s=T0, work_s=H, gpus_per_node=1, nodes=1)

    def gpus(self, n: int) -> "JobBuilder":
        """GPUs per node."""
        self._kw["gpus_per_node"] = n
        return self

    def nodes(self, n: int) -> "JobBuilder":
        self._kw["nodes"] = n
        return self

    def team(self, t: str) -> "JobBuilder":
        self._kw["team"] = t
        return self

    def project(self, p: str | None) -> "JobBuilder":
        self._kw["project"] = p
        return self

    def priority(self, p: int) -> "JobBuilder":
        self._kw["priority"] = p
        return self

    def submit(self, t: float) -> "JobBuilder":
        self._kw["submit_s"] = t
        self._kw["earliest_s"] = min(self._kw["earliest_s"], t)
        return self

    def earliest(self, t: float) -> "JobBuilder":
        self._kw["earliest_s"] = t
        return self

    def deadline(self, t: float) -> "JobBuilder":
        self._kw["deadline_s"] = t
        return self

    def work(self, s: float) -> "JobBuilder":
        """Remaining work on a V100, seconds."""
        self._kw["work_s"] = s
        return self

    def types(self, *t: str) -> "JobBuilder":
        self._kw["gpu_types"] = frozenset(t)
        return self

    def mem(self, gb: float) -> "JobBuilder":
        self._kw["min_mem_gb"] = gb
        return self

    def no_spot(self) -> "JobBuilder":
        self._kw["spot_ok"] = False
        return self

    def preemptible(self, v: bool = True) -> "JobBuilder":
        self._kw["preemptible"] = v
        return self

    def checkpoint(self, interval_s: float | None) -> "JobBuilder":
        """Checkpoint interval; ``None`` = not checkpointable."""
        if interval_s is None:
            self._kw["checkpointable"] = False
        else:
            self._kw["checkpointable"] = True
            self._kw["checkpoint_interval_s"] = interval_s
        return self

    def not_deferrable(self) -> "JobBuilder":
        self._kw["deferrable"] = False
        return self

    def build(self) -> PendingJob:
        return PendingJob(**self._kw)


def make_job(job_id: str) -> JobBuilder:
    return JobBuilder(job_id)


class RunningBuilder:
    def __init__(self, job_id: str):
        self._kw = dict(job_id=job_id, pool=0, allocation=[], expected_end_s=T0 + H, started_s=T0 - 10 * H,
                        priority=1, preemptible=False)

    def on(self, *alloc: tuple[int, int]) -> "RunningBuilder":
        self._kw["allocation"] = list(alloc)
        return self

    def pool(self, p: int) -> "RunningBuilder":
        self._kw["pool"] = p
        return self

    def ends(self, t: float) -> "RunningBuilder":
        self._kw["expected_end_s"] = t
        return self

    def started(self, t: float) -> "RunningBuilder":
        self._kw["started_s"] = t
        return self

    def priority(self, p: int) -> "RunningBuilder":
        self._kw["priority"] = p
        return self

    def preemptible(self, v: bool = True) -> "RunningBuilder":
        self._kw["preemptible"] = v
        return self

    def checkpoint(self, interval_s: float | None) -> "RunningBuilder":
        if interval_s is None:
            self._kw["checkpointable"] = False
        else:
            self._kw["checkpoint_interval_s"] = interval_s
        return self

    def build(self) -> RunningJob:
        return RunningJob(**self._kw)


def make_running(job_id: str) -> RunningBuilder:
    return RunningBuilder(job_id)


# --------------------------------------------------------------------------- pools / offers
class PoolBuilder:
    def __init__(self, name: str):
        self._name = name
        self._nodes: list[PoolNode] = []
        self._kw = dict(carbon_zone="PZ", price_zone="PZ", pue=1.2, amortised_usd_per_gpu_hour=0.5)

    def node(self, gpu_type: str = "V100", gpus: int = 4, mem: float = 16.0) -> "PoolBuilder":
        self._nodes.append(PoolNode(name=f"{self._name}-{len(self._nodes)}", gpu_type=gpu_type, gpu_count=gpus,
                                    gpu_memory_gb=mem))
        return self

    def nodes(self, k: int, gpu_type: str = "V100", gpus: int = 4, mem: float = 16.0) -> "PoolBuilder":
        for _ in range(k):
            self.node(gpu_type, gpus, mem)
        return self

    def zone(self, carbon: str, price: str | None = None) -> "PoolBuilder":
        self._kw["carbon_zone"] = carbon
        self._kw["price_zone"] = price or carbon
        return self

    def pue(self, v: float) -> "PoolBuilder":
        self._kw["pue"] = v
        return self

    def amortised(self, usd_per_gpu_hour: float) -> "PoolBuilder":
        self._kw["amortised_usd_per_gpu_hour"] = usd_per_gpu_hour
        return self

    def build(self) -> Pool:
        return Pool(name=self._name, nodes=tuple(self._nodes), **self._kw)


def make_pool(name: str = "lab") -> PoolBuilder:
    return PoolBuilder(name)


class OfferBuilder:
    def __init__(self, instance_type: str):
        self._kw = dict(provider="aws", region="r1", zone="r1a", instance_type=instance_type, gpu_type="V100",
                        gpu_count=1, gpu_memory_gb=16.0, market=Market.on_demand, usd_per_hour=1.0,
                        carbon_zone="CZ", provisioning_delay_s=300.0, pue=1.1, interruption_rate_per_hour=0.0,
                        min_billed_s=60.0)

    def gpu(self, gpu_type: str, count: int = 1, mem: float = 16.0) -> "OfferBuilder":
        self._kw.update(gpu_type=gpu_type, gpu_count=count, gpu_memory_gb=mem)
        return self

    def spot(self, rate_per_hour: float) -> "OfferBuilder":
        self._kw.update(market=Market.spot, interruption_rate_per_hour=rate_per_hour)
        return self

    def price(self, usd_per_hour: float) -> "OfferBuilder":
        self._kw["usd_per_hour"] = usd_per_hour
        return self

    def delay(self, s: float) -> "OfferBuilder":
        self._kw["provisioning_delay_s"] = s
        return self

    def pue(self, v: float) -> "OfferBuilder":
        self._kw["pue"] = v
        return self

    def min_billed(self, s: float) -> "OfferBuilder":
        self._kw["min_billed_s"] = s
        return self

    def carbon_zone(self, z: str) -> "OfferBuilder":
        self._kw["carbon_zone"] = z
        return self

    def region(self, r: str) -> "OfferBuilder":
        self._kw.update(region=r, zone=r + "a")
        return self

    def build(self) -> CloudOffer:
        return CloudOffer(**self._kw)


def make_offer(instance_type: str = "i1") -> OfferBuilder:
    return OfferBuilder(instance_type)


# --------------------------------------------------------------------------- context / snapshot
def make_ctx(pools, offers=(), signals=None, **config) -> PlannerContext:
    signals = signals or FakeSignals(carbon_values={"PZ": pad([], 100.0), "CZ": pad([], 100.0)},
                                     price_values={"PZ": pad([], 50.0)})
    return PlannerContext(PlannerConfig(**config), list(pools), list(offers), signals, gpu_table())


def make_snapshot(now: float, pending, free, running=(), offer_available=None, team_usage=None) -> Snapshot:
    return Snapshot(now_s=now, pending=list(pending), free=[np.asarray(f, dtype=np.int64) for f in free],
                    running=list(running),
                    offer_available=None if offer_available is None else np.asarray(offer_available, dtype=bool),
                    team_usage=team_usage or {})


# --------------------------------------------------------------------------- traces
class TraceJobBuilder:
    def __init__(self, job_id: str):
        self._kw = dict(job_id=job_id, submit_s=T0, duration_s=H, num_gpus=1, gpus_per_node=1, nodes=1,
                        gpu_type=None, team="default", priority=PriorityClass.normal, deadline_s=T0 + 100 * H,
                        preemptible=False)

    def at(self, t: float) -> "TraceJobBuilder":
        self._kw["submit_s"] = t
        return self

    def duration(self, s: float) -> "TraceJobBuilder":
        self._kw["duration_s"] = s
        return self

    def gpus(self, per_node: int, nodes: int = 1) -> "TraceJobBuilder":
        self._kw.update(gpus_per_node=per_node, nodes=nodes, num_gpus=per_node * nodes)
        return self

    def gpu_type(self, t: str | None) -> "TraceJobBuilder":
        self._kw["gpu_type"] = t
        return self

    def deadline(self, t: float) -> "TraceJobBuilder":
        self._kw["deadline_s"] = t
        return self

    def team(self, t: str) -> "TraceJobBuilder":
        self._kw["team"] = t
        return self

    def build(self) -> TraceJob:
        return TraceJob(**self._kw)


def make_trace_job(job_id: str) -> TraceJobBuilder:
    return TraceJobBuilder(job_id)


def make_trace(*jobs: TraceJob) -> Trace:
    return Trace(jobs=sorted(jobs, key=lambda j: j.submit_s), source="test")
