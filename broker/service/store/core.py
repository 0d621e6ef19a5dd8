"""The job store: the source of truth for job state (ARCHITECTURE.md §5).

:class:`JobStore` wraps a SQLAlchemy engine (PostgreSQL in production, SQLite
for a single-machine trial) and offers the operations the API, the planner
cycle, the reconciler and the node agents need. Every state change is a
compare-and-set on ``jobs.version`` checked against
:data:`broker.states.ALLOWED_TRANSITIONS` and recorded in ``job_events``.

Exceptions::

    StoreError (ValueError)
     +-- JobNotFound        no such job, or not visible to the asking team
     +-- IdempotencyConflict same idempotency key, different spec
     +-- NotCancellable     the job is already finished
     +-- ScheduleNotFound   no such schedule, or not visible to the asking team
     +-- ScheduleConflict   the team already has a schedule of that name
     +-- InvalidSchedule    bad schedule name, cron, time zone, or an absolute instant in its spec
    broker.service.store.quota.ScheduleCapExceeded  create_schedule over the team's quotas.max_schedules
     +-- broker.service.tokens.TokenError  token operations (unknown, expired, forbidden, bootstrap refused, ...)
    broker.states.InvalidTransition (ValueError)
    broker.service.store.quota.QuotaExceeded    submit/submit_many over the team's quotas.max_queued_jobs or
                                                quotas.max_queued_spec_bytes (limit names which)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

from pydantic import ValidationError
from sqlalchemy import JSON, LargeBinary, Text, cast, create_engine, delete, event, func, insert, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker.service.store.tables import (Attempt, AuditEvent, Base, Job, JobEvent, JobLog, Node, PlannerState, Schedule,
                                        utcnow)
from broker.service.store.quota import ScheduleCapExceeded, queue_refusal, spec_bytes
from broker.service.store.tokens import Principal, audit, audit_row, hash_token
from broker.model import JobSpec, default_slack_s, short_repr
from broker.schemas import SCHEDULE_NAME_RE, AttemptView, JobEventView, JobView, NodeView, ScheduleView
from broker.states import ON_NODE_STATES, UNFINISHED_STATES, JobState, check_transition
from broker.bulk_cancel import CANCEL_BATCH_JOBS, MAX_CANCEL_JOBS

__all__ = ["JobStore", "StoreError", "JobNotFound", "IdempotencyConflict", "NotCancellable", "ScheduleNotFound",
           "ScheduleConflict", "InvalidSchedule", "Principal", "new_job_id", "new_schedule_id", "hash_token",
           "default_deadline", "check_schedule", "SubmitItem", "SubmitWriter"]

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
#: the states a team's queued-jobs quota counts, as stored
_UNFINISHED = sorted(x.value for x in UNFINISHED_STATES)


class StoreError(ValueError):
    """Base of the store's errors."""


class JobNotFound(StoreError):
    """No job with this id that the caller may see."""


class IdempotencyConflict(StoreError):
    """The idempotency key was used before, with a different spec."""


class NotCancellable(StoreError):
    """The job already finished."""


class ScheduleNotFound(StoreError):
    """No schedule with this id that the caller may see."""


class ScheduleConflict(StoreError):
    """The team already has a schedule with this name (names are unique per team)."""


class InvalidSchedule(StoreError):
    """A schedule was rejected; nothing was stored.

    Attributes:
        errors: ``[(field, value, message)]``, one per rejected field; ``field`` is dotted
            (``"cron"``, ``"timezone"``, ``"name"``, ``"spec.deadline"``) and ``message``
            starts with ``field=value:`` (``"cron='61 * * * *': ..."``). ``str(e)`` joins the messages.
    """

    def __init__(self, errors: list[tuple[str, Any, str]]):
        super().__init__("; ".join(m for _, _, m in errors))
        self.errors = errors


#: how long a group of single submits waits for a row lock (a team's ``team_usage`` counter, held by that team's
#: bulk submit until it commits) before it is given up and its submits are stored one by one, side by side
GROUP_LOCK_TIMEOUT_MS = 100

#: the columns of an audit event row (the keys of :func:`broker.service.store.tokens.audit_row`)
_AUDIT_COLS = ("at", "actor_token_id", "actor_team", "actor_kind", "action", "target", "detail")


def new_job_id() -> str:
    """A new job id: ``job-`` and 16 hex digits (64 random bits)."""
    return "job-" + uuid.uuid4().hex[:16]


def new_schedule_id() -> str:
    """A new schedule id: ``sch-`` and 16 hex digits (64 random bits)."""
    return "sch-" + uuid.uuid4().hex[:16]


#: spec fields that hold absolute instants, with why a recurring run cannot use them
_ABSOLUTE_FIELDS = {
    "deadline": "a recurring run's spec cannot hold an absolute deadline; every run is relative to its fire "
                "instant: give slack_s (seconds beyond estimated_duration_s, counted from each fire)",
    "earliest_start": "a recurring run's spec cannot hold an absolute start (earliest_start/not_before); "
                      "every run is submitted at its fire instant",
    "not_after": "a recurring run's spec cannot hold an absolute latest start; every run is relative to its "
                 "fire instant: bound it with slack_s",
}


#: the most bytes a schedule's stored spec holds (:func:`broker.service.store.quota.spec_bytes`): schedules' specs
#: count against no spec budget (a team holds ``quotas.max_schedules`` of them: 100 x 64 KiB = 6.4 MiB, where 100
#: specs of 2.75 MB each once were 275 MB in every ``GET /v1/schedules``)
MAX_SCHEDULE_SPEC_BYTES = 64 * 1024


def check_schedule(name: str, cron: str, timezone: str, spec: JobSpec) -> str:
    """Check a schedule's definition without storing it (used by :meth:`JobStore.create_schedule`,
    the API and the CLI, so all three reject the same things with the same words).

    Args:
        name: 1-200 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit.
        cron: 5-field cron expression (:func:`broker.recurring.validate_cron`).
        timezone: IANA zone the cron is read in (:func:`broker.recurring.validate_timezone`).
        spec: the job every fire submits; ``deadline``, ``earliest_start`` (``not_before``)
            and ``not_after`` must be ``None`` (use ``slack_s``: each run's deadline is its
            fire instant + ``estimated_duration_s`` + ``slack_s``); at most :data:`MAX_SCHEDULE_SPEC_BYTES`
            (64 KiB) stored.

    Returns:
        str: the cron expression normalised (whitespace collapsed, lower case, macros expanded).

    Raises:
        InvalidSchedule: every rejected field, each message naming the field and the value.
    """
    from broker.recurring import ScheduleError, validate_cron, validate_timezone

    errors: list[tuple[str, Any, str]] = []
    if not isinstance(name, str) or not SCHEDULE_NAME_RE.match(name):
        errors.append(("name", name, f"name={name!r}: 1-200 letters, digits, '.', '_' or '-', "
                                     f"starting with a letter or digit"))
    normalised = cron
    try:
        normalised = validate_cron(cron)
    except ScheduleError as e:
        errors.append(("cron", cron, str(e)))
    try:
        validate_timezone(timezone)
    except ScheduleError as e:
        errors.append(("timezone", timezone, str(e)))
    for field, why in _ABSOLUTE_FIELDS.items():
        v = getattr(spec, field)
        if v is not None:
            errors.append((f"spec.{field}", v, f"spec.{field}={v.isoformat()!r}: {why}"))
    size = spec_bytes(spec.model_dump(mode="json"))
    if size > MAX_SCHEDULE_SPEC_BYTES:
        errors.append(("spec.command", f"{len(spec.command)} arguments",
                       f"spec.command: {len(spec.command)} arguments make the spec {size} bytes as stored; a "
                       f"schedule's spec holds at most {MAX_SCHEDULE_SPEC_BYTES} (put a long command in a script in "
                       f"the image)"))
    if errors:
        raise InvalidSchedule(errors)
    return normalised


def spec_hash(spec: JobSpec) -> str:
    """SHA-256 of the spec's canonical JSON: equal specs give equal hashes."""
    return _hash_dumped(spec.model_dump(mode="json"))


def _hash_dumped(dumped: dict) -> str:
    """:func:`spec_hash` of a spec already dumped with ``model_dump(mode="json")``."""
    return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def _submit_sql(cols: tuple[str, ...], audited: bool = False) -> str:
    """PostgreSQL: a job row of columns ``cols`` and its ``submitted`` event in one statement (a
    data-modifying CTE; psycopg named parameters, one per column); with ``audited`` also the caller's
    ``job.submit`` audit event (parameters ``a_at``, ``a_actor_token_id``, ... of :data:`_AUDIT_COLS`),
    so a submit is one round trip however it is audited."""
    audit = ""
    if audited:
        audit = (f", a AS (INSERT INTO audit_events ({', '.join(_AUDIT_COLS)}) "
                 f"VALUES ({', '.join(f'%(a_{c})s' for c in _AUDIT_COLS)}))")
    return (f"WITH j AS (INSERT INTO jobs ({', '.join(cols)}) "
            f"VALUES ({', '.join(f'%({c})s' for c in cols)}) RETURNING id, created_at){audit} "
            "INSERT INTO job_events (job_id, at, from_state, to_state, version, reason) "
            "SELECT id, created_at, NULL, 'submitted', 1, 'submitted' FROM j")


def default_deadline(submitted: datetime, spec: JobSpec) -> datetime:
    """The completion deadline of a job without one, as in the simulator
    (:func:`broker.sim.traces.default_deadline_s`): submit + duration + max(duration, 12 h),
    or submit + duration + ``slack_s`` when the spec gives a slack."""
    d = spec.estimated_duration_s
    slack = spec.slack_s if spec.slack_s is not None else default_slack_s(d)
    start = max(submitted, spec.earliest_start) if spec.earliest_start else submitted
    return start + timedelta(seconds=d + slack)


def _stored_spec(raw: dict) -> JobSpec:
    """The stored spec as a :class:`JobSpec`; a row that today's rules reject (written by an older
    version) is shown as stored instead of failing every read that includes it."""
    try:
        return JobSpec.model_validate(raw)
    except ValidationError:
        return JobSpec.model_construct(**raw)


def _job_view(j: Job) -> JobView:
    return JobView(id=j.id, team=j.team, name=j.name, state=j.state, version=j.version,
                   spec=_stored_spec(j.spec), created_at=j.created_at, updated_at=j.updated_at,
                   not_before=j.not_before, not_after=j.not_after, deadline=j.deadline, reason=j.reason,
                   placement=j.placement, attempt=j.attempt, started_at=j.started_at, finished_at=j.finished_at,
                   exit_code=j.exit_code, cancel_requested=j.cancel_requested, idempotency_key=j.idempotency_key,
                   schedule_id=j.schedule_id)


def _new_job_view(row: dict, spec: JobSpec) -> JobView:
    """The view of a job row just written (``row``: the inserted values; ``spec``: its validated spec)."""
    return JobView(id=row["id"], team=row["team"], name=row["name"], state=row["state"], version=row["version"],
                   spec=spec, created_at=row["created_at"], updated_at=row["updated_at"],
                   not_before=row["not_before"], not_after=row["not_after"], deadline=row["deadline"],
                   reason=row["reason"], placement=None, attempt=0, started_at=None, finished_at=None,
                   exit_code=None, cancel_requested=False, idempotency_key=row["idempotency_key"],
                   schedule_id=row["schedule_id"])


def _schedule_view(r: Schedule) -> ScheduleView:
    return ScheduleView(id=r.id, team=r.team, name=r.name, cron=r.cron, timezone=r.timezone,
                        spec=_stored_spec(r.spec), enabled=r.enabled, next_fire_at=r.next_fire_at,
                        last_fire_at=r.last_fire_at, created_at=r.created_at, last_error=r.last_error,
                        last_skip_at=r.last_skip_at, last_skip_reason=r.last_skip_reason)


def _new_job_row(team: str, spec: JobSpec, idempotency_key: str | None, now: datetime,
                 not_after: datetime | None, schedule_id: str | None) -> tuple[dict, JobSpec]:
    """The ``jobs`` row of a new submitted job of ``team`` (a new id; ``spec.team`` replaced by ``team``;
    the deadline defaulted by :func:`default_deadline`) and the spec as stored."""
    spec = spec.model_copy(update={"team": team})
    dumped = spec.model_dump(mode="json")
    row = dict(id=new_job_id(), team=team, name=spec.name, spec=dumped,
               state=JobState.submitted.value, version=1, priority=spec.priority_class.rank,
               idempotency_key=idempotency_key, spec_hash=_hash_dumped(dumped), created_at=now, updated_at=now,
               not_before=spec.earliest_start, not_after=not_after or spec.not_after,
               deadline=spec.deadline or default_deadline(now, spec), reason="submitted",
               deferred_once=False, attempt=0, cancel_requested=False, work_done_s=0.0, schedule_id=schedule_id)
    return row, spec


def _over(quotas: tuple[int | None, int | None], held: tuple[int, int]) -> bool:
    """Whether a team holding ``held`` = ``(unfinished jobs, spec bytes)`` is over ``quotas`` = ``(max_unfinished,
    max_spec_bytes)`` (``None``/0 = unlimited)."""
    return any(q and h > q for q, h in zip(quotas, held))


def _tighter(a: int | None, b: int | None) -> int | None:
    """The tighter of two limits, ``None``/0 = unlimited."""
    return min(a, b) if a and b else (a or b or None)


class SubmitItem(NamedTuple):
    """One single submit for :meth:`JobStore.submit_group`: the arguments of :meth:`JobStore.submit`
    (``max_unfinished``: ``quotas.max_queued_jobs``; ``max_spec_bytes``: ``quotas.max_queued_spec_bytes``)."""

    team: str
    spec: JobSpec
    idempotency_key: str | None = None
    now: datetime | None = None
    not_after: datetime | None = None
    actor: Principal | None = None
    max_unfinished: int | None = None
    quota_retry_after_s: int = 30
    max_spec_bytes: int | None = None


def spec_bytes_expr(s: Session):
    """SQL for the bytes of a job's stored JSON spec (:func:`broker.service.store.quota.spec_bytes`) in ``s``'s
    dialect: PostgreSQL's ``octet_length(spec::text)``, SQLite's ``length(CAST(spec AS BLOB))``."""
    if s.get_bind().dialect.name == "postgresql":
        return func.octet_length(cast(Job.spec, Text))
    return func.length(cast(Job.spec, LargeBinary))


class JobStore:
    """Operations on the job store.

    Args:
        url: SQLAlchemy URL (``postgresql+psycopg://...`` or ``sqlite:///PATH``).
        schema: PostgreSQL schema to use (created if missing); ``None`` = default search path.

    SQLite runs with WAL and a 30 s busy timeout so the API, workers and agents
    on one machine can share the file; a missing file is created mode 0600 (in a new directory of
    mode 0700), and :attr:`created_file` says so.
    """

    def __init__(self, url: str, schema: str | None = None, echo: bool = False):
        self.url = url
        self.schema = schema
        kw: dict[str, Any] = {"echo": echo, "future": True}
        #: an SQLite store whose file this made (a new, empty store: a wrong working directory or settings file?)
        self.created_file = False
        if url.startswith("sqlite"):
            path = url.split("sqlite:///", 1)[-1]
            if path and path != ":memory:":
                # private to the broker's user: the file holds token hashes, specs and logs
                Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                    self.created_file = True
                except FileExistsError:
                    pass
            kw["connect_args"] = {"timeout": 30, "check_same_thread": False}
        else:
            kw["pool_pre_ping"] = True
            kw["pool_size"] = 5
            kw["max_overflow"] = 10
            if schema:
                kw["connect_args"] = {"options": f"-csearch_path={schema}"}
        self.engine: Engine = create_engine(url, **kw)
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(dbapi_conn, _rec):  # pragma: no cover - trivial
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()
            # pysqlite's own transaction handling defers BEGIN; take the write lock at BEGIN so
            # two writers never deadlock on a lock upgrade.
            @event.listens_for(self.engine, "connect")
            def _no_autobegin(dbapi_conn, _rec):  # pragma: no cover - trivial
                dbapi_conn.isolation_level = None

            @event.listens_for(self.engine, "begin")
            def _begin_immediate(conn):  # pragma: no cover - trivial
                conn.exec_driver_sql("BEGIN IMMEDIATE")
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings) -> "JobStore":
        """A store for :class:`broker.service.settings.BrokerSettings`."""
        return cls(settings.effective_database_url, settings.database_schema)

    # ------------------------------------------------------------------ schema
    def migrate(self, revision: str = "head") -> None:
        """Bring the schema to Alembic ``revision`` (default the latest; creates the PostgreSQL schema if needed)."""
        from alembic import command
        from alembic.config import Config

        if self.schema and not self.url.startswith("sqlite"):
            with self.engine.begin() as c:
                c.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'))
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)

    def drop_schema(self) -> None:
        """Drop the PostgreSQL schema (tests) or every table (SQLite)."""
        if self.schema and not self.url.startswith("sqlite"):
            with self.engine.begin() as c:
                c.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        else:
            Base.metadata.drop_all(self.engine)
        self.engine.dispose()

    def ping(self) -> None:
        """One database round trip (``SELECT 1``) on a fresh connection; raises the driver's error when the
        database cannot be reached (the API's ``/healthz``)."""
        with self.engine.connect() as c:
            c.execute(text("SELECT 1"))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error."""
        with self._sessions() as s, s.begin():
            yield s

    # ------------------------------------------------------------------ submit / read
    def submit(self, team: str, spec: JobSpec, *, idempotency_key: str | None = None,
               now: datetime | None = None, not_after: datetime | None = None,
               schedule_id: str | None = None, actor: Principal | None = None, max_unfinished: int | None = None,
               quota_retry_after_s: int = 30, max_spec_bytes: int | None = None) -> tuple[JobView, bool]:
        """Store a new job in state ``submitted``; returns ``(job, created)``.

        With ``actor`` (the API's caller) a ``job.submit`` audit event is written in the same transaction.

        With an ``idempotency_key`` already used by ``team`` for the same spec, returns the
        existing job and ``created=False``; with a different spec raises :class:`IdempotencyConflict`.
        ``spec.team`` is overwritten by ``team`` (the caller's identity decides).
        With ``max_unfinished`` (the team's ``quotas.max_queued_jobs``) the team's unfinished jobs are
        counted in the same transaction (:meth:`_unfinished_after_insert`) and a job over it raises
        :class:`broker.service.store.quota.QuotaExceeded` (a replay of an existing job is still answered); so does
        one that would take the bytes of the team's unfinished jobs' specs (:func:`~broker.service.store.quota.spec_bytes`)
        over ``max_spec_bytes`` (the team's ``quotas.max_queued_spec_bytes``, ``limit`` naming it). Nothing of a
        refused submit is stored.
        """
        now = now or utcnow()
        row, spec = _new_job_row(team, spec, idempotency_key, now, not_after, schedule_id)
        job_id, h = row["id"], row["spec_hash"]
        # One transaction, no read before the insert: the unique (team, idempotency_key) constraint
        # detects a repeat (also a concurrent one), and the view is built from the row written.
        # With a quota the team's unfinished jobs are counted after the insert (the new one included).
        quotas = (max_unfinished, max_spec_bytes)
        try:
            if self.engine.dialect.name == "postgresql":
                held = self._submit_pg(row, quotas, audit_event=None if actor is None else audit_row(
                    actor, "job.submit", job_id, {"team": team, "name": spec.name}, now))
            else:
                with self.session() as s:
                    s.execute(insert(Job).values(**row))
                    s.execute(insert(JobEvent).values(job_id=job_id, at=now, from_state=None,
                                                      to_state=JobState.submitted.value, version=1, reason="submitted"))
                    if actor is not None:
                        audit(s, actor, "job.submit", job_id, {"team": team, "name": spec.name}, now)
                    held = self._unfinished_after_insert(s, team) if any(quotas) else (0, 0)
                    refused = queue_refusal(team, *quotas, *held, [row], quota_retry_after_s)
                    if refused is not None:
                        raise refused
            refused = queue_refusal(team, *quotas, *held, [row], quota_retry_after_s)
            if refused is not None:  # PostgreSQL: rolled back
                raise refused
        except IntegrityError:
            if idempotency_key is None:
                raise
            found = self._by_key(team, idempotency_key, h)
            if found is None:
                raise
            return found, False
        return _new_job_view(row, spec), True

    def _submit_pg(self, row: dict, quotas: tuple[int | None, int | None],
                   audit_event: dict | None = None) -> tuple[int, int]:
        """PostgreSQL fast path of :meth:`submit` (the API's hot path): the job ``row`` and its ``submitted``
        event in one statement (:func:`_submit_sql`, a data-modifying CTE), then, with a quota, the team's
        ``team_usage`` counters (see :meth:`_unfinished_after_insert`); straight on the driver's cursor
        (SQLAlchemy's statement machinery was half of a submit's CPU). ``quotas``: ``(max_unfinished,
        max_spec_bytes)``. Returns the team's ``(unfinished jobs, spec bytes)`` with the new one (``(0, 0)``
        without a quota); over either quota the transaction is rolled back.
        Raises :class:`IntegrityError` for a duplicate key."""
        import psycopg
        from psycopg.rows import dict_row
        from psycopg.types.json import Json

        with self.engine.connect() as conn:
            raw = conn.connection.driver_connection
            try:
                with raw.cursor(row_factory=dict_row) as cur:
                    params = {**row, "spec": Json(row["spec"])}
                    if audit_event is not None:  # the caller's job.submit audit event, same statement
                        params.update({f"a_{c}": audit_event[c] for c in _AUDIT_COLS})
                        params["a_detail"] = Json(audit_event["detail"])
                    cur.execute(_submit_sql(tuple(row), audit_event is not None), params)
                    held = (0, 0)
                    if any(quotas):
                        cur.execute("SELECT unfinished, spec_bytes FROM team_usage WHERE team = %s", (row["team"],))
                        usage = cur.fetchone()
                        if usage is not None:
                            held = (int(usage["unfinished"]), int(usage["spec_bytes"]))
                if _over(quotas, held):
                    raw.rollback()
                else:
                    raw.commit()
            except psycopg.errors.UniqueViolation as e:
                raw.rollback()
                raise IntegrityError("INSERT INTO jobs", None, e) from e
            except BaseException:
                raw.rollback()
                raise
        return held

    def submit_group(self, items: Sequence[SubmitItem]) -> list[tuple[JobView, bool] | Exception]:
        """Many independent single submits stored together where that changes no answer
        (:meth:`SubmitWriter.submit_group`, on a connection of its own for this call)."""
        writer = SubmitWriter(self)
        try:
            return writer.submit_group(items)
        finally:
            writer.close()

    def submit_writer(self) -> "SubmitWriter":
        """A :class:`SubmitWriter` for one thread that submits many groups (the API's group commit)."""
        return SubmitWriter(self)

    def submit_item(self, it: SubmitItem) -> tuple[JobView, bool]:
        """:meth:`submit` with the arguments ``it`` holds."""
        return self.submit(it.team, it.spec, idempotency_key=it.idempotency_key, now=it.now, not_after=it.not_after,
                           actor=it.actor, max_unfinished=it.max_unfinished,
                           quota_retry_after_s=it.quota_retry_after_s, max_spec_bytes=it.max_spec_bytes)

    def _submit_each(self, items: Sequence[SubmitItem]) -> list[tuple[JobView, bool] | Exception]:
        """:meth:`submit_item` per item, each error kept as that item's result."""
        out: list[tuple[JobView, bool] | Exception] = []
        for it in items:
            try:
                out.append(self.submit_item(it))
            except Exception as e:  # the item's own answer; the others go on
                out.append(e)
        return out

    def _unfinished_after_insert(self, s: Session, team: str) -> tuple[int, int]:
        """Inside a submit transaction ``s`` that has just inserted jobs of ``team``: how many unfinished
        jobs (:data:`broker.states.UNFINISHED_STATES`) the team holds and the bytes of their specs
        (:func:`broker.service.store.quota.spec_bytes`), the new ones included: ``(jobs, bytes)``.

        PostgreSQL: the ``team_usage`` counters kept by triggers on ``jobs`` (migrations 0007 and 0017; O(1)). The
        insert's trigger updated the team's counter row, so this transaction holds its row lock until it commits:
        the team's concurrent submits wait for it and then count on top of it (never over the quota);
        other teams are not blocked. SQLite: a count and a sum of ``length(CAST(spec AS BLOB))`` (``BEGIN
        IMMEDIATE`` serialises every writer; a trial's store is small)."""
        if self.engine.dialect.name == "postgresql":
            r = s.execute(text("SELECT unfinished, spec_bytes FROM team_usage WHERE team = :t"), {"t": team}).first()
            return (0, 0) if r is None else (int(r[0]), int(r[1]))
        n, b = s.execute(select(func.count(), func.coalesce(func.sum(spec_bytes_expr(s)), 0))
                         .where(Job.team == team, Job.state.in_(_UNFINISHED))).one()
        return int(n), int(b)

    def submit_many(self, team: str, items: Sequence[tuple[JobSpec, str | None, datetime | None]], *,
                    now: datetime | None = None, max_unfinished: int | None = None,
                    quota_retry_after_s: int = 30, actor: Principal | None = None, max_spec_bytes: int | None = None
                    ) -> list[tuple[JobView, bool] | IdempotencyConflict]:
        """Store many jobs of ``team`` in one transaction (the bulk submit); per item as :meth:`submit`.

        Args:
            items: ``(spec, idempotency_key or None, not_after or None)`` per job, already validated.
            now: aware submit instant of all of them (default: the current time).
            max_unfinished: the team's ``quotas.max_queued_jobs``: the new jobs all count; if they do not
                all fit, none is stored and :class:`broker.service.store.quota.QuotaExceeded` is raised.
            max_spec_bytes: the team's ``quotas.max_queued_spec_bytes``: likewise for the bytes of the specs of the
                team's unfinished jobs and the new ones (:func:`broker.service.store.quota.spec_bytes`); a replay
                adds nothing.
            actor: the API's caller: a ``job.submit`` audit event per new job, in the same transaction.

        Returns:
            one entry per item, in order: ``(job, created)`` (``created=False``: the key was used before
            with the same spec, also earlier in this batch), or an :class:`IdempotencyConflict` (the key was
            used with another spec) that stores nothing for that item.

        One lookup query for every key, one multi-row insert of jobs and one of their ``submitted``
        events. A concurrent single submit that takes one of the keys first makes the batch retry once.
        """
        now = now or utcnow()
        prepared = []
        for spec, key, not_after in items:
            spec = spec.model_copy(update={"team": team})
            prepared.append((spec, key, not_after, spec_hash(spec)))
        for tries in range(3):
            try:
                return self._submit_many(team, prepared, now, (max_unfinished, max_spec_bytes), quota_retry_after_s,
                                         actor)
            except IntegrityError:
                if tries == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _submit_many(self, team, prepared, now, quotas, quota_retry_after_s, actor=None):
        keys = sorted({k for _, k, _, _ in prepared if k is not None})
        out: list = [None] * len(prepared)
        with self.session() as s:
            existing: dict[str, Job] = {}
            for i in range(0, len(keys), 1000):
                for j in s.execute(select(Job).where(Job.team == team,
                                                     Job.idempotency_key.in_(keys[i:i + 1000]))).scalars():
                    existing[j.idempotency_key] = j
            new_rows, events, fresh = [], [], {}
            for idx, (spec, key, not_after, h) in enumerate(prepared):
                if key is not None and key in existing:
                    j = existing[key]
                    out[idx] = ((_job_view(j), False) if j.spec_hash == h else IdempotencyConflict(
                        f"idempotency_key={key!r}: already used by job {j.id} with a different spec"))
                    continue
                if key is not None and key in fresh:
                    first_h, view = fresh[key]
                    out[idx] = ((view, False) if first_h == h else IdempotencyConflict(
                        f"idempotency_key={key!r}: already used by job {view.id} (earlier in this batch) "
                        f"with a different spec"))
                    continue
                row, _ = _new_job_row(team, spec, key, now, not_after, None)
                job_id = row["id"]
                new_rows.append(row)
                events.append(dict(job_id=job_id, at=now, from_state=None, to_state=JobState.submitted.value,
                                   version=1, reason="submitted"))
                view = _new_job_view(row, spec)
                out[idx] = (view, True)
                if key is not None:
                    fresh[key] = (h, view)
            if new_rows:
                self._bulk_insert(s, Job.__table__, new_rows)
                self._bulk_insert(s, JobEvent.__table__, events)
                if actor is not None:
                    self._bulk_insert(s, AuditEvent.__table__, [
                        audit_row(actor, "job.submit", r["id"], {"team": team, "name": r["name"]}, now)
                        for r in new_rows])
                if any(quotas):
                    refused = queue_refusal(team, *quotas, *self._unfinished_after_insert(s, team), new_rows,
                                            quota_retry_after_s)
                    if refused is not None:
                        raise refused
        return out

    def _bulk_insert(self, s: Session, table, rows: list[dict]) -> None:
        """Insert ``rows`` (dicts with the same keys) into ``table`` inside ``s``: PostgreSQL ``COPY``
        (10x faster than a per-row executemany at 1,000 rows), else an executemany. A duplicate key
        raises :class:`IntegrityError` either way."""
        if self.engine.dialect.name != "postgresql":
            s.execute(insert(table), rows)
            return
        import psycopg
        from psycopg.types.json import Json

        cols = list(rows[0])
        json_cols = {c for c in cols if isinstance(table.c[c].type, JSON)}
        raw = s.connection().connection.driver_connection
        names = ", ".join(f'"{c}"' for c in cols)
        try:
            with raw.cursor() as cur, cur.copy(f'COPY "{table.name}" ({names}) FROM STDIN') as copy:
                for r in rows:
                    copy.write_row([Json(r[c]) if c in json_cols and r[c] is not None else r[c] for c in cols])
        except psycopg.errors.UniqueViolation as e:
            raise IntegrityError(f"COPY {table.name}", None, e) from e

    def find_idempotent(self, team: str, key: str, spec: JobSpec) -> JobView | None:
        """The job ``team`` already submitted with idempotency ``key``, if any (``spec.team`` is
        replaced by ``team`` as in :meth:`submit`). Raises :class:`IdempotencyConflict` if that
        job's spec differs from ``spec``. Lets the API answer a retried submit before re-checking it."""
        return self._by_key(team, key, spec_hash(spec.model_copy(update={"team": team})))

    def _by_key(self, team: str, key: str, h: str) -> JobView | None:
        with self.session() as s:
            j = s.execute(select(Job).where(Job.team == team, Job.idempotency_key == key)).scalar_one_or_none()
            if j is None:
                return None
            if j.spec_hash != h:
                raise IdempotencyConflict(f"idempotency_key={key!r}: already used by job {j.id} with a different spec")
            return _job_view(j)

    def get(self, job_id: str, team: str | None = None) -> JobView:
        """The job ``job_id``; with ``team``, only if it belongs to that team. Raises :class:`JobNotFound`."""
        with self.session() as s:
            j = s.get(Job, job_id)
            if j is None or (team is not None and j.team != team):
                raise JobNotFound(f"job_id={short_repr(job_id)}: no such job" + (f" for team {team!r}" if team else ""))
            return _job_view(j)

    def list_jobs(self, team: str | None = None, states: Sequence[str] | None = None, limit: int = 100,
                  offset: int = 0, name: str | None = None) -> list[JobView]:
        """Jobs newest first, filtered by ``team``, ``states`` and exact ``name``; at most ``limit`` (1-1000)."""
        return self.list_jobs_page(team, states, limit, offset, name=name)[0]

    def list_jobs_page(self, team: str | None = None, states: Sequence[str] | None = None, limit: int = 100,
                       offset: int = 0, max_spec_bytes: int | None = None,
                       name: str | None = None) -> tuple[list[JobView], bool]:
        """``(jobs, cut)``: :meth:`list_jobs`, and with ``max_spec_bytes`` the page also ends before the job whose
        stored spec would bring the page's spec bytes (:func:`broker.service.store.quota.spec_bytes`, as stored)
        past it, keeping at least one job; ``cut`` says it ended there (the next page starts at ``offset +
        len(jobs)``). Only ids and sizes are read first, so a cut page never loads the specs it leaves out."""
        def page(*cols):
            q = select(*cols).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit).offset(offset)
            if team is not None:
                q = q.where(Job.team == team)
            if states:
                q = q.where(Job.state.in_([JobState(x).value for x in states]))
            if name is not None:
                q = q.where(Job.name == name)
            return q

        cut = False
        with self.session() as s:
            if max_spec_bytes is None:
                return [_job_view(j) for j in s.execute(page(Job)).scalars()], False
            ids, used = [], 0
            for job_id, n in s.execute(page(Job.id, spec_bytes_expr(s))):
                used += int(n or 0)
                if ids and used > max_spec_bytes:
                    cut = True
                    break
                ids.append(job_id)
            if not ids:
                return [], False
            rows = {j.id: j for j in s.execute(select(Job).where(Job.id.in_(ids))).scalars()}
            return [_job_view(rows[i]) for i in ids if i in rows], cut

    def events(self, job_id: str) -> list[JobEventView]:
        """The state history of a job, oldest first."""
        with self.session() as s:
            rows = s.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars()
            return [JobEventView(at=e.at, from_state=e.from_state, to_state=e.to_state, version=e.version,
                                 reason=e.reason) for e in rows]

    def attempts(self, job_id: str) -> list[AttemptView]:
        """The attempts of a job, first first."""
        with self.session() as s:
            rows = s.execute(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number)).scalars()
            return [AttemptView(number=a.number, kind=a.kind, pool=a.pool, offer_id=a.offer_id, nodes=a.nodes,
                                gpu_type=a.gpu_type, gpus=a.gpus, created_at=a.created_at, started_at=a.started_at,
                                ended_at=a.ended_at, exit_code=a.exit_code, outcome=a.outcome, reason=a.reason,
                                failover=a.failover or [], external_id=a.external_id)
                    for a in rows]

    def decision(self, job_id: str) -> dict | None:
        """The planner's latest decision record for the job (``None`` before the first cycle)."""
        with self.session() as s:
            return s.execute(select(Job.decision).where(Job.id == job_id)).scalar_one_or_none()

    # ------------------------------------------------------------------ transitions
    @staticmethod
    def cas(s: Session, job_id: str, version: int, from_state: str, to_state: str, reason: str,
            now: datetime | None = None, **fields) -> bool:
        """Compare-and-set one job inside session ``s``: move ``from_state -> to_state`` only if
        the row still has ``version``; also set ``fields``. Records the event. Returns whether it
        applied. Raises :class:`broker.states.InvalidTransition` for a move not in the table."""
        check_transition(job_id, from_state, to_state)
        now = now or utcnow()
        res = s.execute(update(Job).where(Job.id == job_id, Job.version == version, Job.state == from_state)
                        .values(state=to_state, version=version + 1, updated_at=now, reason=reason, **fields))
        if res.rowcount != 1:
            return False
        s.add(JobEvent(job_id=job_id, at=now, from_state=from_state, to_state=to_state, version=version + 1,
                       reason=reason))
        return True

    @staticmethod
    def job_row(s: Session, job_id: str) -> Job | None:
        """Inside session ``s``: the row of job ``job_id`` (``None`` if there is none), for a caller that
        compare-and-sets it in the same transaction (:meth:`cas`, :meth:`bump`)."""
        return s.get(Job, job_id)

    @staticmethod
    def attempt_row(s: Session, job_id: str, number: int, lock: bool = False) -> Attempt | None:
        """Inside session ``s``: attempt ``number`` of ``job_id`` (``None`` if there is none); ``lock`` takes a row
        lock (``SELECT ... FOR UPDATE``) so two reporters of one attempt update it one after the other."""
        q = select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number)
        return s.execute(q.with_for_update() if lock else q).scalar_one_or_none()

    @staticmethod
    def bump(s: Session, job_id: str, version: int, now: datetime | None = None, **fields) -> bool:
        """Compare-and-set fields of a job without a state change (e.g. a wait decision). Returns whether it applied."""
        res = s.execute(update(Job).where(Job.id == job_id, Job.version == version)
                        .values(version=version + 1, updated_at=now or utcnow(), **fields))
        return res.rowcount == 1

    def transition(self, job_id: str, to_state: str, reason: str, *, expect_version: int | None = None,
                   expect_state: str | None = None, **fields) -> bool:
        """Read the job and compare-and-set it to ``to_state`` in one transaction.

        ``expect_version``/``expect_state`` make it conditional on what the caller saw.
        Returns whether it applied. Raises :class:`JobNotFound`, :class:`InvalidTransition`.
        """
        with self.session() as s:
            j = s.get(Job, job_id)
            if j is None:
                raise JobNotFound(f"job_id={short_repr(job_id)}: no such job")
            if expect_version is not None and j.version != expect_version:
                return False
            if expect_state is not None and j.state != expect_state:
                return False
            return self.cas(s, job_id, j.version, j.state, to_state, reason, **fields)

    def request_cancel(self, job_id: str, team: str | None = None, reason: str = "cancelled by user",
                       actor: Principal | None = None) -> JobView:
        """Cancel a job: a waiting job becomes ``cancelled`` at once; a job on a node is marked
        ``cancel_requested`` and its agent stops it (SIGTERM, grace period, SIGKILL).
        Cancelling a cancelled job again is a no-op. With ``actor``, the change (not a no-op) is audited
        ``job.cancel`` in its transaction. Raises :class:`JobNotFound`, :class:`NotCancellable`.
        """
        for _ in range(20):  # retry lost compare-and-set races
            j = self.get(job_id, team)
            if j.state == JobState.cancelled.value:
                return j
            if j.state in (JobState.succeeded.value, JobState.failed.value):
                raise NotCancellable(f"job_id={job_id!r}: already {j.state}")
            with self.session() as s:
                if j.state in (JobState.running.value, JobState.starting.value):
                    if j.cancel_requested:
                        return j
                    if self.bump(s, job_id, j.version, cancel_requested=True, reason=f"cancel requested: {reason}"):
                        s.add(JobEvent(job_id=job_id, at=utcnow(), from_state=j.state, to_state=j.state,
                                       version=j.version + 1, reason=f"cancel requested: {reason}"))
                        if actor is not None:
                            audit(s, actor, "job.cancel", job_id, {"team": j.team, "from_state": j.state,
                                                                   "to_state": j.state, "cancel_requested": True})
                        break
                else:
                    if self.cas(s, job_id, j.version, j.state, JobState.cancelled.value, reason,
                                finished_at=utcnow(), cancel_requested=True):
                        if actor is not None:
                            audit(s, actor, "job.cancel", job_id, {"team": j.team, "from_state": j.state,
                                                                   "to_state": JobState.cancelled.value})
                        break
        return self.get(job_id, team)

    def cancel_many(self, team: str, *, states: Sequence[str] | None = None, name: str | None = None,
                    limit: int = MAX_CANCEL_JOBS, reason: str = "cancelled by user (bulk)",
                    actor: Principal | None = None, batch: int = CANCEL_BATCH_JOBS) -> tuple[list[str], list[str], bool]:
        """Cancel every unfinished job of ``team`` (only that team's: the filter is in every statement) that is in
        one of ``states`` (``None``: any unfinished state) and, if given, named ``name``, as :meth:`request_cancel`
        does one: a waiting job becomes ``cancelled``, a starting or running one gets ``cancel_requested`` (one
        already asked is left alone). Jobs are changed in id order in transactions of ``batch`` jobs, their rows
        locked (``FOR UPDATE``) and each row's ``version`` bumped, so a planner or agent compare-and-set that
        raced it fails and re-reads; each change gets its ``job_events`` row and, with ``actor``, a ``job.cancel``
        audit row (``"bulk": true``) in the same transaction. At most ``limit`` jobs change.

        Returns ``(cancelled_ids, cancel_requested_ids, more)``: ``more`` when further jobs matched past ``limit``.
        States are :class:`broker.states.JobState` values; a terminal one matches nothing."""
        on_node = set(ON_NODE_STATES)
        wanted = [x for x in _UNFINISHED if states is None or x in states]
        cancelled: list[str] = []
        requested: list[str] = []

        def matching(after: str, n: int):
            q = (select(Job.id, Job.state).where(Job.team == team, Job.state.in_(wanted), Job.id > after)
                 .where(~(Job.state.in_(sorted(on_node)) & Job.cancel_requested.is_(True)))
                 .order_by(Job.id).limit(n))
            return q.where(Job.name == name) if name is not None else q

        after = ""
        while wanted and len(cancelled) + len(requested) < limit:
            with self.session() as s:
                rows = s.execute(matching(after, min(batch, limit - len(cancelled) - len(requested)))
                                 .with_for_update()).all()
                if not rows:
                    return sorted(cancelled), sorted(requested), False
                after = rows[-1].id
                by_state: dict[str, list[str]] = {}
                for r in rows:
                    by_state.setdefault(r.state, []).append(r.id)
                now = utcnow()
                events: list[dict[str, Any]] = []
                audits: list[dict[str, Any]] = []
                for st, ids in by_state.items():
                    if st in on_node:
                        to, why, vals = st, f"cancel requested: {reason}", {"cancel_requested": True}
                    else:
                        check_transition(ids[0], st, JobState.cancelled.value)
                        to, why = JobState.cancelled.value, reason
                        vals = {"state": to, "finished_at": now, "cancel_requested": True}
                    res = s.execute(update(Job).where(Job.team == team, Job.id.in_(ids), Job.state == st)
                                    .values(version=Job.version + 1, updated_at=now, reason=why, **vals)
                                    .returning(Job.id, Job.version), execution_options={"synchronize_session": False})
                    for job_id, version in res:
                        events.append({"job_id": job_id, "at": now, "from_state": st, "to_state": to,
                                       "version": version, "reason": why})
                        detail = {"team": team, "from_state": st, "to_state": to, "bulk": True}
                        if to == st:
                            detail["cancel_requested"] = True
                        audits.append(audit_row(actor, "job.cancel", job_id, detail, now))
                        (requested if to == st else cancelled).append(job_id)
                if events:
                    s.execute(insert(JobEvent), events)
                if actor is not None and audits:
                    s.execute(insert(AuditEvent), audits)
        if not wanted:
            return [], [], False
        with self.session() as s:
            more = s.execute(matching(after, 1)).first() is not None
        return sorted(cancelled), sorted(requested), more

    # ------------------------------------------------------------------ logs
    def append_log(self, job_id: str, attempt: int, rank: int, seq: int, data: str,
                   max_bytes: int | None = None) -> bool:
        """Store one log chunk; a chunk already stored (same job, attempt, rank, seq) is ignored. Returns whether stored.
        Each NUL of ``data`` is stored as U+FFFD (:func:`storable_text`): a job's output is whatever it printed.

        With ``max_bytes`` (``settings.log_max_bytes``) the attempt rank's log is kept within it in the same
        transaction: over it, its head (``max_bytes - max_bytes // 2 - 64`` bytes) and tail (``max_bytes // 2``)
        stay, in whole chunks, and one ``[fedbroker: ... N bytes dropped ...]`` chunk stands for the rest
        (:func:`broker.service.store.logs.trim_log`), whatever a node ships."""
        from broker.log_marker import MARKER_MAX_BYTES
        from broker.service.store import logs

        text_ = storable_text(data)
        try:
            with self.session() as s:
                s.add(JobLog(job_id=job_id, attempt=attempt, rank=rank, seq=seq, data=text_,
                             bytes=len(text_.encode("utf-8", "surrogatepass"))))
                s.flush()
                if max_bytes and logs.log_bytes(s, job_id, attempt, rank) > max_bytes:
                    logs.trim_log(s, job_id, attempt, rank, max(max_bytes - max_bytes // 2 - MARKER_MAX_BYTES, 0),
                                  max_bytes // 2)
            return True
        except IntegrityError:
            return False

    def log_chunks(self, job_id: str, attempt: int, rank: int = 0) -> list[tuple[int, str]]:
        """``[(seq, text)]`` of an attempt's log, in order."""
        with self.session() as s:
            rows = s.execute(select(JobLog.seq, JobLog.data).where(
                JobLog.job_id == job_id, JobLog.attempt == attempt, JobLog.rank == rank).order_by(JobLog.seq))
            return [(r.seq, r.data) for r in rows]

    # ------------------------------------------------------------------ nodes
    def heartbeat(self, name: str, pool: str, gpu_type: str, gpu_count: int, gpu_memory_gb: float,
                  healthy_gpus: Sequence[int], agent_id: str, telemetry: dict | None = None,
                  now: datetime | None = None) -> None:
        """Register or refresh a node (its agent calls this every ``heartbeat_interval_s``)."""
        now = now or utcnow()
        vals = dict(pool=pool, gpu_type=gpu_type, gpu_count=gpu_count, gpu_memory_gb=gpu_memory_gb,
                    healthy_gpus=sorted(int(g) for g in healthy_gpus), state="up", agent_id=agent_id,
                    last_heartbeat_at=now, telemetry=telemetry)
        with self.session() as s:
            n = s.get(Node, name)
            if n is None:
                s.add(Node(name=name, registered_at=now, **vals))
            else:
                for k, v in vals.items():
                    setattr(n, k, v)

    def node_shapes(self) -> list[tuple[str, str, str, int, float]]:
        """``(name, pool, gpu_type, gpu_count, gpu_memory_gb)`` of every node the store knows, by name (what the
        submit-time capacity check reads: :mod:`broker.service.feasibility`; no telemetry)."""
        with self.session() as s:
            return [tuple(r) for r in s.execute(select(Node.name, Node.pool, Node.gpu_type, Node.gpu_count,
                                                       Node.gpu_memory_gb).order_by(Node.name))]

    def node_shapes_key(self) -> tuple:
        """A cheap key that changes when a node registers or is removed: ``(count, latest registered_at)``
        (what :class:`broker.service.feasibility.CapacityCache` checks before reading :meth:`node_shapes`)."""
        with self.session() as s:
            return tuple(s.execute(select(func.count(), func.max(Node.registered_at)).select_from(Node)).one())

    def nodes(self) -> list[NodeView]:
        """Every node the store knows, by name."""
        with self.session() as s:
            return [NodeView(name=n.name, pool=n.pool, gpu_type=n.gpu_type, gpu_count=n.gpu_count,
                             gpu_memory_gb=n.gpu_memory_gb, healthy_gpus=list(n.healthy_gpus), state=n.state,
                             last_heartbeat_at=n.last_heartbeat_at, telemetry=n.telemetry)
                    for n in s.execute(select(Node).order_by(Node.name)).scalars()]

    # ------------------------------------------------------------------ planner fence
    def planner_version(self) -> int:
        """The planner fence's current version (0 before the first cycle)."""
        with self.session() as s:
            v = s.execute(select(PlannerState.version).where(PlannerState.id == 1)).scalar_one_or_none()
            if v is None:
                try:
                    s.add(PlannerState(id=1, version=0, leader=""))
                    s.flush()
                except IntegrityError:
                    pass
                return 0
            return int(v)

    def instance_secret(self) -> bytes:
        """The key of cloud instances' report tokens (32 random bytes), made once and kept in ``planner_state``.

        Two processes asking at once get the same key: the row is only filled where it is still empty."""
        import secrets

        self.planner_version()  # makes the row
        with self.session() as s:
            s.execute(update(PlannerState).where(PlannerState.id == 1, PlannerState.instance_secret.is_(None))
                      .values(instance_secret=secrets.token_hex(32)))
        with self.session() as s:
            return bytes.fromhex(s.execute(select(PlannerState.instance_secret).where(PlannerState.id == 1)).scalar_one())

    @staticmethod
    def advance_fence(s: Session, seen_version: int, leader: str, now: datetime) -> bool:
        """Inside the apply transaction: bump the planner fence from ``seen_version``.
        False if another cycle applied in between (this cycle's plan is stale and must be dropped)."""
        res = s.execute(update(PlannerState).where(PlannerState.id == 1, PlannerState.version == seen_version)
                        .values(version=seen_version + 1, leader=leader, cycle_at=now))
        return res.rowcount == 1

    # ------------------------------------------------------------------ schedules
    def create_schedule(self, team: str, name: str, cron: str, timezone: str, spec: JobSpec,
                        now: datetime | None = None, actor: Principal | None = None,
                        max_schedules: int | None = None) -> ScheduleView:
        """Store a recurring run: every fire of ``cron`` (read in ``timezone``'s local wall-clock
        time, DST rules of :mod:`broker.recurring`) submits ``spec`` as a job of ``team`` (the
        reconciler does it, with the idempotency key ``schedule:<id>:<fire instant>``).

        Args:
            team: the owning team (``spec.team`` is overwritten by it, as in :meth:`submit`).
            name: unique per team; 1-200 letters, digits, ``.``, ``_`` or ``-``.
            cron: 5-field cron expression; stored normalised (``"@daily"`` -> ``"0 0 * * *"``).
            timezone: IANA zone name (``"Europe/London"``, ``"UTC"``).
            spec: the job of every run; no absolute instants (``deadline``, ``earliest_start``/
                ``not_before``, ``not_after`` must be ``None``): each run's deadline is its fire
                instant + ``estimated_duration_s`` + ``slack_s`` (12 h or the duration if no slack).
            now: aware creation instant (default: the current time); the first fire is the first
                one strictly after it.
            actor: the API's caller; a ``schedule.create`` audit event is written in the same transaction.
            max_schedules: the team's ``quotas.max_schedules`` (``None`` = no cap): its schedules are counted
                in the same transaction (on PostgreSQL under a per-team advisory lock, so concurrent creates
                cannot pass it together).

        Returns:
            ScheduleView: enabled, ``next_fire_at = next_fire(cron, timezone, now)`` (UTC), never fired.

        Raises:
            InvalidSchedule: bad name, cron or time zone, or an absolute instant in ``spec``
                (:func:`check_schedule`).
            ScheduleConflict: ``team`` already has a schedule called ``name``.
            broker.service.store.quota.ScheduleCapExceeded: ``team`` already holds ``max_schedules``.
            ValueError: ``now`` is naive.
        """
        from broker.recurring import next_fire

        tz = timezone
        now = now or utcnow()
        if now.tzinfo is None or now.utcoffset() is None:
            raise ValueError(f"now={now.isoformat()!r}: naive datetime; give an aware one (e.g. UTC)")
        cron = check_schedule(name, cron, tz, spec)
        row = Schedule(id=new_schedule_id(), team=team, name=name, cron=cron, timezone=tz,
                       spec=spec.model_copy(update={"team": team}).model_dump(mode="json"), enabled=True,
                       next_fire_at=next_fire(cron, tz, now), last_fire_at=None, created_at=now)
        try:
            with self.session() as s:
                if max_schedules:
                    if self.engine.dialect.name == "postgresql":  # one create at a time per team counts
                        s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": f"schedules:{team}"})
                    held = s.execute(select(func.count()).select_from(Schedule).where(Schedule.team == team)).scalar_one()
                    if held >= max_schedules:
                        raise ScheduleCapExceeded(team, max_schedules, held)
                s.add(row)
                s.flush()
                if actor is not None:
                    audit(s, actor, "schedule.create", row.id, {"team": team, "name": name, "cron": cron,
                                                                 "timezone": tz}, now)
        except IntegrityError:
            with self.session() as s:
                other = s.execute(select(Schedule.id).where(Schedule.team == team, Schedule.name == name)).scalar()
            if other is None:  # not the (team, name) constraint
                raise
            raise ScheduleConflict(f"name={name!r}: team {team!r} already has a schedule with this name "
                                   f"({other}); delete it first or pick another name") from None
        return self.get_schedule(row.id)

    def get_schedule(self, schedule_id: str, team: str | None = None) -> ScheduleView:
        """The schedule ``schedule_id``; with ``team``, only if it belongs to that team.
        Raises :class:`ScheduleNotFound`."""
        with self.session() as s:
            r = s.get(Schedule, schedule_id)
            if r is None or (team is not None and r.team != team):
                raise ScheduleNotFound(f"schedule_id={schedule_id!r}: no such schedule"
                                       + (f" for team {team!r}" if team else ""))
            return _schedule_view(r)

    def set_schedule_enabled(self, schedule_id: str, enabled: bool, team: str | None = None,
                             now: datetime | None = None, actor: Principal | None = None) -> ScheduleView:
        """Pause (``enabled=False``) or resume (``True``) a schedule; with ``team``, only that team's.

        A paused schedule creates no jobs. Resuming a paused schedule sets ``next_fire_at`` to
        the first fire strictly after ``now`` (default: the current time): fires missed while
        paused are skipped, not caught up. Pausing a paused or resuming an enabled schedule
        changes nothing. With ``actor``, a change is audited (``schedule.pause`` / ``schedule.resume``) in
        its transaction. Returns the schedule. Raises :class:`ScheduleNotFound`.
        """
        from broker.recurring import next_fire

        now = now or utcnow()
        with self.session() as s:
            q = select(Schedule).where(Schedule.id == schedule_id).with_for_update()
            if team is not None:
                q = q.where(Schedule.team == team)
            r = s.execute(q).scalar_one_or_none()
            if r is None:
                raise ScheduleNotFound(f"schedule_id={schedule_id!r}: no such schedule"
                                       + (f" for team {team!r}" if team else ""))
            if enabled and not r.enabled:
                r.next_fire_at = next_fire(r.cron, r.timezone, now)
                r.last_error = None
            if actor is not None and bool(enabled) != r.enabled:
                audit(s, actor, "schedule.resume" if enabled else "schedule.pause", r.id, {"team": r.team}, now)
            r.enabled = bool(enabled)
            s.flush()
            return _schedule_view(r)

    def schedules(self, team: str | None = None) -> list[ScheduleView]:
        """Schedules ordered by team then name; only ``team``'s when given."""
        with self.session() as s:
            q = select(Schedule).order_by(Schedule.team, Schedule.name)
            if team is not None:
                q = q.where(Schedule.team == team)
            return [_schedule_view(r) for r in s.execute(q).scalars()]

    def delete_schedule(self, schedule_id: str, team: str | None = None, actor: Principal | None = None) -> bool:
        """Delete a schedule (with ``team``, only that team's). Jobs it already created stay, with
        their ``schedule_id``. With ``actor``, a deletion is audited ``schedule.delete`` in its
        transaction. Returns whether a schedule was deleted."""
        with self.session() as s:
            q = delete(Schedule).where(Schedule.id == schedule_id)
            if team is not None:
                q = q.where(Schedule.team == team)
            owner = (s.execute(select(Schedule.team).where(Schedule.id == schedule_id)).scalar_one_or_none()
                     if actor is not None else None)
            deleted = s.execute(q).rowcount == 1
            if deleted and actor is not None:
                audit(s, actor, "schedule.delete", schedule_id, {"team": owner})
            return deleted


def storable_text(text: str) -> str:
    """``text`` as a PostgreSQL ``text`` column holds it: each NUL (U+0000), which PostgreSQL refuses ("text fields
    cannot contain NUL"), becomes U+FFFD. For text the broker does not control (a job's log, a node's reason);
    the same on SQLite, so both stores give back the same text."""
    return text.replace("\x00", "\ufffd")


class SubmitWriter:
    """Stores groups of single submits for one thread (the API's group-commit writer,
    :mod:`broker.service.group_commit`) on a database connection it keeps between groups.

    Not thread-safe: one writer per thread. :meth:`close` gives the connection back to the pool.
    """

    def __init__(self, store: JobStore):
        self.store = store
        self._conn = None  # the held SQLAlchemy Connection (PostgreSQL), checked out with a pre-ping

    def submit_group(self, items: Sequence[SubmitItem]) -> list[tuple[JobView, bool] | Exception]:
        """Many independent single submits, one result per item, in order: :meth:`try_group`, or where that
        stored nothing :meth:`JobStore.submit` per item, each error kept as that item's result (one team's
        item never fails another's). Raises only what :meth:`try_group` raises."""
        done = self.try_group(items)
        return done if done is not None else self.store._submit_each(items)

    def try_group(self, items: Sequence[SubmitItem]) -> list[tuple[JobView, bool]] | None:
        """Store many independent single submits (concurrent ``POST /v1/jobs``) in one transaction where that
        changes no answer: ``[(job, True)]`` per item, in order; ``None`` when nothing was stored and each
        item must be submitted alone (:meth:`JobStore.submit`) to get its own answer: SQLite, or the group
        could not be stored as a whole (a used idempotency key, a team over its queued-jobs or spec-bytes quota, a
        deadlock, a row lock not free within :data:`GROUP_LOCK_TIMEOUT_MS`, a value the database refuses).

        PostgreSQL: :meth:`_write`, two round trips and one commit for the group, where
        :meth:`JobStore.submit` takes four per job. Raises a driver error (``psycopg.OperationalError``) only
        when the connection broke twice before the commit, or while the commit was on its way (whether it
        was stored is then unknown, as for a single submit).
        """
        if not items or self.store.engine.dialect.name != "postgresql":
            return [] if not items else None
        prepared = []
        for it in items:
            now = it.now or utcnow()
            row, spec = _new_job_row(it.team, it.spec, it.idempotency_key, now, it.not_after, None)
            event = None if it.actor is None else audit_row(
                it.actor, "job.submit", row["id"], {"team": it.team, "name": spec.name}, now)
            prepared.append((row, spec, event, (it.max_unfinished, it.max_spec_bytes)))
        if self._write([(row, event, quota) for row, _, event, quota in prepared]):
            return [(_new_job_view(row, spec), True) for row, spec, _, _ in prepared]
        return None

    def _write(self, rows: list[tuple[dict, dict | None, tuple[int | None, int | None]]]) -> bool:
        """Store ``(job row, audit event or None, the team's (max_unfinished, max_spec_bytes), None = unlimited)``
        rows in one transaction, each as :meth:`JobStore._submit_pg` would: the inserts and the quota check pipelined in
        one round trip, the commit in a second. Returns ``False``, with nothing stored,
        when one of them might not be stored on its own: a unique key taken (an idempotency key or,
        rarely, a job id), a team over its quota after all of its rows, a deadlock, a row lock not free
        within :data:`GROUP_LOCK_TIMEOUT_MS`, any other refusal of the database (a value it cannot hold)
        or of the driver. The rows are
        written in team order so that two groups lock the ``team_usage`` counters in the same order.

        A held connection that turns out broken before the commit is sent (the database restarted
        while it was idle) is replaced and the group written once more: nothing of it was stored."""
        import psycopg
        from psycopg.types.json import Json

        limits: dict[str, tuple[int | None, int | None]] = {}
        for row, _, quota in rows:
            if any(quota):  # the tightest of the team's items, per quota
                had = limits.get(row["team"], (None, None))
                limits[row["team"]] = (_tighter(had[0], quota[0]), _tighter(had[1], quota[1]))
        shapes: dict[tuple[tuple[str, ...], bool], list[dict]] = {}
        for row, event, _ in sorted(rows, key=lambda r: r[0]["team"]):
            params = {**row, "spec": Json(row["spec"])}
            if event is not None:
                params.update({f"a_{c}": event[c] for c in _AUDIT_COLS})
                params["a_detail"] = Json(event["detail"])
            shapes.setdefault((tuple(row), event is not None), []).append(params)
        for tries in (1, 2):
            if self._conn is None:
                self._conn = self.store.engine.connect()  # the pool's pre-ping checks it
            raw = self._conn.connection.driver_connection
            try:
                with raw.cursor() as cur:
                    failed = None
                    with raw.pipeline():
                        try:
                            # a row lock another transaction holds (a team's bulk submit) is not waited for
                            # here: the group is given up and its items submitted alone, side by side
                            cur.execute(f"SET LOCAL lock_timeout = '{GROUP_LOCK_TIMEOUT_MS}ms'")
                            for (cols, audited), params_list in shapes.items():
                                cur.executemany(_submit_sql(cols, audited), params_list)
                            if limits:
                                cur.execute("SELECT team, unfinished, spec_bytes FROM team_usage "
                                            "WHERE team = ANY(%s)", (list(limits),))
                        except psycopg.Error as e:
                            # leave the pipeline without an error in flight: its exit then raises the
                            # abort itself instead of logging "error ignored terminating Pipeline"
                            failed = e
                    if failed is not None:
                        raise failed
                    if limits:
                        held = {t: (int(n), int(b)) for t, n, b in cur.fetchall()}
                        if any(_over(m, held.get(t, (0, 0))) for t, m in limits.items()):
                            raw.rollback()
                            return False
            except Exception:
                if not (raw.broken or raw.closed):
                    # a key taken, a deadlock, a lock not free, a value the database refuses: nothing is
                    # stored, and each item gets its own answer alone (one team's item never fails another's)
                    try:
                        raw.rollback()
                    except Exception:  # noqa: BLE001 - the connection is unusable after all
                        self._drop()
                    return False
                self._drop()
                if tries == 2:
                    raise
                continue  # broken before any commit was sent: nothing stored; once more on a new connection
            except BaseException:
                self._drop()
                raise
            try:
                raw.commit()  # returned: stored, whatever happens to the connection afterwards
            except BaseException:
                self._drop()  # the commit may have landed: unknown, as for a single submit
                raise
            return True
        raise AssertionError("unreachable")  # pragma: no cover

    def _drop(self) -> None:
        """Forget the held connection (invalidated: the pool does not hand it out again)."""
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:  # already unusable
                pass
            self._conn = None

    def close(self) -> None:
        """Give the held connection back to the pool."""
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None
