"""``PlannerConfig.team_budget_usd`` in ``federated``: a team's remaining cloud budget bounds its cloud decisions
in a cycle; on-prem options are not limited; a cloud option over the budget is never chosen, not even to
minimise lateness. Hand-worked figures: the 4 x V100 offer at 10 USD/h runs a 1-h job in 3600 s + 300 s boot,
10 x 3900 / 3600 = 10.8333 USD."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from broker.model import DecisionKind
from broker.planner.registry import plan
from tests.broker.builders import H, T0, make_job, make_running, make_snapshot
from tests.broker.planner.test_policies import _fed_ctx

ONE = 10.0 * 3900 / 3600  # USD, one job on the offer


def _busy():
    return [make_running("r").on((0, 4)).ends(T0 + 10 * H).build()]  # the pool is full for 10 h


def _jobs(n: int, team: str = "ml"):
    # 4 GPUs, 1 h, due in 3 h: only the cloud meets the deadline
    return [make_job(f"{team}{i}").team(team).gpus(4).work(H).deadline(T0 + 3 * H).build() for i in range(n)]


def test_the_budget_takes_two_cloud_jobs_and_holds_the_third_on_prem():
    ctx = _fed_ctx(team_budget_usd={"ml": 25.0})
    ds = plan(make_snapshot(T0, _jobs(3), [[0]], _busy()), ctx)
    assert [(d.job_id, d.kind) for d in ds] == [("ml0", DecisionKind.provision), ("ml1", DecisionKind.provision),
                                                ("ml2", DecisionKind.wait)]
    assert sum(d.option.dollars_usd for d in ds[:2]) == pytest.approx(2 * ONE)
    held = ds[2]
    # 25 - 2 x 10.8333 = 3.33 USD left < 10.83: it waits for the pool (late: no deadline-meeting option is left)
    assert held.pool == "lab" and held.option.kind == "onprem"
    assert held.reason.startswith(f"team budget cap reached: team ml has $3.33 of its cloud budget left this month "
                                  f"and cloud offer {ctx.offer_ids[0]} would cost $10.83; no new cloud spend, the job "
                                  "waits for on-prem capacity or its deadline; ")
    (cloud,) = [a for a in held.alternatives if a.kind == "cloud"]
    assert not cloud.feasible and cloud.note == "team budget cap reached: costs $10.83, $3.33 of the team's cloud budget left"
    assert ctx.config.team_budget_usd == {"ml": 25.0}  # the planner spends a copy


def test_a_spent_budget_stops_only_that_teams_cloud_spend():
    ctx = _fed_ctx(team_budget_usd={"ml": 0.0})
    ds = {d.job_id: d for d in plan(make_snapshot(T0, _jobs(1) + _jobs(1, "cv"), [[0]], _busy()), ctx)}
    assert ds["cv0"].kind == DecisionKind.provision  # no budget: unlimited
    assert ds["ml0"].kind == DecisionKind.wait and ds["ml0"].reason.startswith("team budget cap reached: team ml has $0.00")


def test_a_job_only_the_cloud_can_hold_gets_no_decision_when_the_budget_is_spent():
    ctx = _fed_ctx(team_budget_usd={"ml": 5.0})
    job = make_job("big").team("ml").gpus(4).nodes(2).work(H).deadline(T0 + 3 * H).build()  # the pool has 1 node
    assert plan(make_snapshot(T0, [job], [[4]]), ctx) == []  # waits: nothing dropped, nothing rejected
    (d,) = plan(make_snapshot(T0, [job], [[4]]), _fed_ctx(team_budget_usd={"ml": 100.0}))
    assert d.kind == DecisionKind.provision and d.option.dollars_usd == pytest.approx(2 * ONE)  # two instances


def test_on_prem_is_not_limited_by_the_budget():
    ctx = _fed_ctx(team_budget_usd={"ml": 0.0})
    job = make_job("j").team("ml").gpus(4).work(H).deadline(T0 + 3 * H).build()
    (d,) = plan(make_snapshot(T0, [job], [[4]]), ctx)
    assert d.kind == DecisionKind.start and d.option.dollars_usd > 0  # costs money on-prem, not cloud budget


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 8), budget=st.floats(0.0, 100.0))
def test_one_cycles_cloud_decisions_never_exceed_the_budget(n, budget):
    ctx = _fed_ctx(team_budget_usd={"ml": budget})
    ds = plan(make_snapshot(T0, _jobs(n), [[0]], _busy()), ctx)
    cloud = [d for d in ds if d.kind == DecisionKind.provision]
    assert sum(d.option.dollars_usd for d in cloud) <= budget + 1e-9
    assert len(cloud) == min(n, int(budget // ONE + 1e-12))  # every job that fits in the budget goes
    assert len(ds) == n  # none dropped: the others wait


# ---------------------------------------------------------------- project budgets (PlannerConfig.project_budget_usd)
def _pjobs(n: int, project: str, team: str = "ml"):
    return [make_job(f"{project}{i}").team(team).project(project).gpus(4).work(H).deadline(T0 + 3 * H).build()
            for i in range(n)]


def test_a_project_cap_holds_its_projects_cloud_burst_while_another_project_of_the_team_bursts():
    # project a: 15 USD left = one 10.83 USD job, then 4.17 left; project b: no project budget; team: unlimited
    ctx = _fed_ctx(project_budget_usd={"ml": {"a": 15.0}})
    ds = {d.job_id: d for d in plan(make_snapshot(T0, _pjobs(2, "a") + _pjobs(2, "b"), [[0]], _busy()), ctx)}
    assert [ds[j].kind for j in ("a0", "a1", "b0", "b1")] == [DecisionKind.provision, DecisionKind.wait,
                                                              DecisionKind.provision, DecisionKind.provision]
    assert ds["a1"].reason.startswith(f"project budget cap reached: project a of team ml has $4.17 of its cloud "
                                      f"budget left this month and cloud offer {ctx.offer_ids[0]} would cost $10.83; "
                                      "no new cloud spend, the job waits for on-prem capacity or its deadline; ")
    (cloud,) = [a for a in ds["a1"].alternatives if a.kind == "cloud"]
    assert cloud.note == "project budget cap reached: costs $10.83, $4.17 of the project's cloud budget left"
    assert ctx.config.project_budget_usd == {"ml": {"a": 15.0}}  # the planner spends a copy


def test_the_team_cap_still_holds_every_project_and_names_itself():
    # team ml: 25 USD = two jobs (21.67, 3.33 left); project a: 100 USD. Queue order a0, a1, b0, b1:
    # a0 and a1 go (charged to the team and to a: a has 78.33 left), b0 and b1 are held by the team's cap.
    ctx = _fed_ctx(team_budget_usd={"ml": 25.0}, project_budget_usd={"ml": {"a": 100.0}})
    ds = {d.job_id: d for d in plan(make_snapshot(T0, _pjobs(2, "a") + _pjobs(2, "b"), [[0]], _busy()), ctx)}
    assert [ds[j].kind for j in ("a0", "a1", "b0", "b1")] == [DecisionKind.provision, DecisionKind.provision,
                                                              DecisionKind.wait, DecisionKind.wait]
    for j in ("b0", "b1"):
        assert ds[j].reason.startswith("team budget cap reached: team ml has $3.33 of its cloud budget left")


def test_the_smaller_of_the_team_and_project_caps_binds():
    # team 30 USD, project a 12 USD: a0 goes (team 19.17, a 1.17 left); a1 is held by the project's cap, b0 goes
    # on the team's 19.17 (8.33 left) and b1 is held by the team's.
    ctx = _fed_ctx(team_budget_usd={"ml": 30.0}, project_budget_usd={"ml": {"a": 12.0}})
    ds = {d.job_id: d for d in plan(make_snapshot(T0, _pjobs(2, "a") + _pjobs(2, "b"), [[0]], _busy()), ctx)}
    assert [ds[j].kind for j in ("a0", "a1", "b0", "b1")] == [DecisionKind.provision, DecisionKind.wait,
                                                              DecisionKind.provision, DecisionKind.wait]
    assert ds["a1"].reason.startswith("project budget cap reached: project a of team ml has $1.17 ")
    assert ds["b1"].reason.startswith("team budget cap reached: team ml has $8.33 ")


def test_a_project_budget_of_another_team_does_not_hold_a_same_named_project():
    ctx = _fed_ctx(project_budget_usd={"cv": {"a": 0.0}})
    (d,) = plan(make_snapshot(T0, _pjobs(1, "a"), [[0]], _busy()), ctx)
    assert d.kind == DecisionKind.provision


@settings(max_examples=40, deadline=None, derandomize=True)
@given(na=st.integers(0, 6), nb=st.integers(0, 6), team=st.floats(0.0, 100.0), proj=st.floats(0.0, 100.0))
def test_one_cycles_cloud_decisions_fit_both_the_team_and_the_project_cap(na, nb, team, proj):
    ctx = _fed_ctx(team_budget_usd={"ml": team}, project_budget_usd={"ml": {"a": proj}})
    ds = plan(make_snapshot(T0, _pjobs(na, "a") + _pjobs(nb, "b"), [[0]], _busy()), ctx)
    usd = {p: sum(d.option.dollars_usd for d in ds if d.kind == DecisionKind.provision and d.job_id[0] == p)
           for p in "ab"}
    assert usd["a"] <= proj + 1e-9 and usd["a"] + usd["b"] <= team + 1e-9
    # queue order a..., b...: project a takes what both caps allow, b what the team has left after a
    n_a = min(na, int(min(team, proj) // ONE + 1e-12))
    assert usd["a"] == pytest.approx(n_a * ONE)
    assert usd["b"] == pytest.approx(min(nb, int((team - n_a * ONE) // ONE + 1e-12)) * ONE)
    assert len(ds) == na + nb  # none dropped: the others wait
