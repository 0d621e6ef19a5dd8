"""Who a job runs as and where: the node agent's side of job isolation.

A job started by the process runtime (:mod:`workers.runtime`) never runs as root and never
sees the agent's environment:

* **User** (:func:`resolve_job_user`): when the agent runs as root, each job runs as the
  unprivileged user of ``settings.jobs`` (``team_users[team]``, else ``pool_users[pool]``,
  else ``user``), else — the default — each attempt rank under its own uid from
  ``jobs.uid_range`` (:mod:`workers.dynamic_users`); the shim drops to it (uid, primary gid,
  no supplementary groups) just before ``exec``. A user that resolves to uid 0 is refused.
  Jobs that share a configured user can signal and read each other; per-attempt uids cannot. When the agent does
  not run as root it cannot switch users, so jobs run as the agent's own user: weaker (a job can
  read whatever the agent can, e.g. its settings file), documented in the README.
* **Directories** (:func:`jobs_root`, :func:`prepare_jobs_root`, :func:`private_dir`): under
  the jobs root (``settings.jobs.root``; default ``/var/lib/fedbroker/jobs`` for a root agent,
  ``state_dir/jobs`` otherwise), root-owned directories of mode 0711 (traversable, not
  listable) lead to one working directory per attempt and rank
  (``work/<node>/<job>/<attempt>-<rank>``, the job's ``HOME`` and ``cwd``) and one checkpoint
  directory per job (``checkpoints/<team>/<job>``), each mode 0700 and owned by the job's user.
  The agent's state directory (SQLite database, attempt control files, logs) is made 0700:
  a job user can neither list nor read it.
* **Environment**: :func:`providers.launch.base_environment` plus the launch spec's variables,
  nothing else (built in :meth:`workers.runtime.ProcessRuntime.launch`).

cgroups (CPU, memory, device limits through ``systemd-run --scope``) are not applied by the
process runtime: the hosts this was built on have no systemd as PID 1. Run the agent inside a
systemd slice (or use the docker runtime's limits) where they are needed.

Errors: ``ValueError`` naming the setting (``jobs.user``, ``jobs.team_users['vision']``,
``jobs.root``) and the value.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass, field
from pathlib import Path

from broker.job_uids import DEFAULT_UID_RANGE, MIN_UID_RANGE_SIZE, check_uid_range  # the rule the broker's settings check too

__all__ = ["JobUser", "no_new_privileges", "DEFAULT_UID_RANGE", "MIN_UID_RANGE_SIZE", "check_uid_range", "JobsPolicy", "agent_is_root", "resolve_job_user", "jobs_root", "prepare_jobs_root", "check_reachable",
           "private_dir", "DEFAULT_ROOT_JOBS_DIR"]

#: jobs root of an agent that runs as root (every parent is world-traversable on a standard host)
DEFAULT_ROOT_JOBS_DIR = Path("/var/lib/fedbroker/jobs")


@dataclass(frozen=True)
class JobsPolicy:
    """The broker's ``jobs`` settings as an agent receives them (``GET /v1/node/config``): ``user``,
    ``pool_users``, ``team_users`` (user names or uids) and ``root`` (see
    :class:`broker.service.settings.JobsSettings`, where they are validated)."""

    user: str | None = None
    pool_users: dict = field(default_factory=dict)
    team_users: dict = field(default_factory=dict)
    root: str | None = None
    uid_range: tuple[int, int] = DEFAULT_UID_RANGE

    @classmethod
    def from_dict(cls, d: dict) -> "JobsPolicy":
        """From the ``jobs`` object of the node config (missing keys: the defaults). Raises ``ValueError``
        naming ``jobs.uid_range`` for a bad range (:func:`check_uid_range`)."""
        return cls(user=d.get("user"), pool_users=dict(d.get("pool_users") or {}),
                   team_users=dict(d.get("team_users") or {}), root=d.get("root"),
                   uid_range=check_uid_range(tuple(d.get("uid_range") or DEFAULT_UID_RANGE)))


@dataclass(frozen=True)
class JobUser:
    """The unprivileged identity a job runs as: user ``name``, ``uid`` and primary ``gid``; ``dynamic``: a
    per-attempt uid of ``jobs.uid_range`` (:mod:`workers.dynamic_users`), killed off when the attempt ends."""

    name: str
    uid: int
    gid: int
    dynamic: bool = False

    def to_dict(self) -> dict:
        """``{"name", "uid", "gid", "dynamic"}`` (as stored in the attempt's ``meta.json``)."""
        return {"name": self.name, "uid": self.uid, "gid": self.gid, "dynamic": self.dynamic}


#: ``prctl`` option that makes ``execve`` never grant privileges (setuid/setgid bits, file capabilities are
#: ignored) for this process and its children: linux/prctl.h
PR_SET_NO_NEW_PRIVS = 38


def no_new_privileges() -> None:
    """Set ``no_new_privs`` on this process (inherited by its children, never unset): a job cannot gain a uid
    or capabilities through a setuid file — one it planted earlier under a uid that a later job (another
    team's) then got, or ``sudo``. Linux 3.5+. Raises ``OSError`` if the kernel refuses."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")


def agent_is_root() -> bool:
    """True when this process runs with effective uid 0 (it can, and must, drop jobs to another user)."""
    return os.geteuid() == 0


def _lookup(field: str, spec: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except KeyError:
        raise ValueError(f"{field}={spec!r}: no such user on this host") from None


def resolve_job_user(jobs, team: str | None = None, pool: str | None = None) -> JobUser | None:
    """The user a job of ``team`` on a node of ``pool`` runs as, from ``jobs`` (:class:`JobsPolicy`, or :class:`broker.service.settings.JobsSettings`).

    Root agent: ``jobs.team_users[team]``, else ``jobs.pool_users[pool]``, else ``jobs.user``,
    else ``None``: the attempt gets its own uid (:func:`workers.dynamic_users.allocate_uid`).
    Non-root agent: the agent's own user (it cannot switch).

    Raises ``ValueError`` naming the setting when the user does not exist on this host, resolves
    to uid 0, or (non-root agent) names a user other than the agent's own.
    """
    if team is not None and team in jobs.team_users:
        field, spec = f"jobs.team_users[{team!r}]", jobs.team_users[team]
    elif pool is not None and pool in jobs.pool_users:
        field, spec = f"jobs.pool_users[{pool!r}]", jobs.pool_users[pool]
    else:
        field, spec = "jobs.user", jobs.user
    euid = os.geteuid()
    if euid != 0:
        me = pwd.getpwuid(euid)
        if spec is not None and _lookup(field, spec).pw_uid != euid:
            raise ValueError(f"{field}={spec!r}: the agent runs as {me.pw_name!r} (uid {euid}), not root, so it "
                             "cannot switch users; jobs run as the agent's own user. Unset it or run the agent as root")
        return JobUser(me.pw_name, euid, os.getegid())
    if spec is None:
        return None
    pw = _lookup(field, spec)
    if pw.pw_uid == 0:
        raise ValueError(f"{field}={spec!r}: is uid 0 (root); jobs never run as root")
    return JobUser(pw.pw_name, pw.pw_uid, pw.pw_gid)


def jobs_root(root: str | Path | None, state_dir: str | Path) -> Path:
    """The jobs root: ``root`` (the ``jobs.root`` setting) if given, else :data:`DEFAULT_ROOT_JOBS_DIR` for a
    root agent, else ``state_dir/jobs`` (``state_dir``: the agent's own state directory)."""
    if root is not None:
        return Path(root)
    return DEFAULT_ROOT_JOBS_DIR if agent_is_root() else Path(state_dir) / "jobs"


def _can_traverse(st: os.stat_result, user: JobUser) -> bool:
    if user.uid == st.st_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if user.gid == st.st_gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def check_reachable(path: Path, user: JobUser, field: str = "jobs.root") -> None:
    """Raise ``ValueError`` naming ``field`` unless ``user`` can traverse ``path`` and every directory above it
    (owner, primary group or other execute bit; jobs have no supplementary groups)."""
    p = Path(path).resolve()
    for d in [p, *p.parents]:
        st = os.stat(d)
        if not _can_traverse(st, user):
            raise ValueError(f"{field}={str(path)!r}: the job user {user.name!r} (uid {user.uid}) cannot reach it: "
                             f"{d} is mode {stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}; choose a "
                             "directory every job user can traverse (e.g. /var/lib/fedbroker/jobs)")


def _mkdir_traversable(path: Path) -> None:
    """Create ``path`` and missing parents; directories this creates get mode 0711 (root: owned by root)."""
    missing = []
    p = Path(path)
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o711)
        except FileExistsError:
            continue
        os.chmod(d, 0o711)  # not narrowed by the umask


def prepare_jobs_root(root: Path, users: list[JobUser]) -> Path:
    """Create the jobs root (and ``work``, ``checkpoints`` in it) as traverse-only (0711) directories and check
    that each of ``users`` can reach it. Returns the resolved root.

    Raises ``ValueError`` naming ``jobs.root`` when it is writable by group or others (a job user could swap the
    directories the agent creates in it for links) or a job user cannot reach it (see :func:`check_reachable`).
    """
    root = Path(root)
    _mkdir_traversable(root)
    st = os.stat(root)
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ValueError(f"jobs.root={str(root)!r}: is mode {stat.S_IMODE(st.st_mode):04o}, writable by group or "
                         "others; give a directory only its owner can write (the agent creates 0711 ones)")
    for sub in (root / "work", root / "checkpoints"):
        _mkdir_traversable(sub)
        os.chmod(sub, 0o711)
    for u in users:
        check_reachable(root, u)
    return root.resolve()


def private_dir(path: Path, user: JobUser) -> Path:
    """Create ``path`` (mode 0700, owned by ``user`` when the agent is root) below traverse-only parents; an
    existing one is kept and (re)owned. Returns ``path``. Raises ``OSError``; ``ValueError`` if ``path`` is a symlink."""
    path = Path(path)
    _mkdir_traversable(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise ValueError(f"{path}: exists and is not a directory") from None
    if agent_is_root():
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
    os.chmod(path, 0o700)
    return path


def remove_tree(path: str | Path) -> None:
    """Delete the directory ``path`` and everything in it, at any depth, never following a symlink.

    Each directory met is emptied with its subdirectories first moved up into ``path`` itself (``renameat`` by
    directory file descriptor), so at most two directories are open at once and nothing recurses: Python
    3.11's ``shutil.rmtree`` recurses, and a job's tree 2,000 directories deep raised ``RecursionError`` and
    stayed behind for the next holder of its uid. A ``path`` that is a symlink or a file is unlinked; a
    missing one is nothing to do. Run it once the tree's owner has no process left. Raises ``OSError``."""
    path = os.fspath(path)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        top = os.open(path, flags)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(path)
        return
    moved = 0
    try:
        while True:
            with os.scandir(top) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            if not entries:
                break
            for name, is_dir in entries:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    continue
                sub = os.open(name, flags, dir_fd=top)
                try:
                    with os.scandir(sub) as it:
                        inner = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                    for iname, idir in inner:
                        if not idir:
                            os.unlink(iname, dir_fd=sub)
                            continue
                        while True:  # up into ``path`` under a name no entry there has
                            moved += 1
                            try:
                                os.rename(iname, f".removing-{moved}", src_dir_fd=sub, dst_dir_fd=top)
                                break
                            except OSError as e:
                                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                                    raise
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)

