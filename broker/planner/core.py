"""The planner's inputs: a snapshot of one cycle, the settings, and the static context with its caches.

The planner does no I/O. The live broker and the simulator both build a
:class:`Snapshot` (pending jobs, free on-prem capacity, running jobs, cloud
offers, grid signals, team usage) and apply the decisions that
:func:`broker.planner.registry.plan` returns.

Static inputs that do not change between cycles (pools, offers, GPU tables,
grid signals) live in a :class:`PlannerContext`, which also caches values
derived from them (offer arrays, the offers and pools compatible with each job
shape) and costs options with the one cost model (:mod:`broker.planner.costs`).
Per-cycle caches (per-shape offer rankings and start-slot tables) live in the
cycle (:class:`broker.planner.policy_base.Cycle`). No cache changes a result: a
cycle's decisions depend only on the snapshot and the context's inputs.

The policies (:class:`PolicyName`, selected by ``PlannerConfig.policy``) are
modules of this package, bound to their names in :mod:`broker.planner.registry`.

Errors: :class:`PlannerError` for an inconsistent snapshot or context (names the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Mapping, NamedTuple, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from broker.model import DEFAULT_CHECKPOINT_INTERVAL_S, CloudOffer, Market, Pool
from broker.planner.costs import cloud_bill_usd, cloud_cost, cloud_kw, cloud_runtime, onprem_cost, onprem_kw, score
from pricing import power
from pricing.series import HourlySeries, SeriesError, SeriesStack, window_integral

__all__ = [
    "PolicyName",
    "POLICY_NAMES",
    "PlannerConfig",
    "PlannerContext",
    "CloudEstimate",
    "GpuTable",
    "PendingJob",
    "RunningJob",
    "Snapshot",
    "PlannerError",
    "smallest_fit", "smallest_shape_mask", "shape_groups",
]


class PolicyName(StrEnum):
    """The planning policies, by the name settings, the CLI and reports use (the one place they are spelled).

    * ``fifo``: on-prem only, first come first served, no backfill (:mod:`broker.planner.fifo`);
    * ``backfill``: on-prem only, priority -> fair share -> age, EASY backfill (:mod:`broker.planner.backfill`);
    * ``cheapest``: on-prem if it fits now, else the cheapest cloud offer now (:mod:`broker.planner.cheapest`);
    * ``federated``: the ARCHITECTURE §4 score over on-prem and cloud, now or later (:mod:`broker.planner.federated`).
    """

    fifo = "fifo"
    backfill = "backfill"
    cheapest = "cheapest"
    federated = "federated"


#: every policy name, in the order reports list them
POLICY_NAMES: tuple[str, ...] = tuple(p.value for p in PolicyName)


class PlannerError(ValueError):
    """The snapshot or context is inconsistent; the message names the field and value."""


class PlannerConfig(BaseModel):
    """Typed planner settings.

    Fields (units):
        policy: a :class:`PolicyName` (``fifo``, ``backfill``, ``cheapest`` or ``federated``).
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
        priority_max_age_s: seconds of waiting (since submission) after which a job's age
            factor stops growing (Slurm's ``PriorityMaxAge``). Default 3600 (1 h): with
            ``priority_weight_age`` 2, a job is passed by no job of its class submitted more than
            30 min after it (:mod:`broker.planner.fair_share`, "The bound"), so fair share
            arbitrates between jobs submitted within half an hour of each other and no team's
            stream holds another's job back longer than that plus its reservation's shadow time.
            Slurm's default of 7 days would bound nothing users notice.
        priority_weight_age: weight of the age factor (0..1) against the fair-share factor
            (0..1] in the queue priority within a class (Slurm's ``PriorityWeightAge`` over
            ``PriorityWeightFairshare``). Default 2: at or above 1 a job at the cap precedes every
            fresh job whatever the teams' usage; 2 also bounds the pass-by window to half of
            ``priority_max_age_s``. 0 = the strict order fair share, then age.
        team_budget_usd: team -> remaining *cloud* budget, USD; absent = unlimited. ``federated`` only: a
            cloud option costing more than what is left is never chosen (not even to minimise lateness) and
            each cloud decision takes its ``dollars_usd`` off before the team's next job is decided; on-prem
            options are not limited (the capacity is paid for anyway). The live broker passes each budgeted
            team's ``cap - spent - committed`` (:mod:`broker.service.budgets`).
        project_budget_usd: team -> project -> remaining *cloud* budget of that project, USD; absent =
            unlimited. Same rule as ``team_budget_usd`` for the jobs whose :attr:`PendingJob.project` it names;
            a job of a budgeted project of a budgeted team is held by whichever of the two has less left, and
            each of its cloud decisions is charged to both.
        cloud_enabled: the federated/cheapest policies may use cloud offers.
        urgency_bucket_s: ``federated`` orders its on-prem queue least-laxity first: by the
            job's latest on-prem start (deadline - remaining reference-GPU runtime) floored
            to buckets of this many seconds, then in fair-share order within a bucket
            (:func:`broker.planner.policy_base.urgency_bucket`). Default 6 h: in a congested
            pool the jobs that can still wait for a quieter hour leave the GPUs to those that
            cannot, so fewer jobs reach the point where only the cloud meets their deadline
            (BENCHMARKS.md, "Look-ahead"). 0 = fair-share order only.
        wait_ahead: which waiting jobs ``federated``'s on-prem wait estimate counts ahead of a job
            it decides. ``"urgency"`` (default; look-ahead over the queue's order): only the committed
            jobs the least-laxity queue (``urgency_bucket_s``) serves before it: a higher priority class,
            or its class with an urgency bucket at most its own. Jobs with later latest starts queue behind
            it, so a job is not sent to the cloud because of work that will wait for it. ``"queue"``: every
            job committed to the pool (the whole queue's GPUs and GPU-seconds; the behaviour before, kept
            to reproduce it). On the demo (``make demo``) "urgency" costs $77.9k against $82.1k, 0 deadline
            misses either way (BENCHMARKS.md, "Look-ahead planner"). Reviews still bound the optimism: a
            waiting job is looked at again at the last instant the cloud can meet its deadline.
        onprem_cost_basis: what an on-prem GPU-hour costs in the *score*.
            ``marginal`` (default): electricity only — the capital is spent whether
            the GPU is busy or idle, so leaving it idle to rent a cloud GPU never
            saves money. ``amortised``: electricity + the pool's amortised $/GPU-h
            (ARCHITECTURE.md §4's literal formula). Reported costs always include the
            amortised part.
    """

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = PolicyName.federated
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
    priority_max_age_s: float = Field(3600.0, gt=0, allow_inf_nan=False)
    priority_weight_age: float = Field(2.0, ge=0, allow_inf_nan=False)
    team_budget_usd: dict[str, float] = Field(default_factory=dict)
    project_budget_usd: dict[str, dict[str, float]] = Field(default_factory=dict)
    cloud_enabled: bool = True
    urgency_bucket_s: float = Field(6 * 3600.0, ge=0)
    wait_ahead: Literal["queue", "urgency"] = "urgency"
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
    pool; ``review_s`` is when its options are looked at again. ``project``: the
    team's project the job is charged to (``None``: none), for project budgets.
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
    project: str | None = None

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
            :func:`~broker.planner.policy_base.queue_group` (priority, team, urgency
            bucket), each group in submission order (what a store index returns). Lets
            a cycle touch only the head of a long queue.
        queued_demand: optional pool -> ``(GPUs, GPU-seconds)`` of the committed jobs in
            ``queued`` (kept incrementally by the caller); computed from ``queued`` if None.
        queued_demand_by_urgency: optional pool -> ``(priority, urgency bucket)`` -> ``(GPUs,
            GPU-seconds)`` of the committed jobs in ``queued`` (kept incrementally by the caller; the
            bucket as :func:`~broker.planner.policy_base.urgency_bucket`); read only with
            ``PlannerConfig.wait_ahead == "urgency"``, computed from ``queued`` if None.
        foreign_demand: optional pool -> ``(GPUs, GPU-seconds)`` waiting in the pool's own scheduler queue
            that are not the broker's (a Slurm or Kubernetes cluster's pending jobs): ahead of every broker
            job in wait estimates, whatever ``wait_ahead`` says (the broker cannot order them).
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
    queued_demand_by_urgency: Mapping[int, Mapping[tuple[int, float], tuple[float, float]]] | None = None
    foreign_demand: Mapping[int, tuple[float, float]] | None = None
    offer_available: np.ndarray | None = None
    team_usage: Mapping[str, float] = field(default_factory=dict)
    healthy: Sequence[np.ndarray | None] | None = None


class CloudEstimate(NamedTuple):
    """Costs of cloud options, from :mod:`broker.planner.costs`: arrays of one shape (offers, or jobs x offers;
    :meth:`PlannerContext.cloud_estimates`) or floats (one offer; :meth:`PlannerContext.cloud_scalar`).

    Attributes:
        runtime_s: runtime incl. the expected spot rework, seconds.
        finish_bound_s: pessimistic seconds from the create call to completion (deadline checks).
        delay_s: provisioning delay, seconds (the wait before the run starts).
        dollars_usd: the expected bill, USD.
        energy_kwh: facility energy, kWh.
        carbon_kg: emissions over the run's window, kgCO2e (NaN: no carbon data).
        usd_per_hour: price of all the job's instances, USD/h.
    """

    runtime_s: np.ndarray
    finish_bound_s: np.ndarray
    delay_s: np.ndarray
    dollars_usd: np.ndarray
    energy_kwh: np.ndarray
    carbon_kg: np.ndarray
    usd_per_hour: np.ndarray


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
        for p in self.pools:
            for t in set(n.gpu_type for n in p.nodes):
                if t not in gpus.throughput:
                    raise PlannerError(f"pool {p.name!r}: gpu_type={t!r} has no throughput/power entry")
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
        self.offer_ids = [o.offer_id for o in self.offers]
        self.offer_shape_group = shape_groups(self.offers)
        #: per offer: is its carbon figure an estimate (``CloudOffer.carbon_estimated``), for the explain records
        self.offer_carbon_estimated = [bool(getattr(o, "carbon_estimated", False)) for o in self.offers]
        #: per offer, plain floats for :meth:`cloud_scalar` (one job on one offer)
        self._offer_floats = [
            (float(self.offer_thr[i]), bool(self.offer_spot[i]), o.interruption_rate_per_hour, o.provisioning_delay_s,
             o.min_billed_s, o.usd_per_hour, o.gpu_count, float(self.offer_busy_kw[i]), float(self.offer_idle_kw[i]),
             o.pue)
            for i, o in enumerate(self.offers)]
        self.zones = zones
        zi = {z: i for i, z in enumerate(zones)}
        self.offer_zone = np.array([zi[o.carbon_zone] for o in self.offers], dtype=np.int64) if n else np.zeros(0, np.int64)
        #: caches that depend only on the static inputs (per job shape: compatible offers, targets)
        self._shape_cache_static: dict = {}
        self.set_signals(signals)

    def set_signals(self, signals) -> None:
        """Plan on ``signals`` from now on (same interface as the constructor's ``signals``).

        Rebuilds what is derived from the series (per pool: price, carbon and the score of one kWh; per offer zone:
        carbon and their stack); the static caches stay. The simulator's ``--forecast`` calls it once per issue
        hour with the forecasts issued then (``pricing.forecast.ForecastedSignals``), so the planner, which only
        reads these series, sees what a live broker would have known. Raises :class:`PlannerError` if a pool's
        carbon or price zone has no series.
        """
        self.signals = signals
        # per pool: price, carbon, and the marginal score of one kWh at each hour (USD/kWh: tariff + carbon
        # price x intensity)
        pool_price, pool_carbon, pool_score = [], [], []
        for p in self.pools:
            ci = signals.carbon(p.carbon_zone)
            pr = signals.price(p.price_zone)
            if ci is None:
                raise PlannerError(f"pool {p.name!r}: carbon_zone={p.carbon_zone!r} has no series")
            if pr is None:
                raise PlannerError(f"pool {p.name!r}: price_zone={p.price_zone!r} has no series")
            pool_price.append(pr)
            pool_carbon.append(ci)
            pool_score.append(_kwh_score_series(pr, ci, self.config.carbon_price_usd_per_tonne))
        self._pool_price, self._pool_carbon, self._pool_kwh_score = pool_price, pool_carbon, pool_score
        #: per offer, its zone's carbon-intensity series (for :meth:`cloud_scalar`)
        self._offer_carbon = [signals.carbon(o.carbon_zone) for o in self.offers]
        self.zone_carbon = [signals.carbon(z) for z in self.zones]
        try:
            self._zone_stack = SeriesStack(self.zone_carbon) if self.zones else None
        except SeriesError:
            self._zone_stack = None

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
        """Cost of ``job`` on ``pool``'s ``gpu_type`` GPUs from ``start_s`` (:func:`broker.planner.costs.onprem_cost`).

        Returns ``(runtime_s, energy_cost_usd, amortised_usd, energy_kwh, carbon_kg)`` as floats;
        the energy cost and carbon are NaN when the window leaves the signal coverage.
        """
        p = self.pools[pool]
        runtime = job.work_s / self.gpus.throughput[gpu_type]
        c = onprem_cost(runtime, gpus=job.gpus, kw=onprem_kw(job.gpus, self.gpus.busy_kw[gpu_type], p.pue),
                        usd_per_gpu_hour=p.amortised_usd_per_gpu_hour,
                        tariff_integral=window_integral(self._pool_price[pool], start_s, runtime),
                        carbon_integral=window_integral(self._pool_carbon[pool], start_s, runtime))
        return runtime, c.energy_usd, c.amortised_usd, c.energy_kwh, c.carbon_kg

    def pool_price_now(self, pool: int, now_s: float) -> float:
        """Electricity price of ``pool`` at ``now_s``, USD/MWh (0 if missing: only used to cost lost work)."""
        v = self._pool_price[pool].value_at(now_s)
        return 0.0 if math.isnan(v) else v

    def onprem_costs(self, pool: int, gpu_type: str, gpus: int, runtime_s: np.ndarray, starts_s: np.ndarray):
        """Vectorised :meth:`onprem_estimate`: an :class:`~broker.planner.costs.OnpremCost` of arrays
        ``(energy_usd, amortised_usd, energy_kwh, carbon_kg)`` for ``gpus`` GPUs of ``gpu_type`` running
        ``runtime_s`` from ``starts_s`` (same shapes)."""
        p = self.pools[pool]
        ps, cs = self._pool_price[pool], self._pool_carbon[pool]
        if starts_s.size <= 8:  # NumPy's per-call overhead dominates tiny batches (one job per cycle)
            windows = list(zip(starts_s.tolist(), runtime_s.tolist()))
            tariff = np.array([window_integral(ps, s, d) for s, d in windows])
            carbon = np.array([window_integral(cs, s, d) for s, d in windows])
        else:
            tariff, carbon = ps.integrals(starts_s, runtime_s), cs.integrals(starts_s, runtime_s)
        return onprem_cost(runtime_s, gpus=gpus, kw=onprem_kw(gpus, self.gpus.busy_kw[gpu_type], p.pue),
                           usd_per_gpu_hour=p.amortised_usd_per_gpu_hour, tariff_integral=tariff,
                           carbon_integral=carbon)

    def zone_integrals(self, zone_index: np.ndarray, starts_s: np.ndarray, durations_s: np.ndarray) -> np.ndarray:
        """Carbon-intensity window integrals (gCO2e/kWh x h) for offer zones ``zone_index`` (flat arrays)."""
        if self._zone_stack is not None:
            return self._zone_stack.integrals(zone_index, starts_s, durations_s)
        out = np.empty(zone_index.size)
        for z in np.unique(zone_index):
            m = zone_index == z
            out[m] = self.zone_carbon[z].integrals(starts_s[m], durations_s[m])
        return out

    def pool_kwh_score_integrals(self, pool: int, starts_s: np.ndarray, runtime_s: float) -> np.ndarray:
        """``pool``'s score of one kWh (USD/kWh) integrated over each window ``[starts_s, + runtime_s]``: USD per kW
        of load, carbon priced in (NaN where data is missing). One integral per window instead of two."""
        return self._pool_kwh_score[pool].integrals(starts_s, runtime_s)

    def amortised_in_score(self) -> bool:
        """True if the on-prem amortised cost counts in the score (``onprem_cost_basis``)."""
        return self.config.onprem_cost_basis == "amortised"

    def cloud_estimates(self, job: PendingJob, idx: np.ndarray, start_s: float,
                        work_s: np.ndarray | None = None) -> CloudEstimate:
        """Cost of ``job`` on offers ``idx`` (``(m,)``) when provisioning starts at ``start_s``.

        The cost model is :mod:`broker.planner.costs` (:func:`~broker.planner.costs.cloud_runtime`,
        :func:`~broker.planner.costs.cloud_cost`). With ``work_s`` (shape ``(n,)``, reference-GPU
        seconds) the fields are ``(n, m)`` arrays for ``n`` jobs of ``job``'s shape; otherwise ``(m,)``
        arrays for ``job`` itself.
        """
        thr, delay = self.offer_thr[idx], self.offer_delay[idx]
        spot, rate = self.offer_spot[idx], self.offer_rate[idx]
        kw = cloud_kw(job.nodes, job.gpus_per_node, self.offer_gpu_count[idx], self.offer_busy_kw[idx],
                      self.offer_idle_kw[idx], self.offer_pue[idx])
        usd_h, min_billed, zones = job.nodes * self.offer_price[idx], self.offer_min_billed[idx], self.offer_zone[idx]
        if work_s is None:
            runtime = job.work_s / thr
        else:
            runtime = work_s[:, None] / thr[None, :]
            delay, spot, rate, kw, usd_h, min_billed = (a[None, :] for a in (delay, spot, rate, kw, usd_h, min_billed))
        run = cloud_runtime(runtime, spot, rate, delay, checkpointable=job.checkpointable,
                            checkpoint_interval_s=job.checkpoint_interval_s, restart_s=self.config.restart_overhead_s)
        eff = run.expected_s
        if work_s is None:
            ci = self.zone_integrals(zones, start_s + delay, eff)
        else:
            shape = eff.shape
            ci = self.zone_integrals(np.broadcast_to(zones, shape).ravel(),
                                     np.broadcast_to(start_s + delay, shape).ravel(), eff.ravel()).reshape(shape)
            delay, usd_h = np.broadcast_to(delay, shape), np.broadcast_to(usd_h, shape)
        c = cloud_cost(eff, delay, usd_per_hour=usd_h, min_billed_s=min_billed, kw=kw, carbon_integral=ci)
        return CloudEstimate(eff, run.finish_bound_s, delay, c.dollars_usd, c.energy_kwh, c.carbon_kg, usd_h)

    def cloud_scalar(self, job: PendingJob, offer: int, start_s: float) -> CloudEstimate:
        """:meth:`cloud_estimates` of ``job`` on one offer, in plain floats (the same formulas, for per-job
        exact costs where NumPy's per-call cost would dominate)."""
        thr, spot, rate, delay, min_billed, price, count, busy, idle, pue = self._offer_floats[offer]
        zone = self._offer_carbon[offer]
        run = cloud_runtime(job.work_s / thr, spot, rate, delay, checkpointable=job.checkpointable,
                            checkpoint_interval_s=job.checkpoint_interval_s, restart_s=self.config.restart_overhead_s)
        eff = run.expected_s
        usd_h = job.nodes * price
        c = cloud_cost(eff, delay, usd_per_hour=usd_h, min_billed_s=min_billed,
                       kw=cloud_kw(job.nodes, job.gpus_per_node, count, busy, idle, pue),
                       carbon_integral=window_integral(zone, start_s + delay, eff))
        return CloudEstimate(eff, run.finish_bound_s, delay, c.dollars_usd, c.energy_kwh, c.carbon_kg, usd_h)

    def cloud_dollars(self, job: PendingJob, offer: int) -> float:
        """The expected bill of :meth:`cloud_scalar`, USD, without the carbon window (to rank offers by price)."""
        thr, spot, rate, delay, min_billed, price, *_ = self._offer_floats[offer]
        run = cloud_runtime(job.work_s / thr, spot, rate, delay, checkpointable=job.checkpointable,
                            checkpoint_interval_s=job.checkpoint_interval_s, restart_s=self.config.restart_overhead_s)
        return cloud_bill_usd(run.expected_s, delay, job.nodes * price, min_billed)

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
        # one instance per node (a gang: ``nodes`` equal instances) of the smallest shape that holds the node's
        # GPUs in its (provider, zone, GPU type, market): no paying for idle GPUs beyond it
        ok &= smallest_shape_mask(self.offer_shape_group, self.offer_gpu_count, job.gpus_per_node)
        ok &= self.offer_mem >= job.min_mem_gb
        if not job.spot_ok:
            ok &= ~self.offer_spot
        if job.regions is not None:
            ok &= np.array([r in job.regions for r in self.offer_region], dtype=bool)
        res = np.flatnonzero(ok)
        cache[key] = res
        return res


def _kwh_score_series(price: HourlySeries, carbon: HourlySeries, carbon_price_usd_per_tonne: float) -> HourlySeries:
    """The score of one kWh at each hour of ``carbon``'s grid, USD/kWh: :func:`broker.planner.costs.score` of
    the tariff (USD/MWh / 1000) and the emissions (gCO2e/kWh / 1000 kg), no wait. ``price`` is read onto the
    carbon grid by index arithmetic (both hourly, UTC); NaN where either is missing."""
    t = carbon.times_s()
    idx = np.floor((t - price.start_s) / price.interval_s).astype(np.int64)
    inside = (idx >= 0) & (idx < price.values.size)
    tariff = np.full(t.size, np.nan)
    tariff[inside] = price.values[idx[inside]]
    values = score(tariff / 1000.0, carbon.values / 1000.0, 0.0, 0.0, carbon_price_usd_per_tonne)
    return HourlySeries(zone=carbon.zone, unit="USD/kWh", start_s=carbon.start_s, values=values,
                        interval_s=carbon.interval_s)


def shape_groups(offers: Sequence) -> np.ndarray:
    """Group id per offer (``CloudOffer``-like: provider, zone, gpu_type, market): offers of one group differ
    only in shape (GPUs per instance). int64 array of shape ``(len(offers),)``."""
    ids: dict[tuple, int] = {}
    return np.array([ids.setdefault((o.provider, o.zone, o.gpu_type, getattr(o.market, "value", o.market)), len(ids))
                     for o in offers], dtype=np.int64)


def smallest_shape_mask(groups: np.ndarray, gpu_counts: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """Bool mask over offers (``groups`` from :func:`shape_groups`, ``gpu_counts`` GPUs per instance): the offer
    holds ``gpus_per_node`` GPUs and is the smallest shape that does in its (provider, zone, GPU type, market).
    A 1-GPU request may take an 8-GPU instance where that is the only shape (e.g. AWS L40S, H200), but not
    where a 1-GPU shape exists beside it. Shared by the planner and the live broker's failover."""
    groups, gpu_counts = np.asarray(groups, dtype=np.int64), np.asarray(gpu_counts, dtype=np.int64)
    fits = gpu_counts >= gpus_per_node
    if not groups.size:
        return fits
    best = np.full(int(groups.max()) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(best, groups[fits], gpu_counts[fits])
    return fits & (gpu_counts == best[groups])


def smallest_fit(n: int) -> int:
    """The largest instance GPU count a single-node job of ``n`` GPUs may take: the next power of two
    (instance shapes are 1, 2, 4, 8, 16 GPUs; no paying for idle GPUs beyond the smallest shape that holds it)."""
    p = 1
    while p < n:
        p *= 2
    return p
