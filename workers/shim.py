"""The per-attempt supervisor ("shim") of the process runtime, like ``containerd-shim``.

Run as ``python -m workers.shim <attempt_dir>`` by :meth:`workers.runtime.ProcessRuntime.launch`.
It detaches (double fork, so it is nobody's child but init's and never lingers as
its launcher's zombie), spawns the job, waits for it and records its exit code on
disk, so that a node agent killed with ``kill -9`` loses neither the job nor its
exit code; a restarted agent re-adopts the attempt from the directory alone.

On-disk layout of one attempt directory (every JSON file is written whole:
temporary file + ``os.replace``, or ``os.link`` where it must not already exist):

``meta.json``   written by the launcher before the shim starts:
                ``{"job_id", "attempt", "rank", "argv": [str], "env": {str: str}
                (the job's whole environment), "gpus": [int], "workdir": str,
                "user": {"name", "uid", "gid", "dynamic"} or null, "started_at": POSIX s}``; mode 0600.
``log``         the job's stdout and stderr, appended (``O_APPEND``) in order written;
                the shim itself writes only the one line explaining a failed exec. With
                ``meta.json["log_max_bytes"]`` (the node agent always sets it) the job writes to a pipe
                the shim copies into ``log``, keeping the head and the tail of the output within that many
                bytes with a ``[fedbroker: ... N bytes dropped ...]`` line between them (the tail is written
                when the job's output ends, before ``exit.json``).
``shim.json``   ``{"pid", "start_ticks"}`` of the shim process (``start_ticks``:
                field 22 of ``/proc/<pid>/stat``, clock ticks after boot; ``None``
                without ``/proc``); identifies the shim even if its pid is reused.
``pid.json``    ``{"pid", "start_ticks", "spawned_at"}`` of the job process, which
                leads its own session and process group (pgid == pid).
``exit.json``   ``{"exit_code": int, "ended_at": POSIX s}``; ``exit_code`` is the
                job's exit status, ``128 + N`` if a signal N killed it, ``127`` if
                ``argv[0]`` (or ``workdir``) could not be executed.
``stop.json``   written by :meth:`~workers.runtime.ProcessRuntime.terminate`:
                ``{"reason", "requested_at", "grace_s", "kill_deadline"}`` (POSIX s).

Behaviour: the job is spawned without a shell, in a new session (its pid is its
process group id), stdin from ``/dev/null``, umask 077, with exactly the environment
``meta.json["env"]`` (nothing of the shim's own), and, when ``meta.json["user"]`` is
set and the shim runs as root, as that uid and primary gid with no supplementary
groups (``setgroups([])``, ``setgid``, ``setuid`` in the child just before
``exec``; the working directory is entered before, so it may sit below directories
the user cannot list); with ``meta.json["view"]`` (``{"hide": [paths], "private_proc": bool}``, the node agent
sets it) the job's child first enters :class:`workers.isolation.PrivateView` (its own mount namespace:
``/proc`` with ``hidepid=2``, the service sockets covered). The attempt directory stays owned by the shim's user (mode
0700): the job writes its log only through its stdout/stderr file descriptor and
cannot touch the control files (through that descriptor it can still truncate its own
log; the agent tolerates that). When the job process
exits the shim SIGKILLs whatever is left in its process group (stray
grandchildren that would keep holding GPUs) and, when the job has its own uid
(``user["dynamic"]``, :mod:`workers.dynamic_users`), every process of that uid
(one that left the group with ``setsid`` too) before it reaps it, then writes
``exit.json`` and exits 0. SIGTERM sent to the shim is forwarded to the job's
process group (the shim keeps waiting); SIGINT and SIGHUP are ignored.

If the shim itself is killed with SIGKILL, ``exit.json`` is never written and the
runtime reports the attempt ``"lost"``; the job process may keep running (it is
reparented to init; its output goes to ``log`` when written there directly, and through
a pipe its next write gets SIGPIPE).

Errors: none escape; a failure before the job is spawned is recorded as exit
code 127 with its message in ``log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from broker.log_marker import MARKER_MAX_BYTES, dropped_marker
from workers.isolation import PrivateView, no_new_privileges

META = "meta.json"
LOG = "log"
SHIM = "shim.json"
PID = "pid.json"
EXIT = "exit.json"
STOP = "stop.json"

EXEC_FAILED = 127
"""Exit code recorded when the job could not be executed (as a POSIX shell does)."""

__all__ = [
    "META", "LOG", "SHIM", "PID", "EXIT", "STOP", "EXEC_FAILED", "MARKER_RESERVE",
    "write_json_atomic", "read_json", "proc_stat", "proc_start_ticks", "main",
]


def write_json_atomic(path: Path, obj: object, *, exclusive: bool = False, mode: int = 0o644) -> bool:
    """Write ``obj`` as JSON to ``path`` whole: a reader sees the old file or the new one, never a part.

    Writes ``<dir>/.<name>.<pid>.tmp``, fsyncs it, then ``os.replace`` onto ``path``;
    with ``exclusive=True`` it uses ``os.link`` instead, so an existing ``path`` is
    left alone. Returns ``True`` if ``path`` now holds ``obj``, ``False`` only when
    ``exclusive`` and ``path`` already existed. Raises ``OSError`` on I/O failure.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or ``None`` if the file does not exist.

    Raises ``ValueError`` (naming the path) if it exists but is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state letter, start time in clock ticks after boot)`` of ``pid`` from ``/proc``.

    ``None`` if the process does not exist (or ``/proc`` is unavailable).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode("ascii"), int(fields[19])


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22); ``None`` if unknown."""
    st = proc_stat(pid)
    return None if st is None else st[1]


def _append_log(log_fd: int, text: str) -> None:
    os.write(log_fd, text.encode("utf-8", "replace"))


#: seconds the shim keeps draining the job's output pipe after the job exited (a process that escaped the job's
#: group may hold it open for ever)
DRAIN_AFTER_EXIT_S = 1.0


#: bytes of the log file :func:`_copy_capped` keeps free for the dropped-bytes marker
#: (:func:`broker.log_marker.dropped_marker`), so head + marker + tail stays under ``log_max_bytes`` and the agent
#: never cuts it
MARKER_RESERVE = MARKER_MAX_BYTES


def _copy_capped(read_fd: int, log_fd: int, cap: int, pid: int) -> None:
    """Copy the job's output from ``read_fd`` to ``log_fd`` keeping its head and its tail within ``cap`` bytes: the
    first ``cap - cap // 2 - MARKER_RESERVE`` bytes are written as they come; after them the last ``cap // 2`` bytes
    are held in memory (older ones are read and dropped, so the job is never blocked on a full pipe) and written
    at the end, after :func:`broker.log_marker.dropped_marker` of the bytes dropped when any were (the file then holds
    ``head + marker + tail`` < ``cap`` bytes: a crash's traceback is in the tail). Returns at end of file, or
    :data:`DRAIN_AFTER_EXIT_S` after job ``pid`` exited (not reaped), and closes ``read_fd``. A job writing at GB/s
    once filled the node's disk: its stdout was the log file itself, and the cap only bounded what the agent
    shipped; the cap then kept the head only, and the traceback was lost."""
    import select

    size = os.fstat(log_fd).st_size
    tail_keep = cap // 2
    head_end = max(cap - tail_keep - MARKER_RESERVE, 0)
    tail = bytearray()
    dropped = 0
    stop_at = None
    try:
        while True:
            if stop_at is None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                stop_at = time.monotonic() + DRAIN_AFTER_EXIT_S
            timeout = 0.1 if stop_at is None else stop_at - time.monotonic()
            if timeout < 0:
                return
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if not ready:
                continue
            data = os.read(read_fd, 65536)
            if not data:
                return  # every writer closed it
            head = max(head_end - size, 0)
            view = memoryview(data)[:head]
            while view:
                n = os.write(log_fd, view)
                size, view = size + n, view[n:]
            if len(data) > head:
                tail += data[head:]
                if len(tail) > tail_keep:
                    dropped += len(tail) - tail_keep
                    del tail[:len(tail) - tail_keep]
    finally:
        os.close(read_fd)
        out = (dropped_marker(dropped).encode() if dropped else b"") + bytes(tail)
        while out:
            out = out[os.write(log_fd, out):]


def _run(attempt_dir: Path) -> None:
    write_json_atomic(attempt_dir / SHIM, {"pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid())})
    log_fd = os.open(attempt_dir / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    child: list[int] = []  # the job's pid once spawned
    pending_term = [False]

    def on_term(signum, frame):  # forward to the job's process group
        if child:
            try:
                os.killpg(child[0], signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            pending_term[0] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    argv: list[str] = ["?"]
    try:
        meta = read_json(attempt_dir / META)
        if meta is None:
            raise FileNotFoundError(f"{attempt_dir / META} is missing")
        argv = list(meta["argv"])
        env = {str(k): str(v) for k, v in (meta.get("env") or {}).items()}
        drop: dict = {}
        user = meta.get("user")
        if user is not None and os.geteuid() == 0:
            drop = {"user": int(user["uid"]), "group": int(user["gid"]), "extra_groups": []}
        view = meta.get("view")  # a private mount namespace: entered as root, then the drop (workers.isolation)
        spawn = drop
        if drop and view is not None:
            spawn = {"preexec_fn": PrivateView(view.get("hide") or (), bool(view.get("private_proc")))
                     .then_drop_to(drop["user"], drop["group"])}
        cap = meta.get("log_max_bytes")
        out = log_fd
        if cap is not None:  # through a pipe the shim copies, so the file stops growing at the cap
            read_fd, out = os.pipe()
        no_new_privileges()  # inherited by the job: setuid files it meets give it nothing
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                cwd=meta.get("workdir"), start_new_session=True, close_fds=True, umask=0o077, **spawn,
            )
        finally:
            if out != log_fd:
                os.close(out)
    except Exception as exc:  # noqa: BLE001 - anything before the spawn is "cannot execute"
        _append_log(log_fd, f"fedbroker-shim: cannot execute {argv[0]!r}: {exc}\n")
        write_json_atomic(attempt_dir / EXIT, {"exit_code": EXEC_FAILED, "ended_at": time.time()})
        return

    pid = proc.pid
    write_json_atomic(attempt_dir / PID, {"pid": pid, "start_ticks": proc_start_ticks(pid), "spawned_at": time.time()})
    child.append(pid)
    # A terminate() that raced with the spawn (stop.json written before pid.json existed).
    if pending_term[0] or (attempt_dir / STOP).exists():
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    if cap is not None:
        _copy_capped(read_fd, log_fd, int(cap), pid)
    # Wait without reaping, so the process group id cannot be reused while we clean it up.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if drop and user.get("dynamic"):  # the attempt's own uid: whatever left the group (setsid) dies too
        from workers.dynamic_users import kill_uid

        try:
            kill_uid(drop["user"])
        except Exception as exc:  # noqa: BLE001 - the agent kills them again in forget()
            _append_log(log_fd, f"fedbroker-shim: cannot kill the processes left under uid {drop['user']}: {exc}\n")
    rc = proc.wait()
    exit_code = rc if rc >= 0 else 128 - rc
    write_json_atomic(attempt_dir / EXIT, {"exit_code": exit_code, "ended_at": time.time()})
    os.close(log_fd)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m workers.shim <attempt_dir>``, or ``python -m workers.shim --stdin`` (a spare
    shim started ahead: it reads its attempt directory as one line from stdin, and exits 0 at once on EOF).

    Returns (in the launching process, which exits at once after forking the
    detached shim) 0, or 2 if the argument is missing or not a directory.
    """
    args = sys.argv[1:] if argv is None else argv
    if args == ["--stdin"]:  # a spare shim (ProcessRuntime(spare_shim=True)): wait for its attempt directory
        import ctypes.util  # noqa: F401 - what _run's no_new_privileges() imports, loaded while idle

        line = sys.stdin.buffer.readline()
        if not line:
            return 0  # closed unused: the runtime is done
        args = [os.fsdecode(line.rstrip(b"\n"))]
    if len(args) != 1 or not os.path.isdir(args[0]):
        print(f"usage: python -m workers.shim <attempt_dir> (got {args!r})", file=sys.stderr)
        return 2
    attempt_dir = Path(args[0]).resolve()
    if os.fork() != 0:
        return 0  # the launcher reaps this intermediate process; the shim lives on below
    try:
        os.chdir("/")
        _run(attempt_dir)
    except BaseException:  # noqa: BLE001 - the shim has no stderr; leave a trace in the log
        import traceback

        try:
            with open(attempt_dir / LOG, "a", encoding="utf-8") as f:
                f.write("fedbroker-shim: internal error\n" + traceback.format_exc())
        finally:
            os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
