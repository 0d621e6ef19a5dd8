"""Submit-time truth about what the broker can hold (issue #20): a job no known node can ever hold is refused,
an infeasible deadline is warned about, and a job running past its deadline is flagged.

**What "known" means.** The live broker's on-prem capacity is the hosts whose node agents have registered in the
job store (every node row, whatever its state: a lost node may come back) in a pool of the cluster file
(``settings.cluster``; the file's own node lists only document the expected hosts, :mod:`broker.service.live`).
A scheduler pool (``kind: slurm|kubernetes``) shows its nodes only to the planning cycle, and cloud offers
(``settings.cloud_providers``) are many and change, so either may still hold a job no registered node can.

**Refused at submit** (422 naming the field, :func:`never_fits`): only when the broker knows its whole capacity —
no cloud provider configured, no scheduler pool in the cluster file, at least one agent node registered — and no
registered node (or set of ``nodes`` nodes of one pool and one GPU type: the gang rule) has ``gpus_per_node``
GPUs of an allowed type with ``min_gpu_memory_gb``. Before any node has registered, or when pools may grow that
way, the job is accepted and its answer says so (:func:`job_warnings`).

**Deadline warnings** (:func:`job_warnings`, :func:`deadline_flags`): the shortest run the job can have is its
``estimated_duration_s`` (on the reference V100) divided by the best relative throughput
(:data:`pricing.power.GPU_SPECS`) among the registered nodes that can hold it (or, with none known, among its
allowed GPU types, all types when it allows any), plus, when only the cloud can hold it, the shortest provisioning
delay (:data:`pricing.catalog.PROVISIONING_DELAY_S`). The deadline cannot be met when that run is longer than
``deadline - max(now, not_before)``. A job ``starting``/``running`` after its deadline is flagged too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from broker.model import JobSpec, wait_text
from broker.schemas import JobView
from pricing.catalog import PROVISIONING_DELAY_S
from pricing.power import GPU_SPECS, canonical_or_same

__all__ = ["KnownCapacity", "CapacityCache", "never_fits", "job_warnings", "deadline_flags"]

#: states of a job that still waits to run (its deadline can still be warned about)
_WAITING = ("submitted", "queued", "deferred")
#: states of a job holding (or acquiring) GPUs (flagged when past its deadline)
_ACTIVE = ("provisioning", "starting", "running")


@dataclass(frozen=True)
class KnownNode:
    """A registered node: its pool, canonical GPU type, GPUs and memory per GPU (GB)."""

    name: str
    pool: str
    gpu_type: str
    gpu_count: int
    gpu_memory_gb: float


@dataclass(frozen=True)
class KnownCapacity:
    """What the broker knows it can hold (module docstring): ``nodes`` the registered nodes of the cluster file's
    agent pools; ``scheduler_pools`` the names of its Slurm/Kubernetes pools; ``cloud`` whether a cloud provider
    is configured."""

    nodes: tuple[KnownNode, ...]
    scheduler_pools: tuple[str, ...] = ()
    cloud: bool = False

    @property
    def complete(self) -> bool:
        """The registered nodes are all the capacity there is (no cloud, no scheduler pool, a node registered)."""
        return bool(self.nodes) and not self.cloud and not self.scheduler_pools

    def holding(self, spec: JobSpec) -> list[KnownNode]:
        """The nodes that can hold one rank of ``spec`` (GPU type, GPUs per node, memory), in groups big enough
        for its ``nodes`` (one pool, one GPU type)."""
        types = {canonical_or_same(t) for t in spec.gpu_types}
        fit = [n for n in self.nodes if (not types or n.gpu_type in types) and n.gpu_count >= spec.gpus_per_node
               and n.gpu_memory_gb >= spec.min_gpu_memory_gb]
        groups: dict[tuple[str, str], list[KnownNode]] = {}
        for n in fit:
            groups.setdefault((n.pool, n.gpu_type), []).append(n)
        return [n for g in groups.values() if len(g) >= spec.nodes for n in g]


class CapacityCache:
    """:class:`KnownCapacity` read from ``store`` (its node rows) and the cluster file's ``pools``. Read again when
    a node registered or was removed since (:meth:`JobStore.node_shapes_key`, one narrow query a call), and at
    least every ``ttl_s`` seconds (a node whose agent reports other GPUs). Measured with 1,000 registered nodes on
    the shared 2-core machine's PostgreSQL: a full read 33 ms; a submit's call with the key unchanged plus
    :func:`never_fits` 6.3 ms (0.7 ms of it the check); a read at every submit was 29 ms. Thread-safe."""

    def __init__(self, store, pools: Sequence, cloud: bool, ttl_s: float = 10.0):
        self.store = store
        self.agent_pools = {p.name for p in pools if p.kind == "agent"}
        self.scheduler_pools = tuple(p.name for p in pools if p.kind != "agent")
        self.cloud = cloud
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value: KnownCapacity | None = None
        self._key: tuple | None = None

    def get(self) -> KnownCapacity:
        """The capacity, read again when older than ``ttl_s``."""
        key = self.store.node_shapes_key()
        with self._lock:
            if self._value is None or key != self._key or time.monotonic() - self._at >= self.ttl_s:
                self._key = key
                nodes = tuple(KnownNode(name, pool, canonical_or_same(gtype), count, mem)
                              for name, pool, gtype, count, mem in self.store.node_shapes()
                              if pool in self.agent_pools and count > 0)
                self._value = KnownCapacity(nodes, self.scheduler_pools, self.cloud)
                self._at = time.monotonic()
            return self._value


def _largest(nodes: Sequence[KnownNode]) -> str:
    top = max(nodes, key=lambda n: (n.gpu_count, n.gpu_memory_gb, n.name))
    return f"the largest has {top.gpu_count} x {top.gpu_type} {top.gpu_memory_gb:g} GB ({top.name}, pool {top.pool})"


def never_fits(spec: JobSpec, cap: KnownCapacity) -> tuple[str, object, str] | None:
    """``(field, value, message)`` when the broker knows its whole capacity (:attr:`KnownCapacity.complete`) and
    no registered node can ever hold ``spec`` (the 422 of ``POST /v1/jobs``, the field as ``spec.<name>``); else
    ``None``. The field is the first constraint no node meets: ``gpu_types``, ``gpus_per_node``,
    ``min_gpu_memory_gb``, then ``nodes`` (too few nodes of one pool and type)."""
    if not cap.complete or cap.holding(spec):
        return None
    nodes = cap.nodes
    types = {canonical_or_same(t) for t in spec.gpu_types}
    known = sorted({n.gpu_type for n in nodes})
    head = f"no registered node can ever hold this job ({len(nodes)} node(s) known; no cloud provider or scheduler pool)"
    if types and not any(n.gpu_type in types for n in nodes):
        return "spec.gpu_types", list(spec.gpu_types), f"{head}: the nodes have GPU types {known}"
    typed = [n for n in nodes if not types or n.gpu_type in types]
    if not any(n.gpu_count >= spec.gpus_per_node for n in typed):
        return "spec.gpus_per_node", spec.gpus_per_node, f"{head}: {_largest(typed)}"
    roomy = [n for n in typed if n.gpu_count >= spec.gpus_per_node]
    if not any(n.gpu_memory_gb >= spec.min_gpu_memory_gb for n in roomy):
        return "spec.min_gpu_memory_gb", spec.min_gpu_memory_gb, f"{head}: {_largest(roomy)}"
    groups: dict[tuple[str, str], int] = {}
    for n in roomy:
        if n.gpu_memory_gb >= spec.min_gpu_memory_gb:
            groups[(n.pool, n.gpu_type)] = groups.get((n.pool, n.gpu_type), 0) + 1
    (pool, gtype), most = max(groups.items(), key=lambda kv: kv[1])
    return "spec.nodes", spec.nodes, (f"{head}: at most {most} node(s) of one pool and GPU type hold a rank "
                                      f"({gtype} in pool {pool}; a gang runs on one pool and one GPU type)")


def _shortest_run_s(spec: JobSpec, cap: KnownCapacity) -> tuple[float, str]:
    """``(seconds, on what)``: the shortest run ``spec`` can have (module docstring)."""
    holding = cap.holding(spec)
    if holding:
        types, where, delay = {n.gpu_type for n in holding}, "on the fastest registered node that can hold it", 0.0
    else:
        allowed = {canonical_or_same(t) for t in spec.gpu_types}
        types = {t for t in (allowed or GPU_SPECS) if t in GPU_SPECS}
        where = "on the fastest GPU type it allows"
        delay = min(PROVISIONING_DELAY_S.values()) if cap.cloud else 0.0
        if delay:
            where += f", after {wait_text(delay)} of cloud provisioning"
    if not types:
        return spec.estimated_duration_s, "at the reference V100's speed (no known GPU type)"
    best = max(types, key=lambda t: (GPU_SPECS[t].rel_throughput if t in GPU_SPECS else 1.0, t))
    thr = GPU_SPECS[best].rel_throughput if best in GPU_SPECS else 1.0
    return spec.estimated_duration_s / thr + delay, f"{where} ({best}, {thr:g}x a V100)"


def deadline_flags(job: JobView, cap: KnownCapacity, now: datetime) -> list[str]:
    """What ``status``/``list`` flag about ``job``'s deadline at ``now`` (UTC): a waiting job that can no longer
    finish by it (``"deadline cannot be met: ..."``), or a job holding GPUs past it (``"running past its
    deadline ..."``); empty otherwise (and for finished jobs)."""
    if job.state in _ACTIVE:
        late = (now - job.deadline).total_seconds()
        return [f"{job.state} past its deadline {job.deadline.isoformat(timespec='seconds')} by {wait_text(late)}"] \
            if late > 0 else []
    if job.state not in _WAITING:
        return []
    start = max(now, job.not_before) if job.not_before is not None else now
    left = (job.deadline - start).total_seconds()
    need, how = _shortest_run_s(job.spec, cap)
    if need <= left:
        return []
    return [f"deadline cannot be met: it needs at least {wait_text(need)} {how} and "
            f"{wait_text(max(left, 0.0))} are left to its deadline {job.deadline.isoformat(timespec='seconds')}; "
            "it stays queued and would finish late"]


def job_warnings(job: JobView, cap: KnownCapacity, now: datetime) -> list[str]:
    """The ``warnings`` of a job's view (the answers of submit, status and list): :func:`deadline_flags`, and, for a
    waiting job no registered node can hold, where it may still run (a scheduler pool, a cloud offer) or that no
    node has registered yet."""
    out = deadline_flags(job, cap, now)
    if job.state not in _WAITING or cap.holding(job.spec):
        return out
    s = job.spec
    shape = f"{s.nodes} x {s.gpus_per_node} {'/'.join(s.gpu_types) or 'any'} GPU(s)"
    if not cap.nodes and not cap.cloud and not cap.scheduler_pools:
        out.append(f"no node has registered yet: the broker cannot tell whether any will hold {shape}; "
                   "it waits until one that fits heartbeats")
    else:
        may = ([f"scheduler pool(s) {', '.join(cap.scheduler_pools)}"] if cap.scheduler_pools else []) + \
              (["a cloud offer"] if cap.cloud else [])
        out.append(f"no registered node can hold {shape}; it waits for " + " or ".join(may))
    return out
