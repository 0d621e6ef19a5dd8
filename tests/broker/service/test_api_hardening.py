"""API hardening (issue #9, items 6 and 8): bounded query parameters, a schema that states the
server's rules, 413 for any oversized body, 422 for non-UTF-8 bodies and duplicate JSON keys."""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.jsonbody import MAX_BODY_BYTES, DuplicateJsonKey, loads_strict
from broker.model import LINE_PATTERN, JobSpec


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def client(store):
    with TestClient(create_app(store)) as c:
        yield c


@pytest.mark.parametrize("path, params, loc, msg", [
    ("/v1/jobs", {"offset": 2**63}, ["query", "offset"],
     "offset='9223372036854775808': Input should be less than or equal to 10000000"),
    ("/v1/jobs", {"offset": 10_000_001}, ["query", "offset"],
     "offset='10000001': Input should be less than or equal to 10000000"),
    ("/v1/jobs", {"team": "x" * 64}, ["query", "team"], "team='" + "x" * 64 + "': String should have at most 63"),
    ("/v1/jobs", {"team": "a b"}, ["query", "team"], "team='a b': String should match pattern"),
    ("/v1/jobs", {"state": ""}, ["query", "state"], "state='': not a job state"),
    ("/v1/schedules", {"team": ""}, ["query", "team"], "team='': String should have at least 1 character"),
])
def test_query_parameters_out_of_bounds_are_422(client, make_team, path, params, loc, msg):
    _, h = make_team()
    r = client.get(path, params=params, headers=h)
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == loc and err["msg"].startswith(msg), err


def test_offset_at_the_bound_is_an_empty_page(client, make_team):
    _, h = make_team()
    r = client.get("/v1/jobs", params={"offset": 10_000_000}, headers=h)
    assert r.status_code == 200 and r.json() == []


@pytest.mark.parametrize("params, msg", [
    ({"rank": 1024}, "rank='1024': Input should be less than or equal to 1023"),
    ({"rank": 2**63}, "rank='9223372036854775808': Input should be less than or equal to 1023"),
    ({"attempt": 2**31}, "attempt='2147483648': Input should be less than or equal to 2147483647"),
])
def test_log_parameters_out_of_bounds_are_422(client, make_team, params, msg):
    _, h = make_team()
    job = client.post("/v1/jobs", json={"spec": {"command": ["true"]}}, headers=h).json()
    r = client.get(f"/v1/jobs/{job['id']}/logs", params=params, headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith(msg), r.text


def test_the_schema_states_the_rules_the_server_enforces(client):
    doc = client.get("/openapi.json").json()
    comp = doc["components"]["schemas"]
    spec = comp["JobSpec"]["properties"]
    assert spec["command"]["minItems"] == 1 and spec["command"]["maxItems"] == 4096
    no_nul = {"pattern": r"^[^\x00]*$"}
    assert spec["command"]["prefixItems"] == [{"type": "string", "minLength": 1, **no_nul}]
    assert spec["command"]["items"] == {"type": "string", **no_nul}
    # names are shown in terminals and on the finance page: no control or format character (broker.model)
    one_line = {"pattern": LINE_PATTERN}
    assert LINE_PATTERN.startswith(r"^[^\x00-\x1f\x7f-\x9f") and "\u202e" in LINE_PATTERN
    assert spec["gpu_types"]["items"] == {"type": "string", "maxLength": 64, **one_line}
    assert spec["name"]["anyOf"][0] == {"type": "string", "maxLength": 200, **one_line}
    assert spec["image"]["pattern"].startswith("^[a-z0-9]+")
    assert (spec["team"]["minLength"], spec["team"]["maxLength"]) == (1, 63)
    sched = comp["ScheduleRequest"]["properties"]
    assert (sched["name"]["minLength"], sched["name"]["maxLength"]) == (1, 200) and sched["name"]["pattern"]
    assert sched["cron"]["minLength"] == 1 and sched["cron"]["pattern"]
    params = {p["name"]: p["schema"] for p in doc["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert params["offset"]["maximum"] == 10_000_000
    states = params["state"]["anyOf"][0]["items"]["enum"]
    assert "submitted" in states and "" not in states
    logs = {p["name"]: p["schema"] for p in doc["paths"]["/v1/jobs/{job_id}/logs"]["get"]["parameters"]}
    assert logs["rank"]["maximum"] == 1023
    assert comp["TokenCreateRequest"]["properties"]["label"]["pattern"] == one_line["pattern"]


def test_a_chunked_body_over_the_limit_is_413(client, make_team):
    """No Content-Length (chunked): counted as it streams in; was a 400 from the JSON parser."""
    team, h = make_team()

    def chunks():
        yield b'{"spec": {"command": ["true"], "name": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}}'

    r = client.post("/v1/jobs", content=chunks(), headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["detail"] == f"request body: larger than {MAX_BODY_BYTES} bytes"
    assert client.get("/v1/jobs", headers=h).json() == []


def test_a_non_utf8_body_is_422_saying_where(client, make_team):
    _, h = make_team()
    raw = b'{"spec": {"command": ["caf\xe9"]}}'
    r = client.post("/v1/jobs", content=raw, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == [{"loc": ["body"], "type": "utf8_invalid",
                                   "msg": "body: not valid UTF-8 (byte 0xe9 at offset 26: invalid continuation byte)"}]


@pytest.mark.parametrize("raw, key", [
    (b'{"spec": {"command": ["true"], "gpus_per_node": 1, "gpus_per_node": 4}}', "gpus_per_node"),
    (b'{"spec": {"command": ["true"]}, "spec": {"command": ["false"]}}', "spec"),
])
def test_a_duplicate_json_key_is_422_naming_it(client, make_team, raw, key):
    _, h = make_team()
    r = client.post("/v1/jobs", content=raw, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["type"] == "duplicate_key" and err["msg"].startswith(f"body: key {key!r} appears twice"), err
    assert client.get("/v1/jobs", headers=h).json() == []


@pytest.mark.parametrize("raw, kind, msg", [
    (b'{"spec": {"command": ["true"], "gpus_per_node": ' + b"9" * 5000 + b"}}", "json_invalid",
     "body: cannot be parsed: Exceeds the limit (4300 digits) for integer string conversion"),
    (b"[" * 100_000 + b"]" * 100_000, "json_too_deep", "body: nested too deeply to parse"),
])
def test_bodies_the_parser_cannot_read_are_422_not_400(client, make_team, raw, kind, msg):
    _, h = make_team()
    r = client.post("/v1/jobs", content=raw, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["type"] == kind and err["msg"].startswith(msg), err


def test_a_duplicate_key_in_a_schedule_body_is_422(client, make_team):
    _, h = make_team()
    raw = b'{"name": "a", "name": "b", "cron": "@daily", "spec": {"command": ["true"], "slack_s": 60}}'
    r = client.post("/v1/schedules", content=raw, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("body: key 'name' appears twice")


def test_loads_strict():
    assert loads_strict(b'{"a": [{"b": 1}, {"b": 2}]}') == {"a": [{"b": 1}, {"b": 2}]}  # same key, other objects
    with pytest.raises(DuplicateJsonKey) as e:
        loads_strict('{"a": {"b": 1, "b": 2}}')
    assert e.value.key == "b"


def test_job_spec_still_names_the_field_for_an_empty_command():
    with pytest.raises(ValueError, match=r"command=\[\]: needs at least a program name"):
        JobSpec(command=[])


def test_healthz_checks_redis(store):
    from broker.service.api import redis_client
    from tests.conftest import REDIS_URL

    with TestClient(create_app(store, redis=redis_client(REDIS_URL))) as c:
        r = c.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "database": "ok", "redis": "ok"}


def test_healthz_503_names_redis_when_it_is_down(store):
    from broker.service.api import redis_client

    with TestClient(create_app(store, redis=redis_client("redis://127.0.0.1:1/0"))) as c:
        r = c.get("/healthz")
    assert r.status_code == 503
    assert r.json() == {"status": "degraded", "database": "ok", "redis": "unavailable",
                        "detail": "redis unavailable: ConnectionError"}


def test_an_id_of_any_length_is_echoed_cut_in_the_404(client, make_team):
    """Found by a hostile review: a 5,000-character job id in the URL came back whole in the error."""
    _, h = make_team()
    r = client.get("/v1/jobs/" + "j" * 5000, headers=h)
    assert r.status_code == 404 and len(r.text) < 400
    assert r.json()["detail"].startswith("job_id='" + "j" * 199 + "...': no such job")
