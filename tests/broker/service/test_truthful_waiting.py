"""Issue #20, "truthful waiting": what ``explain``, ``status`` and ``submit`` say about a job that waits, on a real
store (PostgreSQL) with the real planning cycle, and the CLI through typer's CliRunner against a live API."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from broker.cli import console as cli_console
from broker.cli import main as cli
from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.cycle import PlanningCycle
from broker.service.live import LiveEnvironment
from broker.service.settings import BrokerSettings
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread


@pytest.fixture(scope="module")
def env():
    return LiveEnvironment(BrokerSettings().planner)


@pytest.fixture
def cli_run(pg_store, monkeypatch):
    """``cli_run(team, *args) -> Result``: ``fedbroker`` as a member of ``team`` against a live API over ``pg_store``."""
    monkeypatch.setattr(cli_console, "console", Console(width=400, force_terminal=False, color_system=None))
    tokens: dict[str, str] = {}
    with ServerThread(create_app(pg_store)) as srv:
        def invoke(team: str, *args):
            tok = tokens.setdefault(team, create_token(pg_store, team).token)
            return CliRunner().invoke(cli.app, list(args), env={"FEDBROKER_API_URL": srv.url, "FEDBROKER_TOKEN": tok,
                                                                "FEDBROKER_CONFIG": None})
        yield invoke


def _spec(**kw) -> JobSpec:
    kw.setdefault("command", ["true"])
    kw.setdefault("estimated_duration_s", 600.0)
    return JobSpec(**kw)


def test_explain_shows_the_latest_decision_of_every_kind_with_its_reason(pg_store, env, cli_run):
    """On cb5ea98 ``explain`` said "no planner decision yet (the planner has not seen this job)" right under the
    reason the planner wrote for a job nothing could hold, and a started job's record forgot that it had waited."""
    pg_store.heartbeat("n1", "local", "V100", 2, 16.0, [0, 1], "agent-1")
    cyc = PlanningCycle(pg_store, env, BrokerSettings())
    first = pg_store.submit("ml", _spec(gpus_per_node=2))[0].id
    second = pg_store.submit("ml", _spec(gpus_per_node=2))[0].id
    huge = pg_store.submit("ml", _spec(gpus_per_node=8))[0].id  # no live node has 8 GPUs
    cyc.run()
    assert [pg_store.get(j).state for j in (first, second, huge)] == ["starting", "queued", "queued"]
    # the first job ends: its GPUs are free again, the second job starts
    assert pg_store.transition(first, "running", "running on n1")
    assert pg_store.transition(first, "succeeded", "exit code 0")
    cyc.run()
    assert pg_store.get(second).state == "starting"

    ex = pg_store.decision(second)
    assert ex["kind"] == "start" and list(ex["earlier"]) == ["wait"]
    assert ex["earlier"]["wait"]["reason"].startswith("wait in the on-prem queue; waiting for 2 GPU(s) in pool local; "
                                                      "expected start ")
    r = cli_run("ml", "explain", second)
    assert r.exit_code == 0, r.output
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    kinds = [ln.split(" ")[1].rstrip(":") for ln in lines[lines.index("latest decision of each kind:") + 1:][:3]]
    assert kinds == ["start", "wait", "intake"], r.stdout
    assert any(" wait on local from " in ln and "Z: wait in the on-prem queue; waiting for 2 GPU(s) in pool local; " in ln
               for ln in lines)
    assert any(ln.endswith(" intake: accepted") for ln in lines)
    assert any(" start on local from " in ln and ln.endswith(": placed on pool local: n1 GPUs [0, 1] (attempt 1)")
               for ln in lines)

    r = cli_run("ml", "explain", huge)
    assert r.exit_code == 0, r.output
    assert "no planner decision yet" not in r.stdout
    why = pg_store.get(huge).reason
    assert why.startswith("no live pool can hold it now and no cloud provider is configured")
    assert f"undecided: {why}" in r.stdout.replace("\n", "")
    assert pg_store.decision(huge)["kind"] == "undecided"


def test_an_expected_start_that_has_passed_is_worked_out_again(pg_store, env):
    """On cb5ea98 a waiting job said "expected start 02:38:22 (in 1 s)" for minutes, in the past, behind a job that
    outran its estimate: the wait decision was not reviewed until its review time, and a running job past its
    estimate was expected to end "now + 1 s". Now the job is reviewed once its expected start has passed, and the
    job ahead holds its GPUs until its time limit at the latest (600 s x 1.2 + 300 s = 1,020 s after its start)."""
    from datetime import datetime, timedelta, timezone

    from broker.model import wait_text
    from broker.service.store.tables import Job

    now = datetime.now(timezone.utc).replace(microsecond=0)
    t0 = now - timedelta(seconds=700)
    pg_store.heartbeat("n1", "local", "V100", 2, 16.0, [0, 1], "agent-1")
    cyc = PlanningCycle(pg_store, env, BrokerSettings())
    ahead = pg_store.submit("ml", _spec(gpus_per_node=2), now=t0)[0].id
    behind = pg_store.submit("ml", _spec(gpus_per_node=2), now=t0 + timedelta(seconds=1))[0].id
    cyc.run(now=t0 + timedelta(seconds=1))
    assert pg_store.get(ahead).state == "starting", pg_store.get(ahead).reason
    first = pg_store.get(behind).reason
    assert f"expected start {(t0 + timedelta(seconds=601)).isoformat()} (in 10.0 min)" in first
    assert pg_store.transition(ahead, "running", "running on n1")
    with pg_store.session() as s:
        s.get(Job, ahead).started_at = t0  # it has run 700 s of its 600 s estimate
    cyc.run(now=now)
    kill = t0 + timedelta(seconds=1020)
    again = pg_store.get(behind)
    assert again.state == "queued"
    assert f"expected start {kill.isoformat()} (in {wait_text(320.0)})" in again.reason, again.reason
    assert pg_store.decision(behind)["option"]["start_s"] == kill.timestamp()


def _api(pg_store):
    from fastapi.testclient import TestClient

    client = TestClient(create_app(pg_store))
    return client, {"Authorization": f"Bearer {create_token(pg_store, 'ml').token}"}


def test_a_job_no_registered_node_can_ever_hold_is_refused_at_submit_naming_the_field(pg_store):
    """On cb5ea98 an 8-GPU job on a 4-GPU host was accepted and waited silently until its 12 h deadline. With a
    node registered (the broker's whole capacity: no cloud provider, no scheduler pool in the bundled cluster
    file), it is now a 422 naming the field and the value; before any node registers it is accepted with a warning."""
    client, h = _api(pg_store)
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "gpus_per_node": 8}}, headers=h)
    assert r.status_code == 201, r.text
    assert r.json()["warnings"] == ["no node has registered yet: the broker cannot tell whether any will hold "
                                    "1 x 8 any GPU(s); it waits until one that fits heartbeats"]
    pg_store.heartbeat("local-0", "local", "V100", 4, 16.0, [0, 1, 2, 3], "agent-1")
    cases = [({"gpus_per_node": 8}, "spec.gpus_per_node", 8,
              "the largest has 4 x V100 16 GB (local-0, pool local)"),
             ({"gpu_types": ["A100"]}, "spec.gpu_types", ["A100"], "the nodes have GPU types ['V100']"),
             ({"min_gpu_memory_gb": 40}, "spec.min_gpu_memory_gb", 40.0,
              "the largest has 4 x V100 16 GB (local-0, pool local)"),
             ({"nodes": 2}, "spec.nodes", 2, "at most 1 node(s) of one pool and GPU type hold a rank (V100 in pool "
                                              "local; a gang runs on one pool and one GPU type)")]
    for extra, field, value, why in cases:
        r = client.post("/v1/jobs", json={"spec": {"command": ["true"], **extra}}, headers=h)
        assert r.status_code == 422, r.text
        [d] = r.json()["detail"]
        assert d["loc"] == ["body", *field.split(".")], d
        assert d["msg"] == (f"{field}={value!r}: no registered node can ever hold this job (1 node(s) known; no "
                            f"cloud provider or scheduler pool): {why}"), d["msg"]
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "gpus_per_node": 4}}, headers=h)
    assert r.status_code == 201 and r.json()["warnings"] == [], r.text


def test_an_infeasible_deadline_is_warned_at_submit_flagged_in_status_and_list_and_in_the_decision(
        pg_store, env, cli_run, tmp_path):
    """On cb5ea98 a job whose deadline could not be met was accepted without a word, ``status`` never flagged it
    (nor a job running past its deadline), and the decision said "best score: on-prem now"."""
    from datetime import datetime, timedelta, timezone

    from broker.service.store.tables import Job

    pg_store.heartbeat("local-0", "local", "V100", 4, 16.0, [0, 1, 2, 3], "agent-1")
    deadline = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=601)
    f = tmp_path / "late.yaml"
    f.write_text(f'command: ["sleep", "3600"]\ngpus_per_node: 1\nestimated_duration_s: 3600\n'
                 f'deadline: {deadline.isoformat()}\n')
    r = cli_run("ml", "submit", str(f))
    assert r.exit_code == 0, r.output
    jid = r.stdout.split()[0]
    warning = ("deadline cannot be met: it needs at least 60.0 min on the fastest registered node that can hold it "
               "(V100, 1x a V100) and 10.0 min are left to its deadline "
               f"{deadline.isoformat()}; it stays queued and would finish late")
    assert f"warning: {warning}" in " ".join(r.output.split()), r.output
    for args in (("status", jid), ("list",)):
        r = cli_run("ml", *args)
        assert r.exit_code == 0 and f"WARNING: {warning}" in " ".join(r.stdout.split()), r.stdout

    PlanningCycle(pg_store, env, BrokerSettings()).run()
    assert pg_store.get(jid).state == "starting"
    assert pg_store.decision(jid)["reason"] == ("misses the deadline: no option finishes by it, the earliest finish "
                                                "was chosen; best score: on-prem now")

    assert pg_store.transition(jid, "running", "running on local-0")
    past = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=300)
    with pg_store.session() as s:
        s.get(Job, jid).deadline = past
    r = cli_run("ml", "status", jid)
    assert r.exit_code == 0, r.output
    assert f"WARNING: running past its deadline {past.isoformat()} by 5.0 min" in " ".join(r.stdout.split()), r.stdout


def test_a_batch_refuses_the_items_no_registered_node_can_hold_and_stores_the_others(pg_store):
    """``POST /v1/jobs:batch`` applies the same check per item (a bad item does not stop the others)."""
    client, h = _api(pg_store)
    pg_store.heartbeat("local-0", "local", "V100", 4, 16.0, [0, 1, 2, 3], "agent-1")
    r = client.post("/v1/jobs:batch", json={"items": [{"spec": {"command": ["true"], "gpus_per_node": 2}},
                                                       {"spec": {"command": ["true"], "gpus_per_node": 8}}]}, headers=h)
    assert r.status_code == 200, r.text
    ok, bad = r.json()["results"]
    assert (ok["status"], bad["status"], r.json()["created"]) == (201, 422, 1)
    assert bad["detail"][0]["loc"] == ["body", "items", 1, "spec", "gpus_per_node"]
    assert bad["detail"][0]["msg"].startswith("items.1.spec.gpus_per_node=8: no registered node can ever hold this job")
