"""The planner kick: debounced, and a suppressed kick is followed by one trailing kick (real Redis)."""

from __future__ import annotations

import time

import pytest
import redis

from broker.service import wiring
from tests.conftest import REDIS_URL


class _Sent:
    """Records ``send_task`` calls instead of queueing them on a Celery broker."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def send_task(self, name, queue=None, **kw):
        self.calls.append((name, queue))


def _wait_for_calls(sent: _Sent, n: int, timeout_s: float = 3.0) -> None:
    """Until ``sent`` holds ``n`` calls (the trailing kick runs on a timer thread; a loaded machine delays it)."""
    end = time.monotonic() + timeout_s
    while len(sent.calls) < n and time.monotonic() < end:
        time.sleep(0.02)


@pytest.fixture
def kick(monkeypatch):
    r = redis.Redis.from_url(REDIS_URL)
    r.delete(wiring.KICK_KEY)
    sent = _Sent()
    monkeypatch.setitem(wiring.services.__dict__, "redis", r)
    monkeypatch.setattr(wiring, "get_app", lambda: sent)
    monkeypatch.setattr(wiring, "_last_kick", -1e9)
    yield sent, r
    t = wiring._trailing
    if t is not None:
        t.cancel()
    wiring._trailing = None
    r.delete(wiring.KICK_KEY)


def test_kicks_within_the_window_send_one_now_and_one_trailing_kick(kick):
    sent, _ = kick
    assert wiring.kick_planner(debounce_ms=300) is True
    assert [wiring.kick_planner(debounce_ms=300) for _ in range(50)] == [False] * 50
    assert sent.calls == [("fedbroker.plan", "planning")]  # 51 submits, one kick so far
    _wait_for_calls(sent, 2)
    time.sleep(0.7)  # two windows more: no further kick
    assert sent.calls == [("fedbroker.plan", "planning")] * 2  # the trailing one, once


def test_a_lone_kick_arms_no_trailing_kick(kick):
    sent, _ = kick
    assert wiring.kick_planner(debounce_ms=100) is True
    time.sleep(0.3)
    assert sent.calls == [("fedbroker.plan", "planning")]
    assert wiring._trailing is None


def test_a_kick_suppressed_by_another_process_is_retried_after_the_window(kick):
    sent, r = kick
    r.set(wiring.KICK_KEY, b"1", px=150)  # another API process kicked just now
    assert wiring.kick_planner(debounce_ms=150) is False
    assert sent.calls == []
    _wait_for_calls(sent, 1)
    assert sent.calls == [("fedbroker.plan", "planning")]


def test_the_apis_planner_wake_never_waits_on_redis(monkeypatch):
    """``wiring.PlannerWake`` (the API's on_submit) returns at once while a kick hangs (a Redis that never
    answers held each kick for its socket timeout); calls during a kick fold into one more kick after it."""
    import threading
    import time

    from broker.service import wiring

    started, release, kicks = threading.Event(), threading.Event(), []

    def slow_kick(debounce_ms=200):
        kicks.append(time.monotonic())
        started.set()
        release.wait(5)
        return True

    monkeypatch.setattr(wiring, "kick_planner", slow_kick)
    wake = wiring.PlannerWake()
    t0 = time.monotonic()
    wake("job-1")
    assert started.wait(5)
    for i in range(20):
        wake(f"job-{i}")
    assert time.monotonic() - t0 < 0.5  # 21 calls, none waited for the hanging kick
    release.set()
    deadline = time.monotonic() + 5
    while len(kicks) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(kicks) == 2


def test_a_redis_that_cannot_be_reached_is_logged_once_a_minute_not_per_kick(monkeypatch, caplog):
    """Found by a hostile review: with Redis down, 200 submits logged "could not request a planning cycle" 14 times
    in 1.5 s."""
    import logging

    from broker.service.log_throttle import LogThrottle

    class Down:  # what redis-py raises for a Redis that refuses connections (after its own retries)
        def set(self, *a, **kw):
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setitem(wiring.services.__dict__, "redis", Down())
    monkeypatch.setattr(wiring, "_kick_failed_log", LogThrottle(60.0))
    with caplog.at_level(logging.WARNING, logger=wiring.log.name):
        for _ in range(5):
            monkeypatch.setattr(wiring, "_last_kick", -1e9)  # past the debounce window each time
            assert wiring.kick_planner() is False
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["could not request a planning cycle"]


def test_log_throttle_is_due_once_per_interval():
    from broker.service.log_throttle import LogThrottle

    clock = [100.0]
    t = LogThrottle(60.0, clock=lambda: clock[0])
    seen = []
    for at in (100.0, 100.5, 159.9, 160.0, 200.0, 220.0):
        clock[0] = at
        seen.append(t.due())
    assert seen == [True, False, False, True, False, True]
