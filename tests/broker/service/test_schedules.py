"""Recurring runs (schedules) through the store, the HTTP API, the SDK and the CLI, on real PostgreSQL.

The hand-checked case: cron ``"30 2 * * *"`` (02:30 local time, daily) in America/New_York,
created at 2026-03-07T12:00Z (07:00 EST).

* 02:30 on 2026-03-08 does not exist (clocks jump 02:00 EST -> 03:00 EDT), so the first fire
  is the first instant after the gap: 03:00 EDT = **2026-03-08T07:00Z** (broker.recurring);
* the next one is 02:30 EDT on 2026-03-09 = **2026-03-09T06:30Z**;
* a run's deadline is its creation (the reconciler pass at the fire) + estimated_duration_s
  (1800 s) + slack_s (3600 s).
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from datetime import datetime, timedelta, timezone

import pytest
from rich.console import Console
from sqlalchemy import update
from typer.testing import CliRunner

with warnings.catch_warnings():  # starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

import broker.service.api
from broker.cli import console as cli_console
from broker.cli import main as cli
from broker.service.api import create_app
from broker.client import Client, Conflict, NotFound, ValidationFailed
from broker.service.store.tables import Schedule
from broker.model import JobSpec
from broker.service.reconciler import Reconciler
from broker.recurring import next_fire
from broker.schemas import ScheduleView
from broker.service.settings import BrokerSettings
from broker.service.store.core import InvalidSchedule, JobStore, ScheduleConflict, ScheduleNotFound
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread
from tests.conftest import auth

ADMIN = "admin-secret-" + uuid.uuid4().hex
UTC = timezone.utc
SID_RE = re.compile(r"^sch-[0-9a-f]{16}$")

CREATED = datetime(2026, 3, 7, 12, 0, tzinfo=UTC)
FIRE1 = datetime(2026, 3, 8, 7, 0, tzinfo=UTC)  # 02:30 EST does not exist: end of the gap, 03:00 EDT
FIRE2 = datetime(2026, 3, 9, 6, 30, tzinfo=UTC)  # 02:30 EDT
FIRE3 = datetime(2026, 3, 10, 6, 30, tzinfo=UTC)
NY = "America/New_York"
SPEC = {"name": "nightly-eval", "image": "ghcr.io/acme/eval:3", "command": ["python", "eval.py"], "gpus_per_node": 2,
        "estimated_duration_s": 1800, "slack_s": 3600}




def t(s: str | None) -> datetime | None:
    return None if s is None else datetime.fromisoformat(s)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def client(store):
    with TestClient(create_app(store, BrokerSettings(admin_token=ADMIN))) as c:
        yield c




class Fresh:
    """An API over a schema of its own (the reconciler fires every due schedule of a schema),
    with the API's clock under the test's control."""

    def __init__(self, store: JobStore, client: TestClient, monkeypatch):
        self.store, self.client, self._mp = store, client, monkeypatch

    def clock(self, now: datetime) -> None:
        self._mp.setattr(broker.service.api, "_utcnow", lambda: now)

    def team(self) -> tuple[str, dict]:
        team = "t" + uuid.uuid4().hex[:10]
        return team, auth(create_token(self.store, team).token)

    def reconcile(self, now: datetime) -> int:
        """One reconciler pass by a new Reconciler (another beat); returns the jobs it created."""
        return Reconciler(self.store, BrokerSettings()).run(now)["scheduled"]


@pytest.fixture
def fresh(pg_store, monkeypatch):
    with TestClient(create_app(pg_store)) as c:
        yield Fresh(pg_store, c, monkeypatch)


@pytest.fixture(scope="module")
def server(store):
    with ServerThread(create_app(store, BrokerSettings(admin_token=ADMIN))) as srv:
        yield srv


def nightly(name: str = "nightly", **kw) -> dict:
    return {"name": name, "cron": "30 2 * * *", "timezone": NY, "spec": SPEC, **kw}


# ----------------------------------------------------------------------------- API + reconciler
def test_create_then_fire_exactly_once_across_the_dst_gap(fresh):
    st, c = fresh.store, fresh.client
    team, h = fresh.team()
    fresh.clock(CREATED)
    r = c.post("/v1/schedules", json=nightly(), headers=h)
    assert r.status_code == 201, r.text
    x = r.json()
    sid = x["id"]
    assert SID_RE.match(sid)
    assert r.headers["location"] == f"/v1/schedules/{sid}"
    assert (x["team"], x["name"], x["cron"], x["timezone"], x["enabled"]) == (team, "nightly", "30 2 * * *", NY, True)
    assert t(x["next_fire_at"]) == FIRE1  # the DST gap rule: 03:00 EDT
    assert t(x["created_at"]) == CREATED and x["last_fire_at"] is None
    assert x["spec"]["team"] == team and x["spec"]["slack_s"] == 3600 and x["spec"]["deadline"] is None
    assert c.get(f"/v1/schedules/{sid}", headers=h).json() == x
    assert st.get_schedule(sid).next_fire_at == FIRE1

    # nothing before the fire
    assert fresh.reconcile(FIRE1 - timedelta(seconds=1)) == 0
    assert st.list_jobs(team=team) == []

    # the fire: exactly one job, of the schedule's team, with its spec
    rec = Reconciler(st, BrokerSettings())
    assert rec.run(FIRE1)["scheduled"] == 1
    jobs = st.list_jobs(team=team)
    assert len(jobs) == 1
    j = jobs[0]
    assert (j.schedule_id, j.team, j.spec.team, j.state, j.name) == (sid, team, team, "submitted", "nightly-eval")
    assert j.spec.model_dump() == JobSpec.model_validate({**SPEC, "team": team}).model_dump()
    assert j.idempotency_key == f"schedule:{sid}:2026-03-08T07:00:00+00:00"
    assert j.created_at == FIRE1 and j.deadline == FIRE1 + timedelta(seconds=1800 + 3600)
    assert j.not_before is None and j.not_after is None

    # the same pass again, and a second beat (another Reconciler) at the same instant: no second job
    assert rec.run(FIRE1)["scheduled"] == 0
    assert fresh.reconcile(FIRE1) == 0
    assert fresh.reconcile(FIRE1 + timedelta(minutes=1)) == 0
    assert [jj.id for jj in st.list_jobs(team=team)] == [j.id]

    # next fire advanced past the fire, to 02:30 EDT the next day
    x = c.get(f"/v1/schedules/{sid}", headers=h).json()
    assert t(x["next_fire_at"]) == FIRE2 and t(x["last_fire_at"]) == FIRE1

    # a beat that read the row before the first one advanced it submits with the same key: a replay
    with st.session() as s:
        s.execute(update(Schedule).where(Schedule.id == sid).values(next_fire_at=FIRE1, last_fire_at=None))
    assert fresh.reconcile(FIRE1) == 0
    assert [jj.id for jj in st.list_jobs(team=team)] == [j.id]
    assert st.get_schedule(sid).next_fire_at == FIRE2

    # the next fire creates the next run
    assert fresh.reconcile(FIRE2) == 1
    j2 = st.list_jobs(team=team)[0]
    assert j2.id != j.id and j2.schedule_id == sid
    assert j2.idempotency_key == f"schedule:{sid}:2026-03-09T06:30:00+00:00"
    v = st.get_schedule(sid)
    assert (v.next_fire_at, v.last_fire_at) == (FIRE3, FIRE2)


def test_paused_schedule_creates_nothing_and_resume_skips_missed_fires(fresh):
    st, c = fresh.store, fresh.client
    team, h = fresh.team()
    fresh.clock(CREATED)
    sid = c.post("/v1/schedules", json=nightly(), headers=h).json()["id"]
    r = c.post(f"/v1/schedules/{sid}/pause", headers=h)
    assert r.status_code == 200, r.text
    assert r.json()["enabled"] is False and t(r.json()["next_fire_at"]) == FIRE1
    assert c.post(f"/v1/schedules/{sid}/pause", headers=h).json()["enabled"] is False  # no-op
    assert fresh.reconcile(FIRE1) == 0
    assert fresh.reconcile(FIRE1 + timedelta(hours=5)) == 0
    assert st.list_jobs(team=team) == []
    x = c.get(f"/v1/schedules/{sid}", headers=h).json()
    assert (x["enabled"], t(x["next_fire_at"]), x["last_fire_at"]) == (False, FIRE1, None)

    # resumed after the missed fire: the next fire is the first after now, the missed one is not caught up
    fresh.clock(FIRE1 + timedelta(hours=5))
    r = c.post(f"/v1/schedules/{sid}/resume", headers=h)
    assert r.status_code == 200
    assert r.json()["enabled"] is True and t(r.json()["next_fire_at"]) == FIRE2
    assert fresh.reconcile(FIRE1 + timedelta(hours=5)) == 0
    assert st.list_jobs(team=team) == []
    assert fresh.reconcile(FIRE2) == 1
    assert st.list_jobs(team=team)[0].idempotency_key == f"schedule:{sid}:2026-03-09T06:30:00+00:00"


# ----------------------------------------------------------------------------- API: isolation, conflicts, 422
def test_other_teams_schedules_are_404(client, make_team, store):
    a, ha = make_team()
    b, hb = make_team()
    sa = client.post("/v1/schedules", json=nightly("a-nightly"), headers=ha).json()
    sb = client.post("/v1/schedules", json=nightly("b-nightly"), headers=hb).json()
    missing = "sch-" + "0" * 16
    for method, suffix in [("GET", ""), ("POST", "/pause"), ("POST", "/resume"), ("DELETE", "")]:
        r = client.request(method, f"/v1/schedules/{sa['id']}{suffix}", headers=hb)
        assert r.status_code == 404, (method, suffix, r.text)
        assert r.json()["detail"] == f"schedule_id={sa['id']!r}: no such schedule for team {b!r}"
        # indistinguishable from a schedule that does not exist
        r_missing = client.request(method, f"/v1/schedules/{missing}{suffix}", headers=hb)
        assert r_missing.status_code == 404
        assert r.json()["detail"].replace(sa["id"], "X") == r_missing.json()["detail"].replace(missing, "X")
    x = client.get(f"/v1/schedules/{sa['id']}", headers=ha).json()
    assert x == sa  # untouched: still enabled, still there
    r = client.get("/v1/schedules/nope", headers=ha)
    assert r.status_code == 404 and r.json()["detail"].startswith("schedule_id='nope': no such schedule")

    # lists: own team only; another team is 403; admins see every team
    assert [s["id"] for s in client.get("/v1/schedules", headers=hb).json()] == [sb["id"]]
    r = client.get("/v1/schedules", params={"team": a}, headers=hb)
    assert r.status_code == 403 and r.json()["detail"] == f"team={a!r}: your token belongs to team {b!r}"
    for h_admin in (auth(ADMIN), make_team(admin=True)[1]):
        ids = {s["id"] for s in client.get("/v1/schedules", headers=h_admin).json()}
        assert {sa["id"], sb["id"]} <= ids
        assert [s["id"] for s in client.get("/v1/schedules", params={"team": a}, headers=h_admin).json()] == [sa["id"]]
        assert client.get(f"/v1/schedules/{sb['id']}", headers=h_admin).json()["team"] == b

    # a team token cannot create a schedule for another team
    r = client.post("/v1/schedules", json={**nightly("sneaky"), "spec": {**SPEC, "team": a}}, headers=hb)
    assert r.status_code == 403 and r.json()["detail"] == f"spec.team={a!r}: your token belongs to team {b!r}"
    assert [s.name for s in store.schedules(a)] == ["a-nightly"]

    # the owner deletes it: 204, then it is gone
    r = client.delete(f"/v1/schedules/{sa['id']}", headers=ha)
    assert r.status_code == 204 and r.content == b""
    assert client.get(f"/v1/schedules/{sa['id']}", headers=ha).status_code == 404
    assert client.delete(f"/v1/schedules/{sa['id']}", headers=ha).status_code == 404
    assert store.schedules(a) == [] and [s.id for s in store.schedules(b)] == [sb["id"]]


def test_duplicate_name_is_409_within_a_team(client, make_team, store):
    team, h = make_team()
    other, h2 = make_team()
    r1 = client.post("/v1/schedules", json={"name": "nightly", "cron": "@daily", "spec": SPEC}, headers=h)
    assert r1.status_code == 201, r1.text
    x = r1.json()
    assert (x["cron"], x["timezone"]) == ("0 0 * * *", "UTC")  # stored normalised; UTC by default
    assert t(x["next_fire_at"]) == next_fire("0 0 * * *", "UTC", t(x["created_at"]))
    for body in ({"name": "nightly", "cron": "@daily", "spec": SPEC}, nightly()):
        r = client.post("/v1/schedules", json=body, headers=h)
        assert r.status_code == 409
        assert r.json()["detail"] == (f"name='nightly': team {team!r} already has a schedule with this name "
                                      f"({x['id']}); delete it first or pick another name")
    assert [s.id for s in store.schedules(team)] == [x["id"]]
    r = client.post("/v1/schedules", json=nightly(), headers=h2)  # names are per team
    assert r.status_code == 201 and r.json()["team"] == other


@pytest.mark.parametrize("body, loc, msg_start", [
    (nightly(cron="61 * * * *"), ["body", "cron"], "cron='61 * * * *': "),
    (nightly(cron="0 0 30 2 *"), ["body", "cron"], "cron='0 0 30 2 *': never fires"),
    (nightly(cron="0 0 * * * *"), ["body", "cron"], "cron='0 0 * * * *': need 5 fields"),
    (nightly(timezone="Mars/Base"), ["body", "timezone"], "timezone='Mars/Base': unknown IANA time zone"),
    (nightly(spec={**SPEC, "deadline": "2099-01-01T00:00:00Z"}), ["body", "spec", "deadline"],
     "spec.deadline='2099-01-01T00:00:00+00:00': a recurring run's spec cannot hold an absolute deadline"),
    (nightly(spec={**SPEC, "not_before": "2099-01-01T00:00:00Z"}), ["body", "spec", "earliest_start"],
     "spec.earliest_start='2099-01-01T00:00:00+00:00': a recurring run's spec cannot hold an absolute start"),
    (nightly(spec={**SPEC, "not_after": "2099-01-01T00:00:00Z"}), ["body", "spec", "not_after"],
     "spec.not_after='2099-01-01T00:00:00+00:00': a recurring run's spec cannot hold an absolute latest start"),
    (nightly(name="bad name!"), ["body", "name"], "name='bad name!': 1-200 letters, digits"),
    # a schedule's name is ASCII; its spec's name follows a job's rule: no format character (issue #20 B7)
    (nightly(name="nightly\u202e"), ["body", "name"], "name='nightly\\u202e': 1-200 letters, digits"),
    (nightly(spec={**SPEC, "name": "nightly\u202egnp.exe"}), ["body", "spec", "name"],
     "spec.name='nightly\\u202egnp.exe': contains the format character U+202E"),
    (nightly(spec={**SPEC, "gpus_per_node": 0}), ["body", "spec", "gpus_per_node"],
     "spec.gpus_per_node=0: Input should be greater than or equal to 1"),
    ({**nightly(), "paused": True}, ["body", "paused"], "paused=True: Extra inputs are not permitted"),
    ({"name": "x", "spec": SPEC}, ["body", "cron"], "cron: Field required"),
])
def test_create_422_names_field_and_value(client, make_team, store, body, loc, msg_start):
    team, h = make_team()
    r = client.post("/v1/schedules", json=body, headers=h)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert len(errors) == 1, errors
    assert errors[0]["loc"] == loc
    assert errors[0]["msg"].startswith(msg_start), errors[0]["msg"]
    assert store.schedules(team) == []


def test_create_422_reports_every_bad_field(client, make_team, store):
    team, h = make_team()
    body = nightly(cron="61 * * * *", timezone="Mars/Base")
    r = client.post("/v1/schedules", json=body, headers=h)
    assert r.status_code == 422
    assert sorted(e["loc"][-1] for e in r.json()["detail"]) == ["cron", "timezone"]
    r = client.post("/v1/schedules", json=nightly(spec={**SPEC, "deadline": "2099-01-03T00:00:00Z",
                                                        "not_after": "2099-01-02T00:00:00Z"}), headers=h)
    assert r.status_code == 422
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "spec", "deadline"], ["body", "spec", "not_after"]]
    assert store.schedules(team) == []


# ----------------------------------------------------------------------------- store
def test_store_create_get_pause_resume_delete(any_store):
    st = any_store
    spec = JobSpec.model_validate(SPEC)
    x = st.create_schedule("vision", "nightly", "30  2 * * *", NY, spec, now=CREATED)
    assert isinstance(x, ScheduleView) and SID_RE.match(x.id)
    assert (x.team, x.name, x.cron, x.timezone, x.enabled) == ("vision", "nightly", "30 2 * * *", NY, True)
    assert (x.next_fire_at, x.last_fire_at, x.created_at) == (FIRE1, None, CREATED)
    assert x.spec.team == "vision" and x.spec.slack_s == 3600
    assert st.get_schedule(x.id) == x and st.get_schedule(x.id, "vision") == x
    with pytest.raises(ScheduleNotFound, match=rf"^schedule_id='{x.id}': no such schedule for team 'nlp'$"):
        st.get_schedule(x.id, "nlp")
    with pytest.raises(ScheduleConflict, match=r"^name='nightly': team 'vision' already has a schedule"):
        st.create_schedule("vision", "nightly", "@daily", "UTC", spec, now=CREATED)
    y = st.create_schedule("nlp", "nightly", "@hourly", "UTC", spec, now=CREATED)
    assert y.next_fire_at == datetime(2026, 3, 7, 13, 0, tzinfo=UTC)
    assert [s.id for s in st.schedules("vision")] == [x.id]
    assert [s.id for s in st.schedules()] == [y.id, x.id]  # by team, then name

    bad = JobSpec.model_validate({"command": ["true"], "not_before": "2099-01-01T00:00:00Z", "not_after": "2099-01-02T00:00:00Z",
                                  "deadline": "2099-01-03T00:00:00Z"})
    with pytest.raises(InvalidSchedule) as e:
        st.create_schedule("vision", "bad name!", "61 * * * *", "Mars/Base", bad, now=CREATED)
    assert [f for f, _, _ in e.value.errors] == ["name", "cron", "timezone", "spec.deadline", "spec.earliest_start",
                                                  "spec.not_after"]
    for field, value, msg in e.value.errors:
        assert msg.startswith(f"{field}={value.isoformat() if isinstance(value, datetime) else value!r}: "), msg
    assert len(st.schedules()) == 2
    with pytest.raises(ValueError, match=r"^now='2026-03-07T12:00:00': naive"):
        st.create_schedule("vision", "other", "@daily", "UTC", spec, now=CREATED.replace(tzinfo=None))

    p = st.set_schedule_enabled(x.id, False, "vision", now=CREATED)
    assert p.enabled is False and p.next_fire_at == FIRE1 and st.get_schedule(x.id).enabled is False
    with pytest.raises(ScheduleNotFound):
        st.set_schedule_enabled(x.id, True, "nlp")
    r = st.set_schedule_enabled(x.id, True, now=FIRE1 + timedelta(hours=1))
    assert r.enabled is True and r.next_fire_at == FIRE2  # the fire missed while paused is skipped
    r = st.set_schedule_enabled(x.id, True, now=FIRE2 + timedelta(hours=1))
    assert r.next_fire_at == FIRE2  # already enabled: nothing changes
    assert st.delete_schedule(x.id, "nlp") is False
    assert st.delete_schedule(x.id, "vision") is True
    assert st.delete_schedule(x.id) is False
    assert [s.id for s in st.schedules()] == [y.id]


# ----------------------------------------------------------------------------- SDK and CLI
def test_sdk(server, store):
    team = "t" + uuid.uuid4().hex[:10]
    with Client(server.url, create_token(store, team).token) as c:
        x = c.create_schedule("nightly", "30 2 * * *", JobSpec.model_validate(SPEC), timezone=NY)
        assert isinstance(x, ScheduleView) and SID_RE.match(x.id)
        assert (x.team, x.name, x.cron, x.timezone, x.enabled) == (team, "nightly", "30 2 * * *", NY, True)
        assert x.next_fire_at == next_fire("30 2 * * *", NY, x.created_at)
        assert x.spec.gpus_per_node == 2 and x.spec.team == team
        assert c.get_schedule(x.id) == x
        assert [s.id for s in c.schedules()] == [x.id]
        p = c.pause_schedule(x.id)
        assert p.enabled is False and c.get_schedule(x.id).enabled is False
        r = c.resume_schedule(x.id)
        assert r.enabled is True and r.next_fire_at > r.created_at

        with pytest.raises(Conflict, match="name='nightly'") as e:
            c.create_schedule("nightly", "@daily", SPEC)
        assert e.value.status == 409
        with pytest.raises(ValidationFailed) as e:
            c.create_schedule("hourly", "61 * * * *", SPEC)
        assert e.value.errors[0]["loc"] == ["body", "cron"] and "cron='61 * * * *'" in str(e.value)
        with pytest.raises(ValidationFailed) as e:
            c.create_schedule("hourly", "@hourly", {**SPEC, "deadline": datetime(2099, 1, 1, tzinfo=UTC)})
        assert e.value.errors[0]["loc"] == ["body", "spec", "deadline"]
        assert [s.id for s in c.schedules()] == [x.id]

        assert c.delete_schedule(x.id) is None
        with pytest.raises(NotFound, match="no such schedule"):
            c.get_schedule(x.id)
        with pytest.raises(NotFound):
            c.delete_schedule(x.id)
        assert c.schedules() == [] and store.schedules(team) == []


JOB_YAML = """\
name: resnet-nightly
image: ghcr.io/acme/resnet:2024.1
command: [python, train.py, --epochs, "90"]
gpus_per_node: 4
nodes: 2
estimated_duration_s: 7200
slack_s: 21600
"""


def test_cli(server, store, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_console, "console", Console(width=300, force_terminal=False, color_system=None))
    team = "t" + uuid.uuid4().hex[:10]
    env = {"FEDBROKER_API_URL": server.url, "FEDBROKER_TOKEN": create_token(store, team).token, "FEDBROKER_CONFIG": None}
    runner = CliRunner()

    def run(*args):
        r = runner.invoke(cli.app, list(args), env=env)
        r.flat = " ".join(r.output.split())  # messages as one line, whatever the console wrapped
        return r

    f = tmp_path / "job.yaml"
    f.write_text(JOB_YAML)
    r = run("schedule", "create", "nightly", "--cron", "0 2 * * *", "--timezone", "Europe/London", str(f), "--json")
    assert r.exit_code == 0, r.output
    x = json.loads(r.stdout)
    sid = x["id"]
    assert SID_RE.match(sid)
    assert (x["team"], x["name"], x["cron"], x["timezone"], x["enabled"]) == (team, "nightly", "0 2 * * *",
                                                                              "Europe/London", True)
    assert t(x["next_fire_at"]) == next_fire("0 2 * * *", "Europe/London", t(x["created_at"]))
    assert (x["spec"]["name"], x["spec"]["nodes"], x["spec"]["gpus_per_node"], x["spec"]["slack_s"]) == (
        "resnet-nightly", 2, 4, 21600)

    r = run("schedule", "list", "--json")
    assert r.exit_code == 0 and [s["id"] for s in json.loads(r.stdout)] == [sid]
    r = run("schedule", "list")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if sid in line)
    assert "nightly" in row and "0 2 * * *" in row and "Europe/London" in row and "active" in row and "2x4" in row
    assert "1 schedule(s)" in r.stdout

    r = run("schedule", "pause", sid)
    assert r.exit_code == 0 and r.stdout.strip() == f"{sid} nightly: cron '0 2 * * *' in Europe/London, paused"
    assert "paused" in next(line for line in run("schedule", "list").stdout.splitlines() if sid in line)
    r = run("schedule", "resume", sid, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["enabled"] is True
    r = run("schedule", "resume", sid)
    assert r.exit_code == 0 and r.stdout.startswith(f"{sid} nightly: cron '0 2 * * *' in Europe/London, next run 20")

    # the broker refuses: exit 1 with its message
    r = run("schedule", "create", "nightly", "--cron", "@daily", str(f))
    assert r.exit_code == 1 and f"409 name='nightly': team {team!r} already has a schedule" in r.flat
    # bad options or job file: exit 2, nothing sent
    r = run("schedule", "create", "hourly", "--cron", "61 * * * *", str(f))
    assert r.exit_code == 2 and "--cron='61 * * * *': " in r.flat
    r = run("schedule", "create", "hourly", "--cron", "@hourly", "--timezone", "Mars/Base", str(f))
    assert r.exit_code == 2 and "--timezone='Mars/Base': unknown IANA time zone" in r.flat
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB_YAML + "deadline: 2099-01-01T00:00:00Z\n")
    r = run("schedule", "create", "hourly", "--cron", "@hourly", str(bad))
    assert r.exit_code == 2, r.output
    assert (f"{bad}: deadline='2099-01-01T00:00:00+00:00': a recurring run's spec cannot hold an absolute deadline"
            in r.flat)
    assert [s.id for s in store.schedules(team)] == [sid]

    r = run("schedule", "delete", sid)
    assert r.exit_code == 0 and r.stdout.strip() == f"{sid} deleted"
    r = run("schedule", "delete", sid)
    assert r.exit_code == 1 and f"404 schedule_id={sid!r}: no such schedule" in r.flat
    assert store.schedules(team) == []
