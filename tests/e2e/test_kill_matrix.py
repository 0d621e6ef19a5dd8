"""Kill matrix (issue #9 item 9): ``kill -9`` of each process kind at each lifecycle step of an on-prem job.

One live broker (real PostgreSQL, a private ``redis-server``, ``serve api``, ``worker``, ``beat`` and one node
agent with fake GPUs, all real processes: :class:`tests.e2e.harness.LiveBroker`) is shared by every case; each
case submits one job of its own. The job's command appends ``<job id> <attempt>`` to ``started`` when it
begins, waits for a ``gate`` file the test creates, then appends the same to ``ran`` and exits 0: the lines
count what the job did, whatever the store says.

Each case holds the job at one step, SIGKILLs one process kind there, starts it again, lets the job go on, and
asserts the job ended ``succeeded`` exactly once with one attempt (closed, exit code 0), the command started
once and its side effect happened once, the usage ledger metered the attempt once (one ``energy`` and one
``amortised`` line, each over the attempt's run), no other job appeared or vanished, and the agent keeps no attempt of
it. The steps and how each is held (the hold is what makes the step deterministic, not a sleep):

============  ==========================================================  =====================================
step          where the job is when the process dies                      held by
============  ==========================================================  =====================================
submitted     in the store, before intake                                 the worker (the planner) SIGSTOPped
placing       taken in (``queued``), the planner's apply transaction       a test transaction holding the planner
              open and blocked before it commits the placement             fence row (``SELECT ... FOR UPDATE``)
starting      queued and placed on the node, not yet picked up             the agent SIGSTOPped
launched      its process runs; the agent's ``running`` report is in        a test transaction holding the job's
              the API, blocked before it commits                          row
running       its process runs (``started`` has its line)                  the gate file is absent
finishing     its process exited (exit file written, ``ran`` has its       the agent SIGSTOPped before the gate
              line), the report is not stored (the store says running)     opens
============  ==========================================================  =====================================

No case of the matrix needs an at-least-once rule: every kill there is answered by the exactly-once paths (the
store is the truth, the planner re-reads it; the agent re-adopts its attempts from its state directory and
reports the ones that ended meanwhile). Holds last a few seconds and ``node_lost_after_s`` is 60 s there, so the
one at-least-once path, a node declared lost, is kept out of the matrix; the last test takes it on purpose (an
agent down past ``node_lost_after_s``: the command starts twice, its side effect happens once, and attempt 2
sees attempt 1's checkpoint).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from broker.client import Client
from broker.model import JobSpec
from tests.e2e.harness import LiveBroker, wait_for

KINDS = {"api": "api", "worker": "worker", "beat": "beat", "agent": "agent-node-a"}
STEPS = ("submitted", "placing", "starting", "launched", "running", "finishing")
#: a case that does not reach ``succeeded`` in this many seconds fails (a healthy case takes ~3-8 s)
CASE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def live():
    """One broker for the module (cases leave it as they found it: every process alive, no job open)."""
    root = Path(tempfile.mkdtemp(prefix="fedbroker-kill-", dir="/tmp"))
    os.chmod(root, 0o1777)  # jobs run under uids of their own: they must reach their case directories
    b = LiveBroker(root / "broker", nodes={"node-a": 2}, node_lost_after_s=60.0, planner_lock_ttl_s=5.0)
    try:
        b.start()
        b.client = Client(b.url, b.token("ml"))
        b.submitted = []  # every job id the module submitted
        b.root = root
        yield b
    except BaseException:
        print(b.logs())
        raise
    finally:
        b.stop()
        shutil.rmtree(root, ignore_errors=True)


def _case_dir(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    os.chmod(d, 0o1777)
    for f in ("started", "ran"):
        (d / f).touch()
        os.chmod(d / f, 0o666)
    return d


def _gated_spec(d: Path) -> JobSpec:
    mark = '"$FEDBROKER_JOB_ID $FEDBROKER_ATTEMPT"'
    script = (f"echo {mark} >> {d}/started; while [ ! -e {d}/gate ]; do sleep 0.05; done; "
              f"echo {mark} >> {d}/ran")
    return JobSpec(command=["/bin/sh", "-c", script], estimated_duration_s=60.0)


def _local(b: LiveBroker, job_id: str) -> list:
    """The agent's attempts of ``job_id`` on disk (what a restarted agent would re-adopt)."""
    from workers.runtime import ProcessRuntime

    return [a for a in ProcessRuntime(b.dir / "state" / "agents" / "node-a").list() if a.key.job_id == job_id]


def _usage(b: LiveBroker, job_id: str) -> list:
    """The usage ledger's records of ``job_id`` (by attempt, rank, line)."""
    from broker.service.store.usage import usage_rows

    with b.store.session() as s:
        return usage_rows(s, job_id)


def _lines(path: Path, job_id: str) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.split()[0] == job_id]


class _RowLock:
    """A transaction of the test's own holding one row (``SELECT ... FOR UPDATE``) until :meth:`release`: a broker
    process that writes that row blocks there, inside its own transaction, not yet committed.

    ``table``/``where`` name the row (``where`` is SQL with ``:id``); ``id`` its key."""

    def __init__(self, b: LiveBroker, table: str, where: str, id):
        from sqlalchemy import text

        self.text = text
        self.conn = b.store.engine.connect()
        self.tx = self.conn.begin()
        got = self.conn.execute(text(f"SELECT 1 FROM {table} WHERE {where} FOR UPDATE"), {"id": id}).all()
        assert got == [(1,)], f"no row of {table} where {where} ({id!r})"

    def blocked(self) -> int:
        """How many other sessions wait on this transaction's lock (``pg_blocking_pids``; what they run is not
        read: ``pg_stat_activity.query`` may still show the statement before)."""
        return self.conn.execute(self.text("SELECT count(*) FROM pg_stat_activity "
                                           "WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")).scalar_one()

    def release(self) -> None:
        self.tx.rollback()
        self.conn.close()


class _Hold:
    """What holds the job at its step: a frozen process (released by SIGCONT unless it was the one killed and
    started again) or the fence transaction."""

    def __init__(self, b: LiveBroker, what):
        self.b, self.what = b, what

    def release(self, killed: str | None = None) -> None:
        if isinstance(self.what, _RowLock):
            self.what.release()
        elif self.what is not None and self.what != killed:
            self.b.resume(self.what)
        self.what = None


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_kill_9_at_each_step_runs_the_job_exactly_once(live, kind, step):
    b, victim = live, KINDS[kind]
    d = _case_dir(b.root, f"{kind}-{step}")
    t0 = time.monotonic()
    hold = _Hold(b, None)
    if step in ("submitted", "placing", "starting", "launched"):
        (d / "gate").touch()
    if step == "submitted":
        hold = _Hold(b, "worker")
        b.pause("worker")
    elif step == "placing":
        b.store.planner_version()  # the fence row exists
        hold = _Hold(b, _RowLock(b, "planner_state", "id = :id", 1))
    elif step in ("starting", "launched"):
        hold = _Hold(b, "agent-node-a")
        b.pause("agent-node-a")
    job_id = b.client.submit(_gated_spec(d)).id
    b.submitted.append(job_id)
    try:
        # ---- hold the job at the step, and check it is there
        if step == "submitted":
            time.sleep(0.3)  # a beat tick and the API's kick are queued meanwhile, for the frozen worker
            assert b.store.get(job_id).state == "submitted"
        elif step == "placing":
            wait_for(lambda: b.store.get(job_id).state == "queued" and hold.what.blocked() >= 1, 30,
                     "the planner to take the job in and block in its apply (advance_fence)")
        elif step == "starting":
            wait_for(lambda: b.store.get(job_id).state == "starting", 30, "the job to be placed")
            assert _local(b, job_id) == [], "the frozen agent picked the job up"
        elif step == "launched":
            wait_for(lambda: b.store.get(job_id).state == "starting", 30, "the job to be placed")
            lock = _RowLock(b, "jobs", "id = :id", job_id)  # the API's `running` report will wait on it
            hold.release()
            hold = _Hold(b, lock)
            wait_for(lambda: _lines(d / "started", job_id) and lock.blocked() >= 1, 30,
                     "the process to start and the API to block storing its `running` report")
            assert b.store.get(job_id).state == "starting"
        else:
            wait_for(lambda: b.store.get(job_id).state == "running" and _lines(d / "started", job_id), 30,
                     "the job's process to run")
            if step == "finishing":
                hold = _Hold(b, "agent-node-a")
                b.pause("agent-node-a")
                (d / "gate").touch()
                wait_for(lambda: [a.status for a in _local(b, job_id)] == ["exited"], 30, "the process to exit")
                assert _lines(d / "ran", job_id) and b.store.get(job_id).state == "running"
        # ---- kill -9 the process kind there, start it again, let the job go on
        b.kill(victim)
        b.restart(victim)
        hold.release(killed=victim)
        if step == "running":
            (d / "gate").touch()
        wait_for(lambda: b.store.get(job_id).state in ("succeeded", "failed", "cancelled"), CASE_TIMEOUT_S,
                 f"job {job_id} to end")
    except BaseException:
        if isinstance(hold.what, _RowLock):
            print("blocked:", hold.what.conn.execute(hold.what.text(
                "SELECT pid, state, wait_event_type, left(query, 200) FROM pg_stat_activity "
                "WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")).all())
            print("job", b.store.get(job_id).state)
        hold.release()
        print(b.logs())
        raise
    # ---- exactly once, by the store and by what the job did
    events = [e.to_state for e in b.store.events(job_id)]
    assert events == ["submitted", "queued", "starting", "running", "succeeded"], events
    attempts = b.store.attempts(job_id)
    assert [(a.outcome, a.exit_code, a.ended_at is not None) for a in attempts] == [("succeeded", 0, True)]
    # the finance ledger metered the attempt once: one energy and one amortised line over its run
    usage = _usage(b, job_id)
    a = attempts[0]
    run_s = (a.ended_at - a.started_at).total_seconds()
    assert [(u.attempt, u.rank, u.line, u.resource) for u in usage] == [(1, 0, "amortised", "node-a"),
                                                                         (1, 0, "energy", "node-a")]
    assert [u.run_s for u in usage] == pytest.approx([run_s, run_s], abs=1e-6)
    assert len(_lines(d / "started", job_id)) == 1, "the command started more than once"
    assert len(_lines(d / "ran", job_id)) == 1, "the side effect happened more than once"
    # no job lost or duplicated, none open, the agent keeps nothing of this one, every process is back
    jobs = b.store.list_jobs(limit=1000)
    assert sorted(j.id for j in jobs) == sorted(b.submitted)
    assert {j.state for j in jobs} == {"succeeded"}
    assert all(a.ended_at is not None for j in jobs for a in b.store.attempts(j.id))
    wait_for(lambda: _local(b, job_id) == [], 15, "the agent to forget the reported attempt")
    assert {n: p.poll() for n, p in b.procs.items()} == {n: None for n in b.procs}
    print(f"kill -9 {victim} at {step}: succeeded once in {time.monotonic() - t0:.1f} s")


def test_agent_gone_past_node_lost_reruns_the_job_once_more_from_its_checkpoint(tmp_path):
    """The one at-least-once path: an agent killed while its job runs and started again only after
    ``node_lost_after_s`` (4 s here). The reconciler declares the node lost and requeues the job (attempt 1 ends
    ``lost``, ARCHITECTURE.md "Attempts"); the restarted agent stops attempt 1's process, which no longer is in its
    work, and runs attempt 2 with the same ``CHECKPOINT_DIR``. So the command starts twice (attempts 1 and 2), and
    its side effect, which attempt 1 had not reached, happens once, by attempt 2."""
    b = LiveBroker(tmp_path / "broker", nodes={"node-a": 2}, node_lost_after_s=4.0)
    try:
        b.start()
        client = Client(b.url, b.token("ml"))
        d = _case_dir(tmp_path, "lost")
        mark = '"$FEDBROKER_JOB_ID $FEDBROKER_ATTEMPT"'
        script = (f"echo {mark} >> {d}/started; echo {mark} >> $CHECKPOINT_DIR/seen; "
                  f"while [ ! -e {d}/gate ]; do sleep 0.05; done; cat $CHECKPOINT_DIR/seen >> {d}/ran")
        job_id = client.submit(JobSpec(command=["/bin/sh", "-c", script], estimated_duration_s=60.0)).id
        wait_for(lambda: b.store.get(job_id).state == "running" and _lines(d / "started", job_id), 30,
                 "the job's process to run")
        b.kill("agent-node-a")
        wait_for(lambda: b.store.get(job_id).state in ("queued", "interrupted"), 30, "the node to be declared lost")
        b.restart("agent-node-a")
        wait_for(lambda: _lines(d / "started", job_id)[1:], 30, "attempt 2 to start")
        (d / "gate").touch()
        wait_for(lambda: b.store.get(job_id).state in ("succeeded", "failed", "cancelled"), CASE_TIMEOUT_S,
                 "the job to end")
        assert b.store.get(job_id).state == "succeeded"
        assert [e.to_state for e in b.store.events(job_id)] == [
            "submitted", "queued", "starting", "running", "interrupted", "queued", "starting", "running", "succeeded"]
        attempts = b.store.attempts(job_id)
        assert [(a.number, a.outcome, a.ended_at is not None) for a in attempts] == [(1, "lost", True),
                                                                                     (2, "succeeded", True)]
        assert [(u.attempt, u.line) for u in _usage(b, job_id)] == [(1, "amortised"), (1, "energy"),
                                                                      (2, "amortised"), (2, "energy")]
        assert _lines(d / "started", job_id) == [f"{job_id} 1", f"{job_id} 2"]
        # once, by attempt 2, which found attempt 1's checkpoint: the rerun resumed from it
        assert d.joinpath("ran").read_text().splitlines() == [f"{job_id} 1", f"{job_id} 2"]
        wait_for(lambda: _local(b, job_id) == [], 15, "the agent to forget both attempts")
    except BaseException:
        print(b.logs())
        raise
    finally:
        b.stop()
