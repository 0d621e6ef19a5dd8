"""The node agent against the real API: real store (PostgreSQL), real planning cycle, real processes.

Each agent talks only to a live API server (uvicorn in a thread, :func:`broker.service.api.create_app`)
with its own node token, exactly as ``fedbroker serve agent`` does; the planning cycle is
stepped by hand.
"""

from __future__ import annotations

import ast
import time
from datetime import timedelta
from pathlib import Path

import pytest

from broker.service.store.tables import Job, utcnow
from broker.service.reconciler import Reconciler
from providers.nvml import FakeNvmlBackend
from tests.workers.rig import sh
from workers.agent import RENDEZVOUS_PORT, NodeAgent
from workers.node_client import NodeApiUnavailable, NodeClient
from workers.runtime import ProcessRuntime

REPO = Path(__file__).resolve().parents[2]


def test_job_succeeds_with_its_logs_and_attempt(pg_store, rig, tmp_path):
    rig = rig({"n1": 2})
    jid = pg_store.submit("ml", sh('echo out; echo err >&2; echo "$CUDA_VISIBLE_DEVICES $NODE_RANK $NNODES"'))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="success")
    j = pg_store.get(jid)
    assert j.exit_code == 0 and j.reason == "exit code 0"
    assert "".join(t for _, t in pg_store.log_chunks(jid, 1)) == "out\nerr\n0 0 1\n"
    [a] = pg_store.attempts(jid)
    assert (a.outcome, a.exit_code, a.gpus, a.nodes) == ("succeeded", 0, 1, [{"node": "n1", "gpus": [0], "rank": 0}])
    assert [e.to_state for e in pg_store.events(jid)] == ["submitted", "queued", "starting", "running", "succeeded"]
    assert rig.agents["n1"].runtime.list() == []  # reported and forgotten


def test_failing_command_fails_the_job_with_its_exit_code(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh("exit 3"))[0].id
    rig.until(lambda: rig.state(jid) == "failed", what="failure")
    j = pg_store.get(jid)
    assert (j.exit_code, j.reason) == (3, "exit code 3 on n1")
    assert pg_store.attempts(jid)[0].outcome == "failed"


def test_two_node_gang_gets_the_rendezvous_environment(pg_store, rig, tmp_path):
    rig = rig({"n1": 2, "n2": 2})
    out = tmp_path / "ranks"
    # one file per rank: ranks run under uids of their own, and a job's files are private to its uid (umask 077)
    script = f'echo "$NODE_RANK $NNODES $MASTER_ADDR $MASTER_PORT $CUDA_VISIBLE_DEVICES $GPUS_PER_NODE" > {out}-$NODE_RANK'
    jid = pg_store.submit("ml", sh(script, gpus_per_node=2, nodes=2))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="gang success")
    placement = pg_store.get(jid).placement["nodes"]
    master = placement[0]["node"]
    got = [Path(f"{out}-{r}").read_text() for r in (0, 1)]
    assert got == [f"0 2 {master} {RENDEZVOUS_PORT} 0,1 2\n", f"1 2 {master} {RENDEZVOUS_PORT} 0,1 2\n"]


def test_a_failed_rank_stops_the_rest_of_the_gang(pg_store, rig, tmp_path):
    rig = rig({"n1": 1, "n2": 1})
    out = tmp_path / "term"
    script = (f'if [ "$NODE_RANK" = 1 ]; then exit 1; fi; trap "echo rank0 TERM >> {out}; exit 143" TERM; '
              'while true; do sleep 0.1; done')
    jid = pg_store.submit("ml", sh(script, nodes=2))[0].id
    rig.until(lambda: rig.state(jid) == "failed", what="the gang to fail")
    assert out.read_text() == "rank0 TERM\n"
    assert pg_store.get(jid).reason == "ranks ended with {'0': 143, '1': 1}" or \
        pg_store.get(jid).reason == "ranks ended with {'1': 1, '0': 143}"


def test_cancel_reaches_the_process_with_sigterm(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh("trap 'echo got TERM; exit 0' TERM; echo up; while true; do sleep 0.1; done"))[0].id
    rig.until(lambda: rig.state(jid) == "running" and pg_store.log_chunks(jid, 1), what="the job to run")
    assert pg_store.request_cancel(jid, "ml").cancel_requested
    rig.until(lambda: rig.state(jid) == "cancelled", what="cancellation")
    log = "".join(t for _, t in pg_store.log_chunks(jid, 1))
    # SIGTERM goes to the job's whole process group: the shell also reports its `sleep` "Terminated"
    assert log.startswith("up\n") and log.endswith("got TERM\n")
    assert pg_store.attempts(jid)[0].outcome == "cancelled"


def test_a_running_agent_starts_new_work_at_once_through_the_long_poll(pg_store, rig, tmp_path, monkeypatch):
    """With its loop ticking only every 30 s, a started agent (threads) still runs a job placed on its
    node within about a second: the work watcher's long-poll of GET /v1/node/work sees the placement
    and wakes the loop (before: up to SUPERVISE_S = 0.5 s of polling delay)."""
    import workers.agent as agent_mod

    monkeypatch.setattr(agent_mod, "SUPERVISE_S", 30.0)
    rig = rig({"n1": 1})
    a = rig.agents["n1"]
    a.start()
    try:
        time.sleep(0.5)  # the first step ran; the watcher holds its long-poll
        jid = pg_store.submit("ml", sh("sleep 5"))[0].id
        rig.cycle.run()
        assert rig.state(jid) == "starting"
        t0 = time.monotonic()
        while rig.state(jid) != "running":
            assert time.monotonic() - t0 < 3.0, "the agent did not start the job within 3 s"
            time.sleep(0.02)
        assert time.monotonic() - t0 < 1.5
        # the cancel wakes the loop the same way (it then ticks every 0.5 s again to see the process end)
        monkeypatch.setattr(agent_mod, "SUPERVISE_S", 0.5)
        assert pg_store.request_cancel(jid, "ml").cancel_requested
        t1 = time.monotonic()
        while rig.state(jid) != "cancelled":
            assert time.monotonic() - t1 < 10.0, "the cancel did not reach the job"
            time.sleep(0.05)
    finally:
        a.stop()


def test_restarted_agent_readopts_a_running_job(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    out = tmp_path / "ran"
    jid = pg_store.submit("ml", sh(f"sleep 1.5; echo once >> {out}"))[0].id
    rig.until(lambda: rig.state(jid) == "running", what="running")
    rig.agents["n1"] = rig.new_agent("n1")  # the old agent is gone (as after kill -9)
    rig.until(lambda: rig.state(jid) == "succeeded", what="success after restart")
    assert out.read_text() == "once\n"
    assert len(pg_store.attempts(jid)) == 1


def test_a_lost_gpu_receives_no_work(pg_store, rig, tmp_path):
    rig = rig({"n1": 2})
    rig.backends["n1"].lose_gpu(0)
    rig.agents["n1"].heartbeat()
    [node] = pg_store.nodes()
    assert node.healthy_gpus == [1] and node.telemetry["gpus"][0]["healthy"] is False
    a = pg_store.submit("ml", sh("sleep 1"))[0].id
    b = pg_store.submit("ml", sh("sleep 1"))[0].id
    rig.step()
    placed = [pg_store.get(x).placement for x in (a, b)]
    assert [p["nodes"][0]["gpus"] for p in placed if p] == [[1]]


def test_stale_attempt_on_a_node_back_from_the_dead_is_stopped(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    out = tmp_path / "ran"
    jid = pg_store.submit("ml", sh(f'sleep 3; echo "$FEDBROKER_ATTEMPT" >> {out}'))[0].id
    rig.until(lambda: rig.state(jid) == "running", what="running")
    # the node looks silent to the reconciler (a network partition): its job is requeued
    out_rec = Reconciler(pg_store, rig.settings).run(utcnow() + timedelta(seconds=rig.settings.node_lost_after_s + 1))
    assert out_rec["requeued"] == 1 and rig.state(jid) == "queued"
    # the agent is still there: it stops the stale attempt 1; the job then runs as attempt 2
    rig.until(lambda: rig.state(jid) == "succeeded", timeout=30, what="attempt 2 to succeed")
    assert out.read_text() == "2\n"
    outcomes = [a.outcome for a in pg_store.attempts(jid)]
    assert outcomes == ["lost", "succeeded"]


def test_high_priority_job_preempts_a_preemptible_one(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    low = pg_store.submit("ml", sh("trap 'exit 143' TERM; while true; do sleep 0.1; done", preemptible=True,
                                  priority_class="low", estimated_duration_s=7200.0))[0].id
    rig.until(lambda: rig.state(low) == "running", what="the low job to run")
    time.sleep(0.1)
    high = pg_store.submit("ml", sh("echo urgent", priority_class="critical", estimated_duration_s=600.0,
                                    deadline=utcnow() + timedelta(minutes=20)))[0].id
    with pg_store.session() as s:  # the low job has run for 1 h (past min_run_before_preempt_s, 30 min)
        s.get(Job, low).started_at = utcnow() - timedelta(hours=1)
    rig.until(lambda: rig.state(high) == "succeeded", timeout=30, what="the critical job to run")
    states = [e.to_state for e in pg_store.events(low)]
    # the request is recorded as an event without a state change, then the agent stops the process
    assert states[:7] == ["submitted", "queued", "starting", "running", "running", "interrupted", "queued"]
    ev = pg_store.events(low)
    assert ev[4].reason == f"preemption requested for {high}"
    assert ev[5].reason == "preempted by a higher-priority job"
    assert pg_store.attempts(low)[0].outcome == "interrupted"


def test_losing_one_node_of_a_gang_tears_down_every_node(pg_store, rig, tmp_path):
    rig = rig({"n1": 1, "n2": 1})
    out = tmp_path / "ended"
    # one file per rank: ranks run under uids of their own, and a job's files are private to its uid (umask 077)
    script = f'trap "echo $NODE_RANK stopped > {out}-$NODE_RANK; exit 143" TERM; while true; do sleep 0.1; done'
    jid = pg_store.submit("ml", sh(script, nodes=2, estimated_duration_s=3600.0))[0].id
    rig.until(lambda: rig.state(jid) == "running", what="the gang to run")
    rig.until(lambda: len(rig.agents["n1"].runtime.list()) == 1 and len(rig.agents["n2"].runtime.list()) == 1,
              what="both ranks to run")
    # n2 falls silent (its agent is gone with the host; its rank keeps running like a hung process)
    lost_agent = rig.agents.pop("n2")
    later = utcnow() + timedelta(seconds=rig.settings.node_lost_after_s + 1)
    rig.agents["n1"].heartbeat()
    with pg_store.session() as s:  # n1 stays fresh at the reconciler's clock
        from broker.service.store.tables import Node

        s.get(Node, "n1").last_heartbeat_at = later
    out_rec = Reconciler(pg_store, rig.settings).run(later)
    assert out_rec["lost_nodes"] == 1 and out_rec["requeued"] == 1
    # n1's agent stops its rank: the attempt is no longer the job's
    end = time.monotonic() + 10
    while time.monotonic() < end and rig.agents["n1"].runtime.list():
        rig.agents["n1"].supervise_once()
        time.sleep(0.05)
    assert rig.agents["n1"].runtime.list() == []
    assert Path(f"{out}-0").read_text() == "0 stopped\n" and not Path(f"{out}-1").exists()
    # and when the lost host's agent comes back, it stops its stale rank too
    end = time.monotonic() + 10
    while time.monotonic() < end and lost_agent.runtime.list():
        lost_agent.supervise_once()
        time.sleep(0.05)
    assert Path(f"{out}-1").read_text() == "1 stopped\n"
    assert pg_store.attempts(jid)[0].outcome == "lost"


def test_agent_survives_an_api_outage_and_reports_after(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    out = tmp_path / "ran"
    jid = pg_store.submit("ml", sh(f"echo before; sleep 1.5; echo after; echo done >> {out}"))[0].id
    rig.until(lambda: rig.state(jid) == "running" and pg_store.log_chunks(jid, 1), what="the job to run")
    rig.api.stop()  # the API is down: the agent must neither stop the job nor lose its end
    agent = rig.agents["n1"]
    end = time.monotonic() + 4.0
    while time.monotonic() < end:
        agent.supervise_once()  # never raises for an outage
        time.sleep(0.05)
    [local] = agent.runtime.list()
    assert (local.status, local.exit_code) == ("exited", 0)  # it ran to its end meanwhile
    assert out.read_text() == "done\n" and rig.state(jid) == "running"  # nothing reported yet
    rig.api.start()  # same port: reports are delivered after the back-off
    rig.until(lambda: rig.state(jid) == "succeeded", timeout=30, what="the end to be reported")
    assert "".join(t for _, t in pg_store.log_chunks(jid, 1)) == "before\nafter\n"
    assert [a.outcome for a in pg_store.attempts(jid)] == ["succeeded"]
    assert agent.runtime.list() == []


def test_a_job_that_prints_a_nul_byte_succeeds_and_its_node_stays_up(pg_store, rig, tmp_path):
    """Found by a hostile review: the log upload of ``printf 'a\\000b'`` answered 500 forever (PostgreSQL text
    holds no NUL), the agent retried it every step without heartbeating, and its node was declared lost."""
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh(r"printf 'a\000b\n'"))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="success")
    assert "".join(t for _, t in pg_store.log_chunks(jid, 1)) == "a\ufffdb\n"


def test_a_log_cut_into_chunks_keeps_every_character(pg_store, rig, tmp_path):
    """40,000 "€" (3 bytes each) without a newline: 64 KiB chunks cut characters in half, and each chunk was
    decoded alone (three U+FFFD in the log; found by a hostile review)."""
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh("python3 -c \"import sys; sys.stdout.write('\u20ac' * 40000)\""))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="success")
    chunks = pg_store.log_chunks(jid, 1)
    assert len(chunks) >= 2 and "".join(t for _, t in chunks) == "\u20ac" * 40000


def test_a_progress_bar_redrawn_with_carriage_returns_is_shipped_while_it_runs(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh(r"printf '10%%\r20%%\r'; sleep 30"))[0].id
    rig.until(lambda: "".join(t for _, t in pg_store.log_chunks(jid, 1)) == "10%\r20%\r", what="the progress")
    assert rig.state(jid) == "running"
    pg_store.request_cancel(jid, "ml")
    rig.until(lambda: rig.state(jid) == "cancelled", what="the cancel")  # leaves no process behind


def test_a_report_the_api_keeps_failing_does_not_stop_heartbeats(pg_store, rig, tmp_path, monkeypatch):
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh("echo hi"))[0].id
    agent = rig.agents["n1"]

    def fail(*_a):
        raise NodeApiUnavailable("node API: 500 Internal Server Error", 500)

    monkeypatch.setattr(agent.api, "log", fail)
    rig.until(lambda: rig.state(jid) == "running" and not agent.runtime.list()[0].status == "running",
              what="the job to end")
    seen = pg_store.nodes()[0].last_heartbeat_at
    end = time.monotonic() + 3.0  # the back-off after each failed step: 0.5, 1, 2 s
    while time.monotonic() < end:
        rig.step()
        time.sleep(0.05)
    assert pg_store.nodes()[0].last_heartbeat_at > seen  # the failing log upload is retried, the node heartbeats
    assert rig.state(jid) == "running"  # its end waits for its log (nothing lost)
    monkeypatch.undo()
    rig.until(lambda: rig.state(jid) == "succeeded", timeout=30, what="the end to be reported")
    assert "".join(t for _, t in pg_store.log_chunks(jid, 1)) == "hi\n"


def test_workers_import_nothing_that_holds_broker_secrets():
    forbidden = ("broker.service.store.core", "broker.service.store.tables", "broker.service.settings", "broker.service.tasks", "broker.service.celery_app",
                 "broker.service.reconciler", "broker.service.attempts", "sqlalchemy", "redis", "celery", "kombu")
    found = []
    for f in sorted((REPO / "workers").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(f.name, n) for n in names if n.split(".")[0] in forbidden or n in forbidden
                      or any(n.startswith(x + ".") for x in forbidden)]
    assert found == []
    # and at run time: the agent's whole import graph loads none of them
    import subprocess
    import sys

    code = ("import sys, workers.agent, workers.node_client, providers.nvml, broker.model; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {('sqlalchemy', 'redis', 'celery', 'kombu')!r} "
            "or m in ('broker.service.store.core', 'broker.service.store.tables', 'broker.service.settings')))")
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "[]"


def test_an_agent_with_another_nodes_token_does_nothing(pg_store, rig, caplog):
    rig = rig({"n1": 1})
    wrong = NodeAgent(NodeClient(rig.api.url, rig.tokens["n1"]), "n9", "local", FakeNvmlBackend(gpu_count=1),
                      state_dir=rig.tmp / "state", runtime=ProcessRuntime(rig.tmp / "state" / "agents" / "n9"))
    wrong.supervise_once()
    assert "the node token names node 'n1', not --name='n9'" in caplog.text
    assert [n.name for n in pg_store.nodes()] == ["n1"]


def test_an_attempt_past_its_time_limit_is_stopped_and_fails_saying_so(pg_store, rig, tmp_path):
    """Issue #20 (finding: a job that said ``estimated_duration_s: 1`` held 4 GPUs for 150 s): the agent stops an
    attempt at its ``time_limit_s`` (SIGTERM, then SIGKILL after ``cancel_grace_s``) and the job fails with the
    reason. On cb5ea98 the spec is refused (no ``time_limit_s`` field), and nothing stopped a job at its
    estimate: this one would run its 60 s loop past the test's 20 s wait."""
    rig = rig({"n1": 1})
    out = tmp_path / "term"
    jid = pg_store.submit("ml", sh(f"trap 'echo TERM >> {out}; exit 0' TERM; i=0; while [ $i -lt 600 ]; do sleep 0.1; "
                                   "i=$((i+1)); done", estimated_duration_s=1.0, time_limit_s=1.5))[0].id
    rig.until(lambda: rig.state(jid) == "failed", timeout=20.0, what="the time limit to stop the job")
    j = pg_store.get(jid)
    # the job caught SIGTERM and exited 0: a time limit is still a failure (as Slurm's TIMEOUT)
    assert j.reason.startswith("time limit of 1.5 s exceeded (ran ") and j.reason.endswith("; exit code 0 on n1")
    assert (j.exit_code, out.read_text()) == (0, "TERM\n")
    [a] = pg_store.attempts(jid)
    assert a.outcome == "failed" and a.reason.startswith("time limit of 1.5 s exceeded")
    assert (a.ended_at - a.started_at).total_seconds() < 10.0  # stopped at 1.5 s, not after the loop's 60 s


def test_the_default_time_limit_is_the_estimate_with_the_slurm_slack(pg_store, rig, tmp_path):
    """Without ``time_limit_s`` the limit is ``estimate x 1.2 + 300 s`` (providers.base.pool_time_limit_s, the
    Slurm and Kubernetes pools' default): here 1 s -> 301.2 s, so a short job that overruns 1 s is left alone."""
    from providers.base import pool_time_limit_s

    assert pool_time_limit_s(1.0) == pytest.approx(301.2)
    assert pool_time_limit_s(600.0, time_limit_s=90) == 90.0
    with pytest.raises(ValueError, match="time_limit_s=0"):
        pool_time_limit_s(600.0, time_limit_s=0)
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh("sleep 2", estimated_duration_s=1.0))[0].id
    rig.until(lambda: pg_store.get(jid).done, timeout=60.0, what="the job to end")
    j = pg_store.get(jid)
    assert (j.state, j.reason) == ("succeeded", "exit code 0")  # past its estimate, inside the default limit
