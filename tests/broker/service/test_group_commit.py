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

SPEC = JobSpec.model_validate({"command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60})
OTHER = SPEC.model_copy(update={"gpus_per_node": 2})
ACTOR = Principal("vision", kind="member", token_id="tok-1")


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

    def submit_group(self, items):
        self.groups.append([it.idempotency_key for it in items])
        self.entered.set()
        if self.hold is not None and len(self.groups) == 1:
            self.hold.wait(10)
        return self.answer(items)


class _Store:
    def __init__(self, writer):
        self.writer = writer

    def submit_writer(self):
        return self.writer


class _View:
    def __init__(self, id):
        self.id = id


def _answers(items):
    out = []
    for it in items:
        if it.idempotency_key.startswith("bad"):
            out.append(QuotaExceeded(f"over: {it.idempotency_key}", "quotas.max_queued_jobs", 5))
        else:
            out.append((_View("job-" + it.idempotency_key), not it.idempotency_key.startswith("old")))
    return out


def test_submits_waiting_while_a_group_is_stored_form_the_next_group_and_each_gets_its_answer():
    release = threading.Event()
    writer = _Writer(_answers, hold=release)
    created: list[str] = []
    gc = GroupCommit(_Store(writer), on_created=created.append)

    async def run():
        first = asyncio.ensure_future(gc.submit(SubmitItem("t", SPEC, idempotency_key="a")))
        await asyncio.get_running_loop().run_in_executor(None, writer.entered.wait, 5)
        rest = [asyncio.ensure_future(gc.submit(SubmitItem("t", SPEC, idempotency_key=k)))
                for k in ("b", "old-c", "bad-d", "e")]
        await asyncio.sleep(0.05)  # all four are queued behind the held group
        release.set()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    a, b, c, d, e = asyncio.run(run())
    assert writer.groups == [["a"], ["b", "old-c", "bad-d", "e"]]
    assert (a[0].id, a[1], b[0].id, c[0].id, c[1], e[0].id) == ("job-a", True, "job-b", "job-old-c", False, "job-e")
    assert isinstance(d, QuotaExceeded) and str(d) == "over: bad-d"
    assert created == ["job-a", "job-b", "job-e"]  # new jobs only, in order


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

    gc = GroupCommit(_Store(_Writer(answer)), on_created=boom)

    async def run():
        with pytest.raises(ConnectionError, match="database unreachable"):
            await gc.submit(SubmitItem("t", SPEC, idempotency_key="a"))
        return await gc.submit(SubmitItem("t", SPEC, idempotency_key="b"))

    with caplog.at_level(logging.ERROR, logger="broker.service.group_commit"):
        job, created = asyncio.run(run())
    assert (job.id, created) == ("job-b", True)  # an on_created error changes no answer
    assert any("on_submit(job-b) failed" in r.getMessage() for r in caplog.records)


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
