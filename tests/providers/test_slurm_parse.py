"""providers.slurm without a cluster: the parsers, the state table, the time limit and the sbatch line."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from providers.slurm import (SlurmJobRequest, SlurmPool, SlurmSettings, lifecycle_state, parse_gres, parse_scontrol,
                             time_limit_min)


def test_parse_gres():
    assert parse_gres("gpu:a100:2(S:0-1),gpu:v100:1") == {"a100": 2, "v100": 1}
    assert parse_gres("gpu:4") == {"gpu": 4}
    assert parse_gres("gpu:a100:1(IDX:0)") == {"a100": 1}
    assert parse_gres("gpu:h100:3(IDX:0-2),shard:h100:0(0/8,0/8)") == {"h100": 3}
    assert parse_gres("(null)") == {}


def test_parse_scontrol_values_with_spaces():
    kv = parse_scontrol("JobId=7 JobName=fb-x-a0 JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 "
                        "AdminComment=draining rack 4 NodeList=a[001-002] RunTime=1-02:03:04")
    assert kv["AdminComment"] == "draining rack 4"
    assert (kv["JobState"], kv["ExitCode"], kv["NodeList"]) == ("FAILED", "3:0", "a[001-002]")


@pytest.mark.parametrize("slurm,ours", [("PENDING", "starting"), ("RUNNING", "running"), ("COMPLETING", "running"),
                                        ("COMPLETED", "succeeded"), ("FAILED", "failed"), ("TIMEOUT", "failed"),
                                        ("OUT_OF_MEMORY", "failed"), ("CANCELLED by 0", "cancelled"),
                                        ("CANCELLED+", "cancelled"), ("NODE_FAIL", "interrupted"),
                                        ("PREEMPTED", "interrupted"), ("REQUEUED", "interrupted")])
def test_lifecycle_state(slurm, ours):
    assert lifecycle_state(slurm) == ours


def test_lifecycle_state_unknown():
    with pytest.raises(ValueError, match="slurm_state='BOGUS'"):
        lifecycle_state("BOGUS")


def test_time_limit_min():
    assert time_limit_min(600, 0.2, 300) == 17  # ceil(1020 / 60)
    assert time_limit_min(1, 0, 0) == 1
    assert time_limit_min(3600, 0, 0) == 60


def test_sbatch_argv_and_script():
    pool = SlurmPool(SlurmSettings(partition="gpu", broker_id="b1", log_dir="/shared/logs",
                                   qos_by_class={"high": "urgent"}))
    req = SlurmJobRequest("j1", 2, "vision", "python train.py", "a100", 4, 600, nodes=2, priority_class="high",
                          deadline=datetime(2026, 12, 2, 8, 0, tzinfo=timezone.utc), env={"LR": "0.1 x"})
    argv = pool.sbatch_argv(req)
    assert argv[:2] == ["sbatch", "--parsable"]
    for a in ("--partition=gpu", "--job-name=fb-j1-a2", "--nodes=2", "--ntasks-per-node=1",
              "--gpus-per-node=a100:4", "--time=17", "--no-requeue", "--qos=urgent",
              "--comment=fedbroker-broker=b1,fedbroker-job=j1,fedbroker-attempt=2,fedbroker-team=vision",
              "--output=/shared/logs/fedbroker-%j.out"):
        assert a in argv
    assert any(a.startswith("--deadline=2026-12-0") for a in argv)
    script = pool.batch_script(req)
    assert "export LR='0.1 x'\n" in script
    assert "exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 bash -c" in script


@pytest.mark.parametrize("field,value,msg", [("job_id", "a b", "job_id='a b'"), ("gpus_per_node", 0, "gpus_per_node=0"),
                                             ("estimate_s", 0, "estimate_s=0"), ("gpu_type", "a100;rm", "gpu_type="),
                                             ("deadline", datetime(2026, 1, 1), "deadline=")])
def test_bad_request_names_the_field(field, value, msg):
    kw = dict(job_id="j", attempt=0, team="t", command="true", gpu_type="a100", gpus_per_node=1, estimate_s=60)
    kw[field] = value
    with pytest.raises(ValueError, match=msg):
        SlurmJobRequest(**kw)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="partition='a b'"):
        SlurmSettings(partition="a b")
