"""The node agent: one per on-prem host (``fedbroker serve agent``).

It holds no broker secret: only the API's URL and a token scoped to its own node
(:class:`workers.node_client.NodeClient`, the node API of :mod:`broker.service.node_api`). Every
``SUPERVISE_S`` seconds it:

* heartbeats every ``heartbeat_interval_s``: inventory and NVML telemetry from
  :mod:`providers.nvml` (a fake backend where there is no GPU); unhealthy or lost GPUs are
  left out of ``healthy_gpus`` and receive no work;
* asks the API for the ranks placed on this node (``GET /v1/node/work``; a second thread
  long-polls it and wakes the step as soon as the work changes) and starts the
  ones that are not here yet, of ``starting`` jobs and of gangs already ``running`` on another
  node (reporting ``running`` once the process is up);
* ships new log bytes of every local attempt;
* stops attempts whose job was cancelled (``cancel_requested``), preempted (``stop_reason``)
  or moved on (no longer in this node's work: the node was declared lost and the job
  requeued) — SIGTERM, then SIGKILL after ``cancel_grace_s``;
* stops, the same way, an attempt that has run longer than its wall-clock limit (the spec's
  ``time_limit_s``, else ``estimated_duration_s x 1.2 + 300 s``: :func:`providers.base.pool_time_limit_s`,
  the Slurm model) and reports its end with "time limit of N s exceeded" (the job fails with it);
* reports attempts that ended (exit code, or lost without one) and single-node attempts the
  API shows running here that have no process (the API requeues them).

What those reports do to the job (all-or-nothing gangs, requeues, outcomes) is decided by the
API (:mod:`broker.service.attempts`). If the API cannot be reached the agent keeps its jobs running
and tries again with back-off (``SUPERVISE_S`` doubling to ``MAX_BACKOFF_S``); it never stops
a job because it cannot reach the API, and the reports wait until it can.

Jobs run through :class:`workers.runtime.ProcessRuntime`: each attempt under a detached shim
that outlives the agent, so an agent killed with ``kill -9`` loses nothing — restarted, it
re-adopts the running attempts from its state directory and reports the ones that ended
meanwhile. A rank is started only once per (job, attempt, rank): the attempt directory is
claimed atomically.

Isolation (:mod:`workers.isolation`): a job gets a clean environment (the launch spec's
variables, nothing of the agent's), runs as the unprivileged user of the broker's ``jobs``
settings (served by ``GET /v1/node/config``; never root) or, by default, under a uid of its
own per attempt and rank from ``jobs.uid_range`` (:mod:`workers.dynamic_users`: leased at
launch, every process of it killed when the rank ends, before the uid is given again), in
its own working directory per attempt and rank, with a checkpoint directory per job (handed
to each new attempt's uid), both under the jobs root and owned by that user; the agent's
state directory is mode 0700. A root agent also keeps the broker's services out of its jobs' reach: an
nftables table refuses the job uids TCP connections to the broker's Redis and database
(:mod:`workers.network_guard`), and each job runs in a mount namespace of its own where their UNIX sockets
are hidden and ``/proc`` shows its own processes only (:class:`workers.isolation.PrivateView`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from providers.base import pool_time_limit_s
from providers.launch import RENDEZVOUS_PORT as _LAUNCH_PORT
from providers.launch import default_route_interface, launch_spec, process_environment
from workers.dynamic_users import LEASE_ROOT, allocate_uid, dynamic_user, hand_over, keep_leased, reclaim, release_uid
from workers.isolation import (SERVICE_SOCKET_DIRS, JobsPolicy, agent_is_root, jobs_root, prepare_jobs_root,
                                private_dir, remove_tree, resolve_job_user)
from workers.network_guard import NetworkGuard
from workers.node_client import NodeApiError, NodeApiUnavailable, NodeClient

__all__ = ["NodeAgent", "RENDEZVOUS_PORT", "SUPERVISE_S", "WORK_WAIT_S", "MAX_BACKOFF_S"]

log = logging.getLogger("fedbroker.agent")
SUPERVISE_S = 0.5
#: seconds one long-poll of GET /v1/node/work may wait for a change (at most broker.service.work_watch.MAX_WAIT_S)
WORK_WAIT_S = 5.0
#: longest wait between tries while the API cannot be reached, seconds
MAX_BACKOFF_S = 10.0
#: seconds between checks that this agent's nftables table is still installed (:meth:`NodeAgent.keep_guard`)
GUARD_CHECK_S = 10.0
#: an attempt must look lost (shim gone, no exit code) this long before it is reported lost, seconds
LOST_CONFIRM_S = 2.0
#: torchrun/NCCL rendezvous port on rank 0 (the c10d default)
RENDEZVOUS_PORT = _LAUNCH_PORT  # 29500, defined once in providers.launch
#: how many reported ends the agent remembers (a rank it ended is never started again on a stale answer)
ENDED_MEMORY = 10_000
#: how the reason of an attempt stopped at its wall-clock limit begins (the job's failure reason)
_TIME_LIMIT_TEXT = "time limit of"
#: answers that say "this report will never be taken" (the attempt is not this node's, or gone)
_REFUSED = (404, 409, 422)


def _utf8_prefix(data: bytes) -> int:
    """How many leading bytes of ``data`` end on a UTF-8 character boundary: ``len(data)`` unless it ends inside a
    multi-byte character, whose bytes are then left out (a 64 KiB chunk cut in the middle of a "€" came back as
    three U+FFFD, each chunk being decoded on its own). Invalid UTF-8 is left as it is (replaced when decoded)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead byte
            continue
        need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        return len(data) - back if back < need else len(data)
    return len(data)


class NodeAgent:
    """Runs and supervises the jobs placed on one host, through the node API.

    Args:
        api: a :class:`workers.node_client.NodeClient` (API URL + this node's token).
        name: node name; must be the node the token names (the API answers for that node only).
        pool: on-prem pool the node belongs to (must be in the broker's cluster file).
        backend: an NVML backend (``providers.nvml.open_backend(...)``).
        state_dir: where the attempts' directories (``agents/<name>``) and checkpoints live.
        runtime: the process runtime (default: under ``state_dir / "agents" / name``).
        gpu_type: override of the canonical GPU type read from NVML.
        config: the agent-side settings (``GET /v1/node/config``); ``None`` = asked from the API.
        lease_root: where per-attempt uids are leased (``<lease_root>/uids``; default
            :data:`workers.dynamic_users.LEASE_ROOT`, shared by every agent of the host).

    The jobs' user and directories are prepared on first use of :attr:`config` (in :meth:`start`'s
    first step, or :meth:`prepare`); ``ValueError`` names the setting when ``jobs`` names a user that
    does not exist, is root, or cannot be taken by a non-root agent, or a jobs root the job user
    cannot reach (:mod:`workers.isolation`).
    """

    def __init__(self, api: NodeClient, name: str, pool: str, backend, state_dir: Path | str = ".fedbroker",
                 runtime=None, gpu_type: str | None = None, config: dict | None = None,
                 lease_root: Path = LEASE_ROOT):
        from workers.runtime import ProcessRuntime

        self.api = api
        self.name = name
        self.pool = pool
        self.backend = backend
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # every attempt's control files and logs
        # a spare shim kept started: a launch does not wait for a Python interpreter to boot (workers.runtime)
        self.runtime = runtime or ProcessRuntime(self.state_dir / "agents" / name, spare_shim=True)
        self.lease_root = Path(lease_root)  # the uid leases: host-wide by default (every agent of the host)
        self.jobs: JobsPolicy | None = None
        #: the nftables table of a root agent (installed by prepare(); None otherwise)
        self.guard: NetworkGuard | None = None
        #: paths hidden from a root agent's jobs, each in a mount namespace of its own (workers.isolation.PrivateView)
        self.private_view: list[str] | None = None
        self.jobs_root: Path | None = None
        self.gpu_type = gpu_type
        self.agent_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._config = config
        self._last_hb = 0.0
        self._backoff = 0.0
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the work watcher: supervise now
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._lost_seen: dict = {}
        #: ranks whose end this agent reported (never started again here, whatever a stale answer says)
        self._ended: dict[tuple[str, int, int], float] = {}

    @property
    def config(self) -> dict:
        """The agent-side settings (asked from the API once). Raises :class:`NodeApiError`, also
        (status 403) when the token names another node than ``name``."""
        if self._config is None:
            cfg = self.api.config()
            if cfg.get("node", self.name) != self.name:
                raise NodeApiError(f"the node token names node {cfg['node']!r}, not --name={self.name!r}", 403)
            self._config = cfg
        if self.jobs is None:
            self.prepare()
        return self._config

    def prepare(self) -> None:
        """Resolve the job users of this node's pool (and of every team mapping) and create the jobs
        root; a root agent then installs its nftables table (:class:`workers.network_guard.NetworkGuard`: the
        job uids cannot connect to the config's ``blocked_endpoints``) and hides the services' UNIX sockets
        and other jobs' ``/proc`` entries from its jobs (:class:`workers.isolation.PrivateView`). Raises
        ``ValueError`` naming the ``jobs`` setting (:mod:`workers.isolation`),
        :class:`workers.network_guard.NetworkGuardError` (no ``nft``, or the kernel refused the table)."""
        cfg = self._config if self._config is not None else self.config
        jobs = JobsPolicy.from_dict(cfg.get("jobs") or {})
        users = [resolve_job_user(jobs, team, self.pool) for team in (*jobs.team_users, None)]
        # a per-attempt uid (None) has no group in common with the root: it reaches what any uid does
        users = [dynamic_user(jobs.uid_range[0]) if u is None else u for u in users]
        self.jobs_root = prepare_jobs_root(jobs_root(jobs.root, self.state_dir), users)
        if agent_is_root():  # the broker's services out of the jobs' reach (workers.network_guard, PrivateView)
            eps = list(cfg.get("blocked_endpoints") or [])
            api = urlsplit(self.api.api_url)  # jobs need not talk to the broker's API either (a job's slow-loris
            if api.hostname:                  # filled its connection cap: heartbeats got 503, the node was lost)
                eps.append({"setting": "the agent's api_url", "host": api.hostname,
                            "port": api.port or (443 if api.scheme == "https" else 80)})
            uids = [jobs.uid_range, *((u.uid, u.uid) for u in users if not u.dynamic)]
            self.guard = NetworkGuard(self.name, uids, eps)
            self.guard.install()
            self.private_view = sorted({*SERVICE_SOCKET_DIRS, *(e["socket"] for e in eps if e.get("socket"))})
        elif self.jobs is None:
            log.warning("the agent does not run as root: its jobs run as its own user, with no nftables table and no "
                        "private /proc, so they can reach the broker's Redis and database and see each other")
        self.jobs = jobs

    # ------------------------------------------------------------------ heartbeat
    def heartbeat(self) -> None:
        """Read NVML and send this node's healthy GPUs and telemetry. Raises :class:`NodeApiError`."""
        inv = self.backend.read()
        gtype = self.gpu_type or inv.gpu_type or "unknown"
        self.api.heartbeat(pool=self.pool, gpu_type=gtype, gpu_count=len(inv.gpus),
                           gpu_memory_gb=inv.gpu_memory_gb or 0.0, healthy_gpus=list(inv.healthy_indices),
                           agent_id=self.agent_id, telemetry=inv.to_dict())
        self._last_hb = time.monotonic()

    # ------------------------------------------------------------------ launch
    def _launch(self, w: dict) -> str:
        """Start the rank of work item ``w`` here; returns what happened (``started``, ``duplicate``,
        ``launch failed: ...``)."""
        from workers.runtime import AlreadyLaunched, AttemptKey, LaunchFailed

        key = AttemptKey(w["job_id"], w["attempt"], w["rank"])
        leased: int | None = None  # a uid this call leased (released again if nothing was claimed)
        try:
            ls = self._launch_spec(w)
            # the runtime adds the base (PATH, HOME, ...), CUDA_VISIBLE_DEVICES and FEDBROKER_JOB_ID/ATTEMPT/RANK
            env = process_environment(ls)
            user = resolve_job_user(self.jobs, ls.team, self.pool)
            if user is None:  # the default: this attempt rank gets a uid of its own
                if self.runtime.attempt_dir(key).exists():
                    raise AlreadyLaunched(key.dirname)
                held = {a.uid for a in self.runtime.list() if a.dynamic_uid}
                user = dynamic_user(allocate_uid(self.jobs.uid_range, self.lease_root, self.runtime.attempt_dir(key),
                                                 used=held))
                leased = user.uid
            private_dir(Path(ls.checkpoint_dir), user)
            if user.dynamic:  # what earlier attempts (other uids) wrote there becomes this attempt's
                hand_over(Path(ls.checkpoint_dir), user, self.jobs.uid_range)
            workdir = private_dir(self._workdir(key), user)
            self.runtime.launch(key, list(ls.command), env=env, gpus=w["gpus"], workdir=workdir, user=user,
                                log_max_bytes=int(self.config["log_max_bytes"]), private_view=self.private_view)
        except AlreadyLaunched:
            self._tell(self.api.running, key.job_id, key.attempt, key.rank)
            return "duplicate"
        except (LaunchFailed, OSError, ValueError) as e:
            # this node could not start it: the API ends the attempt and requeues the job
            log.error("could not launch %s attempt %d rank %d: %s", key.job_id, key.attempt, key.rank, e)
            try:
                self.runtime.forget(key)
                self._remove_workdir(key)
            except Exception:  # noqa: BLE001 - nothing claimed, or already gone (or still running: keep its directory)
                if not self.runtime.attempt_dir(key).exists():
                    self._remove_workdir(key)
            if leased is not None and not self.runtime.attempt_dir(key).exists():
                self._give_back_uid(key, leased)  # nothing runs under it
            self._tell(self.api.launch_failed, key.job_id, key.attempt, key.rank, str(e))
            return f"launch failed: {e}"
        self._tell(self.api.running, key.job_id, key.attempt, key.rank)
        return "started"

    def _give_back_uid(self, key, uid: int) -> None:
        """End a rank's hold on its own ``uid``: take the job's checkpoint directory back to root and delete the
        rank's working directory, and only then release the uid for another attempt. If either fails the
        lease is kept (logged): the uid goes to nobody else until the lease is stale
        (:data:`workers.dynamic_users.STALE_LEASE_S`)."""
        reclaimed = self._reclaim_checkpoints(key.job_id)
        self._remove_workdir(key)
        wd = self._workdir(key)
        if reclaimed and not wd.exists():
            release_uid(uid, self.lease_root)
            return
        log.error("uid %d of %s kept leased: its checkpoint or working directory could not be closed", uid,
                  key.dirname)
        if wd.exists():
            try:  # held while its files are there (the runtime's attempt directory, the lease's holder, is gone)
                keep_leased(uid, self.lease_root, wd)
            except OSError as e:
                log.error("could not keep uid %d leased to %s: %s", uid, wd, e)

    def _reclaim_checkpoints(self, job_id: str) -> bool:
        """Take the job's checkpoint directory back to root (:func:`workers.dynamic_users.reclaim`) unless another
        rank of the job still runs here: the uid its files are owned by is about to go to another job.
        Returns False when a directory could not be taken back."""
        if any(b.key.job_id == job_id and b.status == "running" for b in self.runtime.list()):
            return True
        ok = True
        for d in (self.jobs_root / "checkpoints").glob(f"*/{job_id}"):
            try:
                reclaim(d)
            except OSError as e:
                log.error("could not take back the checkpoint directory %s: %s", d, e)
                ok = False
        return ok

    def _workdir(self, key) -> Path:
        """The attempt's working directory (and ``HOME``): ``<jobs root>/work/<node>/<job>/<attempt>-<rank>``."""
        return self.jobs_root / "work" / self.name / key.job_id / f"{key.attempt}-{key.rank}"

    def _remove_workdir(self, key) -> None:
        """Delete the attempt's working directory (its end was reported; checkpoints stay)."""
        wd = self._workdir(key)
        try:
            remove_tree(wd)  # never follows the job's symlinks, at any depth
        except OSError as e:
            log.error("could not delete the working directory %s: %s", wd, e)
        try:
            wd.parent.rmdir()
        except OSError:
            pass

    def _launch_spec(self, w: dict):
        """The :class:`providers.launch.LaunchSpec` of work item ``w``: the same environment as a
        container or a cloud instance would get (:func:`providers.launch.job_environment`). Rank 0's
        node name is the rendezvous address (``127.0.0.1`` for a single node); checkpoints live under
        ``<jobs root>/checkpoints/<team>/<job_id>``; the NCCL interface is the agent's
        ``$NCCL_SOCKET_IFNAME`` if set, else the interface of the default route."""
        from broker.model import JobSpec

        return launch_spec(
            JobSpec.model_validate(w["spec"]), w["job_id"], w["attempt"], w["rank"], nnodes=w["nnodes"],
            master_addr=w["master_node"] if w["nnodes"] > 1 else "127.0.0.1",
            gpu_devices=tuple(w["gpus"]),
            checkpoint_root=str(self.jobs_root / "checkpoints"),
            grace_s=self.config["cancel_grace_s"],
            nccl_socket_ifname=os.environ.get("NCCL_SOCKET_IFNAME") or default_route_interface(),
        )

    @staticmethod
    def _tell(call, *args, default=True):
        """Make a report; an answer that refuses it for good (404/409/422) is logged and gives
        ``default``. Unreachable API, 401/403: raised (the step backs off and tries again)."""
        try:
            return call(*args)
        except NodeApiUnavailable:
            raise
        except NodeApiError as e:
            if e.status in _REFUSED:
                log.warning("report %s%s refused: %s", call.__name__, args[:3], e.detail)
                return default
            raise

    # ------------------------------------------------------------------ supervision
    def supervise_once(self) -> None:
        """One supervision step (see the module docstring). Never raises for an API outage: the
        step is skipped and tried again after a back-off; local jobs keep running."""
        self.runtime.poll()
        if time.monotonic() < self._retry_at:
            return
        try:
            self._supervise()
        except NodeApiError as e:
            self._backoff = min(max(self._backoff * 2, SUPERVISE_S), MAX_BACKOFF_S)
            self._retry_at = time.monotonic() + self._backoff
            log.warning("node API: %s; local jobs keep running; next try in %.1f s", e, self._backoff)
            return
        if self._backoff:
            log.info("node API reachable again")
            self._backoff, self._retry_at = 0.0, 0.0

    def _supervise(self) -> None:
        cfg = self.config
        # register before asking for work, and heartbeat before any report: a report the API keeps failing
        # (a 500 on one attempt) must not keep the node from heartbeating and have it declared lost
        if self._last_hb == 0.0 or time.monotonic() - self._last_hb >= cfg["heartbeat_interval_s"]:
            self.heartbeat()
        grace = cfg["cancel_grace_s"]
        # Ask for the work BEFORE listing local attempts: a rank the API shows running here was
        # launched before this answer (launch precedes the report), so the listing below includes it.
        work = {(w["job_id"], w["attempt"], w["rank"]): w for w in self.api.work()}
        local = {(a.key.job_id, a.key.attempt, a.key.rank): a for a in self.runtime.list()}
        launched = False
        for key, w in work.items():
            # a gang is running as soon as one rank is: its other ranks start then too
            due = w["state"] == "starting" or (w["state"] == "running" and w["nnodes"] > 1)
            if not due or w["cancel_requested"] or w["stop_reason"]:
                continue
            a = local.get(key)
            if a is None and key in self._ended:
                continue
            if a is None:
                self._launch(w)
                launched = True
            elif a.status == "running":  # launched by an agent that died before its report
                self._tell(self.api.running, *key)
        if launched:
            local = {(a.key.job_id, a.key.attempt, a.key.rank): a for a in self.runtime.list()}
        for key, a in local.items():
            w = work.get(key)
            if a.status == "running":
                if w is None:
                    self.runtime.terminate(a.key, grace, "stale")
                elif w["cancel_requested"]:
                    self.runtime.terminate(a.key, grace, "cancel")
                elif w["stop_reason"]:
                    self.runtime.terminate(a.key, grace, w["stop_reason"])
                elif a.stop_requested is None and (over := self._time_limit_exceeded(a, w)):
                    self.runtime.terminate(a.key, grace, over)
                self._ship_logs(a)
                continue
            if a.status == "lost":
                # confirm over LOST_CONFIRM_S: never report a lost process on one odd reading
                first = self._lost_seen.setdefault(a.key, time.monotonic())
                if time.monotonic() - first < LOST_CONFIRM_S:
                    continue
            self._ship_logs(a, final=True)
            code = a.exit_code if a.status == "exited" else None
            stopped_why = a.stop_requested if (a.stop_requested or "").startswith(_TIME_LIMIT_TEXT) else None
            if self._tell(self.api.ended, *key, code, stopped_why):
                self.runtime.forget(a.key)  # kills what is left under the attempt's own uid
                if a.dynamic_uid and a.uid:
                    self._give_back_uid(a.key, a.uid)
                else:
                    self._remove_workdir(a.key)
                self._lost_seen.pop(a.key, None)
                self._ended[key] = time.monotonic()
        if len(self._ended) > ENDED_MEMORY:  # forget the oldest half
            for k in sorted(self._ended, key=self._ended.get)[:len(self._ended) // 2]:
                del self._ended[k]
        # ranks the API shows running here, with no process and no exit code on this node
        for key, w in work.items():
            if w["state"] == "running" and key not in local and w["nnodes"] == 1:
                self._tell(self.api.gone, *key)

    @staticmethod
    def _time_limit_exceeded(a, w: dict) -> str | None:
        """``"time limit of N s exceeded"`` when local attempt ``a`` (its ``started_at``, POSIX s) has run longer
        than the wall-clock limit of its work item ``w``'s spec (:func:`providers.base.pool_time_limit_s`:
        ``time_limit_s``, else the estimate x 1.2 + 300 s); else ``None``. A spec it cannot read has no limit
        here (the API validated it)."""
        spec = w.get("spec") or {}
        try:
            limit = pool_time_limit_s(float(spec.get("estimated_duration_s", 3600.0)),
                                      time_limit_s=spec.get("time_limit_s"))
        except (TypeError, ValueError):
            return None
        ran = time.time() - a.started_at
        return f"{_TIME_LIMIT_TEXT} {limit:g} s exceeded (ran {ran:.1f} s)" if ran > limit else None

    def _ship_logs(self, a, final: bool = False) -> None:
        """Ship the attempt's new log bytes to the API in chunks (resumable; duplicates ignored)."""
        meta = a.log_path.parent / "shipped.json"
        try:
            state = json.loads(meta.read_text()) if meta.exists() else {"offset": 0, "seq": 0, "truncated": False}
        except (OSError, ValueError):
            state = {"offset": 0, "seq": 0, "truncated": False}
        limit = self.config["log_max_bytes"]
        chunk = self.config["log_chunk_bytes"]
        moved = False
        while state["offset"] < limit:
            try:
                data, new_off = self.runtime.read_log(a.key, state["offset"], min(chunk, limit - state["offset"]))
            except ValueError:  # the job truncated its own log (ftruncate on its stdout): ship nothing more
                break
            if not data:
                break
            # ship whole lines while running; a carriage return ends a line too (a progress bar redrawn with
            # \r, tqdm's way, showed "no log yet" until 64 KiB had built up)
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            if not final and len(data) < chunk and cut:
                data, new_off = data[:cut], state["offset"] + cut
            elif not final and len(data) < chunk:
                break
            keep = _utf8_prefix(data)  # never split a character between two chunks (each is decoded alone)
            if keep < len(data) and (keep or not final):
                if not keep:
                    break  # only part of one character so far: wait for the rest
                data, new_off = data[:keep], state["offset"] + keep
            self._tell(self.api.log, a.key.job_id, a.key.attempt, a.key.rank, state["seq"],
                       data.decode("utf-8", errors="replace"))
            state["offset"], state["seq"] = new_off, state["seq"] + 1
            moved = True
        if final and state["offset"] >= limit and not state["truncated"]:
            self._tell(self.api.log, a.key.job_id, a.key.attempt, a.key.rank, state["seq"],
                       f"\n[fedbroker: log truncated at {limit} bytes]\n")
            state["seq"] += 1
            state["truncated"] = moved = True
        if moved:
            tmp = meta.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, meta)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Supervise in a background thread until :meth:`stop` (the first step heartbeats), and
        long-poll the node's work in another (:meth:`_watch_work`): a change wakes the supervision
        step at once instead of at the next ``SUPERVISE_S`` tick."""
        self._thread = threading.Thread(target=self._loop, name=f"agent-{self.name}", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch_work, name=f"agent-{self.name}-watch", daemon=True)
        self._watcher.start()

    def _loop(self) -> None:
        guard_checked = time.monotonic()
        while True:
            t0 = time.monotonic()
            self._wake.clear()
            try:
                self.supervise_once()
            except Exception:
                log.exception("supervision step failed")
            if self.guard is not None and t0 - guard_checked >= GUARD_CHECK_S:
                guard_checked = t0
                self.keep_guard()
            # one step every SUPERVISE_S, or at once when the work changed (a slow step is followed
            # at once, after a short pause)
            self._wake.wait(max(SUPERVISE_S - (time.monotonic() - t0), 0.05))
            if self._stop.is_set():
                return

    def _watch_work(self) -> None:
        """Long-poll ``GET /v1/node/work`` (``WORK_WAIT_S`` a call) and wake the supervision loop when
        this node's work changes (a rank placed, cancelled, preempted or moved on). The loop still
        polls every ``SUPERVISE_S``: this only makes it sooner. API errors: retried after a pause."""
        etag = None
        while not self._stop.is_set():
            try:
                new = self.api.work_changed(etag, WORK_WAIT_S)
            except NodeApiError:
                self._stop.wait(max(self._backoff, SUPERVISE_S))
                etag = None
                continue
            if new is None:  # an API without ETags: the loop's own poll is all there is
                self._stop.wait(WORK_WAIT_S)
            elif new != etag:
                if etag is not None:
                    self._wake.set()
                etag = new

    def stop(self) -> None:
        """Stop supervising (running jobs keep running under their shims). The nftables table is deleted when
        no job runs here any more; while one does it keeps its rules (the next start replaces them)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.runtime.close()  # the spare shim exits
        self.remove_guard()

    def keep_guard(self) -> bool:
        """Install this agent's nftables table again when it is gone (someone ran ``nft flush ruleset``, or deleted
        it); True when it is there now. Checked every ``GUARD_CHECK_S`` by the supervision loop; errors are logged."""
        if self.guard is None:
            return True
        try:
            if self.guard.installed() is not None:
                return True
            log.warning("network guard: table inet %s was gone: installing it again", self.guard.table)
            self.guard.install()
            return True
        except Exception as e:  # noqa: BLE001 - NetworkGuardError, nft timing out: the next check tries again
            log.error("%s", e)
            return False

    def remove_guard(self) -> bool:
        """Delete this agent's nftables table unless a job still runs here; True when it is gone. Errors are
        logged, never raised (the agent is stopping)."""
        if self.guard is None:
            return True
        if any(a.status == "running" for a in self.runtime.list()):
            log.warning("network guard: table inet %s kept: jobs still run on node %s", self.guard.table, self.name)
            return False
        try:
            self.guard.remove()
        except Exception as e:  # noqa: BLE001 - NetworkGuardError, nft timing out
            log.error("%s", e)
            return False
        return True
