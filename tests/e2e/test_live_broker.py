"""End to end: the live broker as real processes on real PostgreSQL and a real Redis server.

Every job's command appends its own job id to a side-effect file, so "ran exactly once"
is checked by what the jobs did, not only by their state.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from datetime import timedelta

import pytest

from broker.client import Client
from broker.service.store.tables import utcnow
from broker.model import JobSpec
from tests.e2e.harness import LiveBroker, wait_for


@pytest.fixture
def broker(tmp_path, request):
    marker = request.node.get_closest_marker("broker")
    kw = dict(marker.kwargs) if marker else {}
    b = LiveBroker(tmp_path / "broker", **kw)
    try:
        b.start()
        yield b
    except BaseException:
        print(b.logs())
        raise
    finally:
        b.stop()


def _side_effect_spec(out, sleep_s: float = 0.2, **kw) -> JobSpec:
    if not out.exists():  # one file every job appends to: jobs run under uids of their own (umask 077)
        out.touch()
        os.chmod(out, 0o666)
    script = f'sleep {sleep_s}; echo "$FEDBROKER_JOB_ID $FEDBROKER_ATTEMPT $CUDA_VISIBLE_DEVICES" >> {out}'
    return JobSpec(command=["/bin/sh", "-c", script], estimated_duration_s=60.0, **kw)


def _submit_many(client: Client, out, n: int, **kw) -> list[str]:
    return [client.submit(_side_effect_spec(out, **kw)).id for _ in range(n)]


def _assert_exactly_once(b: LiveBroker, ids: list[str], out, timeout: float = 240.0) -> None:
    def done():
        states = collections.Counter(j.state for j in b.store.list_jobs(limit=1000))
        return states if states.get("succeeded", 0) == len(ids) else None

    try:
        wait_for(done, timeout, f"{len(ids)} jobs to succeed", interval=0.5)
    except AssertionError:
        print(collections.Counter(j.state for j in b.store.list_jobs(limit=1000)))
        print(b.logs())
        raise
    lines = out.read_text().split("\n")[:-1]
    ran = collections.Counter(line.split()[0] for line in lines)
    assert sorted(ran) == sorted(ids), "every submitted job ran"
    twice = {k: v for k, v in ran.items() if v != 1}
    assert twice == {}, f"jobs that ran more than once: {twice}"
    for line in lines:  # each ran on exactly one GPU of its node
        assert len(line.split()) == 3 and line.split()[2].isdigit()


@pytest.mark.broker(nodes={"node-a": 8, "node-b": 8})
def test_200_jobs_through_the_sdk_run_exactly_once_with_two_beats(broker, tmp_path):
    broker.start_beat("beat-2")  # two beats: the planner task arrives twice per interval
    broker.start_worker("worker-2")
    client = Client(broker.url, broker.token("ml"))
    out = tmp_path / "ran.txt"
    t0 = time.monotonic()
    ids = _submit_many(client, out, 200)
    _assert_exactly_once(broker, ids, out)
    print(f"200 jobs in {time.monotonic() - t0:.1f} s")
    for jid in ids[:5]:
        ex = client.explain(jid)
        assert [e.to_state for e in ex.events] == ["submitted", "queued", "starting", "running", "succeeded"]
        assert len(ex.attempts) == 1 and ex.attempts[0].exit_code == 0


@pytest.mark.broker(nodes={"node-a": 4, "node-b": 4})
def test_kill_9_of_worker_and_agent_mid_run_loses_nothing_runs_nothing_twice(broker, tmp_path):
    client = Client(broker.url, broker.token("ml"))
    out = tmp_path / "ran.txt"
    ids = _submit_many(client, out, 200, sleep_s=0.5)
    wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 30, 120, "30 jobs to run")
    broker.kill("worker", signal.SIGKILL)
    broker.kill("agent-node-a", signal.SIGKILL)  # its running jobs keep running under their shims
    time.sleep(2.0)
    broker.start_worker("worker")
    broker.start_agent("node-a")
    _assert_exactly_once(broker, ids, out)


@pytest.mark.broker(nodes={"node-a": 4, "node-b": 4})
def test_redis_restart_mid_run_loses_nothing_runs_nothing_twice(broker, tmp_path):
    client = Client(broker.url, broker.token("ml"))
    out = tmp_path / "ran.txt"
    ids = _submit_many(client, out, 200, sleep_s=0.3)
    wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 30, 120, "30 jobs to run")
    broker.restart_redis(down_s=2.0)  # every queued Celery message is gone
    _assert_exactly_once(broker, ids, out)


@pytest.mark.broker(nodes={"node-a": 2})
def test_job_runs_its_command_with_logs_explain_window_and_cancel(broker, tmp_path):
    client = Client(broker.url, broker.token("ml"))
    # 1. a job prints to stdout and stderr; logs and the explain record come back through the SDK
    j = client.submit(JobSpec(command=["/bin/sh", "-c", "echo hello from $CUDA_VISIBLE_DEVICES; echo oops >&2"],
                              estimated_duration_s=120.0))
    j = client.wait(j.id, timeout=60)
    assert j.state == "succeeded" and j.exit_code == 0
    logs = client.logs(j.id)
    assert "hello from " in logs and "oops" in logs
    ex = client.explain(j.id)
    assert ex.decision["kind"] == "start" and ex.decision["option"]["kind"] == "onprem"
    for k in ("dollars_usd", "energy_kwh", "carbon_kg", "wait_s"):
        assert ex.decision["option"][k] >= 0
    assert any(a["kind"] == "cloud" for a in ex.decision["alternatives"])  # what the cloud would have cost
    # 2. a deferred job starts inside its window
    opens = utcnow() + timedelta(seconds=6)
    closes = opens + timedelta(seconds=60)
    d = client.submit(_side_effect_spec(tmp_path / "window.txt", not_before=opens, not_after=closes))
    assert client.get(d.id).state in ("submitted", "deferred")
    d = client.wait(d.id, timeout=90)
    assert d.state == "succeeded", [(e.at.isoformat(), e.to_state, e.reason) for e in client.explain(d.id).events]
    started = [e.at for e in client.explain(d.id).events if e.to_state == "running"]
    assert len(started) == 1 and opens <= started[0] <= closes
    # 3. cancelling a running job sends SIGTERM to its process, which may clean up
    c = client.submit(JobSpec(command=["/bin/sh", "-c", "trap 'echo got TERM; exit 0' TERM; "
                                       "echo started; while true; do sleep 0.1; done"], estimated_duration_s=600.0))
    wait_for(lambda: client.get(c.id).state == "running", 60, "the job to run")
    wait_for(lambda: "started" in client.logs(c.id), 30, "the job's first output")
    client.cancel(c.id)
    c = client.wait(c.id, timeout=60)
    assert c.state == "cancelled"
    wait_for(lambda: "got TERM" in client.logs(c.id), 10, "the TERM handler's output")
