"""The small CLI items of issue 20, with typer's CliRunner against a threaded API server over real PostgreSQL:
GPU health as ``1/1 healthy``, tables that fit ``COLUMNS``, a readable placement for every runtime, bulk
``cancel``, ``logs --tail/--follow`` and "has no output"."""

from __future__ import annotations

import threading
import uuid

import pytest
from typer.testing import CliRunner

from broker.cli import jobs as cli_jobs
from broker.cli import main as cli
from broker.cli.jobs import last_lines, placement_text
from broker.cli.nodes import healthy_text
from broker.model import Decision, DecisionKind, JobSpec, OptionEstimate
from broker.service.api import create_app
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def server(store):
    with ServerThread(create_app(store)) as srv:
        yield srv


@pytest.fixture
def run(server, store):
    """``run(*args, columns=200) -> Result``: ``fedbroker`` as a fresh team (``run.team``) at ``COLUMNS``."""
    team = "t" + uuid.uuid4().hex[:10]
    token = create_token(store, team).token
    runner = CliRunner()

    def invoke(*args, columns: int = 200, as_token: str | None = None):
        return runner.invoke(cli.app, list(args), env={"FEDBROKER_API_URL": server.url,
                                                        "FEDBROKER_TOKEN": as_token or token,
                                                        "FEDBROKER_CONFIG": None, "COLUMNS": str(columns)})

    invoke.team = team
    return invoke


def _running(store, team: str, name: str = "x", placement: dict | None = None) -> str:
    j, _ = store.submit(team, JobSpec(name=name, command=["true"], gpus_per_node=1))
    for st in ("queued", "starting", "running"):
        extra = {"attempt": 1, "placement": placement} if st == "starting" else {}
        assert store.transition(j.id, st, f"test: {st}", **extra)
    return j.id


# ----------------------------------------------------------------------------- "1/1 healthy"
def test_healthy_text_counts_healthy_gpus_of_all():
    assert healthy_text([0], [0]) == "1/1 healthy"  # was "0": read as zero healthy GPUs
    assert healthy_text([0, 1, 3], range(4)) == "3/4 healthy, GPU 2 not"
    assert healthy_text([1], range(4)) == "1/4 healthy, GPUs 0,2,3 not"
    assert healthy_text([], [0, 1]) == "0/2 healthy"


def test_nodes_probe_and_list_show_the_healthy_count(run, store):
    r = run("nodes", "probe", "--nvml", "fake", "--fake-gpus", "1")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == "backend fake; driver fake; CUDA -; 1 GPU(s); type V100; 1/1 healthy"
    node = "n" + uuid.uuid4().hex[:8]
    store.heartbeat(node, "local", "H200", 4, 141.0, [0, 1, 3], "agent-1")
    r = run("nodes", "list", as_token=create_token(store, "ops", "admin").token)  # members see capacity only
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if node in line)
    assert row.split("│")[:5] == [f" {node} ", " local ", " 4 x H200 141 GB ", " 3/4 healthy, GPU 2 not ", " up    "]


# ----------------------------------------------------------------------------- tables that fit COLUMNS
LONG_REASON = "waiting for on-prem capacity: no node of pool local has 4 free GPUs of type V100 or A100 (best: 2 free)"


def test_list_fits_80_and_200_columns_one_line_per_job(run, store):
    for _ in range(2):  # nodes that can hold the 2 x 4-GPU job, so its row carries no "no node can hold" warning
        store.heartbeat("n" + uuid.uuid4().hex[:8], "local", "V100", 4, 16.0, [0, 1, 2, 3], "agent-1")
    j, _ = store.submit(run.team, JobSpec(name="resnet-nightly-" + "x" * 40, command=["true"], gpus_per_node=4,
                                          nodes=2))
    assert store.transition(j.id, "queued", LONG_REASON)
    job = store.get(j.id)
    deadline = job.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
    submitted = job.created_at.strftime("%Y-%m-%dT%H:%M:%SZ")

    narrow = run("list", columns=80)
    assert narrow.exit_code == 0, narrow.output
    lines = narrow.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) == 4  # title, header, rule, one row: nothing wraps
    assert lines[3] == f" {j.id} │ resnet-nightly-xx… │ queued │ 2x4  │ waiting for on-pr… "
    assert lines[1].split() == ["id", "┃", "name", "┃", "state", "┃", "gpus", "┃", "reason"]

    wide = run("list", columns=200)
    lines = wide.stdout.splitlines()
    assert max(map(len, lines)) <= 200 and len(lines) == 4
    # the two long cells share what the others leave (200 - 150), each cut to 48 columns with its ellipsis
    assert lines[3] == (f" {j.id} │ {run.team} │ resnet-nightly-{'x' * 32}… │ queued │ 2x4  │ {submitted} │ "
                        f"{deadline} │ {LONG_REASON[:47]}… ")


def test_list_says_when_it_was_cut_at_the_limit(run, store):
    """New-user note of 2026-12-04: ``list`` showed 50 of 60 jobs and did not say so."""
    ids = [store.submit(run.team, JobSpec(name=f"j{i}", command=["true"]))[0].id for i in range(3)]
    cut = run("list", "--limit", "2")
    assert cut.exit_code == 0, cut.output
    assert cut.stdout.splitlines()[-1] == ("showing the newest 2 jobs; more match (--limit up to 1000, --state, --name, "
                                           "--team)")
    assert ids[0] not in cut.stdout and ids[2] in cut.stdout and ids[1] in cut.stdout
    whole = run("list", "--limit", "3")
    assert "more match" not in whole.stdout and all(i in whole.stdout for i in ids)
    assert len(__import__("json").loads(run("list", "--limit", "2", "--json").stdout)) == 2
    named = run("list", "--name", "j1")
    assert ids[1] in named.stdout and ids[0] not in named.stdout and ids[2] not in named.stdout


def test_explain_fits_80_columns(run, store):
    j, _ = store.submit(run.team, JobSpec(command=["true"], gpus_per_node=8))
    chosen = OptionEstimate("onprem", "toronto", 1.7e9, 0.0, 3600.0, 2.85, 3.12, 0.094, 2.87)
    alt = OptionEstimate("cloud", "aws:us-east-1a:p3.16xlarge:spot", 1.7e9, 300.0, 3600.0, 7.34, 2.6, 1.01, 7.53)
    rec = Decision(j.id, DecisionKind.start, chosen, pool="toronto", alternatives=(alt,), reason=LONG_REASON).record()
    store.transition(j.id, "queued", LONG_REASON, decision=rec)
    for columns in (80, 200):
        r = run("explain", j.id, columns=columns)
        assert r.exit_code == 0, r.output
        assert max(map(len, r.stdout.splitlines())) <= columns
    assert max(map(len, run("explain", j.id, columns=200).stdout.splitlines())) > 80  # 200 is used, not 80


# ----------------------------------------------------------------------------- a readable placement
@pytest.mark.parametrize("placement, text", [
    ({"kind": "onprem", "pool": "local", "gpu_type": "H200", "nodes": [{"node": "gpu-a", "gpus": [0, 1], "rank": 0}]},
     "on-prem pool local (H200): gpu-a[0,1]"),
    ({"kind": "slurm", "pool": "hpc", "gpu_type": "A100", "scheduler_gpu_type": "a100",
      "nodes": [{"node": "n1", "gpus": [0, 1, 2, 3], "rank": 0}, {"node": "n2", "gpus": [0, 1, 2, 3], "rank": 1}]},
     "Slurm pool hpc (A100): n1[0,1,2,3], n2[0,1,2,3]; scheduler gpu type a100"),
    ({"kind": "cloud", "provider": "aws", "offer_id": "aws:us-east-1a:p3.16xlarge:spot", "region": "us-east-1",
      "zone": "us-east-1a", "instance_type": "p3.16xlarge", "market": "spot", "gpu_type": "V100",
      "nodes": [{"rank": 0, "instance_id": "i-0abc", "zone": "us-east-1a", "private_ip": "10.0.0.5",
                 "node": "aws/i-0abc"}]},
     "cloud offer aws:us-east-1a:p3.16xlarge:spot (V100): rank 0 aws/i-0abc (10.0.0.5)"),
    ({"kind": "batch", "queue": "gpu", "extra": {"a": [1, 2]}}, 'batch; queue gpu; extra {"a":[1,2]}'),
    (None, "-"),
])
def test_placement_text_of_every_runtime(placement, text):
    assert placement_text(placement) == text


def test_status_of_a_slurm_job_prints_no_python_dict(run, store):
    pl = {"kind": "slurm", "pool": "hpc", "gpu_type": "A100", "scheduler_gpu_type": "a100",
          "nodes": [{"node": "n1", "gpus": [0, 1], "rank": 0}]}
    jid = _running(store, run.team, placement=pl)
    r = run("status", jid)
    assert r.exit_code == 0, r.output
    assert "  placement: Slurm pool hpc (A100): n1[0,1]; scheduler gpu type a100\n" in r.stdout
    r = run("cancel", jid)
    assert r.stdout == f"{jid} running: cancel requested, the broker cancels it in its Slurm cluster\n"


# ----------------------------------------------------------------------------- bulk cancel
def test_cancel_all_state_name_in_one_request(run, store):
    ids = [store.submit(run.team, JobSpec(name=n, command=["true"]))[0].id for n in ("a", "a", "b")]
    running = _running(store, run.team, name="a")
    other = "o" + uuid.uuid4().hex[:10]
    theirs = store.submit(other, JobSpec(name="a", command=["true"]))[0].id
    r = run("cancel", "--name", "a", "--state", "submitted")
    assert (r.exit_code, r.stdout) == (0, f"team {run.team}: 2 job(s) cancelled, 0 running job(s) asked to stop\n")
    r = run("cancel", "--all")
    assert (r.exit_code, r.stdout) == (0, f"team {run.team}: 1 job(s) cancelled, 1 running job(s) asked to stop\n")
    assert [store.get(i).state for i in ids] == ["cancelled"] * 3 and store.get(running).cancel_requested
    assert store.get(theirs).state == "submitted"  # another team's job of the same name
    r = run("cancel", "--all", "--team", other)
    assert r.exit_code == 1 and f"team={other!r}: your token belongs to team {run.team!r}" in r.stderr
    assert store.get(theirs).state == "submitted"


@pytest.mark.parametrize("args, message", [
    ((), "give a JOB_ID, or --all, --state or --name to cancel many jobs"),
    (("job-0123456789abcdef", "--all"), "JOB_ID='job-0123456789abcdef' with --all/--state/--name/--team: give a job "
                                        "id or a filter, not both"),
    (("--state", "succeeded"), "--state='succeeded': a succeeded job cannot be cancelled; the unfinished states are "
                               "submitted, queued, deferred, provisioning, starting, running, interrupted"),
])
def test_cancel_usage_errors_exit_2(run, args, message):
    r = run("cancel", *args)
    assert r.exit_code == 2 and r.stdout == ""
    assert " ".join(r.stderr.split()) == f"error: {message}"


# ----------------------------------------------------------------------------- logs --tail / --follow
def test_last_lines():
    assert last_lines("a\nb\nc\n", 2) == "b\nc\n"
    assert last_lines("a\nb", 1) == "b"
    assert last_lines("a\n", 5) == "a\n"
    assert last_lines("a\nb\n", 0) == ""


def test_logs_tail_and_a_finished_job_without_output(run, store):
    jid = _running(store, run.team)
    store.append_log(jid, 1, 0, 0, "1\n2\n3\n")
    store.append_log(jid, 1, 0, 1, "4\n5")
    r = run("logs", jid, "--tail", "2")
    assert (r.exit_code, r.stdout) == (0, "4\n5\n")
    assert run("logs", jid, "--tail", "-1").exit_code == 2

    quiet = _running(store, run.team)
    r = run("logs", quiet)
    assert r.stderr == f"{quiet}: attempt 1 rank 0 has no log yet\n"  # still running: it may write
    assert store.transition(quiet, "succeeded", "exit code 0", exit_code=0)
    r = run("logs", quiet)
    assert (r.exit_code, r.stdout) == (0, "")
    assert r.stderr == f"{quiet}: attempt 1 rank 0 has no output (the job is succeeded)\n"


def test_logs_follow_prints_each_byte_once_until_the_job_ends(run, store, monkeypatch):
    monkeypatch.setattr(cli_jobs, "FOLLOW_POLL_S", 0.05)
    jid = _running(store, run.team)
    store.append_log(jid, 1, 0, 0, "old 1\nold 2\nold 3\n")
    first_poll = threading.Event()
    real_log_chunks = store.log_chunks

    def log_chunks(*args, **kwargs):  # the follower's first read of the log releases the writer below
        chunks = real_log_chunks(*args, **kwargs)
        first_poll.set()
        return chunks

    monkeypatch.setattr(store, "log_chunks", log_chunks)

    def job_writes_then_ends():
        first_poll.wait(30)
        store.append_log(jid, 1, 0, 1, "step 1\n")
        store.append_log(jid, 1, 0, 2, "step 2 \x1b[2J\n")
        store.append_log(jid, 1, 0, 3, "done")
        store.transition(jid, "succeeded", "exit code 0", exit_code=0)

    writer = threading.Thread(target=job_writes_then_ends)
    writer.start()
    try:
        r = run("logs", jid, "--follow", "--tail", "1")
    finally:
        writer.join(30)
    assert r.exit_code == 0, r.output
    assert r.stdout == "old 3\nstep 1\nstep 2 \\x1b[2J\ndone\n"  # the tail, then only the new text, escaped
    assert r.stderr == f"{jid}: succeeded (exit code 0)\n"


def test_logs_follow_stops_cleanly_on_ctrl_c(run, store, monkeypatch):
    jid = _running(store, run.team)
    store.append_log(jid, 1, 0, 0, "epoch 1\n")

    def interrupt(_s):
        raise KeyboardInterrupt

    monkeypatch.setattr("broker.client.time.sleep", interrupt)  # Ctrl-C while waiting for the next poll
    r = run("logs", jid, "--follow")
    assert r.exit_code == 130
    assert r.stdout == "epoch 1\n\n" and r.stderr == f"{jid}: stopped following (the job runs on)\n"
    assert store.get(jid).state == "running"


def test_logs_follow_of_a_job_that_ended_without_output(run, store):
    jid = _running(store, run.team)
    assert store.transition(jid, "failed", "exit code 3", exit_code=3)
    r = run("logs", jid, "--follow")
    assert (r.exit_code, r.stdout) == (0, "")
    assert r.stderr == f"{jid}: attempt 1 rank 0 has no output (the job is failed)\n"
