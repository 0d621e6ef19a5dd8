"""No team floods the others (issue #20 item 3; finding #3 and #9 of 2026-12-04): the per-team schedule cap,
scheduled runs under the queued-jobs quota (a fire over it is skipped with an event), bounded round-robin run
creation per reconciler pass, and priority classes as team entitlements. Real PostgreSQL.

Hand-checked case: schedules ``* * * * *`` (UTC) created at T0 = 2026-12-04T03:00:00Z fire first at
T0 + 60 s = 03:01:00Z; a fire's job has the idempotency key ``schedule:<id>:2026-12-04T03:01:00+00:00``.
"""

from __future__ import annotations

import uuid
import warnings
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select, update

with warnings.catch_warnings():  # starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

import broker.service.api
from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.cycle import PlanningCycle
from broker.service.reconciler import Reconciler
from broker.service.settings import BrokerSettings, QuotaSettings, TeamQuota
from broker.service.store.quota import ScheduleCapExceeded
from broker.service.store.tables import AuditEvent, Node
from broker.service.tokens import create_token
from tests.conftest import auth

UTC = timezone.utc
T0 = datetime(2026, 12, 4, 3, 0, tzinfo=UTC)
FIRE = T0 + timedelta(seconds=60)
ADMIN = "admin-secret-" + uuid.uuid4().hex
RUN = {"name": "tick", "command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60}


def every_minute(name: str, **spec) -> dict:
    return {"name": name, "cron": "* * * * *", "timezone": "UTC", "spec": {**RUN, **spec}}


def new_team() -> str:
    return "t" + uuid.uuid4().hex[:10]


def settings(**quotas) -> BrokerSettings:
    return BrokerSettings(admin_token=ADMIN, quotas=QuotaSettings(**quotas))


@pytest.fixture
def api(pg_store, monkeypatch):
    """``api(settings) -> TestClient`` over a fresh schema, the API's clock at T0."""
    monkeypatch.setattr(broker.service.api, "_utcnow", lambda: T0)
    clients = []

    def make(st: BrokerSettings) -> TestClient:
        c = TestClient(create_app(pg_store, st))
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def member(store, team: str) -> dict:
    return auth(create_token(store, team, "member", label="test").token)


# ----------------------------------------------------------------------------- 1. the schedule cap
def test_schedule_cap_refuses_the_next_create_with_429_naming_the_limit(pg_store, api):
    capped, granted = new_team(), new_team()
    c = api(settings(max_schedules=3, per_team={granted: TeamQuota(max_schedules=5)}))
    h, g = member(pg_store, capped), member(pg_store, granted)
    for i in range(3):
        assert c.post("/v1/schedules", json=every_minute(f"s{i}"), headers=h).status_code == 201
    r = c.post("/v1/schedules", json=every_minute("s3"), headers=h)
    assert r.status_code == 429, r.text
    assert r.json() == {"detail": f"quotas.max_schedules: team {capped!r} may hold 3 schedules and holds 3; delete "
                                  f"one first (fedbroker schedule delete) or ask for a higher quota",
                        "limit": "quotas.max_schedules", "retry_after_s": None}
    assert "retry-after" not in r.headers  # waiting frees no place: the SDK raises at once
    assert len(pg_store.schedules(capped)) == 3  # nothing stored
    # a paused schedule still counts; deleting one frees a place
    sid = pg_store.schedules(capped)[0].id
    assert c.post(f"/v1/schedules/{sid}/pause", headers=h).status_code == 200
    assert c.post("/v1/schedules", json=every_minute("s3"), headers=h).status_code == 429
    assert c.delete(f"/v1/schedules/{sid}", headers=h).status_code == 204
    assert c.post("/v1/schedules", json=every_minute("s3"), headers=h).status_code == 201
    # the per-team override: 5
    codes = [c.post("/v1/schedules", json=every_minute(f"g{i}"), headers=g).status_code for i in range(6)]
    assert codes == [201] * 5 + [429]
    # the store refuses the same way without the API
    with pytest.raises(ScheduleCapExceeded, match=r"may hold 3 schedules and holds 3"):
        pg_store.create_schedule(capped, "direct", "* * * * *", "UTC", JobSpec(**RUN), now=T0, max_schedules=3)


def test_default_schedule_cap_is_100():
    assert BrokerSettings().quotas.for_team("anyone").max_schedules == 100


# ----------------------------------------------------------------------------- 2. runs under the quota
def test_fire_over_max_queued_jobs_is_skipped_with_an_event(pg_store):
    team = new_team()
    st = settings(per_team={team: TeamQuota(max_queued_jobs=2)})
    sid = pg_store.create_schedule(team, "tick", "* * * * *", "UTC", JobSpec(**RUN), now=T0).id
    held = [pg_store.submit(team, JobSpec(**RUN), now=T0)[0].id for _ in range(2)]  # the team holds its quota

    out = Reconciler(pg_store, st).run(FIRE)
    assert (out["scheduled"], out["schedule_skips"]) == (0, 1)
    assert [j.schedule_id for j in pg_store.list_jobs(team=team)] == [None, None]  # no run was created
    v = pg_store.get_schedule(sid)
    assert v.enabled is True and v.last_skip_at == FIRE and v.last_fire_at == FIRE
    assert v.next_fire_at == FIRE + timedelta(seconds=60)
    assert v.last_skip_reason == (
        f"fire at 2026-12-04T03:01:00+00:00 skipped: quotas.max_queued_jobs: team {team!r} may hold 2 unfinished "
        f"jobs and holds 2; this submit would exceed it (retry after 30 s, or cancel jobs)")
    with pg_store.session() as s:
        ev = s.execute(select(AuditEvent).where(AuditEvent.action == "schedule.skip")).scalars().all()
    assert [(e.target, e.actor_kind, e.detail["team"], e.detail["fire"], e.detail["limit"]) for e in ev] == [
        (sid, "reconciler", team, "2026-12-04T03:01:00+00:00", "quotas.max_queued_jobs")]
    assert ev[0].detail["reason"] == v.last_skip_reason

    # a place frees up: the next fire creates its run
    pg_store.request_cancel(held[0])
    out = Reconciler(pg_store, st).run(FIRE + timedelta(seconds=60))
    assert (out["scheduled"], out["schedule_skips"]) == (1, 0)
    runs = [j for j in pg_store.list_jobs(team=team) if j.schedule_id == sid]
    assert [j.idempotency_key for j in runs] == [f"schedule:{sid}:2026-12-04T03:02:00+00:00"]


def test_a_schedule_api_get_and_list_show_the_skip(pg_store, api):
    team = new_team()
    c = api(settings(per_team={team: TeamQuota(max_queued_jobs=1)}))
    h = member(pg_store, team)
    sid = c.post("/v1/schedules", json=every_minute("tick"), headers=h).json()["id"]
    assert c.post("/v1/jobs", json={"spec": RUN}, headers=h).status_code == 201
    Reconciler(pg_store, settings(per_team={team: TeamQuota(max_queued_jobs=1)})).run(FIRE)
    got = c.get(f"/v1/schedules/{sid}", headers=h).json()
    assert got["last_skip_at"] == "2026-12-04T03:01:00Z"
    assert got["last_skip_reason"].startswith("fire at 2026-12-04T03:01:00+00:00 skipped: quotas.max_queued_jobs: "
                                              f"team {team!r} may hold 1 unfinished jobs and holds 1;")
    assert c.get("/v1/schedules", headers=h).json() == [got]


# ----------------------------------------------------------------------------- 3. bounded, fair run creation
def test_runs_per_pass_are_bounded_and_round_robin_across_teams(pg_store):
    flood, quiet = "a" + uuid.uuid4().hex[:9], "b" + uuid.uuid4().hex[:9]
    for i in range(5):
        pg_store.create_schedule(flood, f"f{i}", "* * * * *", "UTC", JobSpec(**RUN), now=T0)
    for i in range(2):
        pg_store.create_schedule(quiet, f"q{i}", "* * * * *", "UTC", JobSpec(**RUN), now=T0)
    st = settings()
    st.schedule_runs_per_pass = 3

    def runs(team: str) -> int:
        return sum(j.schedule_id is not None for j in pg_store.list_jobs(team=team))

    out = Reconciler(pg_store, st).run(FIRE)
    # round-robin: both teams' earliest due schedules, then one second one (ties between teams go by schedule id)
    assert (out["scheduled"], out["schedules_left"]) == (3, 1)
    assert (runs(flood), runs(quiet)) in ((2, 1), (1, 2))
    out = Reconciler(pg_store, st).run(FIRE + timedelta(seconds=1))
    assert (out["scheduled"], out["schedules_left"], runs(flood), runs(quiet)) == (3, 1, 4, 2)
    out = Reconciler(pg_store, st).run(FIRE + timedelta(seconds=2))
    assert (out["scheduled"], out["schedules_left"], runs(flood), runs(quiet)) == (1, 0, 5, 2)
    # every run has its fire's key: a late pass still creates the fire at 03:01, once
    keys = {j.idempotency_key for t in (flood, quiet) for j in pg_store.list_jobs(team=t)}
    assert len(keys) == 7 and all(k.endswith(":2026-12-04T03:01:00+00:00") for k in keys)


def test_default_runs_per_pass_is_100():
    assert BrokerSettings().schedule_runs_per_pass == 100


# ----------------------------------------------------------------------------- 4. priority entitlements
def test_member_submit_above_its_priority_classes_is_403_naming_field_and_allowed(pg_store, api):
    plain, granted = new_team(), new_team()
    c = api(settings(per_team={granted: TeamQuota(priority_classes=["low", "normal", "high", "critical"])}))
    h, g = member(pg_store, plain), member(pg_store, granted)
    r = c.post("/v1/jobs", json={"spec": {**RUN, "priority_class": "critical"}}, headers=h)
    assert r.status_code == 403, r.text
    assert r.json() == {"detail": f"spec.priority_class='critical': team {plain!r} may use low, normal (an operator "
                                  f"grants more in quotas.per_team.{plain}.priority_classes)"}
    assert pg_store.list_jobs(team=plain) == []
    for cls in ("low", "normal"):
        assert c.post("/v1/jobs", json={"spec": {**RUN, "priority_class": cls}}, headers=h).status_code == 201
    # the granted team, and an admin for any team
    r = c.post("/v1/jobs", json={"spec": {**RUN, "priority_class": "critical"}}, headers=g)
    assert r.status_code == 201 and r.json()["spec"]["priority_class"] == "critical"
    r = c.post("/v1/jobs", json={"spec": {**RUN, "team": plain, "priority_class": "high"}}, headers=auth(ADMIN))
    assert r.status_code == 201 and r.json()["team"] == plain
    # a replay of a job stored while the class was granted still answers that job (idempotent replays are never
    # refused); a new key is refused
    first = c.post("/v1/jobs", json={"spec": {**RUN, "priority_class": "critical"}, "idempotency_key": "k1"}, headers=g)
    assert first.status_code == 201
    revoked = api(settings())
    again = revoked.post("/v1/jobs", json={"spec": {**RUN, "priority_class": "critical"}, "idempotency_key": "k1"},
                         headers=g)
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    assert revoked.post("/v1/jobs", json={"spec": {**RUN, "priority_class": "critical"}, "idempotency_key": "k2"},
                        headers=g).status_code == 403


def test_batch_item_and_schedule_above_entitlement_are_refused(pg_store, api):
    plain = new_team()
    c = api(settings())
    h = member(pg_store, plain)
    r = c.post("/v1/jobs:batch", json={"items": [{"spec": RUN}, {"spec": {**RUN, "priority_class": "high"}},
                                                  {"spec": RUN}]}, headers=h)
    assert r.status_code == 200, r.text
    res = r.json()
    assert [x["status"] for x in res["results"]] == [201, 403, 201]
    assert res["results"][1]["detail"] == (f"items.1.spec.priority_class='high': team {plain!r} may use low, normal "
                                           f"(an operator grants more in quotas.per_team.{plain}.priority_classes)")
    assert (res["created"], res["failed"]) == (2, 1)
    r = c.post("/v1/schedules", json=every_minute("urgent", priority_class="critical"), headers=h)
    assert r.status_code == 403 and r.json()["detail"].startswith("spec.priority_class='critical': team ")
    assert pg_store.schedules(plain) == []


def test_schedule_fire_after_a_revoked_grant_is_skipped(pg_store):
    team = new_team()
    sid = pg_store.create_schedule(team, "urgent", "* * * * *", "UTC", JobSpec(**RUN, priority_class="high"),
                                   now=T0).id
    out = Reconciler(pg_store, settings()).run(FIRE)  # no grant (any more): the default low, normal
    assert (out["scheduled"], out["schedule_skips"]) == (0, 1)
    v = pg_store.get_schedule(sid)
    assert v.last_skip_reason == (f"fire at 2026-12-04T03:01:00+00:00 skipped: spec.priority_class='high': team "
                                  f"{team!r} may use low, normal (an operator grants more in "
                                  f"quotas.per_team.{team}.priority_classes)")
    granted = settings(per_team={team: TeamQuota(priority_classes=["low", "normal", "high"])})
    out = Reconciler(pg_store, granted).run(FIRE + timedelta(seconds=60))
    assert (out["scheduled"], out["schedule_skips"]) == (1, 0)


def test_planner_never_ranks_a_stored_job_above_its_team_entitlement(pg_store):
    """The finding's case on one 1-GPU node: victim's normal job, then evil's ``critical`` one (stored straight
    into the store, as before a revoked grant). evil is planned as ``normal``, its entitlement: victim's older
    job starts first. With evil granted ``critical`` it jumps the queue, as a granted class should."""
    from broker.service.live import LiveEnvironment

    def first_started(grant: bool) -> str:
        victim, evil = new_team(), new_team()
        node = "n" + uuid.uuid4().hex[:8]
        pg_store.heartbeat(node, "local", "V100", 1, 16.0, [0], "agent-" + node)
        per_team = {evil: TeamQuota(priority_classes=["low", "normal", "high", "critical"])} if grant else {}
        st = settings(per_team=per_team)
        v = pg_store.submit(victim, JobSpec(**RUN))[0].id
        e = pg_store.submit(evil, JobSpec(**RUN, priority_class="critical"))[0].id
        PlanningCycle(pg_store, LiveEnvironment(st.planner), st, dispatch=lambda j, a: None).run()
        states = {j: pg_store.get(j).state for j in (v, e)}
        for j in (v, e):  # free the node for the next case
            pg_store.request_cancel(j)
        with pg_store.session() as s:
            s.execute(update(Node).where(Node.name == node).values(state="lost"))
        return [("victim" if j == v else "evil") for j, x in states.items() if x == "starting"][0]

    assert first_started(grant=False) == "victim"
    assert first_started(grant=True) == "evil"


def test_cli_schedule_list_says_why_a_fire_was_skipped(pg_store, monkeypatch):
    from rich.console import Console
    from typer.testing import CliRunner

    from broker.cli import console as cli_console
    from broker.cli import main as cli
    from tests.broker.harness import ServerThread

    monkeypatch.setattr(cli_console, "console", Console(width=300, force_terminal=False, color_system=None))
    team = new_team()
    st = settings(per_team={team: TeamQuota(max_queued_jobs=1)})
    sid = pg_store.create_schedule(team, "tick", "* * * * *", "UTC", JobSpec(**RUN), now=T0).id
    pg_store.submit(team, JobSpec(**RUN), now=T0)
    Reconciler(pg_store, st).run(FIRE)
    with ServerThread(create_app(pg_store, st)) as srv:
        env = {"FEDBROKER_API_URL": srv.url, "FEDBROKER_TOKEN": create_token(pg_store, team).token,
               "FEDBROKER_CONFIG": None}
        r = CliRunner().invoke(cli.app, ["schedule", "list"], env=env)
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert (f"{sid} tick: fire at 2026-12-04T03:01:00+00:00 skipped: quotas.max_queued_jobs: team {team!r} may hold "
            f"1 unfinished jobs and holds 1; this submit would exceed it (retry after 30 s, or cancel jobs)") in flat


def test_sdk_raises_at_once_at_the_schedule_cap(pg_store):
    from broker.client import Client, RateLimited
    from tests.broker.harness import ServerThread

    team = new_team()
    with ServerThread(create_app(pg_store, settings(max_schedules=1))) as srv:
        c = Client(srv.url, create_token(pg_store, team).token)  # max_rate_wait_s 120 s: a 429 with Retry-After waits
        c.create_schedule("one", "* * * * *", JobSpec(**RUN), timezone="UTC")
        with pytest.raises(RateLimited) as e:
            c.create_schedule("two", "* * * * *", JobSpec(**RUN), timezone="UTC")
    assert (e.value.limit, e.value.retry_after) == ("quotas.max_schedules", None)
    assert f"team {team!r} may hold 1 schedules and holds 1" in str(e.value)


def test_a_running_job_above_its_entitlement_is_preempted_as_its_entitled_class(pg_store):
    """evil's preemptible job stored as ``critical`` (evil is granted low/normal only) runs on the one GPU; a
    ``high`` job of a team granted ``high`` preempts it: evil's job is planned as ``normal``. Without the
    entitlement it would rank above ``high`` and never be preempted."""
    from broker.service.live import LiveEnvironment
    from broker.service.store.tables import Job as JobRow
    from broker.service.store.tables import utcnow

    evil, granted = new_team(), new_team()
    st = settings(per_team={granted: TeamQuota(priority_classes=["low", "normal", "high"])})
    pg_store.heartbeat("n-pre", "local", "V100", 1, 16.0, [0], "agent-pre")
    cycle = PlanningCycle(pg_store, LiveEnvironment(st.planner), st, dispatch=lambda j, a: None)
    low = pg_store.submit(evil, JobSpec(command=["/bin/true"], estimated_duration_s=7200.0, preemptible=True,
                                        priority_class="critical"))[0].id
    cycle.run()
    assert pg_store.get(low).state == "starting"
    with pg_store.session() as s:  # running for 1 h (past min_run_before_preempt_s, 30 min)
        j = s.get(JobRow, low)
        j.state, j.started_at = "running", utcnow() - timedelta(hours=1)
    high = pg_store.submit(granted, JobSpec(command=["/bin/true"], estimated_duration_s=600.0, priority_class="high",
                                            deadline=utcnow() + timedelta(minutes=20)))[0].id
    cycle.run()
    reasons = [e.reason for e in pg_store.events(low)]
    assert f"preemption requested for {high}" in reasons, reasons


# ----------------------------------------------------------------------------- 5. the time-limit ceiling
def test_time_limit_over_the_team_ceiling_is_422_naming_the_field_for_every_token(pg_store, api):
    """Hostile pass of 2026-12-04 (B4): ``time_limit_s: 31000000`` was accepted and held a node for a year. The
    ceiling is 7 days by default; the estimate's default limit counts too: (503,750 s x 1.2) + 300 s = 604,800 s
    exactly fits, 503,751 s (604,801.2 s) does not."""
    team, long = new_team(), new_team()
    c = api(settings(per_team={long: TeamQuota(max_time_limit_s=30 * 86400)}))
    h, g = member(pg_store, team), member(pg_store, long)
    r = c.post("/v1/jobs", json={"spec": {**RUN, "time_limit_s": 31_000_000}}, headers=h)
    assert r.status_code == 422, r.text
    assert [(e["loc"], e["msg"]) for e in r.json()["detail"]] == [(["body", "spec", "time_limit_s"], (
        f"spec.time_limit_s=31000000.0: longer than team {team!r} may ask for: at most 604800 s "
        f"(quotas.max_time_limit_s)"))]
    r = c.post("/v1/jobs", json={"spec": {**RUN, "estimated_duration_s": 503_751}}, headers=h)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "spec", "estimated_duration_s"]
    assert r.json()["detail"][0]["msg"].startswith(
        "spec.estimated_duration_s=503751.0: its default time limit (604801 s: the estimate x 1.2 + 300 s) is longer")
    # an admin token is held to the same ceiling (it is the site's, not an entitlement)
    r = c.post("/v1/jobs", json={"spec": {**RUN, "team": team, "time_limit_s": 604_801}}, headers=auth(ADMIN))
    assert r.status_code == 422
    assert pg_store.list_jobs(team=team) == []
    for spec in ({"estimated_duration_s": 503_750}, {"time_limit_s": 604_800, "estimated_duration_s": 600_000}):
        assert c.post("/v1/jobs", json={"spec": {**RUN, **spec}}, headers=h).status_code == 201
    # the per-team override lets 30 days in; a batch item and a schedule over the ceiling are refused the same way
    assert c.post("/v1/jobs", json={"spec": {**RUN, "time_limit_s": 2_000_000}}, headers=g).status_code == 201
    r = c.post("/v1/jobs:batch", json={"items": [{"spec": RUN}, {"spec": {**RUN, "time_limit_s": 31_000_000}}]},
               headers=h)
    assert [x["status"] for x in r.json()["results"]] == [201, 422]
    assert r.json()["results"][1]["detail"][0]["msg"].startswith("items.1.spec.time_limit_s=31000000.0: longer than")
    r = c.post("/v1/schedules", json=every_minute("long", time_limit_s=31_000_000), headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "time_limit_s"]
    assert pg_store.schedules(team) == []
    assert BrokerSettings().quotas.for_team("anyone").max_time_limit_s == 604_800


def test_schedule_fire_after_the_ceiling_was_lowered_is_skipped(pg_store):
    team = new_team()
    sid = pg_store.create_schedule(team, "long", "* * * * *", "UTC", JobSpec(**{**RUN, "time_limit_s": 86_400}),
                                   now=T0).id
    out = Reconciler(pg_store, settings(max_time_limit_s=3600)).run(FIRE)
    assert (out["scheduled"], out["schedule_skips"]) == (0, 1)
    assert pg_store.list_jobs(team=team) == []
    assert pg_store.get_schedule(sid).last_skip_reason == (
        f"fire at 2026-12-04T03:01:00+00:00 skipped: spec.time_limit_s=86400.0: longer than team {team!r} may ask "
        f"for: at most 3600 s (quotas.max_time_limit_s)")


# ----------------------------------------------------------------------------- 6. GPUs held at once
def _gpu_cap_case(pg_store, st, evil, other):
    """One fresh 8-GPU node; evil's two 4-GPU jobs then other's 4-GPU job, each estimated at 60 s with a 7-day
    limit (the finding). Returns ``(cycle, node, [evil a, evil b, other c])``."""
    from broker.service.live import LiveEnvironment

    node = "n" + uuid.uuid4().hex[:8]
    pg_store.heartbeat(node, "local", "V100", 8, 16.0, list(range(8)), "agent-" + node)
    spec = JobSpec(**{**RUN, "gpus_per_node": 4, "time_limit_s": 604_800})
    ids = [pg_store.submit(t, spec)[0].id for t in (evil, evil, other)]
    return PlanningCycle(pg_store, LiveEnvironment(st.planner), st, dispatch=lambda j, a: None), node, ids


def _free(pg_store, node, ids):
    for j in ids:
        pg_store.request_cancel(j)
    with pg_store.session() as s:
        s.execute(update(Node).where(Node.name == node).values(state="lost"))


def test_a_team_at_max_running_gpus_waits_with_the_reason_and_starts_once_its_gpus_free(pg_store):
    from broker.service.store.tables import Job as JobRow
    from broker.service.store.tables import utcnow

    evil, other = new_team(), new_team()
    st = settings(per_team={evil: TeamQuota(max_running_gpus=4)})
    assert st.quotas.for_team(evil).max_running_gpus == 4 and st.quotas.for_team(other).max_running_gpus is None
    cycle, node, (a, b, c) = _gpu_cap_case(pg_store, st, evil, other)
    cycle.run()
    assert [pg_store.get(j).state for j in (a, b, c)] == ["starting", "queued", "starting"]
    assert pg_store.get(b).reason == (f"waiting: team {evil!r} holds 0 of its quotas.max_running_gpus 4 GPUs "
                                      f"(this job needs 4; 4 more are planned for its jobs ahead of it)")
    cycle.run()  # a now holds its 4 GPUs (starting counts: its attempt has not started yet)
    want = f"waiting: team {evil!r} holds 4 of its quotas.max_running_gpus 4 GPUs (this job needs 4)"
    jb = pg_store.get(b)
    assert (jb.state, jb.reason) == ("queued", want)
    assert pg_store.decision(b)["kind"] == "undecided" and pg_store.decision(b)["reason"] == want
    events = len(pg_store.events(b))
    cycle.run()  # the same reason is not written again
    assert (pg_store.get(b).version, len(pg_store.events(b))) == (jb.version, events)
    with pg_store.session() as s:  # a ends
        row = s.get(JobRow, a)
        row.state, row.finished_at = "succeeded", utcnow()
    cycle.run()
    assert pg_store.get(b).state == "starting"
    _free(pg_store, node, (b, c))


def test_max_running_gpus_default_none_changes_nothing(pg_store):
    assert BrokerSettings().quotas.max_running_gpus is None
    assert BrokerSettings().quotas.for_team("anyone").max_running_gpus is None
    evil, other = new_team(), new_team()
    st = settings(per_team={other: TeamQuota(max_running_gpus=0)})  # 0: unlimited, as the other quotas
    cycle, node, (a, b, c) = _gpu_cap_case(pg_store, st, evil, other)
    cycle.run()
    assert [pg_store.get(j).state for j in (a, b)] == ["starting", "starting"]
    assert pg_store.get(c).reason.startswith("waiting for 4 GPU(s) in pool local")
    _free(pg_store, node, (a, b, c))
