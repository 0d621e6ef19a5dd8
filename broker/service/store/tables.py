"""The job store's schema (SQLAlchemy 2 declarative models).

Tables:

* ``jobs`` — one row per job: spec, state and ``version`` (compare-and-set),
  window (``not_before``, ``not_after``, ``deadline``), the planner's latest
  decision record (the explain record), placement, attempt counter.
* ``job_events`` — the state history: every applied transition with time and reason.
* ``attempts`` — one row per try of a job on a node (or instance): GPUs, start, end, exit code, outcome.
* ``job_logs`` — captured stdout/stderr of attempts, in ordered chunks shipped by node agents.
* ``nodes`` — on-prem hosts: inventory, healthy GPUs, last heartbeat and NVML telemetry.
* ``cloud_instances`` — cloud instances with their intent records (a row is written
  *before* the provider's create call; see ARCHITECTURE.md §5).
* ``cloud_instance_events`` — the instance state history: every state change of a ``cloud_instances``
  row (:mod:`broker.instance_states`) with time and reason.
* ``schedules`` — recurring runs (cron expression + IANA time zone) that create jobs.
* ``api_tokens`` — API tokens (kind, team, expiry, last use), stored as SHA-256 hashes only.
* ``audit_events`` — who (token id, team, kind) did what (token operations, job submits and
  cancels, schedule changes) to which target, written in the transaction of the change.
* ``usage_records`` — the finance ledger: one row per metered resource of an attempt rank
  (:class:`broker.usage.UsageRecord`), written in the transaction that ends the attempt; unique on
  (job, attempt, rank, line, resource), so a replayed end meters once.
* ``budgets`` — per team monthly cloud budgets (USD cap, soft alert fraction) set by an admin
  (:mod:`broker.service.budgets`), with the month whose soft alert was already raised.
* ``signal_values`` — the durable copy of the live signal cache: one value per (source, zone, UTC hour) of
  carbon intensity (gCO2e/kWh) or electricity price (USD/MWh), measured or forecast, with when it was fetched
  (:mod:`broker.service.signal_cache`; Redis holds the fast copy).
* ``signal_fetches`` — per (source, zone, kind): the last fetch attempt and success, the last error and the
  error counts by class (the staleness gauge and fetch error counter of ``/metrics``).
* ``planner_state`` — one row: the planner fence (``version`` is bumped by every
  applied planning cycle; a cycle planned on an older version is discarded).

All instants are stored as timezone-aware UTC (:class:`UtcDateTime`); SQLite,
which has no time zone type, gives them back as UTC too. Schema changes go
through Alembic (``broker/service/store/migrations``); see :func:`broker.service.store.core.JobStore.migrate`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, MetaData, String,
                        Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = ["UtcDateTime", "Base", "Job", "JobEvent", "Attempt", "JobLog", "Node", "CloudInstance", "CloudInstanceEvent", "Schedule",
           "ApiToken", "AuditEvent", "UsageRow", "Budget", "ProjectBudget", "SignalValue", "SignalFetch", "PlannerState", "utcnow"]


def utcnow() -> datetime:
    """The current instant, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class UtcDateTime(TypeDecorator):
    """A ``DateTime(timezone=True)`` that only accepts aware datetimes and always returns UTC.

    Raises ``ValueError`` when given a naive datetime (the field is named by the caller's stack).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()!r} given to a UTC column")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:  # SQLite
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


# Deterministic constraint names, so Alembic migrations are stable across databases.
_NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base: deterministic constraint names; ``datetime`` columns are :class:`UtcDateTime`."""

    metadata = MetaData(naming_convention=_NAMING)
    type_annotation_map = {datetime: UtcDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    """One job: spec (JSON), state + ``version`` (compare-and-set), window instants (UTC), latest decision record, placement, attempt counter; ``work_done_s`` in reference-GPU seconds."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team: Mapped[str] = mapped_column(String(63), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    version: Mapped[int] = mapped_column(Integer, default=1)
    priority: Mapped[int] = mapped_column(Integer)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    spec_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    #: earliest instant the job may start (window start, or end of a deferral)
    not_before: Mapped[datetime | None]
    #: latest instant the job may start (window end); past it the job fails
    not_after: Mapped[datetime | None]
    #: latest completion instant the planner aims for
    deadline: Mapped[datetime]
    #: a job waiting for on-prem capacity is re-decided at this instant
    review_at: Mapped[datetime | None]
    committed_pool: Mapped[str | None] = mapped_column(String(63))
    deferred_once: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str] = mapped_column(Text, default="")
    #: the latest planner decision record (chosen option + best alternatives)
    decision: Mapped[dict[str, Any] | None]
    #: {"kind": "onprem", "pool": ..., "nodes": [{"node": ..., "gpus": [..], "rank": r}]} or a cloud offer
    placement: Mapped[dict[str, Any] | None]
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    dispatched_at: Mapped[datetime | None]
    #: the current state must be left by this instant (starting, provisioning), else the reconciler acts
    state_deadline_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    #: "preempt" when the planner asked the agent to stop the job for a higher-priority one
    stop_reason: Mapped[str | None] = mapped_column(String(32))
    started_at: Mapped[datetime | None]
    #: indexed: the reconciler's retention pass reads the jobs finished before a cutoff
    finished_at: Mapped[datetime | None] = mapped_column(index=True)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    #: reference-GPU seconds of work already done and checkpointed (restarts resume from it)
    work_done_s: Mapped[float] = mapped_column(Float, default=0.0)
    schedule_id: Mapped[str | None] = mapped_column(String(40))

    __table_args__ = (
        UniqueConstraint("team", "idempotency_key", name="uq_jobs_team_idempotency_key"),
        Index("ix_jobs_state_priority_created", "state", "priority", "created_at"),
        Index("ix_jobs_team_state", "team", "state"),
        #: the reconciler's stored-spec budget deletes a team's oldest finished jobs (migration 0017)
        Index("ix_jobs_team_finished_at", "team", "finished_at"),
    )


class JobEvent(Base):
    """One applied transition of a job: when (UTC), from/to state, the version it produced, why."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime]
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    version: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text, default="")


class Attempt(Base):
    """One try of a job on nodes or an instance: GPUs, start/end (UTC), exit code per rank, outcome."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # onprem | cloud | a pool kind (slurm, kubernetes)
    #: the attempt's job in an existing scheduler (the Slurm job id); ``None`` until submitted, and for other kinds
    external_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    pool: Mapped[str | None] = mapped_column(String(63))
    offer_id: Mapped[str | None] = mapped_column(String(200))
    #: [{"node": name, "gpus": [indices], "rank": r}]
    nodes: Mapped[list[Any]]
    gpu_type: Mapped[str | None] = mapped_column(String(32))
    gpus: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    #: per rank: {"rank": exit code}; the attempt ends when every rank has one
    rank_exits: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    outcome: Mapped[str | None] = mapped_column(String(16))  # succeeded|failed|cancelled|interrupted|lost
    reason: Mapped[str] = mapped_column(Text, default="")
    #: cloud attempts: every option tried (``providers.base.FailoverHistory.to_json``), in order
    failover: Mapped[list[Any] | None]
    #: on-prem energy counters read when the attempt started (:func:`broker.service.ledger.snapshot_counters`):
    #: ``{"start": {node: {"at": iso UTC, "gpus": {index: {"energy_mj": int|None, "power_w": float|None}}}}}``
    meter: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),)


class JobLog(Base):
    """One chunk (``seq``) of an attempt rank's captured stdout+stderr, UTF-8 text."""

    __tablename__ = "job_logs"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer, default=0)
    seq: Mapped[int] = mapped_column(Integer)
    data: Mapped[str] = mapped_column(Text)
    #: UTF-8 size of ``data`` (what the team's ``quotas.log_bytes`` budget sums)
    bytes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: > 0: this chunk is the marker of a trimmed log, standing for that many dropped bytes (:mod:`broker.service.log_budget`)
    dropped_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank", "seq", name="uq_job_logs_chunk"),)


class Node(Base):
    """An on-prem host as its agent last reported it: GPUs, healthy GPU indices, heartbeat (UTC), NVML telemetry."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    pool: Mapped[str] = mapped_column(String(63), index=True)
    gpu_type: Mapped[str] = mapped_column(String(32))
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_memory_gb: Mapped[float] = mapped_column(Float)
    #: indices of the GPUs that may receive work (unhealthy/lost GPUs are left out)
    healthy_gpus: Mapped[list[Any]]
    state: Mapped[str] = mapped_column(String(16), default="up")  # up | lost
    agent_id: Mapped[str] = mapped_column(String(64))
    registered_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime]
    telemetry: Mapped[dict[str, Any] | None]


class CloudInstance(Base):
    """A cloud instance of an attempt rank; the row is the intent record written before the create call."""

    __tablename__ = "cloud_instances"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer, default=0)
    offer_id: Mapped[str] = mapped_column(String(200))
    provider: Mapped[str] = mapped_column(String(16))
    region: Mapped[str] = mapped_column(String(40))
    zone: Mapped[str] = mapped_column(String(40))
    instance_type: Mapped[str] = mapped_column(String(40))
    market: Mapped[str] = mapped_column(String(16))
    #: derived from (job, attempt, offer, rank); the provider's idempotency token / requestId
    idempotency_token: Mapped[str] = mapped_column(String(64), unique=True)
    #: intent | running | terminating | terminated | abandoned | failed (indexed: the watch reads the live ones)
    state: Mapped[str] = mapped_column(String(16), index=True)
    provider_instance_id: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime]
    #: indexed: every planning cycle reads the records changed within the cooldowns
    updated_at: Mapped[datetime] = mapped_column(index=True)
    history: Mapped[list[Any]]
    #: rank's private address (rank 0's is the rendezvous endpoint of the others)
    private_ip: Mapped[str | None] = mapped_column(String(64))
    #: last report from the instance (UTC) and its event (running | notice | exited)
    last_report_at: Mapped[datetime | None]
    last_event: Mapped[str | None] = mapped_column(String(16))
    #: the highest report sequence number taken from this rank's instance (``seq`` form field); a report
    #: with a sequence number not above it is a replay and changes nothing
    report_seq: Mapped[int | None]
    #: the provider's error when the create failed, or why the instance was terminated
    error: Mapped[str | None] = mapped_column(Text)
    #: USD/h the provisioner priced the offer at when it wrote the intent (live cloud price or bundled catalog:
    #: :meth:`broker.service.live.LiveEnvironment.offers_at`); the ledger's fallback where the live cloud price
    #: cache has no value (:mod:`broker.service.ledger`); ``None`` on rows written before migration 0013
    launch_usd_per_hour: Mapped[float | None] = mapped_column(Float)


class CloudInstanceEvent(Base):
    """One state change of a cloud instance row (``from_state`` ``None``: the row was written), UTC."""

    __tablename__ = "cloud_instance_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    instance_row_id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), ForeignKey("cloud_instances.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime]
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")


class Schedule(Base):
    """A recurring run: 5-field cron read in ``timezone`` (IANA), the job spec each fire submits, next/last fire (UTC)."""

    __tablename__ = "schedules"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team: Mapped[str] = mapped_column(String(63), index=True)
    name: Mapped[str] = mapped_column(String(200))
    cron: Mapped[str] = mapped_column(String(200))
    timezone: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]]
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    next_fire_at: Mapped[datetime]
    last_fire_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    #: why the reconciler paused it (its run could not be created), until it is resumed
    last_error: Mapped[str | None] = mapped_column(Text)
    #: the last fire the reconciler skipped (UTC) and why (the team's queued-jobs quota or priority entitlement)
    last_skip_at: Mapped[datetime | None]
    last_skip_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (UniqueConstraint("team", "name", name="uq_schedules_team_name"),)


class ApiToken(Base):
    """An API token, stored as its SHA-256 hex digest only (:mod:`broker.service.tokens`).

    ``public_id`` (``tok-`` + 16 hex) names it in lists, revokes and the audit log; ``kind`` is one of
    :data:`broker.service.tokens.TOKEN_KINDS` (``admin`` mirrors ``kind == "admin"`` for older readers; ``kind``
    decides); ``node`` is the node a ``node`` token is scoped to; ``expires_at`` (UTC) ends it;
    ``last_used_at`` (UTC) is refreshed at most once a minute.
    """

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    team: Mapped[str] = mapped_column(String(63))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    label: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime]
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    public_id: Mapped[str] = mapped_column(String(20), unique=True)
    kind: Mapped[str] = mapped_column(String(16), default="member")
    expires_at: Mapped[datetime]
    last_used_at: Mapped[datetime | None]
    node: Mapped[str | None] = mapped_column(String(63))


class AuditEvent(Base):
    """One audited change: when (UTC), the actor (token id, team, kind; ``actor_kind`` ``database`` for
    direct store access, with no token id), the action (``token.create``, ``job.cancel``, ...), its
    target (a token, job or schedule id) and a JSON detail."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(index=True)
    actor_token_id: Mapped[str | None] = mapped_column(String(40))
    actor_team: Mapped[str] = mapped_column(String(63), default="")
    actor_kind: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(40))
    target: Mapped[str] = mapped_column(String(200), default="")
    detail: Mapped[dict[str, Any]]


class UsageRow(Base):
    """One usage record (:class:`broker.usage.UsageRecord`): USD, kWh, kgCO2e of one resource of one attempt
    rank over ``[start, end]`` (UTC). ``None`` figures are unknown and flagged (``estimated``, ``estimate_reasons``)."""

    __tablename__ = "usage_records"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    line: Mapped[str] = mapped_column(String(16))
    resource: Mapped[str] = mapped_column(String(100))
    team: Mapped[str] = mapped_column(String(63), index=True)
    project: Mapped[str | None] = mapped_column(String(63))
    #: indexed: reports read a period
    start: Mapped[datetime] = mapped_column(index=True)
    end: Mapped[datetime]
    provider: Mapped[str] = mapped_column(String(16))
    region: Mapped[str | None] = mapped_column(String(40))
    zone: Mapped[str | None] = mapped_column(String(40))
    pool: Mapped[str | None] = mapped_column(String(63))
    instance_type: Mapped[str | None] = mapped_column(String(40))
    market: Mapped[str | None] = mapped_column(String(16))
    gpu_type: Mapped[str] = mapped_column(String(32))
    gpu_count: Mapped[int] = mapped_column(Integer)
    run_s: Mapped[float] = mapped_column(Float)
    billed_s: Mapped[float] = mapped_column(Float)
    list_unit_price_usd: Mapped[float | None] = mapped_column(Float)
    pricing_unit: Mapped[str] = mapped_column(String(16))
    billed_usd: Mapped[float | None] = mapped_column(Float)
    energy_kwh: Mapped[float | None] = mapped_column(Float)
    carbon_kg: Mapped[float | None] = mapped_column(Float)
    estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    estimate_reasons: Mapped[list[Any]]
    source: Mapped[str] = mapped_column(String(8), default="live")
    #: where the line's price came from (:attr:`broker.usage.UsageRecord.price_source`); ``None`` before 0013
    price_source: Mapped[str | None] = mapped_column(Text)
    recorded_at: Mapped[datetime]

    #: a line's key; ``start`` tells apart the hourly ``idle_amortised`` lines of one node (no job, no attempt)
    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank", "line", "resource", "start",
                                       name="uq_usage_records_line"),)


class Budget(Base):
    """A team's monthly cloud budget (:mod:`broker.service.budgets`): ``cap_usd`` (hard cap, USD per calendar
    month UTC), ``alert_fraction`` (the soft alert fires when spent + committed reaches this fraction of the cap),
    ``alerted_month`` (``YYYY-MM`` whose alert was already raised, so it is raised once a month), who set it when."""

    __tablename__ = "budgets"

    team: Mapped[str] = mapped_column(String(63), primary_key=True)
    cap_usd: Mapped[float] = mapped_column(Float)
    alert_fraction: Mapped[float] = mapped_column(Float, default=0.8)
    alerted_month: Mapped[str | None] = mapped_column(String(7))
    updated_at: Mapped[datetime]
    updated_by: Mapped[str] = mapped_column(String(63), default="")


class ProjectBudget(Base):
    """A project's monthly cloud budget inside its team (:mod:`broker.service.budgets`): the same fields as
    :class:`Budget`, keyed by ``(team, project)``; ``project`` is the job spec's ``project``
    (:class:`broker.model.JobSpec`) and the usage ledger's. A team's own :class:`Budget` still holds all of
    its projects."""

    __tablename__ = "project_budgets"

    team: Mapped[str] = mapped_column(String(63), primary_key=True)
    project: Mapped[str] = mapped_column(String(63), primary_key=True)
    cap_usd: Mapped[float] = mapped_column(Float)
    alert_fraction: Mapped[float] = mapped_column(Float, default=0.8)
    alerted_month: Mapped[str | None] = mapped_column(String(7))
    updated_at: Mapped[datetime]
    updated_by: Mapped[str] = mapped_column(String(63), default="")


class SignalValue(Base):
    """One cached hour of a live signal: ``value`` in ``unit`` (gCO2e/kWh or USD/MWh) of ``zone`` (the broker's
    zone id) from ``source`` for the UTC hour starting at ``hour_at``; ``forecast`` (else measured),
    ``estimated`` (the source flagged it so), ``fetched_at`` (when it was fetched or seeded)."""

    __tablename__ = "signal_values"

    source: Mapped[str] = mapped_column(String(40), primary_key=True)
    zone: Mapped[str] = mapped_column(String(64), primary_key=True)
    hour_at: Mapped[datetime] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))
    value: Mapped[float] = mapped_column(Float)
    unit: Mapped[str] = mapped_column(String(16))
    estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    forecast: Mapped[bool] = mapped_column(Boolean, default=False)
    fetched_at: Mapped[datetime]

    __table_args__ = (Index("ix_signal_values_zone_kind_hour", "zone", "kind", "hour_at"),)


class SignalFetch(Base):
    """Fetch health of one (source, zone, kind): ``last_attempt_at``, ``last_success_at`` (``None``: never),
    ``last_error`` (class and message, never a key), ``error_counts`` (error class -> count since the row was
    made), ``stale_after_s`` (the zone's staleness limit when last refreshed, seconds)."""

    __tablename__ = "signal_fetches"

    source: Mapped[str] = mapped_column(String(40), primary_key=True)
    zone: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)
    last_attempt_at: Mapped[datetime]
    last_success_at: Mapped[datetime | None]
    last_error: Mapped[str] = mapped_column(String(500), default="")
    error_counts: Mapped[dict[str, Any]]
    stale_after_s: Mapped[float] = mapped_column(Float)


class PlannerState(Base):
    """The planner fence (one row, id 1): ``version`` is bumped by every applied planning cycle."""

    __tablename__ = "planner_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), default=0)
    leader: Mapped[str] = mapped_column(String(200), default="")
    cycle_at: Mapped[datetime | None]
    #: random key (hex) of the cloud instances' report tokens (HMAC-SHA256 of job, attempt and rank), made on first use
    instance_secret: Mapped[str | None] = mapped_column(String(64))
