"""The live planning cycle and the reconciler on a real store (PostgreSQL and SQLite)."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from sqlalchemy import select

from broker.cycle import PlanningCycle, decayed_usage
from broker.db import Attempt, Job, utcnow
from broker.live import LiveEnvironment, replay_offset_s
from broker.model import JobSpec
from broker.reconciler import Reconciler, checkpointed_work_s
from broker.settings import BrokerSettings
from broker.store import JobStore


@pytest.fixture(scope="module")
def env():
    return LiveEnvironment(BrokerSettings().planner)


def _cycle(store, env, **kw):
    sent = []
    st = BrokerSettings(**kw)
    return PlanningCycle(store, env, st, dispatch=lambda j, a: sent.append((j, a))), sent, st


def _spec(**kw):
    kw.setdefault("command", ["true"])
    kw.setdefault("estimated_duration_s", 600.0)
    return JobSpec(**kw)


def test_three_one_gpu_jobs_on_a_two_gpu_node(any_store, env):
    store = any_store
    store.heartbeat("n1", "local", "V100", 2, 16.0, [0, 1], "agent-1")
    cyc, sent, _ = _cycle(store, env)
    ids = [store.submit("ml", _spec())[0].id for _ in range(3)]
    res = cyc.run()
    assert res.applied and not res.stale
    assert res.intake == 3
    assert res.kinds == {"start": 2, "wait": 1}
    jobs = {j.id: j for j in store.list_jobs()}
    started = [i for i in ids if jobs[i].state == "starting"]
    waiting = [i for i in ids if jobs[i].state == "queued"]
    assert len(started) == 2 and len(waiting) == 1
    assert sorted(jobs[i].placement["nodes"][0]["gpus"][0] for i in started) == [0, 1]
    assert sent == []  # on-prem placements need no message: node agents poll GET /v1/node/work
    assert [e.to_state for e in store.events(started[0])] == ["submitted", "queued", "starting"]
    assert store.attempts(started[0])[0].gpus == 1
    assert "waiting for 1 GPU(s) in pool local" in jobs[waiting[0]].reason
    rec = store.decision(waiting[0])
    assert rec["kind"] == "wait" and rec["option"]["target"] == "local"
    # a second cycle changes nothing: both GPUs are held by the starting jobs
    res2 = cyc.run()
    assert res2.dispatched == []
    assert store.get(waiting[0]).state == "queued"


def test_unhealthy_gpu_receives_no_work(pg_store, env):
    pg_store.heartbeat("n1", "local", "V100", 2, 16.0, [1], "agent-1")  # GPU 0 lost
    cyc, sent, _ = _cycle(pg_store, env)
    a = pg_store.submit("ml", _spec())[0].id
    b = pg_store.submit("ml", _spec())[0].id
    cyc.run()
    states = {a: pg_store.get(a), b: pg_store.get(b)}
    started = [j for j in states.values() if j.state == "starting"]
    assert len(started) == 1 and started[0].placement["nodes"][0]["gpus"] == [1]


def test_stale_plan_is_dropped_by_the_fence(pg_store, env):
    pg_store.heartbeat("n1", "local", "V100", 2, 16.0, [0, 1], "agent-1")
    cyc, sent, _ = _cycle(pg_store, env)
    jid = pg_store.submit("ml", _spec())[0].id

    class Racing(JobStore):
        def planner_version(self):  # another planner applies between this cycle's read and its apply
            v = super().planner_version()
            with self.session() as s:
                assert JobStore.advance_fence(s, v, "other-planner", utcnow())
            return v

    racing = Racing(pg_store.url, pg_store.schema)
    res = PlanningCycle(racing, env, BrokerSettings(), dispatch=lambda j, a: sent.append(j)).run()
    assert res.stale and not res.applied and sent == []
    assert pg_store.get(jid).state == "queued"  # intake applied; the placement did not
    assert pg_store.attempts(jid) == []
    racing.engine.dispose()


def test_cancel_between_snapshot_and_apply_wins(pg_store, env, monkeypatch):
    import broker.cycle as cycle_mod

    pg_store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1")
    jid = pg_store.submit("ml", _spec())[0].id
    real_plan = cycle_mod.plan

    def plan_then_cancel(snapshot, ctx):  # the user cancels while the planner thinks
        out = real_plan(snapshot, ctx)
        pg_store.request_cancel(jid, "ml", "changed my mind")
        return out

    monkeypatch.setattr(cycle_mod, "plan", plan_then_cancel)
    cyc, sent, _ = _cycle(pg_store, env)
    res = cyc.run()
    assert res.applied and res.kinds == {"start": 1} and sent == []
    assert pg_store.get(jid).state == "cancelled"
    assert pg_store.attempts(jid) == []


def test_window_not_before_defers_then_starts_inside_it(any_store, env):
    store = any_store
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1")
    cyc, sent, _ = _cycle(store, env)
    now = utcnow()
    opens = now + timedelta(hours=2)
    jid = store.submit("ml", _spec(not_before=opens, not_after=opens + timedelta(hours=1)), now=now)[0].id
    cyc.run(now)
    j = store.get(jid)
    assert j.state == "deferred" and j.not_before == opens
    cyc.run(opens - timedelta(seconds=1))
    assert store.get(jid).state == "deferred"
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=opens + timedelta(seconds=5))
    cyc.run(opens + timedelta(seconds=10))
    j = store.get(jid)
    assert j.state == "starting"
    ev = store.events(jid)
    assert [e.to_state for e in ev] == ["submitted", "deferred", "queued", "starting"]
    assert opens <= ev[-1].at <= opens + timedelta(hours=1)


def test_start_window_closed_fails_with_reason(any_store, env):
    store = any_store
    cyc, _, _ = _cycle(store, env)  # no node at all
    now = utcnow()
    jid = store.submit("ml", _spec(not_after=now + timedelta(minutes=5)), now=now)[0].id
    cyc.run(now)
    assert store.get(jid).state == "queued"
    assert "no live pool can hold it" in store.get(jid).reason
    cyc.run(now + timedelta(minutes=6))
    j = store.get(jid)
    assert j.state == "failed" and j.reason.startswith("start window closed at ")


def test_cheapest_window_defers_to_the_best_hour(pg_store, env):
    from broker.live import ReplayedSignals
    from broker.windows import best_start

    pg_store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1")
    cyc, _, _ = _cycle(pg_store, env)
    now = utcnow()
    spec = _spec(window="cheapest", estimated_duration_s=3600.0, deadline=now + timedelta(hours=12))
    jid = pg_store.submit("ml", spec, now=now)[0].id
    cyc.run(now)
    j = pg_store.get(jid)
    sig = ReplayedSignals(env.base_signals, env.offset_for(now.timestamp()))
    kw = 1 * env.gpus.busy_kw["V100"] * 1.3
    expect = best_start(earliest_s=now.timestamp(), latest_start_s=now.timestamp() + 11 * 3600, runtime_s=3600.0,
                        power_kw=kw, price=sig.price("CA-ON"), carbon=sig.carbon("CA-ON"), prefer="cheapest")
    if expect.start_s <= now.timestamp():
        assert j.state == "queued"
    else:
        assert j.state == "deferred"
        assert abs(j.not_before.timestamp() - expect.start_s) < 1e-3
        assert j.reason.startswith("cheapest window on pool local")


def test_decayed_usage_exact():
    ln2 = math.log(2)
    u = decayed_usage([("a", 2, 0.0, 3600.0), ("b", 1, 3600.0, float("nan"))], now_s=3600.0, half_life_s=3600.0)
    # team a: 2 GPUs over the last hour, weight 2^-(age/1h): 2 x (1 - 1/2) / ln2 GPU-h
    assert u["a"] == pytest.approx(1.0 / ln2, rel=1e-12)
    assert "b" not in u  # started now: no usage yet


def test_replay_offset_whole_weeks():
    week = 7 * 86400.0
    assert replay_offset_s(0.0, 100 * week, 50 * week, week) == 0.0
    assert replay_offset_s(0.0, 100 * week, 100 * week + 1, week) == 2 * week
    with pytest.raises(ValueError, match="ahead_s"):
        replay_offset_s(0.0, week, 0.0, week)


# ---------------------------------------------------------------- reconciler
def test_lost_node_requeues_running_job_keeping_checkpoints(pg_store, env):
    store = pg_store
    now = utcnow()
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=now)
    cyc, _, st = _cycle(store, env)
    jid = store.submit("ml", _spec(estimated_duration_s=7200.0, checkpoint_interval_s=600.0), now=now)[0].id
    cyc.run(now)
    assert store.transition(jid, "running", "running on n1", started_at=now)
    later = now + timedelta(seconds=1500)
    out = Reconciler(store, st).run(later)
    assert out["lost_nodes"] == 1 and out["requeued"] == 1
    j = store.get(jid)
    assert j.state == "queued" and j.placement is None
    assert [e.to_state for e in store.events(jid)][-2:] == ["interrupted", "queued"]
    with store.session() as s:
        assert s.get(Job, jid).work_done_s == 1200.0  # two whole 600 s checkpoints of 1500 s
        a = s.execute(select(Attempt).where(Attempt.job_id == jid)).scalar_one()
        assert a.outcome == "lost" and "stopped heartbeating" in a.reason
    assert checkpointed_work_s({"checkpointable": False}, 5000.0) == 0.0


def test_starting_job_is_not_redispatched_and_times_out(pg_store, env):
    store = pg_store
    now = utcnow()
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=now)
    cyc, _, st = _cycle(store, env, dispatch_retry_s=10.0, starting_deadline_s=60.0)
    jid = store.submit("ml", _spec(), now=now)[0].id
    cyc.run(now)
    resent = []
    rec = Reconciler(store, st, dispatch=lambda j, a: resent.append((j, a)))
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=now + timedelta(seconds=15))
    assert rec.run(now + timedelta(seconds=5))["redispatched"] == 0
    assert rec.run(now + timedelta(seconds=15))["redispatched"] == 0  # agents poll: nothing to re-send
    assert resent == []
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=now + timedelta(seconds=61))
    out = rec.run(now + timedelta(seconds=61))
    assert out["timed_out"] == 1
    j = store.get(jid)
    assert j.state == "queued" and j.reason == "still starting after 60 s without a running report from its node agents"


def test_a_job_that_keeps_failing_to_start_fails_after_max_attempts(pg_store, env):
    store = pg_store
    now = utcnow()
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=now)
    cyc, _, st = _cycle(store, env, starting_deadline_s=60.0, max_attempts=2)
    jid = store.submit("ml", _spec(), now=now)[0].id
    rec = Reconciler(store, st)
    for k in (1, 2):
        t = now + timedelta(seconds=61 * (k - 1))
        store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=t)
        cyc.run(t)
        assert store.get(jid).attempt == k
        store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=t + timedelta(seconds=61))
        rec.run(t + timedelta(seconds=61))
    j = store.get(jid)
    assert j.state == "failed" and j.reason == "gave up after 2 attempts; the last: still starting after 60 s without a running report from its node agents"
    assert [a.outcome for a in store.attempts(jid)] == ["timed_out", "timed_out"]


def test_a_schedule_whose_run_cannot_be_created_is_paused_and_the_others_still_fire(any_store, env):
    """Found by a fresh user: one bad schedule's exception stopped every later schedule's run."""
    from broker.db import Schedule

    store = any_store
    t0 = utcnow().replace(microsecond=0)
    good = store.create_schedule("ml", "good", "* * * * *", "UTC", _spec(), now=t0)
    bad = store.create_schedule("ml", "bad", "* * * * *", "UTC", _spec(), now=t0)
    with store.session() as s:  # a row stored before today's validation rules (e.g. by an older version)
        s.get(Schedule, bad.id).spec = {"command": ["true"], "estimated_duration_s": -5}
    fire = good.next_fire_at
    out = Reconciler(store, BrokerSettings()).run(fire)
    assert out["scheduled"] == 1 and list(out["schedule_errors"]) == [bad.id]
    assert [j.schedule_id for j in store.list_jobs()] == [good.id]
    b = store.get_schedule(bad.id)
    assert not b.enabled and "its run could not be created (ValidationError" in b.last_error
    assert store.set_schedule_enabled(bad.id, True).last_error is None
