"""Kubernetes pool adapter: an existing Kubernetes cluster (one namespace) as a place the broker runs jobs.

:class:`KubernetesPool` talks to the API server through the official ``kubernetes`` Python client (a kubeconfig
context, or the pod's service account in-cluster). Written against Kubernetes 1.31+ (``batch/v1`` Jobs with
``completionMode: Indexed``, the ``batch.kubernetes.io/job-completion-index`` annotation, the pod condition
``DisruptionTarget``; the client's OpenAPI document is ``release-1.37``), NVIDIA's device plugin
(``nvidia.com/gpu``) and GPU feature discovery labels (``nvidia.com/gpu.product``), and, optionally, Kueue
``v1beta1`` (the ``kueue.x-k8s.io/queue-name`` label on a suspended Job). Tested with the real client against a
local fake API server (``tests/providers/fake_k8s.py``): no API server can run on the test machines.

The same methods and shapes as ``providers.slurm.SlurmPool`` (``providers.base.PoolJobRequest``,
``PoolJobInfo``, ``NodeCapacity``): :meth:`~KubernetesPool.capacity`, :meth:`~KubernetesPool.free_gpus`,
:meth:`~KubernetesPool.backlog`, :meth:`~KubernetesPool.release_profile`, :meth:`~KubernetesPool.submit`,
:meth:`~KubernetesPool.describe`, :meth:`~KubernetesPool.cancel`, :meth:`~KubernetesPool.poll`,
:meth:`~KubernetesPool.list_managed`, :meth:`~KubernetesPool.sweep`, plus :meth:`~KubernetesPool.logs`.

Submit (one ``batch/v1`` Job per job attempt, named :func:`job_name`, ``fb-<job>-a<attempt>``)::

    single node     completions = parallelism = 1, NonIndexed
    gang of N       completionMode Indexed, completions = parallelism = N, pod i's hostname <name>-i, subdomain
                    <name>: a headless Service <name> (owned by the Job) gives MASTER_ADDR = <name>-0.<name>.<ns>.svc;
                    a required pod anti-affinity on kubernetes.io/hostname puts each rank on its own node
    all or nothing  backoffLimit 0: the first pod that fails fails the Job and the Job controller stops the others
    GPUs            limits/requests nvidia.com/gpu = gpus_per_node; nodeSelector nvidia.com/gpu.product =
                    settings.gpu_products[gpu_type] (plus settings.node_selector); settings.tolerations
    priority        priorityClassName = settings.priority_class_by_class[priority_class] (if any)
    time limit      activeDeadlineSeconds = ceil(estimate_s * (1 + slack_frac) + slack_s) (or the job's
                    time_limit_s), or less if the
                    deadline comes first (it counts from the Job's start, queueing included)
    labels          fedbroker-broker, fedbroker-job, fedbroker-attempt, fedbroker-team (label-safe values; the exact
                    values are annotations of the same keys, which are the tags)
    finalizer       fedbroker.io/attempt: a Job someone else deletes stays visible (deletionTimestamp) until the
                    broker has seen it; cancel and sweep remove it
    Kueue           settings.queue = "kueue": label kueue.x-k8s.io/queue-name = settings.kueue_queue and
                    suspend = true (Kueue admits the whole gang at once by un-suspending the Job)
    environment     the request's env (providers.launch.job_environment), then per pod NODE_RANK = PET_NODE_RANK =
                    FEDBROKER_RANK = the completion index, MASTER_ADDR/PET_MASTER_ADDR, MASTER_PORT/PET_MASTER_PORT
                    (29500), NNODES/PET_NNODES, FEDBROKER_JOB_ID, FEDBROKER_ATTEMPT; command /bin/sh -c <command>

State mapping (Job conditions, pod phases, container states and Warning events -> lifecycle state, reason)::

    annotation fedbroker-cancelled                      -> cancelled   "cancelled by the broker"
    Job condition Complete                              -> succeeded   exit code 0
    deletionTimestamp, not finished, no cancel mark     -> cancelled   "deleted in the cluster, not by the broker"
    a Failed pod with DisruptionTarget or reason Evicted -> interrupted (evicted, node lost, preempted): requeue
    a Failed pod, container OOMKilled                   -> failed      "OOMKilled ...", exit code 137
    a Failed pod                                        -> failed      its exit code (a gang: the lowest failed rank)
    Job condition Failed (DeadlineExceeded, ...)        -> failed      "reached its time limit ..." / the reason
    container waiting ImagePullBackOff, InvalidImageName,
    ErrImageNeverPull, CreateContainerConfigError       -> failed      the kubelet's "Failed" event (still active:
                                                                       the broker cancels it)
    Job suspended                                       -> starting    "suspended: waiting for Kueue ..."
    a pod PodScheduled=False reason Unschedulable        -> starting    the scheduler's message
    every pod Running                                   -> running
    no pod yet, a FailedCreate event (a GPU quota)       -> starting    the Job controller's event
    otherwise                                           -> starting

Errors (``providers.base``; each with ``option = "kubernetes:<namespace>:<gpu_type>"`` and ``code``)::

    SchedulerUnavailable   no answer, HTTP 5xx, 401 (code Unauthorized), 403 without a quota (Forbidden: RBAC),
                           no kubeconfig, or a file that is not one (NoKubeconfig; names the file, not its text)
    QuotaExceeded          HTTP 403 "exceeded quota" (a ResourceQuota of the namespace)
    Throttled              HTTP 429 after settings.max_retries retries (each after Retry-After, at most
                           settings.max_retry_after_s; 1, 2, 4 ... s without the header)
    Unsupported            HTTP 400/422 (an invalid object); a GPU type or count no node has; a deferred start
    NoCapacity             submit(require_free=True) and not enough nodes have the GPUs free now
    ProviderError          code NotFound (404), Conflict (409: the Job of this attempt exists), anything else
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from providers.base import (CANCEL_MARK, MANAGED_TAG, NodeCapacity, NoCapacity, PoolJobInfo, PoolJobRequest,
                            ProviderError, QuotaExceeded, SchedulerUnavailable, Throttled, Unsupported,
                            pool_time_limit_s, settings_from_section, free_gpus_of)
from providers.launch import RENDEZVOUS_PORT

__all__ = ["KubernetesSettings", "KubernetesPool", "settings_from_mapping", "job_info", "job_name", "label_value",
           "GPU_RESOURCE", "GPU_PRODUCT_LABEL", "KUEUE_QUEUE_LABEL", "FINALIZER", "INDEX_KEY", "JOB_NAME_LABEL"]

#: extended resource of NVIDIA's device plugin
GPU_RESOURCE = "nvidia.com/gpu"
#: node label of NVIDIA GPU feature discovery naming the GPU model (e.g. ``NVIDIA-A100-SXM4-80GB``)
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: Kueue's label naming the LocalQueue of a Job
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: the adapter's finalizer on every Job it creates
FINALIZER = "fedbroker.io/attempt"
#: label and annotation of an Indexed Job's pod: its completion index (the rank)
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
#: label the Job controller puts on a Job's pods: the Job's name
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"

_TAG_KEYS = (MANAGED_TAG, "fedbroker-job", "fedbroker-attempt", "fedbroker-team")
_RANK_ENV = ("NODE_RANK", "PET_NODE_RANK", "FEDBROKER_RANK")
_WAITING_FAILED = ("ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError")
_DISRUPTION = {"TerminationByKubelet": "evicted by the kubelet (node pressure or shutdown)",
               "EvictionByEvictionAPI": "evicted through the Eviction API (a node drain)",
               "PreemptionByScheduler": "preempted by a higher-priority pod",
               "DeletionByTaintManager": "its node was lost (NoExecute taint: not ready or unreachable)",
               "DeletionByPodGC": "its node is gone (pod garbage collector)"}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class KubernetesSettings:
    """How to reach one Kubernetes cluster and how to submit to it.

    ``namespace`` where the Jobs go; ``kubeconfig``/``context`` the kubeconfig file and context (``None``: the
    client's defaults, ``$KUBECONFIG`` or ``~/.kube/config``); ``in_cluster`` use the pod's service account
    instead; ``broker_id`` the ``fedbroker-broker`` label; ``gpu_products`` GPU type -> the GPU feature discovery
    product label value (``{"a100": "NVIDIA-A100-SXM4-80GB"}``; a type not listed is taken as the label value
    itself, ``"gpu"`` means any GPU); ``node_selector`` labels every node of the pool has (a GPU node pool);
    ``tolerations`` put on every pod (default: the device plugin's ``nvidia.com/gpu`` taint);
    ``priority_class_by_class`` priority class -> PriorityClass name; ``queue`` ``"none"`` or ``"kueue"`` with
    ``kueue_queue`` the LocalQueue; ``slack_frac``/``slack_s`` the time-limit slack over the estimate (fraction,
    s); ``term_grace_s`` the pods' ``terminationGracePeriodSeconds`` (s); ``propagation`` the delete propagation
    of cancel (``Foreground``: the Job goes after its pods, ``Background``); ``timeout_s`` per request (s);
    ``max_retries``/``max_retry_after_s`` on HTTP 429; ``container_requests`` other requests of the container
    (``{"cpu": "8", "memory": "64Gi"}``, also its limits); ``checkpoint_claim`` a PersistentVolumeClaim mounted at
    ``/checkpoints`` (sub-path ``<team>/<job>``, ``None``: none). ``ValueError`` naming the field for a bad value.
    """

    namespace: str = "default"
    kubeconfig: str | None = None
    context: str | None = None
    in_cluster: bool = False
    broker_id: str = "fedbroker"
    gpu_products: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: list = field(default_factory=lambda: [{"key": GPU_RESOURCE, "operator": "Exists",
                                                        "effect": "NoSchedule"}])
    priority_class_by_class: Mapping[str, str] = field(default_factory=dict)
    queue: str = "none"
    kueue_queue: str | None = None
    slack_frac: float = 0.2
    slack_s: float = 300.0
    term_grace_s: float = 30.0
    propagation: str = "Foreground"
    timeout_s: float = 30.0
    max_retries: int = 3
    max_retry_after_s: float = 60.0
    container_requests: Mapping[str, str] = field(default_factory=dict)
    checkpoint_claim: str | None = None

    def __post_init__(self) -> None:
        if not _DNS_LABEL.fullmatch(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"namespace={self.namespace!r}: must be a DNS label (a-z 0-9 -, at most 63)")
        if not self.broker_id or len(self.broker_id) > 63 or not _LABEL_VALUE.fullmatch(self.broker_id):
            raise ValueError(f"broker_id={self.broker_id!r}: must be a label value (1-63 of A-Z a-z 0-9 - _ ., "
                             "alphanumeric at both ends)")
        if self.queue not in ("none", "kueue"):
            raise ValueError(f"queue={self.queue!r}: must be 'none' or 'kueue'")
        if self.queue == "kueue" and not (self.kueue_queue and _LABEL_VALUE.fullmatch(self.kueue_queue)):
            raise ValueError(f"kueue_queue={self.kueue_queue!r}: queue is 'kueue': must name the LocalQueue")
        if self.propagation not in ("Foreground", "Background"):
            raise ValueError(f"propagation={self.propagation!r}: must be 'Foreground' or 'Background'")
        for name in ("slack_frac", "slack_s", "term_grace_s", "max_retry_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r}: must be a finite number >= 0")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be > 0")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries!r}: must be an integer >= 0")
        for t in self.tolerations:
            if not isinstance(t, Mapping) or not isinstance(t.get("key", ""), str) or \
                    t.get("operator", "Equal") not in ("Equal", "Exists"):
                raise ValueError(f"tolerations: {t!r} is not a toleration (key, operator Equal|Exists, value, effect)")
        if self.checkpoint_claim is not None and not _DNS_LABEL.fullmatch(self.checkpoint_claim):
            raise ValueError(f"checkpoint_claim={self.checkpoint_claim!r}: must be a PersistentVolumeClaim name")


def settings_from_mapping(section: Mapping, where: str = "kubernetes") -> KubernetesSettings:
    """:class:`KubernetesSettings` from one pool's section of a settings file (YAML/JSON mapping). ``ValueError``
    naming ``where`` and the key for an unknown key or a value of the wrong type; the checks of
    :class:`KubernetesSettings` name the field for a bad value (``providers.base.settings_from_section``)."""
    return settings_from_section(KubernetesSettings, section, where, {
        "in_cluster": "bool", "gpu_products": "str_map", "node_selector": "str_map", "tolerations": "map_list",
        "priority_class_by_class": "str_map", "slack_frac": "number", "slack_s": "number", "term_grace_s": "number",
        "timeout_s": "number", "max_retries": "int", "max_retry_after_s": "number", "container_requests": "str_map"})


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def label_value(text: str) -> str:
    """``text`` as a label value: itself when it is one (at most 63 of A-Z a-z 0-9 - _ ., alphanumeric at both
    ends), else ``h-`` and 16 hex digits of its SHA-256 (the exact value is kept in an annotation)."""
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    return "h-" + _digest(text, 16)


def job_name(job_id: str, attempt: int) -> str:
    """The Job's name for attempt ``attempt`` of ``job_id``: ``fb-<job>-a<attempt>`` when ``job_id`` is lower-case
    a-z 0-9 - and short, else ``fb-<up to 24 of it, made DNS-safe>-<8 hex of its SHA-256>-a<attempt>``. At most
    52 characters, so that an Indexed Job's pod hostnames ``<name>-<index>`` stay DNS labels (63)."""
    tail = f"-a{attempt}"
    if _DNS_LABEL.fullmatch(job_id) and len(f"fb-{job_id}{tail}") <= 52:
        return f"fb-{job_id}{tail}"
    slug = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")[:24].strip("-")
    return f"fb-{slug + '-' if slug else ''}{_digest(job_id, 8)}{tail}"


def _epoch(ts: str | None) -> float | None:
    if not ts:
        return None
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def _index(pod: Mapping) -> int:
    raw = (pod.get("metadata", {}).get("annotations") or {}).get(INDEX_KEY) or \
        (pod.get("metadata", {}).get("labels") or {}).get(INDEX_KEY) or "0"
    return int(raw) if str(raw).isdigit() else 0


def _container_state(pod: Mapping) -> tuple[str, Mapping]:
    """``("terminated"|"waiting"|"running"|"", state)`` of the pod's first container."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        for k in ("terminated", "waiting", "running"):
            if (cs.get("state") or {}).get(k) is not None:
                return k, cs["state"][k]
    return "", {}


def _condition(pod: Mapping, type_: str) -> Mapping | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def _gpus(pod: Mapping) -> int:
    """``nvidia.com/gpu`` the pod's containers ask for (limits, else requests)."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        v = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE) or 0
        total += int(v) if str(v).isdigit() else 0
    return total


def job_info(job: Mapping, pods: Iterable[Mapping], events: Iterable[Mapping] = (),
             now: float | None = None) -> PoolJobInfo:
    """What ``job`` (a Job as the API serves it, JSON) and its ``pods`` and Warning ``events`` say about the
    attempt: the state mapping of the module docstring. ``now`` epoch s (default: the clock) for ``elapsed_s``."""
    now = time.time() if now is None else now
    meta, spec, st = job.get("metadata") or {}, job.get("spec") or {}, job.get("status") or {}
    name = meta.get("name", "")
    ann = meta.get("annotations") or {}
    tags = {k: ann[k] for k in _TAG_KEYS if k in ann}
    n = int(spec.get("completions") or 1)
    pods = sorted(pods, key=_index)
    events = list(events)
    conds = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
    finished = "Complete" in conds or "Failed" in conds
    deleting = bool(meta.get("deletionTimestamp"))
    live = [p for p in pods if (p.get("status") or {}).get("phase") in ("Pending", "Running")]
    active = bool(live) or (not finished and not deleting)
    nodes = ",".join(p["spec"]["nodeName"] for p in pods if (p.get("spec") or {}).get("nodeName"))
    ends = [_epoch(s.get("finishedAt")) for p in pods for k, s in [_container_state(p)] if k == "terminated"]
    start = _epoch(st.get("startTime"))
    end = _epoch(st.get("completionTime")) or (max((e for e in ends if e), default=None) if finished else None) or now
    elapsed = max(0.0, end - start) if start else None
    limit = spec.get("activeDeadlineSeconds")

    def out(state: str, pool_state: str, why: str, code: int | None = None, sig: int | None = None) -> PoolJobInfo:
        return PoolJobInfo(name, state, pool_state, code, sig, why, nodes, elapsed, tags, None,
                           float(limit) if limit is not None else None, active)

    def exit_of(p: Mapping) -> tuple[int | None, int | None]:
        kind, s = _container_state(p)
        return (s.get("exitCode"), s.get("signal")) if kind == "terminated" else (None, None)

    def pod_name(p: Mapping) -> str:
        return p["metadata"]["name"] + (f" (rank {_index(p)} of {n})" if n > 1 else "")

    if ann.get(CANCEL_MARK):
        return out("cancelled", "Cancelled", "cancelled by the broker")
    if "Complete" in conds:
        return out("succeeded", "Complete", "exited with code 0" if n == 1 else f"all {n} pods exited with code 0", 0)
    if deleting and not finished:  # before the pods: a foreground deletion fails them on its way
        return out("cancelled", "Deleted", f"deleted in the cluster, not by the broker (Job {name} was deleted by an "
                   "administrator or another controller)")
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    for p in failed:
        dt = _condition(p, "DisruptionTarget")
        pst = p.get("status") or {}
        if (dt and dt.get("status") == "True") or pst.get("reason") in ("Evicted", "NodeLost", "Preempting"):
            word = (dt or {}).get("reason") or pst.get("reason")
            what = _DISRUPTION.get(word, f"{word}")
            msg = (pst.get("message") or (dt or {}).get("message") or "").strip()
            node = (p.get("spec") or {}).get("nodeName") or "its node"
            return out("interrupted", pst.get("reason") or word,
                       f"pod {pod_name(p)} on {node}: {what}" + (f" ({msg})" if msg else "")
                       + ": the broker requeues the attempt", *exit_of(p))
    if failed:
        p = failed[0]
        code, sig = exit_of(p)
        kind, s = _container_state(p)
        if s.get("reason") == "OOMKilled":
            return out("failed", "OOMKilled", f"OOMKilled: pod {pod_name(p)} ran out of memory (its limit or the "
                       f"node's; exit code {code})", code, sig)
        return out("failed", "Failed", f"exited with code {code}" + (f" (signal {sig})" if sig else "")
                   + (f": pod {pod_name(p)}" if n > 1 else ""), code, sig)
    if "Failed" in conds:
        c = conds["Failed"]
        if c.get("reason") == "DeadlineExceeded":
            return out("failed", "DeadlineExceeded", f"reached its time limit (activeDeadlineSeconds={limit})")
        return out("failed", c.get("reason") or "Failed", f"{c.get('reason')}: {c.get('message', '')}".strip())
    for p in pods:
        kind, s = _container_state(p)
        if kind == "waiting" and s.get("reason") in _WAITING_FAILED:
            uid = p["metadata"].get("uid")
            said = [e.get("message", "") for e in events if (e.get("involvedObject") or {}).get("uid") == uid
                    and e.get("reason") == "Failed" and not e.get("message", "").startswith("Error: ")]
            return out("failed", s["reason"], f"{s['reason']}: {said[-1] if said else s.get('message', '')}"
                       + (f" (pod {pod_name(p)})" if n > 1 else ""))
    if spec.get("suspend"):
        q = (meta.get("labels") or {}).get(KUEUE_QUEUE_LABEL)
        return out("starting", "Suspended", f"suspended: waiting for Kueue to admit it (LocalQueue {q})" if q
                   else "suspended")
    unsched = [p for p in pods if (_condition(p, "PodScheduled") or {}).get("reason") == "Unschedulable"]
    if unsched:
        msg = _condition(unsched[0], "PodScheduled").get("message", "")
        return out("starting", "Unschedulable", f"Unschedulable: {msg}"
                   + (f" ({len(unsched)} of {n} pods)" if n > 1 else ""))
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    if len(running) >= n:
        return out("running", "Running", f"running on {nodes}")
    if pods:
        return out("starting", "Pending", f"{len(running)} of {n} pods running, the others pending")
    uid = meta.get("uid")
    said = [e.get("message", "") for e in events if (e.get("involvedObject") or {}).get("uid") == uid
            and e.get("reason") == "FailedCreate"]
    if said:
        return out("starting", "FailedCreate", f"FailedCreate: {said[-1]}")
    return out("starting", "Pending", "waiting for the Job controller to create its pods")


def _where(e: BaseException) -> str:
    """`` at line L, column C`` of a YAML parse error (1-based, from its mark), else ``""``: where a broken
    kubeconfig fails, without the excerpt of the file that ``str(e)`` of a YAML error carries."""
    mark = getattr(e, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


class KubernetesPool:
    """An existing Kubernetes cluster (one namespace) as a broker pool; see the module docstring.

    ``api_client`` a ``kubernetes.client.ApiClient`` (default: one from the settings' kubeconfig or in-cluster
    config, made on first use, its urllib3 retries off: the adapter retries 429 itself); ``sleep`` the pause
    between retries (tests record it).
    """

    name = "kubernetes"

    def __init__(self, settings: KubernetesSettings, api_client: Any = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.settings = settings
        self._client = api_client
        self._sleep = sleep
        self._core = self._batch = None

    # ---------------------------------------------------------------- plumbing
    def _option(self, gpu_type: str = "*") -> str:
        return f"kubernetes:{self.settings.namespace}:{gpu_type}"

    def _apis(self) -> tuple[Any, Any]:
        if self._core is None:
            from kubernetes import client, config
            from kubernetes.config.config_exception import ConfigException

            if self._client is None:
                cfg = client.Configuration()
                try:
                    if self.settings.in_cluster:
                        config.load_incluster_config(client_configuration=cfg)
                    else:
                        config.load_kube_config(config_file=self.settings.kubeconfig, context=self.settings.context,
                                                client_configuration=cfg, persist_config=False)
                except (ConfigException, OSError) as e:
                    raise SchedulerUnavailable(f"kubeconfig={self.settings.kubeconfig!r} context="
                                               f"{self.settings.context!r}: {e}", self._option(),
                                               "NoKubeconfig") from None
                except Exception as e:  # noqa: BLE001 - the client's own parse failures (TypeError, YAMLError, ...)
                    # a file that is not a kubeconfig (plain text, a list, broken YAML): the client fails inside
                    # its parser; name the file and the kind of failure, never its text (it may hold a token)
                    raise SchedulerUnavailable(
                        f"kubeconfig={self.settings.kubeconfig or '~/.kube/config'!r}: not a valid kubeconfig "
                        f"(a YAML mapping with clusters, contexts and users; the client failed with "
                        f"{type(e).__name__}{_where(e)})", self._option(), "NoKubeconfig") from None
                cfg.retries = False
                self._client = client.ApiClient(cfg)
            self._core, self._batch = client.CoreV1Api(self._client), client.BatchV1Api(self._client)
        return self._core, self._batch

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, option: str | None = None, text: bool = False,
              **kw: Any) -> Any:
        """One API request (``fn`` a bound client method) -> its JSON (or text) body; errors mapped (module
        docstring); HTTP 429 retried after ``Retry-After``."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        s = self.settings
        option = option or self._option()
        for attempt in range(s.max_retries + 1):
            try:
                r = fn(*args, _preload_content=False, _request_timeout=s.timeout_s, **kw)
                data = r.data.decode("utf-8", errors="replace")
                return data if text else (json.loads(data) if data else {})
            except ApiException as e:
                status = e.status or 0
                try:
                    body = json.loads(e.body or "{}")
                except ValueError:
                    body = {}
                msg = body.get("message") if isinstance(body, dict) else None
                text_ = f"{what}: HTTP {status} {(msg or e.reason or '').strip()}".strip()
                if status == 429:
                    raw = (e.headers or {}).get("Retry-After")
                    try:
                        wait = float(raw) if raw is not None else float(2 ** attempt)
                    except ValueError:
                        wait = float(2 ** attempt)
                    wait = min(max(wait, 0.0), s.max_retry_after_s)
                    if attempt < s.max_retries:
                        self._sleep(wait)
                        continue
                    raise Throttled(f"{text_} (after {s.max_retries} retries)", option, "TooManyRequests",
                                    retry_after_s=wait) from None
                if status == 401:
                    raise SchedulerUnavailable(text_, option, "Unauthorized") from None
                if status == 403 and "exceeded quota" in (msg or "").lower():
                    raise QuotaExceeded(text_, option, "ExceededQuota") from None
                if status == 403:
                    raise SchedulerUnavailable(f"{text_} (the Role of the README grants what the adapter needs)",
                                               option, "Forbidden") from None
                if status == 404:
                    raise ProviderError(text_, option, "NotFound") from None
                if status == 409:
                    raise ProviderError(text_, option, "Conflict") from None
                if status in (400, 422):
                    raise Unsupported(text_, option, "Invalid") from None
                if status >= 500 or status == 0:
                    raise SchedulerUnavailable(text_, option, f"HTTP{status}") from None
                raise ProviderError(text_, option, f"HTTP{status}") from None
            except (urllib3.exceptions.HTTPError, OSError) as e:
                raise SchedulerUnavailable(f"{what}: no answer from the API server ({e})", option,
                                           "SchedulerUnavailable") from None
        raise AssertionError("unreachable")

    def _items(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> list[dict]:
        return list(self._call(what, fn, *args, **kw).get("items") or [])

    def _gpu_type(self, labels: Mapping[str, str]) -> str:
        product = labels.get(GPU_PRODUCT_LABEL)
        if not product:
            return "gpu"
        for typ, prod in self.settings.gpu_products.items():
            if prod == product:
                return typ
        return product

    def _product(self, gpu_type: str) -> str | None:
        return None if gpu_type == "gpu" else self.settings.gpu_products.get(gpu_type, gpu_type)

    def _tolerated(self, taint: Mapping) -> bool:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            return True
        for t in self.settings.tolerations:
            if t.get("effect") not in (None, "", taint.get("effect")):
                continue
            if t.get("operator") == "Exists" and t.get("key") in (None, "", taint.get("key")):
                return True
            if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
                return True
        return False

    # ---------------------------------------------------------------- capacity
    def _nodes(self) -> list[dict]:
        core, _ = self._apis()
        sel = ",".join(f"{k}={v}" for k, v in sorted(self.settings.node_selector.items())) or None
        return self._items("list nodes", core.list_node, label_selector=sel)

    def capacity(self) -> list[NodeCapacity]:
        """Every node of the pool (``settings.node_selector``) with allocatable ``nvidia.com/gpu`` > 0: its GPUs by
        type (GPU feature discovery's product label through ``gpu_products``) total and requested by the pods on
        it that have not finished, and its state: ``down`` (not Ready), ``drained`` (cordoned, or a taint the
        pods do not tolerate), else ``idle``/``mixed``/``allocated`` by GPUs requested. ``Unsupported`` when no
        node has GPUs. Two requests: nodes, and pods of every namespace."""
        core, _ = self._apis()
        nodes = self._nodes()
        pods = self._items("list pods", core.list_pod_for_all_namespaces,
                           field_selector="status.phase!=Succeeded,status.phase!=Failed")
        used: dict[str, int] = {}
        for p in pods:
            node = (p.get("spec") or {}).get("nodeName")
            if node:
                used[node] = used.get(node, 0) + _gpus(p)
        out = []
        for n in nodes:
            alloc = str((n.get("status") or {}).get("allocatable", {}).get(GPU_RESOURCE, "0"))
            total = int(alloc) if alloc.isdigit() else 0
            if total <= 0:
                continue
            name = n["metadata"]["name"]
            typ = self._gpu_type(n["metadata"].get("labels") or {})
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (n.get("status") or {}).get("conditions") or [])
            u = used.get(name, 0)
            if not ready:
                state = "down"
            elif (n.get("spec") or {}).get("unschedulable") or not all(
                    self._tolerated(t) for t in (n.get("spec") or {}).get("taints") or []):
                state = "drained"
            else:
                state = "idle" if u == 0 else ("mixed" if u < total else "allocated")
            out.append(NodeCapacity(name, state, {typ: total}, {typ: u}))
        if not out:
            raise Unsupported(f"no node with {GPU_RESOURCE} (node_selector {dict(self.settings.node_selector)})",
                              self._option(), "NoGpuNodes")
        return sorted(out, key=lambda c: c.node)

    def free_gpus(self) -> dict[str, int]:
        """GPU type -> GPUs free now over the pool's usable nodes (:func:`providers.base.free_gpus_of`)."""
        return free_gpus_of(self.capacity())

    def backlog(self) -> dict[str, int]:
        """GPU type -> GPUs asked for by pending, unscheduled pods of every namespace that are not this broker's
        (the cluster's own queue ahead of a job the broker would send); the type from the pod's
        ``nodeSelector`` product label, else ``"gpu"`` (any). Suspended (Kueue) Jobs have no pods: not counted."""
        core, _ = self._apis()
        out: dict[str, int] = {}
        for p in self._items("list pods", core.list_pod_for_all_namespaces, field_selector="status.phase=Pending"):
            if (p.get("spec") or {}).get("nodeName"):
                continue
            if (p["metadata"].get("labels") or {}).get(MANAGED_TAG) == self.settings.broker_id:
                continue
            g = _gpus(p)
            if g:
                typ = self._gpu_type((p.get("spec") or {}).get("nodeSelector") or {})
                out[typ] = out.get(typ, 0) + g
        return out

    def release_profile(self) -> list[tuple[datetime, str, int]]:
        """``(end, gpu_type, gpus)`` for every running pod of every namespace that holds GPUs of a pool node and
        has a time limit, soonest first: ``end`` = start + the limit (aware UTC): the pod's own
        ``activeDeadlineSeconds`` from its ``startTime``, else its Job's from the Job's ``startTime``. Every pod
        counts, the broker's and the cluster's own; one without a limit is left out."""
        core, batch = self._apis()
        types = {n["metadata"]["name"]: self._gpu_type(n["metadata"].get("labels") or {}) for n in self._nodes()}
        jobs = {(j["metadata"].get("namespace"), j["metadata"]["name"]): j
                for j in self._items("list jobs", batch.list_job_for_all_namespaces)}
        out = []
        for p in self._items("list pods", core.list_pod_for_all_namespaces, field_selector="status.phase=Running"):
            node, g = (p.get("spec") or {}).get("nodeName"), _gpus(p)
            if node not in types or not g:
                continue
            end = None
            if (p.get("spec") or {}).get("activeDeadlineSeconds") is not None and p["status"].get("startTime"):
                end = _epoch(p["status"]["startTime"]) + float(p["spec"]["activeDeadlineSeconds"])
            else:
                owner = next((o for o in p["metadata"].get("ownerReferences") or [] if o.get("kind") == "Job"), None)
                j = jobs.get((p["metadata"].get("namespace"), owner["name"])) if owner else None
                if j and (j.get("spec") or {}).get("activeDeadlineSeconds") is not None and \
                        (j.get("status") or {}).get("startTime"):
                    end = _epoch(j["status"]["startTime"]) + float(j["spec"]["activeDeadlineSeconds"])
            if end is not None:
                out.append((datetime.fromtimestamp(end, timezone.utc), types[node], g))
        return sorted(out)

    # ---------------------------------------------------------------- submit
    def _labels(self, req: PoolJobRequest) -> dict[str, str]:
        return {MANAGED_TAG: self.settings.broker_id, "fedbroker-job": label_value(req.job_id),
                "fedbroker-attempt": str(req.attempt), "fedbroker-team": label_value(req.team)}

    def _tags(self, req: PoolJobRequest) -> dict[str, str]:
        return {MANAGED_TAG: self.settings.broker_id, "fedbroker-job": req.job_id,
                "fedbroker-attempt": str(req.attempt), "fedbroker-team": req.team}

    def time_limit_s(self, req: PoolJobRequest, now: float | None = None) -> int:
        """``activeDeadlineSeconds`` of ``req``: ``ceil(estimate_s * (1 + slack_frac) + slack_s)`` (the job's own
        ``req.time_limit_s`` instead when it gives one, :func:`providers.base.pool_time_limit_s`), or the whole
        seconds left to ``req.deadline`` if fewer (``now`` epoch s, default the clock). E.g. 60 s with 20 % and
        300 s slack -> 372 s. ``Unsupported`` (code DeadlinePassed) when the deadline is not in the future."""
        s = self.settings
        limit = math.ceil(pool_time_limit_s(req.estimate_s, s.slack_frac, s.slack_s, req.time_limit_s))
        if req.deadline is not None:
            left = math.floor(req.deadline.timestamp() - (time.time() if now is None else now))
            if left < 1:
                raise Unsupported(f"deadline={req.deadline.isoformat()}: already past", self._option(req.gpu_type),
                                  "DeadlinePassed")
            limit = min(limit, left)
        return limit

    def job_manifest(self, req: PoolJobRequest, now: float | None = None) -> dict:
        """The ``batch/v1`` Job of ``req`` (JSON, as ``kubectl get job -o json`` shows it; module docstring).
        ``ValueError`` when ``req.image`` is missing."""
        if not req.image:
            raise ValueError("image=None: a Kubernetes pool runs the command in a container image")
        s = self.settings
        name = job_name(req.job_id, req.attempt)
        gang = req.nodes > 1
        labels = self._labels(req)
        master = f"{name}-0.{name}.{s.namespace}.svc" if gang else "127.0.0.1"
        env = [{"name": k, "value": str(v)} for k, v in sorted(req.env.items())
               if k not in _RANK_ENV + ("MASTER_ADDR", "PET_MASTER_ADDR", "MASTER_PORT", "PET_MASTER_PORT",
                                        "NNODES", "PET_NNODES", "FEDBROKER_JOB_ID", "FEDBROKER_ATTEMPT")]
        env += [{"name": "FEDBROKER_JOB_ID", "value": req.job_id},
                {"name": "FEDBROKER_ATTEMPT", "value": str(req.attempt)},
                {"name": "NNODES", "value": str(req.nodes)}, {"name": "PET_NNODES", "value": str(req.nodes)},
                {"name": "MASTER_ADDR", "value": master}, {"name": "PET_MASTER_ADDR", "value": master},
                {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
                {"name": "PET_MASTER_PORT", "value": str(RENDEZVOUS_PORT)}]
        for k in _RANK_ENV:
            env.append({"name": k, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}}
                       if gang else {"name": k, "value": "0"})
        res = {GPU_RESOURCE: str(req.gpus_per_node), **s.container_requests}
        container: dict = {"name": "job", "image": req.image, "command": ["/bin/sh", "-c", req.command],
                           "env": env, "resources": {"limits": dict(res), "requests": dict(res)}}
        selector = dict(s.node_selector)
        product = self._product(req.gpu_type)
        if product:
            selector[GPU_PRODUCT_LABEL] = product
        pod: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": math.ceil(s.term_grace_s),
                     "enableServiceLinks": False, "containers": [container],
                     "tolerations": [dict(t) for t in s.tolerations]}
        if selector:
            pod["nodeSelector"] = selector
        prio = s.priority_class_by_class.get(req.priority_class or "")
        if prio:
            pod["priorityClassName"] = prio
        if gang:  # one pod per node: the gang's ranks are nodes
            pod["subdomain"] = name
            pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {JOB_NAME_LABEL: name}}, "topologyKey": "kubernetes.io/hostname"}]}}
        if s.checkpoint_claim:
            pod["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": s.checkpoint_claim}}]
            container["volumeMounts"] = [{"name": "checkpoints", "mountPath": "/checkpoints",
                                          "subPath": f"{req.team}/{req.job_id}"}]
        job_labels = dict(labels)
        if s.queue == "kueue":
            job_labels[KUEUE_QUEUE_LABEL] = s.kueue_queue
        spec: dict = {"backoffLimit": 0, "activeDeadlineSeconds": self.time_limit_s(req, now),
                      "completions": req.nodes, "parallelism": req.nodes,
                      "completionMode": "Indexed" if gang else "NonIndexed",
                      "template": {"metadata": {"labels": labels, "annotations": self._tags(req)}, "spec": pod}}
        if s.queue == "kueue":
            spec["suspend"] = True
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": s.namespace, "labels": job_labels,
                             "annotations": self._tags(req), "finalizers": [FINALIZER]},
                "spec": spec}

    def submit(self, req: PoolJobRequest, require_free: bool = False) -> PoolJobInfo:
        """Create the Job of ``req`` (and, for a gang, its headless Service); returns the attempt as the cluster
        sees it right after. ``Unsupported`` when no node has ``gpus_per_node`` GPUs of ``gpu_type`` (or too few
        such nodes), or for ``begin`` (no deferred start: the broker submits at the window it decided);
        ``NoCapacity`` with ``require_free`` when fewer than ``nodes`` nodes have them free now;
        ``ProviderError(code="Conflict")`` when this attempt's Job exists."""
        option = self._option(req.gpu_type)
        if req.begin is not None:
            raise Unsupported("begin: a Kubernetes pool has no deferred start (the broker submits when the window "
                              "opens)", option, "NoDeferredStart")
        manifest = self.job_manifest(req)
        nodes = self.capacity()
        fit = [n for n in nodes if n.gpus_total.get(req.gpu_type, 0) >= req.gpus_per_node]
        if not fit:
            have = sorted({t for n in nodes for t in n.gpus_total})
            raise Unsupported(f"gpu_type={req.gpu_type!r} x {req.gpus_per_node}: no node has that (GPU types: {have})",
                              option, "NoSuchGpuType")
        if len(fit) < req.nodes:
            raise Unsupported(f"nodes={req.nodes}: {len(fit)} nodes have {req.gpus_per_node} x {req.gpu_type}",
                              option, "TooFewNodes")
        if require_free:
            free = sum(1 for n in fit if n.gpus_free(req.gpu_type) >= req.gpus_per_node)
            if free < req.nodes:
                raise NoCapacity(f"{free} of the {req.nodes} nodes needed have {req.gpus_per_node} x {req.gpu_type} "
                                 "free now", option, "NoCapacity")
        core, batch = self._apis()
        ns = self.settings.namespace
        job = self._call("create job", batch.create_namespaced_job, ns, manifest, option=option)
        name = manifest["metadata"]["name"]
        if req.nodes > 1:
            svc = {"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": name, "labels": self._labels(req),
                                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                     "uid": job["metadata"]["uid"]}]},
                   "spec": {"clusterIP": "None", "selector": {JOB_NAME_LABEL: name}, "publishNotReadyAddresses": True,
                            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}}
            self._call("create service", core.create_namespaced_service, ns, svc, option=option)
        return self.describe(name)

    # ---------------------------------------------------------------- describe
    def _warnings(self) -> list[dict]:
        core, _ = self._apis()
        return self._items("list events", core.list_namespaced_event, self.settings.namespace,
                           field_selector="type=Warning")

    def describe(self, name: str) -> PoolJobInfo:
        """The attempt of Job ``name`` now (the Job, its pods and the namespace's Warning events: three requests).
        ``ProviderError(code="NotFound")`` when the Job is gone (or never was)."""
        if not isinstance(name, str) or not _DNS_LABEL.fullmatch(name):
            raise ValueError(f"name={name!r}: must be a Job name (a DNS label)")
        core, batch = self._apis()
        ns = self.settings.namespace
        job = self._call(f"get job {name}", batch.read_namespaced_job, name, ns)
        pods = self._items("list pods", core.list_namespaced_pod, ns, label_selector=f"{JOB_NAME_LABEL}={name}")
        return job_info(job, pods, self._warnings())

    def logs(self, name: str, rank: int = 0, tail_lines: int | None = None) -> str:
        """The output of rank ``rank`` of Job ``name`` (the pod log endpoint; the last ``tail_lines`` lines).
        ``ProviderError(code="NotFound")`` when the pod is not there."""
        core, _ = self._apis()
        ns = self.settings.namespace
        pods = [p for p in self._items("list pods", core.list_namespaced_pod, ns,
                                       label_selector=f"{JOB_NAME_LABEL}={name}") if _index(p) == rank]
        if not pods:
            raise ProviderError(f"job {name}: no pod of rank {rank}", self._option(), "NotFound")
        kw = {"tail_lines": tail_lines} if tail_lines is not None else {}
        return self._call(f"log of {pods[-1]['metadata']['name']}", core.read_namespaced_pod_log,
                          pods[-1]["metadata"]["name"], ns, container="job", text=True, **kw)

    def poll(self) -> dict[str, PoolJobInfo]:
        """Job name -> the attempt now, for every Job of this broker (``fedbroker-broker`` label) in the namespace,
        finished ones whose object is still there included, in three requests (Jobs, pods, Warning events). What
        a broker cycle calls instead of one :meth:`describe` per tracked job."""
        core, batch = self._apis()
        ns = self.settings.namespace
        sel = f"{MANAGED_TAG}={self.settings.broker_id}"
        jobs = self._items("list jobs", batch.list_namespaced_job, ns, label_selector=sel)
        pods: dict[str, list[dict]] = {}
        for p in self._items("list pods", core.list_namespaced_pod, ns, label_selector=sel):
            pods.setdefault((p["metadata"].get("labels") or {}).get(JOB_NAME_LABEL, ""), []).append(p)
        events = self._warnings()
        out = {j["metadata"]["name"]: job_info(j, pods.get(j["metadata"]["name"], []), events) for j in jobs}
        return dict(sorted(out.items()))

    def list_managed(self) -> list[PoolJobInfo]:
        """Every attempt of this broker the cluster still runs or queues (:meth:`poll`, ``active``)."""
        return [i for i in self.poll().values() if i.active]

    # ---------------------------------------------------------------- cancel and sweep
    def cancel(self, name: str, grace_s: float | None = None) -> PoolJobInfo:
        """Stop the attempt of Job ``name``: mark it cancelled by the broker (annotation, unless it is already
        over), remove the adapter's finalizer and delete the Job with ``settings.propagation`` (its pods get
        SIGTERM and their ``terminationGracePeriodSeconds``), then wait up to ``grace_s`` (default
        ``settings.term_grace_s``) + 5 s for its pods to go. Returns the attempt: ``cancelled`` ("cancelled by
        the broker") if it was not over, else as it ended; ``active`` if pods remain. An attempt already over is
        only cleaned up. ``ProviderError(code="NotFound")`` when the Job is gone."""
        grace = self.settings.term_grace_s if grace_s is None else grace_s
        info = self.describe(name)
        _, batch = self._apis()
        ns = self.settings.namespace
        patch: dict = {"metadata": {"finalizers": None}}
        if not info.terminal:
            patch["metadata"]["annotations"] = {CANCEL_MARK: "1"}
        self._call(f"patch job {name}", batch.patch_namespaced_job, name, ns, patch,
                   _content_type="application/merge-patch+json")
        try:
            self._call(f"delete job {name}", batch.delete_namespaced_job, name, ns,
                       propagation_policy=self.settings.propagation)
        except ProviderError as e:
            if e.code != "NotFound":
                raise
        remaining = self._wait_pods_gone(name, grace + 5.0)
        base = info if info.terminal else PoolJobInfo(
            info.pool_job_id, "cancelled", "Cancelled", None, None, "cancelled by the broker", info.nodes,
            info.elapsed_s, info.tags, None, info.time_limit_s, True)
        return dataclasses.replace(base, active=remaining > 0)

    def _wait_pods_gone(self, name: str, timeout_s: float) -> int:
        core, _ = self._apis()
        end = time.monotonic() + timeout_s
        while True:
            pods = self._items("list pods", core.list_namespaced_pod, self.settings.namespace,
                               label_selector=f"{JOB_NAME_LABEL}={name}")
            live = sum(1 for p in pods if (p.get("status") or {}).get("phase") in ("Pending", "Running"))
            if not live or time.monotonic() >= end:
                return live
            time.sleep(0.1)

    def sweep(self, live: Iterable[tuple[str, int]], grace_s: float | None = None) -> list[PoolJobInfo]:
        """Cancel (and clean up) this broker's Jobs whose ``(job, attempt)`` tags are not in ``live``: a broker that
        crashed after creating one, or an attempt the broker has finished with. Returns them as they were found."""
        live_set = set(live)
        gone = []
        for info in self.poll().values():
            att = info.tags.get("fedbroker-attempt", "")
            key = (info.tags.get("fedbroker-job", ""), int(att) if att.isdigit() else None)
            if key not in live_set:
                try:
                    self.cancel(info.pool_job_id, grace_s)
                except ProviderError as e:
                    if e.code != "NotFound":
                        raise
                gone.append(info)
        return gone
