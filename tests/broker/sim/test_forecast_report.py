"""The forecast report (broker/sim/forecast_report.py): regret rows, the Markdown tables, the command."""

from __future__ import annotations

import csv
import math

import pytest

from broker.sim.forecast_report import REGRET_MODES, RegretRow, main, markdown, regret_rows


def _err(kind, zone, model, lo, hi, mape, mae, left=0.0):
    return dict(kind=kind, zone=zone, estimated=False, model=model, lo_h=lo, hi_h=hi, mae=mae, mape=mape, pairs=10,
                mape_left_out=left)


def test_regret_is_the_forecast_run_minus_the_perfect_run_of_the_same_zone():
    rows = regret_rows(["DE-LU"], jobs=40, workers=1, hybrid=False)
    assert [(r.scenario, r.zone, r.model) for r in rows] == [("onprem", "DE-LU", m) for m in REGRET_MODES]
    p = rows[0]
    assert p.model == "perfect" and p.regret_usd == 0.0 and p.regret_kg == 0.0 and p.cost_usd > 0
    for r in rows[1:]:
        assert r.regret_usd == r.cost_usd - p.cost_usd and r.regret_kg == r.carbon_kg - p.carbon_kg
        assert math.isfinite(r.regret_usd) and math.isfinite(r.regret_kg)


def test_markdown_marks_the_best_model_per_bucket_and_gives_regret_in_percent():
    from pricing.forecast_eval import HORIZON_BUCKETS

    errors = []
    for (lo, hi) in HORIZON_BUCKETS:
        errors += [_err("carbon", "Z", "naive_day", lo, hi, 20.0, 50.0), _err("carbon", "Z", "naive_week", lo, hi, 30.0, 60.0),
                   _err("carbon", "Z", "blend", lo, hi, 10.0, 40.0),
                   _err("price", "P", "naive_day", lo, hi, 5.0, 7.0, 0.25),
                   _err("price", "P", "naive_week", lo, hi, float("nan"), 8.0, 0.25),
                   _err("price", "P", "blend", lo, hi, 6.0, 9.0, 0.25)]
    regret = [RegretRow("onprem", "Z", m, 100.0 + i * 10, 1000.0 + i * 50, i * 10.0, i * 50.0, 0, 1.0)
              for i, m in enumerate(REGRET_MODES)]
    md = markdown(errors, regret, None, dict(command="cmd", machine="m", commit="abc", date="d", wall_s=1.0, jobs=40,
                                             start="2024-09-02"))
    assert "| Z | 20.0 / 30.0 / **10.0** | 20.0 / 30.0 / **10.0** |" in md
    assert "| P | **5.0** / — / 6.0 |" in md  # a bucket with no MAPE pair shows a dash, never 0
    assert "mean share left out: 25.0 %" in md
    # naive_day: +10 USD of 100 = +10.0 %, +50 kg of 1000 = +5.0 %; blend (i = 3): +30 (+30.0 %), +150 (+15.0 %)
    assert "| onprem | Z | 100, 1,000 | +10.0 (+10.0 %), +50 (+5.0 %) | +20.0 (+20.0 %), +100 (+10.0 %) | " \
           "+30.0 (+30.0 %), +150 (+15.0 %) |" in md


def test_the_command_writes_the_tables(tmp_path):
    out = tmp_path / "fc"
    assert main(["--out", str(out), "--no-fit", "--no-hybrid", "--zones", "GB", "--jobs", "20", "--workers", "1"]) == 0
    md = (out / "FORECASTS.md").read_text()
    assert "### Carbon: MAPE % by horizon" in md and "| **mean of 27 zones** |" in md and "| onprem | GB |" in md
    with open(out / "forecast_error.csv") as f:
        rows = list(csv.DictReader(f))
    # 27 carbon + 12 price zones x 3 models x 4 buckets
    assert len(rows) == (27 + 12) * 3 * 4
    with open(out / "regret.csv") as f:
        assert [r["model"] for r in csv.DictReader(f)] == list(REGRET_MODES)


def test_the_command_rejects_a_zone_without_prices(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), "--zones", "BR-SP"])
    assert e.value.code == 2 and "['BR-SP'] have no price series" in capsys.readouterr().err
