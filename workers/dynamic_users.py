"""Per-attempt uids ("dynamic users", the systemd ``DynamicUser=`` idea) for jobs of a root agent.

When the broker's ``jobs`` settings name no user for a job (no ``jobs.team_users[team]``,
``jobs.pool_users[pool]`` or ``jobs.user``), a root agent runs each attempt rank under its OWN
uid, gid = the same number, no supplementary groups, taken from ``jobs.uid_range`` (default
:data:`DEFAULT_UID_RANGE`, systemd's dynamic-user range). Such a uid needs no ``/etc/passwd``
entry; the job's ``USER`` and ``LOGNAME`` are ``fedbroker-<uid>`` (:func:`dynamic_user`).

Lifecycle of one uid:

* **allocate** (:func:`allocate_uid`): the lowest id of the range that no lease holds (a lease is
  the file ``/run/fedbroker/uids/<uid>`` (:data:`LEASE_ROOT`, one for every agent of the host), created with ``O_EXCL``, naming the attempt's directory; a
  lease whose attempt directory is gone is stale), that no attempt of this agent holds (its
  ``meta.json``, passed in as ``used``), that owns no running process (``/proc/*/status``) and
  that has no ``/etc/passwd`` entry. The uid stays in the attempt's ``meta.json`` so a restarted
  agent re-adopts it.
* **end** (:func:`kill_uid`): when the rank ends (the shim saw the job exit; the agent stops or
  forgets it; the grace period of a cancel ran out), every process still running under the uid is
  SIGKILLed — a ``setsid`` escapee dies with its job — and what it left at the top of ``/tmp``,
  ``/var/tmp``, ``/dev/shm``, ``/run/lock`` and in System V IPC is removed (:func:`remove_leftovers`), BEFORE the
  lease is released (:func:`release_uid`) and the uid can go to another attempt (the lowest free id
  is taken, so ids are reused).
* **checkpoints** (:func:`hand_over`, :func:`reclaim`): the job's checkpoint directory persists across
  attempts; when a rank's uid is released the agent takes the directory back to root (0700), and at
  each launch gives it (recursively, by file descriptor, never following symlinks or hard links) to
  the new attempt's uid.

Every job process also runs with ``no_new_privs`` (:func:`workers.isolation.no_new_privileges`): a
setuid file a job leaves behind (owned by a uid a later job gets) gives nothing to whoever runs it.

What this protects: jobs of different attempts (so of different teams) cannot signal, ptrace or
read ``/proc/<pid>/environ`` of each other, nor enter each other's 0700 working and checkpoint
directories. What it does not: the network (a job reaches whatever the host reaches, e.g. a
password-less Redis or PostgreSQL on it) and GPUs (``CUDA_VISIBLE_DEVICES`` is an environment
variable, not a device cgroup, with the process runtime); files a job leaves deeper inside another
world-writable directory than the top of ``/tmp``, ``/var/tmp`` or ``/dev/shm`` (they stay readable
by a later attempt given the same uid; give jobs ``HOME`` and ``CHECKPOINT_DIR`` to write to).

Errors: :class:`UidRangeExhausted` (a ``ValueError``) when every id of the range is taken;
``ValueError`` naming ``jobs.uid_range`` from :func:`check_uid_range`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterable

from workers.isolation import DEFAULT_UID_RANGE, MIN_UID_RANGE_SIZE, JobUser, check_uid_range, remove_tree

__all__ = ["NAME_PREFIX", "STALE_LEASE_S", "UidRangeExhausted",
           "dynamic_user", "processes_of_uid", "uids_of_processes", "kill_uid", "allocate_uid",
           "release_uid", "remove_leftovers", "SHARED_TMP_DIRS", "hand_over", "reclaim", "LEASE_ROOT"]

#: name prefix of a dynamic user (``USER``/``LOGNAME`` of the job)
NAME_PREFIX = "fedbroker-"


class UidRangeExhausted(ValueError):
    """Every uid of ``jobs.uid_range`` is held by an attempt or owns a running process."""


def dynamic_user(uid: int):
    """The :class:`workers.isolation.JobUser` of dynamic uid ``uid``: name ``fedbroker-<uid>``, gid = ``uid``."""
    return JobUser(f"{NAME_PREFIX}{uid}", uid, uid, dynamic=True)


def _proc_uids() -> Iterable[tuple[int, set[int]]]:
    """``(pid, {real, effective, saved, fs uid})`` of every live (not zombie) process."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            continue
        uids: set[int] = set()
        zombie = False
        for line in text.splitlines():
            if line.startswith("State:"):
                zombie = line.split()[1:2] in (["Z"], ["X"])
            elif line.startswith("Uid:"):
                uids = {int(x) for x in line.split()[1:]}
        if uids and not zombie:
            yield int(name), uids


def uids_of_processes() -> set[int]:
    """Every uid (real, effective, saved or filesystem) of a running, non-zombie process on this host."""
    out: set[int] = set()
    for _, uids in _proc_uids():
        out |= uids
    return out


def processes_of_uid(uid: int) -> list[int]:
    """Pids of the running (non-zombie) processes that have ``uid`` as real, effective, saved or fs uid."""
    return sorted(pid for pid, uids in _proc_uids() if uid in uids)


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process running under ``uid`` (never 0); returns how many were found at first.

    Each round a helper process drops to ``uid`` and calls ``kill(-1, SIGKILL)`` (atomic against a
    process that forks meanwhile), then ``/proc`` is scanned again; up to ``rounds`` rounds. Needs root.
    Raises ``ValueError`` for uid 0.
    """
    if uid == 0:
        raise ValueError("uid=0: never kill every process of root")
    found = processes_of_uid(uid)
    n = len(found)
    for _ in range(rounds):
        if not found:
            break
        subprocess.run(["/bin/sh", "-c", "kill -s KILL -1"], user=uid, group=uid,
                       extra_groups=[], cwd="/", env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        for pid in processes_of_uid(uid):  # a process whose real uid differs (setuid binary) is not hit by kill(-1)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        found = processes_of_uid(uid)
    return n


#: where the uid leases of every agent on this host live (host-wide: two agents with different jobs roots
#: must never hand out the same uid)
LEASE_ROOT = Path("/run/fedbroker")


def _lease_dir(lease_root: Path) -> Path:
    d = Path(lease_root) / "uids"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


#: a lease whose attempt directory does not exist is stale only when older than this, seconds (the lease is
#: taken just before the attempt directory is created)
STALE_LEASE_S = 120.0


def _lease_live(path: Path) -> bool:
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return True  # being replaced: keep it
    try:
        holder = json.loads(path.read_text()).get("attempt_dir")
    except (OSError, ValueError, AttributeError):
        return age < STALE_LEASE_S  # being written; unreadable for long (a crash while writing): stale
    return not holder or Path(holder).is_dir() or age < STALE_LEASE_S


def allocate_uid(uid_range: tuple[int, int], lease_root: Path, holder: Path, used: Iterable[int] = ()) -> int:
    """Lease the lowest free uid of ``uid_range`` for the attempt whose directory is ``holder``; returns it.

    Free: no live lease in ``<lease_root>/uids`` (:data:`LEASE_ROOT` for an agent), not in ``used`` (the uids of this agent's attempts), no
    running process has it, no ``/etc/passwd`` entry names it. A stale lease (its attempt directory is
    gone, and the lease is older than :data:`STALE_LEASE_S`) is taken over once that uid's processes are
    killed. Raises :class:`UidRangeExhausted`.
    """
    lo, hi = uid_range
    used = set(used)
    busy = uids_of_processes()
    leases = _lease_dir(lease_root)
    for uid in range(lo, hi + 1):
        if uid in used or uid in busy:
            continue
        try:
            pwd.getpwuid(uid)
            continue  # a real account: never borrow it
        except KeyError:
            pass
        path = leases / str(uid)
        if path.exists():
            if _lease_live(path):
                continue
            kill_uid(uid)
            remove_leftovers(uid)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # another agent took it meanwhile
        with os.fdopen(fd, "w") as f:
            json.dump({"attempt_dir": str(holder)}, f)
        return uid
    raise UidRangeExhausted(f"jobs.uid_range={list(uid_range)!r}: every uid is held by an attempt or a running "
                            "process; widen the range")


#: world-writable directories whose top-level entries owned by a released uid are removed (what a job
#: leaves there would otherwise be readable by the next attempt given the same uid)
SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
_SYSV = (("shm", "shmid", "-m"), ("msg", "msqid", "-q"), ("sem", "semid", "-s"))


def remove_leftovers(uid: int, dirs: Iterable[str] = SHARED_TMP_DIRS) -> list[str]:
    """Remove what ``uid`` left behind on the host, once none of its processes runs (like systemd's
    ``RemoveIPC=``): the top-level entries of ``dirs`` it owns (directories whole, never following a
    symlink) and its System V shared memory segments, message queues and semaphore sets (``ipcrm``,
    where installed). Entries it left deeper inside other world-writable directories stay. Returns the
    paths (and ``sysv:<kind>:<id>``) removed. Raises ``ValueError`` for uid 0."""
    if uid == 0:
        raise ValueError("uid=0: never remove root's files")
    removed: list[str] = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            p = os.path.join(d, name)
            try:
                st = os.lstat(p)
                if st.st_uid != uid:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    remove_tree(p)  # never follows the job's symlinks, at any depth
                else:
                    os.unlink(p)
            except OSError:
                continue
            removed.append(p)
    ipcrm = shutil.which("ipcrm", path="/usr/bin:/bin:/usr/sbin:/sbin")
    for kind, id_col, flag in _SYSV:
        try:
            header, *rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except (OSError, ValueError):
            continue
        cols = header.split()
        for row in rows:
            f = dict(zip(cols, row.split()))
            if f.get("uid") == str(uid) and ipcrm is not None:
                if subprocess.run([ipcrm, flag, f[id_col]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  check=False).returncode == 0:
                    removed.append(f"sysv:{kind}:{f[id_col]}")
    return removed


def keep_leased(uid: int, lease_root: Path, holder: Path) -> None:
    """Keep ``uid``'s lease live for as long as the directory ``holder`` exists (what its attempt left and could
    not be removed: the uid must not go to another job while its files are there). Raises ``OSError``."""
    path = _lease_dir(lease_root) / str(uid)
    tmp = path.with_name(f".{uid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"attempt_dir": str(holder)}, f)
    os.replace(tmp, path)


def release_uid(uid: int, lease_root: Path) -> None:
    """Kill what still runs under ``uid`` (:func:`kill_uid`), remove what it left in the shared temporary
    directories and System V IPC (:func:`remove_leftovers`), then drop its lease so it can be given again."""
    kill_uid(uid)
    remove_leftovers(uid)
    try:
        (Path(lease_root) / "uids" / str(uid)).unlink()
    except FileNotFoundError:
        pass


def hand_over(path: Path, user, uid_range: tuple[int, int]) -> None:
    """Give the directory tree ``path`` to ``user`` (a dynamic :class:`workers.isolation.JobUser`): ``path``
    itself mode 0700; every entry below it owned by a uid of ``uid_range`` (an earlier attempt's) is chowned
    to ``user.uid``/``user.gid``. Walks by directory file descriptor (``os.fwalk``, ``chown`` relative to the
    directory, never following a symlink), so a job that swaps a directory for a symlink meanwhile cannot
    steer it elsewhere; an entry owned by anyone else, and a file with more than one hard link (a link to
    another job's file, planted by a job), is left alone. Raises ``OSError``."""
    lo, hi = uid_range
    path = Path(path)
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    os.chmod(path, 0o700)
    for _top, dirs, files, dir_fd in os.fwalk(path, follow_symlinks=False):
        for name in dirs + files:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not lo <= st.st_uid <= hi or (st.st_uid, st.st_gid) == (user.uid, user.gid):
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                continue  # a hard link: the same file may stand in another job's directory
            try:
                os.chown(name, user.uid, user.gid, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue


def reclaim(path: Path) -> bool:
    """Take the directory ``path`` back to root (mode 0700) when the uid that held it is released, so the next
    attempt given that uid (another job's) cannot enter it; :func:`hand_over` gives it to the job's next
    attempt. A symlink or a missing path is left alone. Returns whether it was taken back. Raises ``OSError``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    os.chown(path, 0, 0, follow_symlinks=False)
    os.chmod(path, 0o700)
    return True
