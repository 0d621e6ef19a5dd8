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
* **What it sees** (:class:`PrivateView`, root agent): its own mount namespace, where ``/proc`` shows only
  its own uid's processes (``hidepid=2``) and the UNIX socket directories of PostgreSQL and Redis
  (:data:`SERVICE_SOCKET_DIRS`, and the broker's own socket paths) are empty; TCP to the broker's Redis
  and database is refused by the agent's nftables table (:mod:`workers.network_guard`).

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
           "private_dir", "DEFAULT_ROOT_JOBS_DIR", "PrivateView", "SERVICE_SOCKET_DIRS"]

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


_LIBC = None


def _libc():
    """The C library (``ctypes.CDLL``, errno kept), loaded once per process: ``find_library`` runs ``ldconfig``."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _LIBC


def no_new_privileges() -> None:
    """Set ``no_new_privs`` on this process (inherited by its children, never unset): a job cannot gain a uid
    or capabilities through a setuid file — one it planted earlier under a uid that a later job (another
    team's) then got, or ``sudo``. Linux 3.5+. Raises ``OSError`` if the kernel refuses."""
    import ctypes

    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
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



# ---------------------------------------------------------------------------------------------- a job's view of the host
#: directories where PostgreSQL and Redis packages put their UNIX sockets (Debian/Ubuntu ``/var/run/postgresql``
#: and ``/run/redis``, as ``redis.conf``'s commented ``unixsocket`` line; RHEL the same for PostgreSQL). A
#: PostgreSQL server opens its socket there even when the broker uses TCP, and local ``trust`` lets any uid in.
SERVICE_SOCKET_DIRS = ("/run/postgresql", "/var/run/postgresql", "/run/redis", "/var/run/redis")

#: linux/sched.h and linux/mount.h (sys/mount.h of glibc)
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = os.uname().release.split(".")
        return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= (major, minor)
    except (ValueError, IndexError):
        return False


class PrivateView:
    """What a job process sees of the host, entered between ``fork`` and ``exec`` by the shim (root only): a
    mount namespace of its own (propagation private: nothing it mounts reaches the host) in which

    * ``/proc`` is a fresh procfs mounted ``hidepid=2`` (``invisible``): the job sees the ``/proc/<pid>`` of its
      own uid only, so not another job's command line (``/proc/<pid>/cmdline``), environment or open files.
      Linux 5.8+ only: before it, a proc mount's options were shared by every mount of the pid namespace and
      ``hidepid`` would change the host's ``/proc`` (then ``/proc`` is left as it is);
    * each directory of ``hide`` that exists is covered by an empty read-only tmpfs, and each other existing
      path (a socket file) by ``/dev/null``: the UNIX sockets of the broker's PostgreSQL and Redis
      (:data:`SERVICE_SOCKET_DIRS`, plus the socket paths of the broker's URLs) cannot be reached.

    Process ids are the host's (no PID namespace), so the shim's supervision (process group, pid files, the
    kill of a dynamic uid's processes) is unchanged. Abstract UNIX sockets (``@name``) belong to the network
    namespace and are not hidden (neither PostgreSQL nor Redis uses one).

    Args:
        hide: absolute paths (directories or socket files); symlinks are resolved now, missing paths skipped.
        private_proc: mount the ``hidepid`` procfs.
    """

    def __init__(self, hide=(), private_proc: bool = True):
        import ctypes

        self._libc = _libc()
        self._ctypes = ctypes
        seen, self.targets = set(), []
        for p in hide:
            real = os.path.realpath(p)
            if real in seen or not os.path.lexists(real):
                continue
            seen.add(real)
            self.targets.append((real.encode(), os.path.isdir(real)))
        self.private_proc = bool(private_proc) and _kernel_at_least(5, 8)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            err = self._ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def _mount(self, source: bytes, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
        self._check(self._libc.mount(source, target, fstype, flags, data), f"mount {target.decode()}")

    def enter(self) -> None:
        """Unshare the mount namespace and mount what the class docstring says, in this process (the job's child
        of the shim, still root). Raises ``OSError`` (errno and the step) when the host refuses a step."""
        self._check(self._libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        self._mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
        for target, is_dir in self.targets:
            if is_dir:
                self._mount(b"tmpfs", target, b"tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                            b"size=4k,mode=0755")
            else:
                self._mount(b"/dev/null", target, None, _MS_BIND, None)
        if self.private_proc:
            self._mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"hidepid=2")

    def then_drop_to(self, uid: int, gid: int):
        """A ``preexec_fn`` for ``subprocess.Popen`` (which then gets no ``user``/``group``: it would drop
        privileges before the ``preexec_fn`` runs): :meth:`enter`, then no supplementary groups, gid ``gid``,
        uid ``uid``. A view the host refuses is written as one ``fedbroker-shim:`` line to the job's stderr (its
        log) and the job runs without it; a failed drop raises (the job is not started)."""

        def child() -> None:
            try:
                self.enter()
            except OSError as e:
                os.write(2, (f"fedbroker-shim: this host refused the job's private view ({e}); other jobs' "
                             "processes and the service sockets may be visible to it\n").encode())
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

        return child
