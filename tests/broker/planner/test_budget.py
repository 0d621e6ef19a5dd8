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
