"""Tests for broker.sim.simulator: exact metrics on tiny hand-made traces, determinism, job accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from broker.model import Market
from broker.sim.simulator import SimulationConfig, simulate
from tests.broker.builders import (H, T0, FakeSignals, gpu_table, make_offer, make_pool, make_trace, make_trace_job,
                                   pad)

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-9)  # noqa: E731

# Pool zone PZ: price 40 USD/MWh in hour 0, -20 in hour 1, then 50; carbon 200, 100, then 250 g/kWh.
# Cloud zone CZ: carbon flat 100 g/kWh. 72 hourly values from T0.
SIGNALS = FakeSignals(carbon_values={"PZ": pad([200, 100], 250), "CZ": pad([], 100)},
                      price_values={"PZ": pad([40, -20], 50)})


def _pool():
    # 1 node x 4 V100, PUE 1.2, 0.5 USD/GPU-h amortised
    return make_pool("lab").node("V100", 4).pue(1.2).amortised(0.5).build()


def _fifo_trace():
    return make_trace(
        make_trace_job("a").at(T0).duration(H).gpus(4).build(),
        make_trace_job("b").at(T0 + 30).duration(1800).gpus(2).deadline(T0 + 5000).build(),
        make_trace_job("c").at(T0 + 120).duration(1800).gpus(2).build(),
        make_trace_job("d").at(T0 + 200).duration(600).gpus(8).build(),  # no node has 8 GPUs: rejected
    )


def _run(trace, policy, offers=(), seed=0):
    return simulate(trace, [_pool()], list(offers), SIGNALS, policy, gpus=gpu_table(), spot_traces=(),
                    config=SimulationConfig(seed=seed))


def test_fifo_tiny_trace_exact_metrics():
    m = _run(_fifo_trace(), "fifo").metrics
    # a: starts T0 (tick T0), ends T0+3600.  b (T0+30) and c (T0+120) wait for a, then both start at T0+3600
    # on 2 + 2 GPUs and end at T0+5400.  d never fits: rejected.
    # JCT: a 3600, b 5400-30 = 5370, c 5400-120 = 5280 -> mean 4750; waits 0, 3570, 3480 -> mean 2350
    assert (m["jobs_submitted"], m["jobs_completed"], m["jobs_skipped"]) == (4, 3, 1)
    assert m["mean_jct_s"] == approx(4750.0)
    assert m["mean_wait_s"] == approx(2350.0)
    # p95 of [3600, 5280, 5370]: 5280 + 0.9 x 90 = 5361
    assert m["p95_jct_s"] == approx(5361.0)
    assert m["deadline_misses"] == 1  # b ends 5400 s after T0, its deadline was 5000
    # energy: a 4 x 0.3 kW x 1.2 = 1.44 kW x 1 h; b, c 0.72 kW x 0.5 h each -> 1.44 + 0.36 + 0.36 = 2.16 kWh
    assert m["energy_kwh"] == approx(2.16)
    # electricity: a 1.44 x 40/1000 = 0.0576; b, c 0.72 x 0.5 h x (-20)/1000 = -0.0072 each -> 0.0432 USD
    assert m["onprem_energy_cost_usd"] == approx(0.0432)
    # amortised: 4 GPU-h + 1 + 1 = 6 GPU-h x 0.5 = 3.0 USD (reported apart from cost_usd)
    assert m["onprem_amortised_usd"] == approx(3.0)
    assert m["cloud_cost_usd"] == 0.0
    assert m["cost_usd"] == approx(m["cloud_cost_usd"] + m["onprem_energy_cost_usd"])
    # carbon: a 1.44 x 200/1000 = 0.288; b, c 0.72 x 0.5 x 100/1000 = 0.036 each -> 0.36 kg
    assert m["carbon_kg"] == approx(0.36)
    # busy 4 of 4 GPUs from T0 to T0+5400
    assert m["onprem_gpu_utilization"] == approx(1.0)
    assert m["preemptions"] == 0 and m["cloud_jobs"] == 0


def test_fifo_tiny_trace_per_job_outputs():
    run = _run(_fifo_trace(), "fifo")
    assert sorted(run.waits_s.tolist()) == [0.0, 3480.0, 3570.0]
    assert run.team_cost_usd["default"] == approx(run.metrics["cost_usd"])
    assert any(k.startswith("rejected: no on-prem pool") for k in run.skipped)
    assert run.cum_cost_usd[-1] == approx(run.metrics["cost_usd"])
    assert run.cum_carbon_kg[-1] == approx(0.36)


def _cloud_offer():
    # 4 x V100 on-demand, 10 USD/h, 300 s boot, PUE 1.1, 60 s minimum, carbon zone CZ
    return make_offer("v100x4").gpu("V100", 4).price(10.0).build()


def test_cheapest_tiny_trace_with_one_offer_exact_metrics():
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).build(),
                       make_trace_job("b").at(T0 + 30).duration(H).gpus(4).build())
    m = _run(trace, "cheapest", [_cloud_offer()]).metrics
    # a on-prem T0..T0+3600.  b: planned at T0+30 (a multiple of the default 2 s step), pool full -> provision;
    # boot 300 s; runs T0+330..T0+3930; billed from the create call: 3900 s x 10 USD/h = 10.8333 USD
    assert m["cloud_jobs"] == 1
    assert m["cloud_cost_usd"] == approx(10.0 * 3900 / 3600)
    # on-prem a: 1.44 kWh x 40 USD/MWh = 0.0576 USD; 0.288 kg
    assert m["onprem_energy_cost_usd"] == approx(0.0576)
    assert m["cost_usd"] == approx(10.0 * 3900 / 3600 + 0.0576)
    # cloud: 4 x 0.3 kW x 1.1 = 1.32 kW x 1 h = 1.32 kWh at 100 g/kWh -> 0.132 kg
    assert m["energy_kwh"] == approx(1.44 + 1.32)
    assert m["carbon_kg"] == approx(0.288 + 0.132)
    # JCT: a 3600, b 3930 - 30 = 3900; waits 0 and 300 (boot counts as wait)
    assert m["mean_jct_s"] == approx((3600 + 3900) / 2)
    assert m["mean_wait_s"] == approx(300 / 2)
    assert (m["jobs_completed"], m["deadline_misses"]) == (2, 0)


def _mixed_trace(n=6):
    rng = np.random.default_rng(7)
    jobs = []
    for i in range(n):
        g = int(rng.choice([1, 2, 4, 8]))
        jobs.append(make_trace_job(f"m{i}").at(T0 + 600.0 * i).duration(float(rng.integers(1, 8)) * 900)
                    .gpus(g).deadline(T0 + 600.0 * i + 12 * H).team(f"t{i % 2}").build())
    return make_trace(*jobs)


@pytest.mark.parametrize("policy", ["fifo", "backfill", "cheapest", "federated"])
def test_every_job_is_completed_or_skipped(policy):
    spot = make_offer("v100x4-spot").gpu("V100", 4).spot(0.2).price(4.0).build()
    m = _run(_mixed_trace(), policy, [spot]).metrics
    # the 8-GPU jobs never fit the 4-GPU node: rejected on-prem-only, cloud-less for the 1-node offer shape
    assert m["jobs_submitted"] == 6
    assert m["jobs_completed"] + m["jobs_skipped"] == m["jobs_submitted"]
    assert m["jobs_completed"] >= 1


@pytest.mark.parametrize("policy", ["fifo", "federated"])
def test_same_seed_same_metrics(policy):
    spot = make_offer("v100x4-spot").gpu("V100", 4).spot(0.2).price(4.0).build()
    wall = {"sim_wall_s", "decision_latency_p99_ms"}
    r1 = _run(_mixed_trace(), policy, [spot], seed=3)
    r2 = _run(_mixed_trace(), policy, [spot], seed=3)
    m1 = {k: v for k, v in r1.metrics.items() if k not in wall}
    m2 = {k: v for k, v in r2.metrics.items() if k not in wall}
    assert m1.keys() == m2.keys()
    for k in m1:
        a, b = m1[k], m2[k]
        assert (a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), k
    assert r1.waits_s.tolist() == r2.waits_s.tolist()
    assert r1.cum_cost_usd.tolist() == r2.cum_cost_usd.tolist()


# --------------------------------------------------------------------------- step, offers filter, per-job records
def _one_job_at_30():
    return make_trace(make_trace_job("a").at(T0 + 30).duration(H).gpus(4).build())


@pytest.mark.parametrize("step, start", [(60.0, T0 + 60), (30.0, T0 + 30), (45.0, T0 + 45), (7.0, T0 + 32)])
def test_step_sets_when_an_arrival_is_planned(step, start):
    # Steps are multiples of the step since the POSIX epoch.  T0 = 1693785600 is a multiple of 60, 30 and 45 and
    # is 3 mod 7; the arrival at T0+30 is planned at the next multiple: 60 -> T0+60, 30 -> T0+30 (exact),
    # 45 -> T0+45, 7 -> T0+32 (T0+30 is 5 mod 7).  The pool is free, so it starts then.
    run = simulate(_one_job_at_30(), [_pool()], [], SIGNALS, "fifo", gpus=gpu_table(),
                   config=SimulationConfig(tick_s=step))
    (rec,) = run.jobs
    assert rec.start_s == start and rec.end_s == start + H
    assert rec.wait_s == start - (T0 + 30)
    assert run.metrics["mean_wait_s"] == start - (T0 + 30)


@pytest.mark.parametrize("step", [0.0, -60.0, math.nan, math.inf])
def test_step_must_be_finite_and_positive(step):
    with pytest.raises(ValueError, match="tick_s"):
        SimulationConfig(tick_s=step)


def _two_full_pool_jobs():
    return make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).build(),
                      make_trace_job("b").at(T0 + 30).duration(H).gpus(4).build())


@pytest.mark.parametrize("policy", ["cheapest", "federated"])
def test_no_cloud_keeps_the_policy_on_prem(policy):
    from broker.planner.core import PlannerConfig

    # b's deadline T0+5400 is met only in the cloud (planned at T0+30 on the default 2 s step, ready T0+330,
    # ends T0+3930): both policies burst it
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).build(),
                       make_trace_job("b").at(T0 + 30).duration(H).gpus(4).deadline(T0 + 5400).build())
    with_cloud = simulate(trace, [_pool()], [_cloud_offer()], SIGNALS, policy, gpus=gpu_table())
    assert [(j.placement, j.start_s, j.deadline_met) for j in with_cloud.jobs] == [
        ("lab", T0, True), (_cloud_offer().offer_id, T0 + 330, True)]
    run = simulate(trace, [_pool()], [_cloud_offer()], SIGNALS, policy, gpus=gpu_table(),
                   planner_config=PlannerConfig(cloud_enabled=False))
    # without offers b waits for a: T0+3600..T0+7200 on the pool, past its deadline
    assert run.metrics["cloud_jobs"] == 0 and run.metrics["cloud_cost_usd"] == 0.0
    assert [(j.job_id, j.placement, j.market, j.start_s, j.deadline_met) for j in run.jobs] == [
        ("a", "lab", "", T0, True), ("b", "lab", "", T0 + H, False)]
    assert run.metrics["deadline_misses"] == 1


def _ondemand_and_spot():
    # on-demand 2 USD/h is cheaper than spot 4 USD/h: with any market, cheapest picks on-demand
    return [make_offer("od").gpu("V100", 4).price(2.0).build(),
            make_offer("sp").gpu("V100", 4).spot(0.0).price(4.0).build()]


@pytest.mark.parametrize("market, used, usd_per_hour", [(None, "on_demand", 2.0), (Market.spot, "spot", 4.0),
                                                        (Market.on_demand, "on_demand", 2.0)])
def test_market_keeps_only_offers_of_that_market(market, used, usd_per_hour):
    offers = _ondemand_and_spot()
    run = simulate(_two_full_pool_jobs(), [_pool()], offers, SIGNALS, "cheapest", gpus=gpu_table(),
                   config=SimulationConfig(market=market))
    a, b = run.jobs
    assert (a.placement, a.market) == ("lab", "")
    offer = next(o for o in offers if o.market.value == used)
    assert (b.placement, b.market) == (offer.offer_id, used)
    # b: planned at T0+30 (default 2 s step), billed from the create call for 300 s boot + 3600 s run
    assert run.metrics["cloud_cost_usd"] == approx(usd_per_hour * 3900 / 3600)


def test_per_job_records_of_the_cloud_burst_case_by_hand():
    run = _run(_two_full_pool_jobs(), "cheapest", [_cloud_offer()])
    a, b = run.jobs
    # a on-prem T0..T0+3600: 1.44 kWh, 0.0576 USD electricity, 4 GPU-h x 0.5 = 2.0 USD amortised, 0.288 kg
    assert (a.job_id, a.team, a.gpus, a.status, a.starts) == ("a", "default", 4, "completed", 1)
    assert (a.start_s, a.end_s, a.wait_s, a.placement, a.market) == (T0, T0 + H, 0.0, "lab", "")
    assert (a.dollars_usd, a.amortised_usd) == (approx(0.0576), approx(2.0))
    assert (a.energy_kwh, a.carbon_kg) == (approx(1.44), approx(0.288))
    # b cloud: create at T0+30 (default 2 s step), ready T0+330, ends T0+3930; 3900 s x 10 USD/h; 1.32 kWh at
    # 100 g/kWh
    assert (b.start_s, b.end_s, b.wait_s) == (T0 + 330, T0 + 3930, 300.0)
    assert (b.placement, b.market) == (_cloud_offer().offer_id, "on_demand")
    assert (b.dollars_usd, b.amortised_usd) == (approx(10.0 * 3900 / 3600), 0.0)
    assert (b.energy_kwh, b.carbon_kg) == (approx(1.32), approx(0.132))
    assert a.deadline_met and b.deadline_met
    # the records add up to the run's metrics
    m = run.metrics
    assert a.dollars_usd + b.dollars_usd == approx(m["cost_usd"])
    assert a.amortised_usd + b.amortised_usd == approx(m["onprem_amortised_usd"])
    assert a.energy_kwh + b.energy_kwh == approx(m["energy_kwh"])
    assert a.carbon_kg + b.carbon_kg == approx(m["carbon_kg"])


def test_per_job_records_of_rejected_and_late_jobs():
    run = _run(_fifo_trace(), "fifo")
    rec = {j.job_id: j for j in run.jobs}
    assert [j.job_id for j in run.jobs] == ["a", "b", "c", "d"]
    # b ends T0+5400 after its deadline T0+5000; d never fits (rejected: neither met nor missed)
    assert (rec["b"].end_s, rec["b"].deadline_met) == (T0 + 5400, False)
    assert (rec["d"].status, rec["d"].deadline_met, rec["d"].placement, rec["d"].starts) == ("rejected", None, "", 0)
    assert math.isnan(rec["d"].start_s) and math.isnan(rec["d"].wait_s)
    # b and c: 0.72 kWh each, -0.0072 USD electricity (negative price hour), 1 GPU-h x 0.5 amortised
    assert (rec["c"].energy_kwh, rec["c"].dollars_usd, rec["c"].amortised_usd) == (approx(0.36), approx(-0.0072),
                                                                                  approx(0.5))
    assert sum(j.dollars_usd for j in run.jobs) == approx(run.metrics["cost_usd"])


# --------------------------------------------------------------------------- event-driven planning
def test_default_step_is_the_live_beat_interval():
    from broker.model import PLAN_INTERVAL_S
    from broker.service.settings import BrokerSettings

    assert PLAN_INTERVAL_S == 2.0
    assert SimulationConfig().tick_s == PLAN_INTERVAL_S == BrokerSettings.model_fields["plan_interval_s"].default


@pytest.mark.parametrize("gap_days", [0.5, 40.0, 300.0])
def test_idle_spans_cost_no_cycle(gap_days):
    # two jobs gap_days apart on a free pool, 1 s step: one planner cycle per arrival and none in between, however
    # long the idle span (the clock jumps from event to event); finishes with an empty queue plan nothing
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).build(),
                       make_trace_job("b").at(T0 + gap_days * 86400).duration(H).gpus(4).build())
    run = simulate(trace, [_pool()], [], SIGNALS, "fifo", gpus=gpu_table(), config=SimulationConfig(tick_s=1.0))
    assert run.metrics["planner_cycles"] == 2
    assert run.timeline_t_s.tolist() == [T0, T0 + gap_days * 86400]
    assert [j.start_s for j in run.jobs] == [T0, T0 + gap_days * 86400]


def test_a_job_left_undecided_is_planned_again_at_the_next_signal_hour():
    from pricing.spot import SpotTrace

    from broker.sim.simulator import SpotModel

    # 8 GPUs on one node: the 4-GPU pool can never hold it, only the 8-GPU spot offer can.  The offer's spot
    # trace (hourly ticks, 6-h period) is available 2 h of 6; at the arrival it is not, so federated leaves the job
    # undecided ("no decision this cycle").  The simulator plans it again at each following UTC hour until the
    # offer is available, then it provisions: ready 300 s (the offer's boot) after that hour.
    offer = make_offer("v100x8-spot").gpu("V100", 8).spot(0.0).price(8.0).build()
    spot = SpotTrace(zone="r1a", accelerator="v100", campaign="test", gap_s=3600.0,
                     availability=np.array([0, 0, 0, 0, 1, 1], dtype=np.int8))
    sm = SpotModel([offer], [spot], seed=0)
    arrival = next(t for t in T0 + 60.0 * np.arange(6 * 60) if not sm.available(t)[0])
    hour = next(h for h in H * (np.floor(arrival / H) + 1 + np.arange(12)) if sm.available(h)[0])
    assert H < hour - arrival < 5 * H  # the hand-made trace makes it wait past at least one hour boundary
    trace = make_trace(make_trace_job("big").at(float(arrival)).duration(H).gpus(8)
                       .deadline(float(arrival) + 24 * H).build())
    run = simulate(trace, [_pool()], [offer], SIGNALS, "federated", gpus=gpu_table(), spot_traces=[spot],
                   config=SimulationConfig(tick_s=1.0))
    (rec,) = run.jobs
    assert (rec.status, rec.placement, rec.market) == ("completed", offer.offer_id, "spot")
    assert rec.start_s == hour + 300.0 and rec.end_s == hour + 300.0 + H
    # a cycle at the arrival, then one per hour boundary up to and including the one that provisions
    assert run.metrics["planner_cycles"] == 1 + round((hour - math.floor(arrival / H) * H) / H)


def test_a_job_no_offer_ever_takes_ends_unfinished_after_its_deadline():
    from pricing.spot import SpotTrace

    # as above, but the spot offer is never available: the job is looked at at its arrival (T0+30) and at every
    # UTC hour up to the first one past its deadline (T0+5h+30): T0+1h ... T0+6h, 7 cycles; then the run ends
    offer = make_offer("v100x8-spot").gpu("V100", 8).spot(0.0).price(8.0).build()
    spot = SpotTrace(zone="r1a", accelerator="v100", campaign="test", gap_s=3600.0,
                     availability=np.zeros(6, dtype=np.int8))
    trace = make_trace(make_trace_job("big").at(T0 + 30).duration(H).gpus(8).deadline(T0 + 30 + 5 * H).build())
    run = simulate(trace, [_pool()], [offer], SIGNALS, "federated", gpus=gpu_table(), spot_traces=[spot],
                   config=SimulationConfig(tick_s=1.0))
    (rec,) = run.jobs
    assert rec.status == "unfinished" and rec.placement == ""
    assert run.metrics["planner_cycles"] == 7
    assert run.timeline_t_s.tolist() == [T0 + 30] + [T0 + k * H for k in range(1, 7)]
    assert run.metrics["deadline_misses"] == 1


# ------------------------------------------------------------------------------------------ --forecast (issue 13)
def _dip_run(forecast: str, dip_hours: list[int]):
    """One 1-GPU, 1-h job submitted at day 15 00:00 (deadline +24 h) on a 4-GPU pool; the price is 50 USD/MWh
    but -400 at ``dip_hours``; carbon flat 300 g/kWh. Energy: 1 x 0.3 kW x PUE 1.2 x 1 h = 0.36 kWh."""
    from broker.planner.core import PlannerConfig
    price = [50.0] * (24 * 20)
    for h in dip_hours:
        price[h] = -400.0
    sig = FakeSignals(carbon_values={"PZ": [300.0] * (24 * 20)}, price_values={"PZ": price})
    tr = make_trace(make_trace_job("a").at(T0 + 360 * H).duration(H).gpus(1).deadline(T0 + 384 * H).build())
    return simulate(tr, [_pool()], [], sig, "federated", gpus=gpu_table(),
                    planner_config=PlannerConfig(value_of_time_usd_per_gpu_hour=0.0001),
                    config=SimulationConfig(forecast=forecast))


def test_forecast_regret_of_a_one_off_price_dip_by_hand():
    # perfect knowledge defers the job to the dip (day 15, 12:00): 0.36 kWh x -400 / 1000 = -0.144 USD
    perfect = _dip_run("perfect", [372])
    assert perfect.jobs[0].start_s == T0 + 372 * H and perfect.metrics["cost_usd"] == approx(-0.144)
    # no forecast model can see a dip that never happened before: the job starts now at 50 USD/MWh = 0.018 USD;
    # the regret is 0.018 - (-0.144) = 0.162 USD, and 0 kg (carbon is flat)
    for model in ("naive_day", "naive_week", "blend"):
        run = _dip_run(model, [372])
        assert run.jobs[0].start_s == T0 + 360 * H, model
        assert run.metrics["cost_usd"] - perfect.metrics["cost_usd"] == approx(0.162)
        assert run.metrics["carbon_kg"] == approx(perfect.metrics["carbon_kg"]) == approx(0.108)


def test_a_dip_that_recurs_every_day_is_forecast_and_taken():
    daily = [24 * d + 12 for d in range(20)]
    perfect = _dip_run("perfect", daily)
    for model in ("naive_day", "blend"):
        run = _dip_run(model, daily)
        assert run.jobs[0].start_s == perfect.jobs[0].start_s == T0 + 372 * H, model
        assert run.metrics["cost_usd"] == approx(perfect.metrics["cost_usd"]) == approx(-0.144)


def test_forecast_must_be_a_known_model():
    with pytest.raises(ValueError, match="forecast='arima'"):
        SimulationConfig(forecast="arima")
