"""Trace-driven discrete-event simulator: the same planner on a virtual clock.

One run replays a :class:`broker.sim.traces.Trace` against on-prem pools, cloud
offers and bundled grid signals under one policy and returns a
:class:`broker.sim.results.PolicyRun`.

Model (all times POSIX seconds, UTC):

* **Events** (a heap of plain tuples): job arrival, on-prem finish, cloud
  finish, spot interruption, wake-up (a deferred start or a queue review),
  and the start of a signal hour while a job waits undecided (a policy with
  cloud offers left it without a decision, e.g. no offer available: prices,
  carbon and spot capacity change on the hour, so it is looked at again then,
  hour after hour while other events remain or its deadline is ahead).
* **Planner cycles** run like the live broker's beat tick: events are
  coalesced to the next multiple of ``tick_s`` (default
  :data:`broker.model.PLAN_INTERVAL_S`, the live beat's 2 s; ``fedbroker
  simulate --step``) and one ``plan()`` call decides for everything that
  changed: a job to decide (new, woken, requeued, due for review, undecided
  at a new hour), or freed on-prem GPUs while jobs queue. Nothing runs
  between events: the clock jumps from one event instant to the next, so an
  idle span costs O(1) however long it is (the fair-share decay is applied
  once, at the next planned instant).
* **Offers**: none when the policy is on-prem only or ``cloud_enabled`` is off
  (``--no-cloud``); only those of ``SimulationConfig.market`` when it is set
  (``--market``).
* **On-prem**: a job runs ``work / throughput(gpu type)`` seconds on its nodes.
  Energy = GPUs x board power at 90 % utilisation x runtime x pool PUE;
  electricity cost = energy x hourly price; carbon = energy x hourly
  intensity; amortised cost = GPU-hours x pool $/GPU-h.
* **Cloud**: each instance billed from the create call (provisioning delay
  included) by the provider's billing rule (:func:`pricing.billing.billed_seconds`:
  whole seconds, 60-s minimum; :func:`broker.sim.ledger.cloud_instance_bill`);
  energy at the region's carbon intensity and the provider's PUE. Spot
  availability and interruptions replay the bundled SkyPilot spot traces (each spot offer is mapped to one trace of its
  accelerator, tiled in time with a per-offer phase from the seed). An
  interrupted job loses the work since its last checkpoint (all of it if not
  checkpointable) and is planned again.
* **Preemption**: a preempted on-prem job loses the work since its last
  checkpoint and re-enters the queue.
* **Fair share**: a run's reference-GPU-hours are charged to its team when it
  starts and decay with the fair-share half-life (:class:`broker.planner.fair_share.UsageLedger`;
  why the live cycle's exact integral is not used here is said in that module).
* Both are costed with the planner's cost model (:mod:`broker.planner.costs`) on the
  realised run, so a run without surprises costs what its explain record said.
* ``cost_usd`` is the spend a policy changes: cloud bills + on-prem
  electricity. The on-prem fleet's capital is the same under every policy;
  its share for the GPU-hours used is reported as ``onprem_amortised_usd``.
* **Per job** (:class:`broker.sim.results.JobRecord`, ``PolicyRun.jobs``): the
  same accounting summed over the job's segments, so the records add up to the
  run's ``cost_usd``, ``onprem_amortised_usd``, ``energy_kwh`` and ``carbon_kg``.
* **Usage records** (``PolicyRun.usage``, with ``SimulationConfig.usage_records``): the
  live ledger's lines for every attempt, rank and resource (:mod:`broker.sim.ledger`), and
  ``PolicyRun.chargeback`` (:func:`broker.usage.chargeback`) per team.
* **Grid signals the planner sees** (``SimulationConfig.forecast``, ``--forecast``): by default the
  measured series themselves (perfect knowledge of future prices and carbon). With a forecast model the
  planner sees, at each planning instant, the measured hours before the current UTC hour and the forecast
  issued at that hour (:mod:`pricing.forecast`); the run is still costed on the measured series, so the
  difference from the perfect-knowledge run of the same trace and seed is the regret of forecast error.
* Durations in the trace are taken as the jobs' true runtimes and their
  estimates (oracle runtime estimates; a known simplification).

Determinism: the same trace, cluster, offers, policy and seed give the same
result (no wall-clock input except the measured decision latency).
"""

from __future__ import annotations

import heapq
import math
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from broker.model import FAIR_SHARE_HALF_LIFE_S, PLAN_INTERVAL_S, CloudOffer, DecisionKind, Market, Pool
from broker.planner.core import GpuTable, PendingJob, PlannerConfig, PlannerContext, PolicyName, RunningJob, Snapshot
from broker.planner.costs import cloud_kw, load_emissions_kg, load_energy_kwh, onprem_cost, onprem_kw
from broker.planner.fair_share import UsageLedger, reference_gpu_hours
from broker.planner.policy_base import queue_group
from broker.planner.registry import POLICIES, plan
from broker.sim.ledger import cloud_instance_bill, cloud_records, onprem_records
from broker.sim.results import JobRecord, PolicyRun
from broker.sim.traces import Trace, TraceJob
from broker.usage import chargeback
from pricing.forecast import SIM_FORECASTS, ForecastedSignals
from pricing.series import window_integral

__all__ = ["SimulationConfig", "Simulator", "simulate", "SpotModel", "pending_job"]

_ARRIVE, _FINISH, _CLOUD_FINISH, _INTERRUPT, _WAKE, _HOUR = 0, 1, 2, 3, 4, 5
#: length of a grid-signal interval (hourly prices and carbon), seconds: undecided jobs are looked at again
#: at the next multiple of it (UTC hours)
_SIGNAL_HOUR_S = 3600.0


@dataclass
class SimulationConfig:
    """Simulator settings.

    Attributes:
        tick_s: planner cycle granularity, seconds (events are coalesced to the next
            multiple of it; finite, > 0). Default :data:`broker.model.PLAN_INTERVAL_S` (2 s),
            the live broker's beat interval (``BrokerSettings.plan_interval_s``).
        seed: phase of the spot traces per offer (deterministic).
        fair_share_half_life_s: half-life of the decayed team usage, seconds (7 days).
        max_cycles: safety stop (None: no limit).
        market: only cloud offers of this market (None: any).
        usage_records: build the run's usage records (``PolicyRun.usage``, ``PolicyRun.chargeback``); off for
            runs whose metrics alone are wanted (the carbon-price sweep's other prices).
        forecast: what the planner knows of future grid signals: ``"perfect"`` (the measured series: perfect
            knowledge, the default) or a model of :data:`pricing.forecast.MODELS`: at each planning instant
            it sees the measured hours before the current UTC hour and the forecast issued at that hour
            (:class:`pricing.forecast.ForecastedSignals`, issued once per hour and kept for the hour). Costs and
            carbon are always accounted on the measured series, so the difference between two runs is the
            planner's regret from forecast error.

    Raises:
        ValueError: ``tick_s`` is not a finite number > 0, or ``forecast`` is unknown.
    """

    tick_s: float = PLAN_INTERVAL_S
    seed: int = 0
    fair_share_half_life_s: float = FAIR_SHARE_HALF_LIFE_S
    max_cycles: int | None = None
    market: Market | None = None
    usage_records: bool = True
    forecast: str = "perfect"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tick_s) and self.tick_s > 0):
            raise ValueError(f"tick_s={self.tick_s}: must be a finite number > 0")
        if self.forecast not in SIM_FORECASTS:
            raise ValueError(f"forecast={self.forecast!r}: choose from {', '.join(SIM_FORECASTS)}")


class SpotModel:
    """Spot availability and interruptions of cloud offers, from real availability traces.

    Each spot offer gets one trace of its accelerator (V100 offers -> the V100
    traces, other types -> all traces), chosen by a CRC32 of the offer id, and a
    phase ``crc32(offer id, seed) mod period``. On-demand offers are always
    available and never interrupted.
    """

    def __init__(self, offers: Sequence[CloudOffer], traces, seed: int = 0):
        self.offers = list(offers)
        self.traces = list(traces)
        n = len(self.offers)
        self.trace_of = np.full(n, -1, dtype=np.int64)
        self.offset = np.zeros(n)
        if not self.traces:
            return
        by_acc: dict[str, list[int]] = {}
        for i, tr in enumerate(self.traces):
            by_acc.setdefault(tr.accelerator.upper(), []).append(i)
        all_idx = list(range(len(self.traces)))
        for i, o in enumerate(self.offers):
            if o.market != Market.spot:
                continue
            cand = by_acc.get(o.gpu_type.split("-")[0].upper(), all_idx)
            h = zlib.crc32(o.offer_id.encode())
            k = cand[h % len(cand)]
            self.trace_of[i] = k
            self.offset[i] = zlib.crc32(f"{o.offer_id}:{seed}".encode()) % int(self.traces[k].period_s)
        # flat arrays for a vectorised "available now" over all offers
        base, flat = [], []
        pos = 0
        for tr in self.traces:
            base.append(pos)
            flat.append(np.asarray(tr.availability, dtype=bool))
            pos += len(tr.availability)
        self._flat = np.concatenate(flat)
        self._base = np.array(base)
        spot = self.trace_of >= 0
        self._spot_idx = np.flatnonzero(spot)
        k = self.trace_of[spot]
        self._gap = np.array([self.traces[j].gap_s for j in k])
        self._period = np.array([self.traces[j].period_s for j in k])
        self._len = np.array([len(self.traces[j].availability) for j in k])
        self._b = self._base[k]
        self._off = self.offset[spot]

    def available(self, t_s: float) -> np.ndarray:
        """Bool array ``(n_offers,)``: the offer can be provisioned at ``t_s``."""
        out = np.ones(len(self.offers), dtype=bool)
        if self._spot_idx.size if self.traces else 0:
            tick = np.floor(np.mod(t_s + self._off, self._period) / self._gap).astype(np.int64)
            tick = np.minimum(tick, self._len - 1)
            out[self._spot_idx] = self._flat[self._b + tick]
        return out

    def next_interruption(self, offer: int, t_s: float) -> float:
        """First instant >= ``t_s`` when the offer's capacity is reclaimed (``inf`` for on-demand)."""
        k = self.trace_of[offer]
        if k < 0:
            return math.inf
        return float(self.traces[k].next_drop_after(t_s, float(self.offset[offer])))


def pending_job(tj: TraceJob) -> PendingJob:
    """The planner's view of trace job ``tj`` at its arrival: all its work (reference-GPU seconds) remaining."""
    return PendingJob(job_id=tj.job_id, team=tj.team, priority=tj.priority.rank, submit_s=tj.submit_s,
                      deadline_s=tj.deadline_s, earliest_s=tj.submit_s, work_s=tj.duration_s,
                      gpus_per_node=tj.gpus_per_node, nodes=tj.nodes,
                      gpu_types=frozenset([tj.gpu_type]) if tj.gpu_type else None, preemptible=tj.preemptible)


@dataclass(slots=True)
class _JobState:
    trace: TraceJob
    pending: PendingJob | None = None
    first_start_s: float = math.nan
    end_s: float = math.nan
    attempt: int = 0
    seg_start_s: float = math.nan
    seg_pool: int = -1
    seg_type: str = ""
    seg_offer: int = -1
    seg_provision_s: float = math.nan
    seg_runtime_s: float = 0.0
    deferred: bool = False
    waiting_wake: bool = False
    cloud: bool = False
    placement: str = ""  # pool name or offer id of the latest start
    market: str = ""  # offer market of the latest start ("" on-prem)
    starts: int = 0  # on-prem starts + cloud provisions
    rejected: bool = False
    dollars_usd: float = 0.0  # cloud bills + on-prem electricity (the run's cost_usd)
    amortised_usd: float = 0.0  # on-prem capital share
    energy_kwh: float = 0.0
    carbon_kg: float = 0.0


class Simulator:
    """Replays one trace under one policy. See the module docstring for the model.

    Args:
        trace: the jobs.
        pools: on-prem pools.
        offers: cloud offers (ignored by on-prem-only policies).
        signals: ``carbon(zone)`` / ``price(zone)`` series provider (``pricing.signals.GridSignals``).
        planner_config: the policy and its settings.
        gpus: GPU throughput/power table.
        spot_traces: spot availability traces (``pricing.spot.load_spot_traces()``).
        config: simulator settings.
    """

    def __init__(self, trace: Trace, pools: Sequence[Pool], offers: Sequence[CloudOffer], signals,
                 planner_config: PlannerConfig, gpus: GpuTable, spot_traces=(), config: SimulationConfig | None = None):
        self.trace = trace
        self.cfg = config or SimulationConfig()
        uses_cloud = POLICIES[planner_config.policy].uses_cloud and planner_config.cloud_enabled
        market = self.cfg.market
        self.offers = [o for o in offers if market is None or o.market == market] if uses_cloud else []
        self.ctx = PlannerContext(planner_config, pools, self.offers, signals, gpus)
        self.signals = signals
        self.pools = list(pools)
        self.gpus = gpus
        self.spot = SpotModel(self.offers, spot_traces, self.cfg.seed)
        self.free = [np.array([n.gpu_count for n in p.nodes], dtype=np.int64) for p in self.pools]
        self.capacity = sum(p.total_gpus for p in self.pools)
        self._price = [signals.price(p.price_zone) for p in self.pools]
        self._carbon = [signals.carbon(p.carbon_zone) for p in self.pools]
        self._offer_carbon = [signals.carbon(o.carbon_zone) for o in self.offers]

    # ------------------------------------------------------------------ run
    def run(self, progress: Callable[[int, int], None] | None = None) -> PolicyRun:
        """Run to completion; ``progress(done, total)`` is called now and then. Returns the :class:`PolicyRun`."""
        t_wall = time.perf_counter()
        cfg = self.cfg
        ctx = self.ctx
        jobs: dict[str, _JobState] = {}
        # jobs the planner must look at next cycle (new, woken, requeued, due for review)
        pending: dict[str, PendingJob] = {}
        # jobs waiting in the on-prem queue: queue_group (priority, team, urgency) -> {job_id: job}, in arrival order
        queued: dict[tuple, dict[str, PendingJob]] = {}
        queued_key: dict[str, tuple] = {}
        queued_demand: dict[int, list[float]] = {}
        running: dict[str, RunningJob] = {}

        def enqueue(pj: PendingJob) -> None:
            key = queue_group(pj, self.ctx.config)
            queued.setdefault(key, {})[pj.job_id] = pj
            queued_key[pj.job_id] = key
            if pj.committed_pool is not None:
                acc = queued_demand.setdefault(pj.committed_pool, [0.0, 0.0])
                acc[0] += pj.gpus
                acc[1] += pj.gpus * pj.work_s

        def dequeue(jid: str) -> PendingJob | None:
            key = queued_key.pop(jid, None)
            if key is None:
                return None
            group = queued[key]
            pj = group.pop(jid)
            if not group:  # drop it: the snapshot and the planner's merge then see only live groups
                del queued[key]
            if pj.committed_pool is not None:
                acc = queued_demand[pj.committed_pool]
                acc[0] -= pj.gpus
                acc[1] -= pj.gpus * pj.work_s
            return pj

        def take(jid: str) -> None:
            """Remove a job from wherever it waits (pending or queued)."""
            if pending.pop(jid, None) is None:
                dequeue(jid)
        heap: list = []
        seq = 0
        for tj in self.trace.jobs:
            heapq.heappush(heap, (tj.submit_s, seq, _ARRIVE, tj.job_id, 0))
            seq += 1
            jobs[tj.job_id] = _JobState(tj)
        total = len(jobs)
        done = 0
        # fair share (broker.planner.fair_share): a run's reference-GPU-hours are charged when it starts
        ledger = UsageLedger(self.trace.jobs[0].submit_s if self.trace.jobs else 0.0, cfg.fair_share_half_life_s)
        usage = ledger.usage
        m = dict(cloud_cost=0.0, energy_cost=0.0, amort=0.0, energy=0.0, carbon=0.0, preemptions=0,
                 interruptions=0, cloud_jobs=0, deferred=0, missing_signal_s=0.0)
        tl_t, tl_cost, tl_carbon, tl_busy = [], [], [], []
        busy_gpus = 0
        busy_gpu_s = 0.0
        wait_busy_s = 0.0  # GPU-seconds allocated while some job waited for on-prem
        wait_span_s = 0.0
        last_t = None
        latencies: list[float] = []
        rejected: dict[str, int] = {}
        team_cost: dict[str, float] = {}
        cycles = 0
        tick = cfg.tick_s
        waiting_onprem = 0
        freed = False
        pool_index = {pl.name: i for i, pl in enumerate(self.pools)}
        # jobs left without a decision by a policy with cloud offers, looked at again at the next signal hour
        hourly = bool(self.offers)
        undecided: set[str] = set()
        next_hour = -math.inf  # instant of the pending _HOUR event (-inf: none)

        usage_on = cfg.usage_records
        fc_model = cfg.forecast
        issued_hour = None  # UTC hour (index) of the forecasts the planner holds (``forecast`` not perfect)
        usage_out: list = []

        def account_onprem(st: _JobState, end: float, allocation) -> None:
            p, t = st.seg_pool, st.seg_type
            dur = end - st.seg_start_s
            if dur <= 0:
                return
            pool = self.pools[p]
            g = st.trace.num_gpus
            pi = pi_raw = window_integral(self._price[p], st.seg_start_s, dur)
            ci = ci_raw = window_integral(self._carbon[p], st.seg_start_s, dur)
            if math.isnan(pi) or math.isnan(ci):
                m["missing_signal_s"] += dur
                pi = 0.0 if math.isnan(pi) else pi
                ci = 0.0 if math.isnan(ci) else ci
            c = onprem_cost(dur, gpus=g, kw=onprem_kw(g, self.gpus.busy_kw[t], pool.pue),
                            usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour, tariff_integral=pi, carbon_integral=ci)
            m["energy_cost"] += c.energy_usd
            m["amort"] += c.amortised_usd
            m["energy"] += c.energy_kwh
            m["carbon"] += c.carbon_kg
            st.dollars_usd += c.energy_usd
            st.amortised_usd += c.amortised_usd
            st.energy_kwh += c.energy_kwh
            st.carbon_kg += c.carbon_kg
            team_cost[st.trace.team] = team_cost.get(st.trace.team, 0.0) + c.energy_usd
            if usage_on:
                usage_out.extend(onprem_records(
                    job_id=st.trace.job_id, team=st.trace.team, attempt=st.attempt + 1, pool=pool,
                    allocation=allocation, gpu_type=t, start_s=st.seg_start_s, end_s=end,
                    busy_kw=self.gpus.busy_kw[t], tariff_integral=pi_raw, carbon_integral=ci_raw))

        def account_cloud(st: _JobState, end: float) -> None:
            o = self.offers[st.seg_offer]
            tj = st.trace
            # billed from the create call: the provisioning delay, then the run (interrupted or not)
            run = max(end - st.seg_start_s, 0.0)
            ci = ci_raw = window_integral(self._offer_carbon[st.seg_offer], st.seg_start_s, run)
            if math.isnan(ci):
                m["missing_signal_s"] += run
                ci = 0.0
            # each of the job's instances is billed by the provider's rule, from the create call
            dollars = tj.nodes * cloud_instance_bill(o, max(end - st.seg_provision_s, 0.0))[1]
            busy, idle = self.gpus.busy_kw[o.gpu_type], self.gpus.idle_kw[o.gpu_type]
            kw = cloud_kw(tj.nodes, tj.gpus_per_node, o.gpu_count, busy, idle, o.pue)
            energy, carbon = load_energy_kwh(kw, run), load_emissions_kg(kw, ci)
            m["cloud_cost"] += dollars
            m["energy"] += energy
            m["carbon"] += carbon
            st.dollars_usd += dollars
            st.energy_kwh += energy
            st.carbon_kg += carbon
            team_cost[tj.team] = team_cost.get(tj.team, 0.0) + dollars
            if usage_on:
                usage_out.extend(cloud_records(
                    job_id=tj.job_id, team=tj.team, attempt=st.attempt + 1, offer=o, nodes=tj.nodes,
                    gpus_per_node=tj.gpus_per_node, provision_s=st.seg_provision_s, start_s=st.seg_start_s,
                    end_s=end, busy_kw=busy, idle_kw=idle, carbon_integral=ci_raw))

        def requeue(st: _JobState, now: float, done_work_s: float) -> None:
            tj = st.trace
            pj = st.pending
            pj.work_s = max(pj.work_s - done_work_s, 1.0)
            pj.earliest_s = now
            pj.committed_pool = None
            pj.review_s = 0.0
            st.attempt += 1
            pending[tj.job_id] = pj

        def progress_done(st: _JobState, now: float, thr: float) -> float:
            """Reference-GPU work kept after a stop at ``now`` (checkpointed part only)."""
            ran = max(now - st.seg_start_s, 0.0)
            pj = st.pending
            if not pj.checkpointable:
                return 0.0
            kept = math.floor(ran / pj.checkpoint_interval_s) * pj.checkpoint_interval_s
            return kept * thr

        while heap:
            t_ev = heap[0][0]
            now = math.ceil(t_ev / tick) * tick
            if last_t is not None and now > last_t:
                dt = now - last_t
                busy_gpu_s += busy_gpus * dt
                if waiting_onprem:
                    wait_busy_s += busy_gpus * dt
                    wait_span_s += self.capacity * dt
            while heap and heap[0][0] <= now:
                t, _, kind, jid, token = heapq.heappop(heap)
                if kind == _HOUR:
                    for ujid in undecided:
                        if ujid in queued_key:
                            pending[ujid] = dequeue(ujid)
                    undecided.clear()
                    next_hour = -math.inf
                    continue
                st = jobs[jid]
                if kind == _ARRIVE:
                    tj = st.trace
                    pj = pending_job(tj)
                    st.pending = pj
                    pending[jid] = pj
                elif token != st.attempt:
                    continue  # stale event of an earlier attempt
                elif kind == _FINISH:
                    r = running.pop(jid)
                    for node, g in r.allocation:
                        self.free[r.pool][node] += g
                        busy_gpus -= g
                    freed = True
                    account_onprem(st, t, r.allocation)
                    st.end_s = t
                    done += 1
                elif kind == _CLOUD_FINISH:
                    account_cloud(st, t)
                    st.end_s = t
                    done += 1
                elif kind == _INTERRUPT:
                    account_cloud(st, t)
                    m["interruptions"] += 1
                    thr = self.gpus.throughput[self.offers[st.seg_offer].gpu_type]
                    requeue(st, t, progress_done(st, t, thr))
                elif kind == _WAKE:
                    pj = st.pending
                    if pj is None or jid in running or not math.isnan(st.end_s):
                        continue
                    if jid in queued_key:
                        if pj.review_s <= t:  # due for review: decide again
                            dequeue(jid)
                            pending[jid] = pj
                    elif jid not in pending and pj.earliest_s <= t and st.waiting_wake:
                        st.waiting_wake = False
                        pending[jid] = pj
            if not pending and not (queued_key and freed):
                last_t = now
                continue
            freed = False
            ledger.advance(now)  # fair-share usage decays continuously (one factor per planned instant)
            avail = self.spot.available(now) if self.offers else None
            snap = Snapshot(now_s=now, pending=list(pending.values()), free=self.free,
                            running=list(running.values()), offer_available=avail, team_usage=usage,
                            queued={k: v.values() for k, v in queued.items() if v},
                            queued_demand={p: (a[0], a[1]) for p, a in queued_demand.items()})
            if fc_model != "perfect" and math.floor(now / _SIGNAL_HOUR_S) != issued_hour:
                # the forecasts issued at this UTC hour (kept for the hour): what a live broker would know now
                issued_hour = math.floor(now / _SIGNAL_HOUR_S)
                ctx.set_signals(ForecastedSignals(self.signals, issued_hour * _SIGNAL_HOUR_S, fc_model))
            t0 = time.perf_counter()
            decisions = plan(snap, ctx)
            latencies.append(time.perf_counter() - t0)
            cycles += 1
            for d in decisions:
                st = jobs[d.job_id]
                pj = st.pending
                kind = d.kind
                if kind == DecisionKind.preempt:
                    for vid in d.victims:
                        r = running.pop(vid)
                        vst = jobs[vid]
                        for node, g in r.allocation:
                            self.free[r.pool][node] += g
                            busy_gpus -= g
                        account_onprem(vst, now, r.allocation)
                        m["preemptions"] += 1
                        requeue(vst, now, progress_done(vst, now, self.gpus.throughput[vst.seg_type]))
                    kind = DecisionKind.start
                if kind == DecisionKind.start:
                    p = pool_index[d.pool]
                    node0 = d.allocation[0][0]
                    gtype = self.pools[p].nodes[node0].gpu_type
                    runtime = pj.work_s / self.gpus.throughput[gtype]
                    for node, g in d.allocation:
                        if self.free[p][node] < g:
                            raise RuntimeError(f"planner over-allocated node {node} of pool {d.pool}")
                        self.free[p][node] -= g
                        busy_gpus += g
                    take(d.job_id)
                    st.seg_start_s, st.seg_pool, st.seg_type = now, p, gtype
                    st.placement, st.market = d.pool, ""
                    st.starts += 1
                    if math.isnan(st.first_start_s):
                        st.first_start_s = now
                    running[d.job_id] = RunningJob(job_id=d.job_id, pool=p, allocation=list(d.allocation),
                                                   expected_end_s=now + runtime, started_s=now, priority=pj.priority,
                                                   preemptible=pj.preemptible, team=pj.team,
                                                   checkpoint_interval_s=pj.checkpoint_interval_s,
                                                   checkpointable=pj.checkpointable)
                    ledger.charge(pj.team, reference_gpu_hours(pj.gpus, runtime, self.gpus.throughput[gtype]))
                    heapq.heappush(heap, (now + runtime, seq, _FINISH, d.job_id, st.attempt))
                    seq += 1
                elif kind == DecisionKind.provision:
                    o = d.offer_index
                    offer = self.offers[o]
                    take(d.job_id)
                    start = now + offer.provisioning_delay_s
                    runtime = pj.work_s / self.gpus.throughput[offer.gpu_type]
                    st.seg_provision_s, st.seg_start_s, st.seg_offer = now, start, o
                    st.placement, st.market = offer.offer_id, offer.market.value
                    st.starts += 1
                    if math.isnan(st.first_start_s):
                        st.first_start_s = start
                    if not st.cloud:
                        st.cloud = True
                        m["cloud_jobs"] += 1
                    ledger.charge(pj.team, reference_gpu_hours(pj.gpus, runtime, self.gpus.throughput[offer.gpu_type]))
                    t_int = self.spot.next_interruption(o, start)
                    if t_int < start + runtime:
                        heapq.heappush(heap, (max(t_int, start), seq, _INTERRUPT, d.job_id, st.attempt))
                    else:
                        heapq.heappush(heap, (start + runtime, seq, _CLOUD_FINISH, d.job_id, st.attempt))
                    seq += 1
                elif kind == DecisionKind.defer:
                    take(d.job_id)
                    pj.earliest_s = d.not_before
                    pj.deferred_once = True
                    st.waiting_wake = True
                    if not st.deferred:
                        st.deferred = True
                        m["deferred"] += 1
                    heapq.heappush(heap, (d.not_before, seq, _WAKE, d.job_id, st.attempt))
                    seq += 1
                elif kind == DecisionKind.wait:
                    p = pool_index[d.pool]
                    take(d.job_id)
                    pj.committed_pool = p
                    pj.review_s = d.not_before if d.not_before is not None else math.inf
                    enqueue(pj)
                    if pj.review_s < math.inf:
                        heapq.heappush(heap, (pj.review_s, seq, _WAKE, d.job_id, st.attempt))
                        seq += 1
                elif kind == DecisionKind.reject:
                    take(d.job_id)
                    reason = (d.reason.split(" can ever hold")[0] + " can ever hold the job") if d.reason else "rejected"
                    rejected[reason] = rejected.get(reason, 0) + 1
                    st.end_s = math.nan
                    st.rejected = True
                    done += 1
            # jobs the policy looked at but left waiting join the on-prem queue
            for jid in list(pending):
                pj = pending.pop(jid)
                enqueue(pj)
                if hourly and pj.committed_pool is None:
                    undecided.add(jid)
            # while anything else can still happen, or an undecided job's deadline is ahead (a job no offer ever
            # takes must not keep the run going forever: it ends unfinished)
            if undecided and next_hour <= now and (heap or any(jobs[u].trace.deadline_s > now for u in undecided)):
                next_hour = (math.floor(now / _SIGNAL_HOUR_S) + 1) * _SIGNAL_HOUR_S
                heapq.heappush(heap, (next_hour, seq, _HOUR, "", 0))
                seq += 1
            waiting_onprem = len(queued_key)
            tl_t.append(now)
            tl_cost.append(m["cloud_cost"] + m["energy_cost"])
            tl_carbon.append(m["carbon"])
            tl_busy.append(busy_gpus)
            last_t = now
            if progress is not None and cycles % 2000 == 0:
                progress(done, total)
            if cfg.max_cycles is not None and cycles >= cfg.max_cycles:
                break

        if progress is not None:
            progress(done, total)

        # ------------------------------------------------------------ metrics
        comp = [s for s in jobs.values() if not math.isnan(s.end_s)]
        jct = np.array([s.end_s - s.trace.submit_s for s in comp])
        waits = np.array([s.first_start_s - s.trace.submit_s for s in comp])
        missed = [s.trace.job_id for s in comp if s.end_s > s.trace.deadline_s]
        misses = len(missed)
        unfinished = total - len(comp) - sum(rejected.values())
        t_first = self.trace.jobs[0].submit_s if self.trace.jobs else 0.0
        span = (last_t - t_first) if last_t is not None else 0.0
        lat = np.array(latencies) * 1000.0
        skipped = dict(self.trace.skipped)
        for k, v in rejected.items():
            skipped[f"rejected: {k}"] = v
        if unfinished:
            skipped["unfinished"] = unfinished
        metrics = {
            "jobs_submitted": total,
            "jobs_completed": len(comp),
            "jobs_skipped": sum(rejected.values()) + unfinished,
            "deadline_misses": misses + unfinished,
            "mean_jct_s": float(jct.mean()) if jct.size else math.nan,
            "p95_jct_s": float(np.percentile(jct, 95)) if jct.size else math.nan,
            "mean_wait_s": float(waits.mean()) if waits.size else math.nan,
            "cost_usd": m["cloud_cost"] + m["energy_cost"],
            "cloud_cost_usd": m["cloud_cost"],
            "onprem_energy_cost_usd": m["energy_cost"],
            "onprem_amortised_usd": m["amort"],
            "energy_kwh": m["energy"],
            "carbon_kg": m["carbon"],
            "onprem_gpu_utilization": busy_gpu_s / (self.capacity * span) if span > 0 and self.capacity else 0.0,
            "onprem_allocated_while_waiting": wait_busy_s / wait_span_s if wait_span_s > 0 else math.nan,
            "cloud_jobs": m["cloud_jobs"],
            "deferred_jobs": m["deferred"],
            "preemptions": m["preemptions"],
            "spot_interruptions": m["interruptions"],
            "decision_latency_p99_ms": float(np.percentile(lat, 99)) if lat.size else 0.0,
            "planner_cycles": cycles,
            "missing_signal_hours": m["missing_signal_s"] / 3600.0,
            "sim_wall_s": time.perf_counter() - t_wall,
        }
        records = [JobRecord(job_id=s.trace.job_id, team=s.trace.team, gpus=s.trace.num_gpus,
                             submit_s=s.trace.submit_s, start_s=s.first_start_s, end_s=s.end_s,
                             placement=s.placement, market=s.market, dollars_usd=s.dollars_usd,
                             amortised_usd=s.amortised_usd, energy_kwh=s.energy_kwh, carbon_kg=s.carbon_kg,
                             deadline_s=s.trace.deadline_s, starts=s.starts,
                             status="completed" if not math.isnan(s.end_s) else
                             ("rejected" if s.rejected else "unfinished"))
                   for s in jobs.values()]
        return PolicyRun(policy=ctx.config.policy, metrics=metrics, jobs=records, timeline_t_s=np.array(tl_t),
                         cum_cost_usd=np.array(tl_cost), cum_carbon_kg=np.array(tl_carbon),
                         onprem_busy_gpus=np.array(tl_busy), onprem_total_gpus=self.capacity,
                         team_cost_usd=team_cost, waits_s=waits, skipped=skipped, missed_job_ids=missed,
                         usage=usage_out, chargeback=chargeback(usage_out) if usage_on else {})


def simulate(trace: Trace, pools: Sequence[Pool], offers: Sequence[CloudOffer], signals, policy: str,
             planner_config: PlannerConfig | None = None, gpus: GpuTable | None = None, spot_traces=(),
             config: SimulationConfig | None = None, progress=None) -> PolicyRun:
    """Replay ``trace`` under ``policy``; see :class:`Simulator`. Returns a :class:`PolicyRun`."""
    pc = (planner_config or PlannerConfig()).model_copy(update={"policy": PolicyName(policy)})
    sim = Simulator(trace, pools, offers, signals, pc, gpus or GpuTable.from_pricing(), spot_traces, config)
    return sim.run(progress)
