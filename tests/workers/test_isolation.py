"""Job isolation (issue #9, item 1): a job sees none of the agent's secrets and never runs as root.

The exploit this guards against (commit 1f1d13d): the process runtime started every job with the
agent's whole environment, as the agent's user (root). A job that ran ``env; cat $FEDBROKER_CONFIG``
printed the admin token and the database URL with its password into its own log, and with that
URL minted itself an admin token.

These tests run real jobs through the production path (store, planning cycle, node agent, shim).
They need root (to drop a job to ``nobody``); they are skipped otherwise.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import stat
import time
from pathlib import Path

import pytest
import redis

from broker.service.settings import JobsSettings, load_settings, SettingsError
from providers.launch import SAFE_PATH
from tests.conftest import REDIS_URL
from tests.workers.rig import Rig, sh
from workers.isolation import JobUser, check_reachable, prepare_jobs_root, private_dir, resolve_job_user
from workers.runtime import AttemptKey, ProcessRuntime

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="dropping a job to another user needs root")
NOBODY = pwd.getpwnam("nobody")
DYN = 61184  # the first uid of the default jobs.uid_range
SECRET_TOKEN = "fbk_secret_token_4f1d9a"
SECRET_ADMIN = "fbk_admin_token_77c0e2"
SECRET_PW = "pw-9b3e1f"
SECRET_AWS = "AKIAEXAMPLESECRET0042"
# the keys of the shell's own variables that `env` may print besides the job's environment
SHELL_VARS = {"PWD", "SHLVL", "OLDPWD", "_"}


def _secrets_in_the_agent(monkeypatch, tmp_path: Path) -> Path:
    """The agent's environment as the README's order leaves it (token exported before `serve all`)."""
    config = tmp_path / "fedbroker.yaml"
    config.write_text(f"admin_token: {SECRET_ADMIN}\n"
                      f"database_url: postgresql+psycopg://fedbroker:{SECRET_PW}@db.internal:5432/fedbroker\n")
    os.chmod(config, 0o600)
    monkeypatch.setenv("FEDBROKER_TOKEN", SECRET_TOKEN)
    monkeypatch.setenv("FEDBROKER_DATABASE_URL", f"postgresql://u:{SECRET_PW}@db.internal/fedbroker")
    monkeypatch.setenv("FEDBROKER_CONFIG", str(config))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_AWS)
    return config


def _env_lines(log: str) -> dict[str, str]:
    """The ``env`` output at the top of the log (up to the ``uid=`` line) as a dict."""
    out = {}
    for line in log.split("uid=")[0].splitlines():
        k, _, v = line.partition("=")
        out[k] = v
    return out


@root_only
def test_a_job_sees_no_agent_secret_runs_as_its_own_uid_and_cannot_read_config_or_state(pg_store, env, tmp_path,
                                                                                   monkeypatch):
    rig = Rig(pg_store, env, tmp_path, {"n1": 2})
    config = _secrets_in_the_agent(monkeypatch, tmp_path)
    state_dir = Path(rig.settings.state_dir)
    script = (f'env; echo "uid=$(id -u) gid=$(id -g) groups=$(id -G)"; cat "$FEDBROKER_CONFIG"; cat {config}; '
              f'ls {state_dir}; ls {state_dir}/agents/n1/attempts; echo "pwd=$(pwd)"; '
              'echo ckpt > "$CHECKPOINT_DIR/c"; echo home > "$HOME/h"; cat "$CHECKPOINT_DIR/c" "$HOME/h"')
    jid = pg_store.submit("vision", sh(script))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="the job to end")
    log = "".join(t for _, t in pg_store.log_chunks(jid, 1))

    for secret in (SECRET_TOKEN, SECRET_ADMIN, SECRET_PW, SECRET_AWS, "db.internal", "admin_token"):
        assert secret not in log
    assert f"uid={DYN} gid={DYN} groups={DYN}\n" in log  # the first id of jobs.uid_range, no passwd entry
    assert "cat: '': No such file or directory\n" in log  # $FEDBROKER_CONFIG is not set for the job
    assert f"cat: {config}: Permission denied" in log
    assert f"ls: cannot open directory '{state_dir}': Permission denied" in log
    assert f"ls: cannot access '{state_dir}/agents/n1/attempts': Permission denied" in log
    assert log.endswith("ckpt\nhome\n")

    jobs = tmp_path / "jobs"
    workdir = jobs / "work" / "n1" / jid / "1-0"
    ckpt = jobs / "checkpoints" / "vision" / jid
    assert f"pwd={workdir}\n" in log
    # exactly the launch spec's variables, the runtime's own and the safe base; nothing of the agent's
    got = _env_lines(log)
    assert {k: v for k, v in got.items() if k not in SHELL_VARS} == {
        "PATH": SAFE_PATH, "HOME": str(workdir), "LANG": "C.UTF-8", "TZ": "UTC",
        "USER": f"fedbroker-{DYN}", "LOGNAME": f"fedbroker-{DYN}",
        "CUDA_VISIBLE_DEVICES": "0", "FEDBROKER_JOB_ID": jid, "FEDBROKER_ATTEMPT": "1", "FEDBROKER_RANK": "0",
        "NODE_RANK": "0", "NNODES": "1", "GPUS_PER_NODE": "1", "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "PET_NNODES": "1", "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "29500",
        "PET_RDZV_ID": f"{jid}-1", "CHECKPOINT_DIR": str(ckpt), "NCCL_DEBUG": "WARN",
        **({"NCCL_SOCKET_IFNAME": got["NCCL_SOCKET_IFNAME"]} if "NCCL_SOCKET_IFNAME" in got else {}),
    }
    # the checkpoint directory outlives the attempt: its files stay the job's, the directory goes back to root
    # (0700) once the attempt's uid is released; the working directory is gone
    assert (os.stat(ckpt / "c").st_uid, (ckpt / "c").read_text()) == (DYN, "ckpt\n")
    st = os.stat(ckpt)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)
    assert not workdir.exists()
    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700


@root_only
def test_each_team_runs_as_its_own_user(pg_store, env, tmp_path):
    daemon = pwd.getpwnam("daemon")
    rig = Rig(pg_store, env, tmp_path, {"n1": 1})
    # the API serves the agents their jobs settings (GET /v1/node/config); they ask on their first step
    rig.settings.jobs = JobsSettings(root=str(tmp_path / "jobs"), team_users={"vision": "daemon"})
    for a in rig.agents.values():
        a._config, a.jobs = None, None
    a = pg_store.submit("vision", sh("id -u"))[0].id
    rig.until(lambda: rig.state(a) == "succeeded", what="vision's job")
    b = pg_store.submit("ml", sh("id -u"))[0].id
    rig.until(lambda: rig.state(b) == "succeeded", what="ml's job")
    assert "".join(t for _, t in pg_store.log_chunks(a, 1)) == f"{daemon.pw_uid}\n"
    assert "".join(t for _, t in pg_store.log_chunks(b, 1)) == f"{DYN}\n"  # no mapping: a uid of its own


@root_only
def test_runtime_gives_exactly_the_given_environment_and_drops_to_the_user(tmp_path, monkeypatch):
    _secrets_in_the_agent(monkeypatch, tmp_path)
    rt = ProcessRuntime(tmp_path / "state")
    nobody = JobUser("nobody", NOBODY.pw_uid, NOBODY.pw_gid)
    wd = private_dir(tmp_path / "work" / "1-0", nobody)
    k = AttemptKey("envjob", 1)
    rt.launch(k, ["/bin/sh", "-c", f'env; echo "uid=$(id -u)"; echo x >> {rt.attempt_dir(k)}/log; '
                                   f'echo y > {rt.attempt_dir(k)}/exit.json'],
              env={"MY_VAR": "x y", "PATH": "/usr/bin:/bin"}, gpus=[1], workdir=wd, user=nobody)
    end = time.monotonic() + 10
    while rt.get(k).status == "running" and time.monotonic() < end:
        time.sleep(0.02)
    a = rt.get(k)
    log = a.log_path.read_text()
    assert {k_: v for k_, v in _env_lines(log).items() if k_ not in SHELL_VARS} == {
        "PATH": "/usr/bin:/bin", "HOME": str(wd), "LANG": "C.UTF-8", "TZ": "UTC", "MY_VAR": "x y",
        "CUDA_VISIBLE_DEVICES": "1", "FEDBROKER_JOB_ID": "envjob", "FEDBROKER_ATTEMPT": "1", "FEDBROKER_RANK": "0"}
    assert f"uid={NOBODY.pw_uid}\n" in log
    # the control files are out of the job's reach: it could neither append to the log by path nor fake its exit
    assert re.search(r"log: Permission denied", log) and re.search(r"exit\.json: Permission denied", log)
    assert (a.status, a.exit_code) == ("exited", 2)
    assert stat.S_IMODE(os.stat(rt.state_dir).st_mode) == 0o700
    for f in ("meta.json", "shim.json", "pid.json", "exit.json", "log"):
        assert os.stat(rt.attempt_dir(k) / f).st_uid == 0
    assert SECRET_TOKEN not in (rt.attempt_dir(k) / "meta.json").read_text()


def test_runtime_refuses_uid_0(tmp_path):
    rt = ProcessRuntime(tmp_path / "state")
    with pytest.raises(ValueError, match=r"jobs never run as root \(uid 0\)"):
        rt.launch(AttemptKey("r", 1), ["true"], workdir=tmp_path, user=JobUser("root", 0, 0))
    with pytest.raises(ValueError, match=r"user.uid must be an int >= 0, got -1"):
        rt.launch(AttemptKey("r", 1), ["true"], workdir=tmp_path, user=JobUser("x", -1, 0))


@pytest.mark.parametrize("field, value, message", [
    ("user", "root", "jobs.user='root': jobs never run as root (uid 0)"),
    ("user", "0", "jobs.user='0': jobs never run as root (uid 0)"),
    ("user", "a b", "jobs.user='a b': not a user name or numeric uid"),
    ("team_users", {"vision": "root"}, "jobs.team_users['vision']='root': jobs never run as root"),
    ("pool_users", {"local": "000"}, "jobs.pool_users['local']='000': jobs never run as root"),
    ("root", "relative/dir", "jobs.root='relative/dir': must be an absolute path"),
])
def test_settings_refuse_root_and_bad_values(tmp_path, field, value, message):
    cfg = tmp_path / "f.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump({"jobs": {field: value}}))
    with pytest.raises(SettingsError) as e:
        load_settings(cfg)
    assert message in str(e.value)


@root_only
def test_resolve_job_user_precedence_and_errors():
    daemon, bin_ = pwd.getpwnam("daemon"), pwd.getpwnam("bin")
    js = JobsSettings(user="bin", pool_users={"p": "daemon"}, team_users={"vision": str(NOBODY.pw_uid)})
    assert resolve_job_user(JobsSettings()) is None  # a per-attempt uid (workers.dynamic_users)
    assert resolve_job_user(js, "vision", "p") == JobUser("nobody", NOBODY.pw_uid, NOBODY.pw_gid)
    assert resolve_job_user(js, "ml", "p") == JobUser("daemon", daemon.pw_uid, daemon.pw_gid)
    assert resolve_job_user(js, "ml", "q") == JobUser("bin", bin_.pw_uid, bin_.pw_gid)
    with pytest.raises(ValueError, match=r"jobs.team_users\['ml'\]='no-such-user-x': no such user on this host"):
        resolve_job_user(JobsSettings(team_users={"ml": "no-such-user-x"}), "ml")
    toor = next((p for p in pwd.getpwall() if p.pw_uid == 0 and p.pw_name != "root"), None)
    if toor is not None:  # a second name of uid 0
        with pytest.raises(ValueError, match="is uid 0"):
            resolve_job_user(JobsSettings(user=toor.pw_name))


@root_only
def test_jobs_root_must_be_reachable_and_not_world_writable(tmp_path):
    nobody = JobUser("nobody", NOBODY.pw_uid, NOBODY.pw_gid)
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    os.chmod(hidden, 0o700)
    with pytest.raises(ValueError, match=rf"jobs.root='{hidden}/jobs': the job user 'nobody' \(uid {NOBODY.pw_uid}\) "
                                         rf"cannot reach it: {hidden} is mode 0700 owned by uid 0"):
        prepare_jobs_root(hidden / "jobs", [nobody])
    with pytest.raises(ValueError, match=rf"jobs.root='{tmp_path}': is mode 1777, writable by group or others"):
        prepare_jobs_root(tmp_path, [nobody])
    root = prepare_jobs_root(tmp_path / "jobs", [nobody])
    assert [stat.S_IMODE(os.stat(d).st_mode) for d in (root, root / "work", root / "checkpoints")] == [0o711] * 3
    check_reachable(root, nobody)


def test_agent_refuses_an_unknown_job_user_at_start(pg_store, tmp_path):
    from providers.nvml import FakeNvmlBackend
    from workers.agent import NodeAgent

    from workers.node_client import NodeClient

    config = {"node": "n1", "heartbeat_interval_s": 1.0, "cancel_grace_s": 1.0, "log_chunk_bytes": 65536,
              "log_max_bytes": 1 << 20, "jobs": {"root": str(tmp_path / "jobs"), "user": "no-such-user-x"}}
    agent = NodeAgent(NodeClient("http://127.0.0.1:9", "fbk_x"), "n1", "local", FakeNvmlBackend(gpu_count=1),
                      state_dir=tmp_path / "state", config=config)
    expect = ("jobs.user='no-such-user-x': no such user on this host" if os.geteuid() == 0
              else "jobs.user='no-such-user-x': no such user")
    with pytest.raises(ValueError, match=re.escape(expect)):
        agent.prepare()


def test_a_job_that_truncates_its_own_log_does_not_stop_supervision(pg_store, env, tmp_path):
    # the job's stdout is a pipe the shim copies into the log (the log file is capped): it cannot truncate it, and
    # nothing it does to its stdout stops supervision
    rig = Rig(pg_store, env, tmp_path, {"n1": 2})
    jid = pg_store.submit("ml", sh("echo first line; sleep 1.5; perl -e 'truncate(STDOUT, 0) or print \"kept\\n\"'; "
                                   "echo after; sleep 0.5"))[0].id
    rig.until(lambda: pg_store.log_chunks(jid, 1), what="the first line to be shipped")
    other = pg_store.submit("ml", sh("echo other"))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded" and rig.state(other) == "succeeded", what="both jobs to end")
    assert "".join(t for _, t in pg_store.log_chunks(jid, 1)) == "first line\nkept\nafter\n"
    assert "".join(t for _, t in pg_store.log_chunks(other, 1)) == "other\n"


# ---------------------------------------------------------------------------------------------- issue 20
#: the job's probe: one line per target, "<target> ok" or "<target> <error class>"
_PROBE = r'''
import socket, sys
for target in sys.argv[1:]:
    try:
        if target.startswith("/"):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(target)
        else:
            host, port = target.rsplit(":", 1)
            s = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
        s.close()
        print(target, "ok")
    except OSError as e:
        print(target, type(e).__name__)
'''


@root_only
@pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) is not installed; .ci/run installs it")
def test_a_job_cannot_reach_the_brokers_redis_or_database_but_other_ports(pg_store, env, tmp_path):
    """Finding #2 of issue 20: on cb5ea98 a job's socket to 127.0.0.1:6379 reached the password-less Redis (and
    ``SET fedbroker:planner-lock x EX 300`` stopped intake for 5 min). Now the agent's nftables table refuses the
    job's uid the broker's Redis and PostgreSQL, on every local address and over their UNIX sockets, while
    another port still connects (and root still reaches Redis). The agent's own API is refused to jobs too (a
    job's slow-loris on it filled the API's connection cap: heartbeats got 503 and the node was declared lost)."""
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    port = other.getsockname()[1]
    rig = Rig(pg_store, env, tmp_path, {"n1": 1})
    (tmp_path / "probe.py").write_text(_PROBE)
    os.chmod(tmp_path / "probe.py", 0o644)
    pg_socket = "/var/run/postgresql/.s.PGSQL.5432"
    api = f"127.0.0.1:{rig.api.port}"
    targets = ["127.0.0.1:6379", "127.0.0.1:5432", "[::1]:6379", api, f"127.0.0.1:{port}", pg_socket]
    script = (f"/usr/bin/python3 {tmp_path / 'probe.py'} {' '.join(targets)}; "
              "redis-cli -h 127.0.0.1 -p 6379 ping 2>&1; ls -A /var/run/postgresql | wc -l")
    jid = pg_store.submit("evil", sh(script))[0].id
    rig.until(lambda: rig.state(jid) == "succeeded", what="the probe job")
    log = "".join(t for _, t in pg_store.log_chunks(jid, 1))
    assert log == ("127.0.0.1:6379 ConnectionRefusedError\n127.0.0.1:5432 ConnectionRefusedError\n"
                   "[::1]:6379 ConnectionRefusedError\n"
                   f"{api} ConnectionRefusedError\n"
                   f"127.0.0.1:{port} ok\n"
                   f"{pg_socket} FileNotFoundError\n"
                   "Could not connect to Redis at 127.0.0.1:6379: Connection refused\n"
                   "0\n"), log
    assert redis.Redis.from_url(REDIS_URL).ping()  # root (the broker, the agent) is not matched
    assert os.path.exists(pg_socket)  # hidden from the job only
    table = rig.agents["n1"].guard.installed()
    assert f"meta skuid 61184-65519 tcp dport {{ 5432, 6379, {rig.api.port} }} fib daddr type local" in table
    guard = rig.agents["n1"].guard  # someone deletes the table (nft flush ruleset): the agent's check puts it back
    subprocess.run(["nft", "delete", "table", "inet", guard.table], check=True)
    assert guard.installed() is None
    assert rig.agents["n1"].keep_guard()
    assert f"meta skuid 61184-65519 tcp dport {{ 5432, 6379, {rig.api.port} }} fib daddr type local" in (
        guard.installed() or "")
    other.close()


@root_only
def test_a_job_cannot_see_another_jobs_processes(pg_store, env, tmp_path):
    """Issue 20 ("hide what is not yours"): on cb5ea98 a job read another team's job's ``/proc/<pid>/cmdline``
    (``VICTIM_SECRET_DATASET=s3://victim-private/data ...``). Now each job's ``/proc`` (hidepid=2, in a mount
    namespace of its own) lists its own uid's processes only; the host's ``/proc`` is unchanged."""
    rig = Rig(pg_store, env, tmp_path, {"n1": 2})
    victim = pg_store.submit("victim", sh("echo up; sleep 30; echo VICTIM_SECRET_DATASET=s3-victim-private"))[0].id
    rig.until(lambda: "up" in "".join(t for _, t in pg_store.log_chunks(victim, 1)), what="the victim job")
    seen_by_root = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).find("VICTIM_SECRET") >= 0]
    assert seen_by_root  # the test can fail: the secret is on the host's /proc
    evil = pg_store.submit("evil", sh("grep -a -l 'VICTIM[_]SECRET' /proc/[0-9]*/cmdline; "
                                      "echo pids=$(ls /proc | grep -c '^[0-9]'); grep -c hidepid /proc/mounts"))[0].id
    rig.until(lambda: rig.state(evil) in ("succeeded", "failed"), what="the evil job")
    log = "".join(t for _, t in pg_store.log_chunks(evil, 1))
    # only its own processes: sh, ls and grep of the pipeline at most (the victim's sleep is not there)
    assert "VICTIM" not in log and re.fullmatch(r"pids=[1-4]\n1\n", log), log
    assert "hidepid" not in Path("/proc/mounts").read_text()  # the host's /proc is left as it is
    pg_store.request_cancel(victim, "victim")
    rig.until(lambda: rig.state(victim) == "cancelled", what="the victim to be cancelled")


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


@root_only
def test_a_job_cannot_read_the_agents_credentials(pg_store, env, tmp_path):
    """Issue 20: the agent's node token must stay out of its jobs' reach. The agent here is this test process: its
    ``/proc/<pid>`` (environ, cmdline, open files) is not even listed in the job's ``/proc`` (hidepid=2), and the
    agent's state directory stays closed (mode 0700)."""
    rig = Rig(pg_store, env, tmp_path, {"n1": 1})
    me = os.getpid()
    state = rig.settings.state_dir
    jid = pg_store.submit("evil", sh(f"cat /proc/{me}/environ /proc/{me}/cmdline; ls /proc/{me}/fd; ls {state}"))[0].id
    rig.until(lambda: rig.state(jid) == "failed", what="the job to fail")
    log = "".join(t for _, t in pg_store.log_chunks(jid, 1))
    assert log == (f"cat: /proc/{me}/environ: No such file or directory\n"
                   f"cat: /proc/{me}/cmdline: No such file or directory\n"
                   f"ls: cannot access '/proc/{me}/fd': No such file or directory\n"
                   f"ls: cannot open directory '{state}': Permission denied\n"), log
    assert rig.tokens["n1"] not in log
