"""The planner's Redis lock (broker.service.planner_lock) on a real Redis (``FEDBROKER_TEST_REDIS``): the
attacker's ``SET fedbroker:planner-lock x EX 300`` of issue 20 (intake stopped for every team for 5 min on
cb5ea98) is overridden; a live lock the broker wrote is honoured."""

from __future__ import annotations

import logging
import uuid

import pytest
import redis

from broker.service.planner_lock import PLANNER_LOCK, PlannerLock, lock_key
from tests.conftest import REDIS_URL

KEY = lock_key(b"\x01" * 32)


@pytest.fixture
def r():
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def _lock(r, ttl_s=60.0, key=KEY, holder="planner-a"):
    return PlannerLock(r, key, ttl_s, name=f"test:planner-lock:{uuid.uuid4().hex[:8]}", holder=holder)


def test_a_live_lock_of_this_broker_is_honoured_and_released(r):
    a = _lock(r)
    b = PlannerLock(r, KEY, 60.0, name=a.name, holder="planner-b")
    token = a.acquire()
    assert token.startswith("v1|planner-a|") and len(token.split("|")) == 5
    assert 59000 < r.pttl(a.name) <= 60000
    assert b.acquire() is None  # held: the second planner skips its cycle
    assert a.release(token) is True
    assert r.exists(a.name) == 0
    token_b = b.acquire()
    assert token_b is not None and b.release(token_b)
    assert a.release(token) is False  # long gone


@pytest.mark.parametrize("how,why", [
    (lambda r, k, v: r.set(k, "x", ex=300), "not one a planner writes"),  # the attacker's command
    (lambda r, k, v: r.set(k, v.replace("|planner-a|", "|planner-z|"), ex=30), "not signed by this broker"),
    (lambda r, k, v: r.set(k, v, ex=300), "TTL is 300 s"),                  # a copy of a real value, a longer TTL
    (lambda r, k, v: r.set(k, v), "no TTL"),
])
def test_a_lock_the_broker_did_not_write_is_overridden(r, caplog, how, why):
    a = _lock(r)
    genuine = a.value(a._now_ms() + 60000)
    how(r, a.name, genuine)
    with caplog.at_level(logging.WARNING, logger="fedbroker.planner_lock"):
        token = PlannerLock(r, KEY, 60.0, name=a.name, holder="planner-b").acquire()
    assert token is not None and r.get(a.name).decode() == token
    assert 59000 < r.pttl(a.name) <= 60000
    assert [rec.getMessage() for rec in caplog.records if why in rec.getMessage()], caplog.text


def test_a_lock_signed_with_another_key_or_with_a_far_or_past_deadline_is_overridden(r):
    a = _lock(r)
    now = a._now_ms()
    other = PlannerLock(r, lock_key(b"\x02" * 32), 60.0, name=a.name, holder="planner-a")
    cases = [
        (other.value(now + 60000), "not signed by this broker"),      # another broker's key
        (a.value(now + 3_600_000), "3600 s ahead"),                   # signed, but for an hour
        (a.value(now - 1), "deadline has passed"),                    # a genuine value whose TTL was extended
    ]
    for value, why in cases:
        r.set(a.name, value, px=30000)
        assert why in a.why_not_honoured(r.get(a.name), r.pttl(a.name), a._now_ms())
        assert a.acquire() is not None
    live = a.value(a._now_ms() + 60000)
    r.set(a.name, live, px=60000)
    assert a.why_not_honoured(r.get(a.name), r.pttl(a.name), a._now_ms()) is None
    assert a.acquire() is None


def test_the_plan_task_runs_a_cycle_past_the_attackers_lock(pg_store, r, monkeypatch):
    """``fedbroker.plan`` itself: with the attacker's lock in Redis, a cycle runs (cb5ea98: skipped for 300 s)."""
    from broker.service import tasks
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment
    from broker.service.settings import BrokerSettings
    from broker.service.wiring import services

    settings = BrokerSettings(redis_url=REDIS_URL)
    parts = {"settings": settings, "store": pg_store, "redis": r,
             "cycle": PlanningCycle(pg_store, LiveEnvironment(settings.planner), settings)}
    for k, v in parts.items():
        monkeypatch.setitem(services.__dict__, k, v)
    monkeypatch.setattr(tasks, "_lock", None, raising=False)
    r.set(PLANNER_LOCK, "x", ex=300)
    out = tasks.plan()
    assert "skipped" not in out and "total_s" in out
    assert r.exists(PLANNER_LOCK) == 0  # released after the cycle
    # a live lock the broker wrote is still honoured
    held = tasks._planner_lock().acquire()
    assert tasks.plan() == {"skipped": "another planner holds the lock"}
    assert tasks._planner_lock().release(held)
