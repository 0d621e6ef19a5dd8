"""The store's repositories on real PostgreSQL: planning (store/planning.py), node work (store/nodes.py) and
tokens (store/tokens.py). Each test builds a handful of rows and asserts exactly which come back."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select, update

from broker.model import JobSpec
from broker.service.store import nodes as node_rows
from broker.service.store import planning
from broker.service.store import tokens as token_rows
from broker.service.store.tables import ApiToken, Attempt, Job, Node

UTC = timezone.utc
T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)  # a Monday, UTC
SEC = timedelta(seconds=1)


def _submit(store, team: str, at: datetime, **kw) -> str:
    priority = kw.pop("priority", "normal")
    job, _ = store.submit(team, JobSpec(command=["true"], estimated_duration_s=600.0, priority_class=priority),
                          now=at, **kw)
    return job.id


def _row(store, job_id: str) -> Job:
    with store.session() as s:
        return s.get(Job, job_id)


# ----------------------------------------------------------------------------- intake
def test_intake_ids_take_teams_in_turn_oldest_first_and_only_due_jobs(pg_store):
    st = pg_store
    a1, a2, a3 = (_submit(st, "a", T0 + k * SEC) for k in range(3))
    b1 = _submit(st, "b", T0 + 3 * SEC)
    c_later = _submit(st, "c", T0 + 4 * SEC)
    st.transition(c_later, "deferred", "window", not_before=T0 + timedelta(hours=1))  # not due at now
    c_due = _submit(st, "c", T0 + 5 * SEC)
    st.transition(c_due, "deferred", "window", not_before=T0 + timedelta(minutes=5))  # due: window opened
    d_open = _submit(st, "d", T0 + 6 * SEC)
    st.transition(d_open, "queued", "accepted")  # queued, no start window: not intake's
    d_closed = _submit(st, "d", T0 + 7 * SEC, not_after=T0 + timedelta(minutes=8))
    st.transition(d_closed, "queued", "accepted")  # queued past its window: due (to fail)
    now = T0 + timedelta(minutes=10)
    with st.session() as s:
        # first of each team by age (a1 t0, b1 t0+3, c_due t0+5, d_closed t0+7), then a's second and third
        assert planning.intake_ids(s, now) == [a1, b1, c_due, d_closed, a2, a3]
        assert planning.intake_ids(s, now, limit=3) == [a1, b1, c_due]
        assert [j.id for j in planning.intake_rows(s, [a3, c_later, a1, d_open, d_closed], now)] == [a1, a3, d_closed]


def test_lock_free_rows_skips_rows_another_transaction_holds(pg_store):
    st = pg_store
    j1, j2 = _submit(st, "a", T0), _submit(st, "a", T0 + SEC)
    with st.session() as holder:
        holder.execute(select(Job.id).where(Job.id == j2).with_for_update())
        with st.session() as s:
            held = planning.lock_free_rows(s, [j1, j2, "job-0000000000000000"])
            assert {k: (r.version, r.state) for k, r in held.items()} == {j1: (1, "submitted")}
    with st.session() as s:
        assert set(planning.lock_free_rows(s, [j1, j2])) == {j1, j2}


def test_write_moves_sets_state_version_fields_and_events(any_store):
    st = any_store
    j1, j2 = _submit(st, "a", T0), _submit(st, "a", T0 + SEC)
    r1, r2 = _row(st, j1), _row(st, j2)
    now, start = T0 + timedelta(minutes=1), T0 + timedelta(hours=2)
    with st.session() as s:
        assert planning.write_moves(s, [(r1, "queued", "accepted", {}),
                                        (r2, "deferred", "cheaper at 11:00", {"not_before": start})], now) == 2
        assert planning.write_moves(s, [], now) == 0
    v1, v2 = st.get(j1), st.get(j2)
    assert (v1.state, v1.version, v1.reason, v1.not_before, v1.updated_at) == ("queued", 2, "accepted", None, now)
    assert (v2.state, v2.version, v2.not_before, v2.finished_at) == ("deferred", 2, start, None)
    assert [(e.from_state, e.to_state, e.version, e.reason, e.at) for e in st.events(j2)] == [
        (None, "submitted", 1, "submitted", T0 + SEC), ("submitted", "deferred", 2, "cheaper at 11:00", now)]


def test_write_notes_skip_jobs_changed_since_read_and_group_by_fields(any_store):
    st = any_store
    j1, j2, j3, j4 = (_submit(st, "a", T0 + k * SEC) for k in range(4))
    rows = {j: _row(st, j) for j in (j1, j2, j3, j4)}
    st.transition(j3, "queued", "accepted")  # changed after the read: its note must not be written
    now, review = T0 + timedelta(minutes=1), T0 + timedelta(minutes=30)
    notes = [(rows[j1], {"reason": "r1"}), (rows[j2], {"reason": "r2", "review_at": review}),
             (rows[j3], {"reason": "r3"}), (rows[j4], {"reason": "r4", "decision": {"chosen": {"pool": "p"}}})]
    with st.session() as s:
        written, held = planning.write_notes(s, notes, now)
    assert (written, held) == (3, {j1: 1, j2: 1, j3: 2, j4: 1})
    v1, v2, v3, v4 = st.get(j1), st.get(j2), st.get(j3), st.get(j4)
    assert (v1.state, v1.version, v1.reason, v1.updated_at) == ("submitted", 2, "r1", now)
    assert (v2.version, v2.reason) == (2, "r2")
    with st.session() as s:
        assert s.get(Job, j2).review_at == review
        assert (s.get(Job, j1).review_at, s.get(Job, j4).decision) == (None, {"chosen": {"pool": "p"}})
    assert (v3.version, v3.reason) == (2, "accepted")
    assert (v4.version, v4.reason) == (2, "r4")


def test_flag_records_a_same_state_event_only_when_it_applies(pg_store):
    st = pg_store
    jid = _submit(st, "a", T0)
    seen = _row(st, jid)
    now = T0 + timedelta(minutes=1)
    with st.session() as s:
        assert planning.flag(s, seen, now, "preemption requested for job-x", stop_reason="preempt", reason="stop")
    with st.session() as s:
        assert not planning.flag(s, seen, now, "again", stop_reason="preempt")  # stale version: nothing
    v = st.get(jid)
    assert (v.state, v.version, v.reason) == ("submitted", 2, "stop")
    assert [(e.from_state, e.to_state, e.version, e.reason) for e in st.events(jid)][1:] == [
        ("submitted", "submitted", 2, "preemption requested for job-x")]


# ----------------------------------------------------------------------------- snapshot
def test_queued_order_is_priority_then_age_and_queued_rows_only_queued(pg_store):
    st = pg_store
    old_low = _submit(st, "a", T0, priority="low")
    normal = _submit(st, "b", T0 + SEC)
    high = _submit(st, "a", T0 + 2 * SEC, priority="high")
    normal2 = _submit(st, "c", T0 + 3 * SEC)
    waiting = _submit(st, "c", T0 + 4 * SEC)  # stays submitted
    for j in (old_low, normal, high, normal2):
        st.transition(j, "queued", "accepted")
    with st.session() as s:
        assert planning.queued_order(s) == [
            (high, 2), (normal, 2), (normal2, 2), (old_low, 2)]
        assert sorted(j.id for j in planning.queued_rows(s, [high, waiting, old_low])) == sorted([high, old_low])


def test_gpu_usage_rows_are_started_attempts_running_or_ended_since(pg_store):
    st = pg_store
    jid = _submit(st, "vision", T0)
    since = T0 + timedelta(hours=1)
    parts = [{"node": "n1", "gpus": [0, 1], "rank": 0}, {"node": "n2", "gpus": [3], "rank": 1}]
    with st.session() as s:
        for n in (1, 2, 3, 4):
            planning.add_onprem_attempt(s, jid, n, "lab", parts, "V100", T0)
    times = {1: (T0, T0 + timedelta(minutes=59)),  # ended before since: left out
             2: (T0, None),  # still running
             3: (None, None),  # never started: left out
             4: (T0, since)}  # ended at since: in
    with st.session() as s:
        for n, (a, b) in times.items():
            s.execute(update(Attempt).where(Attempt.job_id == jid, Attempt.number == n)
                      .values(started_at=a, ended_at=b))
    with st.session() as s:
        got = sorted(((r.team, r.gpus, r.started_at, r.ended_at) for r in planning.gpu_usage_rows(s, since)), key=str)
        attempt = s.execute(select(Attempt).where(Attempt.job_id == jid, Attempt.number == 1)).scalar_one()
        assert (attempt.kind, attempt.pool, attempt.gpus, attempt.gpu_type, attempt.nodes) == (
            "onprem", "lab", 3, "V100", parts)
    assert got == sorted([("vision", 3, T0, None), ("vision", 3, T0, since)], key=str)


def test_live_node_rows_are_up_and_heard_since(pg_store):
    st = pg_store
    for name, at in (("n-fresh", T0), ("n-stale", T0 - timedelta(minutes=5)), ("n-lost", T0)):
        st.heartbeat(name, "lab", "V100", 4, 16.0, [0, 1, 2, 3], "agent", now=at)
    with st.session() as s:
        s.execute(update(Node).where(Node.name == "n-lost").values(state="lost"))
    with st.session() as s:
        assert sorted(n.name for n in planning.live_node_rows(s, T0 - timedelta(minutes=1))) == ["n-fresh"]


# ----------------------------------------------------------------------------- node work
def test_on_node_fingerprint_and_placements(pg_store):
    st = pg_store
    with st.session() as s:
        assert node_rows.on_node_fingerprint(s) == (0, 0, None)
        assert node_rows.on_node_placements(s) == {}
    gang, solo, queued = (_submit(st, "a", T0 + k * SEC) for k in range(3))
    for j in (gang, solo, queued):
        st.transition(j, "queued", "accepted")
    st.transition(gang, "starting", "placed", placement={"kind": "onprem", "pool": "lab", "nodes": [
        {"node": "n1", "gpus": [0], "rank": 0}, {"node": "n2", "gpus": [0], "rank": 1}]})
    st.transition(solo, "starting", "placed", placement={"kind": "onprem", "pool": "lab", "nodes": [
        {"node": "n1", "gpus": [1], "rank": 0}]})
    st.transition(solo, "running", "started")
    with st.session() as s:
        fp = node_rows.on_node_fingerprint(s)
        newest = max(s.get(Job, gang).updated_at, s.get(Job, solo).updated_at)
        assert (fp.count, fp.version_sum, fp.newest_change) == (2, 3 + 4, newest)
        assert node_rows.on_node_placements(s) == {"n1": frozenset({(gang, 3), (solo, 4)}),
                                                   "n2": frozenset({(gang, 3)})}


# ----------------------------------------------------------------------------- tokens
def _add(s, public_id: str, team: str, kind: str, expires_at: datetime, node: str | None = None,
         label: str = "") -> ApiToken:
    return token_rows.add_token(s, public_id=public_id, team=team, kind=kind, label=label, node=node,
                                token_hash=token_rows.hash_token("fbk_" + public_id), created_at=T0,
                                expires_at=expires_at)


def test_touch_last_used_writes_only_when_stale(pg_store):
    with pg_store.session() as s:
        row = _add(s, "tok-00000000000000a1", "ml", "member", T0 + timedelta(days=1))
    pk = row.id
    with pg_store.session() as s:
        assert token_rows.touch_last_used(s, pk, T0, T0 - 60 * SEC)  # never used: written
        assert not token_rows.touch_last_used(s, pk, T0 + 30 * SEC, T0 - 30 * SEC)  # used at T0 > stale
        assert token_rows.touch_last_used(s, pk, T0 + 61 * SEC, T0 + SEC)
        found = token_rows.by_hash(s, token_rows.hash_token("fbk_tok-00000000000000a1"))
        assert (found.public_id, found.team, found.kind, found.revoked, found.last_used_at) == (
            "tok-00000000000000a1", "ml", "member", False, T0 + 61 * SEC)
        assert token_rows.by_hash(s, token_rows.hash_token("fbk_nothing")) is None


def test_usable_admin_exists_needs_an_unrevoked_unexpired_admin(pg_store):
    with pg_store.session() as s:
        assert not token_rows.usable_admin_exists(s, T0)
        _add(s, "tok-00000000000000b1", "ml", "member", T0 + timedelta(days=1))
        assert not token_rows.usable_admin_exists(s, T0)
        _add(s, "tok-00000000000000b2", "ops", "admin", T0 + 10 * SEC)
        assert token_rows.usable_admin_exists(s, T0 + 9 * SEC)
        assert not token_rows.usable_admin_exists(s, T0 + 10 * SEC)  # expires_at is the first instant it fails


def test_token_rows_filter_by_team_kind_and_revocation(pg_store):
    later = T0 + timedelta(days=1)
    with pg_store.session() as s:
        _add(s, "tok-00000000000000c1", "ml", "member", later)
        _add(s, "tok-00000000000000c2", "ml", "admin", later)
        _add(s, "tok-00000000000000c3", "cv", "read-only", later)
        _add(s, "tok-00000000000000c4", "nodes", "node", later, node="gpu-1", label="rack")
        _add(s, "tok-00000000000000c5", "nodes", "node", later, node="gpu-1", label="other")
        _add(s, "tok-00000000000000c6", "ml", "member", later).revoked = True
    with pg_store.session() as s:
        ids = lambda rows: [r.public_id for r in rows]  # noqa: E731
        assert ids(token_rows.token_rows(s)) == ["tok-00000000000000c3", "tok-00000000000000c1",
                                                "tok-00000000000000c2", "tok-00000000000000c4",
                                                "tok-00000000000000c5"]
        assert ids(token_rows.token_rows(s, team="ml", kinds={"member", "read-only"}, include_revoked=True)) == [
            "tok-00000000000000c1", "tok-00000000000000c6"]
        assert ids(token_rows.node_token_rows(s, "gpu-1", "rack")) == ["tok-00000000000000c4"]
        assert token_rows.token_for_update(s, "tok-00000000000000c2").kind == "admin"
        assert token_rows.token_for_update(s, "tok-ffffffffffffffff") is None


def test_audit_rows_and_newest_first_reads(pg_store):
    actor = token_rows.Principal("ml", kind="team-admin", token_id="tok-00000000000000d1")
    assert token_rows.audit_row(None, "token.create", "tok-x", None, T0) == {
        "at": T0, "action": "token.create", "target": "tok-x", "detail": {}, "actor_token_id": None,
        "actor_team": "", "actor_kind": "database"}
    with pg_store.session() as s:
        token_rows.audit(s, actor, "job.submit", "job-1", {"team": "ml"}, T0)
        token_rows.audit(s, None, "token.revoke", "tok-x", None, T0 + SEC)
        token_rows.audit(s, actor, "job.cancel", "job-1", {"team": "ml"}, T0 + 2 * SEC)
    with pg_store.session() as s:
        assert [(e.action, e.actor_kind) for e in token_rows.audit_event_rows(s, None, 2, None)] == [
            ("job.cancel", "team-admin"), ("token.revoke", "database")]
        assert [e.target for e in token_rows.audit_event_rows(s, T0 + SEC, 10, None)] == ["job-1", "tok-x"]
        assert [e.at for e in token_rows.audit_event_rows(s, None, 10, "job.submit")] == [T0]


@pytest.mark.parametrize("kind,expected", [("admin", True), ("member", False)])
def test_added_token_admin_column_follows_kind(pg_store, kind, expected):
    with pg_store.session() as s:
        row = _add(s, "tok-00000000000000e1", "ops", kind, T0 + timedelta(days=1))
        assert (row.admin, row.revoked, row.last_used_at, row.id is not None) == (expected, False, None, True)
