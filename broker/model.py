"""Domain model: job specs, on-prem pools, cloud offers (defined in :mod:`pricing.offers`) and planner decisions.

All user-facing objects are pydantic v2 models; invalid input raises
``pydantic.ValidationError`` whose message names the field and the value.
Instants are timezone-aware UTC datetimes at the edges; the planner works on
POSIX seconds (UTC floats) internally.

Units: GPU memory in GB, durations in seconds, prices in USD, energy in kWh,
carbon in kgCO2e, carbon intensity in gCO2e/kWh, electricity price in USD/MWh.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from pricing.offers import CloudOffer, Market  # re-exported: the offer model lives with the prices
from providers.registry import AGENT_KIND, POOL_KINDS

__all__ = [
    "PriorityClass",
    "Market",
    "JobSpec",
    "PoolNode",
    "Pool",
    "CloudOffer",
    "DecisionKind",
    "OptionEstimate",
    "Decision",
    "DECISION_ADAPTER",
    "LazyOptions",
    "WEEK_S",
    "FAIR_SHARE_HALF_LIFE_S",
    "DEFAULT_CHECKPOINT_INTERVAL_S",
    "DEFAULT_SLACK_FACTOR",
    "DEFAULT_MIN_SLACK_S",
    "default_slack_s",
    "wait_text",
]

# Image reference: [registry[:port]/]path[:tag][@sha256:digest]; no shell metacharacters.
_IMAGE_RE = re.compile(
    r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)
#: a team name (also the pattern of the API's ``team`` query parameters)
TEAM_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_NAME_RE = TEAM_RE


class PriorityClass(str, Enum):
    """Priority classes, lowest first. ``rank`` orders the queue (higher first)."""

    low = "low"
    normal = "normal"
    high = "high"
    critical = "critical"

    @property
    def rank(self) -> int:
        return _PRIORITY_RANK[self]


_PRIORITY_RANK = {PriorityClass.low: 0, PriorityClass.normal: 1, PriorityClass.high: 2, PriorityClass.critical: 3}

#: seconds in a week (time-series replay shifts, trace week shifts, token lifetimes)
WEEK_S = 7 * 86400.0
#: half-life of a team's decayed GPU-hour usage, the fair-share term of queue order, seconds (7 days; the live
#: cycle and the simulator both decay with it)
FAIR_SHARE_HALF_LIFE_S = WEEK_S
#: seconds between the live broker's planning cycles (Celery beat's ``plan`` task: ``BrokerSettings.plan_interval_s``)
#: and the simulator's default planning step (``SimulationConfig.tick_s``, ``fedbroker simulate --step``), so a
#: simulation coalesces events as the live broker's beat does; 2 s
PLAN_INTERVAL_S = 2.0
#: checkpoint interval of a job spec that gives none, seconds (30 min): work since the last checkpoint is lost
#: when an attempt is interrupted
DEFAULT_CHECKPOINT_INTERVAL_S = 1800.0
#: the slack of a job without a deadline or ``slack_s``: ``max(DEFAULT_SLACK_FACTOR x duration,
#: DEFAULT_MIN_SLACK_S)`` (:func:`default_slack_s`); traces record no deadlines, so the simulator uses it too
DEFAULT_SLACK_FACTOR = 1.0
DEFAULT_MIN_SLACK_S = 12 * 3600.0


def wait_text(seconds: float) -> str:
    """A wait in words for people: ``"40 s"`` below 2 min, ``"3.7 min"`` below 2 h, else ``"5.2 h"``
    (``fedbroker explain`` and the live broker's waiting reasons; never "0 min" for a wait of seconds)."""
    s = float(seconds)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def default_slack_s(duration_s: float, slack_factor: float = DEFAULT_SLACK_FACTOR,
                    min_slack_s: float = DEFAULT_MIN_SLACK_S) -> float:
    """Seconds of slack beyond ``duration_s`` (seconds) for a job that gives no deadline and no slack:
    ``max(slack_factor x duration_s, min_slack_s)`` (defaults: one duration, at least 12 h). The store's
    default deadline (:func:`broker.service.store.core.default_deadline`) and the trace loaders
    (:func:`broker.sim.traces.default_deadline_s`) both use it."""
    return max(slack_factor * duration_s, min_slack_s)


#: bounds of any instant in a job spec (UTC): later ones overflow date arithmetic and the database
EARLIEST_INSTANT = datetime(2000, 1, 1, tzinfo=timezone.utc)
LATEST_INSTANT = datetime(2200, 1, 1, tzinfo=timezone.utc)
#: longest duration, slack or checkpoint interval a spec may give, seconds (366 days, as the trace loaders)
MAX_SPAN_S = 366 * 86400.0
#: the kernel's limit on one argument (MAX_ARG_STRLEN, 128 KiB) and our cap on the whole argv
MAX_ARG_BYTES = 128 * 1024
MAX_ARGV_BYTES = 1024 * 1024
MAX_ARGS = 4096
#: the largest gang, nodes (ranks are 0 .. MAX_NODES - 1)
MAX_NODES = 1024
#: the format of job ids (``broker.service.store.core.new_job_id``): ``job-`` and 16 hex digits
JOB_ID_PATTERN = r"^job-[0-9a-f]{16}$"
#: the format of schedule ids (``sch-`` and 16 hex digits; the API's path check and the SDK's)
SCHEDULE_ID_PATTERN = r"^sch-[0-9a-f]{16}$"
#: the format of public token ids (``broker.service.tokens.new_token_id``: ``tok-`` and 16 hex digits)
TOKEN_ID_PATTERN = r"^tok-[0-9a-f]{16}$"
#: attempt numbers, exit codes and ranks are stored as 32-bit integers
INT32_MAX = 2**31 - 1


#: text without NUL (what :func:`_text` checks), as a JSON-schema pattern
_NO_NUL = r"^[^\x00]*$"
#: the C0 and C1 control characters (ESC, BEL, NUL, newline, DEL, CSI, ...): a terminal acts on them
CONTROL_CHAR_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: the Unicode format characters (general category ``Cf``, Unicode 14.0: Python 3.11's :mod:`unicodedata`) as
#: inclusive code-point ranges: invisible, and the bidirectional ones reorder what follows them (U+202E
#: RIGHT-TO-LEFT OVERRIDE shows ``job\u202egnp.exe`` as ``jobexe.png``; U+2066-2069 isolates, U+200B-200F
#: zero-width space/joiners and marks, U+FEFF, U+E0001-E007F tags). ``tests/broker/test_model.py`` checks the
#: table against the running Python's ``unicodedata``.
FORMAT_CHAR_RANGES = ((0x00AD, 0x00AD), (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F),
                      (0x0890, 0x0891), (0x08E2, 0x08E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x202A, 0x202E),
                      (0x2060, 0x2064), (0x2066, 0x206F), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD),
                      (0x110CD, 0x110CD), (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
                      (0xE0001, 0xE0001), (0xE0020, 0xE007F))
#: characters outside ``Cf`` that break a line or show as nothing, as inclusive ranges: U+2028 LINE SEPARATOR and
#: U+2029 PARAGRAPH SEPARATOR (``Zl``/``Zp``: a new line in a browser and in JSON readers), U+034F COMBINING
#: GRAPHEME JOINER, U+115F-1160 and U+3164, U+FFA0 Hangul fillers, U+17B4-17B5 Khmer inherent vowels, U+180B-180D
#: and U+180F Mongolian variation selectors (Unicode's ``Default_Ignorable_Code_Point`` less its ``Cf`` and the
#: emoji variation selectors U+FE00-FE0F, which emoji names use). A hostile pass of 2026-12-04 named jobs with them.
BLANK_CHAR_RANGES = ((0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180D), (0x180F, 0x180F),
                     (0x2028, 0x2029), (0x3164, 0x3164), (0xFFA0, 0xFFA0))
# the characters themselves (not \u escapes: Python's re, pydantic's Rust regex and an ECMAScript "u" regex
# all read a literal astral character in a class; only Python and Rust read \U0001D173)
_FORMAT_CLASS = "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in FORMAT_CHAR_RANGES + BLANK_CHAR_RANGES)
#: one line of text a terminal shows as it is (what :func:`one_line` and :func:`line_problem` check): no control
#: character, no format character and none of :data:`BLANK_CHAR_RANGES`, as a JSON-schema pattern. Every one-line field a user gives and others
#: see uses it: a job's ``name``, ``gpu_types`` and ``allowed_regions`` (also inside a schedule's spec), a
#: token's ``label``, the bulk cancel's ``name`` filter. (Team, project, schedule and node names are ASCII:
#: ``TEAM_RE``, ``SCHEDULE_NAME_RE``.)
LINE_PATTERN = "^[^\\x00-\\x1f\\x7f-\\x9f" + _FORMAT_CLASS + "]*$"
#: a character :data:`LINE_PATTERN` refuses
NOT_LINE_CHAR_RE = re.compile("[\\x00-\\x1f\\x7f-\\x9f" + _FORMAT_CLASS + "]")
#: the schema of a GPU type or region name in a spec
_SHORT_NAME = {"type": "string", "maxLength": 64, "pattern": LINE_PATTERN}


def line_problem(v: str) -> str | None:
    """Why ``v`` cannot be shown as one line of a terminal or web page as it is (its first control character,
    by ``repr``, or format character, by code point), or ``None``: the rule of :data:`LINE_PATTERN`. Callers
    prefix ``field=value:``."""
    m = NOT_LINE_CHAR_RE.search(v)
    if m is None:
        return None
    ch = m.group()
    if CONTROL_CHAR_RE.match(ch):
        return f"contains the control character {ch!r}"
    if any(a <= ord(ch) <= b for a, b in BLANK_CHAR_RANGES):
        return f"contains the line-breaking or blank character U+{ord(ch):04X}"
    return f"contains the format character U+{ord(ch):04X}"


def _no_control(schema: dict) -> None:
    """State :data:`LINE_PATTERN` (no control or format character) on the string variant of an optional text
    field's schema."""
    for variant in schema.get("anyOf", [schema]):
        if variant.get("type") == "string":
            variant["pattern"] = LINE_PATTERN


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (a value from a request can be any
    length: a 5,000-character job id in a URL was echoed whole); a datetime is shown in ISO 8601."""
    r = repr(value.isoformat() if isinstance(value, datetime) else value)
    return r if len(r) <= limit else r[:limit] + "...'"


def _utc(v: datetime | None, field: str) -> datetime | None:
    if v is None:
        return None
    if v.tzinfo is None:
        raise ValueError(f"{field}={v.isoformat()!r}: needs a time zone (UTC recommended)")
    try:
        v = v.astimezone(timezone.utc)
    except OverflowError:  # year 1 or 9999 with an offset: UTC cannot hold it
        raise ValueError(f"{field}={v.isoformat()!r}: outside {EARLIEST_INSTANT.year}-{LATEST_INSTANT.year - 1}") from None
    if not (EARLIEST_INSTANT <= v < LATEST_INSTANT):
        raise ValueError(f"{field}={v.isoformat()!r}: outside {EARLIEST_INSTANT.year}-{LATEST_INSTANT.year - 1}")
    return v


def _text(v: str, field: str, max_len: int) -> str:
    """``v`` if it is valid UTF-8 text without NUL of at most ``max_len`` characters, else ``ValueError``."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field}={v[:40]!r}: not valid UTF-8 text (lone surrogate)") from None
    if "\x00" in v:
        raise ValueError(f"{field}={v[:40]!r}: contains a NUL character")
    if len(v) > max_len:
        raise ValueError(f"{field}: {len(v)} characters, at most {max_len}")
    return v


def one_line(v: str, field: str, max_len: int) -> str:
    """``v`` if it is :func:`_text` and holds no control or format character (:func:`line_problem`: a name
    shown in a terminal or on the finance page: an ESC sequence in it would drive the reader's terminal, a
    U+202E would show it reversed), else ``ValueError`` naming ``field``, the value and the character."""
    _text(v, field, max_len)
    problem = line_problem(v)
    if problem is not None:
        raise ValueError(f"{field}={v[:40]!r}: {problem}")
    return v


class JobSpec(BaseModel):
    """What a team asks to run.

    Fields:
        image: container image reference (``registry/repo:tag`` or ``@sha256:``).
        command: argv list, never passed through a shell (required).
        gpus_per_node: GPUs on each node (>= 1).
        nodes: number of nodes of the gang (>= 1).
        gpu_types: allowed GPU types (e.g. ``["V100", "A100"]``); empty = any.
        min_gpu_memory_gb: minimum memory per GPU, GB.
        priority_class: queue priority.
        team: owning team (fair share and budgets are per team).
        project: the team's project it is charged to (optional; same pattern as a team name). The usage
            ledger records it, and a project budget (:mod:`broker.service.budgets`) caps its cloud spend.
        deadline: latest completion instant (UTC); or give ``slack_s``.
        slack_s: seconds of slack beyond the estimated duration, counted from submission.
        earliest_start: do not start before this instant (UTC).
        estimated_duration_s: runtime on the reference GPU (V100), seconds (> 0).
        time_limit_s: wall-clock limit of each attempt, seconds (> 0): an attempt still running after it is
            stopped (SIGTERM, ``cancel_grace_s``, SIGKILL) and the job fails with "time limit of N s exceeded"
            (the Slurm model: the limit is the kill time). ``None``: ``estimated_duration_s x 1.2 + 300 s``
            (:func:`providers.base.pool_time_limit_s`, the Slurm and Kubernetes pools' default slack).
        spot_allowed: may run on spot instances.
        preemptible: may be preempted by a higher-priority job.
        checkpointable: writes checkpoints; restarts lose at most ``checkpoint_interval_s``.
        checkpoint_interval_s: seconds between checkpoints.
        allowed_regions: cloud regions allowed; empty = any.
        max_price_usd_per_hour: cap on the job's total $/hour (all nodes); None = no cap.
        deferrable: may be held for a cheaper/cleaner window before the deadline.
        not_after: latest start instant (UTC); a job not started by then fails
            (live broker). ``not_before`` is accepted as another name of ``earliest_start``.
        window: how the start is chosen inside ``[earliest_start, min(not_after, deadline - duration)]``:
            ``"planner"`` (the planner's score: cost + carbon price + value of time),
            ``"cheapest"`` (lowest electricity cost) or ``"cleanest"`` (lowest emissions)
            over the job's run, on the pool's hourly price/carbon series (live broker).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str | None = Field(None, max_length=200, json_schema_extra=lambda s: _no_control(s))
    image: str = Field("ghcr.io/fedbroker/nccl-train:latest", max_length=512,
                       json_schema_extra={"pattern": _IMAGE_RE.pattern})
    # the schema states the rules; the validators below enforce them with messages naming the field
    command: list[str] = Field(json_schema_extra={"minItems": 1, "maxItems": MAX_ARGS,
                                                  "prefixItems": [{"type": "string", "minLength": 1, "pattern": _NO_NUL}],
                                                  "items": {"type": "string", "pattern": _NO_NUL}})
    gpus_per_node: int = Field(1, ge=1, le=16)
    nodes: int = Field(1, ge=1, le=MAX_NODES)
    gpu_types: tuple[str, ...] = Field((), max_length=32, json_schema_extra={"items": _SHORT_NAME})
    min_gpu_memory_gb: float = Field(0.0, ge=0, le=4096)
    priority_class: PriorityClass = PriorityClass.normal
    team: str = Field("default", json_schema_extra={"minLength": 1, "maxLength": 63, "pattern": TEAM_RE.pattern})
    project: str | None = Field(None, json_schema_extra={"minLength": 1, "maxLength": 63, "pattern": TEAM_RE.pattern})
    deadline: datetime | None = None
    slack_s: float | None = Field(None, ge=0, le=MAX_SPAN_S)
    earliest_start: datetime | None = Field(None, validation_alias=AliasChoices("earliest_start", "not_before"))
    estimated_duration_s: float = Field(3600.0, gt=0, le=MAX_SPAN_S)
    time_limit_s: float | None = Field(None, gt=0, le=MAX_SPAN_S)
    spot_allowed: bool = True
    preemptible: bool = False
    checkpointable: bool = True
    checkpoint_interval_s: float = Field(DEFAULT_CHECKPOINT_INTERVAL_S, gt=0, le=MAX_SPAN_S)
    allowed_regions: tuple[str, ...] = Field((), max_length=256, json_schema_extra={"items": _SHORT_NAME})
    max_price_usd_per_hour: float | None = Field(None, gt=0, le=1e6)
    deferrable: bool = True
    not_after: datetime | None = None
    window: Literal["planner", "cheapest", "cleanest"] = "planner"

    @field_validator("gpus_per_node", "nodes", "min_gpu_memory_gb", "slack_s", "estimated_duration_s",
                     "checkpoint_interval_s", "max_price_usd_per_hour", "time_limit_s", mode="before")
    @classmethod
    def _not_a_boolean(cls, v: Any, info) -> Any:
        # pydantic takes true as 1 (``gpus_per_node: true`` made a 1-GPU job); the schema's integer/number
        # excludes booleans
        if isinstance(v, bool):
            raise ValueError(f"{info.field_name}={v!r}: a number, not a boolean")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not _IMAGE_RE.match(v):
            raise ValueError(f"image={v!r}: not a valid image reference (no spaces or shell metacharacters)")
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str]) -> list[str]:
        if not v or not v[0]:
            raise ValueError(f"command={v!r}: needs at least a program name")
        if len(v) > MAX_ARGS:
            raise ValueError(f"command: {len(v)} arguments, at most {MAX_ARGS}")
        total = 0
        for i, a in enumerate(v):
            _text(a, f"command[{i}]", MAX_ARG_BYTES)
            n = len(a.encode("utf-8"))
            if n > MAX_ARG_BYTES:
                raise ValueError(f"command[{i}]: {n} bytes, at most {MAX_ARG_BYTES} (the kernel's limit on one argument)")
            total += n + 1
        if total > MAX_ARGV_BYTES:
            raise ValueError(f"command: {total} bytes in all, at most {MAX_ARGV_BYTES}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else one_line(v, "name", 200)

    @field_validator("gpu_types", "allowed_regions")
    @classmethod
    def _short_names(cls, v: tuple[str, ...], info) -> tuple[str, ...]:
        for i, x in enumerate(v):
            one_line(x, f"{info.field_name}[{i}]", 64)
        return v

    @field_validator("team")
    @classmethod
    def _team(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"team={v!r}: 1-63 letters, digits, '.', '_' or '-'")
        return v

    @field_validator("project")
    @classmethod
    def _project(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RE.match(v):
            raise ValueError(f"project={v!r}: 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @field_validator("deadline", "earliest_start", "not_after")
    @classmethod
    def _aware(cls, v: datetime | None, info) -> datetime | None:
        return _utc(v, info.field_name)

    @model_validator(mode="after")
    def _window(self) -> "JobSpec":
        if self.not_after is not None and self.earliest_start is not None and self.not_after < self.earliest_start:
            raise ValueError(f"not_after={self.not_after.isoformat()!r}: before earliest_start "
                             f"{self.earliest_start.isoformat()!r}")
        if self.deadline is not None and self.earliest_start is not None and self.deadline <= self.earliest_start:
            raise ValueError(f"deadline={self.deadline.isoformat()!r}: not after earliest_start "
                             f"{self.earliest_start.isoformat()!r}")
        return self

    @property
    def total_gpus(self) -> int:
        """GPUs of the whole gang (nodes x gpus_per_node)."""
        return self.gpus_per_node * self.nodes


class PoolNode(BaseModel):
    """One on-prem host: ``gpu_count`` GPUs of one ``gpu_type`` with ``gpu_memory_gb`` each."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    gpu_type: str
    gpu_count: int = Field(ge=1, le=16)
    gpu_memory_gb: float = Field(16.0, gt=0)


class Pool(BaseModel):
    """An on-prem GPU pool at one site.

    Fields:
        name: pool id.
        site: human-readable site name.
        carbon_zone: grid zone of the site's carbon-intensity series (gCO2e/kWh).
        price_zone: grid zone of the site's electricity price series (USD/MWh).
        pue: power usage effectiveness of the site (>= 1).
        amortised_usd_per_gpu_hour: capital + operations cost per GPU-hour, USD.
        timezone: IANA time zone of the site (local wall-clock of its users and traces).
        nodes: the hosts (of an ``agent`` pool; a scheduler's pool reads its nodes from the cluster itself,
            and nodes listed for it only serve ``fedbroker simulate``).
        kind: who runs the pool's jobs: ``"agent"`` (hosts running ``fedbroker serve agent``) or an existing
            scheduler of :data:`providers.registry.POOL_KINDS` (``"slurm"``, ``"kubernetes"``).
        scheduler: the scheduler's section of the cluster file (how to reach it; checked by the kind's
            ``settings_from_mapping`` when the file is loaded); ``None`` for an agent pool.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    site: str = ""
    carbon_zone: str
    price_zone: str
    pue: float = Field(1.3, ge=1.0, le=3.0)
    amortised_usd_per_gpu_hour: float = Field(0.5, ge=0)
    timezone: str = "UTC"
    nodes: tuple[PoolNode, ...]
    kind: str = AGENT_KIND
    scheduler: dict[str, Any] | None = None

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v != AGENT_KIND and v not in POOL_KINDS:
            raise ValueError(f"kind={v!r}: must be one of {', '.join([AGENT_KIND, *POOL_KINDS])}")
        return v

    @property
    def external(self) -> bool:
        """The pool is an existing scheduler's cluster (not hosts running the broker's node agent)."""
        return self.kind != AGENT_KIND

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone={v!r}: not an IANA time zone (e.g. 'America/Toronto')") from None
        return v

    @model_validator(mode="after")
    def _non_empty(self) -> "Pool":
        if self.external and self.scheduler is None:
            raise ValueError(f"{self.kind}: pool {self.name!r} of kind {self.kind!r} needs its {self.kind!r} section")
        if not self.external and self.scheduler is not None:
            raise ValueError(f"scheduler: pool {self.name!r} of kind 'agent' takes no scheduler section")
        if not self.nodes and not self.external:
            raise ValueError(f"nodes: pool {self.name!r} has no nodes")
        return self

    @property
    def total_gpus(self) -> int:
        return sum(n.gpu_count for n in self.nodes)


class DecisionKind(str, Enum):
    """What the planner decided for one job in one cycle."""

    start = "start"  # on-prem, now, on the given nodes
    provision = "provision"  # cloud, now
    defer = "defer"  # hold until ``not_before`` (a cheaper/cleaner window)
    wait = "wait"  # stay in the on-prem queue; review again at ``not_before``
    preempt = "preempt"  # evict ``victims`` then start on-prem now
    reject = "reject"  # no pool or offer can ever hold this job


@dataclass(slots=True)
class OptionEstimate:
    """One costed option for one job (a record: read it, do not modify it).

    A slotted stdlib dataclass, not a pydantic model (nor a frozen dataclass): a
    100k-job planning cycle creates ~500k of them, and pydantic construction (8 us)
    or frozen-dataclass construction (0.8 us) would dominate the cycle; this one
    costs 0.14 us. Validate or serialise at the edges with :data:`DECISION_ADAPTER`.

    Fields:
        kind: ``"onprem"`` or ``"cloud"``.
        target: pool name or offer id.
        start_s: planned start, POSIX seconds (UTC).
        wait_s: seconds from now until the job runs (incl. provisioning delay).
        runtime_s: expected runtime on this option's GPU type, seconds.
        dollars_usd: expected cost, USD (on-prem: electricity + amortised GPU-hours).
        energy_kwh: expected energy incl. PUE, kWh.
        carbon_kg: expected emissions, kgCO2e.
        score: objective value, USD-equivalent (lower is better); NaN if infeasible.
        feasible: meets the deadline and constraints.
        note: why infeasible, or extra detail.
        carbon_estimated: the option's carbon figure is an estimate (a cloud region with an annual figure or
            another year's hours: ``CloudOffer.carbon_estimated``); False for on-prem pools.
    """

    kind: Literal["onprem", "cloud"]
    target: str
    start_s: float
    wait_s: float
    runtime_s: float
    dollars_usd: float
    energy_kwh: float
    carbon_kg: float
    score: float
    feasible: bool = True
    note: str = ""
    carbon_estimated: bool = False


class LazyOptions(Sequence):
    """A read-only sequence of :class:`OptionEstimate` built on first access.

    A 100k-job planning cycle explains every decision, but the explanation of a job
    that keeps waiting is rarely read: the costs are computed in the cycle (they
    chose the option) and the records are assembled only when someone reads them.

    Args:
        build: ``build(arg) -> list[OptionEstimate]``, called at most once.
        arg: its argument.
    """

    __slots__ = ("_build", "_arg", "_items")

    def __init__(self, build, arg):
        self._build, self._arg, self._items = build, arg, None

    def _get(self) -> tuple:
        if self._items is None:
            self._items = tuple(self._build(self._arg))
            self._build = self._arg = None
        return self._items

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, list, LazyOptions)):
            return self._get() == tuple(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._get())


@dataclass(slots=True)
class Decision:
    """The planner's decision for one job (a record, see :class:`OptionEstimate`).

    ``allocation`` lists ``(node_index, gpus)`` pairs in the chosen pool for
    ``start``/``preempt``. ``not_before`` is POSIX seconds for ``defer``/``wait``.
    ``victims`` are job ids to preempt. ``alternatives`` are the best rejected
    options (at most a few), for the explain record.
    """

    job_id: str
    kind: DecisionKind
    option: OptionEstimate | None = None
    pool: str | None = None
    offer_index: int | None = None
    allocation: tuple[tuple[int, int], ...] = ()
    not_before: float | None = None
    victims: tuple[str, ...] = ()
    alternatives: tuple[OptionEstimate, ...] | LazyOptions = ()
    reason: str = ""

    def record(self) -> dict:
        """JSON-safe dict of the decision with its alternatives built (the explain record)."""
        return DECISION_ADAPTER.dump_python(_Record(self.job_id, self.kind, self.option, self.pool, self.offer_index,
                                                    self.allocation, self.not_before, self.victims,
                                                    tuple(self.alternatives), self.reason), mode="json")


@dataclass(slots=True)
class _Record:
    """The serialisable shape of a :class:`Decision` (alternatives as a plain tuple)."""

    job_id: str
    kind: DecisionKind
    option: OptionEstimate | None
    pool: str | None
    offer_index: int | None
    allocation: tuple[tuple[int, int], ...]
    not_before: float | None
    victims: tuple[str, ...]
    alternatives: tuple[OptionEstimate, ...]
    reason: str


#: pydantic validator/serialiser of decision records; ``Decision.record()`` uses it.
DECISION_ADAPTER: TypeAdapter[_Record] = TypeAdapter(_Record)
