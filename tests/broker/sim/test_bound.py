"""Tests for broker.sim.bound: the fluid LP lower bound, worked by hand on tiny cases, below every
policy's simulated result, and below the exact optimum found by exhaustive search."""

from __future__ import annotations

import itertools
import math

import pytest

from broker.planner.core import PlannerConfig
from broker.planner.costs import cloud_cost, cloud_kw, onprem_cost, onprem_kw
from broker.sim.bound import lower_bound, policy_score_usd
from broker.sim.simulator import SimulationConfig, simulate
from pricing.series import window_integral
from tests.broker.builders import H, T0, FakeSignals, gpu_table, make_offer, make_pool, make_trace, make_trace_job, pad

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731

# Zone PZ: price 40 USD/MWh in hour 0, -20 in hour 1, then 50; carbon 200, 100, then 250 g/kWh.
# Zone CZ (cloud): carbon flat 100 g/kWh. 72 hourly values from T0.
SIGNALS = FakeSignals(carbon_values={"PZ": pad([200, 100], 250), "CZ": pad([], 100)},
                      price_values={"PZ": pad([40, -20], 50)})
FLAT = FakeSignals(carbon_values={"PZ": pad([], 100), "CZ": pad([], 100)}, price_values={"PZ": pad([], 50)})


def _pool(gpus=4):
    # 1 node x ``gpus`` V100 (0.3 kW busy), PUE 1.2: 0.36 kW per busy GPU; 0.5 USD/GPU-h amortised
    return make_pool("lab").node("V100", gpus).pue(1.2).amortised(0.5).build()


def _bound(trace, offers=(), signals=SIGNALS, block_h=1, **config):
    return lower_bound(trace, [_pool()], list(offers), signals, PlannerConfig(**config), gpu_table(), block_h)


def test_one_job_one_pool_flat_prices_is_the_exact_energy_cost():
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(1).deadline(T0 + 3 * H).build())
    b = _bound(trace, signals=FLAT)
    # 1 GPU x 0.36 kW x 1 h = 0.36 kWh at 50 USD/MWh = 0.018 USD, at 100 g/kWh = 0.036 kg
    assert b.cost_usd == approx(0.018)
    assert b.carbon_kg == approx(0.036)
    # score: 0.018 + 190 USD/t x 0.036e-3 t = 0.02484
    assert b.score_usd == approx(0.018 + 0.19 * 0.036)
    assert b.carbon_price_usd_per_t == 190.0
    assert b.excluded == {} and b.classes == 1 and b.onprem_work_fraction == approx(1.0)
    # the simulator's fifo run of the same job costs exactly this
    m = simulate(trace, [_pool()], [], FLAT, "fifo", gpus=gpu_table(), config=SimulationConfig()).metrics
    assert m["cost_usd"] == approx(b.cost_usd) and m["carbon_kg"] == approx(b.carbon_kg)


def test_amortised_basis_adds_the_capital_to_the_score_only():
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(1).deadline(T0 + 3 * H).build())
    b = _bound(trace, signals=FLAT, onprem_cost_basis="amortised")
    assert b.cost_usd == approx(0.018)
    # + 1 GPU-h x 0.5 USD/GPU-h
    assert b.score_usd == approx(0.018 + 0.5 + 0.19 * 0.036)


def _competing():
    # a: 4 GPUs x 1 h, window hours 0-1.  b: 2 GPUs x 2 h (4 GPU-h), window hours 0-2.  The pool has 4 GPUs.
    return make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).deadline(T0 + 2 * H).build(),
                      make_trace_job("b").at(T0).duration(2 * H).gpus(2).deadline(T0 + 3 * H).build())


# one GPU-hour (0.36 kWh) costs 0.0144 USD in hour 0 (40 USD/MWh), -0.0072 in hour 1, 0.018 in hour 2
G0, G1, G2 = 0.36 * 40 / 1000, 0.36 * -20 / 1000, 0.36 * 50 / 1000


def test_two_jobs_compete_for_the_cheap_hour_and_the_bound_splits_their_work():
    b = _bound(_competing())
    # 8 GPU-h of work, 4 GPU-h per hour; the cheapest two hours (1 then 0) take it all:
    # 4 x (-0.0072) + 4 x 0.0144 = 0.0288 USD (b at most 2 GPU-h per hour, so a is split over hours 0 and 1)
    assert b.cost_usd == approx(4 * G1 + 4 * G0)
    assert b.cost_usd == approx(0.0288)
    # carbon: 4 GPU-h x 0.36 kWh at 100 g (hour 1) + 4 at 200 g (hour 0) = 0.144 + 0.288 = 0.432 kg
    assert b.carbon_kg == approx(0.432)
    assert b.classes == 2
    # LP size: a 2 hour-variables, b 3; 3 capacity rows (hours 0-2) + 2 work rows (one target per class:
    # the parallelism limit is each variable's upper bound)
    assert (b.variables, b.constraints) == (5, 5)


def test_a_job_holds_at_most_its_gpus_in_an_hour_across_pools():
    # two pools of 2 V100 each; one 2-GPU job of 2 h (4 GPU-h) in hours 0-1: hour 1 (-0.0072 per GPU-h)
    # could take all 4 GPU-h on the two pools together, but the job holds 2 GPUs at once: 2 in hour 1, 2 in hour 0
    trace = make_trace(make_trace_job("a").at(T0).duration(2 * H).gpus(2).deadline(T0 + 2 * H).build())
    pools = [make_pool("p").node("V100", 2).pue(1.2).build(), make_pool("q").node("V100", 2).pue(1.2).build()]
    b = lower_bound(trace, pools, [], SIGNALS, PlannerConfig(), gpu_table())
    assert b.cost_usd == approx(2 * G1 + 2 * G0)
    # 2 targets x 2 hours; 2 pools x 2 hours capacity rows + 2 parallelism rows + 1 work row
    assert (b.variables, b.constraints) == (4, 7)


def test_two_hour_blocks_give_a_weaker_bound_by_hand():
    # blocks of 2 h from T0 (T0 is a multiple of 7200 s): block 0 = hours 0-1 at min(0.0144, -0.0072) per GPU-h,
    # block 1 = hours 2-3 at 0.018; 8 GPU-h of capacity per block, b at most 2 GPUs x 2 h = 4 GPU-h per block:
    # a's 4 and b's 4 GPU-h all fit block 0 at -0.0072 -> -0.0576 USD, below the hourly bound's 0.0288
    b = _bound(_competing(), block_h=2)
    assert b.cost_usd == approx(8 * G1)
    assert b.cost_usd <= _bound(_competing()).cost_usd
    with pytest.raises(ValueError):
        _bound(_competing(), block_h=0)


def _cheap_offer():
    # 4 x V100 on-demand at 0.05 USD/h, no boot delay, 60 s minimum: 0.0125 USD per V100-hour of work
    return make_offer("v100x4").gpu("V100", 4).price(0.05).delay(0.0).build()


def test_cloud_work_goes_to_the_cheapest_offer_when_it_beats_the_hour():
    b = _bound(_competing(), [_cheap_offer()])
    # hour 1 is full (4 GPU-h at -0.0072); b needs 2 more GPU-h (at most 2 per hour): hour 0 at 0.0144;
    # a's remaining 2 GPU-h go to the cloud at 0.0125 < 0.0144:  -0.0288 + 0.0288 + 0.025 = 0.025 USD
    assert b.cost_usd == approx(4 * G1 + 2 * G0 + 2 * 0.05 / 4)
    assert b.cost_usd == approx(0.025)
    assert b.onprem_work_fraction <= 1.0


def test_jobs_that_can_run_nowhere_are_excluded_and_reported():
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(1).deadline(T0 + 3 * H).build(),
                       make_trace_job("big").at(T0).duration(H).gpus(8).deadline(T0 + 3 * H).build(),
                       make_trace_job("late").at(T0).duration(H).gpus(1).deadline(T0).build())
    b = _bound(trace, signals=FLAT)
    assert b.excluded == {"no pool or offer can hold the job": 1, "deadline not after submission": 1}
    assert b.cost_usd == approx(0.018)


# ------------------------------------------------------------ exhaustive search (integer start hours)
def _exact_optimum(trace, pool, offers, signals, gpus):
    """Least cost over every placement (the pool or a compatible offer) and integer start hour per job that
    meets every deadline without over-allocating the pool's GPUs in any hour (costs.py's formulas)."""
    price, carbon = signals.price(pool.price_zone), signals.carbon(pool.carbon_zone)
    options = []
    for tj in trace.jobs:
        opts = []
        first, last = int((tj.submit_s - T0) // H), int((tj.deadline_s - T0) // H)
        for s in range(first, last + 1):
            start = T0 + s * H
            if start < tj.submit_s:
                continue
            run = tj.duration_s / gpus.throughput["V100"]
            if start + run <= tj.deadline_s and tj.num_gpus <= pool.total_gpus:
                c = onprem_cost(run, gpus=tj.num_gpus, kw=onprem_kw(tj.num_gpus, gpus.busy_kw["V100"], pool.pue),
                                usd_per_gpu_hour=0.0, tariff_integral=window_integral(price, start, run),
                                carbon_integral=window_integral(carbon, start, run))
                opts.append((c.energy_usd, {(s + k): tj.num_gpus for k in range(math.ceil(run / H))}))
            for o in offers:
                if o.gpu_count < tj.gpus_per_node or o.gpu_count > 4 or (tj.gpus_per_node <= 2 and o.gpu_count > 2):
                    continue  # the planner's compatible shapes (smallest power of two holding the job)
                run = tj.duration_s / gpus.throughput[o.gpu_type]
                if start + o.provisioning_delay_s + run > tj.deadline_s:
                    continue
                c = cloud_cost(run, o.provisioning_delay_s, usd_per_hour=tj.nodes * o.usd_per_hour,
                               min_billed_s=o.min_billed_s, carbon_integral=0.0,
                               kw=cloud_kw(tj.nodes, tj.gpus_per_node, o.gpu_count, 0.3, 0.05, o.pue))
                opts.append((c.dollars_usd, {}))
        options.append(opts)
    best = math.inf
    for combo in itertools.product(*options):
        use: dict[int, int] = {}
        for _, hours in combo:
            for h, g in hours.items():
                use[h] = use.get(h, 0) + g
        if all(g <= pool.total_gpus for g in use.values()):
            best = min(best, sum(c for c, _ in combo))
    return best


@pytest.mark.parametrize("with_offer", [False, True])
def test_bound_is_at_most_the_exact_optimum_with_the_gap_stated(with_offer):
    offers = [_cheap_offer()] if with_offer else []
    exact = _exact_optimum(_competing(), _pool(), offers, SIGNALS, gpu_table())
    b = _bound(_competing(), offers)
    if with_offer:
        # a on the cloud (0.05 USD for 1 h), b on-prem hours 0-1: 2 x 0.0144 + 2 x (-0.0072) = 0.0144 -> 0.0644
        assert exact == approx(0.05 + 2 * G0 + 2 * G1)
        assert b.cost_usd == approx(0.025)
        assert exact - b.cost_usd == approx(0.0394)
    else:
        # the gang of 4 and the 2-GPU job cannot overlap: a in hour 0 (0.0576), b in hours 1-2 (0.0216) -> 0.0792
        assert exact == approx(4 * G0 + 2 * G1 + 2 * G2)
        assert b.cost_usd == approx(0.0288)
        assert exact - b.cost_usd == approx(0.0504)
    assert b.cost_usd <= exact


# ------------------------------------------------------------ below every policy's simulated result
def _traces():
    yield make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).deadline(T0 + 6 * H).build(),
                     make_trace_job("b").at(T0 + 30).duration(1800).gpus(2).deadline(T0 + 6 * H).build(),
                     make_trace_job("c").at(T0 + 120).duration(1800).gpus(2).deadline(T0 + 6 * H).build())
    yield make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).deadline(T0 + 3 * H).build(),
                     make_trace_job("b").at(T0 + 30).duration(H).gpus(4).deadline(T0 + 3 * H).build(),
                     make_trace_job("c").at(T0 + 600).duration(2 * H).gpus(1).deadline(T0 + 8 * H).build())
    yield make_trace(*[make_trace_job(f"j{i}").at(T0 + 900.0 * i).duration(1800.0 * (1 + i % 3)).gpus(1 + i % 4)
                       .deadline(T0 + 900.0 * i + 10 * H).build() for i in range(8)])


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("policy", ["fifo", "backfill", "cheapest", "federated"])
def test_bound_is_below_every_policy_on_tiny_traces(policy, k):
    trace = list(_traces())[k]
    offers = [make_offer("v100x4").gpu("V100", 4).price(2.0).build(),
              make_offer("v100x1-spot").gpu("V100", 1).spot(0.2).price(0.3).build()]
    cfg = PlannerConfig()
    run = simulate(trace, [_pool()], offers, SIGNALS, policy, planner_config=cfg, gpus=gpu_table(),
                   config=SimulationConfig())
    m = run.metrics
    # the bound is for schedules that run every job by its deadline: the runs compared must be such
    assert (m["jobs_completed"], m["deadline_misses"]) == (len(trace.jobs), 0)
    for block_h in (1, 3):
        b = lower_bound(trace, [_pool()], offers, SIGNALS, cfg, gpu_table(), block_h)
        assert b.excluded == {}
        assert b.cost_usd <= m["cost_usd"] + 1e-12
        assert b.carbon_kg <= m["carbon_kg"] + 1e-12
        assert b.score_usd <= policy_score_usd(m, cfg) + 1e-12


def test_policy_score_prices_carbon_and_the_amortised_basis():
    m = {"cost_usd": 10.0, "carbon_kg": 100.0, "onprem_amortised_usd": 3.0}
    assert policy_score_usd(m, PlannerConfig()) == approx(10.0 + 0.19 * 100)
    assert policy_score_usd(m, PlannerConfig(onprem_cost_basis="amortised")) == approx(13.0 + 0.19 * 100)
