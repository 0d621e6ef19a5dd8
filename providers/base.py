"""The provider interface: where a placed job attempt gets machines.

A provider adapter (``providers.aws``, ``providers.gcp``; on-prem hosts are run by
node agents) implements the four methods of :class:`Compute`; optional abilities
are small mixins (:class:`SupportsQuotaPreflight`, :class:`SupportsSweep`). The
style follows dstack's ``Compute`` + mixins and SkyPilot's failover with history.

Errors (a provider's SDK errors are mapped onto these, so the broker fails over
without knowing any cloud SDK)::

    ProviderError                   unknown provider failure: bounded retries elsewhere
     +-- NoCapacity                 this zone/type has no capacity now: try the next option
     +-- Unsupported                this option can never work (type not offered here): exclude it
     +-- QuotaExceeded              an account quota blocks it: do not retry (preflight next time)
     +-- Throttled                  API rate limit: back off, then retry the same option
     +-- SchedulerUnavailable       a pool's own scheduler (slurmctld, a Kubernetes API) cannot be reached

Pools that run on a scheduler the site already has (``providers.slurm``, ``providers.kubernetes``) share the
job-level types here: :class:`PoolJobRequest` (one attempt to submit), :class:`PoolJobInfo` (what the scheduler
says about it), :class:`NodeCapacity` (one node's GPUs), :data:`POOL_TERMINAL`, :func:`pool_time_limit_s` and
:func:`settings_from_section` (a pool's settings from its section of a settings file).

Every error carries the option it happened on. :class:`FailoverHistory` keeps, per
job attempt, each option tried, the error and the time, and is stored with the job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

__all__ = ["ProviderError", "NoCapacity", "Unsupported", "QuotaExceeded", "Throttled", "SchedulerUnavailable", "InstanceRequest",
           "InstanceInfo", "Compute", "SupportsQuotaPreflight", "SupportsSweep", "FailoverHistory", "FailoverAttempt",
           "idempotency_token", "as_uuid", "instance_tags", "attempt_of", "MANAGED_TAG", "CANCEL_MARK", "check_outputs",
           "PoolJobRequest", "PoolJobInfo", "NodeCapacity", "POOL_TERMINAL", "USABLE_NODE_STATES",
           "pool_time_limit_s", "DEFAULT_TIME_LIMIT_SLACK_FRAC", "DEFAULT_TIME_LIMIT_SLACK_S", "settings_from_section", "free_gpus_of"]

#: tag/label key on every instance the broker creates; its value is the broker id
MANAGED_TAG = "fedbroker-broker"
#: tag a pool adapter puts on a job (Slurm comment, Kubernetes annotation) before it cancels it, so that a later
#: describe says "cancelled by the broker" rather than "cancelled in the cluster"
CANCEL_MARK = "fedbroker-cancelled"


class ProviderError(Exception):
    """A provider call failed. ``option`` is the offer id (``provider:zone:type:market``) it failed on;
    ``code`` the provider's own error code (e.g. ``InsufficientInstanceCapacity``)."""

    def __init__(self, message: str, option: str | None = None, code: str | None = None):
        super().__init__(message)
        self.option = option
        self.code = code


class NoCapacity(ProviderError):
    """No capacity for this instance type in this zone now; the next option may have some."""


class Unsupported(ProviderError):
    """This option cannot work (type not offered in the zone, bad image for the type): exclude it."""


class QuotaExceeded(ProviderError):
    """An account quota (vCPUs, GPUs, spot) blocks the request; retrying will not help."""


class Throttled(ProviderError):
    """The provider's API rate limit; back off and retry. ``retry_after_s`` if the provider said."""

    def __init__(self, message: str, option: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message, option, code)
        self.retry_after_s = retry_after_s


class SchedulerUnavailable(ProviderError):
    """The pool's scheduler (Slurm's controller, a Kubernetes API server) does not answer, or its client is
    missing; the pool offers nothing until it answers again."""


def idempotency_token(job_id: str, attempt: int, offer_id: str, rank: int = 0) -> str:
    """Client token of one create call: the same (job, attempt, offer, rank) always gives the same
    token, so a create retried after a crash cannot make a second instance (AWS ``ClientToken``,
    max 64 ASCII characters; GCP ``requestId`` must be a UUID, see :func:`as_uuid`). 40 hex digits."""
    return hashlib.sha256(f"{job_id}|{attempt}|{offer_id}|{rank}".encode()).hexdigest()[:40]


def as_uuid(token: str) -> str:
    """``token`` (hex) shaped as a UUID (GCP ``requestId`` requires one)."""
    h = (token + "0" * 32)[:32]
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True)
class InstanceRequest:
    """One instance to create for one rank of a job attempt.

    Fields: ``offer_id`` ``provider:zone:instance_type:market``; ``user_data`` the cloud-init
    script that runs the job's container (``providers.launch``); ``tags`` key -> value put on
    the instance at creation (job, attempt, team, broker id); ``token`` the idempotency token;
    ``gang_size`` the number of nodes of the job (multi-node gangs are placed close together).
    """

    job_id: str
    attempt: int
    rank: int
    team: str
    offer_id: str
    region: str
    zone: str
    instance_type: str
    market: str  # "spot" | "on_demand"
    gpu_type: str
    gpu_count: int
    user_data: str
    tags: dict[str, str]
    token: str
    image: str | None = None  # machine image (AMI / GCE image); None = the adapter's configured default
    gang_size: int = 1  # nodes of the job's gang; > 1 puts the instance in the region's placement group (AWS)


@dataclass(frozen=True)
class InstanceInfo:
    """What a provider says about one managed instance.

    ``state`` is normalised: ``pending | running | stopping | stopped | terminated | unknown``;
    ``private_ip`` is the address NCCL ranks reach it on (rank 0's is the rendezvous endpoint).
    """

    provider: str
    instance_id: str
    zone: str
    instance_type: str
    state: str
    private_ip: str | None
    tags: dict[str, str]
    launched_at: datetime | None = None
    spot: bool = False


class Compute(ABC):
    """Four methods every provider adapter implements."""

    name: str = "provider"

    @abstractmethod
    def launch(self, req: InstanceRequest) -> InstanceInfo:
        """Create (or find, by ``req.token``) the instance. Raises the typed errors above."""

    @abstractmethod
    def describe(self, instance_id: str, zone: str) -> InstanceInfo:
        """The instance now. Raises :class:`ProviderError` (``code="NotFound"`` when it is gone)."""

    @abstractmethod
    def terminate(self, instance_id: str, zone: str) -> None:
        """Terminate the instance; terminating a terminated or unknown instance is not an error."""

    @abstractmethod
    def list_managed(self, broker_id: str) -> list[InstanceInfo]:
        """Every non-terminated instance tagged ``MANAGED_TAG = broker_id``."""


class SupportsQuotaPreflight:
    """Mixin: check an account quota before creating, so a request that cannot fit is not sent."""

    def preflight(self, req: InstanceRequest) -> None:
        """Raise :class:`QuotaExceeded` if the request would exceed a quota; else return."""
        raise NotImplementedError


class SupportsSweep:
    """Mixin: find and terminate instances that carry our tag but belong to no live attempt."""

    def sweep(self, broker_id: str, live: Iterable[tuple[str, int]]) -> list[InstanceInfo]:
        """Terminate managed instances whose ``(job, attempt)`` tags are not in ``live``; return them."""
        live_set = set(live)
        gone = []
        for inst in self.list_managed(broker_id):  # type: ignore[attr-defined]
            key = (inst.tags.get("fedbroker-job", ""), attempt_of(inst.tags))
            if key not in live_set:  # an unreadable attempt tag belongs to no live attempt: ours, and an orphan
                self.terminate(inst.instance_id, inst.zone)  # type: ignore[attr-defined]
                gone.append(inst)
        return gone


def attempt_of(tags: dict[str, str]) -> int | None:
    """The ``fedbroker-attempt`` tag as an int, ``None`` when missing or not a number (edited by hand)."""
    raw = tags.get("fedbroker-attempt", "")
    return int(raw) if raw.isdigit() else None


@dataclass
class FailoverAttempt:
    """One option tried: the offer id, the error class and message (``None`` = it worked), when (UTC), and
    for which rank of the gang (``None`` when not given)."""

    option: str
    error: str | None
    message: str
    at: str
    rank: int | None = None


@dataclass
class FailoverHistory:
    """The options one job attempt tried, in order (stored with the job as JSON)."""

    attempts: list[FailoverAttempt] = field(default_factory=list)

    def record(self, option: str, error: BaseException | None = None, at: datetime | None = None,
               rank: int | None = None) -> None:
        """Append one try of ``option`` (for ``rank``): ``error`` ``None`` means it worked; ``at`` defaults to
        now (UTC)."""
        at = (at or datetime.now(timezone.utc)).isoformat()
        self.attempts.append(FailoverAttempt(option, type(error).__name__ if error else None,
                                             str(error) if error else "", at, rank))

    def tried(self) -> list[str]:
        """Offer ids tried, in order."""
        return [a.option for a in self.attempts]

    def to_json(self) -> list[dict[str, Any]]:
        """JSON-safe list of ``{"option", "error", "message", "at"}`` (``at`` ISO 8601 UTC)."""
        return [asdict(a) for a in self.attempts]


def instance_tags(job_id: str, attempt: int, rank: int, team: str, broker_id: str) -> dict[str, str]:
    """Tags put on every instance at creation (cost allocation and the orphan sweep)."""
    return {MANAGED_TAG: broker_id, "fedbroker-job": job_id, "fedbroker-attempt": str(attempt),
            "fedbroker-rank": str(rank), "fedbroker-team": team}


#: lifecycle states (``broker.states.JobState`` values) after which a pool's job attempt is over
POOL_TERMINAL = frozenset({"succeeded", "failed", "cancelled", "interrupted"})
#: node states (:attr:`NodeCapacity.state`) in which a node can start a job now
USABLE_NODE_STATES = frozenset({"idle", "mixed"})


@dataclass(frozen=True)
class PoolJobRequest:
    """One job attempt to run on a pool's scheduler (Slurm, Kubernetes).

    ``command`` a shell command run on every node of the allocation (``bash -c`` on Slurm, ``/bin/sh -c`` in the
    container on Kubernetes); ``gpu_type`` the GPU type (Slurm: the GRES type, ``a100``; Kubernetes: the key of
    ``KubernetesSettings.gpu_products``); ``gpus_per_node`` GPUs on each of ``nodes`` nodes; ``estimate_s`` the
    estimated run time (s); ``deadline``/``begin`` aware UTC datetimes or ``None``; ``env`` the job environment
    (``providers.launch.job_environment``; the adapter sets the rank and rendezvous keys per node itself);
    ``priority_class`` picks the QOS (Slurm) or the PriorityClass (Kubernetes) through the pool's settings;
    ``image`` the container image (Kubernetes runs the command in it and requires it; Slurm runs the command on
    the nodes and ignores it); ``time_limit_s`` the job's own wall-clock limit (s; ``None``: from ``estimate_s`` and
    the pool's slack, :func:`pool_time_limit_s`). ``ValueError`` naming the field for a bad value.
    """

    job_id: str
    attempt: int
    team: str
    command: str
    gpu_type: str
    gpus_per_node: int
    estimate_s: float
    nodes: int = 1
    deadline: datetime | None = None
    begin: datetime | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    priority_class: str | None = None
    image: str | None = None
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", self.job_id):
            raise ValueError(f"job_id={self.job_id!r}: must be 1-128 of A-Z a-z 0-9 _ . - (letter or digit first)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", self.team):
            raise ValueError(f"team={self.team!r}: must be 1-63 of A-Z a-z 0-9 _ . - (letter or digit first)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.gpu_type):
            raise ValueError(f"gpu_type={self.gpu_type!r}: must be a GRES type name (A-Z a-z 0-9 _ . -)")
        for name, lo in (("attempt", 0), ("gpus_per_node", 1), ("nodes", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
        if not (isinstance(self.estimate_s, (int, float)) and math.isfinite(self.estimate_s) and self.estimate_s > 0):
            raise ValueError(f"estimate_s={self.estimate_s!r}: must be a finite number of seconds > 0")
        for name in ("deadline", "begin"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, datetime) or v.tzinfo is None):
                raise ValueError(f"{name}={v!r}: must be a timezone-aware datetime (UTC)")
        for k in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"env key {k!r}: not a shell variable name")
        if not self.command.strip():
            raise ValueError("command='': must not be empty")


@dataclass(frozen=True)
class NodeCapacity:
    """One node of a pool: ``gpus_total``/``gpus_used`` per GPU type (``"gpu"`` when the scheduler names none) and
    ``state`` in Slurm's words (sinfo's long state, flags such as ``*`` kept; the Kubernetes adapter maps a node
    onto ``idle``/``mixed``/``allocated``/``drained``/``down``)."""

    node: str
    state: str
    gpus_total: Mapping[str, int]
    gpus_used: Mapping[str, int]

    @property
    def usable(self) -> bool:
        """The node can start a job now: idle or mixed, and no flag (``*`` not responding, ``~`` powered off,
        ``#`` powering up, ``!``/``%`` powering down, ``$`` maintenance, ``@`` reboot pending, ``-`` planned)."""
        return self.state in USABLE_NODE_STATES

    def gpus_free(self, gpu_type: str) -> int:
        """GPUs of ``gpu_type`` a new job can get on this node now (0 when the node is not usable)."""
        if not self.usable:
            return 0
        return max(0, self.gpus_total.get(gpu_type, 0) - self.gpus_used.get(gpu_type, 0))


def free_gpus_of(nodes: Iterable[NodeCapacity]) -> dict[str, int]:
    """GPU type -> GPUs free now over the usable ones of ``nodes`` (a pool's ``capacity()``): the ``free_gpus``
    of every scheduler pool (:class:`providers.slurm.SlurmPool`, :class:`providers.kubernetes.KubernetesPool`)."""
    out: dict[str, int] = {}
    for n in nodes:
        for t in n.gpus_total:
            out[t] = out.get(t, 0) + n.gpus_free(t)
    return out


@dataclass(frozen=True)
class PoolJobInfo:
    """What a pool's scheduler says about one job attempt.

    ``pool_job_id`` the scheduler's id of it (Slurm job id, Kubernetes Job name); ``state`` the lifecycle state
    (``broker.states.JobState`` values: starting, running, succeeded, failed, cancelled, interrupted);
    ``pool_state`` the scheduler's own word for it; ``exit_code`` the command's exit status and ``signal`` the
    signal that ended it (``None`` while it runs or when unknown); ``reason`` a sentence for the lifecycle record;
    ``nodes`` the nodes it runs on (Slurm's node list expression; Kubernetes: node names by rank, comma-joined);
    ``elapsed_s`` run time so far or in all (s); ``tags`` the broker's tags (``fedbroker-broker``, ``-job``,
    ``-attempt``, ``-team``); ``stdout`` where its output is (a path; ``None`` where the pool serves logs
    itself); ``time_limit_s`` the limit the scheduler enforces (s); ``active`` the scheduler still queues or runs
    something of it (true of an attempt that is over for the broker but still holds the cluster: cancel it).
    """

    pool_job_id: str
    state: str
    pool_state: str
    exit_code: int | None
    signal: int | None
    reason: str
    nodes: str
    elapsed_s: float | None
    tags: Mapping[str, str]
    stdout: str | None = None
    time_limit_s: float | None = None
    active: bool = False

    @property
    def terminal(self) -> bool:
        """The attempt is over for the broker (it may still hold the cluster: see :attr:`active`)."""
        return self.state in POOL_TERMINAL


#: the default slack of an attempt's time limit over its estimate (fraction, seconds): the Slurm and Kubernetes
#: pools' defaults (``SlurmSettings``/``KubernetesSettings`` ``slack_frac``, ``slack_s``), and the node agent's
#: (:mod:`workers.agent`): a job that gives no ``time_limit_s`` is stopped after ``estimate x 1.2 + 300 s``
DEFAULT_TIME_LIMIT_SLACK_FRAC = 0.2
DEFAULT_TIME_LIMIT_SLACK_S = 300.0


def pool_time_limit_s(estimate_s: float, slack_frac: float = DEFAULT_TIME_LIMIT_SLACK_FRAC,
                      slack_s: float = DEFAULT_TIME_LIMIT_SLACK_S, time_limit_s: float | None = None) -> float:
    """The wall-clock time limit enforced on an attempt (s), by a pool's scheduler (Slurm ``--time``, Kubernetes
    ``activeDeadlineSeconds``) or the node agent (SIGTERM, grace, SIGKILL): the job's own ``time_limit_s`` when it
    gives one (the Slurm model: the user's limit is the kill time), else ``estimate_s * (1 + slack_frac) + slack_s``.
    E.g. 600 s with 20 % and 300 s slack -> 1020 s; ``time_limit_s=90`` -> 90 s. ``ValueError`` naming a negative
    or non-finite argument (a ``time_limit_s`` must be > 0)."""
    for name, v in (("estimate_s", estimate_s), ("slack_frac", slack_frac), ("slack_s", slack_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}={v!r}: must be a finite number >= 0")
    if time_limit_s is not None:
        if (isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float))
                or not math.isfinite(time_limit_s) or time_limit_s <= 0):
            raise ValueError(f"time_limit_s={time_limit_s!r}: must be a finite number of seconds > 0")
        return float(time_limit_s)
    return estimate_s * (1.0 + slack_frac) + slack_s


def settings_from_section(cls: type, section: Mapping, where: str, kinds: Mapping[str, str]) -> Any:
    """A settings dataclass ``cls`` from one pool's section of a settings file (a YAML/JSON mapping).

    ``kinds`` field -> ``"number"``, ``"int"``, ``"bool"``, ``"str_map"`` (str -> str), ``"map_list"`` (a list of
    mappings), ``"str_list"``; a field not named there must be a string (or null). ``ValueError`` naming
    ``where`` and the key for an unknown key or a value of the wrong type; the checks of ``cls`` name the field
    for a bad value (prefixed with ``where``)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where}: must be a mapping, got {type(section).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    for k, v in section.items():
        kind = kinds.get(k, "str")
        ok = {"number": lambda: not isinstance(v, bool) and isinstance(v, (int, float)),
              "int": lambda: not isinstance(v, bool) and isinstance(v, int),
              "bool": lambda: isinstance(v, bool),
              "str_map": lambda: isinstance(v, Mapping) and all(isinstance(a, str) and isinstance(b, str)
                                                                for a, b in v.items()),
              "map_list": lambda: isinstance(v, list) and all(isinstance(x, Mapping) for x in v),
              "str_list": lambda: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "str": lambda: v is None or isinstance(v, str)}[kind]()
        if not ok:
            what = {"number": "a number", "int": "an integer", "bool": "true or false", "str_map": "a mapping of "
                    "strings to strings", "map_list": "a list of mappings", "str_list": "a list of strings",
                    "str": "a string"}[kind]
            raise ValueError(f"{where}.{k}={v!r}: must be {what}")
    try:
        return cls(**dict(section))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def check_outputs(path: Any, out: dict, not_null: tuple[str, ...], required: tuple[str, ...], module: str) -> None:
    """Check one ``terraform output -json`` mapping (``{name: value}``) read from ``path``: ``ValueError`` naming
    the file and the first output of ``not_null`` whose value is null (an apply that did not finish, or a
    module whose resource was not created), then the ``required`` outputs missing (``module``: the Terraform
    module that outputs them, e.g. ``terraform/aws``)."""
    for name in not_null:
        if name in out and out[name] is None:
            raise ValueError(f"{path}: output {name!r} is null (did `terraform apply` finish? "
                             f"`terraform output {name}` shows it)")
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(f"{path}: outputs {missing} are missing ({module} outputs them)")
