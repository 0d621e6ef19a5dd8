"""Tests for the carbon-price frontier: BoundLP's score LP at many prices (hand-worked and parametric-LP
invariants), which policies use the carbon price, frontier_entries, and the report's frontier section."""

from __future__ import annotations

import json
from html import escape

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.planner.core import PlannerConfig
from broker.planner.registry import POLICIES
from broker.sim.bound import BoundLP, FrontierPoint, lower_bound, policy_score_usd
from broker.sim.report import FRONTIER_TEXT, write_report
from broker.sim.simulator import SimulationConfig, simulate
from broker.sim.sweep import frontier_entries, uses_carbon_price
from tests.broker.builders import H, T0, FakeSignals, gpu_table, make_offer, make_pool, make_trace, make_trace_job, pad

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731

# Zone PZ: hour 0 cheap and dirty (10 USD/MWh, 500 g/kWh), hour 1 dear and clean (60 USD/MWh, 50 g/kWh), then
# 100 USD/MWh at 400 g/kWh. Zone CZ (cloud) flat 20 g/kWh. 72 hourly values from T0.
TRADE = FakeSignals(carbon_values={"PZ": pad([500, 50], 400), "CZ": pad([], 20)},
                    price_values={"PZ": pad([10, 60], 100)})
# one V100-hour on-prem (0.3 kW x PUE 1.2 = 0.36 kWh): hour 0 0.0036 USD, 0.18 kg; hour 1 0.0216 USD, 0.018 kg.
# Equal scores where 0.0036 + p x 0.18e-3 = 0.0216 + p x 0.018e-3: p = 0.018 / 0.162e-3 = 111.1 USD/t.
USD0, KG0, USD1, KG1 = 0.36 * 10 / 1000, 0.36 * 500 / 1000, 0.36 * 60 / 1000, 0.36 * 50 / 1000
PRICES = (0.0, 100.0, 190.0, 500.0, 1000.0, 2000.0)


def _pool(gpus=4):
    return make_pool("lab").node("V100", gpus).pue(1.2).amortised(0.5).build()


def _one_job():
    # 1 GPU x 1 h, window hours 0-1
    return make_trace(make_trace_job("a").at(T0).duration(H).gpus(1).deadline(T0 + 2 * H).build())


def _lp(trace, offers=(), signals=TRADE, block_h=1, **config):
    return BoundLP(trace, [_pool()], list(offers), signals, PlannerConfig(**config), gpu_table(), block_h)


@pytest.mark.parametrize("block_h", [1, 2])
def test_the_bound_moves_to_the_clean_hour_above_the_break_even_price(block_h):
    lp = _lp(_one_job(), block_h=block_h)
    for p in PRICES:
        pt = lp.score_point(p)
        # below 111.1 USD/t the cheap dirty hour 0, above it the clean dear hour 1 (with 2-h steps both hours are one
        # block: the point is still one hour's cost and carbon, the hour of least score, never a mix of the two)
        usd, kg = (USD0, KG0) if p < 111.1 else (USD1, KG1)
        assert (pt.cost_usd, pt.carbon_kg) == (approx(usd), approx(kg)), p
        assert pt.score_usd == approx(usd + p * kg / 1000)
        assert pt.carbon_price_usd_per_t == p and pt.onprem_work_fraction == approx(1.0)


def test_the_score_point_at_the_config_price_is_the_lower_bound_score_and_at_zero_the_cost_bound():
    trace = make_trace(make_trace_job("a").at(T0).duration(2 * H).gpus(4).deadline(T0 + 3 * H).build(),
                       make_trace_job("b").at(T0 + 60).duration(H).gpus(2).deadline(T0 + 4 * H).build())
    offers = [make_offer("v100x4").gpu("V100", 4).price(0.3).delay(0.0).build()]
    b = lower_bound(trace, [_pool()], offers, TRADE, PlannerConfig(), gpu_table())
    lp = _lp(trace, offers)
    assert lp.score_point(190.0).score_usd == approx(b.score_usd)
    assert lp.score_point(0.0).score_usd == approx(b.cost_usd)
    assert lp.score_point(0.0).cost_usd == approx(b.cost_usd)
    assert lp.solve_cost() == approx(b.cost_usd) and lp.solve_carbon() == approx(b.carbon_kg)
    # no price's point has less carbon than the carbon bound, nor less cost than the cost bound
    for p in PRICES:
        pt = lp.score_point(p)
        assert pt.carbon_kg >= b.carbon_kg - 1e-9 and pt.cost_usd >= b.cost_usd - 1e-9


def test_amortised_basis_puts_the_capital_in_the_points_cost():
    pt = _lp(_one_job(), onprem_cost_basis="amortised").score_point(0.0)
    # 1 GPU-h at 0.5 USD/GPU-h amortised + hour 0's electricity
    assert pt.cost_usd == approx(0.5 + USD0) and pt.score_usd == approx(0.5 + USD0)


def test_bad_price_and_empty_trace():
    with pytest.raises(ValueError, match="carbon_price_usd_per_t"):
        _lp(_one_job()).score_point(-1.0)
    empty = make_trace(make_trace_job("late").at(T0).duration(H).gpus(1).deadline(T0).build())
    assert _lp(empty).score_point(190.0) == FrontierPoint(190.0, 0.0, 0.0, 0.0, solve_s=pytest.approx(0.0, abs=1.0))


# ------------------------------------------------------------ parametric LP: the frontier is monotone
_hour = st.tuples(st.floats(-20, 120), st.floats(10, 800))  # USD/MWh, gCO2e/kWh


@settings(max_examples=25, deadline=None)
@given(hours=st.lists(_hour, min_size=6, max_size=6), cloud_ci=st.floats(5, 600), cloud_usd=st.floats(0.05, 3.0),
       block_h=st.sampled_from([1, 2, 3]), jobs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3),
                                                                   st.integers(1, 4)), min_size=1, max_size=5))
def test_as_the_carbon_price_rises_the_bounds_carbon_never_rises_and_its_cost_never_falls(hours, cloud_ci, cloud_usd,
                                                                                         block_h, jobs):
    # For c + p d with fixed c, d, optimality at p1 < p2 gives (p2 - p1)(d x1 - d x2) >= 0: carbon non-increasing,
    # and then cost non-decreasing; the score LP is such an LP over (variable, hour / offer) alternatives.
    signals = FakeSignals(carbon_values={"PZ": pad([c for _, c in hours], 300), "CZ": pad([], cloud_ci)},
                          price_values={"PZ": pad([u for u, _ in hours], 50)})
    trace = make_trace(*[make_trace_job(f"j{i}").at(T0 + s * H).duration(d * H).gpus(g)
                         .deadline(T0 + (s + d + 2) * H).build() for i, (s, d, g) in enumerate(jobs)])
    offers = [make_offer("v100x4").gpu("V100", 4).price(cloud_usd).delay(0.0).build()]
    lp = _lp(trace, offers, signals, block_h)
    pts = [lp.score_point(p) for p in PRICES]
    scale = max(1.0, *(abs(p.cost_usd) + p.carbon_kg for p in pts))
    for a, b in zip(pts, pts[1:]):
        assert b.carbon_kg <= a.carbon_kg + 1e-7 * scale
        assert b.cost_usd >= a.cost_usd - 1e-7 * scale
        assert b.score_usd >= a.score_usd - 1e-7 * scale  # carbon >= 0: the score rises with the price
    for p in pts:
        assert p.score_usd == pytest.approx(p.cost_usd + p.carbon_price_usd_per_t * p.carbon_kg / 1000,
                                            rel=1e-7, abs=1e-9)


# ------------------------------------------------------------ which policies use the carbon price
def test_only_federated_uses_the_carbon_price_and_the_others_decide_the_same_at_any_price():
    assert [p for p in POLICIES if uses_carbon_price(p)] == ["federated"]
    trace = make_trace(*[make_trace_job(f"j{i}").at(T0 + 600.0 * i).duration(1800.0 * (1 + i % 3)).gpus(1 + i % 4)
                         .deadline(T0 + 600.0 * i + 8 * H).build() for i in range(10)])
    offers = [make_offer("v100x4").gpu("V100", 4).price(0.8).build(),
              make_offer("v100x1-spot").gpu("V100", 1).spot(0.2).price(0.1).build()]
    for name in POLICIES:
        if uses_carbon_price(name):
            continue
        runs = [simulate(trace, [_pool(2)], offers, TRADE, name, planner_config=PlannerConfig(carbon_price_usd_per_tonne=p),
                         gpus=gpu_table(), config=SimulationConfig()) for p in (0.0, 2000.0)]
        a, b = (r.metrics for r in runs)
        keys = ("cost_usd", "carbon_kg", "cloud_jobs", "mean_wait_s", "energy_kwh")
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, name
        assert [(j.placement, j.start_s) for j in runs[0].jobs] == [(j.placement, j.start_s) for j in runs[1].jobs]


# ------------------------------------------------------------ results.json "frontier" and the report
def _frontier():
    m_fifo = {"cost_usd": 100.0, "carbon_kg": 1000.0, "onprem_amortised_usd": 40.0, "deadline_misses": 3}
    fed = {0.0: {"cost_usd": 90.0, "carbon_kg": 900.0, "onprem_amortised_usd": 30.0, "deadline_misses": 0},
           500.0: {"cost_usd": 95.0, "carbon_kg": 600.0, "onprem_amortised_usd": 30.0, "deadline_misses": 0}}
    points = {0.0: FrontierPoint(0.0, 60.0, 800.0, 60.0, 0.9), 500.0: FrontierPoint(500.0, 70.0, 400.0, 270.0, 0.8)}
    return frontier_entries([500.0, 0.0], {"fifo": {0.0: m_fifo, 500.0: m_fifo}, "federated": fed}, points,
                            PlannerConfig())


def test_frontier_entries_by_hand():
    f = _frontier()
    assert [e["carbon_price_usd_per_t"] for e in f] == [0.0, 500.0]
    assert f[1]["bound"] == {"cost_usd": 70.0, "carbon_kg": 400.0, "score_usd": 270.0, "onprem_work_fraction": 0.8}
    fifo, fed = f[1]["policies"]["fifo"], f[1]["policies"]["federated"]
    # fifo at 500 USD/t: 100 + 0.5 x 1000 = 600 USD, 600 / 270 = 2.22x
    assert fifo == {"cost_usd": 100.0, "carbon_kg": 1000.0, "score_usd": 600.0, "score_ratio_to_bound": approx(600 / 270),
                    "deadline_misses": 3, "uses_carbon_price": False}
    assert fed["score_usd"] == approx(95.0 + 300.0) and fed["uses_carbon_price"] is True
    assert f[0]["policies"]["federated"]["score_ratio_to_bound"] == approx(90 / 60)
    # amortised basis: the capital is in the cost and the score; no bound: no ratio
    g = frontier_entries([0.0], {"fifo": {0.0: {"cost_usd": 100.0, "carbon_kg": 1000.0, "onprem_amortised_usd": 40.0}}},
                         None, PlannerConfig(onprem_cost_basis="amortised"))
    assert g[0]["bound"] is None
    assert g[0]["policies"]["fifo"]["cost_usd"] == 140.0 and g[0]["policies"]["fifo"]["score_ratio_to_bound"] is None
    assert policy_score_usd({"cost_usd": 100.0, "carbon_kg": 1000.0, "onprem_amortised_usd": 40.0},
                            PlannerConfig(onprem_cost_basis="amortised", carbon_price_usd_per_tonne=0)) == 140.0


def test_report_has_the_frontier_plot_and_table(tmp_path):
    from tests.broker.sim.test_report import _run

    runs = {"fifo": _run("fifo", 1.0), "federated": _run("federated", 2.0, seed=1)}
    jp, hp = write_report(runs, tmp_path, {"trace": "t"}, None, _frontier())
    doc = json.loads(jp.read_text())
    assert doc["frontier"] == json.loads(json.dumps(_frontier()))
    html = hp.read_text()
    section = html[html.index("<h2>Carbon-price frontier</h2>"):]
    section = section[:section.index("<h2>", 1)]  # up to the next section
    assert "<img alt='Cost vs carbon as the carbon price sweeps" in section and "data:image/png;base64," in section
    assert "2.22x; 3 late" in section and "$500" in section
    assert escape(FRONTIER_TEXT, quote=True) in html  # how to read it
    # without a frontier: no section, no key
    jp, hp = write_report(runs, tmp_path / "plain", {"trace": "t"})
    assert "frontier" not in json.loads(jp.read_text()) and "Carbon-price frontier" not in hp.read_text()


def test_frontier_points_are_below_every_policy_at_each_price():
    # the tiny trace every policy completes in time: at every price each policy's score is at least the bound's
    trace = make_trace(make_trace_job("a").at(T0).duration(H).gpus(4).deadline(T0 + 6 * H).build(),
                       make_trace_job("b").at(T0 + 30).duration(1800).gpus(2).deadline(T0 + 6 * H).build())
    offers = [make_offer("v100x4").gpu("V100", 4).price(2.0).build()]
    lp = _lp(trace, offers)
    for p in PRICES:
        cfg = PlannerConfig(carbon_price_usd_per_tonne=p)
        for name in POLICIES:
            m = simulate(trace, [_pool()], offers, TRADE, name, planner_config=cfg, gpus=gpu_table(),
                         config=SimulationConfig()).metrics
            assert m["deadline_misses"] == 0
            assert lp.score_point(p).score_usd <= policy_score_usd(m, cfg) + 1e-12, (name, p)
    assert np.isfinite(lp.score_point(2000.0).score_usd)


def test_a_task_that_fails_in_a_worker_raises_here_and_the_rest_are_dropped():
    from broker.sim.sweep import RunSpec, Task, run_tasks

    spec = RunSpec(trace="philly", limit=20)
    tasks = [Task("run", 0.0, "nope"), Task("run", 0.0, "fifo"), Task("run", 0.0, "fifo"), Task("run", 0.0, "fifo")]
    with pytest.raises(ValueError, match="nope"):
        run_tasks(tasks, spec, workers=2)
    done = []
    out = run_tasks(tasks[1:2], spec, workers=2, on_done=lambda t, r, s: done.append(t))  # one task: in-process
    assert done == tasks[1:2] and out[0]["jobs_submitted"] == 20


def test_run_spec_loads_the_user_signals_in_a_worker(tmp_path):
    # the worker processes rebuild the scenario from the RunSpec: --signals must reach them
    from broker.sim.sweep import RunSpec

    (tmp_path / "c.csv").write_text("zone,hour_utc,value,unit,quality\n"
                                    "CA-ON,2023-09-04T00:00Z,123,gCO2e/kWh,measured\n")
    _, scen = RunSpec(trace="philly", limit=5, signals=str(tmp_path)).load()
    c = scen.signals.carbon("CA-ON")
    assert c.values.tolist() == [123.0] and c.start_s == 1693785600.0  # 2023-09-04T00:00Z
    assert scen.user_signals.files == [tmp_path / "c.csv"]
    _, bundled = RunSpec(trace="philly", limit=5).load()
    assert bundled.signals.carbon("CA-ON").values.size == 17544 and bundled.user_signals is None
