"""The node API (/v1/node): a node token acts on its own node's attempts only; team and node
tokens never cross over. Real PostgreSQL store, real planning cycle to place the job."""

from __future__ import annotations

import warnings

import pytest
from typer.testing import CliRunner

with warnings.catch_warnings():  # starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.cycle import PlanningCycle
from broker.service.live import LiveEnvironment
from broker.model import JobSpec
from broker.service.node_api import authenticate_node
from broker.cli.serve import agent_environment
from broker.service.settings import BrokerSettings
from broker.service.tokens import create_node_token, create_token, node_of_token

ADMIN = "admin-secret-for-tests"


def hb(gpus: int, healthy: list[int], pool: str = "local") -> dict:
    return {"pool": pool, "gpu_type": "V100", "gpu_count": gpus, "gpu_memory_gb": 16.0, "healthy_gpus": healthy,
            "agent_id": "test-agent", "telemetry": None}


@pytest.fixture
def rig(pg_store):
    """Nodes n1 (no healthy GPU) and n2 (1 GPU) heartbeating through the API; one job placed on n2."""
    settings = BrokerSettings(admin_token=ADMIN, max_attempts=3)
    changed = []
    c = TestClient(create_app(pg_store, settings, on_submit=changed.append))
    tok = {n: {"Authorization": f"Bearer {create_node_token(pg_store, n)}"} for n in ("n1", "n2")}
    assert c.post("/v1/node/heartbeat", json=hb(1, []), headers=tok["n1"]).json() == {"node": "n1"}
    assert c.post("/v1/node/heartbeat", json=hb(1, [0]), headers=tok["n2"]).json() == {"node": "n2"}
    jid = pg_store.submit("ml", JobSpec(command=["true"], estimated_duration_s=60.0))[0].id
    PlanningCycle(pg_store, LiveEnvironment(settings.planner), settings).run()
    assert pg_store.get(jid).state == "starting"
    return c, tok, jid, changed


def test_a_node_sees_and_reports_only_its_own_attempts(pg_store, rig):
    c, tok, jid, changed = rig
    [w] = c.get("/v1/node/work", headers=tok["n2"]).json()["work"]
    assert {k: v for k, v in w.items() if k != "spec"} == {
        "job_id": jid, "attempt": 1, "rank": 0, "state": "starting", "cancel_requested": False, "stop_reason": None,
        "nnodes": 1, "master_node": "n2", "gpus": [0]}
    assert w["spec"]["command"] == ["true"]
    assert c.get("/v1/node/work", headers=tok["n1"]).json() == {"node": "n1", "work": []}
    base = f"/v1/node/attempts/{jid}/1/0"
    for path, body in (("running", None), ("ended", {"exit_code": 0}), ("launch-failed", {"reason": "x"}),
                       ("gone", None), ("logs", {"seq": 0, "text": "forged\n"})):
        r = c.post(f"{base}/{path}", json=body, headers=tok["n1"])
        assert r.status_code == 404, (path, r.text)
        assert r.json()["detail"] == f"job {jid!r} attempt 1 rank 0: no such attempt on node 'n1'"
    assert c.post(f"/v1/node/attempts/{jid}/1/1/running", headers=tok["n2"]).status_code == 404  # no rank 1
    assert c.post(f"/v1/node/attempts/{jid}/2/0/running", headers=tok["n2"]).status_code == 404  # no attempt 2
    assert pg_store.get(jid).state == "starting" and pg_store.log_chunks(jid, 1) == []
    # the owner's reports are taken
    assert c.post(f"{base}/running", headers=tok["n2"]).json() == {"changed": True}
    assert c.post(f"{base}/running", headers=tok["n2"]).json() == {"changed": False}
    assert c.post(f"{base}/logs", json={"seq": 0, "text": "hi\n"}, headers=tok["n2"]).json() == {"stored": True}
    assert c.post(f"{base}/logs", json={"seq": 0, "text": "hi\n"}, headers=tok["n2"]).json() == {"stored": False}
    assert c.post(f"{base}/ended", json={"exit_code": 0}, headers=tok["n2"]).json() == {"recorded": True,
                                                                                       "changed": True}
    j = pg_store.get(jid)
    assert (j.state, j.exit_code, j.reason) == ("succeeded", 0, "exit code 0")
    assert pg_store.log_chunks(jid, 1) == [(0, "hi\n")]
    assert changed == [jid]  # the planner is woken once, by the end
    assert c.get("/v1/node/work", headers=tok["n2"]).json()["work"] == []


def test_a_node_token_is_refused_by_every_team_route(pg_store, rig):
    c, tok, jid, _ = rig
    for method, path in (("GET", "/v1/jobs"), ("GET", f"/v1/jobs/{jid}"), ("POST", f"/v1/jobs/{jid}/cancel"),
                         ("GET", f"/v1/jobs/{jid}/logs"), ("GET", f"/v1/jobs/{jid}/explain"), ("GET", "/v1/nodes"),
                         ("GET", "/v1/schedules"), ("GET", "/v1/tokens"), ("GET", "/v1/audit")):
        r = c.request(method, path, headers=tok["n2"])
        assert r.status_code == 403, (path, r.text)
        assert r.json()["detail"] == f"{path.split('?')[0]}: a node token (node 'n2') may only call the node API (/v1/node/...)"
    r = c.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=tok["n2"])
    assert r.status_code == 403
    assert pg_store.get(jid).cancel_requested is False


def test_team_admin_and_missing_tokens_are_refused_by_node_routes(pg_store, rig):
    c, tok, jid, _ = rig
    team = {"Authorization": f"Bearer {create_token(pg_store, 'ml').token}"}
    admin = {"Authorization": f"Bearer {create_token(pg_store, 'ops', 'admin').token}"}
    for h in (team, admin, {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": "Bearer fbn_nope"}, {}):
        assert c.get("/v1/node/work", headers=h).status_code == 401
        assert c.post(f"/v1/node/attempts/{jid}/1/0/running", headers=h).status_code == 401
        assert c.post("/v1/node/heartbeat", json=hb(1, [0]), headers=h).status_code == 401
    assert pg_store.get(jid).state == "starting"
    assert authenticate_node(pg_store, create_token(pg_store, "node-x").token) is None  # a team called like a node
    assert authenticate_node(pg_store, "") is None


def test_bad_node_reports_are_422_naming_the_field(pg_store, rig):
    c, tok, jid, _ = rig
    r = c.post("/v1/node/heartbeat", json=hb(1, [0], pool="nowhere"), headers=tok["n2"])
    assert r.status_code == 422 and r.json()["detail"].startswith("pool='nowhere': not an agent pool")
    r = c.post(f"/v1/node/attempts/{jid}/1/0/ended", json={"exit_code": 1, "lost": True}, headers=tok["n2"])
    assert r.status_code == 422 and "exit_code=1, lost=True" in r.json()["detail"]
    r = c.post(f"/v1/node/attempts/{jid}/1/0/logs", json={"seq": -1, "text": ""}, headers=tok["n2"])
    assert r.status_code == 422
    assert pg_store.get(jid).state == "starting"


def test_a_log_or_reason_with_a_nul_byte_is_stored_with_u_fffd(pg_store, rig):
    """A job that prints a NUL: PostgreSQL's text refuses it, and the upload answered 500 forever (the agent retried
    it every step and stopped heartbeating: its node was declared lost for every team)."""
    c, tok, jid, _ = rig
    base = f"/v1/node/attempts/{jid}/1/0"
    assert c.post(f"{base}/logs", json={"seq": 0, "text": "a\x00b\n"}, headers=tok["n2"]).json() == {"stored": True}
    assert pg_store.log_chunks(jid, 1) == [(0, "a\ufffdb\n")]
    r = c.post(f"{base}/launch-failed", json={"reason": "cannot execute '/x\x00'"}, headers=tok["n2"])
    assert r.json() == {"changed": True}
    assert pg_store.get(jid).reason == "could not start on n2: cannot execute '/x\ufffd'"


@pytest.mark.parametrize("change, field", [
    ({"healthy_gpus": [0, 1, 2, 40]}, "healthy_gpus=[0, 1, 2, 40]: [2, 40] not below gpu_count=2"),
    ({"healthy_gpus": [0, 0]}, "healthy_gpus=[0, 0]: an index appears twice"),
    ({"gpu_type": "V1\x0000"}, "gpu_type"),
    ({"agent_id": "a\x1b[2J"}, "agent_id"),
])
def test_a_heartbeat_that_cannot_be_true_is_422(pg_store, rig, change, field):
    c, tok, _, _ = rig
    r = c.post("/v1/node/heartbeat", json={**hb(2, [0, 1]), **change}, headers=tok["n2"])
    assert r.status_code == 422 and field in r.text, r.text
    assert pg_store.nodes()[1].healthy_gpus == [0]  # n2 as its last good heartbeat said


def test_launch_failed_and_lost_requeue_the_job(pg_store, rig):
    c, tok, jid, changed = rig
    base = f"/v1/node/attempts/{jid}/1/0"
    assert c.post(f"{base}/launch-failed", json={"reason": "no such image"}, headers=tok["n2"]).json() == {
        "changed": True}
    j = pg_store.get(jid)
    assert (j.state, j.reason) == ("queued", "could not start on n2: no such image")
    assert [(a.outcome, a.reason) for a in pg_store.attempts(jid)] == [("launch_failed", "could not start on n2: "
                                                                                          "no such image")]
    assert changed == [jid]


def test_a_failed_rank_of_an_onprem_gang_stops_the_others_and_its_exit_code_is_the_jobs(pg_store):
    """The attempt lifecycle is the cloud's on-prem too: rank 1 fails with 3, the gang is asked to stop
    (``peer-ended``, recorded in the job's history), rank 0 is stopped (143) and the job fails with 3."""
    settings = BrokerSettings(admin_token=ADMIN, max_attempts=3)
    c = TestClient(create_app(pg_store, settings))
    tok = {n: {"Authorization": f"Bearer {create_node_token(pg_store, n)}"} for n in ("g1", "g2")}
    for n in tok:
        assert c.post("/v1/node/heartbeat", json=hb(1, [0]), headers=tok[n]).json() == {"node": n}
    jid = pg_store.submit("ml", JobSpec(command=["true"], nodes=2, gpus_per_node=1, estimated_duration_s=60.0))[0].id
    PlanningCycle(pg_store, LiveEnvironment(settings.planner), settings).run()
    assert pg_store.get(jid).state == "starting"
    ranks = {}
    for n in tok:
        [w] = c.get("/v1/node/work", headers=tok[n]).json()["work"]
        ranks[w["rank"]] = n
    assert sorted(ranks) == [0, 1]
    for r, n in ranks.items():
        c.post(f"/v1/node/attempts/{jid}/1/{r}/running", headers=tok[n])
    assert c.post(f"/v1/node/attempts/{jid}/1/1/ended", json={"exit_code": 3}, headers=tok[ranks[1]]).json() == {
        "recorded": True, "changed": False}
    assert pg_store.get(jid).state == "running"
    assert pg_store.events(jid)[-1].reason == f"rank 1 on {ranks[1]} ended (3); stopping the other ranks"
    [w] = c.get("/v1/node/work", headers=tok[ranks[0]]).json()["work"]  # the agent of rank 0 sees the stop
    assert (w["rank"], w["stop_reason"]) == (0, "peer-ended")
    assert c.get("/v1/node/work", headers=tok[ranks[1]]).json()["work"] == []  # rank 1's end is recorded
    assert c.post(f"/v1/node/attempts/{jid}/1/0/ended", json={"exit_code": 143}, headers=tok[ranks[0]]).json() == {
        "recorded": True, "changed": True}
    j = pg_store.get(jid)
    assert (j.state, j.exit_code, j.reason) == ("failed", 3, "ranks ended with {'1': 3, '0': 143}")
    [a] = pg_store.attempts(jid)
    assert (a.outcome, a.exit_code) == ("failed", 3)


def test_the_usage_hook_sees_each_ended_attempt_once(pg_store, rig, monkeypatch):
    """``lifecycle.record_usage`` (where the finance ledger will write) is called once per ended attempt, in
    the transaction that ends it, with the attempt's end already set: a launch failure, then a success."""
    from broker.service import lifecycle

    seen = []
    monkeypatch.setattr(lifecycle, "record_usage",
                        lambda s, att, now: seen.append((att.number, att.outcome, att.exit_code, att.ended_at == now)))
    c, tok, jid, _ = rig
    assert c.post(f"/v1/node/attempts/{jid}/1/0/launch-failed", json={"reason": "no such image"},
                  headers=tok["n2"]).json() == {"changed": True}
    assert seen == [(1, "launch_failed", None, True)]
    settings = BrokerSettings(admin_token=ADMIN, max_attempts=3)
    PlanningCycle(pg_store, LiveEnvironment(settings.planner), settings).run()
    assert pg_store.get(jid).attempt == 2
    for path, body in (("running", None), ("ended", {"exit_code": 0}), ("ended", {"exit_code": 0})):
        c.post(f"/v1/node/attempts/{jid}/2/0/{path}", json=body, headers=tok["n2"])
    assert pg_store.get(jid).state == "succeeded"
    assert seen == [(1, "launch_failed", None, True), (2, "succeeded", 0, True)]


def test_node_tokens_are_minted_by_the_cli_and_agents_get_no_broker_settings(tmp_path):
    from broker.cli.main import app
    from broker.service.store.core import JobStore

    db = tmp_path / "fb.db"
    cfg = tmp_path / "fb.yaml"
    cfg.write_text(f"database_url: sqlite:///{db}\nstate_dir: {tmp_path}\n")
    r = CliRunner().invoke(app, ["nodes", "token", "gpu-01", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    token = r.stdout.strip().splitlines()[0]
    assert node_of_token(JobStore(f"sqlite:///{db}"), token) == "gpu-01"
    r = CliRunner().invoke(app, ["nodes", "token", "bad name", "--config", str(cfg)])
    assert r.exit_code == 2 and "node='bad name'" in r.output
    env = agent_environment("fbn_x", "http://127.0.0.1:8000", base={
        "PATH": "/bin", "FEDBROKER_CONFIG": "/etc/fb.yaml", "FEDBROKER_DATABASE_URL": "postgresql://u:pw@h/db",
        "FEDBROKER_TOKEN": "fbk_team", "FEDBROKER_ADMIN_TOKEN": "adm", "NCCL_SOCKET_IFNAME": "eth0",
        "AWS_SECRET_ACCESS_KEY": "k"})
    assert env == {"PATH": "/bin", "NCCL_SOCKET_IFNAME": "eth0", "FEDBROKER_NODE_TOKEN": "fbn_x",
                   "FEDBROKER_API_URL": "http://127.0.0.1:8000"}


def test_serve_agent_needs_a_node_token_kept_private(tmp_path, monkeypatch):
    from broker.cli.main import app

    monkeypatch.delenv("FEDBROKER_NODE_TOKEN", raising=False)
    r = CliRunner().invoke(app, ["serve", "agent", "--api-url", "http://127.0.0.1:9", "--nvml", "fake"])
    assert r.exit_code == 2 and "no node token: set FEDBROKER_NODE_TOKEN or give --token-file" in r.output
    f = tmp_path / "node.token"
    f.write_text("fbn_x\n")
    f.chmod(0o644)
    r = CliRunner().invoke(app, ["serve", "agent", "--api-url", "http://127.0.0.1:9", "--token-file", str(f)])
    assert r.exit_code == 2 and "mode 644 lets others read it; chmod 600 it" in r.output
    f.chmod(0o600)
    monkeypatch.setenv("FEDBROKER_NODE_TOKEN", "fbn_x")
    r = CliRunner().invoke(app, ["serve", "agent", "--api-url", "ftp://broker", "--nvml", "fake"])
    assert r.exit_code == 2 and "api_url='ftp://broker': must start with http:// or https://" in r.output


def test_work_long_poll_answers_a_change_at_once_and_304_when_none(pg_store, rig):
    """``GET /v1/node/work`` carries an ETag; with ``If-None-Match`` and ``wait_s`` it waits: 304 after
    ``wait_s`` when the node's work did not change, 200 with the new list within ~0.1 s of a change
    (here a cancel), bounded ``wait_s`` (10 s at most: 422 naming the field)."""
    import threading
    import time

    c, tok, jid, _ = rig
    r = c.get("/v1/node/work", headers=tok["n2"])
    etag = r.headers["etag"]
    assert r.status_code == 200 and [w["job_id"] for w in r.json()["work"]] == [jid]
    assert etag.startswith('"') and len(etag) == 18
    assert c.get("/v1/node/work", headers=tok["n2"]).headers["etag"] == etag  # stable while nothing changes
    t0 = time.perf_counter()
    r = c.get("/v1/node/work?wait_s=0.3", headers={**tok["n2"], "If-None-Match": etag})
    assert r.status_code == 304 and r.headers["etag"] == etag and r.content == b""
    assert 0.3 <= time.perf_counter() - t0 < 2.0
    # another node's long-poll is not woken by this node's change
    idle = c.get("/v1/node/work", headers=tok["n1"]).headers["etag"]
    out = {}

    def poll(name, tag, key):
        t = time.perf_counter()
        resp = c.get("/v1/node/work?wait_s=5", headers={**tok[name], "If-None-Match": tag})
        out[key] = (resp, time.perf_counter() - t)

    threads = [threading.Thread(target=poll, args=("n2", etag, "n2")),
               threading.Thread(target=poll, args=("n1", idle, "n1"))]
    for th in threads:
        th.start()
    time.sleep(0.5)
    t_cancel = time.perf_counter()
    assert pg_store.request_cancel(jid, "ml", "stop it").cancel_requested
    threads[0].join(10)
    resp, _ = out["n2"]
    assert resp.status_code == 200 and time.perf_counter() - t_cancel < 1.5
    [w] = resp.json()["work"]
    assert w["cancel_requested"] is True and resp.headers["etag"] != etag
    threads[1].join(10)
    resp, waited = out["n1"]
    assert resp.status_code == 304 and waited >= 5.0
    r = c.get("/v1/node/work?wait_s=11", headers=tok["n2"])
    assert r.status_code == 422 and "wait_s" in r.text


def test_an_agent_cannot_join_a_slurm_pool(pg_store, tmp_path):
    """A pool of an existing scheduler gets its nodes from its cluster: a node agent heartbeating into it is refused."""
    import json

    f = tmp_path / "cluster.json"
    f.write_text(json.dumps({"pools": [
        {"name": "hpc", "kind": "slurm", "carbon_zone": "CA-ON", "price_zone": "CA-ON", "slurm": {"partition": "gpu"}},
        {"name": "local", "carbon_zone": "CA-ON", "price_zone": "CA-ON",
         "nodes": [{"name": "n1", "gpu_type": "V100", "gpu_count": 1}]}]}))
    c = TestClient(create_app(pg_store, BrokerSettings(admin_token=ADMIN, cluster=f)))
    tok = {"Authorization": f"Bearer {create_node_token(pg_store, 'n1')}"}
    r = c.post("/v1/node/heartbeat", json=hb(1, [0], pool="hpc"), headers=tok)
    assert (r.status_code, r.json()["detail"]) == (422, "pool='hpc': not an agent pool of the cluster file (known: local)")
    assert c.post("/v1/node/heartbeat", json=hb(1, [0]), headers=tok).json() == {"node": "n1"}
