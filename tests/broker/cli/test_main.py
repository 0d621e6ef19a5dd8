"""End-to-end tests of the ``fedbroker`` CLI (broker.cli.main.app) with typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from broker.cli import console as cli_console

from broker.cli import main as cli
from broker.planner.core import GpuTable
from broker.usage import read_usage_csv

DOCUMENTED_KEYS = ("jobs_submitted", "jobs_completed", "deadline_misses", "mean_jct_s", "p95_jct_s", "mean_wait_s",
                   "cost_usd", "cloud_cost_usd", "onprem_energy_cost_usd", "energy_kwh", "carbon_kg",
                   "onprem_gpu_utilization", "preemptions", "decision_latency_p99_ms")


@pytest.fixture
def run(monkeypatch):
    # a wide console so tables and messages are not truncated or wrapped at 80 columns
    monkeypatch.setattr(cli_console, "console", Console(width=300, force_terminal=False, color_system=None))
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli.app, list(args))

    return invoke


def test_simulate_philly_two_policies(run, tmp_path):
    out = tmp_path / "sim"
    r = run("simulate", "--trace", "philly", "--jobs", "300", "--policy", "fifo,federated", "--out", str(out))
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert sorted(doc["policies"]) == ["federated", "fifo"]
    for name, m in doc["policies"].items():
        missing = [k for k in DOCUMENTED_KEYS if k not in m]
        assert not missing, f"{name}: missing {missing}"
        assert m["jobs_submitted"] == 300
        assert m["jobs_completed"] + m["jobs_skipped"] == 300
    assert doc["policies"]["fifo"]["cloud_cost_usd"] == 0.0  # fifo is on-prem only
    assert doc["meta"]["jobs"] == 300 and doc["meta"]["trace"] == "philly"
    html = (out / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "federated" in html and "fifo" in html
    assert "trace philly: 300 jobs" in r.output

    assert "bound" not in doc and "cost_ratio_to_bound" not in doc["policies"]["fifo"]  # only with --bound
    # the usage records (the live ledger's columns) add up to the run's cost to the cent; one chargeback line each
    for name, m in doc["policies"].items():
        recs = read_usage_csv(out / f"usage-{name}.csv.gz")
        assert recs and all(x.source == "sim" for x in recs)
        billed = sum(x.billed_usd for x in recs if x.line != "amortised" and x.billed_usd is not None)
        assert abs(billed - m["cost_usd"]) < 0.005
        assert abs(sum(x.billed_usd for x in recs if x.line == "amortised") - m["onprem_amortised_usd"]) < 0.005
        cb = doc["chargeback"][name]
        assert sum(t["total_usd"] for t in cb.values()) == pytest.approx(m["cost_usd"] + m["onprem_amortised_usd"])
        line = next(ln for ln in r.output.splitlines() if ln.startswith(f"chargeback ({name}): "))
        assert f"{len(cb)} teams" in line and f"top team {next(iter(cb))} " in line
        assert f"id='chargeback-{name}'" in html
    assert "<details open id='chargeback-federated'>" in html  # the main policy's table unfolded


def test_simulate_bound_writes_the_lp_bound_and_each_policy_ratio(run, tmp_path):
    out = tmp_path / "sim"
    r = run("simulate", "--trace", "philly", "--jobs", "200", "--policy", "fifo,federated", "--bound", "--out", str(out))
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    b = doc["bound"]
    assert sorted(b) == ["carbon_kg", "carbon_price_usd_per_t", "cost_usd", "score_usd"]
    assert b["carbon_price_usd_per_t"] == 190.0
    # score = cost + 190 USD/t x carbon at its own optimum, so at least the cheaper of the two parts' bounds
    assert b["score_usd"] >= b["cost_usd"] + 0.19 * b["carbon_kg"] - 1e-6
    for name, m in doc["policies"].items():
        if m["jobs_completed"] == 200 and m["deadline_misses"] == 0:  # the bound is for such schedules
            assert m["cost_ratio_to_bound"] >= 1.0 - 1e-9, name
            assert m["score_ratio_to_bound"] >= 1.0 - 1e-9, name
        assert m["cost_ratio_to_bound"] == pytest.approx(m["cost_usd"] / b["cost_usd"])
    assert "LP lower bound: cost $" in r.output
    assert "Lower bound (LP relaxation)" in (out / "report.html").read_text()


def test_simulate_sweep_carbon_price_writes_the_frontier_in_worker_processes_as_in_one(run, tmp_path):
    docs = {}
    for workers in ("2", "1"):
        out = tmp_path / f"w{workers}"
        r = run("simulate", "--trace", "philly", "--jobs", "120", "--policy", "fifo,federated", "--bound",
                "--sweep-carbon-price", "1000,0,190,0", "--workers", workers, "--out", str(out))
        assert r.exit_code == 0, r.output
        docs[workers] = json.loads((out / "results.json").read_text())
        assert "fifo ignores the carbon price: one run serves every price" in r.output
        assert "Carbon-price frontier" in r.output and "federated @ $1,000/t: done" in r.output
        html = (out / "report.html").read_text()
        assert "<h2>Carbon-price frontier</h2>" in html and "Cost vs carbon as the carbon price sweeps" in html
        # each full run's records, written by the process that ran it, add up to its cost; the table is there too
        for name in ("fifo", "federated"):
            recs = read_usage_csv(out / f"usage-{name}.csv.gz")
            billed = sum(x.billed_usd for x in recs if x.line != "amortised" and x.billed_usd is not None)
            assert abs(billed - docs[workers]["policies"][name]["cost_usd"]) < 0.005
            assert f"id='chargeback-{name}'" in html
    doc = docs["2"]
    f = doc["frontier"]
    assert [e["carbon_price_usd_per_t"] for e in f] == [0.0, 190.0, 1000.0]  # sorted, duplicates dropped
    for e in f:
        b, p = e["bound"], e["carbon_price_usd_per_t"]
        assert b["score_usd"] == pytest.approx(b["cost_usd"] + p * b["carbon_kg"] / 1000, rel=1e-7)
        for name, m in e["policies"].items():
            assert m["score_usd"] == pytest.approx(m["cost_usd"] + p * m["carbon_kg"] / 1000)
            assert m["score_ratio_to_bound"] == pytest.approx(m["score_usd"] / b["score_usd"])
            if m["deadline_misses"] == 0:
                assert m["score_ratio_to_bound"] >= 1.0 - 1e-9, (name, p)
    assert [e["bound"]["carbon_kg"] for e in f] == sorted((e["bound"]["carbon_kg"] for e in f), reverse=True)
    assert f[0]["bound"]["cost_usd"] == pytest.approx(doc["bound"]["cost_usd"])  # at $0/t: the cost bound
    at190 = f[1]
    assert at190["bound"]["score_usd"] == pytest.approx(doc["bound"]["score_usd"])
    assert at190["policies"]["federated"]["cost_usd"] == doc["policies"]["federated"]["cost_usd"]
    assert at190["policies"]["federated"]["score_ratio_to_bound"] == \
        pytest.approx(doc["policies"]["federated"]["score_ratio_to_bound"])
    # fifo: one run re-priced; federated: a run per price
    assert len({e["policies"]["fifo"]["carbon_kg"] for e in f}) == 1
    assert [e["policies"]["fifo"]["uses_carbon_price"] for e in f] == [False] * 3
    assert [e["policies"]["federated"]["uses_carbon_price"] for e in f] == [True] * 3
    # the runs and LPs are deterministic: the same figures in worker processes as in this one
    assert docs["2"]["frontier"] == docs["1"]["frontier"] and docs["2"]["policies"] == {
        n: {**m, "sim_wall_s": docs["2"]["policies"][n]["sim_wall_s"],
            "decision_latency_p99_ms": docs["2"]["policies"][n]["decision_latency_p99_ms"]}
        for n, m in docs["1"]["policies"].items()}


def test_simulate_bound_without_cloud_uses_no_offer(run, tmp_path):
    out = tmp_path / "sim"
    r = run("simulate", "--trace", "philly", "--jobs", "20", "--policy", "fifo", "--no-cloud", "--bound",
            "--min-slack-h", "2000", "--out", str(out))
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    # the bound is solved over the offers the runs could use (none here); fifo meets every deadline with
    # 2000 h of slack, so it is a schedule the bound is below
    assert doc["policies"]["fifo"]["deadline_misses"] == 0
    assert doc["policies"]["fifo"]["cost_ratio_to_bound"] >= 1.0 - 1e-9


def test_simulate_forecast_plans_on_forecasts_in_worker_processes_and_says_so(run, tmp_path):
    # the pool in DE-LU (its price dips are what perfect knowledge defers jobs into), on-prem only; two workers:
    # the option travels to the worker processes in the RunSpec
    cluster = tmp_path / "de.yaml"
    cluster.write_text("pools:\n  - name: fra\n    carbon_zone: DE-LU\n    price_zone: DE-LU\n    timezone: Europe/Berlin\n"
                       "    pue: 1.3\n    amortised_usd_per_gpu_hour: 0.55\n    node_groups:\n"
                       "      - {count: 48, gpu_type: V100, gpus_per_node: 8, gpu_memory_gb: 16, name_prefix: v100-}\n")
    docs = {}
    for fc in ("perfect", "blend"):
        out = tmp_path / fc
        r = run("simulate", "--jobs", "300", "--policy", "federated,fifo", "--no-cloud", "--cluster", str(cluster),
                "--start", "2024-09-02", "--step", "60", "--workers", "2", "--forecast", fc, "--out", str(out))
        assert r.exit_code == 0, r.output
        docs[fc] = json.loads((out / "results.json").read_text())
        assert docs[fc]["meta"]["forecast"] == fc
    # fifo never looks at the signals: the same run; federated plans on them: it defers other jobs
    same = lambda m: {k: v for k, v in m.items() if "wall" not in k and "latency" not in k}  # noqa: E731
    assert same(docs["blend"]["policies"]["fifo"]) == same(docs["perfect"]["policies"]["fifo"])
    fed = [docs[fc]["policies"]["federated"] for fc in ("perfect", "blend")]
    assert fed[0]["deferred_jobs"] > 0 and fed[0]["deferred_jobs"] != fed[1]["deferred_jobs"]
    assert fed[0]["cost_usd"] != fed[1]["cost_usd"]


CSV = """submit_time,duration_s,num_gpus,gpu_type,team,job_id
2023-09-04T10:00:00Z,3600,4,V100,vision,g1
2023-09-04T10:05:00Z,-5,2,,nlp,g2
2023-09-04T10:10:00Z,1800,1,,nlp,g3
2023-09-04T11:00:00Z,7200,8,,vision,g4
"""


def test_simulate_generic_csv_skips_and_counts_a_bad_row(run, tmp_path):
    f = tmp_path / "jobs.csv"
    f.write_text(CSV)
    out = tmp_path / "o"
    r = run("simulate", "--trace", str(f), "--policy", "fifo,backfill", "--out", str(out))
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["trace_skipped"] == {"bad_duration": 1}
    assert "3 jobs" in r.output and "1 rows skipped {'bad_duration': 1}" in r.output
    for m in doc["policies"].values():
        # the default pool (48 x 8 V100) is idle: all three start at once, no wait
        assert (m["jobs_submitted"], m["jobs_completed"], m["mean_wait_s"]) == (3, 3, 0.0)
        # JCTs 3600, 1800, 7200 s (oracle durations on V100)
        assert m["mean_jct_s"] == pytest.approx(4200.0)
        # energy: GPU-hours 4 x 1 + 1 x 0.5 + 8 x 2 = 20.5 x V100 board power x the Toronto pool's PUE 1.3
        assert m["energy_kwh"] == pytest.approx(20.5 * GpuTable.from_pricing().busy_kw["V100"] * 1.3, rel=1e-9)
        assert m["cloud_cost_usd"] == 0.0 and m["cost_usd"] == pytest.approx(m["onprem_energy_cost_usd"])
    assert (out / "report.html").exists()


@pytest.mark.parametrize("args, needle", [
    (("--policy", "nope"), "--policy='nope'"),
    (("--policy", "fifo,,federated,bogus"), "bogus"),
    (("--jobs", "0"), "--jobs=0"),
    (("--start", "yesterday"), "--start='yesterday'"),
    (("--step", "0"), "--step=0.0"),
    (("--step", "nan"), "--step=nan"),
    (("--step", "-30"), "--step=-30.0"),
    (("--market", "foo"), "--market='foo'"),
])
def test_simulate_bad_options_exit_2(run, tmp_path, args, needle):
    r = run("simulate", "--out", str(tmp_path / "o"), *args)
    assert r.exit_code == 2
    assert needle in r.output
    assert not (tmp_path / "o").exists()


def test_simulate_missing_csv_exits_2(run, tmp_path):
    missing = tmp_path / "nope.csv"
    r = run("simulate", "--trace", str(missing), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2
    assert str(missing) in r.output


def test_simulate_csv_without_required_column_exits_2(run, tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("submit_time,num_gpus\n2023-09-04T10:00:00Z,4\n")
    r = run("simulate", "--trace", str(f), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2
    assert "missing required column(s) duration_s" in r.output


def test_offers_a100_x8(run):
    r = run("offers", "--gpu", "A100", "--count", "8")
    assert r.exit_code == 0, r.output
    assert "p4d.24xlarge" in r.output or "a2-highgpu-8g" in r.output
    rows = [ln for ln in r.output.splitlines() if " A100 " in ln]
    assert rows and all("V100" not in ln for ln in rows)


def test_offers_unknown_gpu_exits_2(run):
    r = run("offers", "--gpu", "Z99")
    assert r.exit_code == 2
    assert "--gpu='Z99'" in r.output


@pytest.mark.parametrize("args, needle", [
    (("--carbon-price", "nan"), "--carbon-price=nan"),
    (("--value-of-time", "inf"), "--value-of-time=inf"),
    (("--policy", "fifo,,nope"), "unknown ['nope']"),
    (("--sweep-carbon-price", "0,abc"), "--sweep-carbon-price='0,abc': 'abc' is not a number"),
    (("--sweep-carbon-price", "190,-5"), "'-5' must be a finite number >= 0"),
    (("--sweep-carbon-price", "inf"), "'inf' must be a finite number >= 0"),
    (("--workers", "0"), "--workers=0: must be >= 1"),
    (("--forecast", "arima"), "--forecast='arima': choose from perfect, naive_day, naive_week, blend"),
])
def test_simulate_non_finite_or_unknown_options_exit_2(run, tmp_path, args, needle):
    r = run("simulate", "--jobs", "10", "--out", str(tmp_path / "o"), *args)
    assert r.exit_code == 2 and needle in r.output


def test_simulate_unwritable_out_fails_before_running(run, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run("simulate", "--jobs", "10", "--out", str(blocker / "sub"))
    assert r.exit_code == 2 and "cannot write there" in r.output
    assert "Policy comparison" not in r.output  # nothing was simulated


def test_simulate_cluster_with_unknown_gpu_type_exits_2(run, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pools:\n  - name: mars\n    carbon_zone: CA-ON\n    price_zone: CA-ON\n"
                 "    node_groups:\n      - {count: 1, gpu_type: Z99, gpus_per_node: 8}\n")
    r = run("simulate", "--jobs", "10", "--cluster", str(f), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "pool 'mars'" in r.output and "'Z99'" in r.output


def test_simulate_csv_rejects_absurd_duration_and_time(run, tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("submit_time,duration_s,num_gpus\n"
                   "2023-09-04T10:00:00Z,3600,1\n"
                   "2023-09-04T11:00:00Z,1e12,1\n"   # 31,700 years: bad_duration
                   "1e15,3600,1\n")                    # relative time beyond two years: bad_submit_time
    out = tmp_path / "o"
    r = run("simulate", "--trace", str(csv), "--policy", "fifo", "--out", str(out))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["trace_skipped"] == {"bad_duration": 1, "bad_submit_time": 1}
    assert res["policies"]["fifo"]["jobs_submitted"] == 1


def test_offers_outside_data_or_bad_numbers_exit_2(run):
    for args, needle in ((("--start", "2019-01-01"), "outside the bundled"), (("--hours", "nan"), "--hours=nan"),
                         (("--carbon-price", "-1"), "--carbon-price=-1"),
                         # UTC cannot hold it: was a traceback ("year 0 is out of range")
                         (("--start", "0001-01-01T00:00+01:00"), "--start='0001-01-01T00:00+01:00': outside the years")):
        r = run("offers", *args)
        assert r.exit_code == 2 and needle in r.output, (args, r.output)


def test_offers_json_hours_are_on_the_requested_gpu_and_prices_per_instance(run):
    import json

    r = run("offers", "--gpu", "A100", "--count", "8", "--nodes", "2", "--hours", "2", "--no-spot", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    cloud = [x for x in rows if x["provider"] != "onprem"]
    assert cloud and {x["gpu_type"] for x in rows} == {"A100"} and {x["market"] for x in cloud} == {"on_demand"}
    for x in cloud:
        # 2 h on an A100 whatever its V100 throughput; billed from the create call: 2 instances x price x (2 h + 300 s)
        assert x["hours"] == 2.0 and x["instances"] == 2
        assert x["total_usd"] == pytest.approx(2 * x["usd_per_hour"] * (7200 + 300) / 3600, rel=1e-12)
        assert set(x) >= {"provider", "region", "zone", "instance_type", "market", "instances", "usd_per_hour", "hours",
                          "total_usd", "kwh", "kg_co2e", "carbon_estimated"}
    totals = [x["total_usd"] for x in rows if x["kg_co2e"] is not None]
    assert totals == sorted(totals)  # ranked by cost


def test_offers_past_the_carbon_data_stay_ranked_by_cost_and_json_stays_pure(run):
    import json

    # runs from the last bundled hour end after the data: their kgCO2e is n/a, but cost still ranks them
    r = run("offers", "--gpu", "V100", "--start", "2024-12-31T23:00", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)  # the note goes to stderr
    assert any(x["kg_co2e"] is None for x in rows) and any(x["kg_co2e"] is not None for x in rows)
    totals = [x["total_usd"] for x in rows]
    assert totals == sorted(totals)
    assert "run past the bundled carbon data" in r.stderr


def test_offers_json_and_table_flag_carbon_estimates(run):
    import json

    from pricing.carbon import carbon_estimated
    from pricing.regions import grid_zone_for

    rows = json.loads(run("offers", "--gpu", "T4", "--json").output)
    cloud = [x for x in rows if x["provider"] != "onprem"]
    # T4 is sold in estimated regions (e.g. asia-east1, Taiwan: annual figure) and measured ones (europe-west2, GB)
    assert {x["carbon_estimated"] for x in cloud} == {True, False}
    for x in cloud:
        assert x["carbon_estimated"] is carbon_estimated(grid_zone_for(x["provider"], x["region"]))
    assert {x["region"] for x in cloud if x["carbon_estimated"]} >= {"asia-east1", "us-central1", "europe-west4"}
    # the table marks estimated kgCO2e with '*' and says what it means
    out = run("offers", "--gpu", "T4", "--region", "asia-east1").output
    assert "*" in out and "carbon estimated" in out
    out = run("offers", "--gpu", "T4", "--region", "europe-west2").output
    assert "carbon estimated" not in out


def test_offers_hours_without_gpu_are_v100_hours(run):
    import json

    rows = json.loads(run("offers", "--hours", "1", "--no-spot", "--json").output)
    # a V100 runs 1 V100-hour in 1 h; an A100 (faster) in less
    assert {x["hours"] for x in rows if x["gpu_type"] == "V100" and x["provider"] != "onprem"} == {1.0}
    assert all(x["hours"] < 1.0 for x in rows if x["gpu_type"] == "A100" and x["provider"] != "onprem")


# --------------------------------------------------------------------------- --step, --no-cloud, --market, jobs CSV
ONE_JOB = "submit_time,duration_s,num_gpus,gpu_type,team,job_id\n2023-09-04T10:00:30Z,3600,4,V100,vision,g1\n"


def _job_rows(path):
    import csv

    return list(csv.DictReader(path.open()))


@pytest.mark.parametrize("step, start, wait", [(None, "2023-09-04T10:00:30+00:00", 0.0),
                                               ("60", "2023-09-04T10:01:00+00:00", 30.0),
                                               ("7", "2023-09-04T10:00:33+00:00", 3.0)])
def test_simulate_one_job_csv_row_matches_the_run(run, tmp_path, step, start, wait):
    f = tmp_path / "one.csv"
    f.write_text(ONE_JOB)
    out = tmp_path / "o"
    r = run("simulate", "--trace", str(f), "--policy", "fifo", "--out", str(out), *(("--step", step) if step else ()))
    assert r.exit_code == 0, r.output
    m = json.loads((out / "results.json").read_text())["policies"]["fifo"]
    (row,) = _job_rows(out / "jobs-fifo.csv")
    # the idle Toronto pool starts it at the first planning step at or after 10:00:30: the default 2 s step (the
    # live beat's) plans it at once (10:00:30 is POSIX 1693821630, even), 60 s at 10:01:00, 7 s at 10:00:33
    # (1693821630 is 4 mod 7: the next multiple of 7 is 3 s later)
    assert (row["job_id"], row["team"], row["status"], row["placement"], row["market"]) == \
        ("g1", "vision", "completed", "toronto", "")
    assert (row["submit"], row["start"]) == ("2023-09-04T10:00:30+00:00", start)
    assert float(row["wait_s"]) == wait == m["mean_wait_s"]
    # 4 V100-hours x board power x PUE 1.3; USD, kWh and kgCO2e are the run's totals for a one-job run
    assert float(row["energy_kwh"]) == pytest.approx(4 * GpuTable.from_pricing().busy_kw["V100"] * 1.3, rel=1e-12)
    assert float(row["dollars_usd"]) == m["cost_usd"] == m["onprem_energy_cost_usd"]
    assert float(row["amortised_usd"]) == m["onprem_amortised_usd"] == pytest.approx(4 * 0.55, rel=1e-12)
    assert (float(row["energy_kwh"]), float(row["carbon_kg"])) == (m["energy_kwh"], m["carbon_kg"])
    assert row["deadline_met"] == "true"


TINY_CLUSTER = ("pools:\n  - name: tiny\n    carbon_zone: CA-ON\n    price_zone: CA-ON\n    pue: 1.3\n"
                "    amortised_usd_per_gpu_hour: 0.55\n"
                "    node_groups:\n      - {count: 1, gpu_type: V100, gpus_per_node: 4}\n")
TWO_JOBS = ("submit_time,duration_s,num_gpus,gpu_type,team,job_id\n"
            "2023-09-04T10:00:00Z,36000,4,V100,vision,g1\n2023-09-04T10:00:30Z,3600,4,V100,nlp,g2\n")


@pytest.mark.parametrize("flags, markets", [((), {"", "spot"}), (("--no-cloud",), {""}),
                                            (("--market", "spot"), {"", "spot"}),
                                            (("--market", "on_demand"), {"", "on_demand"})])
def test_simulate_no_cloud_and_market_choose_the_offers(run, tmp_path, flags, markets):
    # one 4-GPU node busy 10 h with g1: cheapest bursts g2 to the cloud (to spot, the cheapest, when any market
    # is allowed) unless --no-cloud; --market on_demand makes it pick an on-demand offer
    (tmp_path / "c.yaml").write_text(TINY_CLUSTER)
    (tmp_path / "t.csv").write_text(TWO_JOBS)
    out = tmp_path / "o"
    r = run("simulate", "--trace", str(tmp_path / "t.csv"), "--cluster", str(tmp_path / "c.yaml"),
            "--policy", "cheapest", "--out", str(out), *flags)
    assert r.exit_code == 0, r.output
    rows = {row["job_id"]: row for row in _job_rows(out / "jobs-cheapest.csv")}
    assert {row["market"] for row in rows.values()} == markets
    assert rows["g1"]["placement"] == "tiny"
    m = json.loads((out / "results.json").read_text())["policies"]["cheapest"]
    assert m["cloud_jobs"] == (0 if "--no-cloud" in flags else 1)
    if "--no-cloud" in flags:  # g2 waits for g1's node: 10:00:00 + 10 h
        assert (rows["g2"]["placement"], rows["g2"]["start"]) == ("tiny", "2023-09-04T20:00:00+00:00")
    assert sum(float(row["dollars_usd"]) for row in rows.values()) == pytest.approx(m["cost_usd"], rel=1e-12)


def test_simulate_results_meta_records_what_reproduces_the_run(run, tmp_path):
    f = tmp_path / "one.csv"
    f.write_text(ONE_JOB)
    out = tmp_path / "o"
    r = run("simulate", "--trace", str(f), "--policy", "fifo,federated", "--out", str(out), "--step", "30",
            "--market", "spot", "--no-cloud", "--seed", "5", "--carbon-price", "250", "--value-of-time", "0.01",
            "--slack-factor", "2", "--min-slack-h", "6", "--jobs", "1")
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert {k: meta[k] for k in ("trace", "jobs", "jobs_limit", "step_s", "market", "no_cloud", "seed",
                                 "carbon_price_usd_per_t", "value_of_time_usd_per_gpu_hour", "slack_factor",
                                 "min_slack_h", "policies", "sweep_carbon_price_usd_per_t", "bound")} == {
        "trace": str(f), "jobs": 1, "jobs_limit": 1, "step_s": 30.0, "market": "spot", "no_cloud": True, "seed": 5,
        "carbon_price_usd_per_t": 250.0, "value_of_time_usd_per_gpu_hour": 0.01, "slack_factor": 2.0,
        "min_slack_h": 6.0, "policies": ["fifo", "federated"], "sweep_carbon_price_usd_per_t": None, "bound": False}
    assert meta["planner"]["cloud_enabled"] is False and meta["planner"]["carbon_price_usd_per_tonne"] == 250.0
    assert meta["start"] == "2023-09-04T10:00+00:00" and meta["cluster"] == "bundled default"


def test_simulate_results_meta_default_step_is_the_live_beat_interval(run, tmp_path):
    from broker.model import PLAN_INTERVAL_S

    f = tmp_path / "one.csv"
    f.write_text(ONE_JOB)
    out = tmp_path / "o"
    assert run("simulate", "--trace", str(f), "--policy", "fifo", "--out", str(out)).exit_code == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert (meta["step_s"], meta["market"], meta["no_cloud"], meta["seed"]) == (PLAN_INTERVAL_S, "any", False, 0)


# --------------------------------------------------------------------------- --signals (bring your own history)
def test_simulate_with_user_signals_replays_them_with_gaps_interpolated(run, tmp_path):
    # 2030: outside the bundle, so every figure comes from the user's files. Carbon 10:00 is empty: interpolated
    # between 100 (09:00) and 300 (11:00) to 200; the job runs 10:01:00-11:01:00 (60-s step) on the Toronto pool.
    sig = tmp_path / "signals"
    sig.mkdir()
    (sig / "carbon.csv").write_text("zone,hour_utc,value,unit,quality\n"
                                    "CA-ON,2030-09-02T09:00Z,100,gCO2e/kWh,measured\n"
                                    "CA-ON,2030-09-02T10:00Z,,gCO2e/kWh,measured\n"
                                    "CA-ON,2030-09-02T11:00Z,300,gCO2e/kWh,measured\n"
                                    "CA-ON,2030-09-02T12:00Z,300,gCO2e/kWh,estimated\n")
    (sig / "price.csv").write_text("zone,hour_utc,value,unit,quality\n"
                                   + "".join(f"CA-ON,2030-09-02T{h:02d}:00Z,50,CAD/MWh,measured\n" for h in range(9, 13)))
    f = tmp_path / "one.csv"
    f.write_text(ONE_JOB.replace("2023-09-04", "2030-09-02"))
    out = tmp_path / "o"
    r = run("simulate", "--trace", str(f), "--policy", "fifo", "--no-cloud", "--signals", str(sig), "--out", str(out),
            "--step", "60")
    assert r.exit_code == 0, r.output
    assert "carbon CA-ON: 2030-09-02T09:00+00:00..2030-09-02T13:00+00:00, 4 h, 2 estimated (interpolated 1" in r.output
    doc = json.loads((out / "results.json").read_text())
    m = doc["policies"]["fifo"]
    assert doc["meta"]["signals"] == str(sig)
    kwh = 4 * GpuTable.from_pricing().busy_kw["V100"] * 1.3
    assert m["energy_kwh"] == pytest.approx(kwh, rel=1e-12)
    assert m["carbon_kg"] == pytest.approx(kwh * (59 * 200 + 1 * 300) / 60 / 1000, rel=1e-9)
    assert m["onprem_energy_cost_usd"] == pytest.approx(kwh * 50 / 1000 / 1.3495, rel=1e-9)
    assert m.get("missing_signal_hours", 0.0) == 0.0
    # without --signals the same 2030 trace is outside the bundled data
    r2 = run("simulate", "--trace", str(f), "--policy", "fifo", "--no-cloud", "--out", str(tmp_path / "o2"))
    assert r2.exit_code == 2 and "the carbon data of zone CA-ON covers" in r2.output


def test_simulate_bad_signals_folder_exits_2(run, tmp_path):
    sig = tmp_path / "s"
    sig.mkdir()
    (sig / "c.csv").write_text("zone,hour_utc,value,unit,quality\nCA-ON,2030-09-02T09:30Z,1,gCO2e/kWh,measured\n")
    r = run("simulate", "--jobs", "5", "--signals", str(sig), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "c.csv:2: hour_utc='2030-09-02T09:30Z': not on the hour" in r.output


def test_every_command_the_readme_names_exists():
    # a new user's report: README "Live signals" sent them to `fedbroker jobs explain` (the command is `fedbroker
    # explain`); each `fedbroker a b` in backquotes must resolve, word by word, to a command of the CLI
    import re
    from pathlib import Path

    import typer

    from broker.cli.main import app

    root = typer.main.get_command(app)
    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    named = {m.group(0) for m in re.finditer(r"`fedbroker((?: [a-z][a-z0-9-]*)+)", text)}
    assert "`fedbroker explain" in named  # the pattern does find the README's commands
    unknown = []
    for ref in sorted(named):
        cmd = root
        for word in ref.split()[1:]:
            if not hasattr(cmd, "get_command"):  # a command, not a group (typer 0.29 vendors its own click)
                break  # the rest are arguments
            cmd = cmd.get_command(None, word)
            if cmd is None:
                unknown.append(ref)
                break
    assert unknown == []


def test_offers_prices_now_from_the_live_brokers_series_and_names_it(run):
    """Issue #20 (finding 6): ``--start 2026-12-04T03:00`` was refused ("outside the bundled price/carbon data") and
    the default window was silently 2023-09-04. Now the default is now, and a start after the bundled history is
    priced as the live broker prices it: the history shifted forward by the same whole weeks
    (broker.service.live.live_replay_offset_s), named in the output. The figures are exactly those of the recorded
    hours 102 weeks earlier."""
    import json
    from datetime import datetime, timedelta, timezone

    from broker.service.live import WEEK_S, LiveEnvironment
    from broker.service.settings import BrokerSettings

    start = datetime(2026, 12, 4, 3, tzinfo=timezone.utc)
    assert LiveEnvironment(BrokerSettings().planner).offset_for(start.timestamp()) == 102 * WEEK_S
    r = run("offers", "--gpu", "V100", "--start", "2026-12-04T03:00", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert {x["signals"] for x in rows} == {"bundled 2023-24 history replayed +102 weeks (as the live broker prices "
                                            "it without live sources)"}
    recorded = run("offers", "--gpu", "V100", "--start", (start - timedelta(weeks=102)).isoformat(), "--json")
    assert recorded.exit_code == 0, recorded.output
    old = json.loads(recorded.stdout)
    assert {x["signals"] for x in old} == {"bundled 2023-24 history, as recorded"}
    assert [{**x, "signals": None} for x in rows] == [{**x, "signals": None} for x in old]
    table = run("offers", "--gpu", "V100", "--top", "3")  # the default: now
    assert table.exit_code == 0, table.output
    assert " from 20" in table.stdout and "2023-09-04" not in table.stdout
    assert "prices and carbon from 20" in table.stdout and ": bundled 2023-24 history replayed +" in table.stdout
