"""workers.runtime: real processes under a detached shim; exit codes, logs, env, stop, re-adoption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers.runtime import (
    AlreadyLaunched, AttemptKey, AttemptRunning, LaunchFailed, ProcessRuntime, ProcessRuntimeError,
    RuntimeError_, UnknownAttempt,
)
from workers.shim import SHIM, proc_stat

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


def py(code: str) -> list[str]:
    """argv running ``code`` (dedented) in a fresh Python."""
    return [PY, "-c", textwrap.dedent(code)]


def wait_for(pred, timeout: float = 5.0, every: float = 0.01, poll=None):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {pred}")
        if poll is not None:
            poll()
        time.sleep(every)


def wait_exit(rt: ProcessRuntime, key: AttemptKey, timeout: float = 5.0, poll: bool = False):
    wait_for(lambda: rt.get(key).status != "running", timeout, poll=rt.poll if poll else None)
    return rt.get(key)


def dead(pid: int) -> bool:
    st = proc_stat(pid)
    return st is None or st[0] in ("Z", "X")


@pytest.fixture(params=[False, True], ids=["fresh-shim", "spare-shim"])
def rt(tmp_path, request):
    """A runtime that starts a shim per launch, and one that hands each launch a spare shim started ahead."""
    runtime = ProcessRuntime(tmp_path / "state", spare_shim=request.param)
    yield runtime
    runtime.close()
    for a in runtime.list():  # never leave processes behind
        if a.pid is not None and not dead(a.pid):
            try:
                os.killpg(a.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ----------------------------------------------------------------------------- the spare shim
def test_a_launch_takes_the_spare_shim_and_starts_the_next(tmp_path):
    rt = ProcessRuntime(tmp_path / "state", spare_shim=True)
    try:
        first = rt._spare
        assert first is not None and first.poll() is None
        key = AttemptKey("job-00000000000000a1", 1, 0)
        rt.launch(key, ["/bin/sh", "-c", "exit 7"], workdir=tmp_path)
        assert first.wait(5) == 0  # the spare was the launcher: it forked the shim and left
        assert rt._spare is not None and rt._spare is not first and rt._spare.poll() is None
        assert wait_exit(rt, key).exit_code == 7
    finally:
        rt.close()
    assert rt._spare is None and first.returncode == 0


def test_after_close_or_with_a_dead_spare_a_launch_starts_its_own_shim(tmp_path):
    rt = ProcessRuntime(tmp_path / "state", spare_shim=True)
    spare = rt._spare
    spare.kill()
    spare.wait(5)
    k1 = AttemptKey("job-00000000000000b1", 1, 0)
    rt.launch(k1, ["/bin/true"], workdir=tmp_path)
    assert wait_exit(rt, k1).exit_code == 0
    rt.close()
    assert rt._spare is None
    k2 = AttemptKey("job-00000000000000b2", 1, 0)
    rt.launch(k2, ["/bin/sh", "-c", "exit 3"], workdir=tmp_path)
    assert wait_exit(rt, k2).exit_code == 3 and rt._spare is None


def test_a_spare_shim_takes_a_state_directory_whose_name_is_not_utf8(tmp_path):
    rt = ProcessRuntime(tmp_path / os.fsdecode(b"st\xffate"), spare_shim=True)
    try:
        spare = rt._spare
        key = AttemptKey("job-00000000000000c1", 1, 0)
        rt.launch(key, ["/bin/sh", "-c", "exit 5"], workdir=tmp_path)
        assert spare.wait(5) == 0  # the spare took it (no fall-back)
        assert wait_exit(rt, key).exit_code == 5
    finally:
        rt.close()


def test_the_spare_shim_exits_when_its_runtime_process_is_killed(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, sys
        from workers.runtime import ProcessRuntime
        rt = ProcessRuntime({str(tmp_path / "state")!r}, spare_shim=True)
        print(rt._spare.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         cwd=Path(__file__).resolve().parents[2])
    pid = int(out.stdout.split()[0])
    wait_for(lambda: dead(pid), 10)


def test_exit_codes_are_exact(rt):
    k0, k3 = AttemptKey("job-a", 1), AttemptKey("job-b", 2, rank=1)
    a0 = rt.launch(k0, py("import sys; sys.exit(0)"))
    rt.launch(k3, py("import sys; sys.exit(3)"))
    assert a0.key == k0 and a0.pid is not None and a0.gpus == ()
    e0, e3 = wait_exit(rt, k0), wait_exit(rt, k3)
    assert (e0.status, e0.exit_code, e0.stop_requested) == ("exited", 0, None)
    assert (e3.status, e3.exit_code) == ("exited", 3)
    assert e3.started_at <= e3.ended_at <= time.time()
    assert rt.attempt_dir(k3) == rt.state_dir / "attempts" / "job-b" / "2-1"
    assert [a.key for a in rt.list()] == [k0, k3]


def test_log_holds_stdout_and_stderr_in_order(rt):
    k = AttemptKey("logs", 1)
    rt.launch(k, py("""
        import sys
        print("out line", flush=True)
        print("err line", file=sys.stderr, flush=True)
        print("out again", flush=True)
    """))
    a = wait_exit(rt, k)
    assert a.exit_code == 0
    assert a.log_path.read_bytes() == b"out line\nerr line\nout again\n"


def test_the_log_file_stops_at_log_max_bytes_and_the_job_is_not_blocked(rt):
    """Found by a hostile review: a job writing 1.5 GB made a 1.5 GB log file on the node (the cap only bounded what
    the agent shipped): one job could fill the node's disk for every team."""
    k = AttemptKey("big", 1)
    rt.launch(k, py("""
        import os, sys
        print("first", flush=True)
        block = b"x" * (1 << 20)
        for _ in range(64):  # 64 MiB, far over the cap; never blocked on a full pipe
            os.write(1, block)
        print("done", file=sys.stderr, flush=True)
    """), log_max_bytes=4096)
    a = wait_exit(rt, k, timeout=30)
    assert a.exit_code == 0
    data = a.log_path.read_bytes()
    # the head (4096 - 2048 - 64 reserved for the marker = 1984 bytes), the marker, the tail (2048 bytes, with the
    # last line: a crash's traceback is kept); 6 + 64 MiB + 5 bytes written, 67,104,843 of them dropped
    assert data == (b"first\n" + b"x" * 1978 + b"\n[fedbroker: ... 67104843 bytes dropped ...]\n"
                    + b"x" * 2043 + b"done\n")
    assert len(data) == 4077 < 4096


def test_a_log_under_the_cap_is_kept_whole(rt):
    k = AttemptKey("small", 1)
    rt.launch(k, py("""
        import os
        os.write(1, b"a" * 3000 + b"\\nend\\n")
    """), log_max_bytes=4096)
    a = wait_exit(rt, k, timeout=30)
    assert a.exit_code == 0 and a.log_path.read_bytes() == b"a" * 3000 + b"\nend\n"


def test_a_job_that_exits_while_an_escaped_child_holds_its_output_still_ends(rt):
    """The shim drains the pipe for DRAIN_AFTER_EXIT_S after the job exits, then stops (a child in its own session
    may hold the pipe open for ever)."""
    k = AttemptKey("escape", 1)
    rt.launch(k, py("""
        import os, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: print('x', flush=True); time.sleep(0.05)"],
                         start_new_session=True)
        print("parent done", flush=True)
    """), log_max_bytes=1 << 20)
    a = wait_exit(rt, k, timeout=10)
    assert a.exit_code == 0 and a.log_path.read_bytes().startswith(b"parent done\n")
    rt.forget(k)


def test_a_bad_log_max_bytes_claims_nothing(rt):
    k = AttemptKey("badcap", 1)
    with pytest.raises(ValueError, match="log_max_bytes must be an int >= 1, got 0"):
        rt.launch(k, py("pass"), log_max_bytes=0)
    assert not rt.attempt_dir(k).exists()


def test_child_sees_gpus_ids_env_and_workdir(rt, tmp_path):
    out = tmp_path / "env.json"
    code = f"""
        import json, os
        keys = ["CUDA_VISIBLE_DEVICES", "FEDBROKER_JOB_ID", "FEDBROKER_ATTEMPT", "FEDBROKER_RANK", "MY_VAR"]
        d = {{k: os.environ.get(k) for k in keys}}
        d["cwd"] = os.getcwd()
        d["has_path"] = "PATH" in os.environ
        open({str(out)!r}, "w").write(json.dumps(d))
    """
    k = AttemptKey("envjob", 4, rank=2)
    a = rt.launch(k, py(code), env={"MY_VAR": "x y"}, gpus=[1, 3], workdir=tmp_path)
    assert a.gpus == (1, 3)
    assert wait_exit(rt, k).exit_code == 0
    assert json.loads(out.read_text()) == {
        "CUDA_VISIBLE_DEVICES": "1,3", "FEDBROKER_JOB_ID": "envjob", "FEDBROKER_ATTEMPT": "4",
        "FEDBROKER_RANK": "2", "MY_VAR": "x y", "cwd": str(tmp_path.resolve()), "has_path": True,
    }
    k2 = AttemptKey("envjob", 5)
    rt.launch(k2, py(code))
    assert wait_exit(rt, k2).exit_code == 0
    assert json.loads(out.read_text())["CUDA_VISIBLE_DEVICES"] == ""
    meta = json.loads((rt.attempt_dir(k) / "meta.json").read_text())
    assert (meta["argv"], meta["gpus"]) == (py(code), [1, 3])
    assert meta["started_at"] == a.started_at


def test_duplicate_launch_never_starts_a_second_process(rt, tmp_path):
    counter = tmp_path / "count"
    argv = py(f"open({str(counter)!r}, 'a').write('x\\n')")
    k = AttemptKey("dup", 1)
    rt.launch(k, argv)
    with pytest.raises(AlreadyLaunched, match="'dup/1-0' was already launched"):
        rt.launch(k, argv)
    assert wait_exit(rt, k).exit_code == 0
    with pytest.raises(AlreadyLaunched):
        rt.launch(k, argv)  # also after it exited, until forget()
    time.sleep(0.2)
    assert counter.read_text() == "x\n"
    assert len(rt.list()) == 1
    assert issubclass(AlreadyLaunched, ValueError) and issubclass(AlreadyLaunched, RuntimeError_)


def test_terminate_sigterm_trapped_exits_zero_within_grace(rt):
    k = AttemptKey("graceful", 1)
    rt.launch(k, py("""
        import signal, sys, time
        def bye(*_):
            print("checkpointed", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
    """))
    wait_for(lambda: b"ready" in rt.read_log(k, 0, 100)[0])
    rt.terminate(k, grace_s=5.0)
    a = wait_exit(rt, k, poll=True)
    assert (a.status, a.exit_code, a.stop_requested) == ("exited", 0, "cancel")
    assert a.log_path.read_bytes() == b"ready\ncheckpointed\n"
    stop = json.loads((rt.attempt_dir(k) / "stop.json").read_text())
    assert stop["kill_deadline"] == stop["requested_at"] + 5.0
    rt.terminate(k, grace_s=1.0, reason="preempt")  # after exit: no-op
    assert rt.get(k).stop_requested == "cancel"


def test_sigterm_ignored_gets_sigkill_from_poll_after_grace(rt):
    k = AttemptKey("stubborn", 1)
    rt.launch(k, py("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
    """))
    wait_for(lambda: rt.read_log(k, 0, 100)[0] == b"ready\n")
    t0 = time.time()
    rt.terminate(k, grace_s=0.3, reason="preempt")
    deadline = json.loads((rt.attempt_dir(k) / "stop.json").read_text())["kill_deadline"]
    rt.terminate(k, grace_s=30.0, reason="cancel")  # idempotent: neither reason nor deadline change
    assert json.loads((rt.attempt_dir(k) / "stop.json").read_text())["kill_deadline"] == deadline
    rt.poll()
    time.sleep(0.1)
    assert rt.get(k).status == "running"  # SIGTERM ignored, grace not over
    a = wait_exit(rt, k, timeout=3.0, poll=True)
    assert (a.status, a.exit_code, a.stop_requested) == ("exited", 137, "preempt")
    assert a.ended_at - t0 >= 0.3


def test_missing_executable_is_127_with_message_in_log(rt):
    k = AttemptKey("nope", 1)
    a = rt.launch(k, ["/nonexistent/prog", "--flag"])
    a = wait_exit(rt, k)
    assert (a.status, a.exit_code, a.pid) == ("exited", 127, None)
    assert a.log_path.read_bytes() == (
        b"fedbroker-shim: cannot execute '/nonexistent/prog': "
        b"[Errno 2] No such file or directory: '/nonexistent/prog'\n"
    )


LAUNCHER = """
import sys
from pathlib import Path
from workers.runtime import AttemptKey, ProcessRuntime
rt = ProcessRuntime(Path(sys.argv[1]))
a = rt.launch(AttemptKey("survivor", 1), [sys.executable, "-c", "import time, sys; time.sleep(0.8); sys.exit(5)"])
print(a.pid, flush=True)
import time
time.sleep(60)
"""


def test_job_survives_launcher_kill9_and_is_readopted(tmp_path):
    state = tmp_path / "state"
    launcher = subprocess.Popen([PY, "-c", LAUNCHER, str(state)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        pid = int(launcher.stdout.readline())
    finally:
        launcher.kill()  # SIGKILL
        launcher.wait()
        launcher.stdout.close()
    assert launcher.returncode == -signal.SIGKILL
    rt = ProcessRuntime(state)  # a restarted agent
    [a] = rt.list()
    assert (a.key, a.status, a.pid) == (AttemptKey("survivor", 1), "running", pid)
    a = wait_exit(rt, a.key, timeout=5.0)
    assert (a.status, a.exit_code) == ("exited", 5)


def test_shim_kill9_reports_lost_and_terminate_still_stops_the_job(rt):
    k = AttemptKey("orphan", 1)
    a = rt.launch(k, py("""
        import time
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
    """))
    wait_for(lambda: rt.read_log(k, 0, 100)[0] == b"ready\n")
    shim_pid = json.loads((rt.attempt_dir(k) / SHIM).read_text())["pid"]
    os.kill(shim_pid, signal.SIGKILL)
    lost = wait_for(lambda: (g := rt.get(k)).status == "lost" and g)
    assert (lost.exit_code, lost.pid) == (None, a.pid)
    assert not dead(a.pid)  # the job itself keeps running, reparented
    rt.terminate(k, grace_s=1.0)
    wait_for(lambda: dead(a.pid), timeout=2.0)
    g = rt.get(k)
    assert (g.status, g.stop_requested) == ("lost", "cancel")
    rt.poll()  # past no deadline yet; nothing to do, nothing raised
    rt.forget(k)  # a lost attempt may be forgotten
    with pytest.raises(UnknownAttempt):
        rt.get(k)


def test_read_log_offsets(rt):
    k = AttemptKey("bytes", 1)
    rt.launch(k, py("import sys; sys.stdout.write('abcdefghij')"))
    wait_exit(rt, k)
    assert rt.read_log(k, 0, 4) == (b"abcd", 4)
    assert rt.read_log(k, 4, 4) == (b"efgh", 8)
    assert rt.read_log(k, 8, 100) == (b"ij", 10)
    assert rt.read_log(k, 10, 5) == (b"", 10)
    with pytest.raises(ValueError, match="offset 11 is past the end of the log"):
        rt.read_log(k, 11, 5)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1, got 0"):
        rt.read_log(k, 0, 0)
    with pytest.raises(ValueError, match="offset must be an int >= 0, got -1"):
        rt.read_log(k, -1, 5)


def test_forget_refuses_running_then_deletes(rt):
    k = AttemptKey("fg", 1)
    rt.launch(k, py("import sys; sys.stdin.read(); import time; time.sleep(0.3)"))
    with pytest.raises(AttemptRunning, match="'fg/1-0' is still running"):
        rt.forget(k)
    assert wait_exit(rt, k).exit_code == 0
    rt.forget(k)
    assert not (rt.state_dir / "attempts" / "fg").exists()
    with pytest.raises(UnknownAttempt) as ei:
        rt.get(k)
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, ProcessRuntimeError)
    assert str(ei.value).startswith("no attempt 'fg/1-0'")
    rt.launch(k, py("pass"))  # forgotten keys may be launched again
    assert wait_exit(rt, k).exit_code == 0


def test_bad_input_names_field_and_claims_nothing(rt, tmp_path):
    with pytest.raises(ValueError, match=r"job_id .* got 'a/b'"):
        AttemptKey("a/b", 1)
    with pytest.raises(ValueError, match="attempt must be an int >= 0, got -1"):
        AttemptKey("a", -1)
    with pytest.raises(ValueError, match="rank must be an int >= 0, got True"):
        AttemptKey("a", 1, True)
    k = AttemptKey("bad", 1)
    with pytest.raises(ValueError, match=r"argv must be a non-empty list of str, got \[\]"):
        rt.launch(k, [])
    with pytest.raises(ValueError, match="argv must be a non-empty list of str, got 'ls'"):
        rt.launch(k, "ls")
    with pytest.raises(ValueError, match=r"env\['CUDA_VISIBLE_DEVICES'\] is set by the runtime"):
        rt.launch(k, ["true"], env={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match=r"gpus must not repeat an index, got \[1, 1\]"):
        rt.launch(k, ["true"], gpus=[1, 1])
    with pytest.raises(ValueError, match=r"gpus\[0\] must be an int >= 0, got -2"):
        rt.launch(k, ["true"], gpus=[-2])
    with pytest.raises(ValueError, match="workdir must be an existing directory"):
        rt.launch(k, ["true"], workdir=tmp_path / "missing")
    assert rt.list() == []
    with pytest.raises(UnknownAttempt):
        rt.terminate(k, 1.0)
    rt.launch(k, py("pass"))
    with pytest.raises(ValueError, match="grace_s must be a finite number of seconds >= 0, got -1"):
        rt.terminate(k, -1)
    with pytest.raises(ValueError, match="reason must be a non-empty str, got ''"):
        rt.terminate(k, 1.0, reason="")
    assert wait_exit(rt, k).exit_code == 0
    assert issubclass(LaunchFailed, ProcessRuntimeError)


def test_a_listing_from_another_thread_never_sees_a_launching_or_ending_attempt_as_lost(rt):
    """The agent's supervisor lists attempts while its dispatch thread launches them; a
    transient "lost" there once made the agent requeue a job that was running (it ran twice)."""
    import threading

    seen: list[str] = []
    stop = threading.Event()

    def lister():
        while not stop.is_set():
            seen.extend(a.status for a in rt.list())

    t = threading.Thread(target=lister)
    t.start()
    try:
        keys = [AttemptKey(f"job-{i:016x}", 1) for i in range(8)]
        for k in keys:
            rt.launch(k, ["/bin/true"])
        for k in keys:
            wait_exit(rt, k)
    finally:
        stop.set()
        t.join()
    assert "lost" not in seen
    assert {"running", "exited"} <= set(seen)


def test_a_relative_state_dir_works_because_the_shim_runs_from_root(tmp_path, monkeypatch):
    """`fedbroker serve agent` defaults to state_dir ".fedbroker": the detached shim
    (cwd "/") once got a relative attempt path it could not find and every launch failed."""
    monkeypatch.chdir(tmp_path)
    rt = ProcessRuntime(Path("rel-state"))
    k = AttemptKey("job-00000000000000aa", 1)
    rt.launch(k, ["/bin/sh", "-c", "exit 4"])
    assert wait_exit(rt, k).exit_code == 4


def test_private_view_paths_must_be_absolute(tmp_path):
    rt = ProcessRuntime(tmp_path / "state")
    with pytest.raises(ValueError, match=r"private_view: 'run/redis' is not an absolute path"):
        rt.launch(AttemptKey("job-1", 1, 0), ["/bin/true"], workdir=tmp_path, private_view=["run/redis"])
    assert not rt.attempt_dir(AttemptKey("job-1", 1, 0)).exists()  # nothing claimed
