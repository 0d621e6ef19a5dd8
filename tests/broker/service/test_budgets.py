"""Team budgets (issue #12 item 4) on a real store: the state (spent, committed, remaining, forecast) with
hand-worked figures, the soft alert, and the hard cap through the real planning cycle."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from broker.model import JobSpec
from broker.service.budgets import BudgetError, budget_states, forecast_usd, month_bounds, planner_budgets, \
    remove_budget, set_budget
from broker.service.cycle import PlanningCycle
from broker.service.live import LiveEnvironment
from broker.service.settings import BrokerSettings
from broker.service.store import usage
from broker.service.store.core import JobStore
from broker.service.store.tables import AuditEvent, Job
from broker.usage import UsageRecord

UTC = timezone.utc
#: 11 December 2026 00:00 UTC: 10 of December's 31 days elapsed, 21 left
NOW = datetime(2026, 12, 11, tzinfo=UTC)
IMAGE = "ghcr.io/fedbroker/train@sha256:" + "a" * 64


def _line(job_id: str, team: str, start: datetime, usd: float | None, provider: str = "aws", line: str = "instance",
          attempt: int = 1, project: str | None = None) -> UsageRecord:
    unknown = usd is None
    return UsageRecord(job_id=job_id, attempt=attempt, rank=0, line=line, resource=f"i-{job_id}", team=team,
                       project=project,
                       start=start, end=start + timedelta(hours=1), provider=provider, gpu_type="V100", gpu_count=1,
                       run_s=3600.0, billed_s=3600.0, list_unit_price_usd=usd, billed_usd=usd, energy_kwh=0.3,
                       carbon_kg=0.1, pricing_unit={"instance": "Hours", "energy": "kWh"}[line],
                       estimated=unknown, estimate_reasons=("no price for the hour",) if unknown else ())


def _place_cloud(store: JobStore, team: str, dollars: float, state: str = "provisioning") -> str:
    """A job of ``team`` placed on a cloud offer by a decision costing ``dollars`` USD."""
    jid = store.submit(team, JobSpec(command=["true"]), now=NOW)[0].id
    with store.session() as s:
        j = s.get(Job, jid)
        j.state, j.placement = state, {"kind": "cloud", "offer_id": "aws:x", "provider": "aws"}
        j.decision = {"kind": "provision", "option": {"kind": "cloud", "dollars_usd": dollars}}
    return jid


def test_month_bounds_and_the_linear_forecast_hand_worked():
    assert month_bounds(NOW) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert month_bounds(datetime(2027, 2, 28, 23, 59, tzinfo=UTC)) == (datetime(2027, 2, 1, tzinfo=UTC),
                                                                       datetime(2027, 3, 1, tzinfo=UTC))
    start, end = month_bounds(NOW)
    # 100 USD spent in 10 days = 10 USD/day; 21 days left: 100 + 20 committed + 210 = 330 USD
    assert forecast_usd(100.0, 20.0, start, end, NOW) == pytest.approx(330.0)
    assert forecast_usd(0.0, 5.0, start, end, start) == 5.0  # nothing elapsed: no rate yet
    with pytest.raises(BudgetError, match="now="):
        month_bounds(datetime(2026, 12, 11))


def test_the_state_counts_the_months_cloud_lines_and_the_committed_attempts(pg_store):
    with pg_store.session() as s:
        usage.add_usage(s, [
            _line("job-a", "ml", datetime(2026, 12, 2, tzinfo=UTC), 100.0),  # counted
            _line("job-b", "ml", datetime(2026, 11, 30, 23, tzinfo=UTC), 999.0),  # November: not this month
            _line("job-c", "ml", datetime(2026, 12, 3, tzinfo=UTC), 50.0, provider="onprem", line="energy"),
            _line("job-d", "ml", datetime(2026, 12, 4, tzinfo=UTC), None),  # unknown cost: flagged, counted 0
            _line("job-e", "vision", datetime(2026, 12, 4, tzinfo=UTC), 7.0),  # another team
        ], NOW)
    _place_cloud(pg_store, "ml", 20.0)  # committed: provisioning on a cloud offer
    _place_cloud(pg_store, "vision", 3.0, state="running")
    onprem = pg_store.submit("ml", JobSpec(command=["true"]), now=NOW)[0].id
    with pg_store.session() as s:  # an on-prem attempt commits no cloud money
        j = s.get(Job, onprem)
        j.state, j.placement = "running", {"kind": "onprem", "pool": "local", "nodes": []}
        j.decision = {"kind": "start", "option": {"kind": "onprem", "dollars_usd": 4.0}}
    st = set_budget(pg_store, "ml", 400.0, 0.25, now=NOW)
    # spent 100 (Dec cloud lines only); committed 20; remaining 400 - 120 = 280; forecast 330 (hand-worked above);
    # alert at 0.25 x 400 = 100 <= 120
    assert (st.month, st.spent_usd, st.unpriced_lines, st.committed_usd, st.committed_attempts) == ("2026-12", 100.0, 1,
                                                                                                   20.0, 1)
    assert st.remaining_usd == pytest.approx(280.0) and st.forecast_usd == pytest.approx(330.0)
    assert st.alert and not st.capped
    set_budget(pg_store, "vision", 10.0, now=NOW)
    with pg_store.session() as s:
        states = {b.team: b for b in budget_states(s, NOW)}
    # vision: 7 spent + 3 committed = the 10 USD cap: capped (remaining 0), alert at 8
    assert states["vision"].remaining_usd == pytest.approx(0.0) and states["vision"].capped and states["vision"].alert
    assert list(states) == ["ml", "vision"]


def test_the_soft_alert_is_raised_once_a_month_and_rearmed_by_a_new_cap(pg_store, caplog):
    _place_cloud(pg_store, "ml", 85.0)
    set_budget(pg_store, "ml", 100.0, now=NOW)  # default alert at 80 %: 85 committed reaches it

    def alerts():
        with pg_store.session() as s:
            return [(e.target, e.detail["month"]) for e in
                    s.execute(select(AuditEvent).where(AuditEvent.action == "budget.alert")).scalars()]

    for _ in range(2):
        with pg_store.session() as s:
            remaining, _projects, _states = planner_budgets(s, NOW)
    assert remaining == {"ml": pytest.approx(15.0)}
    assert alerts() == [("ml", "2026-12")]
    assert "team ml: cloud budget alert for 2026-12" in caplog.text
    set_budget(pg_store, "ml", 105.0, now=NOW)  # a new cap re-arms it (85 >= 84)
    with pg_store.session() as s:
        planner_budgets(s, NOW)
    assert alerts() == [("ml", "2026-12"), ("ml", "2026-12")]
    set_budget(pg_store, "ml", 1000.0, now=NOW)
    with pg_store.session() as s:
        planner_budgets(s, NOW)
    assert len(alerts()) == 2  # 85 < 800: no alert


def test_a_planning_cycle_with_no_job_waiting_still_raises_the_alert(pg_store):
    cyc, _ = _world(pg_store)
    _place_cloud(pg_store, "ml", 9.0)  # running on a cloud offer; nothing queued
    set_budget(pg_store, "ml", 10.0, now=NOW)
    cyc.run(now=NOW)
    with pg_store.session() as s:
        ev = s.execute(select(AuditEvent).where(AuditEvent.action == "budget.alert")).scalar_one()
    assert (ev.target, ev.actor_kind, ev.detail["committed_usd"], ev.detail["cap_usd"]) == ("ml", "database", 9.0, 10.0)


def test_bad_budget_input_names_the_field(pg_store):
    for kw, field in (({"team": "no spaces", "cap_usd": 1.0}, "team="), ({"team": "ml", "cap_usd": -1.0}, "cap_usd="),
                      ({"team": "ml", "cap_usd": float("inf")}, "cap_usd="),
                      ({"team": "ml", "cap_usd": 1.0, "alert_fraction": 0.0}, "alert_fraction="),
                      ({"team": "ml", "cap_usd": 1.0, "alert_fraction": 1.5}, "alert_fraction=")):
        with pytest.raises(BudgetError, match=field):
            set_budget(pg_store, **kw)
    assert remove_budget(pg_store, "ml") is False
    set_budget(pg_store, "ml", 1.0)
    assert remove_budget(pg_store, "ml") is True


def test_a_cap_is_0_or_a_cent_to_1e12_usd_and_the_error_names_it(pg_store):
    # cb5ea98 took 1e308 (printed as a 60-digit number) and 1e-300 (shown as 0.00) through set_budget (the CLI)
    for cap, why in ((1e308, r"cap_usd=1e\+308: above the largest cap, 1e\+12 USD a month"),
                     (1e12 + 1, "above the largest cap"), (1e-300, "cap_usd=1e-300: below a cent"),
                     (0.009, "below a cent: give 0 for no cloud at all")):
        with pytest.raises(BudgetError, match=why):
            set_budget(pg_store, "ml", cap, now=NOW)
    assert set_budget(pg_store, "ml", 1e12, now=NOW).cap_usd == 1e12
    assert set_budget(pg_store, "ml", 0.01, now=NOW).cap_usd == 0.01


def test_a_0_cap_alerts_on_the_first_cloud_spend_not_before_and_never_logs_inf(pg_store, caplog):
    # cb5ea98: "spent 0.00 + committed 0.00 USD = inf % of the 0.00 USD cap" and a budget.alert with nothing spent
    st = set_budget(pg_store, "ml", 0.0, now=NOW)
    assert (st.alert, st.capped, st.remaining_usd) == (False, True, 0.0)

    def alerts():
        with pg_store.session() as s:
            return [e.detail for e in s.execute(select(AuditEvent).where(AuditEvent.action == "budget.alert")).scalars()]

    with pg_store.session() as s:
        planner_budgets(s, NOW)
    assert alerts() == [] and "inf" not in caplog.text
    _place_cloud(pg_store, "ml", 2.5)  # cloud spend committed against a 0 cap
    with pg_store.session() as s:
        (st,) = budget_states(s, NOW, "ml")
        planner_budgets(s, NOW)
    assert (st.alert, st.committed_usd) == (True, 2.5)
    assert [(a["cap_usd"], a["committed_usd"]) for a in alerts()] == [(0.0, 2.5)]
    assert ("team ml: cloud budget alert for 2026-12: spent 0.00 + committed 2.50 USD against a 0 USD cap (no cloud "
            "allowed)") in caplog.text
    assert "inf" not in caplog.text


def test_a_team_the_broker_does_not_know_is_refused_unless_new(pg_store):
    from broker.service.tokens import create_token

    with pytest.raises(BudgetError, match=r"^team='nosuchteam': no token, job or budget of this team: a typo\?"):
        set_budget(pg_store, "nosuchteam", 100.0, now=NOW, require_known_team=True)
    assert set_budget(pg_store, "nosuchteam", 100.0, now=NOW).cap_usd == 100.0  # new_team: set before its tokens
    assert set_budget(pg_store, "nosuchteam", 50.0, now=NOW, require_known_team=True).cap_usd == 50.0  # has a budget
    create_token(pg_store, "vision")
    assert set_budget(pg_store, "vision", 10.0, now=NOW, require_known_team=True).team == "vision"  # has a token
    _submit(pg_store, 1, team="nlp")
    assert set_budget(pg_store, "nlp", 10.0, now=NOW, require_known_team=True).team == "nlp"  # has a job


# ----------------------------------------------------------------------------- the hard cap in the live cycle

def _world(store):
    """One 1-GPU (V100) on-prem node; AWS and GCP offers provisionable; the default planner."""
    st = BrokerSettings()
    env = LiveEnvironment(st.planner, None, ("aws", "gcp"))
    store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=NOW)
    sent: list = []
    return PlanningCycle(store, env, st, dispatch=lambda j, a: sent.append(j)), sent


def _submit(store, n: int, team: str = "ml") -> list[str]:
    """``n`` urgent jobs: 1 h of V100 work due in 40 min. Only a fast cloud GPU meets that (an H100 takes about
    17 min plus the provisioning delay); on the V100 node each runs late."""
    spec = JobSpec(command=["true"], estimated_duration_s=3600.0, deadline=NOW + timedelta(minutes=40), image=IMAGE)
    return [store.submit(team, spec, now=NOW)[0].id for _ in range(n)]


def test_without_a_budget_the_burst_goes_to_the_cloud(pg_store):
    cyc, sent = _world(pg_store)
    ids = _submit(pg_store, 6)
    res = cyc.run(now=NOW)
    assert res.kinds == {"provision": 6}
    assert sorted(sent) == sorted(ids)


def test_a_hard_cap_holds_the_burst_on_prem_loses_no_job_and_never_overshoots(pg_store):
    cyc, sent = _world(pg_store)
    ids = _submit(pg_store, 8)
    # the cloud option each job gets (all alike): read from the unbudgeted plan of the same burst
    assert cyc.run(now=NOW).kinds == {"provision": 8}
    prices = {pg_store.decision(i)["option"]["dollars_usd"] for i in ids}
    assert len(prices) == 1
    price = prices.pop()
    # the same burst again, from scratch, under a cap that holds two cloud jobs and a half (2.5 x price)
    with pg_store.session() as s:
        for j in s.execute(select(Job)).scalars():
            s.delete(j)
    cap = 2.5 * price
    set_budget(pg_store, "ml", cap, now=NOW)
    sent.clear()
    ids = _submit(pg_store, 8)
    res = cyc.run(now=NOW)
    # one starts on-prem, two burst (2 x price <= cap), the third would take 3 x price > cap: five wait on-prem
    assert res.kinds == {"start": 1, "provision": 2, "wait": 5}, res.kinds
    jobs = {i: pg_store.get(i) for i in ids}
    cloud = [i for i in ids if jobs[i].state == "provisioning"]
    waiting = [i for i in ids if jobs[i].state == "queued"]
    assert len(cloud) == 2 and len(waiting) == 5 and sorted(sent) == sorted(cloud)
    with pg_store.session() as s:
        st = budget_states(s, NOW)[0]
    assert st.committed_usd == pytest.approx(2 * price) and st.committed_usd <= cap
    assert st.remaining_usd == pytest.approx(0.5 * price) and not st.capped
    for i in waiting:
        rec = pg_store.decision(i)
        assert rec["kind"] == "wait" and rec["reason"].startswith(
            f"team budget cap reached: team ml has ${0.5 * price:.2f} of its cloud budget left this month and "
            f"cloud offer ")
        assert "; no new cloud spend, the job waits for on-prem capacity or its deadline; " in rec["reason"]
        assert any(a["kind"] == "cloud" and a["note"].startswith("team budget cap reached: costs $")
                   for a in rec["alternatives"])
        assert jobs[i].reason.startswith("team budget cap reached")
    # the next cycles (the burst's attempts still running) add no cloud spend: committed stays 2 x price
    for k in range(1, 3):
        res = cyc.run(now=NOW + timedelta(seconds=60 * k))
        assert res.kinds.get("provision", 0) == 0
    # the two cloud attempts end; they ran 10 % longer than estimated: the ledger has 2.2 x price, committed 0
    for i in cloud:
        with pg_store.session() as s:
            j = s.get(Job, i)
            j.state, j.finished_at = "succeeded", NOW + timedelta(hours=1)
            usage.add_usage(s, [_line(i, "ml", NOW, 1.1 * price)], NOW)
    later = NOW + timedelta(hours=1, minutes=5)
    with pg_store.session() as s:
        st = budget_states(s, later)[0]
    assert st.spent_usd == pytest.approx(2.2 * price) and st.committed_usd == 0.0
    assert st.remaining_usd == pytest.approx(0.3 * price)  # still < one job's price: no cloud
    pg_store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=later)
    res = cyc.run(now=later)
    assert res.kinds.get("provision", 0) == 0
    # overshoot bounded as stated: estimates never passed the cap; the ledger passes it only by the runs' overrun
    assert st.spent_usd + st.committed_usd <= cap + 0.2 * price + 1e-9
    # none lost: every job is still there, waiting, running on-prem or done; none failed or dropped
    states = sorted(pg_store.get(i).state for i in ids)
    assert "failed" not in states and "cancelled" not in states and len(states) == 8
    assert states.count("succeeded") == 2


def test_a_spent_budget_keeps_a_job_only_the_cloud_can_hold_undecided_and_says_why(pg_store):
    cyc, sent = _world(pg_store)
    set_budget(pg_store, "ml", 0.0, now=NOW)
    spec = JobSpec(command=["true"], estimated_duration_s=3600.0, gpus_per_node=8, deadline=NOW + timedelta(hours=3),
                   image=IMAGE)  # 8 GPUs: the 1-GPU node can never hold it
    jid = pg_store.submit("ml", spec, now=NOW)[0].id
    res = cyc.run(now=NOW)
    assert res.kinds == {} and sent == []
    j = pg_store.get(jid)
    assert j.state == "queued"
    assert j.reason.startswith("team budget cap reached: team ml has $0.00 of its $0.00 cloud budget left for "
                               "2026-12; no new cloud spend")


# ----------------------------------------------------------------------------- the API

def test_budget_routes_admin_sets_team_reads_its_own(pg_store):
    import uuid
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    from broker.service.api import create_app
    from broker.service.store.tables import utcnow
    from broker.service.tokens import create_token
    from tests.conftest import auth

    admin = "admin-" + uuid.uuid4().hex
    ml = create_token(pg_store, "ml").token
    viewer = create_token(pg_store, "ml", "read-only").token
    other = create_token(pg_store, "vision").token
    month0, _ = month_bounds(utcnow())
    with pg_store.session() as s:
        usage.add_usage(s, [_line("job-a", "ml", month0, 12.5)], month0)
    _place_cloud(pg_store, "ml", 2.5)
    with TestClient(create_app(pg_store, BrokerSettings(admin_token=admin))) as c:
        assert c.put("/v1/budgets/ml", json={"cap_usd": 100.0}, headers=auth(ml)).status_code == 403
        r = c.put("/v1/budgets/ml", json={"cap_usd": 100.0, "alert_fraction": 0.1}, headers=auth(admin))
        assert r.status_code == 200, r.text
        b = r.json()
        # spent 12.5 + committed 2.5 = 15 of 100: remaining 85; 15 >= 0.1 x 100: alert
        assert (b["team"], b["cap_usd"], b["spent_usd"], b["committed_usd"], b["remaining_usd"], b["alert"],
                b["capped"]) == ("ml", 100.0, 12.5, 2.5, 85.0, True, False)
        for tok in (ml, viewer):
            assert c.get("/v1/budgets/ml", headers=auth(tok)).json()["remaining_usd"] == 85.0
            assert [x["team"] for x in c.get("/v1/budgets", headers=auth(tok)).json()] == ["ml"]
        assert c.get("/v1/budgets/ml", headers=auth(other)).status_code == 404  # another team's: not shown
        assert c.get("/v1/budgets", headers=auth(other)).json() == []
        # a new user's report: vision's token asking for ml's budgets got 200 with vision's own; now a 403 as
        # /v1/jobs?team= and the usage routes answer, and its own team by name is still a 200
        r = c.get("/v1/budgets?team=ml", headers=auth(other))
        assert (r.status_code, r.json()) == (403, {"detail": "team='ml': your token belongs to team 'vision'"})
        assert c.get("/v1/budgets?team=vision", headers=auth(other)).json() == []
        assert [x["team"] for x in c.get("/v1/budgets?team=ml", headers=auth(viewer)).json()] == ["ml"]
        assert c.put("/v1/budgets/vision", json={"cap_usd": 5.0}, headers=auth(viewer)).status_code == 403
        r = c.put("/v1/budgets/ml", json={"cap_usd": -1.0}, headers=auth(admin))
        assert r.status_code == 422 and "cap_usd" in r.text
        r = c.put("/v1/budgets/ml", json={"cap_usd": 1.0, "alert_fraction": 2}, headers=auth(admin))
        assert r.status_code == 422 and "alert_fraction" in r.text
        assert c.put("/v1/budgets/bad%20team", json={"cap_usd": 1.0}, headers=auth(admin)).status_code == 422
        r = c.put("/v1/budgets/ml", json={"cap_usd": 0.001}, headers=auth(admin))
        assert r.status_code == 422 and "cap_usd=0.001: below a cent" in r.text and r.json()["detail"][0]["loc"] == [
            "body", "cap_usd"]
        # a typo'd team (cb5ea98: accepted without a word) is a 422 naming the team; new_team=true budgets it
        r = c.put("/v1/budgets/nosuchteam", json={"cap_usd": 100.0}, headers=auth(admin))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "team"]
        assert "team='nosuchteam': no token, job or budget of this team: a typo?" in r.text
        r = c.put("/v1/budgets/nosuchteam?new_team=true", json={"cap_usd": 100.0}, headers=auth(admin))
        assert r.status_code == 200 and r.json()["cap_usd"] == 100.0
        assert c.delete("/v1/budgets/nosuchteam", headers=auth(admin)).status_code == 204
        assert [x["team"] for x in c.get("/v1/budgets", headers=auth(admin)).json()] == ["ml"]
        assert c.delete("/v1/budgets/ml", headers=auth(ml)).status_code == 403
        assert c.delete("/v1/budgets/ml", headers=auth(admin)).status_code == 204
        assert c.delete("/v1/budgets/ml", headers=auth(admin)).status_code == 404
        assert c.get("/v1/budgets/ml", headers=auth(ml)).status_code == 404
    with pg_store.session() as s:
        acts = [e.action for e in s.execute(select(AuditEvent).where(AuditEvent.target == "ml")
                                            .order_by(AuditEvent.id)).scalars()]
    assert acts == ["budget.set", "budget.delete"]


@pytest.mark.parametrize("bad", [None, "abc", "inf", {"x": 1}])  # JSON cannot hold NaN
def test_a_decision_without_a_usable_estimate_commits_0_and_planning_goes_on(pg_store, caplog, bad):
    good = _place_cloud(pg_store, "ml", 20.0)
    odd = _place_cloud(pg_store, "ml", 1.0)
    with pg_store.session() as s:
        s.get(Job, odd).decision = {"kind": "provision", "option": {"kind": "cloud", "dollars_usd": bad}}
    assert good != odd
    st = set_budget(pg_store, "ml", 100.0, now=NOW)
    assert (st.committed_usd, st.committed_attempts) == (20.0, 2)
    with pg_store.session() as s:
        remaining, _, _ = planner_budgets(s, NOW)
    assert remaining == {"ml": 80.0}
    assert "no finite dollars_usd" in caplog.text


def test_a_cloud_attempt_running_past_its_estimate_commits_its_elapsed_time(pg_store):
    """Issue #20 (finding: a lying estimate): committed = max(estimate, elapsed) at the estimate's rate. On cb5ea98 a
    job that said 600 s and ran 1,800 s still committed its 2 USD estimate, so a team could pass its cap."""
    late = _place_cloud(pg_store, "ml", 2.0, state="running")  # 600 s estimated, running for 1,800 s: 3 x 2 USD
    early = _place_cloud(pg_store, "ml", 5.0, state="running")  # 600 s estimated, running for 60 s: its estimate
    queued = _place_cloud(pg_store, "ml", 1.0)  # provisioning, not started: its estimate
    with pg_store.session() as s:
        for jid, ran_s in ((late, 1800.0), (early, 60.0)):
            j = s.get(Job, jid)
            j.started_at = NOW - timedelta(seconds=ran_s)
            j.decision = {"kind": "provision", "option": {**j.decision["option"], "runtime_s": 600.0}}
        s.get(Job, queued).decision = {"kind": "provision", "option": {"kind": "cloud", "dollars_usd": 1.0,
                                                                       "runtime_s": 600.0}}
    st = set_budget(pg_store, "ml", 10.0, now=NOW)
    assert (st.committed_usd, st.committed_attempts) == (pytest.approx(6.0 + 5.0 + 1.0), 3)
    assert st.remaining_usd == pytest.approx(-2.0) and st.capped  # 12 committed of a 10 USD cap
    with pg_store.session() as s:
        remaining, _, _ = planner_budgets(s, NOW)
    assert remaining == {"ml": pytest.approx(-2.0)}
