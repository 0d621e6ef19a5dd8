"""Tests for broker.sim.ledger: the simulator writes the live ledger's usage records (issue #12 item 3).

A hand-worked run (multi-node on-prem, a 45-s cloud job billed 60 s, a 2-instance job billed per whole
second, an hour without signals) and a seeded invariant over medium traces: per policy the records' billed
USD add up to the run's ``cost_usd`` and ``onprem_amortised_usd`` to the cent.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timezone

import numpy as np
import pytest

from broker.model import PriorityClass
from broker.sim.simulator import SimulationConfig, simulate
from broker.usage import CHARGEBACK_COLUMNS, chargeback, read_usage_csv, write_usage_csv
from pricing.spot import load_spot_traces
from tests.broker.builders import H, T0, FakeSignals, gpu_table, make_offer, make_pool, make_trace, make_trace_job, pad

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-9)  # noqa: E731

# Pool zone PZ: 40 USD/MWh in hour 0, -20 in hour 1, then 50; carbon 200, 100, then 250 g/kWh; 72 hours from T0.
# Cloud zone CZ: carbon flat 100 g/kWh.
SIGNALS = FakeSignals(carbon_values={"PZ": pad([200, 100], 250), "CZ": pad([], 100)},
                      price_values={"PZ": pad([40, -20], 50)})


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _pool():
    # 2 nodes x 4 V100, PUE 1.2, 0.5 USD/GPU-h amortised
    return make_pool("lab").nodes(2, "V100", 4).pue(1.2).amortised(0.5).build()


def _offer():
    # 1 x V100 on-demand, 3.6 USD/h (0.001 USD/s), no boot delay, PUE 1.1, 60 s minimum (AWS rule), zone CZ
    return make_offer("v100x1").gpu("V100", 1).price(3.6).delay(0.0).build()


def _hand_run():
    trace = make_trace(
        make_trace_job("a").at(T0).duration(H).gpus(4, nodes=2).team("ta").build(),  # fills both nodes for 1 h
        make_trace_job("b").at(T0 + 30).duration(45.0).gpus(1).team("tb").build(),  # pool full: cloud, 45 s
        make_trace_job("c").at(T0 + 40).duration(100.4).gpus(1, nodes=2).team("tb").build(),  # 2 instances
    )
    return simulate(trace, [_pool()], [_offer()], SIGNALS, "cheapest", gpus=gpu_table())


def test_records_of_a_hand_worked_run():
    run = _hand_run()
    recs = {(r.job_id, r.rank, r.line): r for r in run.usage}
    assert sorted(recs) == [("a", 0, "amortised"), ("a", 0, "energy"), ("a", 1, "amortised"), ("a", 1, "energy"),
                            ("b", 0, "instance"), ("c", 0, "instance"), ("c", 1, "instance")]
    assert all(r.source == "sim" and r.attempt == 1 for r in run.usage)
    # a, each rank (node lab-0, lab-1): 4 GPUs x 0.3 kW x PUE 1.2 = 1.44 kW for 1 h at 40 USD/MWh -> 0.0576 USD,
    # 1.44 kWh, at 200 g/kWh 0.288 kg; amortised 4 GPU-h x 0.5 = 2.0 USD
    for rank in (0, 1):
        e, am = recs[("a", rank, "energy")], recs[("a", rank, "amortised")]
        assert (e.resource, e.provider, e.pool, e.region, e.gpu_type, e.gpu_count) == (
            f"lab-{rank}", "onprem", "lab", "PZ", "V100", 4)
        assert (e.start, e.end, e.run_s, e.billed_s) == (_utc(T0), _utc(T0 + H), H, H)
        assert (e.billed_usd, e.energy_kwh, e.carbon_kg) == (approx(0.0576), approx(1.44), approx(0.288))
        assert (e.pricing_unit, e.list_unit_price_usd) == ("kWh", approx(0.040))  # 40 USD/MWh
        assert e.estimated and "power modelled" in e.estimate_reasons[0]
        assert (am.billed_usd, am.energy_kwh, am.carbon_kg, am.pricing_unit, am.list_unit_price_usd) == (
            approx(2.0), 0.0, 0.0, "GPU-Hours", 0.5)
        assert not am.estimated
    # b: created T0+30, runs 45 s: AWS bills the 60-s minimum x 0.001 USD/s = 0.06 USD;
    # 0.3 kW x 1.1 = 0.33 kW x 45 s = 0.004125 kWh, at 100 g/kWh 0.0004125 kg
    b = recs[("b", 0, "instance")]
    assert (b.start, b.end, b.run_s, b.billed_s, b.billed_usd) == (_utc(T0 + 30), _utc(T0 + 75), 45.0, 60.0,
                                                                    approx(0.06))
    assert (b.provider, b.region, b.zone, b.instance_type, b.market, b.pricing_unit, b.list_unit_price_usd) == (
        "aws", "r1", "r1a", "v100x1", "on_demand", "Hours", 3.6)
    assert (b.energy_kwh, b.carbon_kg) == (approx(0.004125), approx(0.0004125))
    # c: created T0+40, 2 instances of 100.4 s, each billed 101 whole seconds -> 2 x 0.101 = 0.202 USD
    for rank in (0, 1):
        c = recs[("c", rank, "instance")]
        assert (c.run_s, c.billed_s, c.billed_usd) == (approx(100.4), 101.0, approx(0.101))
        assert c.resource == f"sim-{_offer().offer_id}-c-1-{rank}"
    m = run.metrics
    # the run's cost_usd: 2 x 0.0576 + 0.06 + 0.202 = 0.3772 USD; amortised 4.0 USD
    assert m["cost_usd"] == approx(2 * 0.0576 + 0.06 + 0.202)
    assert m["cloud_cost_usd"] == approx(0.262)
    assert m["onprem_amortised_usd"] == approx(4.0)
    assert sum(r.billed_usd for r in run.usage if r.line != "amortised") == approx(m["cost_usd"])
    assert sum(r.energy_kwh for r in run.usage) == approx(m["energy_kwh"])
    assert sum(r.carbon_kg for r in run.usage) == approx(m["carbon_kg"])


def test_chargeback_of_the_hand_worked_run():
    cb = _hand_run().chargeback
    assert list(cb) == ["ta", "tb"]  # highest total first
    ta, tb = cb["ta"], cb["tb"]
    assert (ta["cloud_usd"], ta["onprem_energy_usd"], ta["amortised_usd"], ta["total_usd"]) == (
        0.0, approx(0.1152), approx(4.0), approx(4.1152))
    assert (ta["energy_kwh"], ta["carbon_kg"], ta["gpu_hours"], ta["unknown_lines"]) == (
        approx(2.88), approx(0.576), approx(8.0), 0)
    # tb: b 1 GPU x 45 s + c 2 x 1 GPU x 100.4 s = 245.8 GPU-s
    assert (tb["cloud_usd"], tb["onprem_energy_usd"], tb["amortised_usd"]) == (approx(0.262), 0.0, 0.0)
    assert tb["gpu_hours"] == approx(245.8 / 3600)
    assert set(ta) == set(CHARGEBACK_COLUMNS)


def test_an_hour_without_signals_is_unknown_not_zero():
    # one 4-GPU job from T0+71.5 h for 1 h: the 72-hour series end at T0+72 h
    trace = make_trace(make_trace_job("late").at(T0 + 71.5 * H).duration(H).gpus(4).build())
    run = simulate(trace, [_pool()], [], SIGNALS, "fifo", gpus=gpu_table())
    e = next(r for r in run.usage if r.line == "energy")
    assert (e.billed_usd, e.carbon_kg, e.list_unit_price_usd) == (None, None, None)
    assert e.energy_kwh == approx(1.44)
    assert any("no electricity price" in w for w in e.estimate_reasons)
    assert any("no carbon intensity" in w for w in e.estimate_reasons)
    # the run counts it as 0 USD and says so in missing_signal_hours; the chargeback counts the unknown line
    assert run.metrics["cost_usd"] == 0.0 and run.metrics["missing_signal_hours"] == approx(1.0)
    assert run.chargeback["default"]["unknown_lines"] == 1


def test_usage_csv_round_trip(tmp_path):
    run = _hand_run()
    for name in ("usage.csv", "usage.csv.gz"):
        back = read_usage_csv(write_usage_csv(run.usage, tmp_path / name))
        assert len(back) == len(run.usage)
        for a, b in zip(run.usage, back):  # figures are written to 1e-9: equal to that, the rest exactly
            da, db = a.to_dict(), b.to_dict()
            for k in ("run_s", "billed_s", "list_unit_price_usd", "billed_usd", "energy_kwh", "carbon_kg"):
                assert db.pop(k) == pytest.approx(da.pop(k), abs=1e-9), k
            assert db == da


def test_usage_records_can_be_turned_off():
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).build())
    run = simulate(trace, [_pool()], [], SIGNALS, "fifo", gpus=gpu_table(),
                   config=SimulationConfig(usage_records=False))
    assert run.usage == [] and run.chargeback == {}
    assert run.metrics["cost_usd"] == approx(0.0576)


# --------------------------------------------------------------------------- invariant over medium traces
def _medium_trace(seed: int, n: int = 80):
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        nodes = int(rng.choice([1, 1, 1, 2]))
        per = int(rng.choice([1, 2, 4]))
        t = T0 + float(rng.uniform(0, 40 * H))
        tj = (make_trace_job(f"j{i}").at(round(t, 3)).duration(float(rng.uniform(30, 6 * H)))
              .gpus(per, nodes=nodes).deadline(t + float(rng.uniform(2, 24)) * H).team(f"t{i % 5}").build())
        jobs.append(dataclasses.replace(tj, priority=PriorityClass(rng.choice(["low", "normal", "high"])),
                                        preemptible=bool(rng.random() < 0.5)))
    return make_trace(*jobs)


_OFFERS = [make_offer("od1").gpu("V100", 1).price(3.06).delay(90.0).build(),
           make_offer("od4").gpu("V100", 4).price(12.24).delay(120.0).build(),
           make_offer("sp1").gpu("V100", 1).spot(0.2).price(0.92).delay(75.5).build(),
           make_offer("sp4").gpu("V100", 4).spot(0.2).price(3.67).delay(80.0).build()]


@pytest.mark.parametrize("policy", ["fifo", "backfill", "cheapest", "federated"])
def test_records_add_up_to_the_run_to_the_cent(policy):
    seen = {"interrupted": 0, "preempted": 0, "attempts>1": 0, "unknown": 0}
    for seed in (1, 2, 3):
        run = simulate(_medium_trace(seed), [_pool()], _OFFERS, SIGNALS, policy, gpus=gpu_table(),
                       spot_traces=load_spot_traces(), config=SimulationConfig(seed=seed, tick_s=60.0))
        m, recs = run.metrics, run.usage
        billed = sum(r.billed_usd for r in recs if r.line != "amortised" and r.billed_usd is not None)
        assert abs(billed - m["cost_usd"]) < 0.005, (seed, billed, m["cost_usd"])
        amort = sum(r.billed_usd for r in recs if r.line == "amortised")
        assert abs(amort - m["onprem_amortised_usd"]) < 0.005
        assert sum(r.energy_kwh for r in recs) == pytest.approx(m["energy_kwh"], rel=1e-9)
        assert sum(r.carbon_kg or 0.0 for r in recs) == pytest.approx(m["carbon_kg"], rel=1e-9)
        # per job too: the records of a job add up to its JobRecord
        by_job: dict[str, float] = {}
        for r in recs:
            if r.line != "amortised" and r.billed_usd is not None:
                by_job[r.job_id] = by_job.get(r.job_id, 0.0) + r.billed_usd
        for j in run.jobs:
            assert by_job.get(j.job_id, 0.0) == pytest.approx(j.dollars_usd, abs=1e-9)
        for r in recs:
            if r.line == "instance":  # whole seconds, at least the 60-s minimum, never less than ran
                assert r.billed_s == math.ceil(round(r.run_s, 6)) or r.billed_s == 60.0
                assert r.billed_s >= max(60.0, r.run_s - 1e-6)
            else:
                assert r.billed_s == r.run_s and r.provider == "onprem"
            assert r.estimated == bool(r.estimate_reasons)
        # each on-prem rank has one energy and one amortised line over the same window
        lines = [(r.job_id, r.attempt, r.rank, r.line) for r in recs if r.provider == "onprem"]
        assert len(set(lines)) == len(lines)
        ranks = {k[:3] for k in lines}
        assert len(lines) == 2 * len(ranks)
        cb = chargeback(recs)
        assert sum(t["total_usd"] for t in cb.values()) == pytest.approx(billed + amort, abs=1e-6)
        assert run.chargeback == cb
        seen["interrupted"] += m["spot_interruptions"]
        seen["preempted"] += m["preemptions"]
        seen["attempts>1"] += sum(1 for r in recs if r.attempt > 1)
        seen["unknown"] += sum(1 for r in recs if r.billed_usd is None)
    if policy in ("cheapest", "federated"):
        assert seen["interrupted"] > 0 and seen["attempts>1"] > 0, seen
    if policy == "federated":
        assert seen["preempted"] > 0, seen
    if policy == "fifo":  # the traces run past the 72-hour signals: lines with unknown USD, still to the cent
        assert seen["unknown"] > 0, seen


def test_reading_a_bad_usage_csv_names_the_column_or_line(tmp_path):
    from broker.usage import USAGE_CSV_COLUMNS, UsageError

    p = write_usage_csv(_hand_run().usage, tmp_path / "u.csv")
    lines = p.read_text().splitlines()
    (tmp_path / "nocol.csv").write_text("\n".join([lines[0].replace(",billed_usd", "")] + lines[1:2]) + "\n")
    with pytest.raises(UsageError, match="column 'billed_usd' missing"):
        read_usage_csv(tmp_path / "nocol.csv")
    bad = lines[1].split(",")
    bad[USAGE_CSV_COLUMNS.index("end")] = "2023-09-03T00:00:00+00:00"  # before its start
    (tmp_path / "bad.csv").write_text("\n".join([lines[0], ",".join(bad)]) + "\n")
    with pytest.raises(UsageError, match="line 2: end="):
        read_usage_csv(tmp_path / "bad.csv")
