"""providers.slurm on a real local Slurm 22.05 (tests/slurm/cluster.py): jobs really run and their exit codes,
logs, cancels, admin kills, node failures and the sweep come back from slurmctld."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from providers.base import NoCapacity, ProviderError, QuotaExceeded, SchedulerUnavailable, Unsupported
from providers.slurm import SlurmJobRequest, SlurmPool, SlurmSettings


#: the unprivileged account the tests submit as (the local cluster runs as root; ``nobody`` exists everywhere)
ACCOUNT = "nobody"
ACCOUNT_UID = 65534


@pytest.fixture(scope="module", params=["cli", "rest"])
def pool(request, slurm_cluster):
    """The adapter on the CLI path, then on the slurmrestd (REST + JWT) path: every test runs on both. Jobs are
    submitted as ``nobody`` (CLI: ``submit_user``; REST: a JWT of ``nobody``); ``log_dir`` and
    ``checkpoint_root`` do not exist yet (the adapter makes them)."""
    logs = slurm_cluster.root / f"logs-{request.param}"
    jwt = slurm_cluster.token(path=slurm_cluster.root / "etc" / "nobody.jwt", user=ACCOUNT)
    rest = dict(rest_url=slurm_cluster.rest_url, jwt_file=str(jwt), rest_user=ACCOUNT)
    p = SlurmPool(SlurmSettings(partition="gpu", broker_id="b-test", log_dir=str(logs),
                                checkpoint_root=str(slurm_cluster.root / f"ckpt-{request.param}"),
                                slurm_conf=str(slurm_cluster.conf), term_grace_s=1.0,
                                **(rest if request.param == "rest" else {"submit_user": ACCOUNT})))
    yield p
    for info in p.list_managed():  # a failed test leaves nothing queued for the next one
        p.cancel(info.slurm_job_id, grace_s=0)


def rest_twin(pool, **kw):
    """Settings like ``pool``'s with ``kw`` changed."""
    from dataclasses import replace

    return SlurmPool(replace(pool.settings, **kw))


def req(job_id, command, gpu_type="a100", gpus=1, nodes=1, attempt=0, **kw):
    return SlurmJobRequest(job_id=job_id, attempt=attempt, team="vision", command=command, gpu_type=gpu_type,
                           gpus_per_node=gpus, estimate_s=60, nodes=nodes, **kw)


def wait(pool, sid, states, timeout_s=30.0):
    end = time.monotonic() + timeout_s
    while True:
        info = pool.describe(sid)
        if info.state in states or time.monotonic() > end:
            return info
        time.sleep(0.1)


def test_one_gpu_job_runs_to_succeeded_with_its_log(pool):
    info = pool.submit(req("one-gpu", 'echo "gpus=$CUDA_VISIBLE_DEVICES rank=$NODE_RANK job=$FEDBROKER_JOB_ID"',
                           env={"GREETING": "it's me"}))
    assert info.tags == {"fedbroker-broker": "b-test", "fedbroker-job": "one-gpu", "fedbroker-attempt": "0",
                         "fedbroker-team": "vision"}
    assert info.time_limit_s == 7 * 60  # ceil((60 * 1.2 + 300) / 60) = 7 min
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.slurm_state, done.exit_code, done.signal) == ("succeeded", "COMPLETED", 0, 0)
    assert done.reason == "exited with code 0"
    assert Path(done.stdout).read_text() == "gpus=0 rank=0 job=one-gpu\n"


def test_failing_job_reports_its_exit_code(pool):
    info = pool.submit(req("fails", 'echo "$GREETING"; exit 4', env={"GREETING": "it's me"}))
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.exit_code, done.reason) == ("failed", 4, "exited with code 4")
    assert Path(done.stdout).read_text() == "it's me\n"


def test_two_node_gang_runs_once_per_node_with_rank0_as_master(pool, slurm_cluster):
    info = pool.submit(req("gang", 'echo "rank=$NODE_RANK master=$MASTER_ADDR:$MASTER_PORT nnodes=$NNODES"',
                           gpus=2, nodes=2))
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("succeeded", 0)
    hosts = slurm_cluster.run("scontrol", "show", "hostnames", done.nodes).stdout.split()
    assert len(hosts) == 2 and all(h.startswith("a") for h in hosts)
    # each node rank has its own output file (fedbroker logs --rank N), mode 0600; the batch file holds srun's words
    files = pool.log_files(done.stdout)
    assert sorted(files) == [-1, 0, 1]
    assert [files[r].read_text() for r in (0, 1)] == [f"rank=0 master={hosts[0]}:29500 nnodes=2\n",
                                                      f"rank=1 master={hosts[0]}:29500 nnodes=2\n"]
    assert files[1].name == f"fedbroker-{info.slurm_job_id}-rank1.out"
    assert [f.stat().st_mode & 0o777 for f in files.values()] == [0o600, 0o600, 0o600]
    assert files[-1].read_text() == ""


def test_gang_exit_code_is_the_failing_rank_s(pool):
    info = pool.submit(req("gang-fail", 'exit $((NODE_RANK * 3))', nodes=2))
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("failed", 3)


def test_capacity_matches_sinfo_and_require_free(pool, slurm_cluster):
    idle = {n.node: (n.state, dict(n.gpus_total), dict(n.gpus_used)) for n in pool.capacity()}
    assert idle == {"a001": ("idle", {"a100": 2}, {"a100": 0}), "a002": ("idle", {"a100": 2}, {"a100": 0}),
                    "a003": ("idle", {"a100": 2}, {"a100": 0}), "h001": ("idle", {"h100": 4}, {"h100": 0})}
    assert pool.free_gpus() == {"a100": 6, "h100": 4}
    hold = pool.submit(req("hold", "sleep 60", gpu_type="h100", gpus=3))
    assert wait(pool, hold.slurm_job_id, {"running"}).state == "running"
    try:
        caps = {n.node: n for n in pool.capacity()}
        assert (caps["h001"].state, caps["h001"].gpus_free("h100")) == ("mixed", 1)
        assert pool.free_gpus() == {"a100": 6, "h100": 1}
        # sinfo's own words for the same node: GRES total and in use
        line = slurm_cluster.run("sinfo", "-h", "-N", "-n", "h001", "-o", "%N %t %G").stdout.split()
        assert line == ["h001", "mix", "gpu:h100:4"]
        used = slurm_cluster.run("squeue", "-h", "-j", hold.slurm_job_id, "-o", "%b").stdout.strip()
        assert used == "gres:gpu:h100:3"
        with pytest.raises(NoCapacity) as e:
            pool.submit(req("wants-two", "true", gpu_type="h100", gpus=2), require_free=True)
        assert e.value.option == "slurm:gpu:h100"
    finally:
        pool.cancel(hold.slurm_job_id, grace_s=0)


def test_cancel_sends_term_then_the_job_ends_cancelled(pool):
    info = pool.submit(req("stop-me", 'trap "echo got TERM; exit 0" TERM; echo started; sleep 60 & wait'))
    assert wait(pool, info.slurm_job_id, {"running"}).state == "running"
    time.sleep(0.5)  # the trap is set
    t0 = time.monotonic()
    done = pool.cancel(info.slurm_job_id)
    assert time.monotonic() - t0 < 5
    assert (done.state, done.reason) == ("cancelled", "cancelled by the broker")
    assert "got TERM" in Path(done.stdout).read_text()
    assert pool.cancel(info.slurm_job_id).state == "cancelled"  # again: nothing to do


def test_cancel_kills_a_job_that_ignores_term_after_the_grace(pool):
    info = pool.submit(req("stubborn", "trap '' TERM; sleep 60"))
    assert wait(pool, info.slurm_job_id, {"running"}).state == "running"
    time.sleep(0.5)
    t0 = time.monotonic()
    done = pool.cancel(info.slurm_job_id, grace_s=1.0)
    took = time.monotonic() - t0
    assert (done.state, done.reason) == ("cancelled", "cancelled by the broker")
    assert 1.0 <= took < 20, took


def test_cancel_of_a_pending_job(pool):
    info = pool.submit(req("later", "true", begin=datetime.now(timezone.utc) + timedelta(hours=1)))
    assert (info.state, info.slurm_state) == ("starting", "PENDING")
    done = pool.cancel(info.slurm_job_id)
    assert (done.state, done.slurm_state, done.reason) == ("cancelled", "CANCELLED", "cancelled by the broker")


def test_admin_scancel_is_reported_with_the_reason(pool, slurm_cluster):
    info = pool.submit(req("admin-kills", "sleep 60"))
    assert wait(pool, info.slurm_job_id, {"running"}).state == "running"
    slurm_cluster.run("scontrol", "update", f"JobId={info.slurm_job_id}", "AdminComment=draining rack 4")
    slurm_cluster.run("scancel", info.slurm_job_id)
    done = wait(pool, info.slurm_job_id, {"cancelled"})
    assert (done.state, done.slurm_state, done.signal) == ("cancelled", "CANCELLED", 15)
    assert done.reason == ("cancelled in the cluster, not by the broker (scancel by an administrator or the "
                           "job's owner; signal 15); admin comment: draining rack 4")


def test_forgotten_job_is_found_by_list_managed_and_swept(pool, slurm_cluster):
    other = rest_twin(pool, broker_id="someone-else")
    live = pool.submit(req("live", "sleep 60", attempt=2))
    orphan = pool.submit(req("orphan", "sleep 60", attempt=0))
    foreign = other.submit(req("theirs", "sleep 60"))
    managed = {(i.tags["fedbroker-job"], i.tags["fedbroker-attempt"]) for i in pool.list_managed()}
    assert managed == {("live", "2"), ("orphan", "0")}
    polled = pool.poll()  # every job of ours the controller holds, finished ones too; never another broker's
    assert live.slurm_job_id in polled and orphan.slurm_job_id in polled and foreign.slurm_job_id not in polled
    assert all(i.tags["fedbroker-broker"] == "b-test" for i in polled.values())
    done = [(i.state, i.exit_code) for i in polled.values() if i.tags["fedbroker-job"] in ("one-gpu", "fails")]
    assert sorted(set(done)) == [("failed", 4), ("succeeded", 0)]  # the first tests' jobs, finished
    gone = pool.sweep(live=[("live", 2)], grace_s=0)
    assert [g.slurm_job_id for g in gone] == [orphan.slurm_job_id]
    assert pool.describe(orphan.slurm_job_id).state == "cancelled"
    assert pool.describe(live.slurm_job_id).state in ("starting", "running")
    assert other.describe(foreign.slurm_job_id).state in ("starting", "running")
    pool.cancel(live.slurm_job_id, grace_s=0)
    other.cancel(foreign.slurm_job_id, grace_s=0)
    assert pool.list_managed() == [] and other.list_managed() == []


def test_typed_errors(pool, slurm_cluster, tmp_path):
    with pytest.raises(Unsupported, match="gpu_type='v100'") as e:
        pool.submit(req("v100", "true", gpu_type="v100"))
    assert e.value.code == "NoSuchGres"
    with pytest.raises(Unsupported) as e:
        pool.submit(req("too-many", "true", gpu_type="a100", gpus=3))
    assert e.value.code == "NoSuchGres"
    with pytest.raises(QuotaExceeded, match="time limit") as e:  # MaxTime=60 min
        pool.submit(SlurmJobRequest("long", 0, "vision", "true", "a100", 1, estimate_s=3600))
    assert e.value.code == "PartitionLimit"
    with pytest.raises(QuotaExceeded, match="Node count"):  # MaxNodes=2, 3 a100 nodes exist
        pool.submit(req("wide", "true", nodes=3))
    with pytest.raises(Unsupported, match="'nope'"):
        rest_twin(pool, partition="nope").capacity()
    with pytest.raises(ProviderError) as e:
        pool.describe("999999")
    assert e.value.code == "NotFound"
    if pool.settings.rest_url:
        expired = slurm_cluster.token(lifespan_s=1, path=tmp_path / "expired.jwt")
        time.sleep(2.1)
        with pytest.raises(SchedulerUnavailable) as e:
            rest_twin(pool, jwt_file=str(expired)).capacity()
        assert e.value.code == "AuthRejected"
        with pytest.raises(SchedulerUnavailable) as e:
            rest_twin(pool, jwt_file=str(tmp_path / "none.jwt")).capacity()
        assert e.value.code == "NoToken"
        with pytest.raises(SchedulerUnavailable):  # nothing listens on port 9
            rest_twin(pool, rest_url="http://127.0.0.1:9").capacity()
        return
    missing = SlurmPool(SlurmSettings(bin_dir=str(tmp_path), slurm_conf=pool.settings.slurm_conf))
    with pytest.raises(SchedulerUnavailable) as e:
        missing.capacity()
    assert e.value.code == "ClientMissing"
    # a controller that does not answer: the same config with the controller's port moved to a closed one
    conf = tmp_path / "slurm.conf"
    conf.write_text(slurm_cluster.conf.read_text().replace(f"SlurmctldPort={slurm_cluster.ctld_port}",
                                                           "SlurmctldPort=9") + "MessageTimeout=1\n")
    down = SlurmPool(SlurmSettings(slurm_conf=str(conf), timeout_s=20))
    with pytest.raises(SchedulerUnavailable):
        down.capacity()


def test_node_down_mid_run_interrupts_the_attempt(pool, slurm_cluster):
    info = pool.submit(req("node-dies", "sleep 60", gpu_type="h100"))
    assert wait(pool, info.slurm_job_id, {"running"}).state == "running"
    slurm_cluster.run("scontrol", "update", "NodeName=h001", "State=DOWN", "Reason=fedbroker-test")
    try:
        done = wait(pool, info.slurm_job_id, {"interrupted"})
        if pool.settings.rest_url:  # slurmrestd v0.0.38 ignores requeue=false: Slurm requeued the job itself
            assert (done.state, done.slurm_state, done.slurm_active) == ("interrupted", "PENDING", True)
            assert done.reason.startswith("Slurm requeued the job itself (restart 1, ")
            assert [i.slurm_job_id for i in pool.list_managed()] == [info.slurm_job_id]
            assert pool.cancel(info.slurm_job_id).slurm_state == "CANCELLED"
            assert pool.list_managed() == []
        else:
            assert (done.state, done.slurm_state) == ("interrupted", "NODE_FAIL")
            assert done.reason == "NODE_FAIL on h001 (Slurm reason NodeDown): the broker requeues the attempt"
    finally:
        slurm_cluster.run("scontrol", "update", "NodeName=h001", "State=RESUME", check=False)


def test_backlog_counts_the_cluster_s_own_pending_gpus_not_ours(pool, slurm_cluster):
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    ours = pool.submit(req("ours-later", "true", gpus=2, nodes=2, begin=later))
    for argv in (["--gpus-per-node=a100:1", "-N", "2"], ["--gpus-per-node=h100:3"]):  # another team's jobs
        slurm_cluster.run("sbatch", "--begin=now+1hour", "-p", "gpu", "-t", "5", "-o", "/dev/null", *argv,
                          "--wrap", "true")
    try:
        assert pool.backlog() == {"a100": 2, "h100": 3}
    finally:
        pool.cancel(ours.slurm_job_id)
        slurm_cluster.run("scancel", "--state=PENDING", "--user=root")
    assert pool.backlog() == {}


def test_release_profile_from_running_jobs_time_limits(pool):
    assert pool.release_profile() == []
    t0 = datetime.now(timezone.utc)
    job = pool.submit(req("holds-gpus", "sleep 60", gpu_type="a100", gpus=1, nodes=2))  # --time=7 (60 s estimate)
    try:
        running = wait(pool, job.slurm_job_id, {"running"})
        assert running.state == "running"
        [(end, typ, gpus)] = pool.release_profile()
        assert (typ, gpus) == ("a100", 2)
        assert abs((end - t0).total_seconds() - 7 * 60) <= 3, end
    finally:
        pool.cancel(job.slurm_job_id, grace_s=0)


def test_job_sees_the_launch_environment_only_and_runs_as_the_submit_account(pool, monkeypatch):
    """Issue #20: the broker's environment (cloud keys, its database URL) never reaches a job; the job runs as the
    unprivileged submit account, with Slurm's SLURM_* variables, the clean base (PATH, HOME, LANG, TZ,
    CUDA_VISIBLE_DEVICES) and the launch variables."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "FAKE-secret-key")
    monkeypatch.setenv("FEDBROKER_DATABASE_URL", "postgresql://broker:pw@db/fedbroker")
    info = pool.submit(req("env-check", 'id -u; echo "home=$HOME"; env | sort', env={"WORLD_SIZE": "1"}))
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("succeeded", 0)
    out = Path(done.stdout).read_text()
    assert "FAKE-secret-key" not in out and "pw@db" not in out
    uid, home, *env = out.splitlines()
    assert uid == str(ACCOUNT_UID)
    keys = {line.split("=", 1)[0] for line in env if "=" in line}
    assert sorted(k for k in keys if not k.startswith("SLURM")) == [
        "CUDA_VISIBLE_DEVICES", "ENVIRONMENT", "FEDBROKER_ATTEMPT", "FEDBROKER_JOB_ID", "FEDBROKER_RANK",
        "GPU_DEVICE_ORDINAL", "HOME", "HOSTNAME", "LANG", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "PATH",
        "PET_MASTER_ADDR", "PET_NODE_RANK", "PWD", "ROCR_VISIBLE_DEVICES", "SHLVL", "TMPDIR", "TZ", "WORLD_SIZE",
        "ZE_AFFINITY_MASK", "_"]
    assert {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "TZ=UTC",
            "CUDA_VISIBLE_DEVICES=0", "WORLD_SIZE=1"} <= set(env)
    home = home.removeprefix("home=")
    assert home.startswith("/tmp/fedbroker-") and not Path(home).exists()  # the rank's working directory, removed


def test_submitting_as_root_is_refused_unless_explicitly_allowed(pool, slurm_cluster):
    """The local cluster's SlurmUser is root: submitting as root is refused before anything reaches Slurm, and
    runs as uid 0 only with allow_privileged_submit."""
    path = "rest" if pool.settings.rest_url else "cli"
    logs, job = str(slurm_cluster.root / f"logs-root-{path}"), f"as-root-{path}"
    if pool.settings.rest_url:
        root = rest_twin(pool, rest_user="root", jwt_file=str(slurm_cluster.jwt_file), log_dir=logs)
        key = "rest_user"
    else:
        root = rest_twin(pool, submit_user=None, log_dir=logs)  # the broker's own user: root
        key = "submit_user"
    with pytest.raises(Unsupported) as e:
        root.submit(req(job, "id -u"))
    assert e.value.code == "PrivilegedSubmit"
    assert str(e.value) == (f"{key}='root' is root: jobs of other teams would run with its rights; set {key} to an "
                            "unprivileged Slurm account, or allow_privileged_submit: true to accept this")
    assert not [i for i in pool.poll().values() if i.tags["fedbroker-job"] == job]
    allowed = rest_twin(root, allow_privileged_submit=True)
    done = wait(allowed, allowed.submit(req(job, "id -u")).slurm_job_id, {"succeeded", "failed"})
    assert (done.state, Path(done.stdout).read_text()) == ("succeeded", "0\n")


def test_checkpoint_dir_is_made_for_the_job_owned_by_its_user(pool):
    ckpt = Path(pool.settings.checkpoint_root) / "vision" / "ckpt-job"
    info = pool.submit(req("ckpt-job", 'touch "$CHECKPOINT_DIR/step1" && stat -c "%U %a" "$CHECKPOINT_DIR"',
                           env={"CHECKPOINT_DIR": str(ckpt)}))
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, Path(done.stdout).read_text()) == ("succeeded", f"{ACCOUNT} 700\n")
    assert (ckpt / "step1").stat().st_uid == ACCOUNT_UID
    root = Path(pool.settings.checkpoint_root)
    assert (root.stat().st_uid, root.stat().st_mode & 0o777) == (ACCOUNT_UID, 0o700)  # made by the adapter
    # a checkpoint root the account cannot write: the job fails at once, saying why
    info = pool.submit(req("no-ckpt", "echo never", env={"CHECKPOINT_DIR": "/proc/fedbroker/ckpt"}))
    done = wait(pool, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("failed", 1)
    mkdir, why = Path(done.stdout).read_text().splitlines()  # mkdir's own words, then the job's reason
    assert mkdir.startswith("mkdir: cannot create directory ") and mkdir.endswith(": No such file or directory")
    assert why == (f"fedbroker: cannot create CHECKPOINT_DIR=/proc/fedbroker/ckpt as {ACCOUNT} (checkpoint_root "
                   "must exist on every node and be writable by the submit account)")


def test_log_file_is_private_capped_at_head_and_tail_and_removed_by_retention(pool):
    small = rest_twin(pool, log_max_bytes=4096)
    info = small.submit(req("chatty", "printf HEAD; head -c 10000 /dev/zero | tr '\\0' x; printf TAIL"))
    done = wait(small, info.slurm_job_id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("succeeded", 0)
    out = Path(done.stdout)
    body = b"HEAD" + b"x" * 10000 + b"TAIL"  # 10,008 bytes: 2,048 + 2,048 kept, 5,912 dropped between
    assert out.read_bytes() == (body[:2048] + b"\n[fedbroker: 5912 bytes of output dropped here (log_max_bytes 4096: "
                                b"the first 2048 and the last 2048 bytes are kept)]\n" + body[-2048:])
    st, dst = out.stat(), out.parent.stat()
    assert (st.st_mode & 0o777, st.st_uid, dst.st_mode & 0o777, dst.st_uid) == (0o600, ACCOUNT_UID, 0o700, ACCOUNT_UID)
    other = out.parent / "notes.txt"  # not a job output file: retention leaves it
    other.write_text("operator's\n")
    small.purge_logs(datetime.fromtimestamp(st.st_mtime - 1, timezone.utc))  # earlier tests' files only
    assert out.exists()
    assert small.purge_logs(datetime.now(timezone.utc) + timedelta(seconds=1)) >= 1
    assert not out.exists() and other.read_text() == "operator's\n"
    assert not [f for f in out.parent.iterdir() if f.name.startswith("fedbroker-")]
    other.unlink()
