"""Tests for broker.sim.traces: generic CSV, Philly loader, week shift, gang shapes, bad rows."""

from __future__ import annotations

import gzip
import sys
import types
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from broker.model import PriorityClass
from broker.sim.traces import (
    PHILLY_PATH,
    WEEK_S,
    Trace,
    TraceError,
    TraceJob,
    default_deadline_s,
    gang_shape,
    load_generic_csv,
    load_philly,
)

LA = ZoneInfo("America/Los_Angeles")
H12 = 12 * 3600

GENERIC = """job_id,submit_time,duration_s,num_gpus,gpu_type,team,priority,deadline_s,preemptible
a,2023-09-04T10:00:00Z,3600,12,,vision,HIGH,,true
b,2023-09-04T09:00:00,600,1,,nlp,,7200,0
c,2023-09-04T11:00:00+02:00,-5,1,,nlp,,,
d,2023-09-04T12:00:00Z,100,0,,nlp,,,
e,not-a-time,100,1,,nlp,,,
f,2023-09-04T13:00:00Z,100,2,,nlp,urgent,,
g,2023-09-04T14:00:00Z,100,2,,nlp,low,,maybe
h,2023-09-04T15:00:00Z,nan,2,,nlp,,,
"""


@pytest.fixture()
def no_power(monkeypatch):
    """Make ``pricing.power`` unimportable, whatever the checkout holds."""
    monkeypatch.setitem(sys.modules, "pricing.power", None)


def _write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_generic_exact_jobs_and_skips(tmp_path, no_power):
    tr = load_generic_csv(_write(tmp_path, GENERIC))
    assert isinstance(tr, Trace)
    # sorted by submit time: b (09:00 naive = UTC) before a (10:00Z)
    assert [j.job_id for j in tr.jobs] == ["b", "a"]
    b, a = tr.jobs
    # 2023-09-04T10:00:00Z = 1693821600
    assert a == TraceJob(job_id="a", submit_s=1693821600.0, duration_s=3600.0, num_gpus=12, gpus_per_node=4,
                         nodes=3, gpu_type=None, team="vision", priority=PriorityClass.high,
                         deadline_s=1693821600.0 + 3600 + H12, preemptible=True)
    assert b == TraceJob(job_id="b", submit_s=1693818000.0, duration_s=600.0, num_gpus=1, gpus_per_node=1,
                         nodes=1, gpu_type=None, team="nlp", priority=PriorityClass.normal,
                         deadline_s=1693818000.0 + 7200, preemptible=False)
    assert tr.skipped == {"bad_duration": 2, "bad_num_gpus": 1, "bad_submit_time": 1,
                          "unknown_priority": 1, "bad_preemptible": 1}
    assert tr.skip_examples["bad_duration"] == ["row 3: duration_s=-5", "row 8: duration_s=nan"]
    assert tr.skip_examples["bad_num_gpus"] == ["row 4: num_gpus=0"]
    assert tr.skip_examples["bad_submit_time"] == ["row 5: submit_time=not-a-time"]
    assert tr.skip_examples["unknown_priority"] == ["row 6: priority=urgent"]
    assert tr.skip_examples["bad_preemptible"] == ["row 7: preemptible=maybe"]
    assert tr.shift_s == 0.0
    assert tr.total_skipped == 6


def test_generic_deadline_rule_slack_factor(tmp_path, no_power):
    p = _write(tmp_path, "submit_time,duration_s,num_gpus\n0,100000,1\n10,60,1\n")
    tr = load_generic_csv(p, start=datetime(2023, 1, 2, tzinfo=timezone.utc), slack_factor=0.5, min_slack_s=3600)
    t0 = datetime(2023, 1, 2, tzinfo=timezone.utc).timestamp()
    j0, j1 = tr.jobs
    assert (j0.job_id, j0.submit_s, j0.deadline_s) == ("job-1", t0, t0 + 100000 + 50000)
    assert (j1.job_id, j1.submit_s, j1.deadline_s) == ("job-2", t0 + 10, t0 + 10 + 60 + 3600)
    assert default_deadline_s(0, 100, 1.0, H12) == 100 + H12
    assert default_deadline_s(0, 100000, 1.0, H12) == 200000


def test_generic_week_shift_keeps_weekday_and_hour(tmp_path, no_power):
    # Wednesday 2019-03-06 23:30 local Los Angeles (PST), given with its offset.
    p = _write(tmp_path, "submit_time,duration_s,num_gpus\n2019-03-06T23:30:00-08:00,60,1\n"
                         "2019-03-13T23:30:00-07:00,60,1\n")
    tr = load_generic_csv(p, start=datetime(2023, 9, 4), site_tz="America/Los_Angeles")
    first, second = (datetime.fromtimestamp(j.submit_s, LA) for j in tr.jobs)
    assert (first.weekday(), first.hour, first.minute) == (2, 23, 30)
    assert first.date().isoformat() == "2023-09-06"  # first Wednesday on/after Monday 2023-09-04
    assert (second.weekday(), second.hour) == (2, 23)  # crossed a DST change in 2019: wall-clock kept
    assert tr.shift_s % WEEK_S == 0 and tr.shift_s > 0


def test_generic_limit_and_missing_column(tmp_path, no_power):
    p = _write(tmp_path, "submit_time,duration_s,num_gpus\n30,1,1\n10,1,1\n20,1,1\nbad,1,1\n")
    tr = load_generic_csv(p, limit=2)
    assert [j.job_id for j in tr.jobs] == ["job-2", "job-3"]
    assert tr.skipped == {"bad_submit_time": 1}
    with pytest.raises(TraceError, match="num_gpus"):
        load_generic_csv(_write(tmp_path, "submit_time,duration_s\n0,1\n", "m.csv"))
    with pytest.raises(TraceError, match="nope.csv"):
        load_generic_csv(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="limit"):
        load_generic_csv(p, limit=-1)


def test_generic_malformed_and_duplicate_rows(tmp_path, no_power):
    p = _write(tmp_path, "job_id,submit_time,duration_s,num_gpus\nx,0,1,1\nx,5,1,1\ny,1,2\nz,2,1,1,extra\n")
    tr = load_generic_csv(p)
    assert [j.job_id for j in tr.jobs] == ["x"]
    assert tr.skipped == {"malformed_row": 2, "duplicate_job_id": 1}


def test_a_job_id_a_spreadsheet_would_run_is_skipped(tmp_path, no_power):
    """Found by a hostile review: ``=HYPERLINK(...)`` as a job id reached jobs-*.csv and the usage file as it was."""
    p = _write(tmp_path, 'job_id,submit_time,duration_s,num_gpus\n"=HYPERLINK(""http://x"")",0,1,1\n'
                         "+cmd|calc,1,1,1\n-2,2,1,1\n@SUM(A1),3,1,1\nok-1,4,1,1\n")
    tr = load_generic_csv(p)
    assert [j.job_id for j in tr.jobs] == ["ok-1"]
    assert tr.skipped == {"bad_job_id": 4}


def test_gpu_type_checked_with_pricing_power(tmp_path, monkeypatch):
    fake = types.ModuleType("pricing.power")

    def canonical_gpu_type(s):
        table = {"v100": "V100", "a100": "A100"}
        try:
            return table[s.lower()]
        except KeyError:
            raise ValueError(f"unknown GPU type {s!r}") from None

    fake.canonical_gpu_type = canonical_gpu_type
    monkeypatch.setitem(sys.modules, "pricing.power", fake)
    p = _write(tmp_path, "submit_time,duration_s,num_gpus,gpu_type\n0,1,1,v100\n1,1,1,Z80\n2,1,1,\n")
    tr = load_generic_csv(p)
    assert [(j.job_id, j.gpu_type) for j in tr.jobs] == [("job-1", "V100"), ("job-3", None)]
    assert tr.skipped == {"unknown_gpu_type": 1}
    assert tr.skip_examples["unknown_gpu_type"] == ["row 2: gpu_type=Z80"]


def test_gpu_type_accepted_without_pricing_power(tmp_path, no_power):
    p = _write(tmp_path, "submit_time,duration_s,num_gpus,gpu_type\n0,1,1,Z80\n")
    assert load_generic_csv(p).jobs[0].gpu_type == "Z80"


@pytest.mark.parametrize("gpus,shape", [(1, (1, 1)), (6, (1, 6)), (8, (1, 8)), (12, (3, 4)), (16, (2, 8)),
                                        (24, (3, 8)), (9, (9, 1)), (10, (5, 2)), (128, (16, 8))])
def test_gang_shape(gpus, shape):
    assert gang_shape(gpus) == shape


def test_philly_small_file_shape_and_dst(tmp_path):
    # Philly format, gzipped; the 12-GPU job becomes 3 nodes x 4 GPUs.
    text = ("timestamp,duration,num_gpus,gpu_time,cluster\n"
            "2017-11-05 01:30:00,100.0,12,1200.0,abc123\n"
            "2017-11-05 03:00:00,0.0,1,0.0,abc123\n"
            "garbage,5.0,1,5.0,abc123\n")
    p = tmp_path / "philly.csv.gz"
    p.write_bytes(gzip.compress(text.encode()))
    tr = load_philly(p, start=datetime(2023, 11, 5))
    (j,) = tr.jobs
    assert (j.job_id, j.num_gpus, j.nodes, j.gpus_per_node, j.team) == ("philly-1", 12, 3, 4, "abc123")
    # 2023-11-05 01:30 occurs twice in Los Angeles; the first (PDT, UTC-7) = 08:30Z.
    assert j.submit_s == 1699173000.0
    assert tr.shift_s == 313 * WEEK_S
    assert tr.skipped == {"bad_duration": 1, "bad_submit_time": 1}
    assert tr.skip_examples["bad_submit_time"] == ["row 3: timestamp=garbage"]


def test_philly_missing_column(tmp_path):
    p = _write(tmp_path, "timestamp,duration,num_gpus\n2017-10-09 07:01:55,66.0,1\n")
    with pytest.raises(TraceError, match="cluster"):
        load_philly(p)


@pytest.fixture(scope="module")
def philly() -> Trace:
    return load_philly()


def test_philly_full_trace(philly):
    assert len(philly.jobs) == 82247 and philly.skipped == {}
    assert philly.shift_s == 313 * WEEK_S  # 2017-09-04 -> 2023-09-04, 2,191 days
    assert PHILLY_PATH.name in philly.source
    subs = [j.submit_s for j in philly.jobs]
    assert subs == sorted(subs)
    first = datetime.fromtimestamp(subs[0], LA)
    # earliest row (file line 31568): 2017-09-04 10:30:41,2240194.0,8,... cluster 7f04ca
    assert first.replace(tzinfo=None) == datetime(2023, 9, 4, 10, 30, 41)
    assert datetime(2023, 9, 4, tzinfo=LA) <= first < datetime(2023, 9, 11, tzinfo=LA)
    big = [j for j in philly.jobs if j.num_gpus == 12]
    assert len(big) == 7 and all((j.nodes, j.gpus_per_node) == (3, 4) for j in big)
    assert len({j.team for j in philly.jobs}) == 15


def test_philly_first_row_by_hand(philly):
    # broker/data/philly_jobs_pollux_osdi21.csv.gz, file line 2 (first data row):
    #   2017-10-09 07:01:55,66.0,1,66.0,11cb48
    j = next(j for j in philly.jobs if j.job_id == "philly-1")
    # Monday 07:01:55 local (PDT, UTC-7) in 2017 and after the 313-week shift in 2023.
    before = datetime(2017, 10, 9, 7, 1, 55, tzinfo=LA)
    after = datetime.fromtimestamp(j.submit_s, LA)
    assert (before.weekday(), before.hour) == (after.weekday(), after.hour) == (0, 7)
    assert after.replace(tzinfo=None) == datetime(2023, 10, 9, 7, 1, 55)
    assert j.submit_s == 1696860115.0  # 2023-10-09T14:01:55Z
    assert after - before == timedelta(weeks=313)
    assert j == TraceJob(job_id="philly-1", submit_s=1696860115.0, duration_s=66.0, num_gpus=1, gpus_per_node=1,
                         nodes=1, gpu_type=None, team="11cb48", priority=PriorityClass.normal,
                         deadline_s=1696860115.0 + 66 + H12, preemptible=False)


def test_philly_limit_and_start(philly):
    tr = load_philly(limit=10, start=datetime(2024, 1, 1, tzinfo=timezone.utc))
    assert len(tr.jobs) == 10
    # same jobs as the first 10 of the default load, moved by whole weeks
    assert [j.job_id for j in tr.jobs] == [j.job_id for j in philly.jobs[:10]]
    first = datetime.fromtimestamp(tr.jobs[0].submit_s, LA)
    assert first >= datetime(2024, 1, 1, tzinfo=timezone.utc)
    assert (first.weekday(), first.hour, first.minute) == (0, 10, 30)


def test_gpu_type_with_real_pricing_power_if_present(tmp_path):
    pytest.importorskip("pricing.power")
    p = _write(tmp_path, "submit_time,duration_s,num_gpus,gpu_type\n0,1,1,Tesla V100-SXM2-16GB\n1,1,1,Z80\n")
    tr = load_generic_csv(p)
    assert [j.gpu_type for j in tr.jobs] == ["V100"]
    assert tr.skipped == {"unknown_gpu_type": 1}
