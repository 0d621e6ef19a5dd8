"""Wire shapes of the HTTP API, shared by the server (:mod:`broker.service.api`) and the SDK (:mod:`broker.client`).

All instants are timezone-aware UTC (ISO 8601 on the wire); money in USD,
energy in kWh, emissions in kgCO2e, durations in seconds.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.model import LINE_PATTERN, JobSpec, one_line

__all__ = ["SubmitRequest", "JobView", "JobEventView", "AttemptView", "ExplainView", "LogsView", "NodeView",
           "decision_brief", "with_earlier", "latest_decisions",
           "ScheduleRequest", "ScheduleView", "ErrorBody", "SCHEDULE_NAME_RE", "TOKEN_KINDS", "TOKEN_MAX_TTL_S",
           "TokenCreateRequest", "TokenRotateRequest", "TokenView", "CreatedToken", "AuditEventView",
           "UsageTotalsView", "UsageSummaryView", "SavingsView"]

#: a schedule name: 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit
SCHEDULE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
#: the shape of a cron the schema states (5 space-separated fields or an ``@`` macro);
#: :func:`broker.recurring.validate_cron` checks the fields themselves
CRON_SHAPE_RE = re.compile(r"^\s*(@[A-Za-z]+|\S+(\s+\S+){4})\s*$")


class SubmitRequest(BaseModel):
    """Body of ``POST /v1/jobs``: the job spec, and an optional idempotency key
    (also accepted as the ``Idempotency-Key`` header): a retried submit with the same
    key and the same spec returns the first job instead of creating another."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec
    idempotency_key: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$",
                                        description="printable ASCII without spaces")


class JobView(BaseModel):
    """A job as the API shows it.

    Fields: ``state`` is a :class:`broker.states.JobState` value; ``version`` counts its
    applied transitions; ``not_before``/``not_after`` bound its start, ``deadline`` its
    completion; ``placement`` says where it runs (``{"kind": "onprem", "pool", "nodes":
    [{"node", "gpus", "rank"}]}``); ``reason`` is why it is in its state.
    """

    id: str
    team: str
    name: str | None = None
    state: str
    version: int
    spec: JobSpec
    created_at: datetime
    updated_at: datetime
    not_before: datetime | None = None
    not_after: datetime | None = None
    deadline: datetime
    reason: str = ""
    placement: dict[str, Any] | None = None
    attempt: int = 0
    started_at: datetime | None = None
    finished_at: datetime | None = None
    exit_code: int | None = None
    cancel_requested: bool = False
    idempotency_key: str | None = None
    schedule_id: str | None = None
    #: what the broker warns about this job now: a deadline it cannot meet, running past its deadline, no node
    #: known to hold it (:mod:`broker.service.feasibility`); set on the answers of submit, status and list
    warnings: list[str] = Field(default_factory=list)

    @property
    def done(self) -> bool:
        """True in a terminal state (succeeded, failed, cancelled)."""
        return self.state in ("succeeded", "failed", "cancelled")


class JobEventView(BaseModel):
    """One applied state transition."""

    at: datetime
    from_state: str | None
    to_state: str
    version: int
    reason: str


class AttemptView(BaseModel):
    """One try of a job: where, when, how it ended."""

    number: int
    kind: str
    pool: str | None = None
    offer_id: str | None = None
    nodes: list[dict[str, Any]]
    gpu_type: str | None = None
    gpus: int
    created_at: datetime
    started_at: datetime | None = None
    ended_at: datetime | None = None
    exit_code: int | None = None
    outcome: str | None = None
    reason: str = ""
    #: cloud attempts: each option tried, in order: ``{"option", "error", "message", "at"}`` (``error`` null = it worked)
    failover: list[dict[str, Any]] = []
    #: an attempt on an existing scheduler's pool (``kind`` ``slurm``): the cluster's job id (``null`` until submitted)
    external_id: str | None = None


class ExplainView(BaseModel):
    """Why the job is where it is: the planner's latest decision record (chosen option
    and best alternatives, each with ``dollars_usd``, ``energy_kwh``, ``carbon_kg``,
    ``wait_s``), the latest decision of every kind (:func:`latest_decisions`), the state history and the
    attempts."""

    job: JobView
    decision: dict[str, Any] | None
    events: list[JobEventView]
    attempts: list[AttemptView]
    decisions: list[dict[str, Any]] = Field(default_factory=list, description=(
        "the latest decision of every kind, newest first: {kind, at, reason, target?, start_s?}"))


#: the keys of a decision kept in the ``earlier`` map of a later record (:func:`with_earlier`)
_BRIEF_KEYS = ("kind", "at", "reason")


def decision_brief(record: dict[str, Any]) -> dict[str, Any]:
    """The short form of a decision record (``broker.model.Decision.record`` as the planning cycle stores it):
    ``{kind, at, reason}`` plus, when it chose an option, its ``target`` (pool or offer id) and ``start_s``
    (POSIX s, UTC)."""
    out = {k: record.get(k) for k in _BRIEF_KEYS}
    opt = record.get("option") or {}
    if opt:
        out["target"], out["start_s"] = opt.get("target"), opt.get("start_s")
    return out


def with_earlier(record: dict[str, Any], previous: dict[str, Any] | None, at: datetime) -> dict[str, Any]:
    """``record`` stamped ``at`` (ISO 8601 UTC) with ``earlier``: kind -> :func:`decision_brief` of the latest
    earlier decision of each other kind, carried over from ``previous`` (the job's stored record, or ``None``).
    A job has at most one entry per kind (six planner kinds, plus ``undecided``), so a record stays small."""
    earlier = dict((previous or {}).get("earlier") or {})
    if previous and previous.get("kind"):
        earlier[previous["kind"]] = decision_brief(previous)
    earlier.pop(record.get("kind"), None)
    record["at"] = at.isoformat(timespec="seconds")
    record["earlier"] = earlier
    return record


def latest_decisions(record: dict[str, Any] | None, events: list[JobEventView]) -> list[dict[str, Any]]:
    """The latest decision of every kind for ``explain``, newest first: the planner's stored ``record`` and the
    earlier kinds it carries (:func:`with_earlier`), and intake's (``kind: intake``: the latest event that took
    the job in from ``submitted`` or out of ``deferred``, with its reason). Each is ``{kind, at, reason, ...}``
    (``at`` ISO 8601 UTC)."""
    out = []
    if record:
        out.append(decision_brief(record))
        out.extend((record.get("earlier") or {}).values())
    taken = [e for e in events if e.from_state in ("submitted", "deferred") and e.to_state in ("queued", "deferred")]
    if taken:
        e = taken[-1]
        out.append({"kind": "intake", "at": e.at.isoformat(timespec="seconds"), "reason": e.reason,
                    "to_state": e.to_state})
    return sorted(out, key=lambda d: str(d.get("at") or ""), reverse=True)


class LogsView(BaseModel):
    """Captured stdout+stderr of one attempt (``attempt`` 0 = none yet), rank 0 unless asked."""

    job_id: str
    attempt: int
    rank: int
    text: str
    truncated: bool = False


class NodeView(BaseModel):
    """An on-prem host as its agent last reported it."""

    name: str
    pool: str
    gpu_type: str
    gpu_count: int
    gpu_memory_gb: float
    healthy_gpus: list[int]
    state: str
    last_heartbeat_at: datetime
    telemetry: dict[str, Any] | None = None


class NodeCapacityView(BaseModel):
    """What a team token sees of the on-prem nodes (``GET /v1/nodes``): the agent nodes' GPUs of one pool and GPU
    type in aggregate, no node names and no per-GPU use, memory or power (those stay admin-only in
    :class:`NodeView`). Counts of GPUs; a node is *up* when its state is ``up`` and it heartbeated within
    ``node_lost_after_s`` (the planner's live nodes)."""

    pool: str
    gpu_type: str
    nodes: int = Field(description="registered nodes of this pool and GPU type")
    nodes_up: int = Field(description="of them, up (state up, heartbeat within node_lost_after_s)")
    gpus: int = Field(description="their GPUs, as registered")
    healthy_gpus: int = Field(description="healthy GPUs of the nodes up")
    free_gpus: int = Field(description="healthy GPUs of the nodes up that no active on-prem job holds")


class ScheduleRequest(BaseModel):
    """Body of ``POST /v1/schedules``: a recurring run.

    Fields: ``name`` (unique per team; 1-200 letters, digits, ``.``, ``_`` or ``-``);
    ``cron`` (5 fields, ``"minute hour day-of-month month day-of-week"``, or a macro such
    as ``@daily``; see :func:`broker.recurring.validate_cron`), read in the local
    wall-clock time of ``timezone`` (an IANA name, default ``"UTC"``); ``spec``, the job
    every fire submits. The spec may not hold absolute instants (``deadline``,
    ``earliest_start``/``not_before``, ``not_after``): each run's deadline is its fire
    instant + ``estimated_duration_s`` + ``slack_s`` (the server answers 422 naming the field).
    """

    model_config = ConfigDict(extra="forbid")

    # the schema states the rules; the validators below enforce them with messages naming the field
    name: str = Field(json_schema_extra={"minLength": 1, "maxLength": 200, "pattern": SCHEDULE_NAME_RE.pattern})
    cron: str = Field(description="5 fields (minute hour day-of-month month day-of-week) or a macro such as @daily",
                      json_schema_extra={"minLength": 1, "maxLength": 200, "pattern": CRON_SHAPE_RE.pattern})
    timezone: str = Field("UTC", description="an IANA time zone name", json_schema_extra={"minLength": 1})
    spec: JobSpec

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not SCHEDULE_NAME_RE.match(v):
            raise ValueError(f"name={v!r}: 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        from broker.recurring import validate_cron

        if len(v) > 200:
            raise ValueError(f"cron: {len(v)} characters, at most 200")

        return validate_cron(v)  # ScheduleError is a ValueError: "cron='...': why"

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, v: str) -> str:
        from broker.recurring import validate_timezone

        return validate_timezone(v)


class ScheduleView(BaseModel):
    """A recurring run as the API shows it.

    Fields: ``cron`` as stored (normalised: lower case, macros expanded), read in
    ``timezone``; ``enabled`` is false while paused; ``next_fire_at`` is the next fire
    instant (UTC) the reconciler acts on, ``last_fire_at`` the last one it handled (created a
    job, or skipped it: ``last_skip_at``; ``None`` before the first); ``spec`` is the job every fire submits (its
    ``team`` is the schedule's); ``last_error`` says why the reconciler paused it, if it did;
    ``last_skip_at``/``last_skip_reason``: the last fire the reconciler skipped (UTC) and why (the team held
    ``quotas.max_queued_jobs`` unfinished jobs or ``quotas.max_queued_spec_bytes`` bytes of their specs, or the spec's
    priority class is above the team's entitlement).
    """

    id: str
    team: str
    name: str
    cron: str
    timezone: str
    spec: JobSpec
    enabled: bool
    next_fire_at: datetime
    last_fire_at: datetime | None = None
    created_at: datetime
    last_error: str | None = None
    last_skip_at: datetime | None = None
    last_skip_reason: str | None = None


class ErrorBody(BaseModel):
    """Every error response: ``{"detail": message}`` or, for validation, a list of
    ``{"loc": [...], "msg": ..., "type": ...}`` naming the field."""

    detail: Any


#: token kinds (:mod:`broker.service.tokens` says what each may do)
TOKEN_KINDS = ("member", "team-admin", "read-only", "node", "admin", "finance")
TokenKind = Literal["member", "team-admin", "read-only", "node", "admin", "finance"]
#: the longest token lifetime, seconds (3650 days)
TOKEN_MAX_TTL_S = 3650 * 86400


class TokenCreateRequest(BaseModel):
    """Body of ``POST /v1/tokens``.

    Fields: ``team`` (default: the caller's; 1-63 letters, digits, ``.``, ``_``, ``-``); ``kind`` (one of
    :data:`TOKEN_KINDS`; a team admin may only create ``member`` and ``read-only``); ``label`` (a note,
    at most 200 characters); ``ttl_s`` (lifetime in seconds, 60 .. 3650 days; default the broker's
    ``token_ttl_days``); ``node`` (the node a ``node`` token is scoped to; only for that kind).
    """

    model_config = ConfigDict(extra="forbid")

    team: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    kind: TokenKind = "member"
    label: str = Field("", max_length=200, json_schema_extra={"pattern": LINE_PATTERN})
    ttl_s: int | None = Field(None, ge=60, le=TOKEN_MAX_TTL_S)
    node: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

    @field_validator("label")
    @classmethod
    def _label(cls, v: str) -> str:
        # shown by `fedbroker tokens list`: a job name's rule, with its message naming the character
        return one_line(v, "label", 200)


class TokenRotateRequest(BaseModel):
    """Optional body of ``POST /v1/tokens/{id}/rotate``: ``ttl_s``, the new secret's lifetime in seconds
    (60 .. 3650 days; default the broker's ``token_ttl_days``)."""

    model_config = ConfigDict(extra="forbid")

    ttl_s: int | None = Field(None, ge=60, le=TOKEN_MAX_TTL_S)


class TokenView(BaseModel):
    """A token as the API lists it (never its secret).

    Fields: ``id`` (``tok-`` + 16 hex, public); ``kind``; ``team``; ``node`` (``node`` tokens);
    ``created_at``, ``expires_at``, ``last_used_at`` (UTC; ``last_used_at`` is refreshed at most once a
    minute, ``None`` if never used); ``revoked``; ``expired`` (``expires_at`` had passed when listed).
    """

    id: str
    team: str
    kind: str
    label: str = ""
    node: str | None = None
    created_at: datetime
    expires_at: datetime
    last_used_at: datetime | None = None
    revoked: bool = False
    expired: bool = False


class CreatedToken(TokenView):
    """A token just created or rotated: :class:`TokenView` plus ``token``, the secret, shown this once
    (only its SHA-256 is stored); ``rotated_from``: the id of the token it replaces (rotate only)."""

    token: str
    rotated_from: str | None = None


class AuditEventView(BaseModel):
    """One audit event: ``at`` (UTC), the actor (``actor_token_id``, ``actor_team``, ``actor_kind``:
    a token kind, or ``database`` for direct store access, which has no token id), ``action``
    (``token.create``, ``token.bootstrap``, ``token.revoke``, ``token.rotate``, ``job.submit``,
    ``job.cancel``, ``schedule.create``, ``schedule.pause``, ``schedule.resume``, ``schedule.delete``),
    ``target`` (a token, job or schedule id) and ``detail``."""

    id: int
    at: datetime
    actor_token_id: str | None = None
    actor_team: str
    actor_kind: str
    action: str
    target: str
    detail: dict[str, Any]


# ----------------------------------------------------------------------------- usage ledger (issue #12)
class UsageTotalsView(BaseModel):
    """The sums of one group of usage-ledger lines (:class:`broker.usage.UsageTotals`): ``key`` the group's
    value (``null``: lines without one, e.g. the pool of a cloud line; ``day``: ``YYYY-MM-DD`` UTC; ``null`` in
    ``total``); ``cost_usd`` (USD), ``gpu_hours`` (instance and energy lines: the amortised line is the same
    GPUs), ``energy_kwh`` (facility kWh), ``carbon_kg`` (kgCO2e, location-based) summed over known figures;
    ``lines``; ``estimated_lines`` (some figure modelled or unknown); ``unpriced_lines``,
    ``unknown_energy_lines``, ``unknown_carbon_lines`` (unknown figures, left out of the sums, never 0)."""

    key: str | None = None
    cost_usd: float
    gpu_hours: float
    energy_kwh: float
    carbon_kg: float
    lines: int
    estimated_lines: int
    unpriced_lines: int
    unknown_energy_lines: int
    unknown_carbon_lines: int


class SavingsView(BaseModel):
    """``GET /v1/usage/savings``: the jobs' lines that start in ``[start, end)`` (UTC; of ``team``, ``null``: every
    team) against two counterfactual placements of the same work (:func:`broker.usage.savings`): USD
    ``actual_usd``, ``cheapest_cloud_usd`` (all on the cheapest cloud now), ``onprem_only_usd``; the
    ``saved_vs_*`` differences (positive: the actual placements cost less); ``gpu_hours`` and ``units``
    compared, and those left out (``not_compared_*``, ``reasons``); the USD per GPU-hour used by GPU type and
    how each was found (``rate_notes``)."""

    start: datetime
    end: datetime
    team: str | None = None
    gpu_hours: float
    actual_usd: float
    cheapest_cloud_usd: float
    onprem_only_usd: float
    saved_vs_cheapest_cloud_usd: float
    saved_vs_onprem_only_usd: float
    units: int
    not_compared_units: int
    not_compared_gpu_hours: float
    cloud_usd_per_gpu_hour: dict[str, float]
    onprem_usd_per_gpu_hour: dict[str, float]
    reasons: list[str]
    rate_notes: list[str]


class UsageSummaryView(BaseModel):
    """``GET /v1/usage/summary``: the ledger lines that start in ``[start, end)`` (UTC), of ``team`` (``null``:
    every team, admins only), grouped ``by`` team, project, provider, region, pool, line or day."""

    by: Literal["team", "project", "provider", "region", "pool", "line", "day"]
    start: datetime
    end: datetime
    team: str | None = None
    groups: list[UsageTotalsView]
    total: UsageTotalsView
