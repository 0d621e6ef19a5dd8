"""Project budgets (issue #12 item 4, optional per (team, project)) on a real PostgreSQL store: the state counts
only the project's ledger lines and jobs (hand-worked), the soft alert, and the hard cap through the real planning
cycle: a project's cap holds that project's cloud burst while another project of the team still bursts, the
team's cap still holds every project, the overshoot stays bounded as stated for team caps, no job is lost; the
API round trip with the rights of admins and team admins."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from broker.model import JobSpec
from broker.service.budgets import BudgetError, budget_states, planner_budgets, remove_budget, set_budget
from broker.service.store import usage
from broker.service.store.core import JobStore
from broker.service.store.tables import AuditEvent, Job
from tests.broker.service.test_budgets import IMAGE, NOW, _line, _world


def _place_cloud_project(store: JobStore, team: str, project: str | None, dollars: float,
                         state: str = "provisioning") -> str:
    """A job of ``team``'s ``project`` placed on a cloud offer by a decision costing ``dollars`` USD."""
    jid = store.submit(team, JobSpec(command=["true"], project=project), now=NOW)[0].id
    with store.session() as s:
        j = s.get(Job, jid)
        j.state, j.placement = state, {"kind": "cloud", "offer_id": "aws:x", "provider": "aws"}
        j.decision = {"kind": "provision", "option": {"kind": "cloud", "dollars_usd": dollars}}
    return jid


def test_a_project_state_counts_only_its_projects_lines_and_jobs(pg_store):
    with pg_store.session() as s:
        usage.add_usage(s, [
            _line("job-a", "ml", NOW - timedelta(days=2), 60.0, project="a"),  # counted in a
            _line("job-b", "ml", NOW - timedelta(days=2), 25.0, project="b"),  # project b: not a's
            _line("job-c", "ml", NOW - timedelta(days=2), 9.0),  # no project: the team's only
            _line("job-d", "vision", NOW - timedelta(days=2), 4.0, project="a"),  # another team's project a
        ], NOW)
    _place_cloud_project(pg_store, "ml", "a", 15.0)
    _place_cloud_project(pg_store, "ml", "b", 3.0)
    _place_cloud_project(pg_store, "vision", "a", 2.0)
    a = set_budget(pg_store, "ml", 100.0, 0.75, project="a", now=NOW)
    # spent 60 + committed 15 = 75 of 100: remaining 25; 75 >= 0.75 x 100: alert;
    # forecast 75 + 60 / 10 d x 21 d = 201 USD
    assert (a.team, a.project, a.spent_usd, a.committed_usd, a.committed_attempts) == ("ml", "a", 60.0, 15.0, 1)
    assert a.remaining_usd == pytest.approx(25.0) and a.forecast_usd == pytest.approx(201.0)
    assert a.alert and not a.capped
    team = set_budget(pg_store, "ml", 200.0, now=NOW)  # the team's budget counts every project and none
    assert (team.project, team.spent_usd, team.committed_usd) == (None, 94.0, 18.0)
    set_budget(pg_store, "ml", 20.0, project="b", now=NOW)  # 25 + 3 = 28 > 20: capped
    with pg_store.session() as s:
        states = budget_states(s, NOW, projects=True)
        assert [(b.team, b.project) for b in budget_states(s, NOW)] == [("ml", None)]  # teams only, as before
        teams, projects, _ = planner_budgets(s, NOW)
    assert [(b.team, b.project, b.remaining_usd, b.capped) for b in states] == [("ml", "a", 25.0, False),
                                                                              ("ml", "b", -8.0, True)]
    assert teams == {"ml": pytest.approx(88.0)}
    assert projects == {"ml": {"a": pytest.approx(25.0), "b": pytest.approx(-8.0)}}


def test_a_projects_soft_alert_is_raised_once_a_month_naming_the_project(pg_store, caplog):
    _place_cloud_project(pg_store, "ml", "a", 85.0)
    set_budget(pg_store, "ml", 100.0, project="a", now=NOW)
    for _ in range(2):
        with pg_store.session() as s:
            planner_budgets(s, NOW)
    with pg_store.session() as s:
        evs = [(e.target, e.detail["project"], e.detail["committed_usd"]) for e in
               s.execute(select(AuditEvent).where(AuditEvent.action == "budget.alert")).scalars()]
    assert evs == [("ml", "a", 85.0)]
    assert "project a of team ml: cloud budget alert for 2026-12" in caplog.text


def test_bad_project_input_names_the_field(pg_store):
    with pytest.raises(BudgetError, match="project='no spaces'"):
        set_budget(pg_store, "ml", 1.0, project="no spaces")
    with pytest.raises(BudgetError, match="project=''"):
        remove_budget(pg_store, "ml", project="")
    with pytest.raises(ValueError, match="project='a b'"):
        JobSpec(command=["true"], project="a b")
    assert remove_budget(pg_store, "ml", project="a") is False
    set_budget(pg_store, "ml", 1.0, project="a")
    set_budget(pg_store, "ml", 2.0)
    assert remove_budget(pg_store, "ml", project="a") is True  # the team's budget stays
    with pg_store.session() as s:
        assert [(b.project, b.cap_usd) for b in budget_states(s, NOW, "ml")] == [(None, 2.0)]


# ----------------------------------------------------------------------------- the hard cap in the live cycle

def _submit(store, project: str, n: int, at) -> list[str]:
    """``n`` urgent jobs of team ml's ``project`` submitted at ``at``, ``at`` + 10 s, ... (queue order: oldest
    first): 1 h of V100 work due at NOW + 40 min; only a fast cloud GPU meets that (test_budgets._submit)."""
    spec = JobSpec(command=["true"], estimated_duration_s=3600.0, deadline=NOW + timedelta(minutes=40), image=IMAGE,
                   project=project)
    return [store.submit("ml", spec, now=at + timedelta(seconds=10 * k))[0].id for k in range(n)]


def _price(store, cyc) -> float:
    """The cloud option's estimate (USD) of one such job, from an unbudgeted plan; the jobs are then removed."""
    ids = _submit(store, "x", 2, NOW - timedelta(minutes=3))
    assert cyc.run(now=NOW).kinds == {"provision": 2}  # unbudgeted, both burst (the V100 would run them late)
    (price,) = {store.decision(i)["option"]["dollars_usd"] for i in ids}
    with store.session() as s:
        for j in s.execute(select(Job)).scalars():
            s.delete(j)
    return price


def _burst(store, cyc):
    """Three jobs of project b (the older: first in queue order), then three of project a; one cycle.
    Returns ``(cycle result, {project: job ids})``."""
    ids = {"b": _submit(store, "b", 3, NOW - timedelta(minutes=2)), "a": _submit(store, "a", 3, NOW - timedelta(minutes=1))}
    res = cyc.run(now=NOW)
    return res, ids


def test_a_project_cap_holds_its_cloud_burst_while_another_project_of_the_team_bursts(pg_store):
    cyc, sent = _world(pg_store)
    price = _price(pg_store, cyc)
    cap = 1.5 * price  # project a: one cloud job
    set_budget(pg_store, "ml", cap, project="a", now=NOW)
    sent.clear()
    res, ids = _burst(pg_store, cyc)
    # b0..b2 burst (no cap on b, none on the team); a0 bursts (price <= 1.5 x price); a1 would take a past its
    # cap: decided again without the cloud, it starts on the V100 (late); a2 waits for the V100
    assert res.kinds == {"start": 1, "provision": 4, "wait": 1}, res.kinds
    st = {p: [pg_store.get(i).state for i in ids[p]] for p in ids}
    assert st["b"] == ["provisioning"] * 3 and st["a"][0] == "provisioning" and st["a"][2] == "queued", st
    assert st["a"][1] not in ("provisioning", "queued")  # on the V100
    assert pg_store.get(ids["a"][1]).placement["kind"] == "onprem"
    assert [pg_store.decision(i)["kind"] for i in ids["a"][1:]] == ["start", "wait"]
    for i in ids["a"][1:]:
        rec = pg_store.decision(i)
        assert rec["reason"].startswith(
            f"project budget cap reached: project a of team ml has ${0.5 * price:.2f} of its cloud budget left this "
            "month and cloud offer ")
    assert pg_store.get(ids["a"][2]).reason.startswith("project budget cap reached: project a of team ml")
    with pg_store.session() as s:
        (a,) = budget_states(s, NOW, "ml", "a")
    assert a.committed_usd == pytest.approx(price) and a.remaining_usd == pytest.approx(0.5 * price)
    # the next cycles add no cloud spend for a; a's attempt ends 30 % over its estimate: spent 1.3 x price
    for k in range(1, 3):
        assert cyc.run(now=NOW + timedelta(seconds=60 * k)).kinds.get("provision", 0) == 0
    with pg_store.session() as s:
        j = s.get(Job, ids["a"][0])
        j.state, j.finished_at = "succeeded", NOW + timedelta(hours=1)
        usage.add_usage(s, [_line(ids["a"][0], "ml", NOW, 1.3 * price, project="a")], NOW)
    later = NOW + timedelta(hours=1, minutes=5)
    with pg_store.session() as s:
        (a,) = budget_states(s, later, "ml", "a")
    assert a.spent_usd == pytest.approx(1.3 * price) and a.committed_usd == 0.0
    pg_store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=later)
    assert cyc.run(now=later).kinds.get("provision", 0) == 0  # 0.2 x price left < one job
    # overshoot bounded as stated: estimates never passed the cap; the ledger passes it only by the run's overrun
    assert a.spent_usd + a.committed_usd <= cap + 0.3 * price + 1e-9
    states = [pg_store.get(i).state for p in ids for i in ids[p]]
    assert len(states) == 6 and "failed" not in states and "cancelled" not in states  # none lost


def test_the_team_cap_still_holds_every_project_and_says_so(pg_store):
    cyc, sent = _world(pg_store)
    price = _price(pg_store, cyc)
    set_budget(pg_store, "ml", 2.5 * price, now=NOW)  # the team: two cloud jobs
    set_budget(pg_store, "ml", 10 * price, project="a", now=NOW)  # project a's own cap is not the binding one
    res, ids = _burst(pg_store, cyc)
    # b0 and b1 burst (2 x price of the team's 2.5); b2 would pass the team's cap: it starts on the V100; a0..a2
    # are held by the team's cap too (project a's 10 x price does not lift it) and wait for the V100
    assert res.kinds == {"start": 1, "provision": 2, "wait": 3}, res.kinds
    assert [pg_store.get(i).placement["kind"] for i in ids["b"]] == ["cloud", "cloud", "onprem"]
    assert [pg_store.get(i).state for i in ids["a"]] == ["queued"] * 3
    for i in ids["a"] + ids["b"][2:]:
        assert pg_store.decision(i)["reason"].startswith(
            f"team budget cap reached: team ml has ${0.5 * price:.2f} of its cloud budget left this month")
    with pg_store.session() as s:
        (team,) = budget_states(s, NOW, "ml")
        (a,) = budget_states(s, NOW, "ml", "a")
    assert team.committed_usd == pytest.approx(2 * price) and a.committed_usd == 0.0


def test_a_spent_project_budget_keeps_a_job_only_the_cloud_can_hold_undecided_and_says_why(pg_store):
    cyc, sent = _world(pg_store)
    set_budget(pg_store, "ml", 0.0, project="a", now=NOW)
    spec = JobSpec(command=["true"], estimated_duration_s=3600.0, gpus_per_node=8, deadline=NOW + timedelta(hours=3),
                   image=IMAGE, project="a")  # 8 GPUs: the 1-GPU node can never hold it
    jid = pg_store.submit("ml", spec, now=NOW)[0].id
    other = pg_store.submit("ml", spec.model_copy(update={"project": "b"}), now=NOW)[0].id
    res = cyc.run(now=NOW)
    assert res.kinds == {"provision": 1} and sent == [other]  # project b bursts
    j = pg_store.get(jid)
    assert j.state == "queued"
    assert j.reason.startswith("project budget cap reached: project a of team ml has $0.00 of its $0.00 cloud budget "
                               "left for 2026-12; no new cloud spend")


# ----------------------------------------------------------------------------- the API

def test_project_budget_routes_round_trip(pg_store):
    import uuid
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    from broker.service.api import create_app
    from broker.service.budgets import month_bounds
    from broker.service.settings import BrokerSettings
    from broker.service.store.tables import utcnow
    from broker.service.tokens import create_token
    from tests.conftest import auth

    admin = "admin-" + uuid.uuid4().hex
    lead = create_token(pg_store, "ml", "team-admin").token
    ml = create_token(pg_store, "ml").token
    other_lead = create_token(pg_store, "vision", "team-admin").token
    month0, _ = month_bounds(utcnow())
    with pg_store.session() as s:
        usage.add_usage(s, [_line("job-a", "ml", month0, 12.0, project="a"),
                            _line("job-b", "ml", month0, 30.0, project="b")], month0)
    with TestClient(create_app(pg_store, BrokerSettings(admin_token=admin))) as c:
        body = {"cap_usd": 40.0, "alert_fraction": 0.25}
        assert c.put("/v1/budgets/ml?project=a", json=body, headers=auth(ml)).status_code == 403  # a member
        assert c.put("/v1/budgets/ml?project=a", json=body, headers=auth(other_lead)).status_code == 403
        assert c.put("/v1/budgets/ml", json=body, headers=auth(lead)).status_code == 403  # the team's: admins only
        r = c.put("/v1/budgets/ml?project=a", json=body, headers=auth(lead))  # the team's own team admin
        assert r.status_code == 200, r.text
        # project a: 12 spent of 40: remaining 28; 12 >= 0.25 x 40 = 10: alert
        b = r.json()
        assert (b["team"], b["project"], b["spent_usd"], b["remaining_usd"], b["alert"], b["capped"]) == (
            "ml", "a", 12.0, 28.0, True, False)
        assert c.put("/v1/budgets/ml?project=b", json={"cap_usd": 25.0}, headers=auth(admin)).status_code == 200
        assert c.get("/v1/budgets/ml?project=a", headers=auth(ml)).json()["remaining_usd"] == 28.0
        assert c.get("/v1/budgets/ml?project=c", headers=auth(ml)).status_code == 404
        assert c.get("/v1/budgets/ml?project=a", headers=auth(other_lead)).status_code == 404
        assert c.get("/v1/budgets", headers=auth(ml)).json() == []  # the team budgets, as before: none
        got = c.get("/v1/budgets?projects=true", headers=auth(ml)).json()
        assert [(x["project"], x["remaining_usd"], x["capped"]) for x in got] == [("a", 28.0, False), ("b", -5.0, True)]
        assert [x["project"] for x in c.get("/v1/budgets?project=b", headers=auth(admin)).json()] == ["b"]
        assert c.get("/v1/budgets?projects=true", headers=auth(other_lead)).json() == []
        r = c.put("/v1/budgets/ml?project=a%20b", json=body, headers=auth(admin))
        assert r.status_code == 422 and "project" in r.text
        assert c.delete("/v1/budgets/ml?project=a", headers=auth(ml)).status_code == 403
        assert c.delete("/v1/budgets/ml?project=a", headers=auth(lead)).status_code == 204
        assert c.delete("/v1/budgets/ml?project=a", headers=auth(lead)).status_code == 404
    with pg_store.session() as s:
        acts = [(e.action, e.detail.get("project")) for e in
                s.execute(select(AuditEvent).where(AuditEvent.target == "ml", AuditEvent.action.like("budget.%"))
                          .order_by(AuditEvent.id)).scalars()]
    assert acts == [("budget.set", "a"), ("budget.set", "b"), ("budget.delete", "a")]
