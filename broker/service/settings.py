"""Settings of the live broker: one typed schema, from a YAML file plus environment variables.

Precedence (highest first): keyword arguments, environment variables
``FEDBROKER_<FIELD>`` (nested with ``__``, e.g. ``FEDBROKER_PLANNER__POLICY=backfill``),
the YAML file named by ``FEDBROKER_CONFIG`` (or passed to :func:`load_settings`),
then the defaults below. Unknown keys in the file are errors naming the key, and so is a key given twice in
one mapping (with both lines).

Defaults run everything on one machine: SQLite under ``state_dir``, Redis on
127.0.0.1:6379, the API on 127.0.0.1:8600, the planner every 2 s.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from broker.job_uids import DEFAULT_UID_RANGE, check_uid_range
from broker.model import PLAN_INTERVAL_S, PriorityClass
from broker.planner.core import PlannerConfig
from broker.unique_keys import DuplicateKeyError, UniqueKeyLoader, load_yaml, read_document  # re-exported
from broker.service.redact import HIDDEN, hide_secret_values, is_secret_name, mask_userinfo
from broker.service.signal_settings import SignalsSettings
from providers.registry import PROVIDERS

__all__ = ["BrokerSettings", "QuotaSettings", "TeamQuota", "TeamLimits", "AwsSettings", "AwsRegionSettings",
           "GcpSettings", "CloudSettings", "JobsSettings", "SignalsSettings", "load_settings",
           "SettingsError", "DuplicateKeyError", "UniqueKeyLoader", "load_yaml", "aws_regions", "validation_message"]

_S3_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9._=-]+)*/?$"
_GS_URI = r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[A-Za-z0-9._=-]+)*/?$"


class SettingsError(ValueError):
    """The settings file or environment is invalid; the message names the key and value."""


#: an AZ ID (``use1-az1``, ``usw2-lax1-az1``): the same physical zone in every account
_AZ_ID = re.compile(r"^[a-z]{2,6}[0-9]+(-[a-z0-9]+)?-az[0-9]+$")


@functools.lru_cache(maxsize=1)
def aws_regions() -> tuple[frozenset[str], str]:
    """Every AWS region botocore's bundled endpoint data knows (all partitions: ``aws``, ``aws-us-gov``,
    ``aws-cn``, ...), offline; and botocore's version. An empty set if botocore is not installed."""
    try:
        import boto3
        import botocore
    except ImportError:  # pragma: no cover - boto3 is a dependency
        return frozenset(), ""
    session = boto3.session.Session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return frozenset(regions), botocore.__version__


_DIRECTIONS = {"north": "n", "south": "s", "east": "e", "west": "w", "central": "c", "northeast": "ne",
               "southeast": "se", "northwest": "nw", "southwest": "sw"}


def az_id_prefix(region: str) -> str | None:
    """The prefix of the region's availability zone IDs: ``us-east-1`` -> ``use1``, ``ap-northeast-1`` -> ``apne1``,
    ``us-gov-west-1`` -> ``usgw1`` (AWS's naming of AZ IDs); ``None`` for a region name it cannot read."""
    parts = region.split("-")
    if len(parts) < 3 or not parts[-1].isdigit():
        return None
    gov = parts[1] == "gov"
    words = parts[2:-1] if gov else parts[1:-1]
    if len(words) != 1 or words[0] not in _DIRECTIONS:
        return None
    return parts[0] + ("g" if gov else "") + _DIRECTIONS[words[0]] + parts[-1]


def _closest(word: str, choices) -> str | None:
    """The choice closest to ``word`` (:func:`difflib.get_close_matches`); a tie goes to the longer common
    prefix (``us-eest-1``: ``us-east-1`` rather than ``us-west-1``)."""
    close = difflib.get_close_matches(word, sorted(choices), n=5)
    if not close:
        return None

    def prefix(c: str) -> int:
        return len(os.path.commonprefix([word, c]))

    best = difflib.SequenceMatcher(None, word, close[0]).ratio()
    tied = [c for c in close if difflib.SequenceMatcher(None, word, c).ratio() == best]
    return max(tied, key=lambda c: (prefix(c), [-ord(ch) for ch in c]))


def _zone_of_region(zone: str, region: str) -> bool:
    """Whether ``zone`` is an availability zone NAME of ``region``: ``us-east-1a``, a Local Zone
    (``us-west-2-lax-1a``) or a Wavelength Zone (``us-east-1-wl1-bos-wlz-1``)."""
    suffix = r"([a-z]|-[a-z]+-[0-9]+[a-z]|-wl[0-9]+-[a-z0-9]+-wlz-[0-9]+)"
    return re.fullmatch(re.escape(region) + suffix, zone) is not None


class AwsRegionSettings(BaseModel):
    """One region's network and machine image, named as ``terraform/aws`` outputs them.

    ``ami_id``: the GPU machine image (docker + NVIDIA container toolkit + aws CLI);
    ``subnet_ids_by_az``: private subnet per availability zone name (instances are created only in these
    zones); ``subnet_ids_by_az_id``: the same subnets by AZ ID (``use1-az1``: the price catalog names
    zones this way; the same physical zone in every account); ``security_group_id``: the nodes' group (NCCL between members); ``placement_group_name``:
    cluster placement group used for multi-node gangs; ``instance_profile_name``: the nodes' IAM
    instance profile (least privilege: the checkpoint bucket).
    """

    model_config = ConfigDict(extra="forbid")

    ami_id: str = Field(pattern=r"^ami-[0-9a-f]{8,17}$")
    subnet_ids_by_az: dict[str, str] = Field(min_length=1)
    subnet_ids_by_az_id: dict[str, str] = Field(default_factory=dict)
    security_group_id: str | None = Field(None, pattern=r"^sg-[0-9a-f]{8,17}$")
    placement_group_name: str | None = None
    instance_profile_name: str | None = None
    launch_template_id: str | None = None  # RunInstances starts from it (root volume, encryption); our fields win

    @field_validator("subnet_ids_by_az_id")
    @classmethod
    def _az_ids(cls, v: dict[str, str]) -> dict[str, str]:
        for az_id in v:
            if not _AZ_ID.match(az_id):
                hint = ("that is a zone name: put it under subnet_ids_by_az"
                        if re.fullmatch(r"[a-z]{2}(-[a-z]+)+-[0-9]+[a-z]", az_id) else
                        "AZ IDs look like use1-az1 or usw2-lax1-az1")
                raise ValueError(f"subnet_ids_by_az_id: {az_id!r} is not an AZ ID ({hint})")
        return v


class AwsSettings(BaseModel):
    """AWS burst settings: ``regions`` (region -> :class:`AwsRegionSettings`, from ``terraform output -json``),
    ``endpoint_url`` (an EC2-compatible endpoint; ``None`` = AWS), ``key_name`` (SSH key pair, optional),
    ``checkpoint_uri`` (``s3://bucket/prefix``: job checkpoints survive instances there; ``None`` = checkpoints
    stay on the instance and a requeued job restarts from scratch).

    Region keys must be regions botocore knows (offline endpoint data, every partition); every key of a
    region's ``subnet_ids_by_az`` must be a zone name of that region (``us-east-1a``, ``us-west-2-lax-1a``)."""

    model_config = ConfigDict(extra="forbid")

    regions: dict[str, AwsRegionSettings] = Field(min_length=1)
    endpoint_url: str | None = None
    key_name: str | None = None
    checkpoint_uri: str | None = Field(None, pattern=_S3_URI)

    @field_validator("regions")
    @classmethod
    def _known_regions(cls, v: dict[str, AwsRegionSettings]) -> dict[str, AwsRegionSettings]:
        known, version = aws_regions()
        if not known:  # pragma: no cover - no botocore: nothing to check against
            return v
        for region in v:
            if region in known:
                continue
            close = _closest(region, known)
            hint = (f"did you mean {close!r}?" if close else
                    f"botocore {version} knows {len(known)} regions; a region newer than it needs a newer boto3")
            raise ValueError(f"regions: {region!r} is not an AWS region ({hint})")
        return v

    @model_validator(mode="after")
    def _zones_of_their_region(self) -> "AwsSettings":
        for region, rs in self.regions.items():
            prefix = az_id_prefix(region)
            for az_id in rs.subnet_ids_by_az_id:
                if prefix is not None and not az_id.startswith(prefix + "-"):
                    raise ValueError(f"regions.{region}.subnet_ids_by_az_id: {az_id!r} is not an AZ ID of {region} "
                                     f"(they start with {prefix}-, e.g. {prefix}-az1)")
            for zone in rs.subnet_ids_by_az:
                if _zone_of_region(zone, region):
                    continue
                if _AZ_ID.match(zone):
                    hint = "that is an AZ ID: put it under subnet_ids_by_az_id"
                else:
                    hint = (f"zone names are the region and a letter, e.g. {region}a, or a Local Zone such as "
                            f"{region}-xyz-1a")
                raise ValueError(f"regions.{region}.subnet_ids_by_az: {zone!r} is not a zone of {region} ({hint})")
        return self


class GcpSettings(BaseModel):
    """GCP burst settings, named as ``terraform/gcp`` outputs them: ``project``, ``region`` (instances are created
    only in its zones), ``network``, ``subnetwork``, ``service_account_email``, ``gpu_image``;
    ``api_endpoint`` (a Compute Engine-compatible endpoint; ``None`` = Google), ``operation_timeout_s`` (an insert
    not done by then is reconciled by instance name, not failed), ``checkpoint_uri`` (``gs://bucket/prefix``)."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    region: str = Field(pattern=r"^[a-z]+-[a-z]+[0-9]+$")
    network: str = "global/networks/default"
    subnetwork: str | None = None
    service_account_email: str | None = None
    gpu_image: str = "projects/deeplearning-platform-release/global/images/family/common-cu121-debian-11"
    instance_template: str | None = None  # informational
    api_endpoint: str | None = None
    operation_timeout_s: float = Field(60.0, gt=0, le=3600)
    checkpoint_uri: str | None = Field(None, pattern=_GS_URI)


class CloudSettings(BaseModel):
    """How the broker runs cloud instances (see :mod:`broker.service.cloud`).

    Fields (units):
        broker_id: value of the ``fedbroker-broker`` tag on every instance; the orphan sweep only touches
            instances with this value, so two brokers in one account must differ.
        report_url: where instances report (``POST .../v1/instances/report``); must be reachable from the
            instances' subnets, and ``https://`` unless its host is loopback (reports carry a bearer token).
            ``None`` = ``api_url`` + ``/v1/instances/report``.
        checkpoint_root: instance-local directory of job checkpoints (synced with ``checkpoint_uri``).
        start_deadline_s: seconds from instances created to the container reporting ``running``
            (boot, driver, image pull); past it the attempt is torn down and the job requeued.
        poll_interval_s: seconds between describe calls on the instances of active cloud attempts
            (lost instance, spot reclaimed without a report).
        sweep_interval_s: seconds between orphan sweeps (tagged instances with no live attempt).
        capacity_cooldown_s: an offer that failed with no capacity is not chosen again for this long.
        capacity_cooldown_s also applies after a spot reclaim and a start timeout on the offer.
        quota_cooldown_s: likewise after a quota error (quota rarely frees up by itself) or an unsupported option.
        error_cooldown_s: likewise after any other provider error (an outage, throttling): provisioning backs
            off instead of failing jobs (attempts that created nothing do not count against max_attempts).
        max_failover_options: options (zone -> type -> region -> provider) one attempt may try.
        notice_grace_s: seconds between SIGTERM and SIGKILL for a container on a cloud instance.
        checkpoint_sync_s: seconds between checkpoint uploads while a container runs.
    """

    model_config = ConfigDict(extra="forbid")

    broker_id: str = Field("fedbroker", pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    report_url: str | None = None
    checkpoint_root: str = Field("/var/lib/fedbroker/checkpoints", pattern=r"^/[^\x00\n:]*$")
    start_deadline_s: float = Field(1200.0, gt=0)
    poll_interval_s: float = Field(30.0, gt=0)
    sweep_interval_s: float = Field(300.0, gt=0)
    capacity_cooldown_s: float = Field(600.0, ge=0)
    quota_cooldown_s: float = Field(3600.0, ge=0)
    error_cooldown_s: float = Field(120.0, ge=0)
    max_failover_options: int = Field(8, ge=1, le=100)
    notice_grace_s: int = Field(90, ge=0, le=600)
    checkpoint_sync_s: int = Field(300, ge=10)

    @field_validator("report_url")
    @classmethod
    def _report_url_https(cls, v: str | None) -> str | None:
        """Reports carry the rank's bearer token: ``https://`` unless the host is loopback (a trial on one machine)."""
        if v is None:
            return v
        from urllib.parse import urlsplit

        try:
            u = urlsplit(v)
            host = (u.hostname or "").lower()
        except ValueError:
            raise ValueError(f"report_url={v!r}: not a URL") from None
        if u.scheme == "https" and host:
            return v
        if u.scheme == "http" and _is_loopback(host):
            return v
        raise ValueError(f"report_url={v!r}: must be an https:// URL (instance reports carry a bearer token); "
                         f"plain http:// only for a loopback host (127.0.0.1, ::1, localhost)")


def _is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_USER_RE = re.compile(r"^(?:[0-9]{1,10}|[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?)$")


def _check_job_user(field: str, v: str) -> str:
    if not isinstance(v, str) or not _USER_RE.match(v):
        raise ValueError(f"{field}={v!r}: not a user name or numeric uid")
    if v == "root" or (v.isdigit() and int(v) == 0):
        raise ValueError(f"{field}={v!r}: jobs never run as root (uid 0); name an unprivileged user")
    return v


class JobsSettings(BaseModel):
    """How node agents isolate the jobs they run (see :mod:`workers.isolation`).

    Fields:
        user: the user (name or numeric uid) jobs run as when the agent runs as root; ``None`` = each
            attempt rank under a uid of its own from ``uid_range`` (jobs that share a user can signal
            and read each other; per-attempt uids cannot). ``root`` and uid 0 are refused (a name that
            resolves to uid 0 is refused when the agent starts). When the agent does not run as root it
            cannot switch users: jobs run as the agent's own user (weaker: a job can then read what the
            agent can), and a ``user`` naming anyone else is an error at agent start.
        pool_users: ``{pool: user}``, overrides ``user`` for the agents of that pool.
        team_users: ``{team: user}``, overrides both for that team's jobs (one user per team keeps
            teams' working and checkpoint directories apart).
        root: directory holding the jobs' working directories (``work/<node>/<job>/<attempt>-<rank>``,
            one per attempt and rank, mode 0700, owned by the job's user) and checkpoint directories
            (``checkpoints/<team>/<job>``); every directory above it must be traversable by the job
            users. ``None`` = ``/var/lib/fedbroker/jobs`` when the agent runs as root, else
            ``state_dir/jobs``.
        uid_range: ``[lo, hi]`` (inclusive) of the uids a root agent gives its jobs when no user above
            applies: each attempt rank runs under its own uid (gid = the same number), the lowest one
            free on the host (the systemd ``DynamicUser=`` idea, :mod:`workers.dynamic_users`); default
            ``[61184, 65519]``, systemd's range. Within ``1..2**31-1``, ``lo <= hi``, at least 16 ids.
        blocked_endpoints: ``["host:port", ...]`` a root agent refuses its jobs' uids TCP connections to, on top
            of the broker's own Redis (``redis_url``) and database (``database_url``), which are always blocked
            (:mod:`broker.service.service_endpoints`, served in ``GET /v1/node/config``; e.g. a Redis replica, a
            metrics database). ``host``: a name or address (IPv6 in brackets); ``port``: 1..65535.
    """

    model_config = ConfigDict(extra="forbid")

    user: str | None = None
    pool_users: dict[str, str] = Field(default_factory=dict)
    team_users: dict[str, str] = Field(default_factory=dict)
    root: Path | None = None
    uid_range: tuple[int, int] = DEFAULT_UID_RANGE
    blocked_endpoints: list[str] = Field(default_factory=list)

    @field_validator("blocked_endpoints")
    @classmethod
    def _blocked(cls, v: list[str]) -> list[str]:
        for i, hp in enumerate(v):
            host, sep, port = hp.rpartition(":")
            if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"jobs.blocked_endpoints[{i}]={hp!r}: expected host:port with a port in 1..65535")
        return v

    @field_validator("uid_range", mode="before")
    @classmethod
    def _uid_range(cls, v: Any) -> tuple[int, int]:
        return check_uid_range(v, field="uid_range")  # the message reads "setting jobs.uid_range=..."

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else _check_job_user("jobs.user", v)

    @field_validator("pool_users", "team_users")
    @classmethod
    def _users(cls, v: dict[str, str], info) -> dict[str, str]:
        for k, u in v.items():
            _check_job_user(f"jobs.{info.field_name}[{k!r}]", u)
        return v

    @field_validator("root")
    @classmethod
    def _root(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError(f"jobs.root={str(v)!r}: must be an absolute path")
        return v


class TeamQuota(BaseModel):
    """One team's overrides of :class:`QuotaSettings` (``quotas.per_team.<team>``): a key left out
    inherits the section's value; ``0`` or ``null`` means unlimited for that team (``priority_classes``:
    ``null`` inherits the section's list; a list replaces it, e.g. ``[low, normal, high]`` grants ``high``)."""

    model_config = ConfigDict(extra="forbid")

    max_queued_jobs: int | None = Field(None, ge=0)
    max_queued_spec_bytes: int | None = Field(None, ge=0)
    stored_spec_bytes: int | None = Field(None, ge=0)
    submits_per_s: float | None = Field(None, ge=0)
    burst: int | None = Field(None, ge=0)
    max_schedules: int | None = Field(None, ge=0)
    log_bytes: int | None = Field(None, ge=0)
    priority_classes: tuple[PriorityClass, ...] | None = Field(None, min_length=1)
    max_time_limit_s: float | None = Field(None, ge=0, le=366 * 86400.0)
    max_running_gpus: int | None = Field(None, ge=0)


class FinanceSettings(BaseModel):
    """Who bills whom in the FOCUS export (:mod:`broker.focus`, ``GET /v1/usage/focus``).

    Fields:
        organisation: the operator's organisation: InvoiceIssuerName, ProviderName and PublisherName of the
            on-prem lines (their electricity and amortised capital). Default ``"On-premises operator"``:
            set it (``FEDBROKER_FINANCE__ORGANISATION``).
        billing_account_id: the operator's billing account id (BillingAccountId of on-prem lines, and of a
            cloud's lines when ``cloud_accounts`` names none). Default ``"fedbroker"``.
        billing_account_name: its display name (BillingAccountName; ``None`` = ``organisation``).
        cloud_accounts: provider (``aws``, ``gcp``) -> the account the cloud invoices (AWS payer account id,
            GCP billing account id).
    """

    model_config = ConfigDict(extra="forbid")

    organisation: str = Field("On-premises operator", min_length=1, max_length=200)
    billing_account_id: str = Field("fedbroker", min_length=1, max_length=200)
    billing_account_name: str | None = Field(None, min_length=1, max_length=200)
    cloud_accounts: dict[str, str] = Field(default_factory=dict)


class QuotaSettings(BaseModel):
    """Per-team admission limits of the API (enforced by :mod:`broker.service.limits`).

    Fields (units; ``0`` or ``null`` = unlimited):
        max_queued_jobs: unfinished jobs (any state but succeeded/failed/cancelled,
            :data:`broker.states.UNFINISHED_STATES`) a team may hold; a submit that would exceed it
            answers 429 (``Retry-After: quota_retry_after_s``). Checked in the submit transaction.
        max_queued_spec_bytes: bytes of job spec a team's unfinished jobs may hold in the store, summed over them:
            each job's stored JSON spec (the UTF-8 length of ``json.dumps(spec)``, ASCII as Python writes it, which
            is PostgreSQL's ``octet_length(spec::text)``; :func:`broker.service.store.quota.spec_bytes`). A submit
            (single, batch, schedule fire) that would exceed it answers 429 ``quotas.max_queued_spec_bytes`` like
            ``max_queued_jobs``, in the same transaction. Default 256 MiB (268,435,456): a command may hold 1 MiB
            of argv (:data:`broker.model.MAX_ARGV_BYTES`), so 10,000 queued jobs of one team once stood for
            ~10 GB of specs (hostile pass B3 of issue #20); 256 MiB is 10,000 specs of 26 KiB or 256 of 1 MiB.
        stored_spec_bytes: bytes of job spec (counted as ``max_queued_spec_bytes`` counts them) all of a team's stored
            jobs may hold, finished ones included: a finished job leaves the queued budget at once but its spec stays
            until ``retention_days`` deletes it, so "submit 1 MiB, cancel" at the submit rate once grew the store
            ~4 TB in 30 days. Over it, each reconciler pass deletes the team's oldest finished jobs (as retention
            does, at most ``retention_batch`` a pass) until it is within it; unfinished jobs are never deleted
            (``max_queued_spec_bytes`` bounds them, and must be set and not above this one). Default 1 GiB.
        submits_per_s: sustained submits per second per team (token bucket in Redis, shared by every
            API process); a batch charges one token per new item. Over it: 429 with ``Retry-After``.
        burst: bucket size, submits. A batch bigger than ``burst`` is let in once the bucket is full and
            leaves it in debt (so the long-run rate still holds). ``0``/``null`` with a rate: one second of
            submits, ``ceil(submits_per_s)``.
        quota_retry_after_s: the ``Retry-After`` of a queued-jobs or spec-bytes 429, seconds.
        max_schedules: schedules a team may hold (enabled or paused); a create over it answers 429
            ``quotas.max_schedules``. Default 100 (1,200 every-minute schedules of one team once held the
            reconciler ~17 s a minute).
        log_bytes: bytes of job output (UTF-8, every attempt and rank) the store keeps per team; over it the
            reconciler trims the team's oldest logs first (:mod:`broker.service.log_budget`). Default 1 GiB.
        priority_classes: the priority classes a team's members may submit (jobs, batches, schedules; an admin
            token may use any); a class above them answers 403 naming ``spec.priority_class`` and the allowed
            classes, and the planner never ranks (or lets preempt) a stored job above its team's highest
            class. Default ``[low, normal]``: grant ``high``/``critical`` per team (``per_team.<team>``).
        max_time_limit_s: the longest wall-clock limit an attempt of a team's job may have, seconds (Slurm's
            partition ``MaxTime``): a job whose limit (its ``time_limit_s``, else ``estimated_duration_s x 1.2 +
            300 s``, :func:`providers.base.pool_time_limit_s`) is longer answers 422 naming the field, and a
            schedule's fire is skipped. Default 7 days (604,800 s): a member's 31,000,000 s limit once held a node
            for a year and told the team waiting behind it "expected start in 8611 h".
        max_running_gpus: GPUs a team's jobs may hold at once (Slurm's ``GrpTRES=gres/gpu``, a Kueue nominal
            quota): the GPUs (``gpus_per_node x nodes``) of its provisioning, starting and running jobs, cloud ones
            included. The planning cycle leaves a waiting job out of a cycle's plan while placing it would bring its
            team over the cap (:mod:`broker.service.cycle`), and says so in its reason; it is planned again once
            the team's jobs release GPUs. Default ``null`` (unlimited): 4 jobs of one member, each estimated at 60 s
            with a 7-day ``time_limit_s``, once held every GPU of a site for up to 7 days.
        per_team: ``team -> TeamQuota`` overrides.

    The rate limit needs Redis: while Redis is unreachable submits are let through (fail open) with a
    warning in the API's log at most once a minute; the queued-jobs and spec-bytes quotas still hold (they are in
    the database).
    """

    model_config = ConfigDict(extra="forbid")

    max_queued_jobs: int | None = Field(10000, ge=0)
    max_queued_spec_bytes: int | None = Field(256 * 1024 ** 2, ge=0)
    stored_spec_bytes: int | None = Field(1024 ** 3, ge=0)
    submits_per_s: float | None = Field(50.0, ge=0)
    burst: int | None = Field(200, ge=0)
    quota_retry_after_s: int = Field(30, ge=1, le=3600)
    max_schedules: int | None = Field(100, ge=0)
    log_bytes: int | None = Field(1024 ** 3, ge=0)
    priority_classes: tuple[PriorityClass, ...] = Field((PriorityClass.low, PriorityClass.normal), min_length=1)
    max_time_limit_s: float | None = Field(7 * 86400.0, ge=0, le=366 * 86400.0)
    max_running_gpus: int | None = Field(None, ge=0)
    per_team: dict[str, TeamQuota] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _queued_within_stored(self) -> "QuotaSettings":
        """The stored-spec budget can only be kept if the unfinished jobs' specs stay below it: for the section and
        every team with a ``stored_spec_bytes``, ``max_queued_spec_bytes`` must be set and not above it."""
        for team in (None, *sorted(self.per_team)):
            if team is None:
                queued, stored, where = self.max_queued_spec_bytes or None, self.stored_spec_bytes or None, "quotas"
            else:
                lim = self.for_team(team)
                queued, stored, where = lim.max_queued_spec_bytes, lim.stored_spec_bytes, f"quotas.per_team.{team}"
            if stored is not None and (queued is None or queued > stored):
                raise ValueError(
                    f"{where}: max_queued_spec_bytes ({'unlimited' if queued is None else queued}) must be set and "
                    f"at most stored_spec_bytes ({stored}): the reconciler keeps stored_spec_bytes by deleting "
                    f"finished jobs only, so unfinished jobs' specs must fit within it (or set stored_spec_bytes "
                    f"to 0, unlimited)")
        return self

    def for_team(self, team: str) -> "TeamLimits":
        """The limits that apply to ``team`` (its overrides over the section's values), ``None`` = unlimited."""
        o = self.per_team.get(team)
        vals = {k: getattr(self, k) for k in ("max_queued_jobs", "max_queued_spec_bytes", "stored_spec_bytes",
                                              "submits_per_s", "burst", "max_schedules", "log_bytes",
                                              "priority_classes", "max_time_limit_s", "max_running_gpus")}
        if o is not None:
            vals.update({k: getattr(o, k) for k in o.model_fields_set})
        rate = vals["submits_per_s"] or None
        burst = vals["burst"] or None
        if rate is not None and burst is None:
            burst = max(1, math.ceil(rate))
        return TeamLimits(max_queued_jobs=vals["max_queued_jobs"] or None,
                          max_queued_spec_bytes=vals["max_queued_spec_bytes"] or None,
                          stored_spec_bytes=vals["stored_spec_bytes"] or None, submits_per_s=rate,
                          burst=burst if rate is not None else None, max_schedules=vals["max_schedules"] or None,
                          log_bytes=vals["log_bytes"] or None,
                          priority_classes=tuple(vals["priority_classes"] or self.priority_classes),
                          max_time_limit_s=vals["max_time_limit_s"] or None,
                          max_running_gpus=vals["max_running_gpus"] or None)


class TeamLimits(BaseModel):
    """The effective limits of one team (:meth:`QuotaSettings.for_team`); ``None`` = unlimited."""

    model_config = ConfigDict(frozen=True)

    max_queued_jobs: int | None = None
    max_queued_spec_bytes: int | None = None
    stored_spec_bytes: int | None = None
    submits_per_s: float | None = None
    burst: int | None = None
    max_schedules: int | None = None
    log_bytes: int | None = None
    priority_classes: tuple[PriorityClass, ...] = (PriorityClass.low, PriorityClass.normal)
    max_time_limit_s: float | None = None
    max_running_gpus: int | None = None

    @property
    def max_priority_rank(self) -> int:
        """The highest :attr:`broker.model.PriorityClass.rank` among :attr:`priority_classes` (0 low .. 3 critical)."""
        return max(c.rank for c in self.priority_classes)


class BrokerSettings(BaseSettings):
    """Everything the API, Celery workers, beat and node agents read.

    Fields (units):
        database_url: SQLAlchemy URL of the job store; ``postgresql+psycopg://...`` in
            production, ``sqlite:///PATH`` for a single-machine trial (default: ``state_dir/fedbroker.db``).
        database_schema: PostgreSQL schema holding the tables (``None`` = the default ``search_path``).
        redis_url: Celery broker and the planner's leader lock.
        trial: a single-user trial on one machine (``serve all --trial`` sets it, as ``FEDBROKER_TRIAL=1``): ``serve
            all`` then runs with a Redis or database URL that has no password (it refuses to otherwise), prints a
            WARNING block, and ``/healthz`` carries a ``"trial"`` line naming them
            (:func:`broker.service.service_endpoints.trial_notice`). Default off.
        state_dir: where the embedded database, node agents' job directories and logs live.
        api_host, api_port: where ``fedbroker serve api`` listens.
        api_url: where the SDK and CLI reach the API.
        api_certfile, api_keyfile: PEM certificate (chain) and private key: ``serve api`` speaks HTTPS
            (give both or neither; ``--certfile/--keyfile`` override them).
        api_max_connections: open connections ``serve api`` holds at most; a request above it is a 503
            (read timeouts and keep-alive limits: :mod:`broker.service.httpserver`).
        api_max_connections_per_peer: open connections ``serve api`` holds at most from one client address (per
            API process; ``0`` = no per-address cap; at most ``api_max_connections``). One more is answered a short
            503 with ``Retry-After`` and closed before it reaches the app, so one host holding slow or idle
            connections cannot fill ``api_max_connections`` for every other team (and for node agents, whose
            heartbeats failing for ``node_lost_after_s`` get their node declared lost): it would take
            ``api_max_connections / api_max_connections_per_peer`` addresses (1000 / 64: 16). It counts the TCP
            peer (``X-Forwarded-For`` is not trusted): behind a reverse proxy every client is the proxy's address,
            so set ``0`` there and let the proxy cap per client (nginx ``limit_conn``). An IPv6 address counts on
            its own (a host with a /64 has many); an IPv4-mapped ``::ffff:a.b.c.d`` counts as ``a.b.c.d``.
            Loopback is capped too: on one machine the agent (2 connections: its loop and its long-poll), the SDK
            (one keep-alive connection per session) and the CLI are all ``127.0.0.1``, far below 64. Node agents
            behind one NAT address share it: keep it above twice their number. Default 64,
            lowered to ``api_max_connections`` when that is set below 64 and this is not given.
        api_list_max_bytes: the most bytes of stored job specs one ``GET /v1/jobs`` page carries (:func:`broker.
            service.store.quota.spec_bytes`, as stored); the page ends before the job that would pass it (at least
            one job) and its ``X-Next-Offset`` header says where the next page starts. Default 8 MiB: a member's
            1,000-job page of 2.75 MB specs (allowed by the spec budgets) was 342 MiB, held the API 8.6-11 s and
            2 GB of memory, and two in parallel made a node's heartbeat 28.5 s stale.
        cluster: YAML file of on-prem pools (site, grid zones, PUE, $/GPU-h); node agents
            register the hosts. ``None`` = the bundled ``broker/data/local_cluster.yaml``.
        planner: the planner's settings (policy, carbon price, ...), see :class:`PlannerConfig`.
        cloud_providers: cloud providers whose offers may be provisioned (names in
            :data:`providers.registry.PROVIDERS`: ``aws``, ``gcp``; each needs its section below); empty =
            on-prem only (cloud offers are still costed and shown as alternatives in explain records).
        aws, gcp: provider settings (:class:`AwsSettings`, :class:`GcpSettings`), from Terraform outputs
            (``fedbroker cloud settings-from-terraform``).
        cloud: how cloud instances are run and watched (:class:`CloudSettings`).
        plan_interval_s: seconds between planning cycles (beat; default :data:`broker.model.PLAN_INTERVAL_S`, 2 s,
            also the simulator's default step).
        reconcile_interval_s: seconds between reconciler passes (beat).
        heartbeat_interval_s: seconds between node-agent heartbeats.
        node_lost_after_s: a node silent this long is lost; its jobs are requeued.
        dispatch_retry_s: a ``provisioning`` job whose provision message was lost is sent again after
            max(this, 300) seconds (on-prem agents poll; nothing to re-send).
        starting_deadline_s: a job still ``starting`` after this long goes back to the queue.
        provisioning_deadline_s: a job still ``provisioning`` after this long goes back to the queue.
        cancel_grace_s: seconds between SIGTERM and SIGKILL when a job is cancelled or preempted.
        planner_lock_ttl_s: TTL of the planner's Redis lock (a crashed leader frees it after this).
        log_chunk_bytes, log_max_bytes: log shipping chunk size and cap per attempt and rank, bytes. Over the cap
            the node's shim and the store keep the head and the tail (``log_max_bytes // 2``), with one
            ``[fedbroker: ... N bytes dropped ...]`` line between.
        log_trim_keep_bytes: bytes of head and of tail (whole chunks) a log keeps when its team is over its
            ``quotas.log_bytes`` and the reconciler trims it (:mod:`broker.service.log_budget`). Default 64 KiB.
        admin_token: DEPRECATED (a warning is logged at startup): a plaintext admin API token that always works
            and never expires. Use ``admin_token_sha256`` for a break-glass admin, or a stored admin token
            (``fedbroker tokens create --team ops --admin``: the bootstrap on a fresh store).
        admin_token_sha256: SHA-256 hex digest (64 lower-case hex) of a break-glass admin token; the secret itself
            is never in the settings (``printf %s "$TOKEN" | sha256sum``).
        token_ttl_days: default lifetime of a new or rotated API token, days (at most 3650).
        max_attempts: a job whose attempts keep ending without an exit code (node lost, start
            timed out, could not be launched) fails after this many attempts.
        jobs: how node agents isolate jobs: their user and directories (:class:`JobsSettings`).
        intake_batch: jobs per intake transaction of a planning cycle (a burst is taken in
            several short transactions, so a cancel never waits behind one long one).
        intake_per_cycle: most jobs one planning cycle takes in (0: all), round-robin across teams,
            oldest first within a team; the rest wait for the next cycle, which is requested at once.
            Keeps a cycle short during a burst (~0.5-1 ms a job for intake and its first note on 2
            loaded cores): 200 keeps an intake cycle near 0.2-0.3 s, so another team's job waits at most
            about two such cycles. Default 200.
        retention_days: days a finished (succeeded, failed, cancelled) job is kept after it
            finished; then the reconciler deletes the job row and its events, logs, attempts and
            cloud-instance records (a job with a cloud instance not yet terminated is kept until it
            is). Nothing is archived; ``fedbroker jobs``/the API no longer know the job, and its
            idempotency key may be used again. Fair share counts attempts of the last 56 days
            (8 half-lives), so with less than that the oldest usage (weight < 5 % at 30 days) is
            forgotten early. ``0`` keeps everything forever. Default 30.
        retention_batch: most jobs one reconciler pass deletes (one short transaction).
        audit_retention_days: days an audit event (``audit_events``: token, job, schedule and budget changes;
            ``fedbroker audit``, ``GET /v1/audit``) is kept after it was recorded (its ``at``); then the reconciler
            deletes it. Independent of ``retention_days``: the audit log outlives the jobs it names, as an audit
            trail is commonly kept a year or more (SOC 2 reviews a 12-month period; PCI DSS 10.5.1 asks for 12
            months). ``0`` keeps every event forever. Default 400 (a year and a month of slack).
        audit_retention_batch: most audit events one reconciler pass deletes (one short transaction, oldest
            first). Default 5,000: a pass every ``reconcile_interval_s`` (5 s) purges up to 1,000 events/s, 20x one
            team's default sustained ``quotas.submits_per_s`` (each submit writes one event).
        schedule_runs_per_pass: most scheduled runs one reconciler pass creates, round-robin across teams
            (each team's earliest due fire first); the rest fire in the next passes. Default 100 (a run took
            ~14 ms to create on 2 loaded cores: one pass stays near 1.5 s however many schedules are due).
        quotas: per-team queued-jobs quota and submit rate limit (:class:`QuotaSettings`).
        finance: the organisation and billing accounts of the FOCUS export (:class:`FinanceSettings`).
        signals: which live sources serve each zone's carbon and price, keys, refresh periods and staleness
            limits (:class:`broker.service.signal_settings.SignalsSettings`); none = the bundled replay.
        api_token_cache_s: seconds the API keeps a token it authenticated in memory (per process, at
            most 10,000 tokens); a revoked token keeps working for up to this long. ``0`` = no cache.
        api_workers: uvicorn worker processes of ``fedbroker serve api`` (each its own pool and cache).
    """

    model_config = SettingsConfigDict(env_prefix="FEDBROKER_", env_nested_delimiter="__", extra="forbid")

    database_url: str | None = None
    database_schema: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    trial: bool = False
    state_dir: Path = Path(".fedbroker")
    api_host: str = "127.0.0.1"
    api_port: int = Field(8600, ge=1, le=65535)
    api_url: str | None = None
    api_certfile: Path | None = None
    api_keyfile: Path | None = None
    api_max_connections: int = Field(1000, ge=1, le=100_000)
    api_max_connections_per_peer: int = Field(64, ge=0, le=100_000)
    api_list_max_bytes: int = Field(8 * 1024 ** 2, ge=1, le=1024 ** 3)
    cluster: Path | None = None
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    cloud_providers: tuple[str, ...] = ()
    aws: AwsSettings | None = None
    gcp: GcpSettings | None = None
    cloud: CloudSettings = Field(default_factory=CloudSettings)
    plan_interval_s: float = Field(PLAN_INTERVAL_S, gt=0)
    reconcile_interval_s: float = Field(5.0, gt=0)
    heartbeat_interval_s: float = Field(2.0, gt=0)
    node_lost_after_s: float = Field(30.0, gt=0)
    dispatch_retry_s: float = Field(10.0, gt=0)
    starting_deadline_s: float = Field(120.0, gt=0)
    provisioning_deadline_s: float = Field(900.0, gt=0)
    cancel_grace_s: float = Field(10.0, ge=0)
    planner_lock_ttl_s: float = Field(60.0, gt=0)
    log_chunk_bytes: int = Field(64 * 1024, ge=1024)
    log_max_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    log_trim_keep_bytes: int = Field(64 * 1024, ge=0)
    admin_token: str | None = None
    admin_token_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    token_ttl_days: float = Field(90.0, gt=0, le=3650)
    max_attempts: int = Field(5, ge=1)
    jobs: JobsSettings = Field(default_factory=JobsSettings)
    intake_batch: int = Field(250, ge=1, le=100_000)
    intake_per_cycle: int = Field(200, ge=0, le=1_000_000)
    retention_days: float = Field(30.0, ge=0, le=36_500)
    retention_batch: int = Field(500, ge=1, le=100_000)
    audit_retention_days: float = Field(400.0, ge=0, le=36_500)
    audit_retention_batch: int = Field(5000, ge=1, le=100_000)
    schedule_runs_per_pass: int = Field(100, ge=1, le=100_000)
    quotas: QuotaSettings = Field(default_factory=QuotaSettings)
    finance: FinanceSettings = Field(default_factory=FinanceSettings)
    signals: SignalsSettings = Field(default_factory=SignalsSettings)
    api_token_cache_s: float = Field(5.0, ge=0, le=300)
    api_workers: int = Field(1, ge=1, le=64)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("cloud_providers")
    @classmethod
    def _providers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            if p not in PROVIDERS:
                raise ValueError(f"cloud_providers: {p!r} is not a known provider ({', '.join(PROVIDERS)})")
        if len(set(v)) != len(v):
            raise ValueError(f"cloud_providers={list(v)!r}: lists a provider twice")
        return v

    @model_validator(mode="after")
    def _per_peer_cap(self) -> "BrokerSettings":
        if self.api_max_connections_per_peer > self.api_max_connections:
            if "api_max_connections_per_peer" in self.model_fields_set:
                raise ValueError(f"api_max_connections_per_peer={self.api_max_connections_per_peer} is above "
                                 f"api_max_connections={self.api_max_connections}: a per-address cap must be at most "
                                 f"the cap of the whole process (0 = no per-address cap)")
            self.api_max_connections_per_peer = self.api_max_connections  # the default, under a small global cap
        return self

    @model_validator(mode="after")
    def _provider_sections(self) -> "BrokerSettings":
        for p in self.cloud_providers:
            section = PROVIDERS[p].settings_section
            if getattr(self, section) is None:
                raise ValueError(f"cloud_providers lists {p!r} but the {section!r} section is missing "
                                 f"(see `fedbroker cloud settings-from-terraform --provider {p}`)")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls)

    # ------------------------------------------------------------------ derived
    @property
    def effective_database_url(self) -> str:
        """``database_url`` or the embedded SQLite file under ``state_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.state_dir / 'fedbroker.db').resolve()}"

    @property
    def effective_api_url(self) -> str:
        """``api_url``, or ``http://api_host:api_port``."""
        return self.api_url or f"http://{self.api_host}:{self.api_port}"

    @property
    def effective_report_url(self) -> str:
        """Where cloud instances report: ``cloud.report_url`` or the API's ``/v1/instances/report``."""
        return self.cloud.report_url or f"{self.effective_api_url.rstrip('/')}/v1/instances/report"


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by ``FEDBROKER_CONFIG`` (a mapping of the fields above; a key given twice
    is an error naming it and its lines)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("FEDBROKER_CONFIG")
        if not path:
            return {}
        p = Path(path)
        try:
            data = read_document(p, p.read_text(), as_json=False) or {}  # YAML whatever its suffix, as always
        except OSError as e:
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: cannot read ({e.strerror or e})") from None
        except DuplicateKeyError as e:
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: {e}") from None
        except yaml.YAMLError as e:
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: must hold a mapping of settings, got {type(data).__name__}")
        return data


#: a validator's own message that starts by naming a field path: "regions: ...", "regions.us-east-1.x: ...", "x=..."
_OWN_MSG = re.compile(r"^[a-z_][a-z0-9_]*(\.[A-Za-z0-9_-]+)*(: |=)")


def validation_message(e: ValidationError, prefix: str = "setting") -> str:
    """One line for the first error of ``e``: ``setting <dotted key>=<value>: <why>``; a message of our own
    validators, which names its field, gets the dotted path of the section in front instead of the value
    (``setting aws.regions: 'us-eest-1' is not an AWS region (did you mean 'us-east-1'?)``). The value of a
    field whose name looks secret (:func:`broker.service.redact.is_secret_name`) is shown as ``<hidden>``, and a
    ``user:password@`` in the line as ``user:***@``."""
    err = e.errors()[0]
    parts = [str(x) for x in err["loc"]]
    if any(map(is_secret_name, err["loc"])):  # never echo a key, token or password, nor anything under one
        return mask_userinfo(f"{prefix} {'.'.join(parts)}={HIDDEN}: {err['msg']}")
    loc = ".".join(parts)
    msg = str(err["msg"])
    own = msg.startswith("Value error, ")
    msg = msg.removeprefix("Value error, ")
    if not loc:  # a rule across fields: the message names them
        return f"settings: {msg}"
    if own and _OWN_MSG.match(msg):
        head = re.split(r"[.:=]", msg, maxsplit=1)[0]
        parent = parts[:-1] if head == parts[-1] else parts
        return mask_userinfo(f"{prefix} {'.'.join(parent + [msg])}")
    shown = hide_secret_values(err.get("input"))
    return mask_userinfo(f"{prefix} {loc}={shown!r}: {err['msg']}")


def load_settings(config: str | Path | None = None, **overrides) -> BrokerSettings:
    """Settings from ``config`` (or ``$FEDBROKER_CONFIG``), the environment and ``overrides``.

    Raises :class:`SettingsError` naming the first bad key and value.
    """
    old = os.environ.get("FEDBROKER_CONFIG")
    try:
        if config is not None:
            os.environ["FEDBROKER_CONFIG"] = str(config)
        return BrokerSettings(**overrides)
    except PydanticSettingsError as e:  # an environment variable that is not valid JSON for a list/mapping field
        raise SettingsError(f"{e}: a list or mapping setting takes JSON in the environment, "
                            f"e.g. FEDBROKER_CLOUD_PROVIDERS='[\"aws\"]'") from None
    except ValidationError as e:
        raise SettingsError(validation_message(e)) from None
    finally:
        if config is not None:
            if old is None:
                os.environ.pop("FEDBROKER_CONFIG", None)
            else:
                os.environ["FEDBROKER_CONFIG"] = old
