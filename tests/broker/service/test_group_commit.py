"""Group commit of single submits: :class:`broker.service.store.core.SubmitWriter` (real PostgreSQL and SQLite)
and :class:`broker.service.group_commit.GroupCommit` (grouping, answers, errors)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from sqlalchemy import text

from broker.model import JobSpec
from broker.service.group_commit import GroupCommit
from broker.service.store.core import IdempotencyConflict, SubmitItem
from broker.service.store.quota import QuotaExceeded
from broker.service.store.tokens import Principal
from tests.conftest import PG_URL

SPEC = JobSpec.model_validate({"command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60})
OTHER = SPEC.model_copy(update={"gpus_per_node": 2})
ACTOR = Principal("vision", kind="member", token_id="tok-1")
PG_DSN = PG_URL.replace("postgresql+psycopg://", "postgresql://")


def _rows(store, sql: str, **params) -> list:
    with store.engine.connect() as c:
        return list(c.execute(text(sql), params))


# ----------------------------------------------------------------------------- the store's writer
def test_a_group_is_one_transaction_with_each_job_its_event_and_its_audit_row(pg_store):
    w = pg_store.submit_writer()
    try:
        out = w.submit_group([SubmitItem("vision", SPEC, actor=ACTOR), SubmitItem("nlp", OTHER, idempotency_key="n1"),
                              SubmitItem("vision", SPEC, actor=ACTOR, max_unfinished=10)])
    finally:
        w.close()
    assert [created for _, created in out] == [True, True, True]
    ids = [job.id for job, _ in out]
    assert [(j.team, j.spec.gpus_per_node, j.state, j.idempotency_key) for j, _ in out] == [
        ("vision", 1, "submitted", None), ("nlp", 2, "submitted", "n1"), ("vision", 1, "submitted", None)]
    # one transaction: every row carries the same transaction id
    assert len(_rows(pg_store, "SELECT DISTINCT xmin::text FROM jobs WHERE id = ANY(:ids)", ids=ids)) == 1
    assert sorted(r[0] for r in _rows(pg_store, "SELECT job_id FROM job_events WHERE to_state = 'submitted'")) == sorted(ids)
    assert sorted(r[0] for r in _rows(pg_store, "SELECT target FROM audit_events WHERE action = 'job.submit'")) == sorted(
        [ids[0], ids[2]])
    assert pg_store.get(ids[1]).deadline == out[1][0].deadline


def test_a_used_idempotency_key_makes_every_item_answer_as_if_alone(pg_store):
    first, _ = pg_store.submit("vision", SPEC, idempotency_key="k")
    out = pg_store.submit_group([SubmitItem("vision", SPEC), SubmitItem("vision", SPEC, idempotency_key="k"),
                                 SubmitItem("vision", OTHER, idempotency_key="k"),
                                 SubmitItem("vision", SPEC, idempotency_key="m")])
    assert out[0][1] is True and out[3][1] is True
    assert out[1] == (pg_store.get(first.id), False)
    assert isinstance(out[2], IdempotencyConflict) and first.id in str(out[2])
    assert _rows(pg_store, "SELECT count(*) FROM jobs")[0][0] == 3


def test_a_group_given_up_leaves_no_driver_warning_in_the_log(pg_store, caplog):
    """A used key in a group with a quota check (the error surfaces inside the pipeline): nothing is stored and
    psycopg logs nothing (it logged "error ignored terminating Pipeline ... pipeline aborted" per group)."""
    first, _ = pg_store.submit("vision", SPEC, idempotency_key="k")
    w = pg_store.submit_writer()
    try:
        with caplog.at_level(logging.DEBUG):
            assert w.try_group([SubmitItem("vision", SPEC, idempotency_key="k", max_unfinished=50),
                                SubmitItem("vision", SPEC, max_unfinished=50),
                                SubmitItem("nlp", SPEC, max_unfinished=50)]) is None
    finally:
        w.close()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []
    assert _rows(pg_store, "SELECT id FROM jobs") == [(first.id,)]


def test_a_group_over_a_quota_stores_the_jobs_that_fit_in_order(pg_store):
    pg_store.submit("vision", SPEC)
    out = pg_store.submit_group([SubmitItem("vision", SPEC, max_unfinished=3, quota_retry_after_s=7)] * 4
                                + [SubmitItem("nlp", SPEC, max_unfinished=3)])
    assert [r[1] if isinstance(r, tuple) else type(r).__name__ for r in out] == [
        True, True, "QuotaExceeded", "QuotaExceeded", True]
    assert out[2].retry_after_s == 7
    assert dict(_rows(pg_store, "SELECT team, count(*) FROM jobs GROUP BY team")) == {"vision": 3, "nlp": 1}


def test_an_item_the_database_refuses_fails_alone_and_the_group_is_stored(pg_store):
    """A spec value PostgreSQL cannot hold (a NUL in text; the API's model refuses it, the store must not rely
    on that): the others of its group are stored, and it gets the error a submit of its own gets."""
    bad = JobSpec.model_construct(**{**SPEC.model_dump(), "name": "bad\x00name"})
    out = pg_store.submit_group([SubmitItem("vision", SPEC), SubmitItem("mallory", bad), SubmitItem("nlp", OTHER)])
    assert out[0][1] is True and out[2][1] is True
    assert isinstance(out[1], Exception) and "NUL" in str(out[1])
    assert dict(_rows(pg_store, "SELECT team, count(*) FROM jobs GROUP BY team")) == {"vision": 1, "nlp": 1}


def test_a_held_connection_killed_while_idle_is_replaced_and_the_group_stored_once(pg_store):
    w = pg_store.submit_writer()
    try:
        w.submit_group([SubmitItem("vision", SPEC)])
        pid = w._conn.connection.driver_connection.info.backend_pid
        assert _rows(pg_store, "SELECT pg_terminate_backend(:p)", p=pid)[0][0] is True
        out = w.submit_group([SubmitItem("vision", SPEC), SubmitItem("vision", OTHER)])
    finally:
        w.close()
    assert [created for _, created in out] == [True, True]
    assert _rows(pg_store, "SELECT count(*) FROM jobs")[0][0] == 3


def test_sqlite_submits_each_item_on_its_own(sqlite_store):
    sqlite_store.submit("vision", SPEC, idempotency_key="k")
    out = sqlite_store.submit_group([SubmitItem("vision", SPEC), SubmitItem("vision", OTHER, idempotency_key="k")])
    assert out[0][1] is True and isinstance(out[1], IdempotencyConflict)
    assert sqlite_store.submit_group([]) == []


# ----------------------------------------------------------------------------- GroupCommit
class _Writer:
    """A writer that records each group and can hold the first one until released."""

    def __init__(self, answer, hold: threading.Event | None = None):
        self.groups: list[list[str]] = []
        self.answer = answer
        self.hold = hold
        self.entered = threading.Event()
        self.closed = 0

    def try_group(self, items):
        self.groups.append([it.idempotency_key for it in items])
        self.entered.set()
        if self.hold is not None and len(self.groups) == 1:
            self.hold.wait(10)
        return self.answer(items)

    def close(self):
        self.closed += 1


class _Store:
    """The writer above; a submit alone answers from ``alone`` (``key -> (view, created)`` or an exception)."""

    def __init__(self, writer, alone=None):
        self.writer = writer
        self.alone = alone or {}
        self.alone_calls: list[str] = []

    def submit_writer(self):
        return self.writer

    def submit_item(self, it):
        self.alone_calls.append(it.idempotency_key)
        r = self.alone[it.idempotency_key]
        if isinstance(r, Exception):
            raise r
        return r


class _View:
    def __init__(self, id):
        self.id = id


def _answers(items):
    """A group with a key starting "bad" or "old" is not stored as a whole: each of its items goes alone."""
    if any(it.idempotency_key.startswith(("bad", "old")) for it in items):
        return None
    return [(_View("job-" + it.idempotency_key), True) for it in items]


ALONE = {"b": (_View("job-b"), True), "old-c": (_View("job-old-c"), False), "e": (_View("job-e"), True),
         "bad-d": QuotaExceeded("over: bad-d", "quotas.max_queued_jobs", 5)}


def test_submits_waiting_while_a_group_is_stored_form_the_next_group_and_each_gets_its_answer():
    release = threading.Event()
    writer = _Writer(_answers, hold=release)
    created: list[str] = []
    store = _Store(writer, ALONE)
    gc = GroupCommit(store, on_created=created.append)

    async def run():
        first = asyncio.ensure_future(gc.submit(SubmitItem("t", SPEC, idempotency_key="a")))
        await asyncio.get_running_loop().run_in_executor(None, writer.entered.wait, 5)
        rest = [asyncio.ensure_future(gc.submit(SubmitItem("t", SPEC, idempotency_key=k)))
                for k in ("b", "old-c", "bad-d", "e")]
        await asyncio.sleep(0.05)  # all four are queued behind the held group
        release.set()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    a, b, c, d, e = asyncio.run(run())
    # the second group could not be stored whole: each of its submits went alone, with its own answer
    assert writer.groups == [["a"], ["b", "old-c", "bad-d", "e"]]
    assert sorted(store.alone_calls) == ["b", "bad-d", "e", "old-c"]
    assert (a[0].id, a[1], b[0].id, c[0].id, c[1], e[0].id) == ("job-a", True, "job-b", "job-old-c", False, "job-e")
    assert isinstance(d, QuotaExceeded) and str(d) == "over: bad-d"
    assert sorted(created) == ["job-a", "job-b", "job-e"]  # new jobs only


def test_max_group_caps_a_group():
    release = threading.Event()
    writer = _Writer(_answers, hold=release)
    gc = GroupCommit(_Store(writer), max_group=2)

    async def run():
        first = asyncio.ensure_future(gc.submit(SubmitItem("t", SPEC, idempotency_key="a")))
        await asyncio.get_running_loop().run_in_executor(None, writer.entered.wait, 5)
        rest = [asyncio.ensure_future(gc.submit(SubmitItem("t", SPEC, idempotency_key=k))) for k in "bcde"]
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(first, *rest)

    asyncio.run(run())
    assert writer.groups == [["a"], ["b", "c"], ["d", "e"]]
    with pytest.raises(ValueError, match="max_group=0"):
        GroupCommit(_Store(writer), max_group=0)


def test_a_failing_group_fails_each_request_and_the_writer_goes_on(caplog):
    calls = []

    def answer(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise ConnectionError("database unreachable")
        return _answers(items)

    def boom(job_id):
        raise RuntimeError("kick failed")

    writer = _Writer(answer)
    gc = GroupCommit(_Store(writer), on_created=boom)

    async def run():
        with pytest.raises(ConnectionError, match="database unreachable"):
            await gc.submit(SubmitItem("t", SPEC, idempotency_key="a"))
        return await gc.submit(SubmitItem("t", SPEC, idempotency_key="b"))

    with caplog.at_level(logging.ERROR, logger="broker.service.group_commit"):
        job, created = asyncio.run(run())
    assert (job.id, created) == ("job-b", True)  # an on_created error changes no answer
    assert any("on_submit(job-b) failed" in r.getMessage() for r in caplog.records)
    gc.close()  # the writer stops and gives its connection back
    assert writer.closed >= 1 and gc._thread is None


def test_concurrent_submits_through_postgresql_are_all_stored_once(pg_store):
    gc = GroupCommit(pg_store)

    async def run():
        return await asyncio.gather(*[gc.submit(SubmitItem("vision", SPEC, idempotency_key=f"k{i}", actor=ACTOR,
                                                           max_unfinished=100)) for i in range(40)])

    out = asyncio.run(run())
    assert all(created for _, created in out)
    assert sorted(j.idempotency_key for j, _ in out) == sorted(f"k{i}" for i in range(40))
    assert _rows(pg_store, "SELECT count(*), count(DISTINCT idempotency_key) FROM jobs")[0] == (40, 40)
    assert _rows(pg_store, "SELECT count(*) FROM audit_events WHERE action = 'job.submit'")[0][0] == 40


def test_a_group_whose_commit_returned_is_stored_even_if_the_connection_dies_right_after(pg_store, monkeypatch):
    """The commit returned: the group is answered as stored (it is), however the connection fares next; the
    following group gets a new connection. (Committing inside the pipeline answered 500 for stored jobs.)"""
    import psycopg

    real = psycopg.Connection.commit

    def commit_then_die(self):
        real(self)
        killer = psycopg.connect(PG_DSN, autocommit=True)
        killer.execute("SELECT pg_terminate_backend(%s)", (self.info.backend_pid,))
        killer.close()

    w = pg_store.submit_writer()
    try:
        w.try_group([SubmitItem("vision", SPEC)])  # the held connection
        monkeypatch.setattr(psycopg.Connection, "commit", commit_then_die)
        out = w.try_group([SubmitItem("vision", SPEC), SubmitItem("nlp", OTHER)])
        monkeypatch.setattr(psycopg.Connection, "commit", real)
        assert [created for _, created in out] == [True, True]
        assert [created for _, created in w.try_group([SubmitItem("vision", OTHER)])] == [True]
    finally:
        w.close()
    assert _rows(pg_store, "SELECT count(*) FROM jobs")[0][0] == 4


def test_a_team_row_lock_held_elsewhere_gives_the_group_up_and_the_other_team_is_not_held(pg_store):
    """Team vision's usage counter is locked by another transaction (as a bulk submit of vision's holds it) for
    2 s: the group gives up within GROUP_LOCK_TIMEOUT_MS, each submit goes alone, nlp's is answered at once and
    vision's when the lock is released."""
    import time

    from broker.service.store.core import GROUP_LOCK_TIMEOUT_MS

    pg_store.submit("vision", SPEC)  # vision's team_usage row exists
    locked, release = threading.Event(), threading.Event()

    def hold():
        with pg_store.engine.begin() as c:
            c.execute(text("SELECT unfinished FROM team_usage WHERE team = 'vision' FOR UPDATE"))
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10)
    w = pg_store.submit_writer()
    try:
        t0 = time.monotonic()
        assert w.try_group([SubmitItem("vision", SPEC), SubmitItem("nlp", SPEC)]) is None
        assert time.monotonic() - t0 < GROUP_LOCK_TIMEOUT_MS / 1000 + 1.0
    finally:
        w.close()
    gc = GroupCommit(pg_store)
    done: dict[str, float] = {}

    async def one(team):
        await gc.submit(SubmitItem(team, SPEC))
        done[team] = time.monotonic() - t0

    async def run():
        asyncio.get_running_loop().call_later(1.5, release.set)
        await asyncio.gather(one("vision"), one("nlp"))

    t0 = time.monotonic()
    asyncio.run(run())
    holder.join(10)
    gc.close()
    assert done["nlp"] < 1.0 <= 1.4 < done["vision"]
    assert dict(_rows(pg_store, "SELECT team, count(*) FROM jobs GROUP BY team")) == {"vision": 2, "nlp": 1}


def test_an_idle_writer_gives_its_connection_back_and_close_stops_it(pg_store, monkeypatch):
    from broker.service import group_commit

    monkeypatch.setattr(group_commit, "IDLE_RELEASE_S", 0.2)
    gc = GroupCommit(pg_store)
    asyncio.run(gc.submit(SubmitItem("vision", SPEC)))
    pool = pg_store.engine.pool
    import time

    deadline = time.monotonic() + 5
    while pool.checkedout() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.checkedout() == 0
    gc.close()
    assert gc._thread is None
    assert asyncio.run(gc.submit(SubmitItem("vision", SPEC)))[1] is True  # a new writer on demand
    gc.close()
