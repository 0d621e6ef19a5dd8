"""Fair share (broker.planner.fair_share): the decay, the exact integral the live cycle uses, the ledger the
simulator keeps, and how the two agree. Numbers worked out by hand; invariants with hypothesis."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.model import FAIR_SHARE_HALF_LIFE_S
from broker.planner.fair_share import (UsageLedger, decay_factor, decay_rate, decayed_gpu_hours, decayed_usage,
                                       reference_gpu_hours)

H = 3600.0
WEEK = FAIR_SHARE_HALF_LIFE_S  # 168 h
NOW = 1.7e9


def test_a_half_life_halves_the_weight():
    assert decay_rate(WEEK) == math.log(2) / 604800.0
    assert decay_factor(0.0) == 1.0
    assert decay_factor(WEEK) == pytest.approx(0.5, rel=1e-15)
    assert decay_factor(2 * H, half_life_s=H) == pytest.approx(0.25, rel=1e-15)


def test_two_gpus_for_an_hour_ending_a_half_life_ago():
    # ages 168 h .. 169 h: 2 GPUs x integral of 2^(-age/168 h) d(age) = 2 x 168 h / ln2 x (2^-1 - 2^-(169/168))
    #   = 168 / ln2 x (1 - 2^(-1/168)) = 0.99794 GPU-h: a bit under 2 x 1/2, every second being older than 168 h
    got = decayed_gpu_hours(2, NOW - WEEK - H, NOW - WEEK, NOW)
    assert float(got) == pytest.approx(0.9979398961808484, rel=1e-12)
    assert decayed_usage([("ml", 2, NOW - WEEK - H, NOW - WEEK)], NOW) == {"ml": pytest.approx(0.9979398961808484,
                                                                                               rel=1e-12)}
    # the simulator charges the run's 2 GPU-h at its start (age 169 h): 2 x 2^(-169/168) = 0.99588 GPU-h
    ledger = UsageLedger(NOW - WEEK - H)
    ledger.charge("ml", reference_gpu_hours(2, H))
    ledger.advance(NOW)
    assert ledger.usage["ml"] == pytest.approx(0.9958826236582974, rel=1e-12)


def test_a_running_attempt_counts_up_to_now_and_a_future_one_not_at_all():
    # half-life 1 h: 1 GPU since 1 h ago, still running (NaN end): (1 - 1/2) / ln2 = 0.72135 GPU-h
    got = decayed_usage([("a", 1, NOW - H, math.nan), ("a", 1, NOW - H, None), ("b", 4, NOW + 10.0, math.nan),
                         ("c", 4, NOW - H, NOW + H)], NOW, half_life_s=H)
    assert got == {"a": pytest.approx(2 * 0.5 / math.log(2), rel=1e-12), "c": pytest.approx(4 * 0.5 / math.log(2),
                                                                                              rel=1e-12)}
    assert decayed_usage([], NOW) == {}


def test_reference_gpu_hours_weigh_the_gpu_type():
    # 4 A100 (2.2 x a V100) for 30 min = 4 x 0.5 h x 2.2 = 4.4 reference-GPU-hours
    assert reference_gpu_hours(4, 1800.0, 2.2) == pytest.approx(4.4, rel=1e-15)
    assert reference_gpu_hours(3, 7200.0) == 6.0


def test_the_ledger_decays_only_forward():
    ledger = UsageLedger(0.0, half_life_s=H)
    ledger.charge("a", 8.0)
    ledger.advance(H)
    ledger.advance(H / 2)  # the past: nothing happens
    ledger.charge("b", 1.0)
    ledger.advance(2 * H)
    assert ledger.usage == {"a": pytest.approx(2.0, rel=1e-14), "b": pytest.approx(0.5, rel=1e-14)}
    assert ledger.t_s == 2 * H


def _scalar_usage(rows, now_s, half_life_s):
    """The live cycle's per-row loop before fair_share existed (the reference for the vectorised form)."""
    lam = math.log(2) / half_life_s
    out: dict[str, float] = {}
    for team, gpus, a, b in rows:
        b = now_s if math.isnan(b) else min(b, now_s)
        if b <= a:
            continue
        out[team] = out.get(team, 0.0) + gpus * (math.exp(-lam * (now_s - b)) - math.exp(-lam * (now_s - a))) / lam / H
    return out


_row = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 64), st.floats(-60 * 86400.0, 3600.0),
                 st.one_of(st.just(math.nan), st.floats(1.0, 20 * 86400.0)))


@settings(max_examples=200, deadline=None)
@given(st.lists(_row, max_size=30), st.sampled_from([3600.0, 86400.0, WEEK]))
def test_vectorised_usage_equals_the_per_row_integral(rows, half_life_s):
    rows = [(t, g, NOW + a, NOW + a + d) for t, g, a, d in rows]  # start offset from now, duration (NaN: running)
    want = _scalar_usage(rows, NOW, half_life_s)
    got = decayed_usage(rows, NOW, half_life_s)
    assert got.keys() == {k for k, v in want.items() if v > 0.0}
    for k in got:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 30 * 86400.0), st.floats(0.0, 100.0)), min_size=1, max_size=20),
       st.lists(st.floats(0.0, 30 * 86400.0), max_size=20))
def test_the_ledger_decays_each_charge_from_when_it_was_made(charges, ticks):
    """However the clock advances, a charge made at t weighs decay_factor(now - t) at now."""
    events = sorted([(t, 0, h) for t, h in charges] + [(t, 1, 0.0) for t in ticks])
    ledger = UsageLedger(0.0)
    for t, kind, h in events:
        ledger.advance(t)
        if kind == 0:
            ledger.charge("a", h)
    now = 31 * 86400.0
    ledger.advance(now)
    want = sum(h * decay_factor(now - t) for t, h in charges)
    assert ledger.usage["a"] == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.sampled_from([1.0, 2.2, 4.0]), st.floats(0.0, 20 * 86400.0),
       st.floats(60.0, 2 * 86400.0), st.booleans())
def test_the_simulator_and_the_cycle_agree_on_an_interval(gpus, throughput, age_s, run_s, running):
    """A GPU interval charged into the simulator's ledger in one-minute slices (each at its start) gives the live
    cycle's exact integral to within the slices' discretisation (rate x 60 s / 2 = 3.4e-5 at a week's half-life).
    Charged whole at its start, as the simulator does, the run weighs the integral x lambda d / (e^(lambda d) - 1):
    the same rule, its GPU-hours counted at the start."""
    start = NOW - age_s - run_s
    end = NOW - age_s
    if running:  # still running: the cycle counts up to now
        start, end = NOW - run_s, math.nan
    stop = NOW if running else end
    exact = decayed_usage([("t", gpus * throughput, start, end)], NOW)["t"]

    ledger = UsageLedger(start)
    edges = np.append(np.arange(start, stop, 60.0), stop)
    for a, b in zip(edges[:-1], edges[1:]):
        ledger.advance(a)
        ledger.charge("t", reference_gpu_hours(gpus, b - a, throughput))
    ledger.advance(NOW)
    assert ledger.usage["t"] == pytest.approx(exact, rel=1e-4)
    assert ledger.usage["t"] <= exact * (1 + 1e-12)  # each slice counted at its oldest instant

    whole = UsageLedger(start)
    whole.charge("t", reference_gpu_hours(gpus, stop - start, throughput))
    whole.advance(NOW)
    x = decay_rate() * (stop - start)
    assert whole.usage["t"] == pytest.approx(exact * x / math.expm1(x), rel=1e-9)


def test_the_live_cycle_gives_the_planner_decayed_reference_gpu_hours(pg_store, monkeypatch):
    """The cycle's snapshot: an attempt of 2 A100s (2.2 x a V100) for the hour that ended a half-life ago weighs
    2.2 x 0.99794 = 2.19547 reference-GPU-hours; one of 1 V100 running for the last hour 168/ln2 x (1 - 2^(-1/168))
    = 0.99794 (ages 0 .. 1 h); one never started, nothing (its team is left out)."""
    from datetime import timedelta

    from sqlalchemy import update

    import broker.service.cycle as cycle_mod
    from broker.model import JobSpec
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment
    from broker.service.settings import BrokerSettings
    from broker.service.store import planning
    from broker.service.store.tables import Attempt, utcnow

    now = utcnow()
    spec = JobSpec(command=["true"], estimated_duration_s=600.0)
    ml, vision, idle = (pg_store.submit(team, spec, now=now - timedelta(days=8))[0].id for team in ("ml", "vision", "x"))
    week, hour = timedelta(seconds=WEEK), timedelta(hours=1)
    with pg_store.session() as s:
        planning.add_onprem_attempt(s, ml, 1, "lab", [{"node": "n1", "gpus": [0, 1], "rank": 0}], "A100", now)
        planning.add_onprem_attempt(s, vision, 1, "lab", [{"node": "n2", "gpus": [0], "rank": 0}], "V100", now)
        planning.add_onprem_attempt(s, idle, 1, "lab", [{"node": "n2", "gpus": [1], "rank": 0}], "V100", now)
        s.execute(update(Attempt).where(Attempt.job_id == ml).values(started_at=now - week - hour, ended_at=now - week))
        s.execute(update(Attempt).where(Attempt.job_id == vision).values(started_at=now - hour))
    pg_store.heartbeat("n1", "local", "V100", 1, 16.0, [0], "agent-1", now=now)
    seen = {}
    real_plan = cycle_mod.plan

    def spy(snapshot, ctx):
        seen.update(snapshot.team_usage)
        return real_plan(snapshot, ctx)

    monkeypatch.setattr(cycle_mod, "plan", spy)
    PlanningCycle(pg_store, LiveEnvironment(BrokerSettings().planner), BrokerSettings()).run(now)
    assert seen == {"ml": pytest.approx(2.2 * 0.9979398961808484, rel=1e-9),
                    "vision": pytest.approx(168 / math.log(2) * (1 - 2 ** (-1 / 168)), rel=1e-9)}
