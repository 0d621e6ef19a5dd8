"""The bulk cancel (``POST /v1/jobs:cancel``): its request and response bodies.

One request cancels every unfinished job of one team that matches a filter: ``all`` (every unfinished
job), ``states`` (jobs in these states) and/or ``name`` (jobs of this exact name); the filters combine
with AND, and at least one must be given (an empty body cancels nothing: 422). Each matching job is
treated as ``POST /v1/jobs/{id}/cancel`` treats it: a waiting job (submitted, queued, deferred,
provisioning, interrupted) becomes ``cancelled`` at once; a starting or running one gets
``cancel_requested`` and its node agent (or its scheduler's pool, or the cloud control) stops it. A team
token cancels its own team's jobs only; an admin token must name the ``team``. Every change is audited
``job.cancel`` with ``"bulk": true``. The store applies it in transactions of
:data:`CANCEL_BATCH_JOBS` jobs, at most ``limit`` jobs per request (``more`` says whether others
matched).

Why: 10,000 jobs took 52 s to cancel one request at a time from 8 SDK threads (issue 20).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.model import LINE_PATTERN, TEAM_RE, one_line

__all__ = ["CANCEL_BATCH_JOBS", "MAX_CANCEL_JOBS", "CancelManyRequest", "CancelManyResponse"]

#: jobs changed per store transaction of a bulk cancel (bounds each transaction's locks and audit rows)
CANCEL_BATCH_JOBS = 500
#: the most jobs one bulk cancel changes (ten times the default ``quotas.max_queued_jobs`` of 10,000)
MAX_CANCEL_JOBS = 100_000


class CancelManyRequest(BaseModel):
    """Body of ``POST /v1/jobs:cancel``: which unfinished jobs of one team to cancel (filters AND-ed)."""

    model_config = ConfigDict(extra="forbid")

    all: bool = Field(False, description="every unfinished job of the team (alone, or narrowed by states/name)")
    states: list[str] | None = Field(None, min_length=1, max_length=16,
                                     description="only jobs in these states (unfinished ones: submitted, queued, "
                                                 "deferred, provisioning, starting, running, interrupted)")
    name: str | None = Field(None, min_length=1, max_length=200, json_schema_extra={"pattern": LINE_PATTERN},
                             description="only jobs of exactly this name")
    team: str | None = Field(None, min_length=1, max_length=63, pattern=TEAM_RE.pattern,
                             description="the team (default: the token's; an admin token must name one)")
    limit: int = Field(MAX_CANCEL_JOBS, ge=1, le=MAX_CANCEL_JOBS, description="change at most this many jobs")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        # a job's name rule (no job has another name): a 422 naming the character, not the pattern
        return None if v is None else one_line(v, "name", 200)


class CancelManyResponse(BaseModel):
    """Body of a ``POST /v1/jobs:cancel`` answer: the team, the jobs now ``cancelled`` and those now
    ``cancel_requested`` (running or starting: their runtime stops them), by id (ascending), and their
    total ``count``; ``more`` is true when further jobs matched past ``limit``."""

    team: str
    count: int = Field(description="len(cancelled) + len(cancel_requested)")
    cancelled: list[str] = Field(description="ids of the jobs that became cancelled")
    cancel_requested: list[str] = Field(description="ids of the starting/running jobs now asked to stop")
    more: bool = Field(False, description="further jobs matched past limit (send the request again)")
