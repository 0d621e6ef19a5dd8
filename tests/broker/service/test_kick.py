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
