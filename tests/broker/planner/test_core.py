"""Tests for PlannerContext's costing (onprem_estimate / cloud_estimates) and compatible_offers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from broker.planner.core import PlannerError
from broker.planner.registry import plan
from tests.broker.builders import (H, T0, FakeSignals, make_ctx, make_job, make_offer, make_pool,
                                   make_snapshot, pad)

# Pool zone PZ: price (USD/MWh) 40, -20 (negative hour), 100, 60, then 50; carbon (g/kWh) 200, 100, 300, 400, then 250.
# Offer zone CZ: carbon 100, 50, 80, 200, then 150; zone CZ2: flat 300 (same grid, exercises the SeriesStack).
SIGNALS = FakeSignals(
    carbon_values={"PZ": pad([200, 100, 300, 400], 250), "CZ": pad([100, 50, 80, 200], 150), "CZ2": pad([], 300)},
    price_values={"PZ": pad([40, -20, 100, 60], 50)},
)
approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731


def _pool():
    return make_pool("lab").node("V100", 4).node("A100", 4, 40.0).pue(1.5).amortised(0.4).build()


def test_onprem_estimate_fractional_window_v100():
    ctx = make_ctx([_pool()], signals=SIGNALS)
    job = make_job("j").gpus(2).work(2.5 * H).build()
    runtime, e_cost, amort, kwh, kg = ctx.onprem_estimate(0, "V100", job, T0 + 0.5 * H)
    # runtime 9000 s on V100 (throughput 1); window [0.5 h, 3.0 h]
    # kW = 2 GPUs x 0.3 kW x PUE 1.5 = 0.9
    # price integral = 0.5 x 40 + 1 x (-20) + 1 x 100 = 100 USD/MWh.h -> 0.9 x 100 / 1000 = 0.09 USD
    # carbon integral = 0.5 x 200 + 100 + 300 = 500 g/kWh.h -> 0.9 x 500 / 1000 = 0.45 kg
    # energy = 0.9 kW x 2.5 h = 2.25 kWh; amortised = 2 GPUs x 2.5 h x 0.4 = 2.0 USD
    assert runtime == approx(9000.0)
    assert e_cost == approx(0.09)
    assert amort == approx(2.0)
    assert kwh == approx(2.25)
    assert kg == approx(0.45)


def test_onprem_estimate_negative_price_hour_a100():
    ctx = make_ctx([_pool()], signals=SIGNALS)
    job = make_job("j").gpus(2).work(2 * H).build()
    runtime, e_cost, amort, kwh, kg = ctx.onprem_estimate(0, "A100", job, T0 + H)
    # runtime = 7200 / 2.0 = 3600 s, window [1 h, 2 h] = the -20 USD/MWh hour
    # kW = 2 x 0.4 x 1.5 = 1.2 -> cost 1.2 x (-20) / 1000 = -0.024 USD (paid to consume)
    # carbon 1.2 x 100 / 1000 = 0.12 kg; energy 1.2 kWh; amortised 2 x 1 h x 0.4 = 0.8
    assert (runtime, e_cost, amort, kwh, kg) == (approx(3600.0), approx(-0.024), approx(0.8), approx(1.2),
                                                 approx(0.12))
    # half an hour earlier: [0.5, 1.5] -> 0.5 x 40 + 0.5 x (-20) = 10 -> 0.012 USD; carbon 0.5x200+0.5x100=150 -> 0.18
    _, e2, _, _, kg2 = ctx.onprem_estimate(0, "A100", job, T0 + 0.5 * H)
    assert e2 == approx(0.012) and kg2 == approx(0.18)


def test_onprem_estimate_outside_coverage_is_nan_not_zero():
    ctx = make_ctx([_pool()], signals=SIGNALS)
    job = make_job("j").gpus(1).work(2 * H).build()
    _, e_cost, _, kwh, kg = ctx.onprem_estimate(0, "V100", job, T0 + 71 * H)  # ends at 73 h > 72 h of data
    assert math.isnan(e_cost) and math.isnan(kg)
    assert kwh == approx(1 * 0.3 * 1.5 * 2)  # energy does not need the signals: 0.9 kWh


def _offers():
    return [
        # 0: A100 spot, 4 GPUs, 3 USD/h, 0.1 interruptions/h, 300 s boot, PUE 1.1, carbon zone CZ
        make_offer("a100x4-spot").gpu("A100", 4, 40.0).spot(0.1).price(3.0).delay(300).pue(1.1).build(),
        # 1: same, on-demand (rate 0)
        make_offer("a100x4-od").gpu("A100", 4, 40.0).price(5.0).delay(300).pue(1.1).build(),
        # 2: V100 x1 on-demand in CZ2, no boot delay, 120 s minimum
        make_offer("v100x1").gpu("V100", 1).price(0.9).delay(0).min_billed(120).carbon_zone("CZ2").build(),
    ]


def test_cloud_estimate_spot_rework_checkpointable():
    ctx = make_ctx([_pool()], _offers(), signals=SIGNALS, restart_overhead_s=300.0)
    job = make_job("j").gpus(3).work(4 * H).checkpoint(1800).build()
    runtime, bound, delay, dollars, kwh, kg, usd_h = ctx.cloud_estimates(job, np.array([0, 1]), T0 + 3300)
    # A100 runtime = 14400 / 2 = 7200 s (2 h)
    # spot rework: 0.1/h x 2 h = 0.2 interruptions x (1800/2 + 300 restart) = 0.2 x 1200 = 240 s -> 7440 s
    # billed from the create call: 7440 + 300 = 7740 s -> 3.0 USD/h x 7740/3600 = 6.45 USD
    # kW = 1 instance x (3 busy x 0.4 + 1 idle x 0.06) x 1.1 = 1.386 -> 1.386 x 7440/3600 = 2.8644 kWh
    # carbon window starts after boot: [T0+3600, +7440 s] = hours [1, 3.0667]:
    #   50 + 80 + (240/3600) x 200 = 143.333.. g/kWh.h -> 1.386 x 143.333../1000 kg
    assert runtime.tolist() == [approx(7440.0), approx(7200.0)]
    assert (delay + runtime).tolist() == [approx(7740.0), approx(7500.0)]
    # pessimistic finish: 0.2 + 2 sqrt(0.2) interruptions, each losing a whole interval + restart + a new boot
    # (1800 + 300 + 300 = 2400 s): 300 + 7200 + 1.0944272 x 2400 = 10126.625 s; on-demand 300 + 7200
    assert bound.tolist() == [approx(7500.0 + (0.2 + 2 * math.sqrt(0.2)) * 2400.0), approx(7500.0)]
    assert dollars[0] == approx(6.45)
    # on-demand: no rework, billed 7500 s x 5 USD/h = 10.4166.. USD
    assert dollars[1] == approx(5.0 * 7500 / 3600)
    assert kwh[0] == approx(1.386 * 7440 / 3600)
    assert kwh[1] == approx(1.386 * 2.0)
    assert kg[0] == approx(1.386 * (50 + 80 + 240 / 3600 * 200) / 1000)
    assert kg[1] == approx(1.386 * (50 + 80) / 1000)
    assert usd_h.tolist() == [3.0, 5.0]


def test_cloud_estimate_spot_rework_not_checkpointable():
    ctx = make_ctx([_pool()], _offers(), signals=SIGNALS, restart_overhead_s=300.0)
    job = make_job("j").gpus(3).work(4 * H).checkpoint(None).build()
    runtime, bound, delay, dollars, *_ = ctx.cloud_estimates(job, np.array([0]), T0)
    # lost per interruption = half the run (3600) + 300 = 3900 s; 0.2 x 3900 = 780 s -> 7980 s
    # billed 7980 + 300 = 8280 s x 3 USD/h = 6.9 USD
    assert runtime[0] == approx(7980.0)
    assert delay[0] + runtime[0] == approx(8280.0)
    # pessimistic: each interruption loses the whole run + restart + boot (7200 + 300 + 300 = 7800 s)
    assert bound[0] == approx(7500.0 + (0.2 + 2 * math.sqrt(0.2)) * 7800.0)
    assert dollars[0] == approx(6.9)


def test_cloud_estimate_billing_minimum_and_gang_instances():
    ctx = make_ctx([_pool()], _offers(), signals=SIGNALS)
    short = make_job("s").gpus(1).work(30).build()
    runtime, finish, delay, dollars, kwh, kg, usd_h = ctx.cloud_estimates(short, np.array([2]), T0)
    # 30 s on V100, no boot delay: billed max(30, 120) = 120 s x 0.9 USD/h = 0.03 USD
    # energy and carbon count only the 30 s run: 0.3 kW x 1.1 = 0.33 kW x 30 s = 0.00275 kWh; CZ2 300 g -> 0.000825 kg
    assert runtime[0] == approx(30.0) and finish[0] == approx(30.0)
    assert dollars[0] == approx(0.03)
    assert kwh[0] == approx(0.33 * 30 / 3600)
    assert kg[0] == approx(0.33 * 300 * 30 / 3600 / 1000)
    gang = make_job("g").gpus(1).nodes(3).work(H).build()
    _, _, _, dollars, kwh, _, usd_h = ctx.cloud_estimates(gang, np.array([2]), T0)
    # 3 instances x 0.9 USD/h x 1 h = 2.7 USD; 3 x 0.33 kW x 1 h = 0.99 kWh
    assert dollars[0] == approx(2.7) and kwh[0] == approx(0.99) and usd_h[0] == approx(2.7)


def test_compatible_offers_shapes_markets_regions():
    offers = _offers() + [make_offer("v100x8").gpu("V100", 8).region("r2").build()]
    ctx = make_ctx([_pool()], offers, signals=SIGNALS)
    # each node takes the smallest shape that holds it in its (provider, zone, GPU type, market):
    # 3 GPUs: A100x4 (r1a) and V100x8 (r2a, the only V100 shape there), not V100x1 (too small)
    assert ctx.compatible_offers(make_job("a").gpus(3).build()).tolist() == [0, 1, 3]
    assert ctx.compatible_offers(make_job("b").gpus(3).no_spot().build()).tolist() == [1, 3]
    # 1 GPU: V100x1 in r1a; A100x4 and V100x8 are the smallest shapes of their groups, so a user could buy them
    assert ctx.compatible_offers(make_job("c").gpus(1).build()).tolist() == [0, 1, 2, 3]
    # a gang: one instance per node, the smallest shape holding gpus_per_node
    assert ctx.compatible_offers(make_job("d").gpus(8).nodes(2).build()).tolist() == [3]
    assert ctx.compatible_offers(make_job("e").gpus(4).nodes(2).types("A100").build()).tolist() == [0, 1]
    assert ctx.compatible_offers(make_job("f").gpus(4).nodes(2).mem(80).build()).tolist() == []
    j = make_job("g").gpus(8).build()
    j.regions = frozenset({"r1"})
    assert ctx.compatible_offers(j).tolist() == []


def test_context_rejects_unknown_gpu_type_and_missing_zone():
    with pytest.raises(PlannerError, match="H100"):
        make_ctx([make_pool().node("H100", 8).build()], signals=SIGNALS)
    with pytest.raises(PlannerError, match="NOPE"):
        make_ctx([make_pool().node("V100", 8).zone("NOPE").build()], signals=SIGNALS)


def test_plan_checks_free_arrays_against_pools():
    ctx = make_ctx([_pool()], signals=SIGNALS, policy="fifo")
    with pytest.raises(PlannerError, match="free: 2 arrays for 1 pools"):
        plan(make_snapshot(T0, [], [[4, 4], [4, 4]]), ctx)


def test_value_of_time_scales_with_gpus_and_priority():
    ctx = make_ctx([_pool()], signals=SIGNALS, value_of_time_usd_per_gpu_hour=0.01)
    # 0.01 USD/GPU-h x 8 GPUs x multiplier (0.5, 1, 10, 50)
    vals = [ctx.value_of_time(make_job("j").gpus(4).nodes(2).priority(p).build()) for p in range(4)]
    assert vals == [approx(0.04), approx(0.08), approx(0.8), approx(4.0)]


def test_set_signals_replaces_every_series_the_planner_reads_and_keeps_the_static_caches():
    ctx = make_ctx([_pool()], _offers(), signals=SIGNALS)
    job = make_job("j").gpus(2).work(2 * H).build()
    offers_before = ctx.compatible_offers(job)
    # everything doubled: price 80, -40, 200, 120 ...; carbon x2 in every zone
    doubled = FakeSignals(carbon_values={z: [2 * v for v in vals] for z, vals in SIGNALS.carbon_values.items()},
                          price_values={z: [2 * v for v in vals] for z, vals in SIGNALS.price_values.items()})
    _, e1, _, _, kg1 = ctx.onprem_estimate(0, "V100", job, T0)
    c1 = ctx.cloud_scalar(job, 0, T0 + 3300)
    ctx.set_signals(doubled)
    _, e2, _, _, kg2 = ctx.onprem_estimate(0, "V100", job, T0)
    c2 = ctx.cloud_scalar(job, 0, T0 + 3300)
    # V100, 0.9 kW (2 x 0.3 x PUE 1.5) over hours [0, 2): price 40 - 20 = 20 -> 0.018 USD, x2; carbon
    # 200 + 100 = 300 -> 0.27 kg, x2; the cloud offer: carbon x2, its dollars unchanged
    assert (e2, kg2) == (approx(2 * e1), approx(2 * kg1)) and (e1, kg1) == (approx(0.018), approx(0.27))
    assert c2.carbon_kg == approx(2 * c1.carbon_kg) and c2.dollars_usd == c1.dollars_usd
    assert ctx.zone_integrals(np.array([0]), np.array([T0]), np.array([H]))[0] == approx(2 * 100.0)
    assert ctx.compatible_offers(job) is offers_before  # per-shape cache kept
    with pytest.raises(PlannerError, match="price_zone='PZ' has no series"):
        ctx.set_signals(FakeSignals(carbon_values=SIGNALS.carbon_values))
