"""Tests for broker.sim.report: results.json, self-contained HTML, rich and Markdown tables."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from rich.console import Console
from rich.table import Table

from broker.sim.report import (JOB_CSV_COLUMNS, chargeback_summary, comparison_table, format_value, markdown_table,
                               to_jsonable, write_job_csv, write_report)
from broker.sim.results import METRIC_KEYS, JobRecord, PolicyRun


def _metrics(base: float) -> dict[str, float]:
    m = {k: base + i for i, k in enumerate(METRIC_KEYS)}
    m["jobs_submitted"] = 1000
    m["cost_usd"] = 12345.678
    m["onprem_gpu_utilization"] = 0.625
    m["mean_wait_s"] = 5400.0
    return m


def _run(name: str, base: float, n: int = 50, seed: int = 0) -> PolicyRun:
    rng = np.random.default_rng(seed)
    t = 1693785600.0 + np.arange(n) * 300.0
    return PolicyRun(
        policy=name,
        metrics=_metrics(base),
        timeline_t_s=t,
        cum_cost_usd=np.cumsum(rng.random(n)),
        cum_carbon_kg=np.cumsum(rng.random(n)),
        onprem_busy_gpus=rng.integers(0, 385, n).astype(float),
        onprem_total_gpus=384,
        team_cost_usd={f"team{i:02d}": float(100 - i) for i in range(12)},
        waits_s=rng.exponential(600.0, n),
        skipped={"bad_duration": 2},
    )


def test_write_report_json_exact_and_html(tmp_path):
    runs = {"fifo": _run("fifo", 1.0), "federated": _run("federated", 100.0, seed=1)}
    runs["federated"].metrics["p95_jct_s"] = float("nan")
    runs["federated"].metrics["cloud_jobs"] = np.int64(7)
    runs["federated"].metrics["carbon_kg"] = np.float32(2.5)
    meta = {"trace": "philly", "jobs": np.int64(82247), "shift_weeks": 313, "bad": float("inf")}
    jp, hp = write_report(runs, tmp_path / "out", meta)
    assert jp == tmp_path / "out" / "results.json" and hp == tmp_path / "out" / "report.html"

    doc = json.loads(jp.read_text())
    assert set(doc) == {"policies", "meta", "skipped"}
    assert list(doc["policies"]) == ["fifo", "federated"]
    assert doc["policies"]["fifo"] == _metrics(1.0)
    fed = doc["policies"]["federated"]
    assert fed["p95_jct_s"] is None
    assert fed["cloud_jobs"] == 7 and isinstance(fed["cloud_jobs"], int)
    assert fed["carbon_kg"] == 2.5
    assert fed["cost_usd"] == 12345.678
    assert doc["meta"] == {"trace": "philly", "jobs": 82247, "shift_weeks": 313, "bad": None}
    assert doc["skipped"] == {"fifo": {"bad_duration": 2}, "federated": {"bad_duration": 2}}

    html = hp.read_text()
    assert html.count("<img ") == 5
    assert html.count("src='data:image/png;base64,") == 5
    assert "http://" not in html and "https://" not in html  # self-contained
    for k in METRIC_KEYS:
        assert k in html
    assert "$12,346" in html and "62.5 %" in html


def test_report_with_empty_timelines(tmp_path):
    jp, hp = write_report({"fifo": PolicyRun("fifo", {"cost_usd": 1.0})}, tmp_path, {})
    assert json.loads(jp.read_text())["policies"]["fifo"] == {"cost_usd": 1.0}
    assert hp.read_text().count("data:image/png;base64,") == 5


def test_plotting_fast_with_large_timelines(tmp_path):
    runs = {p: _run(p, float(i), n=100_000, seed=i) for i, p in enumerate(["fifo", "backfill", "cheapest", "federated"])}
    t0 = time.perf_counter()
    write_report(runs, tmp_path, {})
    assert time.perf_counter() - t0 < 5.0


def test_markdown_and_rich_tables():
    runs = {"fifo": _run("fifo", 1.0), "cheap|est": _run("cheap|est", 2.0)}
    md = markdown_table(runs)
    lines = md.strip().splitlines()
    assert lines[0] == "| metric | unit | fifo | cheap\\|est |"
    assert lines[1] == "|---|---|---:|---:|"
    assert len(lines) == 2 + len(METRIC_KEYS)
    assert "| cost_usd | USD | $12,346 | $12,346 |" in lines
    assert "| mean_wait_s | s | 1.5 h | 1.5 h |" in lines
    assert "| onprem_gpu_utilization | fraction | 62.5 % | 62.5 % |" in lines
    assert "| jobs_submitted | jobs | 1,000 | 1,000 |" in lines

    t = comparison_table(runs)
    assert isinstance(t, Table)
    assert [c.header for c in t.columns] == ["metric", "unit", "fifo", "cheap|est"]
    assert t.row_count == len(METRIC_KEYS)
    console = Console(width=200, record=True)
    console.print(t)
    text = console.export_text()
    assert "$12,346" in text and "1.5 h" in text


@pytest.mark.parametrize("value,unit,text", [
    (None, "USD", "\u2014"), (float("nan"), "s", "\u2014"), (12, "jobs", "12"), (1234567, "count", "1,234,567"),
    (45.0, "s", "45.0 s"), (600, "s", "10.0 min"), (7200, "s", "2.0 h"), (3 * 86400, "s", "3.0 d"),
    (99.5, "USD", "$99.50"), (-250, "USD", "-$250"), (0.5, "fraction", "50.0 %"), (3.14159, "ms", "3.14 ms"),
    (1234.5, "kWh", "1,234"), (0.01234, "kgCO2e", "0.0123"),
])
def test_format_value(value, unit, text):
    assert format_value(value, unit) == text


def test_to_jsonable():
    out = to_jsonable({"a": np.arange(3), 1: np.float64("nan"), "b": (np.bool_(True), math.inf)})
    assert out == {"a": [0, 1, 2], "1": None, "b": [True, None]}
    json.dumps(out, allow_nan=False)


def test_write_job_csv_one_row_per_job_with_exact_cells(tmp_path):
    import csv

    t0 = 1693785600.0  # 2023-09-04T00:00:00Z
    jobs = [JobRecord(job_id="a", team="nlp", gpus=4, submit_s=t0 + 30, start_s=t0 + 360, end_s=t0 + 3960,
                      placement="aws:r1a:v100x4:on_demand", market="on_demand", dollars_usd=10.0 * 3900 / 3600,
                      amortised_usd=0.0, energy_kwh=1.32, carbon_kg=0.132, deadline_s=t0 + 7200, starts=1,
                      status="completed"),
            JobRecord(job_id="d", team="cv", gpus=8, submit_s=t0 + 200, start_s=math.nan, end_s=math.nan,
                      placement="", market="", dollars_usd=0.0, amortised_usd=0.0, energy_kwh=0.0, carbon_kg=0.0,
                      deadline_s=t0 + 3600, starts=0, status="rejected")]
    path = write_job_csv(PolicyRun(policy="cheapest", metrics={}, jobs=jobs), tmp_path / "jobs-cheapest.csv")
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == list(JOB_CSV_COLUMNS)
    assert rows[0] == {"job_id": "a", "team": "nlp", "gpus": "4", "status": "completed",
                       "submit": "2023-09-04T00:00:30+00:00", "start": "2023-09-04T00:06:00+00:00",
                       "end": "2023-09-04T01:06:00+00:00", "placement": "aws:r1a:v100x4:on_demand",
                       "market": "on_demand", "dollars_usd": repr(10.0 * 3900 / 3600), "amortised_usd": "0.0",
                       "energy_kwh": "1.32", "carbon_kg": "0.132", "wait_s": "330.0",
                       "deadline": "2023-09-04T02:00:00+00:00", "deadline_met": "true", "starts": "1"}
    assert (rows[1]["start"], rows[1]["end"], rows[1]["wait_s"], rows[1]["deadline_met"]) == ("", "", "", "")
    assert float(rows[0]["dollars_usd"]) == 10.0 * 3900 / 3600  # repr round-trips exactly


# --------------------------------------------------------------------------- chargeback
def _cb():
    z = dict(cloud_usd=0.0, onprem_energy_usd=0.0, amortised_usd=0.0, total_usd=0.0, idle_usd=0.0, energy_kwh=0.0,
             carbon_kg=0.0, gpu_hours=0.0, unknown_lines=0)
    return {"vc1": {**z, "cloud_usd": 1200.0, "onprem_energy_usd": 40.0, "amortised_usd": 260.0, "total_usd": 1500.0,
                    "energy_kwh": 800.0, "carbon_kg": 120.0, "gpu_hours": 640.0},
            "vc2<x>": {**z, "onprem_energy_usd": 10.0, "amortised_usd": 490.0, "total_usd": 500.0, "energy_kwh": 200.0,
                       "carbon_kg": 30.0, "gpu_hours": 980.0, "unknown_lines": 2}}


def test_chargeback_summary_one_line_by_hand():
    # totals: 2,000 USD = cloud 1,200 + energy 50 + amortised 750; 1,000 kWh; 150 kg; 1,620 GPU-h; vc1 1,500 = 75 %
    assert chargeback_summary("federated", _cb()) == (
        "chargeback (federated): 2 teams, $2,000 (cloud $1,200, on-prem energy $50.00, amortised $750), 1,000 kWh, "
        "150 kgCO2e, 1,620 GPU-h; top team vc1 $1,500 (75 %); 2 lines with an unknown figure")
    assert chargeback_summary("fifo", {}) == "chargeback (fifo): no usage"


def test_report_html_has_a_chargeback_table_per_policy(tmp_path):
    runs = {"fifo": _run("fifo", 1.0), "federated": _run("federated", 100.0, seed=1)}
    runs["fifo"].chargeback = _cb()
    runs["federated"].chargeback = {"vc1": _cb()["vc1"]}
    jp, hp = write_report(runs, tmp_path, {})
    html = hp.read_text()
    sec = html[html.index("<h2>Chargeback</h2>"):]
    # federated (the main policy) first and unfolded, fifo folded; names escaped; an all-teams row
    assert sec.index("<details open id='chargeback-federated'>") < sec.index("<details id='chargeback-fifo'>")
    assert "<th>vc2&lt;x&gt;</th>" in sec and "<th>all teams</th>" in sec
    fifo = sec[sec.index("id='chargeback-fifo'"):]
    assert ("<tr><th>all teams</th><th class='num'>$1,200</th><th class='num'>$50.00</th><th class='num'>$750</th>"
            "<th class='num'>$2,000</th><th class='num'>1,000</th><th class='num'>150</th>"
            "<th class='num'>1,620</th></tr>") in fifo
    assert json.loads(jp.read_text())["chargeback"]["fifo"]["vc1"]["cloud_usd"] == 1200.0
    # without usage records: no section
    hp2 = write_report({"fifo": _run("fifo", 1.0)}, tmp_path / "b", {})[1]
    assert "Chargeback" not in hp2.read_text()
