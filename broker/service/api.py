"""The HTTP API of the live broker (FastAPI); OpenAPI at ``/openapi.json``, docs at ``/docs`` (served from the
package, :mod:`broker.service.api_docs`).

Routes (JSON in and out; every ``/v1`` route needs ``Authorization: Bearer <token>``)::

    GET  /healthz                      no auth; {"status": "ok", "database": "ok", "redis": "ok"} or 503
    POST /v1/jobs                      SubmitRequest -> 201 JobView (200: idempotent replay)
    POST /v1/jobs:batch                BatchRequest (1-1000 items) -> 200 BatchResponse (per-item 201/200/403/409/422)
    GET  /v1/jobs?team=&state=&limit=&offset=   -> list[JobView], newest first
    GET  /v1/jobs/{job_id}             -> JobView
    POST /v1/jobs/{job_id}/cancel      -> JobView
    POST /v1/jobs:cancel               CancelManyRequest (all/states/name of one team) -> CancelManyResponse (ids)
    GET  /v1/jobs/{job_id}/logs?attempt=&rank=&offset=  -> LogsView (text from character offset on)
    GET  /v1/jobs/{job_id}/explain     -> ExplainView
    GET  /v1/nodes                     -> list[NodeView] (admin), else list[NodeCapacityView] (per pool, GPU type)
    POST   /v1/schedules               ScheduleRequest -> 201 ScheduleView (409: name taken)
    GET    /v1/schedules?team=         -> list[ScheduleView], by team then name
    GET    /v1/schedules/{schedule_id} -> ScheduleView
    POST   /v1/schedules/{schedule_id}/pause   -> ScheduleView (enabled false: creates no jobs)
    POST   /v1/schedules/{schedule_id}/resume  -> ScheduleView (next fire after now; missed fires skipped)
    DELETE /v1/schedules/{schedule_id} -> 204 (jobs it created stay)
    GET  /v1/tokens?team=&include_revoked=      -> list[TokenView]     (broker.service.api_tokens)
    POST /v1/tokens                    TokenCreateRequest -> 201 CreatedToken (the secret, once)
    POST /v1/tokens/{token_id}/revoke  -> TokenView
    POST /v1/tokens/{token_id}/rotate  TokenRotateRequest (optional) -> CreatedToken
    GET  /v1/audit?since=&action=&limit=        -> list[AuditEventView], newest first (admin)
    GET  /v1/usage/summary?by=&from=&to=&team=  -> UsageSummaryView   (broker.service.api_usage)
    GET  /v1/usage/focus?from=&to=&team=        -> text/csv, FOCUS 1.2
    GET  /finance?from=&to=            no auth; the finance page (HTML; its script asks for a token) (api_finance)
    /v1/node/...                       node agents only, with a node token (:mod:`broker.service.node_api`)

Who sees what: a team token sees, cancels (one by one or in bulk: ``POST /v1/jobs:cancel`` filters
inside its team only) and reads the logs/explain record of its own team's jobs only, and sees, pauses, resumes and deletes its own team's schedules only;
another team's job or schedule answers 404 exactly like a missing one (existence is not
leaked). An admin token (``fedbroker tokens create --admin``, or ``settings.admin_token_sha256``)
sees every team. Token kinds (:mod:`broker.service.tokens`): a ``read-only`` token gets 403 on every
method but GET; a ``node`` token gets 403 on every job and schedule route; only ``admin`` and
``team-admin`` tokens manage tokens; an expired token answers 401 ``token expired``. Every
submit, cancel, schedule change and token operation is audited with its actor.

Schedules: the reconciler submits the schedule's spec as a job at every fire of its cron
(read in the schedule's time zone, DST rules in :mod:`broker.recurring`), with the
idempotency key ``schedule:<id>:<fire instant>``, so a fire creates one job however many
beats see it. A schedule's spec holds no absolute instants (``deadline``,
``earliest_start``/``not_before``, ``not_after``: 422 naming the field); each run's deadline
is its fire instant + ``estimated_duration_s`` + ``slack_s``.

Limits (:mod:`broker.service.limits`, ``settings.quotas``): submits (``POST /v1/jobs``, each new item of a
batch, ``POST /v1/schedules``) over the team's rate, and new jobs over its queued-jobs quota
(``quotas.max_queued_jobs``) or the bytes of its unfinished jobs' specs (``quotas.max_queued_spec_bytes``), answer
429 with ``Retry-After`` (seconds) and ``{"detail", "limit", "retry_after_s"}``; an idempotent replay
of an existing job is never refused. A team holding ``quotas.max_schedules`` schedules gets 429 on
``POST /v1/schedules`` without ``Retry-After``; a ``spec.priority_class`` outside the team's
``quotas.priority_classes`` is 403 (jobs, batch items, schedules; admins may use any class). Authenticated tokens are cached per process for
``settings.api_token_cache_s`` seconds (:mod:`broker.service.auth_cache`): a revoked token works that much longer.

Errors are ``{"detail": message}`` (401, 403, 404, 409, 503) or, for 422, FastAPI's
list ``{"detail": [{"loc": [...], "msg": ..., "type": ..., "input": ...}]}`` where
``msg`` starts with the dotted field name and, where one exists, the offending value
(``"spec.gpus_per_node=-1: Input should be greater than or equal to 1"``). Nothing is
stored when a request is rejected.
"""

import contextlib
import logging
import math
import re
import secrets
from datetime import datetime, timezone
from typing import Annotated, Any, Callable

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from starlette.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError

from broker.log_marker import dropped_bytes
from broker.service.jsonbody import MAX_BODY_BYTES, BodyLimit, StrictJsonBody, utf8_error
from broker.model import INT32_MAX, JOB_ID_PATTERN, LINE_PATTERN, MAX_NODES, SCHEDULE_ID_PATTERN, TEAM_RE, JobSpec, short_repr
from broker.service.node_api import node_router
from broker.service.group_commit import GroupCommit
from broker.service.feasibility import job_warnings, never_fits
from broker.service.auth_cache import TokenCache
from broker.batch import BatchItemResult, BatchRequest, BatchResponse
from broker.bulk_cancel import CancelManyRequest, CancelManyResponse
from broker.states import TERMINAL_STATES
from broker.service.limits import LimitBody, LimitExceeded, RateLimiter, priority_refusal, time_limit_refusal
from broker.service.metrics import CONTENT_TYPE, SCRAPE_CACHE_S, ScrapeCache
from broker.schemas import (ErrorBody, ExplainView, JobView, LogsView, NodeCapacityView, NodeView, ScheduleRequest,
                            ScheduleView, SubmitRequest)
from broker.service.settings import BrokerSettings
from broker.service.service_endpoints import trial_notice
from broker.states import JobState
from broker.service.store.core import (IdempotencyConflict, InvalidSchedule, JobNotFound, JobStore, NotCancellable, Principal,
                          ScheduleConflict, ScheduleNotFound, SubmitItem, hash_token)
from broker.service.tokens import InvalidToken, TokenExpired, finance_route, readable_team
from broker.service.tokens import authenticate as authenticate_token

__all__ = ["create_app", "JOB_ID_RE", "SCHEDULE_ID_RE", "ADMIN_TEAM"]

log = logging.getLogger(__name__)

#: the format of job ids in paths; anything else is answered 404 without a database query
JOB_ID_RE = re.compile(JOB_ID_PATTERN)
#: the format of schedule ids in paths; anything else is answered 404 without a database query
SCHEDULE_ID_RE = re.compile(SCHEDULE_ID_PATTERN)
#: the team of the ``settings.admin_token`` / ``admin_token_sha256`` principal
ADMIN_TEAM = "admin"
#: the actor token id of that principal in the audit log
SETTINGS_ADMIN_ID = "settings-admin"
#: how the node agent's last log chunk starts when it stopped shipping at ``log_max_bytes`` (workers/agent.py)
_TRUNCATED_MARK = "\n[fedbroker: log truncated at "

_bearer = HTTPBearer(auto_error=False, description="An API token: `fedbroker tokens create --team T`.")
_ERRORS = {401: {"model": ErrorBody, "description": "missing, unknown, revoked or expired token"},
           403: {"model": ErrorBody, "description": "this token's kind may not use this route (read-only: GET only; "
                                                    "node: no job or schedule route)"},
           404: {"model": ErrorBody, "description": "no such job visible to the caller"}}
_LIMITED = {429: {"model": LimitBody, "description": "the team's submit rate, queued-jobs quota or spec-bytes "
                                                     "quota is exceeded; "
                                                     "retry after the Retry-After header's seconds"}}
_SCHEDULE_ERRORS = {401: _ERRORS[401], 403: _ERRORS[403],
                    404: {"model": ErrorBody, "description": "no such schedule visible to the caller"}}


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _unprocessable(field: str, value: Any, msg: str, where: str = "body") -> RequestValidationError:
    """A 422 in FastAPI's shape for a check done in the endpoint (``field`` dotted, under ``where``).
    ``msg`` is prefixed with ``field=value: `` unless it already starts with ``field=``."""
    loc = (where, *field.split("."))
    full = msg if msg.startswith(f"{field}=") else f"{field}={short_repr(value)}: {msg}"
    return RequestValidationError([{"type": "value_error", "loc": loc, "input": value, "msg": full}])


#: the integer form fields of an instance report, digits only (``int()`` would also take " 2", "+2", "2_0");
#: an exit code may be negative (a signal)
_UINT = re.compile(r"[0-9]{1,19}", re.ASCII)
_INT = re.compile(r"-?[0-9]{1,19}", re.ASCII)
#: exit codes, attempts and ranks are stored as 32-bit integers
_INT32_MAX = INT32_MAX

#: the largest ``offset`` of ``GET /v1/jobs`` (page with filters beyond it); larger ones overflowed BIGINT (500)
MAX_OFFSET = 10_000_000
#: the largest node rank (``JobSpec.nodes`` is at most 1024)
MAX_RANK = MAX_NODES - 1
#: the constraints of a ``team`` query parameter: those of ``JobSpec.team``
_TEAM_QUERY = {"min_length": 1, "max_length": 63, "pattern": TEAM_RE.pattern}


def _state_enum(schema: dict) -> None:
    """State the job states as the enum of the ``state`` query parameter's items (the endpoint checks them)."""
    for variant in schema.get("anyOf", [schema]):
        if variant.get("type") == "array":
            variant["items"] = {"type": "string", "enum": [s.value for s in JobState]}


#: a message that already starts with a field name and its value, e.g. "command[1]='x': ..."
_OWN_MSG = re.compile(r"^[a-z_]+(\[\d+\])?(=|: )")


def _describe(err: dict) -> dict:
    """Rewrite one pydantic/FastAPI error so ``msg`` names the dotted field and the offending value."""
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    msg = str(err.get("msg", ""))
    where = str(loc[0]) if loc else "body"
    path = [str(x) for x in loc[1:]]
    field = ".".join(path) if path else where
    inp = err.get("input")
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", "JSON decode error")
        pos = loc[1] if len(loc) > 1 else "?"
        return {"loc": ["body"], "msg": f"body: not valid JSON ({reason} at character {pos})", "type": kind}
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if msg.startswith((f"{field}=", f"{field}:")):
        pass  # raised by this module: already "field=value: why"
    elif where == "body" and not path and isinstance(inp, (bytes, str)):
        msg = "body: must be a JSON object (send it with Content-Type: application/json)"
    elif path and msg.startswith(f"{path[-1]}="):
        # our validators already say "field='value': why"; give the whole dotted path
        msg = f"{field}{msg[len(path[-1]):]}"
    elif path and _OWN_MSG.match(msg):
        # "command[1]='x': why" or "earliest_start=...: why" (a validator naming an item or the
        # field's own name behind an alias): put the parent's dotted path in front
        msg = ".".join(path[:-1] + [msg]) if len(path) > 1 else msg
    elif kind == "missing":
        msg = f"{field}: {msg}"
    elif isinstance(inp, (str, int, float, bool)) or inp is None:
        msg = f"{field}={short_repr(inp)}: {msg}"
    else:
        msg = f"{field}: {msg}"
    out = {"loc": list(loc), "msg": msg, "type": kind}
    if _json_scalar(inp):  # echo the value only when it is short and JSON can carry it
        out["input"] = inp
    return out


def _report_form_schema(events) -> dict:
    """The JSON schema of ``POST /v1/instances/report``'s form (what the endpoint checks by hand)."""
    u32 = {"type": "integer", "minimum": 0, "maximum": _INT32_MAX}
    return {"type": "object", "required": ["job_id", "attempt", "rank", "event", "seq"], "maxProperties": 20,
            "properties": {
                "job_id": {"type": "string", "minLength": 1}, "attempt": u32, "rank": u32, "seq": u32,
                "event": {"type": "string", "enum": list(events)},
                "exit_code": {"anyOf": [{"type": "integer", "minimum": -_INT32_MAX - 1, "maximum": _INT32_MAX},
                                        {"type": "string", "maxLength": 0}]},
                "reason": {"type": "string"}, "log_tail": {"type": "string"}}}


def _json(model: Any, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response of a pydantic model we built ourselves (validated already), serialised once."""
    return Response(model.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


def _json_scalar(v: Any) -> bool:
    """True for ``None``, bools, ints, finite floats and short valid-UTF-8 strings."""
    if v is None or isinstance(v, (bool, int)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, str) and len(v) <= 200:
        try:
            v.encode("utf-8")
            return True
        except UnicodeEncodeError:
            return False
    return False


def create_app(store: JobStore, settings: BrokerSettings | None = None,
               on_submit: Callable[[str], None] | None = None, cloud=None, redis=None,
               rate_limiter: RateLimiter | None = None, pool_notes: Callable[[], dict] | None = None) -> FastAPI:
    """The API application over ``store``.

    Args:
        store: the job store (migrated).
        settings: ``admin_token_sha256`` (the digest of an always-valid admin token, team ``"admin"``;
            the deprecated plaintext ``admin_token`` too, with a warning), ``token_ttl_days`` (default
            lifetime of tokens made over the API) and ``log_max_bytes`` (a log at the cap is reported
            ``truncated``) are read from it; ``None`` = the field defaults (no admin token; the
            environment is not read).
        on_submit: called with the new job's id after a job is stored (the live broker wakes
            the planner with it); an exception from it is logged and never fails the request.
            Also called after an instance report that ended a cloud attempt, and after a node
            agent's report moved a job out of ``starting``/``running`` (:mod:`broker.service.node_api`).
        cloud: a :class:`broker.service.cloud.CloudBroker` to take cloud instances' reports
            (``POST /v1/instances/report``); ``None`` = the endpoint answers 404.
        redis: a client with ``ping()`` (``redis.Redis``, short socket timeouts) that ``/healthz`` checks
            (the planner's queue); ``None`` = ``/healthz`` checks the database only and has no ``redis`` key.
        rate_limiter: the per-team submit rate limit (:class:`broker.service.limits.RateLimiter`, Redis);
            ``None`` = no rate limit. The queued-jobs quota (``settings.quotas``) is enforced either way.
        pool_notes: what ``/healthz`` adds as ``pools`` (:class:`broker.service.schedulers.PoolNotes`: scheduler
            pools not reachable or with GPUs the planner leaves out); ``None`` = no ``pools`` key.
    """
    settings = settings or BrokerSettings.model_construct()
    submits = GroupCommit(store, on_created=on_submit)  # POST /v1/jobs (on_submit: per new job, once stored)
    capacity_of = _known_capacity(store, settings)  # what nodes can hold: submit refusals and deadline warnings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(submits.close)  # the writer answers what is queued and gives its connection back

    app = FastAPI(title="fedbroker", version="1", lifespan=lifespan,
                  description="Submit GPU training jobs and see where, when and why they run.",
                  docs_url=None, redoc_url=None)  # /docs from the package, not a CDN (broker.service.api_docs)
    app.add_middleware(StrictJsonBody)  # under BodyLimit: reads the body whole, refuses duplicate keys and non-UTF-8
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    tokens: TokenCache[Principal] = TokenCache(settings.api_token_cache_s)
    app.state.token_cache = tokens

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": [_describe(e) for e in exc.errors()]}, status_code=422)

    @app.exception_handler(JobNotFound)
    @app.exception_handler(ScheduleNotFound)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(LimitExceeded)
    async def _limited(request: Request, exc: LimitExceeded) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=429, headers=None if exc.retry_after_s is None else {
            "Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(IdempotencyConflict)
    @app.exception_handler(NotCancellable)
    @app.exception_handler(ScheduleConflict)
    async def _conflict(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    if settings.admin_token:
        log.warning("settings.admin_token is deprecated: a plaintext admin token in the settings never expires "
                    "and is readable by every process holding them; set admin_token_sha256 (its SHA-256) or "
                    "bootstrap a stored admin token (`fedbroker tokens create --team ops --admin`)")

    # ------------------------------------------------------------------ dependencies
    async def principal(request: Request,
                        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
        """The caller, from ``Authorization: Bearer <token>``; 401 if missing, unknown, revoked or expired;
        403 when the token's kind may not use this route (read-only: GET only; node: no job or schedule route;
        finance: GET of the finance routes only, :func:`broker.service.tokens.finance_route`)."""
        if creds is None or not creds.credentials:
            raise HTTPException(401, "missing token: send 'Authorization: Bearer <token>' "
                                     "(create one with `fedbroker tokens create --team T`)",
                                headers={"WWW-Authenticate": "Bearer"})
        token = creds.credentials
        if settings.admin_token and secrets.compare_digest(token.encode(), settings.admin_token.encode()):
            return Principal(ADMIN_TEAM, kind="admin", token_id=SETTINGS_ADMIN_ID)
        key = hash_token(token)
        if settings.admin_token_sha256 and secrets.compare_digest(key, settings.admin_token_sha256):
            return Principal(ADMIN_TEAM, kind="admin", token_id=SETTINGS_ADMIN_ID)
        who = tokens.get(key)  # a token authenticated in the last api_token_cache_s seconds (and not expired since)
        if who is not None and who.expires_at is not None and who.expires_at <= _utcnow():
            tokens.discard(key)
            who = None
        if who is None:
            try:  # the database lookup (a cache miss) off the event loop
                who = await run_in_threadpool(authenticate_token, store, token)
            except InvalidToken as e:
                raise HTTPException(401, "token expired" if isinstance(e, TokenExpired) else "unknown or revoked token",
                                    headers={"WWW-Authenticate": 'Bearer error="invalid_token"'}) from None
            tokens.put(key, who)
        path = request.url.path
        if who.kind == "read-only" and request.method not in ("GET", "HEAD"):
            raise HTTPException(403, f"{request.method} {path}: a read-only token may only read (GET)")
        if who.kind == "node":
            raise HTTPException(403, f"{path}: a node token (node {who.node!r}) may only call the node API (/v1/node/...)")
        if who.kind == "finance" and not finance_route(request.method, path):
            raise HTTPException(403, f"{request.method} {path}: a finance token may only read the finance routes "
                                     "(GET /v1/usage/..., /v1/budgets)")
        return who

    Caller = Annotated[Principal, Depends(principal)]

    def visible_job(job_id: str, who: Caller) -> JobView:
        """The job ``job_id`` if the caller may see it; 404 otherwise (also for a malformed id)."""
        if not JOB_ID_RE.match(job_id):
            raise HTTPException(404, f"job_id={short_repr(job_id)}: no such job (ids look like job-0123456789abcdef)")
        return store.get(job_id, None if who.admin else who.team)

    Job = Annotated[JobView, Depends(visible_job)]

    def visible_schedule(schedule_id: str, who: Caller) -> ScheduleView:
        """The schedule ``schedule_id`` if the caller may see it; 404 otherwise (also for a malformed id)."""
        if not SCHEDULE_ID_RE.match(schedule_id):
            raise HTTPException(404, f"schedule_id={short_repr(schedule_id)}: no such schedule "
                                     f"(ids look like sch-0123456789abcdef)")
        return store.get_schedule(schedule_id, None if who.admin else who.team)

    Sched = Annotated[ScheduleView, Depends(visible_schedule)]

    def owner_team(spec: JobSpec, who: Principal) -> str:
        """The team a job (or schedule) of ``spec`` belongs to: the caller's; an admin may name
        any ``spec.team``. 403 when a team token names another team."""
        if who.admin:
            return spec.team if "team" in spec.model_fields_set else who.team
        if spec.team not in ("default", who.team):
            raise HTTPException(403, f"spec.team={spec.team!r}: your token belongs to team {who.team!r}")
        return who.team


    def charge(team: str, n: int, replayed: Callable[[], int] | None = None) -> None:
        """Take ``n`` submits from ``team``'s rate limit; 429 (:class:`RateLimitExceeded`) when refused. When
        refused, ``replayed()`` counts the request's jobs that already exist (idempotent replays, never
        refused): only the others are charged, and a request of replays only is let through."""
        if rate_limiter is None:
            return
        try:
            rate_limiter.charge(team, n)
        except LimitExceeded:
            old = replayed() if replayed is not None else 0
            if old == 0:
                raise
            if n > old:
                rate_limiter.charge(team, n - old)

    def exists(team: str, key: str, spec: JobSpec) -> bool:
        """Whether ``team`` already has the job of idempotency ``key`` with ``spec`` (a key used for another
        spec is not a replay: its 409 comes from the submit)."""
        try:
            return store.find_idempotent(team, key, spec) is not None
        except IdempotencyConflict:
            return False

    def entitled(spec: JobSpec, team: str, who: Principal) -> str | None:
        """Why ``team`` may not submit ``spec.priority_class`` (its ``quotas.priority_classes``), ``None`` if it may;
        an admin token may use any class."""
        return None if who.admin else priority_refusal(settings.quotas, team, spec.priority_class)

    def unholdable(spec: JobSpec, team: str, cap) -> tuple[str, Any, str] | None:
        """Why ``spec`` of ``team`` is refused with a 422 before it is stored, as ``(field, value, message)``:
        a wall-clock limit over the team's ``quotas.max_time_limit_s`` (every token), or no known node can ever
        hold it (``cap``, :func:`broker.service.feasibility.never_fits`); ``None`` when neither."""
        return time_limit_refusal(settings.quotas, team, spec) or (never_fits(spec, cap) if cap is not None else None)

    def quota_of(team: str) -> tuple[int | None, int | None]:
        """``team``'s ``(quotas.max_queued_jobs, quotas.max_queued_spec_bytes)`` (``None`` = unlimited)."""
        lim = settings.quotas.for_team(team)
        return lim.max_queued_jobs, lim.max_queued_spec_bytes

    # ------------------------------------------------------------------ health
    @app.get("/healthz", tags=["health"],
             responses={503: {"model": ErrorBody, "description": "the database or Redis is down (named)"}})
    def healthz() -> dict:
        """Liveness, a database round trip and a Redis ``PING``: ``{"status": "ok", "database": "ok",
        "redis": "ok"}``; 503 ``{"status": "degraded", "database": ..., "redis": ..., "detail": ...}`` naming
        each part that failed (``"unavailable"``). No ``redis`` key when the app was built without one. Plus
        ``pools`` (pool -> ``{"health", "not_planned"}``) for scheduler pools not reachable or with GPUs the planner
        leaves out (``pool_notes``; never a 503). A broker in trial mode (``serve all --trial``) adds ``"trial"``:
        the line naming its password-less services."""
        out: dict[str, Any] = {"status": "ok", "database": "ok"}
        notice = trial_notice(settings)  # serve all --trial: password-less services, said on every check
        down = []
        try:
            store.ping()
        except Exception as e:  # any driver error means the same thing here
            log.warning("healthz: database check failed: %s", e)
            out["database"] = "unavailable"
            down.append(f"database unavailable: {type(e).__name__}")
        if redis is not None:
            out["redis"] = "ok"
            try:
                redis.ping()
            except Exception as e:  # connection refused, timeout, auth: the queue is unusable
                log.warning("healthz: redis check failed: %s", type(e).__name__)
                out["redis"] = "unavailable"
                down.append(f"redis unavailable: {type(e).__name__}")
        notes = pool_notes() if pool_notes is not None else {}
        if notes:  # scheduler pools not reachable or with GPUs the planner leaves out: said, not a failure
            out["pools"] = notes
        if notice:
            out["trial"] = notice
        if down:
            return JSONResponse({**out, "status": "degraded", "detail": "; ".join(down)}, status_code=503)
        return out

    # ------------------------------------------------------------------ metrics
    scrapes = ScrapeCache(store, SCRAPE_CACHE_S)

    @app.get("/metrics", tags=["health"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text exposition"},
                        401: _ERRORS[401],
                        403: {"model": ErrorBody, "description": "a node token (node agents use /v1/node only)"}})
    def metrics(who: Caller) -> Response:
        """Prometheus metrics (:mod:`broker.service.metrics`): an admin token sees every team's series, any
        other token (member, read-only, team-admin) only its own team's; a node token gets 403. Each scope's
        answer is reused for ``SCRAPE_CACHE_S`` (10 s)."""
        body = scrapes.get(None if who.admin else who.team, _utcnow())
        return Response(body, media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ jobs
    @app.post("/v1/jobs", status_code=201, response_model=JobView, tags=["jobs"],
              responses={**_ERRORS, 200: {"model": JobView, "description": "idempotent replay: the existing job"},
                         403: {"model": ErrorBody, "description": "spec.team is another team"},
                         409: {"model": ErrorBody, "description": "idempotency key used with another spec"},
                         **_LIMITED})
    async def submit(body: SubmitRequest, who: Caller,
               idempotency_key_header: Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, pattern=r"^[\x21-\x7e]+$",
                                                                    max_length=200)] = None) -> JobView:
        """Store a job in state ``submitted`` for the planner.

        The job's team is the caller's (an admin may name any ``spec.team``). With an
        idempotency key (body ``idempotency_key`` or header ``Idempotency-Key``) a repeat
        of the same spec returns the first job with 200; the same key with another spec is 409.
        403 for a ``spec.priority_class`` above the team's ``quotas.priority_classes`` (the detail names the
        allowed classes; an admin token may use any).
        422 for a ``deadline`` not after now or a ``not_after`` in the past, a wall-clock limit (``time_limit_s``,
        else from ``estimated_duration_s``) over the team's ``quotas.max_time_limit_s``; 429 (``Retry-After``)
        over the team's submit rate, queued-jobs quota or spec-bytes quota (``quotas.max_queued_spec_bytes``), except
        for a replay of an existing job.
        """
        spec = body.spec
        key = body.idempotency_key
        if idempotency_key_header is not None:
            if key is not None and key != idempotency_key_header:
                raise _unprocessable("idempotency_key", key,
                                     f"differs from the Idempotency-Key header {idempotency_key_header!r}")
            key = idempotency_key_header
        team = owner_team(spec, who)
        refused = entitled(spec, team, who)
        if refused is not None:  # a replay of a job stored before a grant was revoked still answers that job
            existing = await run_in_threadpool(store.find_idempotent, team, key, spec) if key is not None else None
            if existing is None:
                raise HTTPException(403, refused)
            return _json(existing, 200)
        now = _utcnow()
        late = None
        if spec.deadline is not None and spec.deadline <= now:
            late = _unprocessable("spec.deadline", spec.deadline, f"must be after now ({now.isoformat(timespec='seconds')})")
        elif spec.not_after is not None and spec.not_after < now:
            late = _unprocessable("spec.not_after", spec.not_after, f"is in the past (now {now.isoformat(timespec='seconds')})")
        if late is not None:
            # a retry of a submit that was stored before its deadline passed answers the first job
            existing = await run_in_threadpool(store.find_idempotent, team, key, spec) if key is not None else None
            if existing is None:
                raise late
            return _json(existing, 200)
        cap = await run_in_threadpool(capacity_of) if capacity_of is not None else None
        refused = unholdable(spec, team, cap)
        if refused is not None:  # over the team's time-limit ceiling, or no known node can ever hold it
            raise _unprocessable(*refused)
        if rate_limiter is not None and rate_limiter.limits(team).submits_per_s is not None:  # Redis: off the loop
            await run_in_threadpool(
                charge, team, 1, (lambda: int(exists(team, key, spec))) if key is not None else None)
        # stored with the other submits in flight in this process, one transaction for all (group_commit)
        max_jobs, max_bytes = quota_of(team)
        job, created = await submits.submit(SubmitItem(
            team, spec, idempotency_key=key, now=now, not_after=spec.not_after, actor=who, max_unfinished=max_jobs,
            quota_retry_after_s=settings.quotas.quota_retry_after_s, max_spec_bytes=max_bytes))
        if cap is not None:  # an infeasible deadline, no node known to hold it: said in the answer
            job = with_warnings(job, cap, now)
        # the view was built from the validated spec: serialise it directly (FastAPI would dump,
        # re-validate and dump it again, a third of a submit's CPU)
        return _json(job, 201 if created else 200, {"Location": f"/v1/jobs/{job.id}"} if created else None)

    @app.post("/v1/jobs:batch", response_model=BatchResponse, tags=["jobs"],
              responses={401: _ERRORS[401], **_LIMITED})
    def submit_batch(body: BatchRequest, who: Caller) -> BatchResponse:
        """Submit 1-1000 jobs in one request (sweeps); each item is what ``POST /v1/jobs`` takes
        (``{"spec", "idempotency_key"}``) and gets its own result, in order (:mod:`broker.batch`):
        201 created, 200 an existing job (idempotent replay, also of an earlier item with the same key),
        403 another team's ``spec.team`` or a ``priority_class`` above the team's entitlement, 409 key used
        with another spec, 422 invalid (errors name
        ``items.<i>.<field>``). A bad item does not stop the others. The new jobs are stored in one
        transaction; 429 for the whole batch (nothing stored) when they exceed the team's submit rate
        (one token per new job), queued-jobs quota or spec-bytes quota. All items must belong to one team."""
        now = _utcnow()
        results: list[BatchItemResult | None] = [None] * len(body.items)
        accepted: list[tuple[int, JobSpec, str | None]] = []
        team: str | None = None
        cap = capacity_of() if capacity_of is not None else None  # what nodes can hold (broker.service.feasibility)
        for i, raw in enumerate(body.items):
            try:
                item = SubmitRequest.model_validate(raw)
            except ValidationError as e:
                results[i] = BatchItemResult(index=i, status=422, detail=[
                    _describe({**err, "loc": ("body", "items", i, *err.get("loc", ()))}) for err in e.errors()])
                continue
            spec = item.spec
            try:
                t = owner_team(spec, who)
            except HTTPException as e:
                results[i] = BatchItemResult(index=i, status=e.status_code, detail=e.detail)
                continue
            refused = entitled(spec, t, who)
            if refused is not None and not (item.idempotency_key is not None and exists(t, item.idempotency_key, spec)):
                results[i] = BatchItemResult(index=i, status=403, detail=f"items.{i}.{refused}")
                continue
            if team is None:
                team = t
            elif t != team:
                results[i] = BatchItemResult(index=i, status=422, detail=[_describe({
                    "type": "value_error", "loc": ("body", "items", i, "spec", "team"), "input": t,
                    "msg": f"items.{i}.spec.team={t!r}: a batch holds one team's jobs (earlier items: {team!r})"})])
                continue
            if spec.deadline is not None and spec.deadline <= now:
                late = ("deadline", spec.deadline, f"must be after now ({now.isoformat(timespec='seconds')})")
            elif spec.not_after is not None and spec.not_after < now:
                late = ("not_after", spec.not_after, f"is in the past (now {now.isoformat(timespec='seconds')})")
            else:
                late = None
            if late is not None:
                existing = None
                if item.idempotency_key is not None:
                    try:
                        existing = store.find_idempotent(t, item.idempotency_key, spec)
                    except IdempotencyConflict as e:
                        results[i] = BatchItemResult(index=i, status=409, detail=str(e))
                        continue
                if existing is not None:
                    results[i] = BatchItemResult(index=i, status=200, job=existing)
                else:
                    f, v, why = late
                    results[i] = BatchItemResult(index=i, status=422, detail=[_describe({
                        "type": "value_error", "loc": ("body", "items", i, "spec", f), "input": v,
                        "msg": f"items.{i}.spec.{f}={short_repr(v)}: {why}"})])
                continue
            refused = unholdable(spec, t, cap)
            if refused is not None:
                f, v, why = refused
                results[i] = BatchItemResult(index=i, status=422, detail=[_describe({
                    "type": "value_error", "loc": ("body", "items", i, *f.split(".")), "input": v,
                    "msg": f"items.{i}.{f}={short_repr(v)}: {why}"})])
                continue
            accepted.append((i, spec, item.idempotency_key))
        if accepted:
            assert team is not None
            keyed = [(sp, k) for _, sp, k in accepted if k is not None]

            charge(team, len(accepted), lambda: sum(exists(team, k, sp) for sp, k in keyed))
            max_jobs, max_bytes = quota_of(team)
            out = store.submit_many(team, [(sp, k, sp.not_after) for _, sp, k in accepted], now=now,
                                    actor=who, max_unfinished=max_jobs, max_spec_bytes=max_bytes,
                                    quota_retry_after_s=settings.quotas.quota_retry_after_s)
            first_new = None
            for (i, _, _), r in zip(accepted, out):
                if isinstance(r, IdempotencyConflict):
                    results[i] = BatchItemResult(index=i, status=409, detail=str(r))
                    continue
                job, created = r
                job = with_warnings(job, cap, now) if cap is not None else job
                results[i] = BatchItemResult(index=i, status=201 if created else 200, job=job)
                if created and first_new is None:
                    first_new = job.id
            if first_new is not None and on_submit is not None:
                try:  # one wake-up of the planner per batch
                    on_submit(first_new)
                except Exception:
                    log.exception("on_submit(%s) failed; the jobs are stored and the next planner tick sees them",
                                  first_new)
        done = [r for r in results if r is not None]
        return _json(BatchResponse(results=done, created=sum(r.status == 201 for r in done),
                                   existing=sum(r.status == 200 for r in done),
                                   failed=sum(r.status >= 400 for r in done)))

    @app.get("/v1/jobs", response_model=list[JobView], tags=["jobs"],
             responses={401: _ERRORS[401], 403: {"model": ErrorBody, "description": "another team's jobs"}})
    def list_jobs(who: Caller,
                  team: Annotated[str | None, Query(description="Only this team (default: yours; admins: all)",
                                                    **_TEAM_QUERY)] = None,
                  state: Annotated[list[str] | None, Query(
                      description="Only these states (repeat the parameter)", max_length=len(JobState),
                      json_schema_extra=_state_enum)] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                  offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="Jobs to skip (newest first)")] = 0,
                  name: Annotated[str | None, Query(min_length=1, max_length=200, pattern=LINE_PATTERN,
                                                    description="Only jobs of exactly this name")] = None,
                  ) -> Response:
        """Jobs newest first. A team token may only ask for its own team (403 otherwise). A page carries at most
        ``api_list_max_bytes`` of stored specs (8 MiB): it may end before ``limit`` jobs, and then its
        ``X-Next-Offset`` header gives the ``offset`` of the next page."""
        known = [s.value for s in JobState]
        for s in state or ():
            if s not in known:
                raise _unprocessable("state", s, f"not a job state (one of {', '.join(known)})", where="query")
        team = readable_team(who, team, who.admin)
        jobs, cut = store.list_jobs_page(team=team, states=state or None, limit=limit, offset=offset,
                                         max_spec_bytes=settings.api_list_max_bytes, name=name)
        if capacity_of is not None:
            cap, now = capacity_of(), _utcnow()
            jobs = [with_warnings(j, cap, now) for j in jobs]
        body = "[" + ",".join(j.model_dump_json() for j in jobs) + "]"
        return Response(body, media_type="application/json",
                        headers={"X-Next-Offset": str(offset + len(jobs))} if cut else None)

    @app.get("/v1/jobs/{job_id}", response_model=JobView, tags=["jobs"], responses=_ERRORS)
    def get_job(job: Job) -> JobView:
        """One job (``warnings``: a deadline it cannot meet or runs past, no node known to hold it)."""
        return job if capacity_of is None else with_warnings(job, capacity_of(), _utcnow())

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobView, tags=["jobs"],
              responses={**_ERRORS, 409: {"model": ErrorBody, "description": "the job already succeeded or failed"}})
    def cancel_job(job: Job, who: Caller) -> JobView:
        """Cancel a job: a waiting job becomes ``cancelled`` now; a running one gets ``cancel_requested``
        and its agent stops it. Cancelling a cancelled job is a no-op; a finished job answers 409."""
        return store.request_cancel(job.id, None if who.admin else who.team, actor=who)

    @app.post("/v1/jobs:cancel", response_model=CancelManyResponse, tags=["jobs"],
              responses={401: _ERRORS[401], 403: {"model": ErrorBody, "description": "another team's jobs, or a "
                                                                                       "read-only/node token"}})
    def cancel_jobs(body: CancelManyRequest, who: Caller) -> CancelManyResponse:
        """Cancel many jobs of one team in one request (:mod:`broker.bulk_cancel`): every unfinished job
        (``all``), or those in ``states`` and/or of ``name`` (AND-ed). Each is cancelled as by
        ``POST /v1/jobs/{job_id}/cancel`` and audited; the answer lists the ids. A team token may only name
        its own team (403); an admin token must name one (422)."""
        known = [s.value for s in JobState]
        unfinished = [s.value for s in JobState if s not in TERMINAL_STATES]
        for st in body.states or ():
            if st not in unfinished:
                why = (f"a {st} job is finished and cannot be cancelled" if st in known else
                       f"not a job state (one of {', '.join(known)})")
                raise _unprocessable("states", st, f"{why}; the unfinished states are {', '.join(unfinished)}")
        if not (body.all or body.states or body.name is not None):
            raise _unprocessable("all", body.all, "give all=true, states or name: an empty filter cancels nothing")
        if who.admin and body.team is None:
            raise _unprocessable("team", None, "an admin token cancels one team's jobs at a time: name the team")
        team = readable_team(who, body.team, who.admin)
        assert team is not None
        cancelled, requested, more = store.cancel_many(team, states=body.states, name=body.name, limit=body.limit,
                                                       actor=who)
        return CancelManyResponse(team=team, count=len(cancelled) + len(requested), cancelled=cancelled,
                                  cancel_requested=requested, more=more)

    @app.get("/v1/jobs/{job_id}/logs", response_model=LogsView, tags=["jobs"], responses=_ERRORS)
    def job_logs(job: Job,
                 attempt: Annotated[int | None, Query(ge=1, le=_INT32_MAX,
                                                      description="Attempt number (default: the latest)")] = None,
                 rank: Annotated[int, Query(ge=0, le=MAX_RANK, description="Node rank of a multi-node job")] = 0,
                 offset: Annotated[int, Query(ge=0, le=_INT32_MAX, description=(
                     "Characters (Unicode code points) of the text the caller already has: only the text after "
                     "them is sent (``fedbroker logs --follow``)"))] = 0
                 ) -> LogsView:
        """Captured stdout+stderr of one attempt and rank (``attempt`` 0 and empty text before the first attempt),
        from character ``offset`` on; ``truncated`` when the agent stopped shipping it at ``log_max_bytes`` or bytes
        were dropped between its head and tail (the cap, or the team's ``quotas.log_bytes``). 404 for an attempt
        that does not exist."""
        if attempt is not None and attempt > job.attempt:
            raise HTTPException(404, f"attempt={attempt}: job {job.id} has {job.attempt} attempt(s)")
        n = job.attempt if attempt is None else attempt
        chunks = store.log_chunks(job.id, n, rank) if n else []
        text_ = "".join(data for _, data in chunks)
        # the node agent ships at most log_max_bytes per attempt and rank, then one marker chunk; the shim and the
        # store keep a long log's head and tail with a "... N bytes dropped ..." line between
        truncated = ((bool(chunks) and chunks[-1][1].startswith(_TRUNCATED_MARK))
                     or len(text_.encode()) >= settings.log_max_bytes or dropped_bytes(text_) > 0)
        return LogsView(job_id=job.id, attempt=n, rank=rank, text=text_[offset:], truncated=truncated)

    @app.get("/v1/jobs/{job_id}/explain", response_model=ExplainView, tags=["jobs"], responses=_ERRORS)
    def explain_job(job: Job) -> ExplainView:
        """The planner's latest decision (chosen option and best alternatives, with $, kWh, kgCO2e
        and wait), the state history and the attempts."""
        from broker.schemas import latest_decisions

        record, events = store.decision(job.id), store.events(job.id)
        return ExplainView(job=job, decision=record, events=events, attempts=store.attempts(job.id),
                           decisions=latest_decisions(record, events))

    # ------------------------------------------------------------------ nodes
    @app.get("/v1/nodes", response_model=list[NodeView] | list[NodeCapacityView], tags=["nodes"],
             responses={401: _ERRORS[401]})
    def list_nodes(who: Caller) -> list[NodeView] | list[NodeCapacityView]:
        """Admin tokens: every on-prem node as its agent last reported it (:class:`NodeView`: per-GPU health,
        utilisation, memory, power). Other tokens: the free capacity only, per pool and GPU type
        (:class:`NodeCapacityView`: nodes, GPUs, healthy and free GPUs; no node names, no per-GPU use, since the
        nodes run other teams' jobs)."""
        if who.admin:
            return store.nodes()
        from datetime import timedelta

        from broker.service.store import nodes as node_rows

        heard = datetime.now(timezone.utc) - timedelta(seconds=settings.node_lost_after_s)
        with store.session() as s:
            return [NodeCapacityView(**c._asdict()) for c in node_rows.node_capacity(s, heard)]

    # ------------------------------------------------------------------ cloud instances
    from broker.service.cloud import REPORT_EVENTS

    @app.post("/v1/instances/report", tags=["instances"], include_in_schema=True,
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/x-www-form-urlencoded": {"schema": _report_form_schema(REPORT_EVENTS)}}}},
              responses={401: {"model": ErrorBody, "description": "missing report token, or not this rank's"},
                         404: {"model": ErrorBody, "description": "no cloud provider, or no such instance"},
                         415: {"model": ErrorBody, "description": "the body is not a form"},
                         422: {"model": ErrorBody}})
    async def instance_report(request: Request) -> dict:
        """A cloud instance reports on its rank of an attempt (sent by the instance's user data, see
        ``providers.launch.cloud_init``). Form fields (``application/x-www-form-urlencoded``): ``job_id``,
        ``attempt``, ``rank``, ``event`` (``running`` | ``notice`` | ``exited``), ``exit_code`` (with
        ``exited``; empty = no code), ``reason``, ``log_tail`` (the last 64 KiB of the container's log),
        ``seq`` (the rank's report counter, from 1: a report whose ``seq`` is not above the last one taken
        from the rank is a replay or a retry and answers 200 ``{"outcome": "duplicate"}``, changing nothing;
        200 rather than 409 so that the instance's retry of a report that was taken ends its retries).
        ``Authorization: Bearer <token>``: the rank's report token (HMAC of job, attempt and rank), not a
        team token. ``attempt``, ``rank`` and ``seq`` are digits only, ``exit_code`` digits with an optional ``-``.
        Returns ``{"outcome": ...}``; 401 without the token, 415 for a body that is not a form (JSON, ...)."""
        from urllib.parse import parse_qs

        from broker.service.cloud import ReportError

        if cloud is None:
            raise HTTPException(404, "no cloud provider is configured on this broker")
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not token:
            raise HTTPException(401, "missing token: send 'Authorization: Bearer <the instance's report token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/x-www-form-urlencoded":
            raise HTTPException(415, "body must be application/x-www-form-urlencoded (the form fields job_id, attempt, "
                                     "rank, event, seq, exit_code, reason, log_tail)")
        raw = await request.body()
        try:  # the body itself is ASCII (curl percent-encodes); a value's bytes may be cut mid-character (log_tail)
            body_text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HTTPException(422, f"body: {utf8_error(raw, e)}") from None
        try:
            form = {k: v[-1] for k, v in parse_qs(body_text, errors="replace",
                                                 keep_blank_values=True, max_num_fields=20).items()}
        except ValueError as e:
            raise HTTPException(422, f"body: not a form ({e})") from None
        fields: dict[str, Any] = {}
        for name, pattern in (("job_id", None), ("attempt", _UINT), ("rank", _UINT), ("event", None), ("seq", _UINT)):
            raw = form.get(name)
            if raw is None or raw == "":
                raise _unprocessable(name, raw, "field required")
            if pattern is None:
                fields[name] = raw
            elif not pattern.fullmatch(raw) or int(raw) > _INT32_MAX:
                raise _unprocessable(name, raw, f"must be an integer in [0, {_INT32_MAX}]")
            else:
                fields[name] = int(raw)
        code_raw = form.get("exit_code", "")
        if code_raw and (not _INT.fullmatch(code_raw) or not -_INT32_MAX - 1 <= int(code_raw) <= _INT32_MAX):
            raise _unprocessable("exit_code", code_raw, f"must be empty or an integer in [{-_INT32_MAX - 1}, {_INT32_MAX}]")
        code = int(code_raw) if code_raw else None

        def take() -> str:
            if not token or not cloud.check_token(fields["job_id"], fields["attempt"], fields["rank"], token):
                raise HTTPException(401, "not the report token of this job attempt and rank",
                                    headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
            return cloud.report(fields["job_id"], fields["attempt"], fields["rank"], fields["event"], code,
                                form.get("reason", "")[:2000], form.get("log_tail", ""), seq=fields["seq"])

        try:
            outcome = await run_in_threadpool(take)
        except ReportError as e:
            if e.status == 422:
                raise _unprocessable("event", fields["event"], str(e)) from None
            raise HTTPException(e.status, str(e)) from None
        if outcome in ("succeeded", "failed", "requeued", "cancelled", "running") and on_submit is not None:
            try:
                on_submit(fields["job_id"])
            except Exception:
                log.exception("on_submit callback failed after an instance report")
        return {"outcome": outcome}

    # ------------------------------------------------------------------ schedules
    @app.post("/v1/schedules", status_code=201, response_model=ScheduleView, tags=["schedules"],
              responses={401: _ERRORS[401], 403: {"model": ErrorBody, "description": "spec.team is another team"},
                         409: {"model": ErrorBody, "description": "the team already has a schedule of that name"},
                         **_LIMITED})
    def create_schedule(body: ScheduleRequest, response: Response, who: Caller) -> ScheduleView:
        """Create a recurring run: at every fire of ``cron`` (local time of ``timezone``) the
        reconciler submits ``spec`` as a job of the caller's team (an admin may name any
        ``spec.team``). The first fire is the first one after now (``next_fire_at``).

        422 naming the field for a bad ``name``, ``cron`` or ``timezone`` and for absolute
        instants in the spec (``spec.deadline``, ``spec.earliest_start``/``not_before``,
        ``spec.not_after``: give ``slack_s``) and for a wall-clock limit over the team's ``quotas.max_time_limit_s``;
        409 if the team already has a schedule of that name;
        403 for a ``spec.priority_class`` above the team's ``quotas.priority_classes``;
        429 over the team's submit rate (a schedule creation costs one submit) or when the team already holds
        ``quotas.max_schedules`` schedules (``limit: quotas.max_schedules``, no ``Retry-After``: delete one).
        """
        team = owner_team(body.spec, who)
        refused = entitled(body.spec, team, who)
        if refused is not None:
            raise HTTPException(403, refused)
        too_long = time_limit_refusal(settings.quotas, team, body.spec)
        if too_long is not None:
            raise _unprocessable(*too_long)
        charge(team, 1)
        try:
            sched = store.create_schedule(team, body.name, body.cron, body.timezone, body.spec, now=_utcnow(),
                                          actor=who, max_schedules=settings.quotas.for_team(team).max_schedules)
        except InvalidSchedule as e:
            raise RequestValidationError([{"type": "value_error", "loc": ("body", *field.split(".")), "input": value,
                                           "msg": msg} for field, value, msg in e.errors]) from None
        response.headers["Location"] = f"/v1/schedules/{sched.id}"
        return sched

    @app.get("/v1/schedules", response_model=list[ScheduleView], tags=["schedules"],
             responses={401: _ERRORS[401], 403: {"model": ErrorBody, "description": "another team's schedules"}})
    def list_schedules(who: Caller, team: Annotated[str | None, Query(
            description="Only this team (default: yours; admins: all)", **_TEAM_QUERY)] = None) -> list[ScheduleView]:
        """Schedules by team, then name. A team token may only ask for its own team (403 otherwise)."""
        team = readable_team(who, team, who.admin)
        return store.schedules(team)

    @app.get("/v1/schedules/{schedule_id}", response_model=ScheduleView, tags=["schedules"],
             responses=_SCHEDULE_ERRORS)
    def get_schedule(sched: Sched) -> ScheduleView:
        """One schedule."""
        return sched

    @app.post("/v1/schedules/{schedule_id}/pause", response_model=ScheduleView, tags=["schedules"],
              responses={**_SCHEDULE_ERRORS, **_LIMITED})
    def pause_schedule(sched: Sched, who: Caller) -> ScheduleView:
        """Pause a schedule: it creates no jobs until resumed (``enabled`` false). Pausing a paused one is a no-op.
        Costs one submit of the team's rate limit, as a resume does (429 over it): each writes an audit row, and
        a member toggling one schedule once wrote 177 rows/s."""
        charge(sched.team, 1)
        return store.set_schedule_enabled(sched.id, False, None if who.admin else who.team, now=_utcnow(), actor=who)

    @app.post("/v1/schedules/{schedule_id}/resume", response_model=ScheduleView, tags=["schedules"],
              responses={**_SCHEDULE_ERRORS, **_LIMITED})
    def resume_schedule(sched: Sched, who: Caller) -> ScheduleView:
        """Resume a paused schedule: its next fire is the first one after now; fires missed while
        paused are skipped. Resuming an enabled schedule is a no-op. Costs one submit (429 over the rate)."""
        charge(sched.team, 1)
        return store.set_schedule_enabled(sched.id, True, None if who.admin else who.team, now=_utcnow(), actor=who)

    @app.delete("/v1/schedules/{schedule_id}", status_code=204, response_class=Response, tags=["schedules"],
                responses=_SCHEDULE_ERRORS)
    def delete_schedule(sched: Sched, who: Caller) -> Response:
        """Delete a schedule (204). The jobs it already created stay, with their ``schedule_id``."""
        if not store.delete_schedule(sched.id, None if who.admin else who.team, actor=who):
            raise ScheduleNotFound(f"schedule_id={sched.id!r}: no such schedule"
                                   + ("" if who.admin else f" for team {who.team!r}"))
        return Response(status_code=204)

    from broker.service.api_tokens import register as register_token_routes

    register_token_routes(app, store, settings, Caller)

    # ------------------------------------------------------------------ budgets (broker.service.api_budgets)
    from broker.service.api_budgets import register as register_budget_routes

    register_budget_routes(app, store, Caller)

    # ------------------------------------------------------------------ usage ledger (issue #12)
    from broker.service.api_usage import register as register_usage_routes

    register_usage_routes(app, store, settings, Caller)  # /v1/usage/summary, /v1/usage/focus

    from broker.service.api_finance import register as register_finance_page

    register_finance_page(app)  # GET /finance: the page; its script reads /v1/usage/summary and /v1/budgets
    from broker.service.api_docs import register as register_docs_page

    register_docs_page(app)  # GET /docs: Swagger UI served from the package, under a strict CSP
    # /v1/node: agents (broker.service.node_api); last, so that the routes above are matched without it
    app.include_router(node_router(store, settings, on_change=on_submit))
    return app


def _known_capacity(store: JobStore, settings: BrokerSettings):
    """``() -> KnownCapacity`` of the store's registered nodes and the cluster file's pools
    (:class:`broker.service.feasibility.CapacityCache`), or ``None`` when the cluster file cannot be read
    (the planning cycle reports that; submits are then not checked)."""
    from broker.cluster import ClusterError, load_cluster
    from broker.service.feasibility import CapacityCache
    from broker.service.live import LIVE_CLUSTER_PATH

    try:
        pools = load_cluster(getattr(settings, "cluster", None) or LIVE_CLUSTER_PATH)
    except (ClusterError, OSError):
        return None
    return CapacityCache(store, pools, bool(getattr(settings, "cloud_providers", ()))).get


def with_warnings(job: JobView, cap, now: datetime) -> JobView:
    """``job`` with its ``warnings`` at ``now`` (:func:`broker.service.feasibility.job_warnings`)."""
    found = job_warnings(job, cap, now)
    return job.model_copy(update={"warnings": found}) if found else job


def redis_client(url: str):
    """A ``redis.Redis`` for ``url`` with 1 s connect/read timeouts, for ``/healthz``'s ``PING``."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
