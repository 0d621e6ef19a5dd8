"""Tests for broker.planner.costs (the one cost model and the score) and for its callers agreeing on the numbers.

Hand-worked numbers, GPU table from tests.broker.builders: V100 busy 0.3 kW / idle 0.05 kW, A100 busy 0.4 kW /
idle 0.06 kW, A100 throughput 2.0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from broker.cli.main import option_rows
from broker.model import DecisionKind
from broker.planner.core import CloudEstimate
from broker.planner.costs import (cloud_bill_usd, cloud_cost, cloud_kw, cloud_runtime, onprem_cost, onprem_kw,
                                  score)
from broker.planner.registry import plan
from broker.sim.simulator import SimulationConfig, simulate
from tests.broker.builders import (H, T0, FakeSignals, gpu_table, make_ctx, make_job, make_offer, make_pool,
                                   make_snapshot, make_trace, make_trace_job, pad)

approx = lambda v: pytest.approx(v, rel=1e-12, abs=1e-12)  # noqa: E731

# 2 instances x (3 busy A100 x 0.4 kW + 1 idle x 0.06 kW) x PUE 1.1 = 2 x 1.26 x 1.1 = 2.772 kW
KW = 2.772
# offers: on-demand 3.0 USD/h and spot 1.2 USD/h per instance, 300 s boot, 60 s minimum, flat 100 gCO2e/kWh
# job: 2 nodes x 3 GPUs, 4 V100-hours of work = 2 h on A100, checkpoint every 1200 s, restart 300 s;
# spot: 0.25 interruptions per hour


def _hand_case():
    """The two offers' ``(runtime, bill, kWh, kg, bound)`` from the cost functions, floats."""
    out = []
    for spot, price in ((False, 3.0), (True, 1.2)):
        run = cloud_runtime(4 * H / 2.0, spot, 0.25, 300.0, checkpointable=True, checkpoint_interval_s=1200.0,
                            restart_s=300.0)
        kw = cloud_kw(2, 3, 4, 0.4, 0.06, 1.1)
        c = cloud_cost(run.expected_s, 300.0, usd_per_hour=2 * price, min_billed_s=60.0, kw=kw,
                       carbon_integral=100.0 * run.expected_s / H)
        out.append((run.expected_s, c.dollars_usd, c.energy_kwh, c.carbon_kg, run.finish_bound_s))
    return out


def test_cloud_cost_on_demand_and_spot_by_hand():
    (od_run, od_usd, od_kwh, od_kg, od_bound), (sp_run, sp_usd, sp_kwh, sp_kg, sp_bound) = _hand_case()
    assert cloud_kw(2, 3, 4, 0.4, 0.06, 1.1) == approx(KW)
    # on-demand: runtime 7200 s, never interrupted; billed from the create call: 300 + 7200 = 7500 s
    #   2 x 3.0 USD/h x 7500 / 3600 = 12.5 USD; 2.772 kW x 2 h = 5.544 kWh; 5.544 kWh x 100 g = 0.5544 kg
    assert (od_run, od_usd, od_kwh, od_kg) == (approx(7200.0), approx(12.5), approx(5.544), approx(0.5544))
    assert od_bound == approx(7500.0)
    # spot: 0.25/h x 2 h = 0.5 interruptions, each losing half an interval + restart = 600 + 300 = 900 s
    #   -> 450 s of rework: 7650 s; billed 7950 s x 2 x 1.2 USD/h = 5.3 USD
    #   2.772 kW x 7650/3600 h = 5.8905 kWh -> 0.58905 kg at 100 g/kWh
    assert (sp_run, sp_usd, sp_kwh, sp_kg) == (approx(7650.0), approx(5.3), approx(5.8905), approx(0.58905))
    # pessimistic finish: 0.5 + 2 sqrt(0.5) = 1.9142136 interruptions, each losing a whole interval, the
    # restart and a new boot (1200 + 300 + 300 = 1800 s): 300 + 7200 + 3445.584 = 10945.584 s
    assert sp_bound == approx(7500.0 + (0.5 + 2.0 * math.sqrt(0.5)) * 1800.0)
    assert sp_bound == pytest.approx(10945.584, abs=1e-3)


def test_cloud_bill_minimum_billed_seconds():
    # a 30 s run after a 0 s boot is billed the 120 s minimum: 0.9 USD/h x 120/3600 = 0.03 USD
    assert cloud_bill_usd(30.0, 0.0, 0.9, 120.0) == approx(0.03)
    # past the minimum, per second: 0.9 x 150/3600 = 0.0375
    assert cloud_bill_usd(30.0, 120.0, 0.9, 120.0) == approx(0.0375)
    # the array form is the same formula
    assert cloud_bill_usd(np.array([30.0, 30.0]), np.array([0.0, 120.0]), 0.9, 120.0).tolist() == [
        approx(0.03), approx(0.0375)]


def test_onprem_cost_by_hand():
    # 4 V100 x 0.3 kW x PUE 1.5 = 1.8 kW for 2.5 h (9000 s); tariff integral 100 USD/MWh x h, carbon 500 g/kWh x h
    kw = onprem_kw(4, 0.3, 1.5)
    c = onprem_cost(9000.0, gpus=4, kw=kw, usd_per_gpu_hour=0.4, tariff_integral=100.0, carbon_integral=500.0)
    # electricity 1.8 x 100 / 1000 = 0.18 USD; capital 4 GPUs x 2.5 h x 0.4 = 4.0 USD
    # energy 1.8 kW x 2.5 h = 4.5 kWh; carbon 1.8 x 500 / 1000 = 0.9 kg
    assert kw == approx(1.8)
    assert (c.energy_usd, c.amortised_usd, c.energy_kwh, c.carbon_kg) == (approx(0.18), approx(4.0), approx(4.5),
                                                                          approx(0.9))
    assert c.dollars_usd == approx(4.18)
    # no data for the window: NaN, never 0 (a zero would look like the cleanest hour)
    missing = onprem_cost(9000.0, gpus=4, kw=kw, usd_per_gpu_hour=0.4, tariff_integral=math.nan,
                          carbon_integral=math.nan)
    assert math.isnan(missing.energy_usd) and math.isnan(missing.carbon_kg) and missing.energy_kwh == approx(4.5)


def test_score_by_hand():
    (_, od_usd, _, od_kg, _), (_, sp_usd, _, sp_kg, _) = _hand_case()
    # carbon 190 USD/t = 0.19 USD/kg; value of time 0.5 USD/h; wait = the 300 s boot = 0.0416667 USD
    # on-demand: 12.5 + 0.19 x 0.5544 + 0.5 x 300/3600 = 12.5 + 0.105336 + 0.0416667 = 12.6470027
    assert score(od_usd, od_kg, 300.0, 0.5, 190.0) == approx(12.5 + 0.105336 + 0.5 / 12)
    # spot: 5.3 + 0.19 x 0.58905 + 0.0416667 = 5.4535862
    assert score(sp_usd, sp_kg, 300.0, 0.5, 190.0) == approx(5.3 + 0.1119195 + 0.5 / 12)
    # on-prem (test_onprem_cost_by_hand), marginal: 0.18 USD + 0.19 x 0.9 kg + 0.02 USD/h x 1 h wait = 0.371
    assert score(0.18, 0.9, H, 0.02, 190.0) == approx(0.371)
    # vectorised: the same numbers, NaN stays NaN
    got = score(np.array([od_usd, math.nan]), np.array([od_kg, 1.0]), 300.0, 0.5, 190.0)
    assert got[0] == approx(12.5 + 0.105336 + 0.5 / 12) and math.isnan(got[1])


def _hand_ctx():
    offers = [make_offer("a100x4-od").gpu("A100", 4, 40.0).price(3.0).delay(300).min_billed(60).pue(1.1).build(),
              make_offer("a100x4-spot").gpu("A100", 4, 40.0).spot(0.25).price(1.2).delay(300).min_billed(60)
              .pue(1.1).build()]
    return make_ctx([], offers, restart_overhead_s=300.0)


def test_context_costs_offers_with_the_cost_model():
    """PlannerContext's vector, matrix and scalar paths give the hand-worked numbers (default signals: CZ flat 100)."""
    ctx = _hand_ctx()
    job = make_job("j").gpus(3).nodes(2).work(4 * H).checkpoint(1200).build()
    want = _hand_case()
    est = ctx.cloud_estimates(job, np.array([0, 1]), T0)
    matrix = ctx.cloud_estimates(job, np.array([0, 1]), T0, work_s=np.array([4 * H, 4 * H]))
    for o, (run, usd, kwh, kg, bound) in enumerate(want):
        rows = [ctx.cloud_scalar(job, o, T0), CloudEstimate(*(np.asarray(f)[o] for f in est))]
        rows += [CloudEstimate(*(np.asarray(f)[i, o] for f in matrix)) for i in range(2)]
        for row in rows:
            assert (row.runtime_s, row.dollars_usd, row.energy_kwh, row.carbon_kg, row.finish_bound_s) == (
                approx(run), approx(usd), approx(kwh), approx(kg), approx(bound))
            assert row.delay_s == 300.0 and row.usd_per_hour == approx(2 * (3.0, 1.2)[o])
        assert ctx.cloud_dollars(job, o) == approx(usd)


# ------------------------------------------------------------------ one job, one option: three readers agree
# Pool zone PZ: price 40, -20, 100, then 50 USD/MWh; carbon 200, 100, 300, then 250 g/kWh. Cloud zone CZ: carbon
# 100, 50, 80, then 150 g/kWh (hourly from T0).
SIGNALS = FakeSignals(carbon_values={"PZ": pad([200, 100, 300], 250), "CZ": pad([100, 50, 80], 150)},
                      price_values={"PZ": pad([40, -20, 100], 50)})
DEADLINE = T0 + 3 * H  # no time to defer: the only choices are now (on-prem) or the cloud


def _explain(pools, offers, job):
    ctx = make_ctx(pools, offers, signals=SIGNALS, policy="federated")
    (d,) = plan(make_snapshot(T0, [job], [[n.gpu_count for n in p.nodes] for p in pools]), ctx)
    return ctx, d


def _simulated(pools, offers, trace_job):
    return simulate(make_trace(trace_job), pools, offers, SIGNALS, "federated", gpus=gpu_table(), spot_traces=(),
                    config=SimulationConfig(seed=0)).metrics


def test_explain_offers_and_simulator_agree_on_prem():
    pools = [make_pool("lab").node("V100", 4).pue(1.5).amortised(0.4).build()]
    job = make_job("j").gpus(2).work(2.5 * H).deadline(DEADLINE).build()
    ctx, d = _explain(pools, [], job)
    assert d.kind == DecisionKind.start
    rec = d.record()["option"]
    (row,) = option_rows(ctx, job, T0)
    m = _simulated(pools, [], make_trace_job("j").at(T0).duration(2.5 * H).gpus(2).deadline(DEADLINE).build())
    # 2 x 0.3 kW x 1.5 = 0.9 kW over [T0, T0 + 2.5 h]: electricity 0.9 x (40 - 20 + 0.5 x 100) / 1000 = 0.063 USD,
    # capital 2 GPUs x 2.5 h x 0.4 = 2.0 USD; 2.25 kWh; 0.9 x (200 + 100 + 0.5 x 300) / 1000 = 0.405 kg
    want = (approx(2.063), approx(2.25), approx(0.405))
    assert (rec["dollars_usd"], rec["energy_kwh"], rec["carbon_kg"]) == want
    assert (row.dollars_usd, row.energy_kwh, row.carbon_kg) == want
    assert (m["onprem_energy_cost_usd"] + m["onprem_amortised_usd"], m["energy_kwh"], m["carbon_kg"]) == want
    assert m["onprem_energy_cost_usd"] == approx(0.063) and m["cost_usd"] == approx(0.063)


def test_explain_offers_and_simulator_agree_on_the_cloud():
    """An on-demand offer (the simulator bills what happened; with no interruption expected or replayed, that
    is the explain record's expectation); no pool, so the cloud is the only place."""
    offers = [make_offer("a100x4-od").gpu("A100", 4, 40.0).price(3.0).delay(300).pue(1.1).build(),
              make_offer("a100x4-dear").gpu("A100", 4, 40.0).price(5.0).delay(300).pue(1.1).build()]
    job = make_job("j").gpus(3).work(4 * H).deadline(DEADLINE + 2 * H).build()
    ctx, d = _explain([], offers, job)
    assert d.kind == DecisionKind.provision and d.offer_index == 0
    rec = d.record()
    rows = {r.instance: r for r in option_rows(ctx, job, T0)}
    m = _simulated([], offers, make_trace_job("j").at(T0).duration(4 * H).gpus(3).deadline(DEADLINE + 2 * H).build())
    # 2 h on A100 after a 300 s boot; billed 7500 s x 3.0 USD/h = 6.25 USD; 1 x (3 x 0.4 + 0.06) x 1.1 = 1.386 kW
    # x 2 h = 2.772 kWh; carbon over [T0 + 300 s, T0 + 7500 s]: 100 x 3300/3600 + 50 + 80 x 300/3600 = 148.3333 g/kWh.h
    kg = 1.386 * (100 * 3300 / 3600 + 50 + 80 * 300 / 3600) / 1000
    want = (approx(6.25), approx(2.772), approx(kg))
    opt = rec["option"]
    assert (opt["dollars_usd"], opt["energy_kwh"], opt["carbon_kg"]) == want
    assert (rows["a100x4-od"].dollars_usd, rows["a100x4-od"].energy_kwh, rows["a100x4-od"].carbon_kg) == want
    assert (m["cloud_cost_usd"], m["energy_kwh"], m["carbon_kg"]) == want
    # the rejected offer in the explain record is costed as `offers` costs it: 7500 s x 5.0 USD/h
    (alt,) = rec["alternatives"]
    assert alt["target"] == offers[1].offer_id
    assert (alt["dollars_usd"], alt["energy_kwh"], alt["carbon_kg"]) == (
        approx(rows["a100x4-dear"].dollars_usd), approx(rows["a100x4-dear"].energy_kwh),
        approx(rows["a100x4-dear"].carbon_kg))
    assert alt["dollars_usd"] == approx(5.0 * 7500 / 3600)
