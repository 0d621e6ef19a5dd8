"""One live planning cycle: store -> snapshot -> ``plan()`` -> fenced compare-and-set -> dispatches.

:meth:`PlanningCycle.run` does, in order:

1. **Intake** (per-job compare-and-set, safe to repeat): ``submitted`` jobs become
   ``queued``, or ``deferred`` until their window opens (``not_before``) — for a job
   with ``window: cheapest|cleanest`` the start is the cheapest/cleanest slot of its
   window (:func:`broker.windows.best_start`); ``deferred`` jobs whose ``not_before``
   has come are ``queued`` again; waiting jobs past their ``not_after`` fail.
2. **Snapshot**: the planner fence version, live nodes (fresh heartbeat), queued
   jobs and the jobs holding GPUs, turned into the planner's :class:`Snapshot`
   exactly as the simulator builds it (``pending`` = new, requeued or due for
   review; ``queued`` = jobs committed to an on-prem pool, by (priority, team)).
3. **Plan**: :func:`broker.planner.plan`, the same pure function the simulator runs.
4. **Apply** in one transaction that first advances the planner fence from the
   version read in step 2 (:meth:`JobStore.advance_fence`); if another cycle
   applied meanwhile (two planners after a lost Redis lock, a task delivered
   twice), nothing is applied. Each decision is a compare-and-set on the job's
   version, so a job cancelled meanwhile is left alone.
5. **Dispatch** (after commit): ``dispatch(job_id, attempt)`` for every job sent to a cloud
   (``provisioning``). On-prem placements need none: node agents poll the node API.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Sequence

import numpy as np
from sqlalchemy import or_, select

from broker.db import Attempt, Job, JobEvent, Node, utcnow
from broker.live import LiveEnvironment, LiveNode
from broker.model import DecisionKind, JobSpec
from broker.planner import PendingJob, RunningJob, Snapshot, plan
from broker.states import JobState
from broker.store import JobStore
from providers.launch import DIGEST_RE as _DIGEST_RE

__all__ = ["PlanningCycle", "CycleResult", "pending_job", "decayed_usage", "json_safe"]

log = logging.getLogger("fedbroker.cycle")
S = JobState
#: half-life of the fair-share usage decay, seconds (7 days, as in the simulator's default)
FAIR_SHARE_HALF_LIFE_S = 7 * 86400.0


@dataclass
class CycleResult:
    """What one cycle did. ``stale``: the plan was dropped because another cycle applied first."""

    applied: bool = False
    stale: bool = False
    intake: int = 0
    decisions: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    dispatched: list[tuple[str, int]] = field(default_factory=list)
    plan_s: float = 0.0
    total_s: float = 0.0


def _ts(dt: datetime | None) -> float | None:
    return None if dt is None else dt.timestamp()


def _dt(s: float) -> datetime:
    return datetime.fromtimestamp(s, timezone.utc)


def pending_job(j: Job, pool_index: dict[str, int], canon: Callable[[str], str]) -> PendingJob:
    """The planner's view of a stored job (times in POSIX seconds, work in reference-GPU seconds).

    A start window's end (``not_after``) tightens the deadline the planner sees to
    ``not_after + remaining work`` so the planner never holds it past its window.
    """
    spec = j.spec
    work = max(float(spec["estimated_duration_s"]) - float(j.work_done_s or 0.0), 1.0)
    deadline = j.deadline.timestamp()
    if j.not_after is not None:
        deadline = min(deadline, j.not_after.timestamp() + work)
    created = j.created_at.timestamp()
    earliest = max(created, _ts(j.not_before) or created)
    types = spec.get("gpu_types") or ()
    regions = spec.get("allowed_regions") or ()
    committed = pool_index.get(j.committed_pool) if j.committed_pool else None
    return PendingJob(
        job_id=j.id, team=j.team, priority=j.priority, submit_s=created, deadline_s=deadline, earliest_s=earliest,
        work_s=work, gpus_per_node=int(spec["gpus_per_node"]), nodes=int(spec["nodes"]),
        gpu_types=frozenset(canon(t) for t in types) if types else None,
        min_mem_gb=float(spec.get("min_gpu_memory_gb") or 0.0), spot_ok=bool(spec.get("spot_allowed", True)),
        preemptible=bool(spec.get("preemptible", False)), checkpointable=bool(spec.get("checkpointable", True)),
        checkpoint_interval_s=float(spec.get("checkpoint_interval_s") or 1800.0),
        regions=frozenset(regions) if regions else None, max_usd_per_hour=spec.get("max_price_usd_per_hour"),
        deferrable=bool(spec.get("deferrable", True)) and spec.get("window", "planner") == "planner",
        committed_pool=committed, deferred_once=bool(j.deferred_once),
        review_s=_ts(j.review_at) if j.review_at is not None else (math.inf if committed is not None else 0.0))


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by ``None`` (JSON has no NaN; PostgreSQL rejects it).
    In explain records an infeasible option's ``score`` is NaN: it has no score."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def decayed_usage(rows: Sequence[tuple[str, int, float, float]], now_s: float,
                  half_life_s: float = FAIR_SHARE_HALF_LIFE_S) -> dict[str, float]:
    """Team -> decayed GPU-hours from ``(team, gpus, start_s, end_s)`` rows (``end_s`` NaN = still running).

    Each GPU-second at time t weighs ``exp(-ln2 x (now - t) / half_life)``; integrated exactly per row.
    """
    lam = math.log(2) / half_life_s
    out: dict[str, float] = defaultdict(float)
    for team, gpus, a, b in rows:
        b = now_s if (b is None or math.isnan(b)) else min(b, now_s)
        if b <= a:
            continue
        # integral of exp(-lam (now - t)) dt over [a, b]
        w = (math.exp(-lam * (now_s - b)) - math.exp(-lam * (now_s - a))) / lam
        out[team] += gpus * w / 3600.0
    return dict(out)


class PlanningCycle:
    """Runs planning cycles against a :class:`JobStore`.

    Args:
        store: the job store.
        env: static planning inputs (:class:`LiveEnvironment`).
        settings: :class:`broker.settings.BrokerSettings` (deadlines, heartbeat timeouts).
        dispatch: called after commit with ``(job_id, attempt)`` for each job sent to provisioning.
        leader: a name for this planner, recorded with the fence.
    """

    def __init__(self, store: JobStore, env: LiveEnvironment, settings, dispatch: Callable[[str, int], None] | None = None,
                 leader: str = "planner", cloud=None):
        self.store = store
        self.env = env
        self.settings = settings
        self.dispatch = dispatch
        self.leader = leader
        self.cloud = cloud
        from pricing.power import canonical_or_same

        self.canon = canonical_or_same

    # ------------------------------------------------------------------ public
    def run(self, now: datetime | None = None) -> CycleResult:
        """One cycle at ``now`` (default: the clock). Returns a :class:`CycleResult`."""
        t0 = time.perf_counter()
        now = now or utcnow()
        res = CycleResult()
        res.intake = self.intake(now)
        version = self.store.planner_version()
        with self.store.session() as s:
            snap_parts = self._read(s, now)
        if snap_parts is None:
            res.total_s = time.perf_counter() - t0
            return res
        snapshot, ctx, jobs, nodes_by_pool, used = snap_parts
        t1 = time.perf_counter()
        decisions = plan(snapshot, ctx) if snapshot.pending or snapshot.queued else []
        res.plan_s = time.perf_counter() - t1
        res.decisions = len(decisions)
        with self.store.session() as s:
            if not JobStore.advance_fence(s, version, self.leader, now):
                res.stale = True
                log.info("planning cycle dropped: another cycle applied since fence version %d", version)
            else:
                res.dispatched = self._apply(s, now, decisions, jobs, ctx, nodes_by_pool, used, res.kinds)
                res.applied = True
        if res.applied and self.dispatch is not None:
            for job_id, attempt in res.dispatched:
                try:
                    self.dispatch(job_id, attempt)
                except Exception:  # the reconciler re-dispatches starting jobs
                    log.exception("dispatch of %s attempt %d failed; the reconciler will retry", job_id, attempt)
        res.total_s = time.perf_counter() - t0
        return res

    # ------------------------------------------------------------------ intake
    def intake(self, now: datetime) -> int:
        """Step 1 (see module docstring). Returns how many jobs changed state."""
        n = 0
        with self.store.session() as s:
            rows = s.execute(select(Job).where(or_(
                Job.state == S.submitted.value,
                (Job.state == S.deferred.value) & (Job.not_before <= now),
                (Job.state.in_([S.queued.value, S.deferred.value])) & (Job.not_after < now),
            ))).scalars().all()
            for j in rows:
                if j.state in (S.queued.value, S.deferred.value) and j.not_after is not None and j.not_after < now:
                    n += JobStore.cas(s, j.id, j.version, j.state, S.failed.value,
                                      f"start window closed at {j.not_after.isoformat()} before the job could start",
                                      now, finished_at=now)
                elif j.state == S.deferred.value:
                    n += JobStore.cas(s, j.id, j.version, j.state, S.queued.value,
                                      f"window opened at {j.not_before.isoformat()}", now)
                else:
                    n += self._accept(s, j, now)
        return n

    def _accept(self, s, j: Job, now: datetime) -> bool:
        spec = j.spec
        start = j.not_before
        reason = "accepted"
        if spec.get("window", "planner") in ("cheapest", "cleanest"):
            chosen, why = self._best_window(j, now)
            if chosen is not None:
                start = chosen
                reason = why
        if start is not None and start > now:
            return JobStore.cas(s, j.id, j.version, j.state, S.deferred.value,
                                reason if reason != "accepted" else f"waiting for its window to open at {start.isoformat()}",
                                now, not_before=start)
        return JobStore.cas(s, j.id, j.version, j.state, S.queued.value, reason, now)

    def _best_window(self, j: Job, now: datetime) -> tuple[datetime | None, str]:
        """Cheapest/cleanest start in the job's window on the first pool that can hold it."""
        from broker.windows import best_start

        spec = JobSpec.model_validate(j.spec)
        types = {self.canon(t) for t in spec.gpu_types}
        pool = None
        gpu_type = None
        for p in self.env.site_pools.values():
            for nd in p.nodes:
                t = self.canon(nd.gpu_type)
                if not types or t in types:
                    pool, gpu_type = p, t
                    break
            if pool is not None:
                break
        if pool is None or gpu_type not in self.env.gpus.throughput:
            return None, ""
        runtime = spec.estimated_duration_s / self.env.gpus.throughput[gpu_type]
        earliest = max(now, spec.earliest_start or now).timestamp()
        latest = j.deadline.timestamp() - runtime
        if j.not_after is not None:
            latest = min(latest, j.not_after.timestamp())
        if latest < earliest:
            return None, ""
        from broker.live import ReplayedSignals

        sig = ReplayedSignals(self.env.base_signals, self.env.offset_for(now.timestamp()))
        kw = spec.total_gpus * self.env.gpus.busy_kw[gpu_type] * pool.pue
        choice = best_start(earliest_s=earliest, latest_start_s=latest, runtime_s=runtime, power_kw=kw,
                            price=sig.price(pool.price_zone), carbon=sig.carbon(pool.carbon_zone),
                            prefer=spec.window, slot_s=self.env.planner.slot_s)
        return _dt(choice.start_s), (f"{spec.window} window on pool {pool.name}: {choice.reason} "
                                     f"(electricity ${choice.cost_usd:.4f}, {choice.carbon_kg:.4f} kgCO2e over the run)")

    # ------------------------------------------------------------------ snapshot
    def live_nodes(self, s, now: datetime) -> list[LiveNode]:
        """Nodes that heartbeated within ``node_lost_after_s`` and are not marked lost."""
        cutoff = now - timedelta(seconds=self.settings.node_lost_after_s)
        out = []
        for n in s.execute(select(Node).where(Node.state == "up", Node.last_heartbeat_at >= cutoff)).scalars():
            out.append(LiveNode(n.name, n.pool, self.canon(n.gpu_type), n.gpu_count, n.gpu_memory_gb,
                                tuple(sorted(n.healthy_gpus))))
        return out

    def _read(self, s, now: datetime):
        now_s = now.timestamp()
        self._now_s = now_s
        nodes = self.live_nodes(s, now)
        pools = self.env.pools_for(nodes)
        waiting = s.execute(select(Job).where(Job.state == S.queued.value)
                            .order_by(Job.priority.desc(), Job.created_at, Job.id)).scalars().all()
        if not waiting:
            return None
        ctx = self.env.context(pools, now_s)
        pool_index = {p.name: i for i, p in enumerate(pools)}
        node_pos = {(p.name, nd.name): k for p in pools for k, nd in enumerate(p.nodes)}
        live = {n.name: n for n in nodes}
        # GPUs held by active attempts, per node: set of GPU indices
        used: dict[str, set[int]] = defaultdict(set)
        running: list[RunningJob] = []
        active = s.execute(select(Job).where(Job.state.in_([S.starting.value, S.running.value, S.provisioning.value]))
                           ).scalars().all()
        for j in active:
            pl = j.placement or {}
            if pl.get("kind") != "onprem":
                continue
            alloc = []
            for part in pl.get("nodes", []):
                used[part["node"]].update(part["gpus"])
                k = node_pos.get((pl.get("pool"), part["node"]))
                if k is not None:
                    alloc.append((k, len(part["gpus"])))
            p = pool_index.get(pl.get("pool"))
            if p is None or not alloc:
                continue
            gtype = pools[p].nodes[alloc[0][0]].gpu_type
            started = _ts(j.started_at) or _ts(j.dispatched_at) or now_s
            work = max(float(j.spec["estimated_duration_s"]) - float(j.work_done_s or 0.0), 1.0)
            running.append(RunningJob(
                job_id=j.id, pool=p, allocation=alloc,
                expected_end_s=max(started + work / ctx.gpus.throughput.get(gtype, 1.0), now_s + 1.0),
                started_s=started, priority=j.priority,
                preemptible=bool(j.spec.get("preemptible", False)) and j.stop_reason is None and not j.cancel_requested,
                team=j.team, checkpoint_interval_s=float(j.spec.get("checkpoint_interval_s") or 1800.0),
                checkpointable=bool(j.spec.get("checkpointable", True))))
        free = []
        for p in pools:
            arr = np.zeros(len(p.nodes), dtype=np.int64)
            for k, nd in enumerate(p.nodes):
                arr[k] = len(set(live[nd.name].healthy) - used[nd.name])
            free.append(arr)
        pending: list[PendingJob] = []
        queued: dict[tuple[int, str], list[PendingJob]] = defaultdict(list)
        jobs: dict[str, Job] = {}
        self._tag_only = tag_only = set()
        for j in waiting:
            pj = pending_job(j, pool_index, self.canon)
            if self.cloud is not None and not _DIGEST_RE.search(str(j.spec.get("image", ""))):
                pj.regions = frozenset()  # cloud launches need the image pinned by digest: no cloud offer fits
                tag_only.add(j.id)
            jobs[j.id] = j
            if pj.committed_pool is not None and pj.review_s > now_s:
                queued[(pj.priority, pj.team)].append(pj)
            else:
                pj.committed_pool = None
                pending.append(pj)
        # fair share: decayed GPU-hours of attempts in the last 8 half-lives
        since = now - timedelta(seconds=8 * FAIR_SHARE_HALF_LIFE_S)
        rows = s.execute(select(Job.team, Attempt.gpus, Attempt.started_at, Attempt.ended_at)
                         .join(Job, Job.id == Attempt.job_id)
                         .where(Attempt.started_at.is_not(None), or_(Attempt.ended_at.is_(None), Attempt.ended_at >= since))
                         ).all()
        usage = decayed_usage([(r[0], r[1], r[2].timestamp(), _ts(r[3]) if r[3] else math.nan) for r in rows], now_s)
        avail = np.array(self.env.offer_provisionable(), dtype=bool) if ctx.offers else None
        if avail is not None and self.cloud is not None:
            cooling = self.cloud.cooling_offers(s, now)  # no capacity / quota just now: not again for a while
            if cooling:
                avail &= np.array([o.offer_id not in cooling for o in ctx.offers], dtype=bool)
        self._pending_by_id = {pj.job_id: pj for pj in pending}
        for group in queued.values():
            for pj in group:
                self._pending_by_id[pj.job_id] = pj
        snap = Snapshot(now_s=now_s, pending=pending, free=free, running=running, queued=dict(queued),
                        offer_available=avail, team_usage=usage,
                        healthy=[None] * len(pools))
        nodes_by_pool = {p.name: [(nd.name, live[nd.name]) for nd in p.nodes] for p in pools}
        return snap, ctx, jobs, nodes_by_pool, used

    def _tag_note(self, job_id: str) -> str:
        """Why a job got no cloud offer, when its image is not pinned by digest."""
        if job_id not in getattr(self, "_tag_only", ()):
            return ""
        return ("; cloud offers were not considered: cloud launches need the image pinned by digest "
                "(image: repo@sha256:<64 hex>), so all ranks of a gang run the same bits")

    def _unprovisionable_cloud(self, ctx, j: Job, pj: PendingJob | None, k: int = 3) -> list[dict]:
        """The ``k`` best cloud offers for the job, costed from now, as infeasible explain alternatives
        (their provider is not configured): what bursting would have cost, in $, kWh, kgCO2e and wait."""
        if pj is None or not ctx.offers:
            return []
        idx = ctx.compatible_offers(pj)
        if idx.size == 0:
            return []
        now_s = self._now_s
        runtime, finish, dollars, energy, carbon, _ = ctx.cloud_estimates(pj, idx, now_s)
        score = dollars + ctx.config.carbon_price_usd_per_tonne / 1000.0 * carbon
        score = np.where(np.isnan(score), np.inf, score)
        out = []
        for i in np.argsort(score, kind="stable")[:k]:
            if not np.isfinite(score[i]):
                break
            o = ctx.offers[int(idx[i])]
            delay = float(finish[i] - runtime[i])
            out.append({"kind": "cloud", "target": o.offer_id, "start_s": now_s + delay, "wait_s": delay,
                        "runtime_s": float(runtime[i]), "dollars_usd": float(dollars[i]), "energy_kwh": float(energy[i]),
                        "carbon_kg": float(carbon[i]), "score": None, "feasible": False,
                        "note": f"not provisionable: provider {o.provider!r} is not configured (cloud_providers)"})
        return out

    # ------------------------------------------------------------------ apply
    def _apply(self, s, now: datetime, decisions, jobs: dict[str, Job], ctx, nodes_by_pool, used, kinds) -> list:
        st = self.settings
        dispatched = []
        pending_by_id = self._pending_by_id
        for d in decisions:
            j = jobs.get(d.job_id)
            if j is None:
                continue
            kind = d.kind
            kinds[kind.value] = kinds.get(kind.value, 0) + 1
            rec = d.record()
            if kind != DecisionKind.provision and not any(a["kind"] == "cloud" for a in rec["alternatives"]):
                rec["alternatives"].extend(self._unprovisionable_cloud(ctx, j, pending_by_id.get(j.id)))
            rec = json_safe(rec)
            if kind == DecisionKind.preempt:
                for vid in d.victims:
                    v = s.get(Job, vid)
                    if v is not None and v.state in (S.starting.value, S.running.value) and v.stop_reason is None:
                        JobStore.bump(s, v.id, v.version, now, stop_reason="preempt",
                                      reason=f"preemption requested for higher-priority job {d.job_id}")
                        s.add(JobEvent(job_id=v.id, at=now, from_state=v.state, to_state=v.state, version=v.version + 1,
                                       reason=f"preemption requested for {d.job_id}"))
                review = now + timedelta(seconds=st.cancel_grace_s + 30.0)
                JobStore.bump(s, j.id, j.version, now, decision=rec, committed_pool=d.pool, review_at=review,
                              reason=f"preempting {', '.join(d.victims)}; starts when their GPUs are free")
            elif kind == DecisionKind.start:
                nodes = nodes_by_pool[d.pool]
                parts = []
                ok = True
                for rank, (k, g) in enumerate(d.allocation):
                    name, ln = nodes[k]
                    freeg = sorted(set(ln.healthy) - used[name])
                    if len(freeg) < g:
                        ok = False
                        break
                    pick = freeg[:g]
                    used[name].update(pick)
                    parts.append({"node": name, "gpus": pick, "rank": rank})
                if not ok:
                    log.error("planner placed %s on more GPUs than free; left queued", d.job_id)
                    continue
                attempt = j.attempt + 1
                gtype = nodes[d.allocation[0][0]][1].gpu_type
                placement = {"kind": "onprem", "pool": d.pool, "gpu_type": gtype, "nodes": parts}
                where = ", ".join(f"{p['node']} GPUs {p['gpus']}" for p in parts)
                if JobStore.cas(s, j.id, j.version, S.queued.value, S.starting.value,
                                f"placed on pool {d.pool}: {where} (attempt {attempt})", now,
                                placement=placement, attempt=attempt, decision=rec, dispatched_at=now,
                                state_deadline_at=now + timedelta(seconds=st.starting_deadline_s),
                                committed_pool=None, review_at=None):
                    s.add(Attempt(job_id=j.id, number=attempt, kind="onprem", pool=d.pool, offer_id=None, nodes=parts,
                                  gpu_type=gtype, gpus=sum(len(p["gpus"]) for p in parts), created_at=now,
                                  rank_exits={}, reason=""))
            elif kind == DecisionKind.provision:
                offer = ctx.offers[d.offer_index]
                attempt = j.attempt + 1
                if JobStore.cas(s, j.id, j.version, S.queued.value, S.provisioning.value,
                                f"provisioning {offer.offer_id} (attempt {attempt})", now,
                                placement={"kind": "cloud", "offer_id": offer.offer_id, "provider": offer.provider,
                                           "region": offer.region, "zone": offer.zone, "gpu_type": offer.gpu_type,
                                           "instance_type": offer.instance_type, "market": offer.market.value},
                                attempt=attempt, decision=rec, dispatched_at=now, committed_pool=None, review_at=None,
                                state_deadline_at=now + timedelta(seconds=st.provisioning_deadline_s)):
                    dispatched.append((j.id, attempt))  # the dispatch task hands it to provisioning
            elif kind == DecisionKind.defer:
                o = d.option
                why = (f"deferred to a cheaper/cleaner window on pool {d.pool} starting {_dt(d.not_before).isoformat()}"
                       + (f" (${o.dollars_usd:.4f}, {o.carbon_kg:.4f} kgCO2e)" if o is not None else ""))
                JobStore.cas(s, j.id, j.version, S.queued.value, S.deferred.value, why, now,
                             not_before=_dt(d.not_before), deferred_once=True, decision=rec, committed_pool=None,
                             review_at=None)
            elif kind == DecisionKind.wait:
                review = _dt(d.not_before) if d.not_before is not None and math.isfinite(d.not_before) else None
                o = d.option
                why = (f"waiting for {j.spec['gpus_per_node'] * j.spec['nodes']} GPU(s) in pool {d.pool}"
                       + (f"; expected wait {o.wait_s / 60:.0f} min" if o is not None else "")
                       + (f"; options reviewed again at {review.isoformat(timespec='seconds')}" if review else ""))
                JobStore.bump(s, j.id, j.version, now, committed_pool=d.pool, review_at=review, decision=rec,
                              reason=why)
            elif kind == DecisionKind.reject:
                why = d.reason or "no pool or offer can hold it"
                if self._tag_note(j.id):  # cloud offers were left out, not found wanting
                    why = why.replace("no on-prem pool and no cloud offer can", "no on-prem pool can") + self._tag_note(j.id)
                    rec["reason"] = why
                JobStore.cas(s, j.id, j.version, S.queued.value, S.failed.value, why, now, decision=rec,
                             finished_at=now)
        # jobs the planner left without a decision (nothing can hold them now): say why
        decided = {d.job_id for d in decisions}
        for jid, j in jobs.items():
            if jid in decided or j.committed_pool is not None:
                continue
            why = ("no live pool can hold it now and no cloud provider is configured; "
                   "waiting for a node that fits (gpus_per_node, nodes, gpu_types, min_gpu_memory_gb)")
            if self.cloud is not None:
                why = ("no live pool can hold it now and no cloud offer is available (cooling down after a failure, "
                       "or none fits); waiting for a node or an offer that fits" + self._tag_note(jid))
            if j.reason != why:
                JobStore.bump(s, j.id, j.version, now, reason=why)
        return dispatched
