"""Bulk cancel (``POST /v1/jobs:cancel``, ``Client.cancel_many``, ``JobStore.cancel_many``) on real PostgreSQL,
over real HTTP: one request cancels one team's matching jobs, never another team's, audited (issue 20: 10,000
jobs took 52 s one request at a time from 8 SDK threads)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select

from broker.client import AuthError, Client, ValidationFailed
from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.settings import BrokerSettings
from broker.service.store.tables import AuditEvent, Job, JobEvent
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread

ADMIN = "admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def server(store):
    with ServerThread(create_app(store, BrokerSettings(admin_token=ADMIN))) as srv:
        yield srv


def _job(store, team: str, name: str, state: str = "submitted") -> str:
    """A job of ``team`` named ``name``, moved along the lifecycle to ``state``."""
    j, _ = store.submit(team, JobSpec(name=name, command=["true"], gpus_per_node=1))
    path = {"submitted": [], "queued": ["queued"], "running": ["queued", "starting", "running"],
            "succeeded": ["queued", "starting", "running", "succeeded"]}[state]
    for st in path:
        assert store.transition(j.id, st, f"test: {st}", **({"attempt": 1} if st == "starting" else {}))
    return j.id


def _states(store, ids) -> dict[str, tuple[str, bool, int]]:
    with store.session() as s:
        rows = s.execute(select(Job.id, Job.state, Job.cancel_requested, Job.version).where(Job.id.in_(list(ids))))
        return {r.id: (r.state, r.cancel_requested, r.version) for r in rows}


def _team():
    return "t" + uuid.uuid4().hex[:10]


def test_cancel_by_name_then_all_changes_only_the_callers_team_and_is_audited(store, server):
    a, b = _team(), _team()
    tok_a = create_token(store, a).token
    sweep = sorted(_job(store, a, "sweep") for _ in range(3))
    running = _job(store, a, "sweep", "running")
    other = _job(store, a, "other", "queued")
    done = _job(store, a, "sweep", "succeeded")
    theirs = [_job(store, b, "sweep"), _job(store, b, "sweep", "queued"), _job(store, b, "sweep", "running")]
    before_b = _states(store, theirs)
    with store.session() as s:
        events_before = s.execute(select(func.count()).select_from(JobEvent)).scalar_one()

    c = Client(server.url, tok_a)
    res = c.cancel_many(name="sweep")
    assert (res.team, res.count, res.cancelled, res.cancel_requested, res.more) == (a, 4, sweep, [running], False)
    after = _states(store, sweep + [running, other, done])
    assert [after[i][:2] for i in sweep] == [("cancelled", True)] * 3
    assert after[running][:2] == ("running", True) and after[other][:2] == ("queued", False)
    assert after[done][:2] == ("succeeded", False)
    assert _states(store, theirs) == before_b  # team B's jobs of the same name: untouched, same versions
    assert c.get(running).reason == "cancel requested: cancelled by user (bulk)"
    assert [e.to_state for e in store.events(sweep[0])][-1] == "cancelled"

    with store.session() as s:
        assert s.execute(select(func.count()).select_from(JobEvent)).scalar_one() == events_before + 4
        rows = s.execute(select(AuditEvent).where(AuditEvent.action == "job.cancel", AuditEvent.actor_team == a)
                         .order_by(AuditEvent.target)).scalars().all()
    assert [(r.target, r.detail) for r in rows] == sorted(
        [(i, {"team": a, "from_state": "submitted", "to_state": "cancelled", "bulk": True}) for i in sweep]
        + [(running, {"team": a, "from_state": "running", "to_state": "running", "bulk": True,
                      "cancel_requested": True})])

    # --all: the one unfinished job left (the running one is already asked to stop, the finished one stays)
    res = c.cancel_many(all=True)
    assert (res.count, res.cancelled, res.cancel_requested) == (1, [other], [])
    assert c.cancel_many(all=True).count == 0  # again: nothing left, a no-op
    assert _states(store, theirs) == before_b


def test_another_team_an_empty_filter_or_a_finished_state_is_refused(store, server):
    a, b = _team(), _team()
    c = Client(server.url, create_token(store, a).token)
    theirs = [_job(store, b, "x"), _job(store, b, "x", "running")]
    before = _states(store, theirs)
    with pytest.raises(AuthError) as e:
        c.cancel_many(all=True, team=b)
    assert e.value.status == 403 and str(e.value) == f"403 team={b!r}: your token belongs to team {a!r}"
    with pytest.raises(ValidationFailed) as e:
        c.cancel_many()
    assert "all=False: give all=true, states or name: an empty filter cancels nothing" in str(e.value)
    with pytest.raises(ValidationFailed) as e:
        c.cancel_many(state="succeeded")
    assert ("states='succeeded': a succeeded job is finished and cannot be cancelled; the unfinished states are "
            "submitted, queued, deferred, provisioning, starting, running, interrupted") in str(e.value)
    with pytest.raises(ValidationFailed) as e:  # no job has such a name (the rule of a job's name): 422
        c.cancel_many(name="sweep\u202e")
    assert "name='sweep\\u202e': contains the format character U+202E" in str(e.value)
    with pytest.raises(ValidationFailed) as e:
        c.cancel_many(state="sleeping")
    assert "states='sleeping': not a job state" in str(e.value)
    read_only = Client(server.url, create_token(store, b, "read-only").token)
    with pytest.raises(AuthError) as e:
        read_only.cancel_many(all=True)
    assert e.value.status == 403
    assert _states(store, theirs) == before


def test_an_admin_names_the_team(store, server):
    b = _team()
    queued, running = _job(store, b, "x", "queued"), _job(store, b, "x", "running")
    admin = Client(server.url, ADMIN)
    with pytest.raises(ValidationFailed) as e:
        admin.cancel_many(all=True)
    assert "team=None: an admin token cancels one team's jobs at a time: name the team" in str(e.value)
    res = admin.cancel_many(state=["running"], team=b)
    assert (res.team, res.cancelled, res.cancel_requested) == (b, [], [running])
    assert _states(store, [queued])[queued][0] == "queued"


def test_batches_and_the_limit(store):
    """1,205 jobs in transactions of 500: every one cancelled once; ``limit`` stops at 1,000 and says ``more``."""
    t = _team()
    ids = sorted(j.id for j, _ in store.submit_many(t, [(JobSpec(command=["true"]), None, None)] * 1205))
    cancelled, requested, more = store.cancel_many(t, states=["submitted"], limit=1000, batch=500)
    assert (cancelled, requested, more) == (ids[:1000], [], True)
    cancelled, requested, more = store.cancel_many(t, states=["submitted"], batch=500)
    assert (cancelled, requested, more) == (ids[1000:], [], False)
    assert {v[0] for v in _states(store, ids).values()} == {"cancelled"}
    assert store.cancel_many(t, states=["succeeded", "failed"]) == ([], [], False)  # finished states match nothing


def test_the_one_machine_sqlite_store_cancels_in_bulk_too(sqlite_store):
    """The quick start's store (SQLite: no ``FOR UPDATE``, ``RETURNING`` since 3.35): same answer."""
    t = _team()
    ids = sorted(_job(sqlite_store, t, "s") for _ in range(3))
    running = _job(sqlite_store, t, "s", "running")
    assert sqlite_store.cancel_many(t, name="s", batch=2) == (ids, [running], False)
    assert {i: v[:2] for i, v in _states(sqlite_store, ids + [running]).items()} == {
        **{i: ("cancelled", True) for i in ids}, running: ("running", True)}
