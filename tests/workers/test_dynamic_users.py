"""Per-attempt uids (issue #9, job isolation; :mod:`workers.dynamic_users`).

The penetration test this guards against: every job of every team ran as ``nobody``, so a job of
team vision could ``kill`` team ml's job, read its ``/proc/<pid>/environ``, its files and overwrite
its checkpoint; a ``setsid`` child outlived its job and could wait for later jobs. Now each attempt
rank runs under its own uid, and every process of that uid dies when the rank ends.

These tests run real jobs through the production path (store, API, planning cycle, agent, shim) and
need root; they are skipped otherwise (the settings checks run everywhere).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from broker.service.store.tables import utcnow
from broker.service.reconciler import Reconciler
from broker.service.settings import BrokerSettings, SettingsError, load_settings
from tests.workers.rig import Rig, sh
from workers.dynamic_users import (STALE_LEASE_S, UidRangeExhausted, allocate_uid, dynamic_user, hand_over, kill_uid,
                                   processes_of_uid, reclaim, release_uid)
from workers.runtime import AttemptKey, ProcessRuntime
from workers.shim import proc_stat

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="running jobs under other uids needs root")
LO = 61184  # the first uid of the default jobs.uid_range


def _log(store, jid: str, attempt: int = 1) -> str:
    return "".join(t for _, t in store.log_chunks(jid, attempt))


def _alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _probe(me: str, other: str, d: Path) -> str:
    """A job that publishes its pid/HOME/checkpoint, then attacks the other team's job, then waits for it."""
    return (f'echo secret-{me} > "$CHECKPOINT_DIR/s"; echo home-{me} > "$HOME/h"; '
            f'echo "$$ $HOME $CHECKPOINT_DIR" > {d}/{me}.tmp; chmod 644 {d}/{me}.tmp; mv {d}/{me}.tmp {d}/{me}.info; '
            f'while [ ! -f {d}/{other}.info ]; do sleep 0.05; done; read pid home ckpt < {d}/{other}.info; '
            'echo "uid=$(id -u) gid=$(id -g) groups=$(id -G) user=$USER"; '
            'kill -0 "$pid"; echo "kill=$?"; kill -9 "$pid"; cat "$home/h"; cat "$ckpt/s"; '
            'echo overwritten > "$ckpt/s"; cat "/proc/$pid/environ" > /dev/null; '
            f'touch {d}/{me}.done; while [ ! -f {d}/{other}.done ]; do sleep 0.05; done')


@root_only
def test_two_teams_get_different_uids_and_cannot_signal_or_read_each_other(pg_store, rig, tmp_path):
    rig = rig({"n1": 2})
    d = tmp_path / "x"
    d.mkdir()
    os.chmod(d, 0o1777)
    a = pg_store.submit("vision", sh(_probe("vision", "ml", d)))[0].id
    b = pg_store.submit("ml", sh(_probe("ml", "vision", d)))[0].id
    rig.until(lambda: rig.state(a) == "succeeded" and rig.state(b) == "succeeded", timeout=30, what="both jobs")
    logs = {"vision": _log(pg_store, a), "ml": _log(pg_store, b)}
    uids = {}
    for team, other in (("vision", "ml"), ("ml", "vision")):
        log = logs[team]
        uid = int(log.split("uid=")[1].split()[0])
        uids[team] = uid
        assert f"uid={uid} gid={uid} groups={uid} user=fedbroker-{uid}\n" in log
        pid, home, ckpt = (d / f"{other}.info").read_text().split()
        assert "kill: Operation not permitted" in log and "kill=1\n" in log
        assert f"cat: {home}/h: Permission denied" in log
        assert f"cat: {ckpt}/s: Permission denied" in log
        assert f"{ckpt}/s: Permission denied" in log.split(f"cat: {ckpt}/s")[1]  # the overwrite failed too
        # not even there: the job's /proc lists its own uid's processes only (hidepid=2, workers.isolation.PrivateView)
        assert f"cat: /proc/{pid}/environ: No such file or directory" in log
        assert f"home-{other}" not in log and f"secret-{other}" not in log
        assert (Path(ckpt) / "s").read_text() == f"secret-{other}\n"  # untouched
    assert sorted(uids.values()) == [LO, LO + 1]
    rig.until(lambda: rig.agents["n1"].runtime.list() == [], what="both attempts to be forgotten")
    assert not list((tmp_path / "leases" / "uids").iterdir())  # both leases released


@root_only
def test_a_setsid_escapee_dies_with_its_job(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    pidfile = tmp_path / "escapee"
    jid = pg_store.submit("ml", sh(f'setsid sleep 1000 & echo $! > {pidfile}; sleep 0.3; id -u'))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="the job to end")
    pid = int(pidfile.read_text())
    uid = int(_log(pg_store, jid))
    assert uid == LO
    assert not _alive(pid) and processes_of_uid(uid) == []


@root_only
def test_cancel_kills_an_escapee_after_the_grace_period_not_only_the_group(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    pidfile = tmp_path / "escapee"
    # the escapee ignores SIGTERM; the job itself also ignores it: only the SIGKILL after the grace ends them
    jid = pg_store.submit("ml", sh(f"trap '' TERM; setsid sh -c 'trap \"\" TERM; sleep 1000' & echo $! > {pidfile}; "
                                   "echo up; while true; do sleep 0.1; done"))[0].id
    rig.until(lambda: rig.state(jid) == "running" and pg_store.log_chunks(jid, 1), what="the job to run")
    pid = int(pidfile.read_text())
    assert _alive(pid)
    pg_store.request_cancel(jid, "ml")
    rig.until(lambda: rig.state(jid) == "cancelled", what="cancellation")
    assert not _alive(pid) and processes_of_uid(LO) == []


@root_only
def test_a_requeued_jobs_next_attempt_takes_over_the_checkpoint(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    script = ('if [ "$FEDBROKER_ATTEMPT" = 1 ]; then mkdir "$CHECKPOINT_DIR/sub"; echo step1 > "$CHECKPOINT_DIR/sub/c"; '
              'ln -s /etc/shadow "$CHECKPOINT_DIR/link"; sleep 30; '
              'else cat "$CHECKPOINT_DIR/sub/c"; echo step2 >> "$CHECKPOINT_DIR/sub/c"; echo "uid=$(id -u)"; fi')
    jid = pg_store.submit("ml", sh(script))[0].id
    rig.until(lambda: rig.state(jid) == "running" and any(rig.agents["n1"].jobs_root.glob("checkpoints/ml/*/link")),
              what="attempt 1 to write its checkpoint")
    Reconciler(pg_store, rig.settings).run(utcnow() + timedelta(seconds=rig.settings.node_lost_after_s + 1))
    rig.until(lambda: rig.state(jid) == "succeeded", timeout=30, what="attempt 2 to succeed")
    log = _log(pg_store, jid, 2)
    assert log.startswith("step1\nuid=")
    uid = int(log.split("uid=")[1])
    ckpt = rig.agents["n1"].jobs_root / "checkpoints" / "ml" / jid
    assert (ckpt / "sub" / "c").read_text() == "step1\nstep2\n"
    for p in (ckpt / "sub", ckpt / "sub" / "c", ckpt / "link"):
        assert os.lstat(p).st_uid == uid
    # the attempt ended: its directory went back to root (0700) until the job's next attempt
    rig.until(lambda: os.stat(ckpt).st_uid == 0, what="the checkpoint directory to be taken back")
    assert os.stat("/etc/shadow").st_uid == 0  # the symlink was not followed
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700


@root_only
def test_a_restarted_agent_keeps_its_attempts_uid(pg_store, rig, tmp_path):
    rig = rig({"n1": 2})
    a = pg_store.submit("ml", sh("id -u; sleep 2"))[0].id
    rig.until(lambda: rig.state(a) == "running", what="a to run")
    [att] = rig.agents["n1"].runtime.list()
    assert (att.uid, att.dynamic_uid) == (LO, True)
    rig.agents["n1"] = rig.new_agent("n1")  # the old agent is gone (as after kill -9)
    b = pg_store.submit("vision", sh("id -u"))[0].id
    rig.until(lambda: rig.state(b) == "succeeded" and rig.state(a) == "succeeded", timeout=30, what="both jobs")
    assert (_log(pg_store, a), _log(pg_store, b)) == (f"{LO}\n", f"{LO + 1}\n")


@root_only
def test_allocation_skips_ids_in_use_and_takes_over_stale_leases(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir(mode=0o711)
    lo = 2_000_000_000  # far from any real account
    rng = (lo, lo + 15)
    squatter = subprocess.Popen(["sleep", "30"], user=lo, group=lo, extra_groups=[])
    try:
        holder = tmp_path / "attempt-a"
        holder.mkdir()
        assert allocate_uid(rng, root, holder, used={lo + 1}) == lo + 2  # lo: a process; lo + 1: an attempt's
        assert json.loads((root / "uids" / str(lo + 2)).read_text()) == {"attempt_dir": str(holder)}
        assert allocate_uid(rng, root, tmp_path / "attempt-b", used={lo + 1}) == lo + 3  # lo + 2: leased
        # a lease whose attempt directory is gone is stale once older than STALE_LEASE_S
        old = time.time() - STALE_LEASE_S - 1
        os.utime(root / "uids" / str(lo + 3), (old, old))
        assert allocate_uid(rng, root, tmp_path / "attempt-c", used={lo + 1}) == lo + 3
        with pytest.raises(UidRangeExhausted, match=rf"jobs.uid_range=\[{lo}, {lo + 15}\]: every uid is held"):
            allocate_uid(rng, root, tmp_path / "x", used=set(range(lo, lo + 16)))
        assert kill_uid(lo) == 1
        assert squatter.wait(timeout=5) == -9
        assert allocate_uid(rng, root, tmp_path / "attempt-d", used={lo + 1}) == lo
    finally:
        squatter.kill()
        squatter.wait()


@root_only
def test_allocation_skips_uids_with_a_passwd_entry(tmp_path):
    nobody = pwd.getpwnam("nobody").pw_uid
    rng = (nobody - 3, nobody + 12)
    got = [allocate_uid(rng, tmp_path, tmp_path / f"a{i}") for i in range(4)]
    assert got == [nobody - 3, nobody - 2, nobody - 1, nobody + 1]  # never nobody's uid


@root_only
def test_kill_uid_kills_every_process_of_the_uid_and_no_other(tmp_path):
    uid = 2_100_000_000
    procs = [subprocess.Popen(["sh", "-c", "setsid sleep 1000 & sleep 1000"], user=uid, group=uid, extra_groups=[],
                              cwd="/")]
    other = subprocess.Popen(["sleep", "1000"], user=uid + 1, group=uid + 1, extra_groups=[], cwd="/")
    try:
        end = time.monotonic() + 5
        while len(processes_of_uid(uid)) < 3 and time.monotonic() < end:
            time.sleep(0.02)
        assert len(processes_of_uid(uid)) == 3  # sh, its sleep, the setsid sleep
        assert kill_uid(uid) == 3
        assert processes_of_uid(uid) == [] and other.poll() is None
        with pytest.raises(ValueError, match="uid=0"):
            kill_uid(0)
    finally:
        for p in (*procs, other):
            p.kill()
            p.wait()


@root_only
def test_hand_over_changes_owners_in_the_range_only_and_follows_no_link(tmp_path):
    ck = tmp_path / "ck"
    (ck / "d").mkdir(parents=True)
    rng = (61184, 65519)
    old, new = dynamic_user(61190), dynamic_user(61191)
    for p in (ck, ck / "d"):
        os.chown(p, old.uid, old.gid)
    (ck / "d" / "f").write_text("x")
    os.chown(ck / "d" / "f", old.uid, old.gid)
    target = tmp_path / "rootfile"
    target.write_text("root's")
    os.link(target, ck / "hard")  # planted hard link to a root-owned file
    theirs = tmp_path / "other-job"
    theirs.mkdir()
    (theirs / "model.pt").write_text("another job's")
    os.chown(theirs / "model.pt", 61195, 61195)  # owned by a uid of the range, as another job's file is
    os.link(theirs / "model.pt", ck / "planted")
    os.symlink(target, ck / "soft")
    os.lchown(ck / "soft", old.uid, old.gid)
    hand_over(ck, new, rng)
    assert [os.lstat(p).st_uid for p in (ck, ck / "d", ck / "d" / "f", ck / "soft")] == [new.uid] * 4
    assert os.stat(target).st_uid == 0
    assert os.stat(theirs / "model.pt").st_uid == 61195  # a file with two links is never handed over
    assert stat.S_IMODE(os.stat(ck).st_mode) == 0o700
    # released: the directory goes back to root, so the next job given that uid cannot enter it
    assert reclaim(ck) is True and (os.stat(ck).st_uid, stat.S_IMODE(os.stat(ck).st_mode)) == (0, 0o700)
    assert reclaim(ck / "soft") is False and os.lstat(ck / "soft").st_uid == new.uid


@pytest.mark.parametrize("value, message", [
    ([0, 100], "jobs.uid_range=[0, 100]: must lie within 1..2147483647 (uid 0 is root)"),
    ([100, 2 ** 31], "jobs.uid_range=[100, 2147483648]: must lie within 1..2147483647"),
    ([70000, 60000], "jobs.uid_range=[70000, 60000]: lo must be <= hi"),
    ([60000, 60014], "jobs.uid_range=[60000, 60014]: holds 15 ids, at least 16 needed"),
    ([60000], "jobs.uid_range=[60000]: must be [lo, hi], two integer uids"),
    ("60000-70000", "jobs.uid_range='60000-70000': must be [lo, hi], two integer uids"),
])
def test_settings_refuse_bad_uid_ranges(tmp_path, value, message):
    cfg = tmp_path / "f.yaml"
    cfg.write_text(yaml.safe_dump({"jobs": {"uid_range": value}}))
    with pytest.raises(SettingsError) as e:
        load_settings(cfg)
    assert message in str(e.value)


def test_settings_uid_range_default_is_systemds(tmp_path):
    cfg = tmp_path / "f.yaml"
    cfg.write_text(yaml.safe_dump({"jobs": {"uid_range": [100000, 100015]}}))
    assert load_settings(cfg).jobs.uid_range == (100000, 100015)
    assert BrokerSettings().jobs.uid_range == (61184, 65519)


def test_the_node_config_serves_the_uid_range_to_the_agent(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    rig.settings.jobs.uid_range = (100000, 100015)
    agent = rig.new_agent("n1")
    assert agent.api.config()["jobs"]["uid_range"] == [100000, 100015]
    agent.prepare()
    assert agent.jobs.uid_range == (100000, 100015)


@root_only
def test_release_removes_what_the_uid_left_in_shared_tmp_dirs_and_sysv_ipc(tmp_path):
    uid = 2_100_000_100
    root = tmp_path / "jobs"
    root.mkdir(mode=0o711)
    assert allocate_uid((uid, uid + 15), root, tmp_path / "a") == uid
    kept = Path(f"/tmp/fbk-kept-{uid}")
    kept.write_text("root's\n")
    os.chmod(kept, 0o666)
    run = dict(user=uid, group=uid, extra_groups=[], cwd="/", check=True)
    subprocess.run(["sh", "-c", f"echo x > /tmp/fbk-left-{uid}; mkdir /dev/shm/fbk-{uid}; echo y > /dev/shm/fbk-{uid}/f; "
                                f"ln -s {kept} /var/tmp/fbk-link-{uid}; echo z >> {kept}"], **run)
    ipc = shutil.which("ipcmk")
    shmid = None
    if ipc:
        out = subprocess.run([ipc, "-M", "4096"], capture_output=True, text=True, **run).stdout
        shmid = out.split()[-1]
    try:
        release_uid(uid, root)
        for p in (f"/tmp/fbk-left-{uid}", f"/dev/shm/fbk-{uid}", f"/var/tmp/fbk-link-{uid}"):
            assert not os.path.lexists(p)
        assert kept.read_text() == "root's\nz\n"  # the link's target and files of others stay
        if shmid is not None:
            assert not any(line.split()[1] == shmid for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:])
        assert not (root / "uids" / str(uid)).exists()
    finally:
        kept.unlink()
        if shmid is not None:
            subprocess.run(["ipcrm", "-m", shmid], capture_output=True)


@root_only
def test_a_setuid_file_gives_a_job_nothing(tmp_path):
    # a job that got uid A copied a binary and set its setuid bit; a later job (uid B, another team) runs it
    planted = tmp_path / "id"
    shutil.copy("/usr/bin/id", planted)
    os.chown(planted, LO + 40, LO + 40)
    os.chmod(planted, 0o6755)
    rt = ProcessRuntime(tmp_path / "state")
    user = dynamic_user(LO + 41)
    wd = tmp_path / "wd"
    wd.mkdir()
    os.chown(wd, user.uid, user.gid)
    k = AttemptKey("suid", 1)
    rt.launch(k, [str(planted), "-u"], env={"PATH": "/usr/bin:/bin"}, workdir=wd, user=user)
    end = time.monotonic() + 10
    while rt.get(k).status == "running" and time.monotonic() < end:
        time.sleep(0.02)
    assert rt.get(k).log_path.read_text() == f"{LO + 41}\n"  # not LO + 40: no_new_privs ignores the setuid bit
    rt.forget(k)


@root_only
def test_a_finished_jobs_checkpoint_goes_back_to_root_before_its_uid_is_given_again(pg_store, rig, tmp_path):
    rig = rig({"n1": 1})
    jid = pg_store.submit("ml", sh('echo secret > "$CHECKPOINT_DIR/model.pt"'))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="the job")
    ckpt = rig.agents["n1"].jobs_root / "checkpoints" / "ml" / jid
    rig.until(lambda: os.stat(ckpt).st_uid == 0, what="the checkpoint directory to be taken back")
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700
    # the next job gets the same (lowest free) uid and cannot enter it
    other = pg_store.submit("vision", sh(f'id -u; cat {ckpt}/model.pt || echo denied'))[0].id
    rig.until(lambda: rig.state(other) == "succeeded", what="the other job")
    out = _log(pg_store, other)
    assert out.startswith(f"{LO}\n") and out.endswith("denied\n") and "secret" not in out


def test_remove_tree_deletes_any_depth_and_never_follows_a_symlink(tmp_path):
    """Found by a hostile review: a job that made its working directory 2,019 directories deep made
    ``shutil.rmtree`` (recursive in Python 3.11) raise ``RecursionError``; the directory stayed behind."""
    from workers.isolation import remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    top = tmp_path / "wd"
    top.mkdir()
    root_fd = cur = os.open(top, os.O_RDONLY)
    for i in range(3000):  # deeper than the interpreter's recursion limit
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=nxt))
        if i == 10:
            os.symlink(str(outside), "link", dir_fd=nxt)
        if cur != root_fd:
            os.close(cur)
        cur = nxt
    os.close(cur)
    os.close(root_fd)
    (top / ".removing-1").mkdir()  # the names it moves directories up to, taken already
    (top / ".removing-2").mkdir()
    (top / ".removing-2" / "x").write_text("y")
    remove_tree(top)
    assert not top.exists()
    assert (outside / "keep").read_text() == "x"  # not followed
    remove_tree(top)  # missing: nothing to do
    link = tmp_path / "link"
    link.symlink_to(outside)
    remove_tree(link)  # a symlink is unlinked, its target left alone
    assert not link.exists() and (outside / "keep").exists()


@root_only
def test_a_uid_whose_working_directory_stays_behind_is_kept_leased(tmp_path):
    from workers.dynamic_users import _lease_live, allocate_uid, keep_leased

    leases, holder, left = tmp_path / "leases", tmp_path / "attempt", tmp_path / "leftover"
    holder.mkdir()
    left.mkdir()
    uid = allocate_uid((61184, 65519), leases, holder)
    keep_leased(uid, leases, left)
    holder.rmdir()  # the runtime forgot the attempt
    lease = leases / "uids" / str(uid)
    assert _lease_live(lease)
    assert allocate_uid((61184, 65519), leases, tmp_path) != uid
    left.rmdir()
    os.utime(lease, (0, 0))  # old, and its holder gone: stale
    assert not _lease_live(lease)
