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

Every error carries the option it happened on. :class:`FailoverHistory` keeps, per
job attempt, each option tried, the error and the time, and is stored with the job.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable

__all__ = ["ProviderError", "NoCapacity", "Unsupported", "QuotaExceeded", "Throttled", "SchedulerUnavailable", "InstanceRequest",
           "InstanceInfo", "Compute", "SupportsQuotaPreflight", "SupportsSweep", "FailoverHistory", "FailoverAttempt",
           "idempotency_token", "as_uuid", "instance_tags", "attempt_of", "MANAGED_TAG", "check_outputs"]

#: tag/label key on every instance the broker creates; its value is the broker id
MANAGED_TAG = "fedbroker-broker"


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
