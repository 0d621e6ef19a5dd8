"""The HTTP API (broker.service.api) through FastAPI's TestClient, on a real PostgreSQL schema (and SQLite).

Each test uses teams of its own (``make_team``), so tests sharing the module's schema
cannot see each other's jobs.
"""

from __future__ import annotations

import re
import uuid
import warnings
from datetime import datetime, timedelta, timezone

import pytest

with warnings.catch_warnings():  # starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.store.tables import Attempt, Job
from broker.model import Decision, DecisionKind, JobSpec, OptionEstimate
from broker.service.settings import BrokerSettings
from broker.service.store.core import JobStore
from broker.service.tokens import create_token
from tests.broker.harness import count_jobs
from tests.conftest import auth

ADMIN = "admin-secret-" + uuid.uuid4().hex
UTC = timezone.utc
ID_RE = re.compile(r"^job-[0-9a-f]{16}$")


def future(hours: float = 48) -> datetime:
    return (datetime.now(UTC) + timedelta(hours=hours)).replace(microsecond=0)


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def submitted():
    """Job ids passed to on_submit, in order."""
    return []


@pytest.fixture(scope="module")
def client(store, submitted):
    app = create_app(store, BrokerSettings(admin_token=ADMIN), on_submit=submitted.append)
    with TestClient(app) as c:
        yield c




# ----------------------------------------------------------------------------- submit
def test_submit_201_with_exact_fields(client, make_team, submitted):
    team, h = make_team()
    dl = future(30)
    spec = {"name": "resnet50", "image": "ghcr.io/acme/train:1.2", "command": ["python", "train.py", "--epochs", "3"],
            "gpus_per_node": 4, "nodes": 2, "gpu_types": ["A100"], "estimated_duration_s": 7200, "deadline": dl.isoformat(),
            "priority_class": "low", "spot_allowed": False}
    r = client.post("/v1/jobs", json={"spec": spec}, headers=h)
    assert r.status_code == 201, r.text
    j = r.json()
    assert ID_RE.match(j["id"])
    assert r.headers["location"] == f"/v1/jobs/{j['id']}"
    assert j["team"] == team and j["spec"]["team"] == team
    assert j["state"] == "submitted" and j["version"] == 1 and j["reason"] == "submitted"
    assert j["name"] == "resnet50"
    assert j["spec"]["command"] == ["python", "train.py", "--epochs", "3"]
    assert (j["spec"]["gpus_per_node"], j["spec"]["nodes"], j["spec"]["gpu_types"]) == (4, 2, ["A100"])
    assert j["spec"]["priority_class"] == "low" and j["spec"]["spot_allowed"] is False
    assert datetime.fromisoformat(j["deadline"]) == dl
    assert (j["attempt"], j["placement"], j["started_at"], j["finished_at"], j["exit_code"]) == (0, None, None, None, None)
    assert j["idempotency_key"] is None and j["cancel_requested"] is False
    assert submitted[-1] == j["id"]
    # no agent has registered a node in this store: the answer says the broker cannot tell yet (issue #20)
    assert j["warnings"] == ["no node has registered yet: the broker cannot tell whether any will hold 2 x 4 A100 "
                             "GPU(s); it waits until one that fits heartbeats"]
    # GET gives the same record
    g = client.get(f"/v1/jobs/{j['id']}", headers=h)
    assert g.status_code == 200 and g.json() == j


def test_submit_default_deadline_and_start_window(client, make_team, store):
    _, h = make_team()
    start, end = future(2), future(5)
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "estimated_duration_s": 1800, "not_before": start.isoformat(),
                                               "not_after": end.isoformat()}}, headers=h)
    assert r.status_code == 201, r.text
    j = r.json()
    # no deadline: earliest start + duration + max(duration, 12 h) (broker.service.store.core.default_deadline)
    assert datetime.fromisoformat(j["deadline"]) == start + timedelta(seconds=1800 + 12 * 3600)
    assert datetime.fromisoformat(j["not_before"]) == start
    assert datetime.fromisoformat(j["not_after"]) == end  # stored on the row: the planner reads it there
    with store.session() as s:
        assert s.get(Job, j["id"]).not_after == end


def test_idempotent_submit(client, make_team, store, submitted):
    team, h = make_team()
    body = {"spec": {"command": ["true"], "image": "ghcr.io/acme/train:2", "gpus_per_node": 2}}
    r1 = client.post("/v1/jobs", json=body, headers={**h, "Idempotency-Key": "run-42"})
    n_calls = len(submitted)
    r2 = client.post("/v1/jobs", json=body, headers={**h, "Idempotency-Key": "run-42"})
    r3 = client.post("/v1/jobs", json={**body, "idempotency_key": "run-42"}, headers=h)  # key in the body
    assert (r1.status_code, r2.status_code, r3.status_code) == (201, 200, 200)
    assert r1.json()["id"] == r2.json()["id"] == r3.json()["id"]
    assert r1.json()["idempotency_key"] == "run-42"
    assert len(submitted) == n_calls  # the planner is woken for new jobs only
    assert count_jobs(store, team) == 1
    # same key, another spec: 409 naming the key; nothing stored
    r4 = client.post("/v1/jobs", json={"spec": {"command": ["true"], "image": "ghcr.io/acme/train:2", "gpus_per_node": 4}},
                     headers={**h, "Idempotency-Key": "run-42"})
    assert r4.status_code == 409
    assert "idempotency_key='run-42'" in r4.json()["detail"] and r1.json()["id"] in r4.json()["detail"]
    # header and body disagree: 422 naming the field
    r5 = client.post("/v1/jobs", json={**body, "idempotency_key": "a"}, headers={**h, "Idempotency-Key": "b"})
    assert r5.status_code == 422
    assert r5.json()["detail"][0]["msg"].startswith("idempotency_key='a': differs from the Idempotency-Key header 'b'")
    assert count_jobs(store, team) == 1
    # another team may use the same key: keys are per team
    other, h2 = make_team()
    r6 = client.post("/v1/jobs", json=body, headers={**h2, "Idempotency-Key": "run-42"})
    assert r6.status_code == 201 and r6.json()["id"] != r1.json()["id"] and r6.json()["team"] == other


def test_idempotent_retry_is_answered_even_after_its_deadline_passed(client, make_team, store):
    team, h = make_team()
    past = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
    job, created = store.submit(team, JobSpec(command=["true"], deadline=past), idempotency_key="k1",
                                now=datetime.now(UTC) - timedelta(hours=3))
    assert created
    # the retry carries a deadline that is now in the past; it still answers the first job
    spec = job.spec.model_dump(mode="json")
    r = client.post("/v1/jobs", json={"spec": spec, "idempotency_key": "k1"}, headers=h)
    assert r.status_code == 200 and r.json()["id"] == job.id


def test_submit_team_rules(client, make_team, store):
    team, h = make_team()
    # a team token may leave spec.team "default" or name its own team, not another one
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "team": team}}, headers=h)
    assert r.status_code == 201 and r.json()["team"] == team
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "team": "someone-else"}}, headers=h)
    assert r.status_code == 403
    assert r.json()["detail"] == f"spec.team='someone-else': your token belongs to team {team!r}"
    assert count_jobs(store, "someone-else") == 0
    # an admin may submit for any team; without spec.team the job is the admin's own team
    target = "t" + uuid.uuid4().hex[:10]
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "team": target}}, headers=auth(ADMIN))
    assert r.status_code == 201 and r.json()["team"] == target
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=auth(ADMIN))
    assert r.status_code == 201 and r.json()["team"] == "admin"


def test_on_submit_failure_does_not_fail_the_request(store, make_team, caplog):
    team, h = make_team()

    def boom(job_id: str) -> None:
        raise RuntimeError("planner queue down")

    with TestClient(create_app(store, on_submit=boom)) as c:
        r = c.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=h)
    assert r.status_code == 201
    assert count_jobs(store, team) == 1
    assert any("on_submit" in rec.getMessage() and r.json()["id"] in rec.getMessage() for rec in caplog.records)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("body, loc, msg_start", [
    ({"spec": {"command": ["true"], "gpus": 8}}, ["body", "spec", "gpus"], "spec.gpus=8: Extra inputs are not permitted"),
    ({"spec": {"command": ["true"]}, "priority": "high"}, ["body", "priority"], "priority='high': Extra inputs are not permitted"),
    ({"spec": {"command": ["true"], "gpus_per_node": -1}}, ["body", "spec", "gpus_per_node"],
     "spec.gpus_per_node=-1: Input should be greater than or equal to 1"),
    ({"spec": {"command": ["true"], "gpus_per_node": 17}}, ["body", "spec", "gpus_per_node"],
     "spec.gpus_per_node=17: Input should be less than or equal to 16"),
    ({"spec": {"command": ["true"], "image": "busybox; rm -rf /"}}, ["body", "spec", "image"],
     "spec.image='busybox; rm -rf /': not a valid image reference"),
    ({"spec": {"command": ["true"], "deadline": "2020-01-01T00:00:00Z"}}, ["body", "spec", "deadline"],
     "spec.deadline='2020-01-01T00:00:00+00:00': must be after now"),
    ({"spec": {"command": ["true"], "deadline": "2031-01-01T00:00:00"}}, ["body", "spec", "deadline"],
     "spec.deadline='2031-01-01T00:00:00': needs a time zone"),
    ({"spec": {"command": ["true"], "not_after": "2021-06-01T12:00:00+00:00"}}, ["body", "spec", "not_after"],
     "spec.not_after='2021-06-01T12:00:00+00:00': is in the past"),
    ({}, ["body", "spec"], "spec: Field required"),
])
def test_submit_422_names_field_and_value(client, make_team, store, body, loc, msg_start):
    team, h = make_team()
    r = client.post("/v1/jobs", json=body, headers=h)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert len(errors) == 1, errors
    assert errors[0]["loc"] == loc
    assert errors[0]["msg"].startswith(msg_start), errors[0]["msg"]
    assert count_jobs(store, team) == 0


def test_submit_deadline_now_is_rejected(client, make_team, store):
    team, h = make_team()
    now = datetime.now(UTC).replace(microsecond=0)
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "deadline": now.isoformat()}}, headers=h)
    assert r.status_code == 422
    assert r.json()["detail"][0]["msg"].startswith(f"spec.deadline={now.isoformat()!r}: must be after now")
    assert count_jobs(store, team) == 0


def test_submit_malformed_or_non_json_body(client, make_team, store):
    team, h = make_team()
    r = client.post("/v1/jobs", content=b'{"spec": {"command": ["true"], "gpus_per_node": 2,}}',
                    headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422
    assert r.json()["detail"] == [{"loc": ["body"], "type": "json_invalid",
                                   "msg": "body: not valid JSON (Expecting property name enclosed in double quotes "
                                          "at character 50)"}]
    r = client.post("/v1/jobs", content=b"spec: {}", headers={**h, "Content-Type": "application/yaml"})
    assert r.status_code == 422
    assert r.json()["detail"][0]["msg"] == "body: must be a JSON object (send it with Content-Type: application/json)"
    assert count_jobs(store, team) == 0


def test_several_errors_are_all_reported(client, make_team):
    _, h = make_team()
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"], "gpus_per_node": 0, "nodes": 0, "bogus": True}}, headers=h)
    assert r.status_code == 422
    assert sorted(e["loc"][-1] for e in r.json()["detail"]) == ["bogus", "gpus_per_node", "nodes"]


# ----------------------------------------------------------------------------- auth and isolation
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer fbk_not-a-token"}, {"Authorization": "Basic dTpw"},
                                     {"Authorization": "Bearer "}])
def test_401_without_a_valid_token(client, headers, store):
    for method, path in [("get", "/v1/jobs"), ("get", "/v1/nodes"), ("get", "/v1/jobs/job-0123456789abcdef"),
                         ("post", "/v1/jobs/job-0123456789abcdef/cancel")]:
        r = getattr(client, method)(path, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]
    n = count_jobs(store, "default")
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=headers)
    assert r.status_code == 401 and count_jobs(store, "default") == n


def test_revoked_token_is_401(client, store):
    from broker.service.store.tables import ApiToken
    from broker.service.store.core import hash_token

    tok = create_token(store, "revokers").token
    assert client.get("/v1/jobs", headers=auth(tok)).status_code == 200
    with store.session() as s:
        s.execute(ApiToken.__table__.update().where(ApiToken.token_hash == hash_token(tok)).values(revoked=True))
    # authenticated tokens are cached for settings.api_token_cache_s (5 s): revocation takes effect after it
    client.app.state.token_cache.clear()
    assert client.get("/v1/jobs", headers=auth(tok)).status_code == 401


def test_team_isolation(client, make_team, store):
    a, ha = make_team()
    b, hb = make_team()
    ja = client.post("/v1/jobs", json={"spec": {"command": ["true"], "name": "a-job"}}, headers=ha).json()
    jb = client.post("/v1/jobs", json={"spec": {"command": ["true"], "name": "b-job"}}, headers=hb).json()
    missing = "job-" + "0" * 16
    for path in (f"/v1/jobs/{ja['id']}", f"/v1/jobs/{ja['id']}/logs", f"/v1/jobs/{ja['id']}/explain"):
        r = client.get(path, headers=hb)
        assert r.status_code == 404, path
        # indistinguishable from a job that does not exist
        r_missing = client.get(path.replace(ja["id"], missing), headers=hb)
        assert r_missing.status_code == 404
        assert r.json()["detail"].replace(ja["id"], "X") == r_missing.json()["detail"].replace(missing, "X")
    r = client.post(f"/v1/jobs/{ja['id']}/cancel", headers=hb)
    assert r.status_code == 404
    assert client.get(f"/v1/jobs/{ja['id']}", headers=ha).json()["state"] == "submitted"
    # lists show own jobs only; asking for another team is 403
    assert [j["id"] for j in client.get("/v1/jobs", headers=hb).json()] == [jb["id"]]
    assert [j["id"] for j in client.get("/v1/jobs", params={"team": b}, headers=hb).json()] == [jb["id"]]
    r = client.get("/v1/jobs", params={"team": a}, headers=hb)
    assert r.status_code == 403 and r.json()["detail"] == f"team={a!r}: your token belongs to team {b!r}"
    # admins (settings.admin_token, or a stored admin token) see both
    for h_admin in (auth(ADMIN), make_team(admin=True)[1]):
        assert client.get(f"/v1/jobs/{ja['id']}", headers=h_admin).json()["team"] == a
        ids = {j["id"] for j in client.get("/v1/jobs", params={"limit": 1000}, headers=h_admin).json()}
        assert {ja["id"], jb["id"]} <= ids
        assert [j["id"] for j in client.get("/v1/jobs", params={"team": a}, headers=h_admin).json()] == [ja["id"]]


def test_malformed_job_id_is_404(client, make_team):
    _, h = make_team()
    for bad in ("nope", "job-0123", "job-0123456789ABCDEF", "job-0123456789abcdef0", "1;DROP TABLE jobs"):
        r = client.get(f"/v1/jobs/{bad}", headers=h)
        assert r.status_code == 404, bad
        assert r.json()["detail"].startswith(f"job_id={bad!r}: no such job")


# ----------------------------------------------------------------------------- list
def test_list_filters_order_and_paging(client, make_team, store):
    team, h = make_team()
    ids = [client.post("/v1/jobs", json={"spec": {"command": ["true"], "name": f"j{i}"}}, headers=h).json()["id"] for i in range(4)]
    client.post(f"/v1/jobs/{ids[1]}/cancel", headers=h)
    r = client.get("/v1/jobs", headers=h)
    assert [j["id"] for j in r.json()] == ids[::-1]  # newest first
    assert [j["id"] for j in client.get("/v1/jobs", params={"state": "cancelled"}, headers=h).json()] == [ids[1]]
    both = client.get("/v1/jobs", params=[("state", "cancelled"), ("state", "submitted")], headers=h).json()
    assert len(both) == 4
    page = client.get("/v1/jobs", params={"limit": 2, "offset": 1}, headers=h).json()
    assert [j["id"] for j in page] == [ids[2], ids[1]]


@pytest.mark.parametrize("params, loc, msg_start", [
    ({"state": "bogus"}, ["query", "state"], "state='bogus': not a job state (one of submitted, queued,"),
    ({"limit": 0}, ["query", "limit"], "limit='0': Input should be greater than or equal to 1"),
    ({"limit": 1001}, ["query", "limit"], "limit='1001': Input should be less than or equal to 1000"),
    ({"offset": -1}, ["query", "offset"], "offset='-1': Input should be greater than or equal to 0"),
])
def test_list_422(client, make_team, params, loc, msg_start):
    _, h = make_team()
    r = client.get("/v1/jobs", params=params, headers=h)
    assert r.status_code == 422
    err = r.json()["detail"][0]
    assert err["loc"] == loc and err["msg"].startswith(msg_start), err


# ----------------------------------------------------------------------------- cancel
def test_cancel_submitted_job(client, make_team):
    _, h = make_team()
    j = client.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=h).json()
    r = client.post(f"/v1/jobs/{j['id']}/cancel", headers=h)
    assert r.status_code == 200
    c = r.json()
    assert (c["state"], c["version"], c["cancel_requested"], c["reason"]) == ("cancelled", 2, True, "cancelled by user")
    assert c["finished_at"] is not None
    ex = client.get(f"/v1/jobs/{j['id']}/explain", headers=h).json()
    assert [(e["from_state"], e["to_state"], e["version"], e["reason"]) for e in ex["events"]] == [
        (None, "submitted", 1, "submitted"), ("submitted", "cancelled", 2, "cancelled by user")]
    # cancelling again is a no-op
    again = client.post(f"/v1/jobs/{j['id']}/cancel", headers=h)
    assert again.status_code == 200 and again.json()["version"] == 2


def test_cancel_finished_job_is_409(client, make_team, store):
    _, h = make_team()
    j = client.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=h).json()
    for to in ("queued", "starting", "running", "succeeded"):
        assert store.transition(j["id"], to, f"test: {to}")
    r = client.post(f"/v1/jobs/{j['id']}/cancel", headers=h)
    assert r.status_code == 409
    assert r.json()["detail"] == f"job_id={j['id']!r}: already succeeded"
    assert client.get(f"/v1/jobs/{j['id']}", headers=h).json()["state"] == "succeeded"


def test_cancel_running_job_requests_the_agent(client, make_team, store):
    _, h = make_team()
    j = client.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=h).json()
    for to in ("queued", "starting", "running"):
        store.transition(j["id"], to, f"test: {to}")
    c = client.post(f"/v1/jobs/{j['id']}/cancel", headers=h).json()
    assert (c["state"], c["cancel_requested"], c["reason"]) == ("running", True, "cancel requested: cancelled by user")


# ----------------------------------------------------------------------------- logs, explain, nodes
def test_logs(client, make_team, store):
    _, h = make_team()
    j = client.post("/v1/jobs", json={"spec": {"command": ["true"], "nodes": 2}}, headers=h).json()
    r = client.get(f"/v1/jobs/{j['id']}/logs", headers=h)
    assert r.json() == {"job_id": j["id"], "attempt": 0, "rank": 0, "text": "", "truncated": False}
    store.transition(j["id"], "queued", "test")
    store.transition(j["id"], "starting", "test", attempt=1)
    for seq, data in [(1, "epoch 1 loss=0.9\n"), (0, "starting torchrun\n"), (2, "epoch 2 loss=0.5\n")]:
        store.append_log(j["id"], 1, 0, seq, data)
    store.append_log(j["id"], 1, 0, 1, "duplicate chunk is ignored\n")
    store.append_log(j["id"], 1, 1, 0, "rank 1 here\n")
    r = client.get(f"/v1/jobs/{j['id']}/logs", headers=h)
    assert r.status_code == 200
    assert r.json() == {"job_id": j["id"], "attempt": 1, "rank": 0, "truncated": False,
                        "text": "starting torchrun\nepoch 1 loss=0.9\nepoch 2 loss=0.5\n"}
    assert client.get(f"/v1/jobs/{j['id']}/logs", params={"rank": 1}, headers=h).json()["text"] == "rank 1 here\n"
    # a second attempt becomes the default; the first stays readable
    store.transition(j["id"], "queued", "test: node lost")
    store.transition(j["id"], "starting", "test", attempt=2)
    store.append_log(j["id"], 2, 0, 0, "resumed from checkpoint\n")
    assert client.get(f"/v1/jobs/{j['id']}/logs", headers=h).json()["text"] == "resumed from checkpoint\n"
    assert client.get(f"/v1/jobs/{j['id']}/logs", params={"attempt": 1}, headers=h).json()["text"].startswith("starting")
    store.append_log(j["id"], 2, 0, 1, "\n[fedbroker: log truncated at 16777216 bytes]\n")  # the agent's cap marker
    r = client.get(f"/v1/jobs/{j['id']}/logs", headers=h).json()
    assert r["truncated"] is True and r["text"].startswith("resumed from checkpoint\n")
    assert client.get(f"/v1/jobs/{j['id']}/logs", params={"attempt": 1}, headers=h).json()["truncated"] is False
    r = client.get(f"/v1/jobs/{j['id']}/logs", params={"attempt": 3}, headers=h)
    assert r.status_code == 404 and r.json()["detail"] == f"attempt=3: job {j['id']} has 2 attempt(s)"
    r = client.get(f"/v1/jobs/{j['id']}/logs", params={"attempt": 0}, headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "attempt"]


def test_explain(client, make_team, store):
    _, h = make_team()
    j = client.post("/v1/jobs", json={"spec": {"command": ["true"], "gpus_per_node": 8}}, headers=h).json()
    ex = client.get(f"/v1/jobs/{j['id']}/explain", headers=h).json()
    assert set(ex) == {"job", "decision", "events", "attempts", "decisions"}
    assert ex["decision"] is None and ex["attempts"] == [] and ex["job"]["id"] == j["id"]
    chosen = OptionEstimate("onprem", "toronto", 1.7e9, 0.0, 3600.0, 2.85, 3.12, 0.094, 2.87)
    alt = OptionEstimate("cloud", "aws:us-east-1a:p3.16xlarge:spot", 1.7e9 + 300, 300.0, 3600.0, 7.34, 2.6, 1.01, 7.53)
    rec = Decision(j["id"], DecisionKind.start, chosen, pool="toronto", allocation=((0, 8),), alternatives=(alt,),
                   reason="cheapest feasible").record()
    now = datetime.now(UTC)
    store.transition(j["id"], "queued", "planned", decision=rec)
    store.transition(j["id"], "starting", "dispatched", attempt=1)
    with store.session() as s:
        s.add(Attempt(job_id=j["id"], number=1, kind="onprem", pool="toronto", offer_id=None,
                      nodes=[{"node": "gpu-01", "gpus": list(range(8)), "rank": 0}], gpu_type="V100", gpus=8,
                      created_at=now, started_at=None, ended_at=None, exit_code=None, rank_exits={}, outcome=None,
                      reason=""))
    ex = client.get(f"/v1/jobs/{j['id']}/explain", headers=h).json()
    assert ex["decision"]["kind"] == "start" and ex["decision"]["reason"] == "cheapest feasible"
    assert ex["decision"]["option"]["target"] == "toronto"
    assert ex["decision"]["option"]["dollars_usd"] == 2.85 and ex["decision"]["option"]["carbon_kg"] == 0.094
    assert [a["target"] for a in ex["decision"]["alternatives"]] == ["aws:us-east-1a:p3.16xlarge:spot"]
    assert [e["to_state"] for e in ex["events"]] == ["submitted", "queued", "starting"]
    assert ex["job"]["state"] == "starting" and ex["job"]["attempt"] == 1
    assert len(ex["attempts"]) == 1
    a = ex["attempts"][0]
    assert (a["number"], a["kind"], a["pool"], a["gpu_type"], a["gpus"]) == (1, "onprem", "toronto", "V100", 8)
    assert a["nodes"] == [{"node": "gpu-01", "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "rank": 0}]


def test_nodes_admins_see_each_node(client, make_team, store):
    name = "gpu-" + uuid.uuid4().hex[:6]
    seen = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    store.heartbeat(name, "toronto", "V100", 8, 32.0, [0, 1, 2, 3, 5, 6, 7], "agent-1",
                    telemetry={"gpu_util": [0.5] * 8}, now=seen)
    r = client.get("/v1/nodes", headers=auth(ADMIN))
    assert r.status_code == 200
    mine = [n for n in r.json() if n["name"] == name]
    assert mine == [{"name": name, "pool": "toronto", "gpu_type": "V100", "gpu_count": 8, "gpu_memory_gb": 32.0,
                     "healthy_gpus": [0, 1, 2, 3, 5, 6, 7], "state": "up", "last_heartbeat_at": "2030-01-02T03:04:05Z",
                     "telemetry": {"gpu_util": [0.5] * 8}}]


def test_nodes_members_see_free_capacity_per_pool_and_gpu_type_only(client, make_team, store):
    """Pool P: node a (8 x V100, GPU 4 unhealthy; a running job holds GPUs 0-1), node b (4 x V100, silent for an
    hour: not up), node c (2 x A100). A member's body: V100 2 nodes, 1 up, 12 GPUs, 7 healthy, 5 free; A100 1
    node up, 2 GPUs, 2 healthy, 2 free. cb5ea98 gave members every node's name, GPU use, memory and power."""
    team, h = make_team()
    pool = "p" + uuid.uuid4().hex[:8]
    a, b, c = (f"{pool}-{x}" for x in "abc")
    now = datetime.now(UTC)
    store.heartbeat(a, pool, "V100", 8, 32.0, [0, 1, 2, 3, 5, 6, 7], "agent-a", telemetry={"gpu_util": [0.9] * 8},
                    now=now)
    store.heartbeat(b, pool, "V100", 4, 32.0, [0, 1, 2, 3], "agent-b", now=now - timedelta(hours=1))
    store.heartbeat(c, pool, "A100", 2, 80.0, [0, 1], "agent-c", now=now)
    j = client.post("/v1/jobs", json={"spec": {"command": ["true"], "gpus_per_node": 2}}, headers=h).json()
    store.transition(j["id"], "queued", "planned")
    store.transition(j["id"], "starting", "dispatched", attempt=1,
                     placement={"kind": "onprem", "pool": pool, "nodes": [{"node": a, "gpus": [0, 1], "rank": 0}]})
    r = client.get("/v1/nodes", headers=h)
    assert r.status_code == 200, r.text
    mine = [x for x in r.json() if x["pool"] == pool]
    assert mine == [{"pool": pool, "gpu_type": "A100", "nodes": 1, "nodes_up": 1, "gpus": 2, "healthy_gpus": 2,
                     "free_gpus": 2},
                    {"pool": pool, "gpu_type": "V100", "nodes": 2, "nodes_up": 1, "gpus": 12, "healthy_gpus": 7,
                     "free_gpus": 5}]
    assert a not in r.text and "gpu_util" not in r.text and "telemetry" not in r.text


# ----------------------------------------------------------------------------- health and docs
def test_healthz(client):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "database": "ok"}


def test_healthz_503_when_database_is_down():
    dead = JobStore("postgresql+psycopg://postgres@127.0.0.1:1/test")
    with TestClient(create_app(dead)) as c:
        r = c.get("/healthz")
    assert r.status_code == 503
    assert r.json()["database"] == "unavailable" and r.json()["status"] == "degraded"
    dead.engine.dispose()


def test_openapi_lists_paths(client):
    doc = client.get("/openapi.json").json()
    assert set(doc["paths"]) == {"/healthz", "/metrics", "/v1/jobs", "/v1/jobs:batch", "/v1/jobs:cancel", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
                                 "/v1/jobs/{job_id}/logs", "/v1/jobs/{job_id}/explain", "/v1/nodes",
                                 "/v1/schedules", "/v1/schedules/{schedule_id}", "/v1/schedules/{schedule_id}/pause",
                                 "/v1/schedules/{schedule_id}/resume", "/v1/instances/report",
                                 "/v1/tokens", "/v1/tokens/{token_id}/revoke", "/v1/tokens/{token_id}/rotate",
                                 "/v1/audit", "/v1/budgets", "/v1/budgets/{team}", "/v1/usage/summary", "/v1/usage/focus",
                                 "/v1/usage/savings",
                                 "/v1/node/config", "/v1/node/heartbeat", "/v1/node/work",
                                 *(f"/v1/node/attempts/{{job_id}}/{{attempt}}/{{rank}}/{r}"
                                   for r in ("running", "ended", "launch-failed", "gone", "logs"))}
    assert set(doc["paths"]["/v1/jobs"]) == {"get", "post"}
    assert set(doc["paths"]["/v1/schedules"]) == {"get", "post"}
    assert set(doc["paths"]["/v1/schedules/{schedule_id}"]) == {"get", "delete"}
    assert set(doc["paths"]["/v1/budgets/{team}"]) == {"get", "put", "delete"}
    assert {"200", "401", "403", "422"} <= set(doc["paths"]["/v1/budgets/{team}"]["put"]["responses"])
    assert {"201", "401", "403", "409", "422"} <= set(doc["paths"]["/v1/schedules"]["post"]["responses"])
    post = doc["paths"]["/v1/jobs"]["post"]
    assert {"201", "200", "401", "403", "409", "422"} <= set(post["responses"])
    assert {"401", "404", "415", "422"} <= set(doc["paths"]["/v1/instances/report"]["post"]["responses"])
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert client.get("/docs").status_code == 200


# ----------------------------------------------------------------------------- SQLite (embedded trial)
def test_sqlite_store_round_trip(tmp_path):
    st = JobStore(f"sqlite:///{tmp_path / 'fb.db'}")
    st.migrate()
    tok = create_token(st, "solo").token
    with TestClient(create_app(st)) as c:
        assert c.get("/healthz").json() == {"status": "ok", "database": "ok"}
        h = {**auth(tok), "Idempotency-Key": "once"}
        spec = {"command": ["true"], "gpus_per_node": 2, "deadline": future(10).isoformat()}  # one instant for both
        r1 = c.post("/v1/jobs", json={"spec": spec}, headers=h)
        r2 = c.post("/v1/jobs", json={"spec": spec}, headers=h)
        assert (r1.status_code, r2.status_code) == (201, 200) and r1.json()["id"] == r2.json()["id"]
        assert r1.json()["team"] == "solo" and r1.json()["state"] == "submitted"
        assert [j["id"] for j in c.get("/v1/jobs", headers=auth(tok)).json()] == [r1.json()["id"]]
        assert c.post(f"/v1/jobs/{r1.json()['id']}/cancel", headers=auth(tok)).json()["state"] == "cancelled"
    st.drop_schema()


def test_sqlite_validation_stores_nothing(tmp_path):
    st = JobStore(f"sqlite:///{tmp_path / 'fb.db'}")
    st.migrate()
    tok = create_token(st, "solo").token
    with TestClient(create_app(st)) as c:
        r = c.post("/v1/jobs", json={"spec": {"command": []}}, headers=auth(tok))
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("spec.command=[]: needs at least a program")
    assert count_jobs(st, "solo") == 0
    st.drop_schema()


@pytest.mark.parametrize("raw, loc, start", [
    (b'{"spec": {"command": ["true"], "estimated_duration_s": 1e400}}', ["body", "spec", "estimated_duration_s"],
     "spec.estimated_duration_s=inf: Input should be a finite number"),
    (b'{"spec": {"command": ["true"], "estimated_duration_s": 1e12}}', ["body", "spec", "estimated_duration_s"],
     "spec.estimated_duration_s=1000000000000.0: Input should be less than or equal to 31622400"),
    (b'{"spec": {"command": ["true"], "slack_s": Infinity}}', ["body", "spec", "slack_s"],
     "spec.slack_s=inf: Input should be a finite number"),
    (b'{"spec": {"command": ["true"], "min_gpu_memory_gb": NaN}}', ["body", "spec", "min_gpu_memory_gb"],
     "spec.min_gpu_memory_gb=nan: Input should be a finite number"),
    (b'{"spec": {"command": ["true"], "checkpoint_interval_s": Infinity}}', ["body", "spec", "checkpoint_interval_s"],
     "spec.checkpoint_interval_s=inf: Input should be a finite number"),
    (b'{"spec": {"command": ["echo", "\\ud800"]}}', ["body", "spec", "command"],
     "spec.command[1]='\\ud800': not valid UTF-8 text"),
    (b'{"spec": {"command": ["a\\u0000b"]}}', ["body", "spec", "command"], "spec.command[0]='a\\x00b': contains a NUL"),
    (b'{"spec": {"command": ["true"], "not_before": "9999-12-31T23:00:00Z"}}', ["body", "spec", "not_before"],
     "spec.earliest_start='9999-12-31T23:00:00+00:00': outside 2000-2199"),
    (b'{"spec": {"name": "no-command"}}', ["body", "spec", "command"], "spec.command: Field required"),
    # year 1 with an offset: UTC cannot hold it (an OverflowError, once a 500)
    (b'{"spec": {"command": ["true"], "deadline": "0001-01-01T00:00:00+01:00"}}', ["body", "spec", "deadline"],
     "spec.deadline='0001-01-01T00:00:00+01:00': outside 2000-2199"),
    (b'{"spec": {"command": ["true"], "not_after": "9999-12-31T23:59:59-14:00"}}', ["body", "spec", "not_after"],
     "spec.not_after='9999-12-31T23:59:59-14:00': outside 2000-2199"),
    (b'{"spec": {"command": ["true"], "gpus_per_node": true}}', ["body", "spec", "gpus_per_node"],
     "spec.gpus_per_node=True: a number, not a boolean"),
    # a name is shown in terminals (fedbroker list): an ESC sequence would drive the reader's terminal
    (b'{"spec": {"command": ["true"], "name": "\\u001b]0;PWNED\\u0007\\u001b[2J"}}', ["body", "spec", "name"],
     "spec.name='\\x1b]0;PWNED\\x07\\x1b[2J': contains the control character '\\x1b'"),
    # a bidirectional override shows "train\u202egnp.exe" as "trainexe.png" (issue #20 B7)
    (b'{"spec": {"command": ["true"], "name": "train\\u202egnp.exe"}}', ["body", "spec", "name"],
     "spec.name='train\\u202egnp.exe': contains the format character U+202E"),
    (b'{"spec": {"command": ["true"], "gpu_types": ["A100\\u200b"]}}', ["body", "spec", "gpu_types"],
     "spec.gpu_types[0]='A100\\u200b': contains the format character U+200B"),
])
def test_submit_rejects_non_finite_huge_or_unencodable_values(client, make_team, store, raw, loc, start):
    """Found by a fresh user: these once gave 500s, or were stored and broke every later list."""
    team, h = make_team()
    r = client.post("/v1/jobs", content=raw, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == loc and err["msg"].startswith(start), err["msg"]
    assert client.get("/v1/jobs", headers=h).json() == []  # nothing stored, and listing still works


def test_a_body_over_the_limit_is_413_before_parsing(client, make_team, store):
    from broker.service.api import MAX_BODY_BYTES

    team, h = make_team()
    big = b'{"spec": {"command": ["true"], "name": "' + b"x" * MAX_BODY_BYTES + b'"}}'
    r = client.post("/v1/jobs", content=big, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["detail"] == f"request body: larger than {MAX_BODY_BYTES} bytes"
    assert client.get("/v1/jobs", headers=h).json() == []


def test_an_idempotency_key_with_control_characters_is_422(client, make_team, store):
    """PostgreSQL text cannot hold NUL: such a key once gave a 500 (found by a fresh user)."""
    team, h = make_team()
    r = client.post("/v1/jobs", json={"spec": {"command": ["true"]}, "idempotency_key": "a\u0000b"}, headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "idempotency_key"]
    assert client.get("/v1/jobs", headers=h).json() == []


def test_the_jobs_list_filters_by_exact_name(pg_store):
    """The second hostile pass's new-user note: ``GET /v1/jobs?name=vjob`` ignored the name."""
    import uuid

    from broker.client import Client
    from broker.service.api import create_app
    from broker.service.settings import BrokerSettings
    from broker.service.tokens import create_token
    from tests.broker.harness import ServerThread
    from tests.conftest import auth

    spec = {"command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60}
    team = "t" + uuid.uuid4().hex[:10]
    a = pg_store.submit(team, JobSpec(**spec, name="vjob"))[0].id
    pg_store.submit(team, JobSpec(**spec, name="vjob-2"))
    pg_store.submit(team, JobSpec(**spec))
    with ServerThread(create_app(pg_store, BrokerSettings.model_construct())) as srv:
        h = auth(create_token(pg_store, team, "member", label="t").token)
        sdk = Client(srv.url, token=h["Authorization"][7:])
        assert [j.id for j in sdk.list(name="vjob")] == [a]
        assert sdk.list(name="nope") == [] and len(sdk.list()) == 3
        import requests

        r = requests.get(f"{srv.url}/v1/jobs", params={"name": "a\u202eb"}, headers=h, timeout=10)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "name"]
