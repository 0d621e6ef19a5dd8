"""Pools of an existing scheduler (issue #14): the live broker's side of :mod:`providers.slurm` (and of any kind
in :data:`providers.registry.POOL_KINDS`).

A pool of the cluster file with ``kind: slurm`` is a cluster the broker does not run itself: it reads it, submits
to it, follows its jobs and stops them, through the kind's adapter (``SlurmPool``). :class:`SchedulerPools` is the
one object the service holds for all such pools:

* :meth:`SchedulerPools.read` — the planner's inputs from each cluster, once per planning cycle
  (:class:`PoolView`): its nodes now (free GPUs per node by GPU type, ``capacity()``), when its running jobs'
  GPUs come back at the latest (``release_profile()``, their time limits) and the cluster's own queue ahead
  (``pending_work()``: GPUs and GPU-seconds of pending jobs that are not the broker's). The planning cycle
  (:mod:`broker.service.cycle`) turns them into the planner's pure :class:`~broker.planner.core.Snapshot`: the
  nodes as pool nodes, each release as a running job holding those GPUs, the queue ahead as demand committed to
  the pool. The planner sees the pool like any other.
* :meth:`SchedulerPools.submit` — after the cycle placed a job there (``queued -> starting``, attempt
  ``kind="slurm"``): one ``sbatch`` (or ``POST job/submit``) with the job's launch environment
  (:func:`providers.launch.scheduler_environment`); the Slurm job id is kept on the attempt
  (``attempts.external_id``). A request the cluster refuses for good (no such GRES, over a partition limit)
  requeues the attempt (counted against ``max_attempts``); a cluster that does not answer leaves it ``starting``
  and :meth:`watch` submits again after ``dispatch_retry_s``.
* :meth:`SchedulerPools.watch` — each reconciler pass, per pool: **one** ``poll()`` (``scontrol -o show job`` or
  ``GET jobs``) for every tracked job, then each job through :mod:`broker.service.lifecycle`:
  running -> :func:`~broker.service.lifecycle.mark_running`; ended -> :func:`~broker.service.lifecycle.
  scheduler_ended` (succeeded, failed with the exit code and reason, cancelled by the cluster's admin: failed
  with the reason, node failure/preemption: requeued), the ledger meters it there (elapsed and ``ConsumedEnergy``
  from the adapter, kept on the attempt's ``meter["scheduler"]``; the tail of each output file is kept as the
  attempt's log of its node rank where the broker's host can read ``log_dir``, and output files older than
  ``retention_days`` are removed hourly); cancel requested -> ``cancel()`` (SIGTERM,
  then kill after ``term_grace_s``); still pending in the cluster past ``starting_deadline_s`` -> cancelled there
  and requeued; a job Slurm requeued itself is cancelled there (the broker requeues, not Slurm). Then the
  **sweep**: jobs tagged with this broker's id whose ``(job, attempt)`` is not a live attempt are cancelled (the
  poll is read before the store, so a job submitted meanwhile is never swept).
* :meth:`SchedulerPools.status` / :func:`pools_status` — ``fedbroker pools``: each pool's kind, health, free GPUs
  by type (agent pools from the store's nodes, scheduler pools from their clusters), the GPUs the planner leaves
  out (``not_planned``); :class:`PoolNotes` gives ``/healthz`` the same for the pools with something to say.

A pool whose submit account is privileged (``SlurmPool.submit_account``: root, ``SlurmUser``) sits out of
planning with the refusal as its health. Why a pool or its GPUs are left out is logged once, not every cycle.

Adapter calls happen outside database transactions; state moves are compare-and-sets in short ones.
Errors of a cluster (:class:`providers.base.SchedulerUnavailable` and the rest) never stop a cycle or a pass:
the pool is left out of that cycle (its view carries the error) and its jobs are looked at again next pass.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable, Mapping

from broker.model import JobSpec, Pool
from broker.service import lifecycle
from broker.service.live import LiveNode
from broker.service.store import attempts as repo
from broker.service.store.core import JobStore
from broker.service.store.tables import utcnow
from broker.states import ON_NODE_STATES, JobState
from providers.base import MANAGED_TAG, ProviderError, QuotaExceeded, Unsupported
from providers.launch import DEFAULT_CHECKPOINT_ROOT, launch_spec, scheduler_environment
from providers.registry import build_pool, pool_kind

__all__ = ["PoolView", "SchedulerPools", "LIVE_NODE_STATES", "pools_status", "PoolNotes"]

log = logging.getLogger("fedbroker.schedulers")
S = JobState
#: node states (Slurm's long state, no flag) of a node that runs or can run jobs: its GPUs count in the pool;
#: others (down, drained, a flag such as ``*`` not responding) are left out of the pool, like a lost agent node
LIVE_NODE_STATES = frozenset({"idle", "mixed", "allocated", "completing"})
#: characters of a log the adapter serves (``logs()``) kept as the attempt's log (as :data:`providers.launch.
#: LOG_TAIL_BYTES` of an output file)
LOG_TAIL_CHARS = 65536
#: the most GPUs a pool node holds (``broker.model.PoolNode.gpu_count``'s bound)
MAX_GPUS_PER_NODE = 16
#: how often a pool's ``log_dir`` is swept for output files past retention (:meth:`SchedulerPools.purge_logs`)
LOG_PURGE_EVERY = timedelta(hours=1)


@dataclass
class PoolView:
    """One scheduler pool as a planning cycle sees it (:meth:`SchedulerPools.read`).

    ``nodes``: planner nodes (``LiveNode``; name ``<pool>/<node>``, plus ``/<GRES type>`` on a node with several
    GPU types; GPU type canonical, ``healthy`` = ``range(free GPUs)``); ``gres``: planner node name -> the
    cluster's own GPU type name (what ``--gpus-per-node`` takes); ``releases``: ``(end POSIX s, canonical GPU
    type, GPUs)`` of the running jobs (time limits); ``backlog_gpus``/``backlog_gpu_s``: the cluster's own pending
    jobs (GPUs, GPU-seconds at their time limits); ``skipped``: why GPUs were left out (a GPU type
    with no power/throughput model, a node with more GPUs of a type than a pool node holds); ``error``: why the
    cluster could not be read (then nothing else is set).
    """

    name: str
    kind: str
    nodes: list[LiveNode] = field(default_factory=list)
    gres: dict[str, str] = field(default_factory=dict)
    releases: list[tuple[float, str, int]] = field(default_factory=list)
    backlog_gpus: float = 0.0
    backlog_gpu_s: float = 0.0
    skipped: list[str] = field(default_factory=list)
    error: str | None = None


class SchedulerPools:
    """The pools of ``pools`` whose kind is an existing scheduler (see the module docstring).

    Args:
        pools: the cluster file's pools (agent pools are ignored).
        settings: :class:`broker.service.settings.BrokerSettings` (``starting_deadline_s``, ``dispatch_retry_s``,
            ``max_attempts``).
        adapters: pool name -> adapter, instead of building them from the pools' sections (tests).
        canon: GPU type name -> the power table's canonical name (default :func:`pricing.power.canonical_or_same`).
    """

    def __init__(self, pools: Iterable[Pool], settings, adapters: Mapping[str, Any] | None = None,
                 canon: Callable[[str], str] | None = None):
        from pricing.power import canonical_or_same

        self.pools: dict[str, Pool] = {p.name: p for p in pools if p.external}
        self.settings = settings
        self._adapters: dict[str, Any] = dict(adapters or {})
        self.canon = canon or canonical_or_same
        self._reported: set[tuple[str, str]] = set()  # (pool, why GPUs are left out) logged already
        self._errors: dict[str, str] = {}  # pool -> why it could not be read last cycle (logged once)
        self._logs_purged_at: dict[str, datetime] = {}  # pool -> last purge of its log_dir (LOG_PURGE_EVERY)

    def __bool__(self) -> bool:
        return bool(self.pools)

    @property
    def kinds(self) -> set[str]:
        """The pool kinds present (placement kinds of the jobs placed on these pools)."""
        return {p.kind for p in self.pools.values()}

    def adapter(self, name: str) -> Any:
        """Pool ``name``'s adapter, built on first use from its section (:func:`providers.registry.build_pool`)."""
        if name not in self._adapters:
            p = self.pools[name]
            self._adapters[name] = build_pool(p.kind, p.scheduler, f"pool {name!r}.{p.kind}")
        return self._adapters[name]

    # ------------------------------------------------------------------ planning inputs
    def read(self) -> dict[str, PoolView]:
        """Pool name -> :class:`PoolView` for every pool (three requests each: capacity, release profile and
        queue ahead). A cluster that cannot be read gives a view with ``error`` set and no nodes (logged)."""
        return {name: self._read_one(name) for name in self.pools}

    def _read_one(self, name: str) -> PoolView:
        pool = self.pools[name]
        view = PoolView(name, pool.kind)
        try:
            ad = self.adapter(name)
            caps = ad.capacity()
            if hasattr(ad, "prepare_directories"):  # jobs that would run privileged or log where others read: the
                ad.prepare_directories()  # pool sits out (its health says why)
            releases = ad.release_profile()
            pending = ad.pending_work() if hasattr(ad, "pending_work") else {
                t: (g, 0.0) for t, g in ad.backlog().items()}
        except Exception as e:  # noqa: BLE001 - a cluster never stops a cycle: the pool sits this one out
            view.error = f"{type(e).__name__}: {e}"
            if self._errors.get(name) != view.error:  # once per new error, not every cycle
                log.warning("pool %s (%s) left out of planning: %s", name, pool.kind, view.error)
            self._errors[name] = view.error
            return view
        if self._errors.pop(name, None) is not None:
            log.warning("pool %s (%s) is back in planning", name, pool.kind)
        view.nodes, view.gres, view.skipped = self.plan_nodes(name, caps)
        self._report_skipped(name, view.skipped)
        view.releases = [(end.timestamp(), self.gpu_type(name, t), int(g)) for end, t, g in releases]
        view.backlog_gpus = float(sum(g for g, _ in pending.values()))
        view.backlog_gpu_s = float(sum(gs for _, gs in pending.values()))
        return view

    def gpu_type(self, name: str, gres: str) -> str:
        """The planner's (canonical) GPU type of pool ``name``'s GRES type ``gres``: the pool's ``gres_types``
        mapping first (``{gpu: A100}`` for an untyped ``gpu:N``), then :attr:`canon`."""
        mapping = getattr(getattr(self.adapter(name), "settings", None), "gres_types", None) or {}
        return self.canon(mapping.get(gres, gres))

    def plan_nodes(self, name: str, caps: Iterable) -> tuple[list[LiveNode], dict[str, str], list[str]]:
        """``(nodes, gres, skipped)`` of :class:`PoolView` from pool ``name``'s ``capacity()``: the planner's nodes
        of the live nodes, planner node -> GRES type, and why GPUs were left out (each reason once)."""
        from pricing.power import gpu_spec

        nodes: list[LiveNode] = []
        gres: dict[str, str] = {}
        skipped: list[str] = []
        for n in caps:
            if n.state not in LIVE_NODE_STATES:
                continue
            types = [t for t, c in sorted(n.gpus_total.items()) if c > 0]
            for t in types:
                if n.gpus_total[t] > MAX_GPUS_PER_NODE:
                    skipped.append(f"{n.node}: {n.gpus_total[t]} x {t} (a pool node holds at most "
                                   f"{MAX_GPUS_PER_NODE} GPUs)")
                    continue
                canon = self.gpu_type(name, t)
                try:
                    mem = gpu_spec(canon).memory_gb
                except ValueError:
                    hint = (f"gres_types maps it to {canon!r}" if canon != self.canon(t)
                            else "map it to one in the pool's gres_types, e.g. {gpu: A100}")
                    why = f"GPU type {t!r}: no power or throughput model (pricing.power; {hint})"
                    if why not in skipped:
                        skipped.append(why)
                    continue
                node = f"{name}/{n.node}" + (f"/{t}" if len(types) > 1 else "")
                nodes.append(LiveNode(node, name, canon, int(n.gpus_total[t]), float(mem),
                                      tuple(range(n.gpus_free(t)))))
                gres[node] = t
        return nodes, gres, skipped

    def _report_skipped(self, name: str, skipped: list[str]) -> None:
        """Log each reason GPUs of pool ``name`` are left out of planning once per process (not every cycle);
        ``fedbroker pools`` and ``/healthz`` show them while they hold (:meth:`status`)."""
        new = [why for why in skipped if (name, why) not in self._reported]
        if new:
            self._reported.update((name, why) for why in new)
            log.warning("pool %s: GPUs left out of planning: %s", name, "; ".join(new))

    # ------------------------------------------------------------------ submit
    def request(self, j, spec: JobSpec, attempt: int) -> Any:
        """The adapter's job request for stored job ``j`` (its ``placement`` on one of these pools) and
        ``attempt``: the command as one shell line (``shlex.join``), the pool's GPU type name, the remaining work
        at the GPU type's speed (s), the job's deadline, its priority class, and its launch environment
        (:func:`providers.launch.scheduler_environment`). Only the fields the kind's request class has are given."""
        from pricing.power import gpu_spec

        pl = j.placement or {}
        work = max(float(spec.estimated_duration_s) - float(j.work_done_s or 0.0), 1.0)
        try:
            speed = gpu_spec(self.canon(pl.get("gpu_type", ""))).rel_throughput
        except ValueError:
            speed = 1.0
        pool_root = getattr(getattr(self.adapter(pl["pool"]), "settings", None), "checkpoint_root", None)
        ls = launch_spec(spec, j.id, attempt, 0, spec.nodes, "localhost",
                         checkpoint_root=pool_root or self.settings_value("checkpoint_root", DEFAULT_CHECKPOINT_ROOT))
        kw = dict(job_id=j.id, attempt=attempt, team=j.team, command=shlex.join(spec.command),
                  gpu_type=pl.get("scheduler_gpu_type") or pl.get("gpu_type"), gpus_per_node=spec.gpus_per_node,
                  nodes=spec.nodes, estimate_s=work / max(speed, 1e-9), deadline=j.deadline,
                  env=scheduler_environment(ls), priority_class=spec.priority_class.value, image=spec.image,
                  time_limit_s=spec.time_limit_s)
        cls = pool_kind(self.pools[pl["pool"]].kind).load("request")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in names})

    def settings_value(self, name: str, default: Any) -> Any:
        """``settings.<name>`` or ``default`` when the settings have none."""
        return getattr(self.settings, name, default) or default

    def submit(self, store: JobStore, job_id: str, attempt: int) -> str:
        """Submit attempt ``attempt`` of ``job_id`` (``starting`` on one of these pools, not yet submitted) to its
        cluster and keep the cluster's job id on the attempt. Returns what happened: ``"submitted <id>"``,
        ``"stale"`` (not that attempt, not ``starting``, or already submitted), ``"requeued"`` (the cluster refused
        it for good: :class:`providers.base.Unsupported` / :class:`providers.base.QuotaExceeded`) or
        ``"error: ..."`` (the cluster did not answer: left ``starting``, :meth:`watch` tries again)."""
        with store.session() as s:
            j = repo.job_row(s, job_id)
            att = repo.attempt_row(s, job_id, attempt)
            if (j is None or att is None or j.attempt != attempt or j.state != S.starting.value
                    or att.external_id is not None or (j.placement or {}).get("pool") not in self.pools):
                return "stale"
            spec = JobSpec.model_validate(j.spec)
            pool = j.placement["pool"]
            try:
                req = self.request(j, spec, attempt)
            except ValueError as e:
                lifecycle.requeue_lost(s, j, utcnow(), f"could not build the {self.pools[pool].kind} request: {e}",
                                       "launch_failed", max_attempts=self.settings.max_attempts)
                return "requeued"
        try:
            info = self.adapter(pool).submit(req)
        except (Unsupported, QuotaExceeded) as e:
            with store.session() as s:
                j = repo.job_row(s, job_id)
                if j is not None and j.attempt == attempt and j.state == S.starting.value:
                    lifecycle.requeue_lost(s, j, utcnow(), f"pool {pool} refused it: {e}", "launch_failed",
                                           max_attempts=self.settings.max_attempts)
            return "requeued"
        except ProviderError as e:
            log.warning("submit of %s attempt %d to pool %s failed (%s); the reconciler tries again", job_id,
                        attempt, pool, e)
            return f"error: {e}"
        self._adopt(store, job_id, attempt, info.pool_job_id, pool)
        return f"submitted {info.pool_job_id}"

    def _adopt(self, store: JobStore, job_id: str, attempt: int, external_id: str, pool: str) -> None:
        now = utcnow()
        with store.session() as s:
            if repo.set_external_id(s, job_id, attempt, external_id):
                j = repo.job_row(s, job_id)
                if j is not None and j.attempt == attempt:
                    repo.bump_with_event(s, j, now, f"submitted to {self.pools[pool].kind} pool {pool} as job "
                                         f"{external_id} (attempt {attempt})")

    # ------------------------------------------------------------------ watch
    def watch(self, store: JobStore, now: datetime | None = None) -> dict:
        """One pass over every pool (the module docstring). Returns counts: ``polled`` (tracked jobs),
        ``running``, ``ended``, ``requeued``, ``cancelled``, ``swept``, ``resubmitted``, ``changed`` (jobs whose
        state moved) and ``errors`` (pool -> why it could not be polled)."""
        now = now or utcnow()
        out: dict[str, Any] = {"polled": 0, "running": 0, "ended": 0, "requeued": 0, "cancelled": 0, "swept": 0,
                               "resubmitted": 0, "changed": 0, "logs_removed": 0, "errors": {}}
        for name in self.pools:
            try:
                self._watch_pool(store, name, now, out)
            except Exception as e:  # noqa: BLE001 - one cluster's outage leaves the other pools' watch alone
                out["errors"][name] = f"{type(e).__name__}: {e}"
                log.warning("pool %s: watch skipped this pass: %s", name, e, exc_info=not isinstance(e, ProviderError))
            out["logs_removed"] += self.purge_logs(name, now)
        return out

    def purge_logs(self, name: str, now: datetime) -> int:
        """Remove pool ``name``'s job output files last written more than ``settings.retention_days`` before
        ``now`` (the adapter's ``purge_logs``; the store keeps each attempt's log for as long), at most once per
        :data:`LOG_PURGE_EVERY`; ``retention_days`` 0 keeps them. Returns how many were removed."""
        days = float(self.settings_value("retention_days", 0.0))
        last = self._logs_purged_at.get(name)
        ad = self.adapter(name)
        if days <= 0 or not hasattr(ad, "purge_logs") or (last is not None and now - last < LOG_PURGE_EVERY):
            return 0
        self._logs_purged_at[name] = now
        n = ad.purge_logs(now - timedelta(days=days))
        if n:
            log.info("pool %s: removed %d job output file(s) older than %g days", name, n, days)
        return n

    def _watch_pool(self, store: JobStore, name: str, now: datetime, out: dict) -> None:
        pool = self.pools[name]
        ad = self.adapter(name)
        infos = ad.poll()  # before the store: a job submitted after this read is live in the store already
        with store.session() as s:
            tracked = [(j.id, j.attempt, j.state, ext, bool(j.cancel_requested), j.state_deadline_at, j.dispatched_at)
                       for j, ext in repo.scheduler_attempts(s, {pool.kind}, ON_NODE_STATES)
                       if (j.placement or {}).get("pool") == name]
        live = {(jid, att) for jid, att, *_ in tracked}
        by_tag = {(i.tags.get("fedbroker-job", ""), i.tags.get("fedbroker-attempt", "")): i for i in infos.values()
                  if i.active}
        grace = getattr(ad.settings, "term_grace_s", None) if hasattr(ad, "settings") else None
        for sid, info in infos.items():  # the sweep: this broker's jobs with no live attempt
            att = info.tags.get("fedbroker-attempt", "")
            key = (info.tags.get("fedbroker-job", ""), int(att) if att.isdigit() else None)
            if info.active and info.tags.get(MANAGED_TAG) and key not in live:
                log.warning("pool %s: sweeping job %s (%s attempt %s): no live attempt has it", name, sid, *key)
                ad.cancel(sid, grace)
                out["swept"] += 1
        out["polled"] += len(tracked)
        retry = timedelta(seconds=float(self.settings_value("dispatch_retry_s", 30.0)))
        for jid, attempt, state, ext, cancel, deadline, dispatched in tracked:
            try:
                self._follow(store, name, ad, infos, by_tag, now, retry, jid, attempt, state, ext, cancel, deadline,
                             dispatched, out)
            except ProviderError as e:
                log.warning("pool %s: %s attempt %d not followed this pass: %s", name, jid, attempt, e)

    def _follow(self, store, name, ad, infos, by_tag, now, retry, jid, attempt, state, ext, cancel, deadline,
                dispatched, out) -> None:
        """One tracked job of pool ``name`` (see :meth:`watch`)."""
        pool = self.pools[name]
        if ext is None:  # not submitted, or the id was not written (a crash after sbatch): adopt or submit again
            found = by_tag.get((jid, str(attempt)))
            if found is not None:
                self._adopt(store, jid, attempt, found.pool_job_id, name)
                ext = found.pool_job_id
            elif cancel:
                with store.session() as s:
                    j = repo.job_row(s, jid)
                    if j is not None and j.attempt == attempt and j.state in ON_NODE_STATES:
                        out["cancelled"] += lifecycle.cancel_attempt(
                            s, j, now, lifecycle.Place.scheduler(f"pool {name} (not submitted)", "never submitted"))
                        out["changed"] += 1
                return
            else:
                if dispatched is None or dispatched <= now - retry:
                    with store.session() as s:
                        j = repo.job_row(s, jid)
                        if j is not None and j.attempt == attempt:
                            JobStore.bump(s, jid, j.version, now, dispatched_at=now)
                    got = self.submit(store, jid, attempt)
                    out["resubmitted"] += 1
                    out["changed"] += got == "requeued"
                return
        info = infos.get(ext)
        if info is None:
            try:
                info = ad.describe(ext)
            except ProviderError as e:
                if e.code != "NotFound":
                    raise
                info = None
        label = f"{pool.kind.capitalize()} job {ext}"
        if info is None:
            with store.session() as s:
                j = repo.job_row(s, jid)
                if j is not None and j.attempt == attempt and j.state in ON_NODE_STATES:
                    out["requeued"] += lifecycle.requeue_lost(
                        s, j, now, f"{label} in pool {name}: the cluster no longer knows it",
                        max_attempts=self.settings.max_attempts)
                    out["changed"] += 1
            return
        if cancel and info.active:
            info = ad.cancel(ext)
        elif info.state == "starting" and state == S.starting.value and deadline is not None and deadline < now:
            info = ad.cancel(ext)
            with store.session() as s:
                j = repo.job_row(s, jid)
                if j is not None and j.attempt == attempt and j.state == S.starting.value:
                    limit = self.settings.starting_deadline_s
                    out["requeued"] += lifecycle.requeue_lost(
                        s, j, now, f"{label} still pending in pool {name} after {limit:.0f} s (cancelled there)",
                        "timed_out", max_attempts=self.settings.max_attempts)
                    out["changed"] += 1
            return
        place = lifecycle.Place.scheduler(f"{label} on {info.nodes or 'no node'}",
                                          "scancel: SIGTERM, then kill after the grace" if pool.kind == "slurm"
                                          else "deleted in the cluster")
        if info.state == "running" and state == S.starting.value:
            with store.session() as s:
                j = repo.job_row(s, jid)
                if j is not None and j.attempt == attempt:
                    att = repo.attempt_row(s, jid, attempt)
                    if lifecycle.mark_running(s, j, att, now, f"running: {place.where}"):
                        out["running"] += 1
                        out["changed"] += 1
            return
        if not info.terminal:
            return
        if info.active:  # Slurm requeued it itself: the broker requeues the attempt, this copy goes
            ad.cancel(ext, 0.0)
        if hasattr(ad, "logs") and not info.stdout:  # a kind whose adapter serves the log (Kubernetes pods)
            try:
                store.append_log(jid, attempt, 0, 0, str(ad.logs(ext))[-LOG_TAIL_CHARS:])
            except Exception as e:  # noqa: BLE001 - a log the cluster no longer has is not kept
                log.info("log of %s attempt %d not kept: %s", jid, attempt, e)
        else:
            files = ad.log_files(info.stdout) if hasattr(ad, "log_files") else {0: info.stdout}
            for rank, path in files.items():  # a gang: one file per node rank (logs --rank N); -1: srun's words
                self.keep_log(store, jid, attempt, str(path) if path else None, rank=max(rank, 0),
                              seq=1 if rank < 0 else 0)
        energy = ad.consumed_energy_j(ext) if hasattr(ad, "consumed_energy_j") else None
        ran = bool(info.elapsed_s) or info.state in ("succeeded", "failed")
        for _ in range(3):
            with store.session() as s:
                j = repo.job_row(s, jid)
                att = repo.attempt_row(s, jid, attempt, lock=True)
                if j is None or att is None or j.attempt != attempt or j.state not in ON_NODE_STATES:
                    return
                att.meter = {**(att.meter or {}), "scheduler": {
                    "job_id": ext, "elapsed_s": info.elapsed_s, "consumed_energy_j": energy, "nodes": info.nodes,
                    "state": info.pool_state, "exit_code": info.exit_code, "signal": info.signal}}
                ok, outcome = lifecycle.scheduler_ended(s, j, att, now, info.state, info.exit_code, info.reason,
                                                        place, ran=ran, max_attempts=self.settings.max_attempts)
                if ok:
                    out["ended"] += 1
                    out["changed"] += 1
                    out["requeued"] += outcome == "requeued"
                    out["cancelled"] += outcome == "cancelled"
                    return

    @staticmethod
    def keep_log(store: JobStore, job_id: str, attempt: int, path: str | None, rank: int = 0, seq: int = 0) -> bool:
        """Keep the last :data:`providers.launch.LOG_TAIL_BYTES` bytes of an ended job's output file (the
        scheduler's ``StdOut``, on a file system the broker's host shares: ``log_dir``) as the attempt's log of node
        rank ``rank``, chunk ``seq`` (``fedbroker logs --rank N``), decoded as UTF-8 with replacement. Returns
        whether stored (``False``: no path, the file is empty or not readable from here, or the chunk was kept
        already)."""
        from pathlib import Path

        from providers.launch import LOG_TAIL_BYTES

        if not path:
            return False
        try:
            with Path(path).open("rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - LOG_TAIL_BYTES))
                data = f.read().decode("utf-8", errors="replace").replace("\x00", "")
        except OSError as e:
            log.info("log of %s attempt %d not kept: %s", job_id, attempt, e)
            return False
        if seq and not data:
            return False
        return store.append_log(job_id, attempt, rank, seq, data)

    # ------------------------------------------------------------------ status
    def status(self) -> list[dict]:
        """Per pool: ``name``, ``kind``, ``health`` (``"reachable"`` or the typed error, ``"SchedulerUnavailable:
        ..."``), ``free_gpus`` (GPU type -> GPUs free now), ``total_gpus`` (GPU type -> GPUs of the live nodes),
        ``nodes`` (live nodes), ``backlog_gpus`` (the cluster's own pending jobs' GPUs)."""
        out = []
        for name, pool in self.pools.items():
            row: dict[str, Any] = {"name": name, "kind": pool.kind}
            try:
                ad = self.adapter(name)
                caps = ad.capacity()
                if hasattr(ad, "prepare_directories"):
                    ad.prepare_directories(create=False)
                backlog = ad.backlog()
            except Exception as e:  # noqa: BLE001 - reported as the pool's health
                row.update(health=f"{type(e).__name__}: {e}", free_gpus={}, total_gpus={}, nodes=0, backlog_gpus=0)
                out.append(row)
                continue
            free: dict[str, int] = {}
            total: dict[str, int] = {}
            live = 0
            for n in caps:
                if n.state not in LIVE_NODE_STATES:
                    continue
                live += 1
                for t, c in n.gpus_total.items():
                    total[t] = total.get(t, 0) + c
                    free[t] = free.get(t, 0) + n.gpus_free(t)
            row.update(health="reachable", free_gpus=dict(sorted(free.items())), total_gpus=dict(sorted(total.items())),
                       nodes=live, backlog_gpus=int(sum(backlog.values())))
            skipped = self.plan_nodes(name, caps)[2]
            if skipped:  # GPUs the cluster has that the planner leaves out (an unmodelled GPU type, ...)
                row["not_planned"] = skipped
            out.append(row)
        return out


def pools_status(pools: Iterable[Pool], settings, store: JobStore | None, now: datetime | None = None,
                 schedulers: SchedulerPools | None = None) -> list[dict]:
    """``fedbroker pools``: one row per pool of ``pools`` (the cluster file), in file order, each with ``name``,
    ``kind``, ``health``, ``free_gpus`` and ``total_gpus`` (GPU type -> GPUs), ``nodes`` (live nodes).

    * an agent pool, from the store: its nodes that heartbeated within ``settings.node_lost_after_s`` and are
      not lost (``health`` ``"N of M node(s) up"``, ``"no node"`` when none registered); free = healthy GPUs less
      those held by ``starting``/``running`` jobs placed there; ``store`` ``None``: health ``"unknown (no store)"``;
    * a scheduler pool, from its cluster (:meth:`SchedulerPools.status`: ``"reachable"`` or the typed error),
      plus ``backlog_gpus``."""
    pools = list(pools)
    now = now or utcnow()
    sched = schedulers if schedulers is not None else SchedulerPools(pools, settings)
    by_name = {r["name"]: r for r in sched.status()}
    nodes = store.nodes() if store is not None else []
    held: dict[tuple[str, int], int] = {}
    if store is not None:
        for j in store.list_jobs(states=list(ON_NODE_STATES), limit=100_000):
            pl = j.placement or {}
            if pl.get("kind") == "onprem":
                for part in pl.get("nodes", []):
                    for g in part.get("gpus", []):
                        held[(part["node"], g)] = 1
    cutoff = now - timedelta(seconds=float(settings.node_lost_after_s))
    out = []
    for p in pools:
        if p.external:
            out.append(by_name[p.name])
            continue
        mine = [n for n in nodes if n.pool == p.name]
        up = [n for n in mine if n.state == "up" and n.last_heartbeat_at >= cutoff]
        free: dict[str, int] = {}
        total: dict[str, int] = {}
        for n in up:
            total[n.gpu_type] = total.get(n.gpu_type, 0) + n.gpu_count
            free[n.gpu_type] = free.get(n.gpu_type, 0) + sum(1 for g in n.healthy_gpus if (n.name, g) not in held)
        health = ("unknown (no store)" if store is None else "no node" if not mine
                  else f"{len(up)} of {len(mine)} node(s) up")
        out.append({"name": p.name, "kind": p.kind, "health": health, "free_gpus": dict(sorted(free.items())),
                    "total_gpus": dict(sorted(total.items())), "nodes": len(up)})
    return out


class PoolNotes:
    """What ``/healthz`` says about the scheduler pools: pool name -> ``{"health": ..., "not_planned": [...]}`` for
    each pool that is not reachable or has GPUs the planner leaves out (:meth:`SchedulerPools.status`); ``{}`` when
    all is well or the cluster file has no scheduler pool.

    A call never waits for a cluster: it answers the last reading and, when that is older than ``max_age_s``
    (60 s) or there is none yet, starts one reading in a background thread (a cluster's client may take its
    ``timeout_s`` to fail). ``pools``: the cluster file's pools (``None``: loaded from ``settings.cluster`` on the
    first reading; a file that cannot be loaded gives ``{}``)."""

    def __init__(self, settings, pools: Iterable[Pool] | None = None, max_age_s: float = 60.0):
        import threading

        self.settings = settings
        self._pools = list(pools) if pools is not None else None
        self.max_age_s = max_age_s
        self._notes: dict[str, dict] = {}
        self._read_at: float | None = None
        self._busy = threading.Lock()

    def __call__(self) -> dict[str, dict]:
        import threading
        import time

        stale = self._read_at is None or time.monotonic() - self._read_at >= self.max_age_s
        if stale and self._busy.acquire(blocking=False):
            threading.Thread(target=self._refresh, name="fedbroker-pool-notes", daemon=True).start()
        return dict(self._notes)

    def _refresh(self) -> None:
        import time

        try:
            if self._pools is None:
                from broker.cluster import load_cluster
                from broker.service.live import LIVE_CLUSTER_PATH

                self._pools = load_cluster(self.settings.cluster or LIVE_CLUSTER_PATH)
            sched = SchedulerPools(self._pools, self.settings)
            notes = {}
            for row in sched.status() if sched else []:
                if row["health"] != "reachable" or row.get("not_planned"):
                    notes[row["name"]] = {"health": row["health"], "not_planned": row.get("not_planned", [])}
            self._notes = notes
        except Exception as e:  # noqa: BLE001 - /healthz reports the pools, it never fails on them
            log.info("pool notes for /healthz not read: %s", e)
        finally:
            self._read_at = time.monotonic()
            self._busy.release()
