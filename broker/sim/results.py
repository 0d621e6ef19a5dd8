"""Results of one simulated policy run, shared by the simulator, the report and the CLI.

``PolicyRun.metrics`` carries at least the keys of :data:`METRIC_KEYS`, with the
units given there. Timelines are sampled at planner cycles (POSIX seconds, UTC).
``PolicyRun.jobs`` holds one :class:`JobRecord` per trace job (written as
``jobs-<policy>.csv`` by :func:`broker.sim.report.write_job_csv`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np

__all__ = ["JobRecord", "PolicyRun", "METRIC_KEYS"]

#: metric name -> unit, in the order the comparison table prints them.
METRIC_KEYS: dict[str, str] = {
    "jobs_submitted": "jobs",
    "jobs_completed": "jobs",
    "jobs_skipped": "jobs",
    "deadline_misses": "jobs",
    "mean_jct_s": "s",
    "p95_jct_s": "s",
    "mean_wait_s": "s",
    "cost_usd": "USD",
    "cloud_cost_usd": "USD",
    "onprem_energy_cost_usd": "USD",
    "onprem_amortised_usd": "USD",
    "onprem_allocated_while_waiting": "fraction",
    "energy_kwh": "kWh",
    "carbon_kg": "kgCO2e",
    "onprem_gpu_utilization": "fraction",
    "cloud_jobs": "jobs",
    "deferred_jobs": "jobs",
    "preemptions": "count",
    "spot_interruptions": "count",
    "decision_latency_p99_ms": "ms",
    "planner_cycles": "count",
    "missing_signal_hours": "h",
    "sim_wall_s": "s",
}


@dataclass(frozen=True)
class JobRecord:
    """One trace job's outcome in a run, from the simulator's own accounting.

    Attributes:
        job_id, team: from the trace.
        gpus: GPUs the job asks for (all nodes).
        submit_s, start_s, end_s, deadline_s: POSIX seconds, UTC. ``start_s`` is the
            first start (on-prem start, or the cloud instance ready after its boot);
            ``start_s``/``end_s`` are NaN when the job never started/finished.
        placement: pool name or cloud offer id of the latest start ("" if none).
        market: ``spot`` or ``on_demand`` for a cloud placement, "" on-prem or none.
        dollars_usd: cloud bills + on-prem electricity over all its runs, USD (its
            share of the run's ``cost_usd``).
        amortised_usd: on-prem capital share for its GPU-hours, USD (``onprem_amortised_usd``).
        energy_kwh: facility energy, kWh; carbon_kg: emissions, kgCO2e.
        starts: on-prem starts plus cloud provisions (> 1 after a preemption or a spot interruption).
        status: ``completed``, ``rejected`` (no pool or offer can ever hold it) or
            ``unfinished`` (still waiting or running when the run stopped).
    """

    job_id: str
    team: str
    gpus: int
    submit_s: float
    start_s: float
    end_s: float
    placement: str
    market: str
    dollars_usd: float
    amortised_usd: float
    energy_kwh: float
    carbon_kg: float
    deadline_s: float
    starts: int
    status: str

    @property
    def wait_s(self) -> float:
        """Seconds from submission to the first start (NaN if it never started)."""
        return self.start_s - self.submit_s

    @property
    def deadline_met(self) -> bool | None:
        """Finished by its deadline; False if unfinished; None if rejected (counted as skipped, not missed)."""
        if self.status == "rejected":
            return None
        return not math.isnan(self.end_s) and self.end_s <= self.deadline_s


@dataclass
class PolicyRun:
    """One policy replayed over one trace.

    Attributes:
        policy: policy name (``fifo``, ``backfill``, ``cheapest``, ``federated``).
        metrics: see :data:`METRIC_KEYS` (units there).
        timeline_t_s: sample instants, POSIX seconds UTC, shape ``(k,)``.
        cum_cost_usd: cumulative cost (cloud + on-prem electricity), USD, ``(k,)``.
        cum_carbon_kg: cumulative emissions, kgCO2e, ``(k,)``.
        onprem_busy_gpus: on-prem GPUs allocated at each sample, ``(k,)``.
        onprem_total_gpus: on-prem GPUs in the cluster.
        team_cost_usd: team -> cost (cloud + on-prem electricity), USD.
        waits_s: per completed job, seconds from submission to its first start, ``(n,)``.
        skipped: reason -> count of trace rows or jobs not simulated.
        missed_job_ids: ids of jobs that finished after their deadline (or never), for drill-down.
        jobs: one :class:`JobRecord` per trace job, in trace order.
        usage: the run's usage records (:class:`broker.usage.UsageRecord`, ``source="sim"``): one per attempt,
            rank and resource line, as the live ledger writes them (:mod:`broker.sim.ledger`); empty when the
            run was made without them (``SimulationConfig.usage_records``).
        chargeback: :func:`broker.usage.chargeback` of ``usage``: team -> cloud, on-prem energy and amortised
            USD, kWh, kgCO2e, GPU-hours (empty without records).
    """

    policy: str
    metrics: dict[str, float]
    timeline_t_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cum_cost_usd: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cum_carbon_kg: np.ndarray = field(default_factory=lambda: np.zeros(0))
    onprem_busy_gpus: np.ndarray = field(default_factory=lambda: np.zeros(0))
    onprem_total_gpus: int = 0
    team_cost_usd: dict[str, float] = field(default_factory=dict)
    waits_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    skipped: dict[str, int] = field(default_factory=dict)
    missed_job_ids: list[str] = field(default_factory=list)
    jobs: list[JobRecord] = field(default_factory=list)
    usage: list = field(default_factory=list)
    chargeback: dict[str, dict[str, float]] = field(default_factory=dict)
