"""The planner: a pure function ``plan(snapshot) -> decisions`` (DESIGN.md §3-§4).

The planner does no I/O. The live broker and the simulator both build a
:class:`Snapshot` (pending jobs, free on-prem capacity, running jobs, cloud
offers, grid signals, team usage) and apply the returned decisions.

Static inputs that do not change between cycles (pools, offers, GPU tables,
grid signals) live in a :class:`PlannerContext`, which also caches values
derived from them (offer arrays, per-pool effective energy price series, the
offers and pools compatible with each job shape). Per-cycle caches (per-shape
offer rankings and start-slot tables) live in the cycle (:class:`broker.planner.policies.Cycle`).
No cache changes a result: a cycle's decisions depend only on the snapshot and
the context's inputs.

Policies (selected by ``PlannerConfig.policy``), see :mod:`broker.planner.policies`:

* ``fifo``      on-prem only, first come first served, no backfill;
* ``backfill``  on-prem only, priority -> fair share -> age, EASY backfill;
* ``cheapest``  on-prem if it fits now, else the cheapest cloud offer now;
* ``federated`` the unified objective over on-prem + cloud, now or later.

Objective for job j, option o, start t (USD-equivalent, lower is better)::

    score = dollars(j,o,t) + carbon_price x kgCO2e(j,o,t)
          + value_of_time(j) x (t - now + provisioning delay)

Errors: :class:`PlannerError` for an inconsistent snapshot (names the field).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from broker.model import DEFAULT_CHECKPOINT_INTERVAL_S, CloudOffer, Market, Pool
from pricing.series import SeriesError, SeriesStack, window_integral

__all__ = [
    "PlannerConfig",
    "PlannerContext",
    "GpuTable",
    "PendingJob",
    "RunningJob",
    "Snapshot",
    "PlannerError",
    "plan",
]

PolicyName = Literal["fifo", "backfill", "cheapest", "federated"]
POLICIES: tuple[str, ...] = ("fifo", "backfill", "cheapest", "federated")


class PlannerError(ValueError):
    """The snapshot or context is inconsistent; the message names the field and value."""


class PlannerConfig(BaseModel):
    """Typed planner settings.

    Fields (units):
        policy: one of ``fifo``, ``backfill``, ``cheapest``, ``federated``.
        carbon_price_usd_per_tonne: USD per tCO2e in the objective. Default 190:
            the US EPA's 2023 social cost of carbon (2.0 % discount rate, 2020 emissions).
        value_of_time_usd_per_gpu_hour: USD per GPU per hour of waiting, normal priority.
            Default 0.002: batch training before its deadline is patient; the
            deadline is the hard limit.
        priority_time_multiplier: multiplier of the value of time per priority rank
            (low, normal, high, critical).
        horizon_s: how far ahead a start may be deferred, seconds (48 h).
        slot_s: spacing of candidate start slots, seconds (1 h, the signal interval).
        min_defer_saving_usd: a deferral must save at least this much, USD (hysteresis).
        min_defer_saving_fraction: ... and at least this fraction of the start-now score.
            A job is deferred at most once.
        defer_min_free_fraction: a job that fits now is deferred only if nobody waits for
            its pool and at least this fraction of the pool stays free after it.
        backfill_depth: how many queued jobs a backfill pass examines (Slurm's bf_max_job_test idea).
        preemption: allow ``federated`` to preempt lower-priority preemptible jobs.
        min_run_before_preempt_s: a job that (re)started less than this ago is not preempted (hysteresis).
        restart_overhead_s: seconds a preempted or interrupted job needs to restart.
        deadline_margin_s: safety margin before a deadline, seconds.
        review_margin_s: a job waiting for on-prem is reviewed this long (plus 20 % of
            the cloud runtime) before the last instant the cloud could still meet its deadline.
        min_review_s: the earliest a waiting job is reviewed again, seconds.
        team_weight: team -> fair-share weight (default 1).
        team_budget_usd: team -> remaining budget, USD; absent = unlimited.
        cloud_enabled: the federated/cheapest policies may use cloud offers.
        onprem_cost_basis: what an on-prem GPU-hour costs in the *score*.
            ``marginal`` (default): electricity only — the capital is spent whether
            the GPU is busy or idle, so leaving it idle to rent a cloud GPU never
            saves money. ``amortised``: electricity + the pool's amortised $/GPU-h
            (DESIGN.md §4's literal formula). Reported costs always include the
            amortised part.
    """

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "federated"
    carbon_price_usd_per_tonne: float = Field(190.0, ge=0)
    value_of_time_usd_per_gpu_hour: float = Field(0.002, ge=0)
    priority_time_multiplier: tuple[float, float, float, float] = (0.5, 1.0, 10.0, 50.0)
    horizon_s: float = Field(48 * 3600.0, ge=0)
    slot_s: float = Field(3600.0, gt=0)
    min_defer_saving_usd: float = Field(0.01, ge=0)
    min_defer_saving_fraction: float = Field(0.02, ge=0)
    defer_min_free_fraction: float = Field(0.1, ge=0, le=1)
    backfill_depth: int = Field(200, ge=1)
    preemption: bool = True
    min_run_before_preempt_s: float = Field(1800.0, ge=0)
    restart_overhead_s: float = Field(300.0, ge=0)
    deadline_margin_s: float = Field(300.0, ge=0)
    review_margin_s: float = Field(3600.0, ge=0)
    min_review_s: float = Field(900.0, gt=0)
    team_weight: dict[str, float] = Field(default_factory=dict)
    team_budget_usd: dict[str, float] = Field(default_factory=dict)
    cloud_enabled: bool = True
    onprem_cost_basis: Literal["marginal", "amortised"] = "marginal"


@dataclass(frozen=True)
class GpuTable:
    """Per-GPU-type constants the planner needs.

    Attributes:
        throughput: relative training throughput vs the reference GPU (V100 = 1.0).
        busy_kw: board power while training, kW per GPU.
        idle_kw: board power while idle, kW per GPU.
    Built from :mod:`pricing.power` by :func:`GpuTable.from_pricing`.
    """

    throughput: Mapping[str, float]
    busy_kw: Mapping[str, float]
    idle_kw: Mapping[str, float]

    @classmethod
    def from_pricing(cls, utilisation: float | None = None) -> "GpuTable":
        """Table for every GPU type in ``pricing.power.GPU_SPECS`` at ``utilisation`` (default: the module's)."""
        from pricing import power

        u = power.DEFAULT_UTILISATION if utilisation is None else utilisation
        thr, busy, idle = {}, {}, {}
        for name in power.GPU_SPECS:
            thr[name] = power.GPU_SPECS[name].rel_throughput
            busy[name] = power.gpu_power_w(name, u) / 1000.0
            idle[name] = power.gpu_power_w(name, 0.0) / 1000.0
        return cls(thr, busy, idle)


@dataclass(slots=True)
class PendingJob:
    """A job waiting for a decision or for capacity (planner's view).

    Times are POSIX seconds (UTC). ``work_s`` is the remaining runtime on the
    reference GPU (V100), seconds. ``gpu_types`` None means any type.
    ``committed_pool`` is set once the planner chose to wait for that on-prem
    pool; ``review_s`` is when its options are looked at again.
    """

    job_id: str
    team: str
    priority: int
    submit_s: float
    deadline_s: float
    earliest_s: float
    work_s: float
    gpus_per_node: int
    nodes: int
    gpu_types: frozenset[str] | None = None
    min_mem_gb: float = 0.0
    spot_ok: bool = True
    preemptible: bool = False
    checkpointable: bool = True
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S
    regions: frozenset[str] | None = None
    max_usd_per_hour: float | None = None
    deferrable: bool = True
    committed_pool: int | None = None
    review_s: float = 0.0
    deferred_once: bool = False

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(slots=True)
class RunningJob:
    """A job holding on-prem GPUs now.

    ``allocation`` is ``[(node_index, gpus), ...]`` in pool ``pool``;
    ``expected_end_s`` and ``started_s`` are POSIX seconds.
    """

    job_id: str
    pool: int
    allocation: list[tuple[int, int]]
    expected_end_s: float
    started_s: float
    priority: int
    preemptible: bool
    team: str = "default"
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S
    checkpointable: bool = True


@dataclass
class Snapshot:
    """Everything one planning cycle looks at.

    Attributes:
        now_s: the cycle instant, POSIX seconds (UTC).
        pending: jobs to look at now: new, woken from a deferral, requeued, due for
            review — or, for a stateless caller, every job not running. Jobs whose
            ``earliest_s`` is in the future are ignored.
        queued: jobs already waiting in the on-prem queue, grouped by
            ``(priority, team)``, each group in submission order (what a store
            index returns). Lets a cycle touch only the head of a long queue.
        queued_demand: optional pool -> ``(GPUs, GPU-seconds)`` of the committed jobs in
            ``queued`` (kept incrementally by the caller); computed from ``queued`` if None.
        free: per pool, free GPUs per node (int arrays ``(n_nodes,)``).
        running: on-prem running jobs (for reservations and preemption).
        offer_available: bool array ``(n_offers,)``: offer can be provisioned now.
        team_usage: team -> decayed GPU-hours (GPU-type-weighted).
        healthy: per pool optional bool array of healthy nodes.
    """

    now_s: float
    pending: Sequence[PendingJob]
    free: Sequence[np.ndarray]
    running: Sequence[RunningJob] = ()
    queued: Mapping[tuple[int, str], Sequence[PendingJob]] | None = None
    queued_demand: Mapping[int, tuple[float, float]] | None = None
    offer_available: np.ndarray | None = None
    team_usage: Mapping[str, float] = field(default_factory=dict)
    healthy: Sequence[np.ndarray | None] | None = None


class PlannerContext:
    """Static planning inputs and caches derived from them.

    Args:
        config: planner settings.
        pools: on-prem pools (node order defines node indexes).
        offers: cloud offers (list order defines offer indexes).
        signals: object with ``carbon(zone) -> HourlySeries`` (gCO2e/kWh) and
            ``price(zone) -> HourlySeries | None`` (USD/MWh), e.g. ``pricing.signals.GridSignals``.
        gpus: per-GPU-type throughput and power.

    Raises :class:`PlannerError` if a pool's GPU type is not in ``gpus``, or
    a pool's carbon or price zone has no series.
    """

    def __init__(self, config: PlannerConfig, pools: Sequence[Pool], offers: Sequence[CloudOffer],
                 signals, gpus: GpuTable):
        self.config = config
        self.pools = list(pools)
        self.offers = list(offers)
        self.signals = signals
        self.gpus = gpus
        self._pool_node_types = [[n.gpu_type for n in p.nodes] for p in self.pools]
        self._pool_node_mem = [np.array([n.gpu_memory_gb for n in p.nodes]) for p in self.pools]
        self._pool_types = [sorted(set(t)) for t in self._pool_node_types]
        self.pool_capacity = [p.total_gpus for p in self.pools]
        # effective energy price per pool: USD per kWh of facility energy incl. carbon price
        cp = config.carbon_price_usd_per_tonne
        self._pool_price = []
        self._pool_carbon = []
        self._pool_effective = []
        for p in self.pools:
            for t in set(n.gpu_type for n in p.nodes):
                if t not in gpus.throughput:
                    raise PlannerError(f"pool {p.name!r}: gpu_type={t!r} has no throughput/power entry")
            ci = signals.carbon(p.carbon_zone)
            pr = signals.price(p.price_zone)
            if ci is None:
                raise PlannerError(f"pool {p.name!r}: carbon_zone={p.carbon_zone!r} has no series")
            if pr is None:
                raise PlannerError(f"pool {p.name!r}: price_zone={p.price_zone!r} has no series")
            self._pool_price.append(pr)
            self._pool_carbon.append(ci)
            self._pool_effective.append(_combine_effective(pr, ci, cp))
        # offer arrays for vectorised scoring
        n = len(self.offers)
        self.offer_gpu_type = [o.gpu_type for o in self.offers]
        self.offer_gpu_count = np.array([o.gpu_count for o in self.offers], dtype=np.int64)
        self.offer_mem = np.array([o.gpu_memory_gb for o in self.offers])
        self.offer_price = np.array([o.usd_per_hour for o in self.offers])
        self.offer_spot = np.array([o.market == Market.spot for o in self.offers], dtype=bool)
        self.offer_delay = np.array([o.provisioning_delay_s for o in self.offers])
        self.offer_pue = np.array([o.pue for o in self.offers])
        self.offer_rate = np.array([o.interruption_rate_per_hour for o in self.offers])
        self.offer_min_billed = np.array([o.min_billed_s for o in self.offers])
        self.offer_region = [o.region for o in self.offers]
        self.offer_thr = np.array([gpus.throughput.get(o.gpu_type, np.nan) for o in self.offers])
        self.offer_busy_kw = np.array([gpus.busy_kw.get(o.gpu_type, np.nan) for o in self.offers])
        self.offer_idle_kw = np.array([gpus.idle_kw.get(o.gpu_type, np.nan) for o in self.offers])
        zones = sorted(set(o.carbon_zone for o in self.offers))
        zone_series = {z: signals.carbon(z) for z in zones}
        self.offer_ids = [o.offer_id for o in self.offers]
        #: per offer, plain floats for the scalar (one job, one offer) cost path
        self.offer_rows = [
            (float(self.offer_thr[i]), bool(self.offer_spot[i]), o.interruption_rate_per_hour, o.provisioning_delay_s,
             o.min_billed_s, o.usd_per_hour, o.gpu_count, float(self.offer_busy_kw[i]), float(self.offer_idle_kw[i]),
             o.pue, zone_series[o.carbon_zone])
            for i, o in enumerate(self.offers)]
        self.zones = zones
        zi = {z: i for i, z in enumerate(zones)}
        self.offer_zone = np.array([zi[o.carbon_zone] for o in self.offers], dtype=np.int64) if n else np.zeros(0, np.int64)
        self.zone_carbon = [signals.carbon(z) for z in zones]
        try:
            self._zone_stack = SeriesStack(self.zone_carbon) if zones else None
        except SeriesError:
            self._zone_stack = None
        #: caches that depend only on the static inputs (per job shape: compatible offers, targets)
        self._shape_cache_static: dict = {}

    # ----------------------------------------------------------------- helpers
    def pool_types(self, pool: int) -> list[str]:
        return self._pool_types[pool]

    def pool_node_types(self, pool: int) -> list[str]:
        return self._pool_node_types[pool]

    def pool_node_mem(self, pool: int) -> np.ndarray:
        return self._pool_node_mem[pool]

    def value_of_time(self, job: PendingJob) -> float:
        """USD per hour of waiting for ``job`` (all its GPUs)."""
        m = self.config.priority_time_multiplier[min(max(job.priority, 0), 3)]
        return self.config.value_of_time_usd_per_gpu_hour * job.gpus * m

    def onprem_estimate(self, pool: int, gpu_type: str, job: PendingJob, start_s: float):
        """Exact cost of ``job`` on ``pool``'s ``gpu_type`` GPUs starting at ``start_s``.

        Returns ``(runtime_s, energy_cost_usd, amortised_usd, energy_kwh, carbon_kg)``:
        energy = GPUs x busy power (kW) x runtime (h) x PUE; energy cost and carbon
        integrate the hourly price (USD/MWh) and intensity (gCO2e/kWh) over
        ``[start_s, start_s + runtime]``; NaN when the window leaves the signal coverage.
        """
        p = self.pools[pool]
        runtime = job.work_s / self.gpus.throughput[gpu_type]
        kw = job.gpus * self.gpus.busy_kw[gpu_type] * p.pue
        hours = runtime / 3600.0
        price_int = window_integral(self._pool_price[pool], start_s, runtime)  # USD/MWh x h
        ci_int = window_integral(self._pool_carbon[pool], start_s, runtime)  # g/kWh x h
        return (runtime, kw * price_int / 1000.0, job.gpus * hours * p.amortised_usd_per_gpu_hour,
                kw * hours, kw * ci_int / 1000.0)

    def pool_price_now(self, pool: int, now_s: float) -> float:
        """Electricity price of ``pool`` at ``now_s``, USD/MWh (0 if missing: only used to cost lost work)."""
        v = self._pool_price[pool].value_at(now_s)
        return 0.0 if math.isnan(v) else v

    def onprem_costs(self, pool: int, gpu_type: str, gpus: int, runtime_s: np.ndarray, starts_s: np.ndarray):
        """Vectorised :meth:`onprem_estimate`: arrays ``(energy_cost_usd, amortised_usd, energy_kwh, carbon_kg)``
        for ``gpus`` GPUs of ``gpu_type`` running ``runtime_s`` from ``starts_s`` (same shapes)."""
        p = self.pools[pool]
        kw = gpus * self.gpus.busy_kw[gpu_type] * p.pue
        hours = runtime_s / 3600.0
        ps, cs = self._pool_price[pool], self._pool_carbon[pool]
        if starts_s.size <= 8:  # NumPy's per-call overhead dominates tiny batches (one job per cycle)
            price = np.array([window_integral(ps, s, d) for s, d in zip(starts_s.tolist(), runtime_s.tolist())])
            ci = np.array([window_integral(cs, s, d) for s, d in zip(starts_s.tolist(), runtime_s.tolist())])
        else:
            price = ps.integrals(starts_s, runtime_s)
            ci = cs.integrals(starts_s, runtime_s)
        return kw * price / 1000.0, gpus * hours * p.amortised_usd_per_gpu_hour, kw * hours, kw * ci / 1000.0

    def zone_integrals(self, zone_index: np.ndarray, starts_s: np.ndarray, durations_s: np.ndarray) -> np.ndarray:
        """Carbon-intensity window integrals (gCO2e/kWh x h) for offer zones ``zone_index`` (flat arrays)."""
        if self._zone_stack is not None:
            return self._zone_stack.integrals(zone_index, starts_s, durations_s)
        out = np.empty(zone_index.size)
        for z in np.unique(zone_index):
            m = zone_index == z
            out[m] = self.zone_carbon[z].integrals(starts_s[m], durations_s[m])
        return out

    def amortised_in_score(self) -> bool:
        """True if the on-prem amortised cost counts in the score (``onprem_cost_basis``)."""
        return self.config.onprem_cost_basis == "amortised"

    def pool_effective_integrals(self, pool: int, starts: np.ndarray, duration_s: float) -> np.ndarray:
        """∫ (price/1000 + carbon_price x CI/1e6) dt over each window: USD per kW, shape like ``starts``."""
        return self._pool_effective[pool].integrals(starts, duration_s)

    def cloud_estimates(self, job: PendingJob, idx: np.ndarray, start_s: float):
        """Vectorised cost of ``job`` on offers ``idx`` starting provisioning at ``start_s``.

        Returns arrays over ``idx``: ``(runtime_s, finish_offset_s, dollars_usd,
        energy_kwh, carbon_kg, usd_per_hour)``. Spot offers add the expected
        rework of interruptions: ``rate x runtime_h`` interruptions, each losing
        half a checkpoint interval (half the run if not checkpointable) plus the
        restart overhead.
        """
        thr = self.offer_thr[idx]
        runtime = job.work_s / thr
        spot = self.offer_spot[idx]
        rate = self.offer_rate[idx]
        lost_each = (job.checkpoint_interval_s / 2.0 if job.checkpointable else runtime / 2.0) + self.config.restart_overhead_s
        rework = np.where(spot, rate * runtime / 3600.0 * lost_each, 0.0)
        eff_runtime = runtime + rework
        delay = self.offer_delay[idx]
        instances = job.nodes
        # billing starts at the create call: boot and image pull are billed too
        billed = np.maximum(eff_runtime + delay, self.offer_min_billed[idx])
        usd_h = instances * self.offer_price[idx]
        dollars = usd_h * billed / 3600.0
        gcount = self.offer_gpu_count[idx]
        kw = instances * (job.gpus_per_node * self.offer_busy_kw[idx]
                          + (gcount - job.gpus_per_node) * self.offer_idle_kw[idx]) * self.offer_pue[idx]
        energy = kw * eff_runtime / 3600.0
        zones = self.offer_zone[idx]
        t0 = start_s + delay
        if self._zone_stack is not None:
            carbon = kw * self._zone_stack.integrals(zones, t0, eff_runtime) / 1000.0
        else:
            carbon = np.empty(idx.size)
            for z in np.unique(zones):
                m = zones == z
                carbon[m] = kw[m] * self.zone_carbon[z].integrals(t0[m], eff_runtime[m]) / 1000.0
        return eff_runtime, delay + eff_runtime, dollars, energy, carbon, usd_h

    def cloud_dollars(self, job: PendingJob, offer: int) -> float:
        """Expected USD of ``job`` on ``offer`` (as :meth:`cloud_scalar`, without the carbon window)."""
        thr, spot, rate, delay, min_billed, price, *_ = self.offer_rows[offer]
        runtime = job.work_s / thr
        if spot:
            lost = (job.checkpoint_interval_s / 2.0 if job.checkpointable else runtime / 2.0) + self.config.restart_overhead_s
            runtime += rate * runtime / 3600.0 * lost
        return job.nodes * price * max(runtime + delay, min_billed) / 3600.0

    def cloud_scalar(self, job: PendingJob, offer: int, start_s: float):
        """One job on one offer, same model as :meth:`cloud_estimates` + :meth:`cloud_finish_bound`.

        Returns ``(runtime_s incl. expected rework, pessimistic finish offset s, dollars_usd,
        energy_kwh, carbon_kg, usd_per_hour)``. Plain-float arithmetic: for per-job exact costs.
        """
        thr, spot, rate, delay, min_billed, price, count, busy, idle, pue, zone = self.offer_rows[offer]
        runtime = job.work_s / thr
        restart = self.config.restart_overhead_s
        if spot:
            lost = (job.checkpoint_interval_s / 2.0 if job.checkpointable else runtime / 2.0) + restart
            mean = rate * runtime / 3600.0
            eff = runtime + mean * lost
            lost_hi = (job.checkpoint_interval_s if job.checkpointable else runtime) + restart + delay
            finish = delay + runtime + (mean + 2.0 * math.sqrt(mean)) * lost_hi
        else:
            eff = runtime
            finish = delay + runtime
        usd_h = job.nodes * price
        dollars = usd_h * max(eff + delay, min_billed) / 3600.0
        kw = job.nodes * (job.gpus_per_node * busy + (count - job.gpus_per_node) * idle) * pue
        carbon = kw * window_integral(zone, start_s + delay, eff) / 1000.0
        return eff, finish, dollars, kw * eff / 3600.0, carbon, usd_h

    def cloud_finish_bound(self, job: PendingJob, idx: np.ndarray) -> np.ndarray:
        """Pessimistic seconds from now to completion on offers ``idx``, for deadline checks.

        On-demand: provisioning delay + runtime. Spot: interruptions are Poisson with
        mean ``m = rate x runtime_h``; the bound takes ``m + 2 sqrt(m)`` of them (about
        the 97.5th percentile), each costing the lost work plus a new provisioning delay.
        """
        runtime = job.work_s / self.offer_thr[idx]
        delay = self.offer_delay[idx]
        mean = np.where(self.offer_spot[idx], self.offer_rate[idx] * runtime / 3600.0, 0.0)
        k = mean + 2.0 * np.sqrt(mean)
        lost_each = (job.checkpoint_interval_s if job.checkpointable else runtime) + self.config.restart_overhead_s + delay
        return delay + runtime + k * lost_each

    def compatible_offers(self, job: PendingJob) -> np.ndarray:
        """Indexes of offers that can hold ``job`` (GPU type, count, memory, market, region); cached per shape."""
        key = ("offers", job.gpu_types, job.gpus_per_node, job.nodes > 1, job.min_mem_gb, job.spot_ok, job.regions)
        cache = self._shape_cache_static
        hit = cache.get(key)
        if hit is not None:
            return hit
        n = len(self.offers)
        ok = np.ones(n, dtype=bool)
        if job.gpu_types is not None:
            ok &= np.array([t in job.gpu_types for t in self.offer_gpu_type], dtype=bool)
        ok &= ~np.isnan(self.offer_thr)
        if job.nodes > 1:
            ok &= self.offer_gpu_count == job.gpus_per_node  # homogeneous gang of whole instances
        else:
            ok &= self.offer_gpu_count >= job.gpus_per_node
            # smallest instance shape that holds the job, per (type, zone, market): no paying for idle GPUs
            ok &= self.offer_gpu_count <= smallest_fit(job.gpus_per_node)
        ok &= self.offer_mem >= job.min_mem_gb
        if not job.spot_ok:
            ok &= ~self.offer_spot
        if job.regions is not None:
            ok &= np.array([r in job.regions for r in self.offer_region], dtype=bool)
        res = np.flatnonzero(ok)
        cache[key] = res
        return res


def smallest_fit(n: int) -> int:
    """The largest instance GPU count a single-node job of ``n`` GPUs may take: the next power of two
    (instance shapes are 1, 2, 4, 8, 16 GPUs; no paying for idle GPUs beyond the smallest shape that holds it)."""
    p = 1
    while p < n:
        p *= 2
    return p


def _combine_effective(price, carbon, carbon_price_usd_per_tonne: float):
    """Series of USD per kWh: price (USD/MWh)/1000 + CI (g/kWh) x carbon price (USD/t)/1e6, on the carbon grid."""
    from pricing.series import HourlySeries

    t = carbon.times_s()
    # align price onto the carbon series grid by index arithmetic (both hourly, UTC)
    off = (t - price.start_s) / price.interval_s
    idx = np.floor(off).astype(np.int64)
    inside = (idx >= 0) & (idx < price.values.size)
    pv = np.full(t.size, np.nan)
    pv[inside] = price.values[idx[inside]]
    vals = pv / 1000.0 + carbon.values * carbon_price_usd_per_tonne / 1e6
    return HourlySeries(zone=carbon.zone, unit="USD/kWh", start_s=carbon.start_s, values=vals,
                        interval_s=carbon.interval_s)


def plan(snapshot: Snapshot, ctx: PlannerContext):
    """Decide for the jobs in ``snapshot`` under ``ctx.config.policy``.

    Returns a list of :class:`broker.model.Decision`. Pure: reads the snapshot
    and the context, writes neither (the context's caches aside).
    Raises :class:`PlannerError` for an inconsistent snapshot.
    """
    from broker.planner import policies

    if len(snapshot.free) != len(ctx.pools):
        raise PlannerError(f"free: {len(snapshot.free)} arrays for {len(ctx.pools)} pools")
    # A big cycle allocates ~5 small objects per job and no reference cycles; pausing the
    # cyclic garbage collector meanwhile saves ~40 % of a 100k-job cycle.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return policies.POLICY_FUNCS[ctx.config.policy](snapshot, ctx)
    finally:
        if gc_was_enabled:
            gc.enable()
