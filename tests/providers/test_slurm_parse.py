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
    assert time_limit_min(600, 0.2, 300, time_limit_s=90) == 2  # the job's own limit, in whole minutes


def test_sbatch_time_is_the_jobs_own_time_limit():
    """Issue #20: the spec's ``time_limit_s`` is the Slurm ``--time`` (one rule with the agent's limit)."""
    pool = SlurmPool(SlurmSettings(partition="gpu", broker_id="b1", log_dir="/shared/logs"))
    req = SlurmJobRequest("j1", 1, "vision", "true", "a100", 1, 600, time_limit_s=3000.0)
    assert "--time=50" in pool.sbatch_argv(req)


def test_sbatch_argv_and_script():
    pool = SlurmPool(SlurmSettings(partition="gpu", broker_id="b1", log_dir="/shared/logs",
                                   qos_by_class={"high": "urgent"}))
    req = SlurmJobRequest("j1", 2, "vision", "python train.py", "a100", 4, 600, nodes=2, priority_class="high",
                          deadline=datetime(2026, 12, 2, 8, 0, tzinfo=timezone.utc), env={"LR": "0.1 x"})
    argv = pool.sbatch_argv(req)
    assert argv[:2] == ["sbatch", "--parsable"]
    for a in ("--export=NONE", "--partition=gpu", "--job-name=fb-j1-a2", "--nodes=2", "--ntasks-per-node=1",
              "--gpus-per-node=a100:4", "--time=17", "--no-requeue", "--qos=urgent",
              "--comment=fedbroker-broker=b1,fedbroker-job=j1,fedbroker-attempt=2,fedbroker-team=vision",
              "--output=/shared/logs/fedbroker-%j.out"):
        assert a in argv
    assert any(a.startswith("--deadline=2026-12-0") for a in argv)
    script = pool.batch_script(req)
    assert "export LR='0.1 x'\n" in script
    assert ("srun --export=ALL --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 "
            "--output=/shared/logs/fedbroker-%j-rank%t.out bash -c") in script


def test_untyped_gres_is_asked_for_by_count():
    pool = SlurmPool(SlurmSettings(gres_types={"gpu": "A100"}))
    req = SlurmJobRequest("j1", 1, "vision", "true", "gpu", 4, 600)
    assert "--gpus-per-node=4" in pool.sbatch_argv(req)
    assert pool.rest_job(req)["gpus_per_node"] == "4"


def test_client_commands_get_no_broker_environment(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "FAKE")
    monkeypatch.delenv("TZ", raising=False)
    pool = SlurmPool(SlurmSettings(slurm_conf="/etc/slurm/slurm.conf", bin_dir="/opt/slurm/bin"))
    assert pool.client_environment() == {"PATH": "/opt/slurm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                                                 "/sbin:/bin", "LANG": "C.UTF-8", "SLURM_CONF": "/etc/slurm/slurm.conf"}
    assert pool.rest_job(SlurmJobRequest("j1", 1, "vision", "true", "a100", 1, 60))["environment"] == \
        pool.client_environment()


def test_submitting_as_the_cluster_s_slurm_user_is_refused():
    """A SlurmUser that is not root (Debian's ``slurm`` account, uid 64030 here): refused without the allow."""
    import pwd

    from providers.base import Unsupported

    try:
        pwd.getpwnam("slurm")
    except KeyError:
        pytest.skip("no 'slurm' user on this host (Debian's slurm-wlm packages make it)")
    runner = FakeRunner({"scontrol": (0, "Configuration data as of 2026-12-04T03:00:00\nSlurmUser               = "
                                         "slurm(64030)\nSlurmdUser              = root(0)\n", "")})
    with pytest.raises(Unsupported) as e:
        SlurmPool(SlurmSettings(submit_user="slurm"), runner=runner).submit_account()
    assert e.value.code == "PrivilegedSubmit"
    assert str(e.value).startswith("submit_user='slurm' is the cluster's SlurmUser: ")
    ok = SlurmPool(SlurmSettings(submit_user="slurm", allow_privileged_submit=True), runner=runner)
    assert ok.submit_account()[:2] == ("slurm", pwd.getpwnam("slurm").pw_uid)
    with pytest.raises(Unsupported) as e:
        SlurmPool(SlurmSettings(submit_user="no-such-user-here"), runner=runner).submit_account()
    assert (e.value.code, str(e.value)) == ("NoSuchUser", "submit_user='no-such-user-here': no such user on the "
                                                          "broker's host")


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
    with pytest.raises(ValueError, match="log_max_bytes=100: must be an integer from 1024 to"):
        SlurmSettings(log_max_bytes=100)
    with pytest.raises(ValueError, match="checkpoint_root='ckpt': must be an absolute path"):
        SlurmSettings(checkpoint_root="ckpt")
    with pytest.raises(ValueError, match="submit_user='x y': must be a user name"):
        SlurmSettings(submit_user="x y")
    with pytest.raises(ValueError, match="submit_user='a': on the REST path jobs run as the JWT's user"):
        SlurmSettings(rest_url="http://h:6820", jwt_file="/j", rest_user="b", submit_user="a")


class FakeRunner:
    """Answers each Slurm command (argv[0]'s name) with a fixed CompletedProcess; records the calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, argv, **kw):
        import subprocess
        from pathlib import Path

        self.calls.append(argv)
        rc, out, err = self.answers[Path(argv[0]).name]
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_describe_falls_back_to_sacct_for_a_forgotten_job():
    runner = FakeRunner({
        "scontrol": (1, "", "slurm_load_jobs error: Invalid job id specified\n"),
        "sacct": (0, "4242|NODE_FAIL|0:0|3600|fedbroker-broker=b1,fedbroker-job=j9,fedbroker-attempt=1|a[001-002]|"
                     "NodeDown|120\n", ""),
    })
    info = SlurmPool(SlurmSettings(broker_id="b1"), runner=runner).describe("4242")
    assert (info.state, info.slurm_state, info.elapsed_s, info.time_limit_s) == ("interrupted", "NODE_FAIL", 3600.0,
                                                                                 7200.0)
    assert info.reason == "NODE_FAIL on a[001-002] (Slurm reason NodeDown): the broker requeues the attempt"
    assert runner.calls[1][:6] == ["sacct", "-X", "-n", "-P", "-j", "4242"]


def test_describe_of_an_unknown_job_without_accounting_is_not_found():
    from providers.base import ProviderError

    runner = FakeRunner({"scontrol": (1, "", "slurm_load_jobs error: Invalid job id specified\n"),
                         "sacct": (1, "", "sacct: error: Slurm accounting storage is disabled\n")})
    with pytest.raises(ProviderError, match="accounting storage is disabled") as e:
        SlurmPool(SlurmSettings(), runner=runner).describe("7")
    assert e.value.code == "NotFound"


def test_rest_job_exit_status_is_split_into_code_and_signal():
    from providers.slurm import _rest_kv

    kv = _rest_kv({"job_id": 5, "job_state": "FAILED", "exit_code": 5 << 8, "start_time": 100, "end_time": 161,
                   "time_limit": 7, "standard_output": "/logs/fedbroker-%j.out", "comment": "a=b"})
    assert (kv["ExitCode"], kv["RunTime"], kv["TimeLimit"], kv["StdOut"]) == ("5:0", "00:01:01", "00:07:00",
                                                                              "/logs/fedbroker-5.out")
    assert _rest_kv({"job_id": 6, "job_state": "CANCELLED", "exit_code": 15})["ExitCode"] == "0:15"


def test_sbatch_errors_map_to_typed_errors():
    from providers.base import QuotaExceeded, SchedulerUnavailable, Unsupported

    cases = [("sbatch: error: Batch job submission failed: Requested node configuration is not available", Unsupported),
             ("sbatch: error: Batch job submission failed: Invalid partition name specified", Unsupported),
             ("sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds "
              "some limit)", QuotaExceeded),
             ("sbatch: error: Batch job submission failed: Job violates accounting/QOS policy", QuotaExceeded),
             ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
              SchedulerUnavailable)]
    for msg, cls in cases:
        assert type(SlurmPool._error("sbatch", msg, "slurm:gpu:a100")) is cls, msg


def test_settings_from_mapping():
    from providers.slurm import settings_from_mapping

    s = settings_from_mapping({"partition": "a100", "rest_url": "http://head:6820", "jwt_file": "/etc/jwt",
                               "rest_user": "fedbroker", "qos_by_class": {"high": "urgent"}, "term_grace_s": 60})
    assert (s.partition, s.rest_url, s.term_grace_s, dict(s.qos_by_class)) == ("a100", "http://head:6820", 60,
                                                                                {"high": "urgent"})
    with pytest.raises(ValueError, match=r"pools\.hpc: unknown key\(s\) \['partiton'\]"):
        settings_from_mapping({"partiton": "gpu"}, "pools.hpc")
    with pytest.raises(ValueError, match=r"slurm\.timeout_s='30': must be a number"):
        settings_from_mapping({"timeout_s": "30"})
    with pytest.raises(ValueError, match="jwt_file and rest_user are required"):
        settings_from_mapping({"rest_url": "http://head:6820"})
    with pytest.raises(ValueError, match="rest_url='head:6820': must be an http"):
        settings_from_mapping({"rest_url": "head:6820", "jwt_file": "/j", "rest_user": "u"})
    # a bad URL with a password in it: the error names the field, never the password
    with pytest.raises(ValueError) as e:
        settings_from_mapping({"rest_url": "ftp://user:pa55w0rd@[::1", "jwt_file": "/j", "rest_user": "u"})
    assert str(e.value) == "slurm: rest_url=<hidden: holds user:password@>: must be an http(s) URL"
