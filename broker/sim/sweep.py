"""Policy runs and LP solves of one ``simulate`` call as independent tasks, run in worker processes, and the
carbon-price frontier they make (issue 11, item 2).

``fedbroker simulate --sweep-carbon-price P1,P2,...`` re-runs the policies whose decisions depend on the carbon
price (:attr:`broker.planner.registry.Policy.uses_carbon_price`: ``federated``) at each price; the others decide the
same at every price, so their one run serves every price (its score is re-priced). With ``--bound`` the score LP of
:class:`broker.sim.bound.BoundLP` is solved at each price too. :func:`frontier_entries` turns them into the
``"frontier"`` of results.json: per price, the bound's (cost, carbon) point and score, and each policy's cost,
carbon, score and score ratio to the bound at that price.

**Processes.** :func:`run_tasks` runs :class:`Task` s in ``workers`` processes (``spawn``: a fresh interpreter, so no
solver or thread state is inherited from the parent). Each worker loads the inputs once from a picklable
:class:`RunSpec` (the bundled scenario and the trace, as the parent did) and builds the LP once if it solves one;
it returns a run's :class:`~broker.sim.results.PolicyRun` only where the report needs it (the runs at the main
carbon price), else its metrics. With ``workers == 1`` the tasks run in this process on the parent's inputs.
Memory: one scenario + trace + run per worker, and the LP in those that solve one: each process peaks at
~0.5 GB on the whole Philly trace (measured with ``make demo``).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

from broker.model import PLAN_INTERVAL_S, Market
from broker.planner.core import PlannerConfig
from broker.planner.registry import POLICIES
from broker.sim.bound import BoundLP, FrontierPoint, policy_dollars_usd, policy_score_usd

__all__ = ["RunSpec", "Task", "run_tasks", "usage_file", "bound_offers", "uses_carbon_price", "frontier_entries"]


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to rebuild one ``simulate`` call's inputs (picklable).

    Attributes:
        trace: ``"philly"`` (bundled) or the path of a generic-CSV trace.
        cluster: on-prem cluster file, None for the bundled default pool.
        start, limit, slack_factor, min_slack_s: the trace loader's arguments (``min_slack_s`` in seconds).
        planner: the :class:`PlannerConfig` fields (``model_dump()``) at the main carbon price.
        seed, step_s, market: :class:`~broker.sim.simulator.SimulationConfig`'s ``seed``, ``tick_s`` (s), ``market``.
        block_h: hours per LP time step of the bound.
        signals: folder of user carbon/price CSVs (``simulate --signals``), None for the bundled series.
        usage_dir: where a full run writes its usage records, ``usage-<policy>.csv.gz``
            (:func:`broker.usage.write_usage_csv`), in the process that ran it; the run then comes back without
            them (``PolicyRun.usage`` empty, ``chargeback`` kept): no records through the pipe nor held by the
            parent. None: the records come back in the run.
        forecast: :class:`~broker.sim.simulator.SimulationConfig`'s ``forecast`` (``perfect`` or a model).
    """

    trace: str
    cluster: str | None = None
    start: datetime | None = None
    limit: int | None = None
    slack_factor: float = 1.0
    min_slack_s: float = 12 * 3600.0
    planner: dict = field(default_factory=dict)
    seed: int = 0
    step_s: float = PLAN_INTERVAL_S
    market: Market | None = None
    block_h: int = 1
    signals: str | None = None
    usage_dir: str | None = None
    forecast: str = "perfect"

    def load(self) -> tuple[Any, Any]:
        """``(trace, scenario)``: the trace and the bundled scenario, loaded as ``simulate`` loads them."""
        from pathlib import Path

        from broker.sim.scenario import load_scenario
        from broker.sim.traces import load_generic_csv, load_philly

        scen = load_scenario(self.cluster, signals_dir=self.signals)
        kw = dict(start=self.start, limit=self.limit, slack_factor=self.slack_factor, min_slack_s=self.min_slack_s)
        if self.trace == "philly":
            tr = load_philly(site_tz=scen.pools[0].timezone, **kw)
        else:
            tr = load_generic_csv(Path(self.trace), **kw)
        return tr, scen

    def planner_config(self, carbon_price_usd_per_t: float | None = None) -> PlannerConfig:
        """The planner config, at ``carbon_price_usd_per_t`` (USD per tCO2e) if given."""
        pc = PlannerConfig(**self.planner)
        if carbon_price_usd_per_t is not None:
            pc = pc.model_copy(update={"carbon_price_usd_per_tonne": float(carbon_price_usd_per_t)})
        return pc


def usage_file(policy: str) -> str:
    """The name of ``policy``'s usage-record file in the output folder: ``usage-<policy>.csv.gz``."""
    return f"usage-{policy}.csv.gz"


def bound_offers(offers: Sequence, config: PlannerConfig, market: Market | None) -> list:
    """The offers the runs could use, for the bound: none without cloud, else those of ``market`` (None: all)."""
    return [o for o in offers if market in (None, o.market)] if config.cloud_enabled else []


def uses_carbon_price(policy: str) -> bool:
    """True if ``policy``'s decisions depend on the carbon price (:attr:`Policy.uses_carbon_price`)."""
    return POLICIES[policy].uses_carbon_price


@dataclass(frozen=True)
class Task:
    """One unit of work.

    ``kind``: ``"run"`` (simulate ``policy`` at ``carbon_price_usd_per_t``, USD per tCO2e; returns the
    :class:`~broker.sim.results.PolicyRun` if ``full`` else its metrics), ``"bound"`` (the cost, carbon and score
    LPs at the price: ``(LowerBound, FrontierPoint)``) or ``"score"`` (the score LP alone: a
    :class:`~broker.sim.bound.FrontierPoint`). An LP without optimum returns its ``RuntimeError`` (not raised).
    """

    kind: str
    carbon_price_usd_per_t: float
    policy: str = ""
    full: bool = False

    def label(self) -> str:
        """e.g. ``federated @ $190/t``, ``LP score @ $0/t``."""
        what = self.policy if self.kind == "run" else f"LP {self.kind}"
        return f"{what} @ ${self.carbon_price_usd_per_t:,.0f}/t"


_STATE: dict[str, Any] = {}  # per process: spec, trace, scenario, and the LP once built


def _init(spec: RunSpec, trace=None, scenario=None) -> None:
    if trace is None:
        trace, scenario = spec.load()
    _STATE.clear()
    _STATE.update(spec=spec, trace=trace, scen=scenario)


def _lp() -> BoundLP:
    lp = _STATE.get("lp")
    if lp is None:
        spec, scen = _STATE["spec"], _STATE["scen"]
        pc = spec.planner_config()
        lp = _STATE["lp"] = BoundLP(_STATE["trace"], scen.pools, bound_offers(scen.offers, pc, spec.market),
                                    scen.signals, pc, scen.gpus, spec.block_h)
    return lp


def _run(task: Task) -> tuple[Any, float]:
    """Do ``task`` in this process; returns (its result, wall seconds)."""
    from broker.sim.simulator import SimulationConfig, simulate

    t0 = time.perf_counter()
    spec, scen = _STATE["spec"], _STATE["scen"]
    if task.kind == "run":
        r = simulate(_STATE["trace"], scen.pools, scen.offers, scen.signals, task.policy,
                     planner_config=spec.planner_config(task.carbon_price_usd_per_t), gpus=scen.gpus,
                     spot_traces=scen.spot_traces,
                     config=SimulationConfig(seed=spec.seed, tick_s=spec.step_s, market=spec.market,
                                             usage_records=task.full, forecast=spec.forecast))
        if task.full and spec.usage_dir is not None:
            from pathlib import Path

            from broker.usage import write_usage_csv

            write_usage_csv(r.usage, Path(spec.usage_dir) / usage_file(task.policy))
            r.usage = []
        out = r if task.full else r.metrics
    else:
        try:
            lp = _lp()
            if task.kind == "score":
                out = lp.score_point(task.carbon_price_usd_per_t)
            else:
                t1 = time.perf_counter()
                cost, carbon = lp.solve_cost(), lp.solve_carbon()
                point = lp.score_point(task.carbon_price_usd_per_t)
                out = (lp.bound(cost, carbon, point, time.perf_counter() - t1), point)
        except RuntimeError as e:
            out = e
    return out, time.perf_counter() - t0


def run_tasks(tasks: Sequence[Task], spec: RunSpec, workers: int, trace=None, scenario=None,
              on_done: Callable[[Task, Any, float], None] | None = None) -> list[Any]:
    """Run ``tasks`` and return their results in order.

    Args:
        tasks: what to do (put the longest first: workers take them in order).
        spec: the inputs, for the workers to load.
        workers: processes (>= 1); 1 runs in this process on ``trace`` and ``scenario`` (loaded from ``spec`` if
            None), as do a single task and platforms without ``spawn``.
        on_done: called in this process as each task ends, with the task, its result and its wall seconds.
    """
    results: list[Any] = [None] * len(tasks)
    workers = min(workers, len(tasks))
    if workers <= 1:
        _init(spec, trace, scenario)
        try:
            for i, t in enumerate(tasks):
                results[i], s = _run(t)
                if on_done:
                    on_done(t, results[i], s)
        finally:
            _STATE.clear()
        return results
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init,
                             initargs=(spec,)) as ex:
        futs = {ex.submit(_run, t): i for i, t in enumerate(tasks)}
        try:
            for f in as_completed(futs):
                i = futs[f]
                results[i], s = f.result()
                if on_done:
                    on_done(tasks[i], results[i], s)
        except BaseException:  # a task failed (or ^C): drop the queued ones rather than wait for them
            ex.shutdown(wait=False, cancel_futures=True)
            raise
    return results


def frontier_entries(prices: Sequence[float], metrics: Mapping[str, Mapping[float, Mapping[str, float]]],
                     bound_points: Mapping[float, FrontierPoint] | None, config: PlannerConfig) -> list[dict]:
    """The ``"frontier"`` of results.json: one entry per carbon price (ascending, USD per tCO2e).

    Args:
        prices: the carbon prices.
        metrics: policy -> price -> the run's metrics at that price (the same run at every price for a policy that
            does not use the carbon price).
        bound_points: price -> the score LP's point (None: no bound).
        config: the planner config (its ``onprem_cost_basis`` decides the dollars of a score).

    Each entry: ``carbon_price_usd_per_t``; ``bound``: :meth:`FrontierPoint.as_json` or None; ``policies``: name ->
    ``cost_usd`` (the dollars of its score, :func:`~broker.sim.bound.policy_dollars_usd`), ``carbon_kg``,
    ``score_usd`` (cost + price / 1000 x carbon, :func:`~broker.sim.bound.policy_score_usd`),
    ``score_ratio_to_bound`` (None without a positive bound score), ``deadline_misses`` (the bound is for runs
    without) and ``uses_carbon_price`` (False: one run, re-priced).
    """
    out = []
    for p in sorted(prices):
        cfg = config.model_copy(update={"carbon_price_usd_per_tonne": float(p)})
        bp = bound_points.get(p) if bound_points else None
        pols = {}
        for name, by_price in metrics.items():
            m = by_price[p]
            sc = policy_score_usd(m, cfg)
            pols[name] = {"cost_usd": policy_dollars_usd(m, cfg), "carbon_kg": m["carbon_kg"], "score_usd": sc,
                          "score_ratio_to_bound": sc / bp.score_usd if bp is not None and bp.score_usd > 0 else None,
                          "deadline_misses": m.get("deadline_misses"), "uses_carbon_price": uses_carbon_price(name)}
        out.append({"carbon_price_usd_per_t": float(p), "bound": bp.as_json() if bp is not None else None,
                    "policies": pols})
    return out
