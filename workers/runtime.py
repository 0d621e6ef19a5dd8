"""Process runtime of the node agent: job attempts as supervised OS processes on this host.

Each attempt runs as a real process tree under a small detached supervisor,
:mod:`workers.shim` (like ``containerd-shim``). Everything about an attempt lives
in its directory ``<state_dir>/attempts/<job_id>/<attempt>-<rank>/`` (layout in
:mod:`workers.shim`), so the agent holds no state the runtime needs: an agent
killed with ``kill -9`` loses neither the job nor its exit code, and a fresh
:class:`ProcessRuntime` on the same ``state_dir`` re-adopts every attempt
(:meth:`ProcessRuntime.list`).

Statuses (:attr:`LocalAttempt.status`):

* ``"running"`` — the shim is alive and has not recorded an exit (this includes
  the first :data:`LAUNCH_TIMEOUT_S` seconds after launch, before the shim has
  written its pid).
* ``"exited"`` — the shim recorded the exit code (``128 + N`` for signal N, 127
  when the program could not be executed).
* ``"lost"`` — the shim is gone and no exit code was written (someone
  ``kill -9``-ed the shim, or the host rebooted). The job process may **still be
  running**, reparented to init; :meth:`ProcessRuntime.terminate` and
  :meth:`ProcessRuntime.poll` still signal its process group (after checking
  that the pid was not reused), but its exit code can never be known.

Times are POSIX seconds (UTC, wall clock ``time.time()``), so kill deadlines
survive an agent restart. Linux only (``/proc`` identifies processes across pid
reuse; ``os.waitid``).

Errors (all derive from :class:`ProcessRuntimeError`, alias ``RuntimeError_``)::

    ProcessRuntimeError(Exception)
     +-- AlreadyLaunched(ValueError)   the attempt directory already exists
     +-- UnknownAttempt(ValueError, KeyError)   no such attempt directory
     +-- AttemptRunning(ValueError)    forget() of an attempt that is still running
     +-- LaunchFailed                  the shim did not start (or not in time)

Bad arguments raise plain ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from providers.launch import RUNTIME_OWNED_ENV, SAFE_PATH, base_environment
from workers import shim as _shim
from workers.shim import EXIT, LOG, META, PID, SHIM, STOP, proc_stat, read_json, write_json_atomic

if TYPE_CHECKING:
    from workers.isolation import JobUser

__all__ = [
    "AttemptKey", "LocalAttempt", "ProcessRuntime", "ProcessRuntimeError", "RuntimeError_",
    "AlreadyLaunched", "UnknownAttempt", "AttemptRunning", "LaunchFailed", "LAUNCH_TIMEOUT_S",
]

LAUNCH_TIMEOUT_S = 10.0
"""Seconds :meth:`ProcessRuntime.launch` waits for the shim to report the job's pid."""

_RESERVED_ENV = RUNTIME_OWNED_ENV
#: the shim's own environment: not the agent's (which holds the broker's secrets)
_SHIM_ENV = {"PATH": SAFE_PATH, "LANG": "C.UTF-8"}
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the directory holding the ``workers`` package


def _popen_shim(arg: str, stdin) -> subprocess.Popen:
    """``python -m workers.shim <arg>`` (an attempt directory, or ``--stdin``) in a session of its own, with
    only :data:`_SHIM_ENV`, from the package's directory. Raises ``OSError``."""
    return subprocess.Popen(
        [sys.executable, "-m", "workers.shim", arg],
        stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, cwd=_PACKAGE_ROOT, env=_SHIM_ENV,
    )


class ProcessRuntimeError(Exception):
    """Base of every error the process runtime raises on purpose (besides argument ``ValueError``)."""


RuntimeError_ = ProcessRuntimeError


class AlreadyLaunched(ProcessRuntimeError, ValueError):
    """:meth:`ProcessRuntime.launch` found the attempt directory already claimed; nothing was started."""


class UnknownAttempt(ProcessRuntimeError, ValueError, KeyError):
    """No attempt directory for the key (never launched here, or forgotten). Also a ``KeyError``."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AttemptRunning(ProcessRuntimeError, ValueError):
    """:meth:`ProcessRuntime.forget` refused: the attempt is still running."""


class LaunchFailed(ProcessRuntimeError):
    """The shim could not be started, died before spawning the job, or did not report the job's pid
    within :data:`LAUNCH_TIMEOUT_S`. The attempt directory stays claimed (see :meth:`ProcessRuntime.get`)."""


def _check_int(field: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class AttemptKey:
    """One attempt of one job on this host: ``(job_id, attempt, rank)``.

    ``job_id``: non-empty str usable as one path component (no ``/``, NUL, not
    ``.``/``..``, at most 200 characters); ``attempt`` and ``rank``: ints >= 0
    (``rank`` = node rank in a multi-node gang, 0 otherwise). Directory name
    (:attr:`dirname`): ``f"{job_id}/{attempt}-{rank}"``.

    Raises ``ValueError`` naming the field for any other value.
    """

    job_id: str
    attempt: int
    rank: int = 0

    def __post_init__(self) -> None:
        j = self.job_id
        if (not isinstance(j, str) or not j or j in (".", "..") or "/" in j or "\x00" in j
                or len(j) > 200 or j.startswith(".")):
            raise ValueError(f"job_id must be a non-empty path component (no '/', NUL, leading '.'), got {j!r}")
        _check_int("attempt", self.attempt)
        _check_int("rank", self.rank)

    @property
    def dirname(self) -> str:
        """Relative attempt directory, ``f"{job_id}/{attempt}-{rank}"``."""
        return f"{self.job_id}/{self.attempt}-{self.rank}"


@dataclass(frozen=True)
class LocalAttempt:
    """What the runtime knows about one attempt, read from its directory.

    ``status``: ``"running" | "exited" | "lost"`` (module docstring);
    ``exit_code``: the process exit status, ``128 + N`` if killed by signal N,
    127 if it could not be executed, ``None`` unless ``"exited"``;
    ``pid``: the job process's pid (== its process group id), ``None`` before it
    was spawned or if it never was; ``log_path``: its stdout + stderr;
    ``started_at`` / ``ended_at``: POSIX seconds (launch time / exit recorded);
    ``stop_requested``: the ``reason`` given to :meth:`ProcessRuntime.terminate`;
    ``gpus``: the GPU indices in its ``CUDA_VISIBLE_DEVICES``; ``argv``: its command;
    ``uid``: the uid it runs as (``None``: the caller's own); ``dynamic_uid``: that uid is
    its own (:mod:`workers.dynamic_users`), held until :meth:`ProcessRuntime.forget`.
    """

    key: AttemptKey
    status: str
    exit_code: int | None
    pid: int | None
    log_path: Path
    started_at: float
    ended_at: float | None
    stop_requested: str | None
    gpus: tuple[int, ...]
    argv: tuple[str, ...] = ()
    uid: int | None = None
    dynamic_uid: bool = False


def _is_alive(info: dict | None) -> bool:
    """Whether the process recorded as ``{"pid", "start_ticks"}`` still exists and is not a zombie."""
    if not info or not isinstance(info.get("pid"), int):
        return False
    st = proc_stat(info["pid"])
    if st is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc: best effort
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, ticks = st
    if info.get("start_ticks") is not None and ticks != info["start_ticks"]:
        return False  # the pid was reused
    return state not in ("Z", "X")


def _signal_group(info: dict | None, sig: int) -> bool:
    """Send ``sig`` to the process group led by the recorded job pid; ``True`` if delivered.

    Skips the signal if a process with that pid exists but started at another
    time (the pid was reused by someone else). If the leader is gone but members
    of its group remain, they are still signalled (a group id cannot be reused
    while the group exists).
    """
    if not info or not isinstance(info.get("pid"), int):
        return False
    pid = info["pid"]
    st = proc_stat(pid)
    if st is not None and info.get("start_ticks") is not None and st[1] != info["start_ticks"]:
        return False
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _kill_dynamic_uid(meta: dict | None) -> None:
    """SIGKILL every process of the attempt's own uid (``meta["user"]["dynamic"]``); nothing for a shared user."""
    user = (meta or {}).get("user") or {}
    if user.get("dynamic") and os.geteuid() == 0 and int(user.get("uid", 0)) > 0:
        from workers.dynamic_users import kill_uid

        kill_uid(int(user["uid"]))


class ProcessRuntime:
    """Launch, watch, stop and forget job attempts as supervised local processes.

    ``state_dir``: directory (created if missing) under which attempts live in
    ``state_dir/"attempts"``. Several :class:`ProcessRuntime` objects (in one or
    several processes) may share a ``state_dir``; the directory is the only state.
    """

    def __init__(self, state_dir: Path, spare_shim: bool = False):
        self.state_dir = Path(state_dir).resolve()  # the detached shim runs with cwd "/"
        self.attempts_dir = self.state_dir / "attempts"
        self.attempts_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # control files and logs: no job user may read or write them
        #: with ``spare_shim``, one shim interpreter is kept started and waiting for its attempt directory on
        #: stdin (``python -m workers.shim --stdin``): a launch hands it over instead of starting Python
        #: (~0.1 s idle, several times that on a loaded host) and starts the next spare. It exits when
        #: its stdin closes (:meth:`close`, or this process ending, even by SIGKILL).
        self.spare_shim = spare_shim
        self._spare: subprocess.Popen | None = None
        self._spare_lock = threading.Lock()
        if spare_shim:
            self._start_spare()

    def _start_spare(self) -> None:
        """Start the next spare shim (no error: a launch without one starts its shim itself)."""
        try:
            self._spare = _popen_shim("--stdin", subprocess.PIPE)
        except OSError:
            self._spare = None

    def _start_shim(self, adir: Path) -> subprocess.Popen:
        """The shim of attempt directory ``adir``: the spare, handed ``adir``, or a new one. Raises ``OSError``."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
            if spare is not None:
                path = os.fsencode(adir)  # any bytes the file system allows but a newline (the line's end)
                try:
                    if spare.poll() is not None or b"\n" in path:
                        raise OSError("the spare shim is gone, or the path holds a newline")
                    spare.stdin.write(path + b"\n")
                    spare.stdin.close()
                except Exception:  # noqa: BLE001 - this launch starts its own shim; the spare must not linger
                    spare.kill()
                    spare.wait()
                    spare = None
            if self.spare_shim:
                self._start_spare()
        if spare is not None:
            return spare
        return _popen_shim(str(adir), subprocess.DEVNULL)

    def close(self) -> None:
        """Let the spare shim (if any) exit: its stdin is closed. Launches after this start their own shims."""
        with self._spare_lock:
            spare, self._spare, self.spare_shim = self._spare, None, False
        if spare is not None:
            try:
                spare.stdin.close()
                spare.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass

    # ---------------------------------------------------------------- paths
    def attempt_dir(self, key: AttemptKey) -> Path:
        """The directory of ``key``: ``state_dir/"attempts"/job_id/f"{attempt}-{rank}"`` (may not exist)."""
        if not isinstance(key, AttemptKey):
            raise ValueError(f"key must be an AttemptKey, got {key!r}")
        return self.attempts_dir / key.job_id / f"{key.attempt}-{key.rank}"

    # ---------------------------------------------------------------- launch
    def launch(
        self,
        key: AttemptKey,
        argv: list[str],
        env: dict[str, str] | None = None,
        gpus: Sequence[int] = (),
        workdir: Path | None = None,
        user: "JobUser | None" = None,
        log_max_bytes: int | None = None,
        private_view: Sequence[str] | None = None,
    ) -> LocalAttempt:
        """Start ``argv`` (no shell) as attempt ``key`` under a detached shim; return it ``"running"``
        (or already ``"exited"`` if it could not be executed: exit code 127, message in the log).

        The job's environment is exactly :func:`providers.launch.base_environment`
        (``PATH``, ``HOME`` = ``workdir``, ``LANG``, ``TZ``) updated by ``env``, then
        ``CUDA_VISIBLE_DEVICES=",".join(gpus)`` (``""`` for no GPUs),
        ``FEDBROKER_JOB_ID``, ``FEDBROKER_ATTEMPT``, ``FEDBROKER_RANK``: nothing of the
        caller's ``os.environ`` (an agent holds the broker's secrets). Its working
        directory is ``workdir`` (default: the caller's current directory).
        ``user`` (a :class:`workers.isolation.JobUser`): the job runs as that uid and
        primary gid with no supplementary groups (the shim drops privileges just before
        ``exec``); ``None`` = the caller's own user (the node agent always passes one).
        A ``dynamic`` user (a per-attempt uid, :mod:`workers.dynamic_users`) also sets
        ``USER`` and ``LOGNAME`` to its name, and every process left under that uid is
        killed when the job ends (shim), after the grace period of :meth:`terminate`
        (:meth:`poll`) and in :meth:`forget`.
        The attempt directory (control files and log) is mode 0700 and owned by the
        caller, so the job can neither read nor rewrite it; it writes its log only
        through its stdout and stderr.
        ``log_max_bytes``: the log file stops growing at that many bytes (the job writes to a pipe the shim
        copies, dropping what is over); ``None``: the job's stdout is the log file itself, unbounded.
        ``private_view``: absolute paths (socket directories or files) to hide: a root caller's job with a
        ``user`` then runs in a mount namespace of its own with a ``hidepid=2`` ``/proc`` and those paths
        covered (:class:`workers.isolation.PrivateView`); ``None``: it sees the host's mounts.
        Returns once the job's pid is on disk.

        The attempt directory is claimed with ``os.mkdir`` before anything starts,
        so a duplicate dispatch of the same key never starts a second process.

        Raises ``ValueError`` naming the field for an empty ``argv``/non-str
        element, a non-str ``env`` key/value or a key containing ``=``, an ``env``
        key the runtime sets itself (``CUDA_VISIBLE_DEVICES``, ``FEDBROKER_*``),
        a GPU index that is not an int >= 0 or is repeated, a ``workdir`` that
        is not a directory, a ``user`` with uid 0 or (caller not root) another uid
        than the caller's; :class:`AlreadyLaunched` if the key was launched
        before (and not forgotten); :class:`LaunchFailed` if the shim did not
        report the job's pid within :data:`LAUNCH_TIMEOUT_S` seconds.
        """
        adir = self.attempt_dir(key)
        argv = self._check_argv(argv)
        env = self._check_env(env)
        gpu_t = self._check_gpus(gpus)
        cap = None if log_max_bytes is None else _check_int("log_max_bytes", log_max_bytes, 1)
        hide = None if private_view is None else [str(p) for p in private_view]
        for p in hide or ():
            if not os.path.isabs(p):
                raise ValueError(f"private_view: {p!r} is not an absolute path")
        if workdir is None:
            workdir = Path.cwd()
        if not Path(workdir).is_dir():
            raise ValueError(f"workdir must be an existing directory, got {str(workdir)!r}")
        user_d = None
        if user is not None:
            uid, gid = getattr(user, "uid", None), getattr(user, "gid", None)
            for f, v in (("user.uid", uid), ("user.gid", gid)):
                _check_int(f, v)
            if uid == 0:
                raise ValueError(f"user={user!r}: jobs never run as root (uid 0)")
            if os.geteuid() != 0 and uid != os.geteuid():
                raise ValueError(f"user={user!r}: only a root caller can run a job as another user "
                                 f"(this process is uid {os.geteuid()})")
            user_d = {"name": str(getattr(user, "name", uid)), "uid": uid, "gid": gid,
                      "dynamic": bool(getattr(user, "dynamic", False))}
        overrides = base_environment(str(Path(workdir).resolve()))
        overrides.update(env)
        if user_d is not None and user_d["dynamic"]:  # no passwd entry: getpass.getuser() reads these
            overrides.update({"USER": user_d["name"], "LOGNAME": user_d["name"]})
        overrides.update({
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpu_t),
            "FEDBROKER_JOB_ID": key.job_id,
            "FEDBROKER_ATTEMPT": str(key.attempt),
            "FEDBROKER_RANK": str(key.rank),
        })

        for _ in range(5):  # forget() of a sibling attempt may remove the job directory in between
            adir.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(adir, 0o700)
                break
            except FileExistsError:
                raise AlreadyLaunched(f"attempt {key.dirname!r} was already launched ({adir} exists)") from None
            except FileNotFoundError:
                continue
        else:
            raise LaunchFailed(f"attempt {key.dirname!r}: cannot create {adir}")
        started_at = time.time()
        write_json_atomic(adir / META, {
            "job_id": key.job_id, "attempt": key.attempt, "rank": key.rank, "argv": argv,
            "env": overrides, "gpus": list(gpu_t), "workdir": str(Path(workdir).resolve()),
            "user": user_d, "started_at": started_at,
            **({} if cap is None else {"log_max_bytes": cap}),
            **({} if private_view is None else {"view": {"hide": hide, "private_proc": True}}),
        }, mode=0o600)
        os.close(os.open(adir / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))

        try:
            proc = self._start_shim(adir)
        except OSError as exc:
            with open(adir / LOG, "a", encoding="utf-8") as f:
                f.write(f"fedbroker-runtime: cannot start the shim {sys.executable!r}: {exc}\n")
            write_json_atomic(adir / EXIT, {"exit_code": _shim.EXEC_FAILED, "ended_at": time.time()})
            raise LaunchFailed(f"attempt {key.dirname!r}: cannot start the shim: {exc}") from exc

        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        delay = 0.002
        while True:
            if (adir / PID).exists() or (adir / EXIT).exists():
                break
            rc = proc.poll()
            if rc not in (None, 0):
                raise LaunchFailed(f"attempt {key.dirname!r}: the shim exited with status {rc} before starting the job")
            if rc == 0 and (adir / SHIM).exists() and not _is_alive(read_json(adir / SHIM)):
                if (adir / PID).exists() or (adir / EXIT).exists():
                    break
                raise LaunchFailed(f"attempt {key.dirname!r}: the shim died before starting the job; see {adir / LOG}")
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"attempt {key.dirname!r}: no job pid after {LAUNCH_TIMEOUT_S} s; the attempt stays claimed")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)  # a stat() every 10 ms: the pid is seen within 10 ms of being written
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)  # the intermediate exits right after forking the shim
        except subprocess.TimeoutExpired:
            pass
        return self.get(key)

    @staticmethod
    def _check_argv(argv: object) -> list[str]:
        if isinstance(argv, (str, bytes)) or not isinstance(argv, (list, tuple)) or not argv:
            raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
        for i, a in enumerate(argv):
            if not isinstance(a, str) or "\x00" in a:
                raise ValueError(f"argv[{i}] must be a str without NUL, got {a!r}")
        if not argv[0]:
            raise ValueError(f"argv[0] must be a non-empty program, got {argv[0]!r}")
        return list(argv)

    @staticmethod
    def _check_env(env: object) -> dict[str, str]:
        if env is None:
            return {}
        if not isinstance(env, dict):
            raise ValueError(f"env must be a dict[str, str], got {env!r}")
        for k, v in env.items():
            if not isinstance(k, str) or not k or "=" in k or "\x00" in k:
                raise ValueError(f"env key must be a non-empty str without '=' or NUL, got {k!r}")
            if not isinstance(v, str) or "\x00" in v:
                raise ValueError(f"env[{k!r}] must be a str without NUL, got {v!r}")
            if k in _RESERVED_ENV:
                raise ValueError(f"env[{k!r}] is set by the runtime (from gpus= / the key); got {v!r}")
        return dict(env)

    @staticmethod
    def _check_gpus(gpus: object) -> tuple[int, ...]:
        if isinstance(gpus, (str, bytes)):
            raise ValueError(f"gpus must be a sequence of int GPU indices, got {gpus!r}")
        try:
            out = tuple(gpus)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"gpus must be a sequence of int GPU indices, got {gpus!r}") from None
        for i, g in enumerate(out):
            _check_int(f"gpus[{i}]", g)
        if len(set(out)) != len(out):
            raise ValueError(f"gpus must not repeat an index, got {list(out)!r}")
        return out

    # ---------------------------------------------------------------- read state
    def get(self, key: AttemptKey) -> LocalAttempt:
        """The attempt ``key`` as it stands on disk now. Raises :class:`UnknownAttempt`."""
        adir = self.attempt_dir(key)
        if not adir.is_dir():
            raise UnknownAttempt(f"no attempt {key.dirname!r} under {self.attempts_dir}")
        return self._read(key, adir)

    def list(self) -> list[LocalAttempt]:  # noqa: A003 - the API's name
        """Every attempt directory on disk, sorted by ``(job_id, attempt, rank)``.

        This is how a restarted agent re-adopts attempts. Entries that are not
        attempt directories (e.g. temporary files) are skipped.
        """
        out: list[LocalAttempt] = []
        for jdir in sorted(self.attempts_dir.iterdir()):
            if not jdir.is_dir():
                continue
            for adir in jdir.iterdir():
                a, sep, r = adir.name.partition("-")
                if not sep or not a.isdigit() or not r.isdigit() or not adir.is_dir():
                    continue
                try:
                    key = AttemptKey(jdir.name, int(a), int(r))
                except ValueError:
                    continue
                try:
                    out.append(self._read(key, adir))
                except FileNotFoundError:  # forgotten meanwhile
                    continue
        out.sort(key=lambda x: (x.key.job_id, x.key.attempt, x.key.rank))
        return out

    def _read(self, key: AttemptKey, adir: Path) -> LocalAttempt:
        # Order matters: look at the shim BEFORE reading the exit file. The shim writes the exit
        # file and then exits, so "shim gone" followed by "no exit file" really means lost; the
        # other order misreads a shim that finished in between as lost.
        shim_info = read_json(adir / SHIM)  # read once: it may appear between two looks
        shim_alive = _is_alive(shim_info)
        meta = read_json(adir / META) or {}
        exit_ = read_json(adir / EXIT)
        pidinfo = read_json(adir / PID)
        stop = read_json(adir / STOP)
        started_at = meta.get("started_at")
        if started_at is None:
            started_at = adir.stat().st_mtime
        if exit_ is not None:
            status = "exited"
        elif shim_alive:
            status = "running"
        elif shim_info is None and time.time() - started_at < LAUNCH_TIMEOUT_S:
            # being launched: the directory is claimed but the metadata or the shim's pid is
            # not written yet (a listing from another thread can land in between)
            status = "running"
        else:
            status = "lost"
        return LocalAttempt(
            key=key,
            status=status,
            exit_code=None if exit_ is None else int(exit_["exit_code"]),
            pid=None if pidinfo is None else int(pidinfo["pid"]),
            log_path=adir / LOG,
            started_at=float(started_at),
            ended_at=None if exit_ is None else float(exit_["ended_at"]),
            stop_requested=None if stop is None else stop.get("reason"),
            gpus=tuple(meta.get("gpus") or ()),
            argv=tuple(meta.get("argv") or ()),
            uid=None if not meta.get("user") else int(meta["user"]["uid"]),
            dynamic_uid=bool((meta.get("user") or {}).get("dynamic")),
        )

    # ---------------------------------------------------------------- stop
    def terminate(self, key: AttemptKey, grace_s: float, reason: str = "cancel") -> None:
        """Ask attempt ``key`` to stop: SIGTERM to its process group now, SIGKILL from :meth:`poll`
        once ``grace_s`` seconds have passed. Does not block.

        Records ``{"reason", "requested_at", "grace_s", "kill_deadline"}`` (POSIX s)
        in the attempt directory. Idempotent: a second call changes nothing (the
        first reason and kill deadline stay; no second SIGTERM). No-op for an
        attempt that has exited. For a ``"lost"`` attempt the job's process group
        is still signalled if it is alive (and the pid was not reused).

        Raises ``ValueError`` naming ``grace_s`` (not a finite number >= 0) or
        ``reason`` (not a non-empty str); :class:`UnknownAttempt`.
        """
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not math.isfinite(grace_s) or grace_s < 0:
            raise ValueError(f"grace_s must be a finite number of seconds >= 0, got {grace_s!r}")
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty str, got {reason!r}")
        att = self.get(key)
        if att.status == "exited":
            return
        adir = self.attempt_dir(key)
        now = time.time()
        claimed = write_json_atomic(adir / STOP, {
            "reason": reason, "requested_at": now, "grace_s": float(grace_s), "kill_deadline": now + grace_s,
        }, exclusive=True)
        if claimed:
            _signal_group(read_json(adir / PID), signal.SIGTERM)

    def poll(self) -> None:
        """Escalate: SIGKILL the process group of every attempt past its kill deadline and not exited.

        Call it every ~0.5 s. Re-sends SIGKILL on every call until the exit is
        recorded (or, for a ``"lost"`` attempt, while the group exists); an attempt
        with its own uid also has every process of that uid killed (a ``setsid``
        escapee included). Errors reading one attempt do not stop the others.
        """
        now = time.time()
        for jdir in list(self.attempts_dir.iterdir()):
            if not jdir.is_dir():
                continue
            for adir in list(jdir.iterdir()):
                try:
                    stop = read_json(adir / STOP)
                    if stop is None or (adir / EXIT).exists() or now < float(stop["kill_deadline"]):
                        continue
                    _signal_group(read_json(adir / PID), signal.SIGKILL)
                    _kill_dynamic_uid(read_json(adir / META))
                except (OSError, ValueError, KeyError, TypeError):
                    continue

    # ---------------------------------------------------------------- logs, cleanup
    def read_log(self, key: AttemptKey, offset: int, max_bytes: int) -> tuple[bytes, int]:
        """Up to ``max_bytes`` bytes of the attempt's log from byte ``offset``; returns ``(data, offset + len(data))``.

        ``data`` is empty at the end of the log. Raises ``ValueError`` naming
        ``offset`` (not an int >= 0, or past the end of the log) or ``max_bytes``
        (not an int >= 1); :class:`UnknownAttempt`.
        """
        _check_int("offset", offset)
        _check_int("max_bytes", max_bytes, 1)
        adir = self.attempt_dir(key)
        if not adir.is_dir():
            raise UnknownAttempt(f"no attempt {key.dirname!r} under {self.attempts_dir}")
        try:
            with open(adir / LOG, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset > size:
                    raise ValueError(f"offset {offset} is past the end of the log ({size} bytes)")
                f.seek(offset)
                data = f.read(max_bytes)
        except FileNotFoundError:
            if offset:
                raise ValueError(f"offset {offset} is past the end of the log (0 bytes)") from None
            data = b""
        return data, offset + len(data)

    def forget(self, key: AttemptKey) -> None:
        """Delete the attempt's directory (after its end was reported upstream).

        Allowed for ``"exited"`` and ``"lost"`` attempts (a lost attempt's job may
        still run: :meth:`terminate` it first; an attempt with its own uid has every
        process of that uid killed here). Afterwards the key may be
        launched again. Raises :class:`AttemptRunning` while it is running;
        :class:`UnknownAttempt`.
        """
        att = self.get(key)
        if att.status == "running":
            raise AttemptRunning(f"attempt {key.dirname!r} is still running (pid {att.pid}); terminate it first")
        adir = self.attempt_dir(key)
        _kill_dynamic_uid(read_json(adir / META))  # before the uid can go to another attempt
        shutil.rmtree(adir)
        try:
            adir.parent.rmdir()
        except OSError:
            pass
