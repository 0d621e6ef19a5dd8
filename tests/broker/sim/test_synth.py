"""Tests for broker.sim.synth: seeded synthetic traces that load with the generic CSV loader."""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime, timezone

import pytest

from broker.sim.synth import (DEFAULT_START, GANG_MIX, KINDS, SHORT_MIX, generate, main, mean_rate_per_h,
                              offered_load, write_csv)
from broker.sim.traces import default_deadline_s, load_generic_csv

START_S = DEFAULT_START.timestamp()  # 2023-09-04T00:00:00Z = 1693785600


def test_start_is_the_philly_monday():
    assert START_S == 1693785600.0


def test_mean_rate_hand_worked():
    # gangs: E[gpus] = 128 x 0.6 + 64 x 0.25 + 16 x 0.15 = 95.2; E[duration] = 4 h x exp(0.8^2 / 2) = 5.5085 h
    # -> 384 GPUs / (95.2 x 5.5085 GPU-h per job) = 0.73225 jobs per hour at load 1
    assert mean_rate_per_h(KINDS["gangs"], 1.0, 384) == pytest.approx(384 / (95.2 * 4 * math.exp(0.32)), rel=1e-12)
    assert mean_rate_per_h(KINDS["gangs"], 1.0, 384) == pytest.approx(0.73225, abs=1e-5)
    # short: E[gpus] = 0.55 + 0.4 + 0.6 + 0.8 = 2.35; E[duration] = 8 min x exp(0.5) = 0.21985 h
    assert mean_rate_per_h(KINDS["short"], 0.8, 384) == pytest.approx(0.8 * 384 / (2.35 * 8 / 60 * math.exp(0.5)))


@pytest.mark.parametrize("kind", ["gangs", "short"])
def test_same_seed_same_bytes_other_seed_other_rows(tmp_path, kind):
    a, b, c = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.csv"
    write_csv(generate(kind, seed=7, days=1), a)
    write_csv(generate(kind, seed=7, days=1), b)
    write_csv(generate(kind, seed=8, days=1), c)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.read_text().splitlines()[0] == "job_id,submit_time,duration_s,num_gpus,team"


def test_gang_trace_loads_with_its_shapes_and_default_deadlines(tmp_path):
    rows = generate("gangs", seed=0)  # 14 days at load 1.0 of 384 GPUs: ~246 jobs expected
    path = tmp_path / "gangs.csv"
    write_csv(rows, path)
    tr = load_generic_csv(path)
    assert tr.skipped == {}
    assert len(tr) == len(rows)
    assert 200 <= len(tr) <= 300
    by_id = {r["job_id"]: r for r in rows}
    for j in tr.jobs:
        r = by_id[j.job_id]
        assert j.num_gpus == int(r["num_gpus"]) and j.duration_s == float(r["duration_s"])
        assert (j.nodes, j.gpus_per_node) == (j.num_gpus // 8, 8)  # 16x8, 8x8 or 2x8 gangs
        assert KINDS["gangs"].min_s <= j.duration_s <= KINDS["gangs"].max_s
        assert START_S <= j.submit_s < START_S + 14 * 86400
        assert j.deadline_s == default_deadline_s(j.submit_s, j.duration_s)  # duration + max(duration, 12 h)
        assert j.gpu_type is None and not j.preemptible
    sizes = Counter(j.num_gpus for j in tr.jobs)
    assert set(sizes) <= {g for g, _ in GANG_MIX}
    assert sizes[128] > sizes[64] > sizes[16] > 0  # 0.6 / 0.25 / 0.15
    assert offered_load(rows, 14, 384) == pytest.approx(1.0, abs=0.15)


def test_short_trace_loads_and_meets_its_load(tmp_path):
    rows = generate("short", seed=1, days=1)
    path = tmp_path / "short.csv"
    write_csv(rows, path)
    tr = load_generic_csv(path)
    assert tr.skipped == {} and len(tr) == len(rows) > 10_000
    assert all(j.nodes == 1 and j.num_gpus in {g for g, _ in SHORT_MIX} for j in tr.jobs)
    assert all(60 <= j.duration_s <= 7200 for j in tr.jobs)
    # ~14k jobs: the offered load is within a few % of the asked 0.8 (clipping moves the mean by < 1 %)
    assert offered_load(rows, 1, 384) == pytest.approx(0.8, abs=0.04)


def test_diurnal_peak_at_15_utc():
    rows = generate("short", seed=2, days=2, diurnal=1.0)
    hours = Counter(int(r["submit_time"][11:13]) for r in rows)
    # rate at hour h: 1 + cos(2 pi (h - 15) / 24); 03:00 is the trough (0), 15:00 the peak (2)
    assert hours[15] > 10 * max(hours[3], 1)
    flat = Counter(int(r["submit_time"][11:13]) for r in generate("short", seed=2, days=2, diurnal=0.0))
    assert 0.7 < flat[3] / flat[15] < 1.4


def test_a_later_start():
    rows = generate("gangs", seed=0, days=2, start=datetime(2024, 1, 1, tzinfo=timezone.utc))
    assert rows and all(r["submit_time"].startswith(("2024-01-01", "2024-01-02")) for r in rows)


@pytest.mark.parametrize("kw, field", [
    ({"kind_name": "huge"}, "kind='huge'"),
    ({"days": 0}, "days=0"),
    ({"load": -1}, "load=-1"),
    ({"pool_gpus": 0}, "pool_gpus=0"),
    ({"diurnal": 1.5}, "diurnal=1.5"),
    ({"start": datetime(2023, 9, 4)}, "start="),
])
def test_bad_arguments_name_the_field(kw, field):
    kw = {"kind_name": "gangs", **kw}
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        generate(**kw)


def test_main_writes_the_file(tmp_path, capsys):
    out = tmp_path / "g.csv"
    assert main(["gangs", str(out), "--seed", "3", "--days", "2"]) == 0
    ref = tmp_path / "ref.csv"
    write_csv(generate("gangs", seed=3, days=2), ref)
    assert out.read_bytes() == ref.read_bytes()
    assert "jobs, offered load" in capsys.readouterr().out
    assert main(["gangs", str(out), "--load", "0"]) == 2
    assert "--load=0.0" in capsys.readouterr().err


@pytest.mark.parametrize("args,err", [
    (["--load", "1e9"], "--load=1e+09, --pool-gpus=384, --days=14: about "),
    (["--pool-gpus", "100000000"], "more than 2,000,000: lower one of them"),
    (["--seed", "-1"], "--seed=-1: must be >= 0"),
    (["--start", "garbage"], "--start='garbage': not an ISO 8601 date"),
    (["--days", "0.0001"], "no job arrived in the span"),
])
def test_main_bad_options_exit_2_naming_the_option_before_any_work(tmp_path, capsys, args, err):
    out = tmp_path / "g.csv"
    assert main(["gangs", str(out), *args]) == 2
    assert err in capsys.readouterr().err
    assert not out.exists()


def test_main_bad_output_path_exits_2_naming_it(tmp_path, capsys):
    assert main(["short", str(tmp_path / "no" / "x.csv")]) == 2
    assert "its folder does not exist" in capsys.readouterr().err
    assert main(["short", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
