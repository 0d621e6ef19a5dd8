"""The node agent: one per on-prem host (``fedbroker serve agent``).

It is a Celery worker consuming only its own queue ``node.<name>``
(``fedbroker.agent.run_attempt``) plus a supervisor thread that, every
``SUPERVISE_S`` seconds:

* heartbeats every ``heartbeat_interval_s``: inventory and NVML telemetry from
  :mod:`providers.nvml` (a fake backend where there is no GPU) into ``nodes``;
  unhealthy or lost GPUs are left out of ``healthy_gpus`` and receive no work;
* ships new log bytes of every local attempt into ``job_logs``;
* stops attempts whose job was cancelled (``cancel_requested``), preempted
  (``stop_reason``) or moved on (the job's current attempt is another one: the
  node was declared lost and the job requeued) — SIGTERM, then SIGKILL after
  ``cancel_grace_s``;
* reports attempts that ended (exit code) and requeues jobs whose process is
  gone without one.

Jobs run through :class:`workers.runtime.ProcessRuntime`: each attempt under a
detached shim that outlives the agent, so an agent killed with ``kill -9``
loses nothing — restarted, it re-adopts the running attempts from its state
directory and reports the ones that ended meanwhile. A duplicate dispatch (a
message delivered twice, or re-sent by the reconciler) never starts a second
process: the attempt directory is claimed atomically.

Isolation (:mod:`workers.isolation`): a job gets a clean environment (the launch spec's
variables, nothing of the agent's), runs as the unprivileged user of ``settings.jobs``
(never root), in its own working directory per attempt and rank, with a checkpoint
directory per job, both under the jobs root and owned by that user; the agent's state
directory is mode 0700.

Exactly-once: a job's process is started only by the agent of the node its
current attempt was placed on, only while the job is ``starting`` with that
attempt, and only once per (job, attempt, rank).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from celery import shared_task
from sqlalchemy import select

from broker.db import Attempt, Job, utcnow
from broker.reconciler import requeue_lost
from broker.states import JobState
from broker.store import JobStore
from providers.launch import RENDEZVOUS_PORT as _LAUNCH_PORT
from providers.launch import default_route_interface, launch_spec, process_environment
from workers.isolation import private_dir, resolve_job_user

__all__ = ["NodeAgent", "run_attempt", "current_agent", "set_current_agent", "RENDEZVOUS_PORT"]

log = logging.getLogger("fedbroker.agent")
S = JobState
SUPERVISE_S = 0.5
#: an attempt must look lost (shim gone, no exit code) this long before its job is requeued, seconds
LOST_CONFIRM_S = 2.0
#: torchrun/NCCL rendezvous port on rank 0 (the c10d default)
RENDEZVOUS_PORT = _LAUNCH_PORT  # 29500, defined once in providers.launch

_AGENT: "NodeAgent | None" = None


def current_agent() -> "NodeAgent":
    """The agent of this process (set by ``fedbroker serve agent``). Raises ``RuntimeError`` if none."""
    if _AGENT is None:
        raise RuntimeError("no node agent runs in this process")
    return _AGENT


def set_current_agent(agent: "NodeAgent | None") -> None:
    global _AGENT
    _AGENT = agent


class NodeAgent:
    """Runs and supervises the jobs placed on one host.

    Args:
        store: the job store.
        settings: :class:`broker.settings.BrokerSettings`.
        name: node name (unique in the broker).
        pool: on-prem pool the node belongs to (must be in the cluster file).
        backend: an NVML backend (``providers.nvml.open_backend(...)``).
        runtime: the process runtime (default: under ``settings.state_dir / "agents" / name``).
        gpu_type: override of the canonical GPU type read from NVML.

    Raises ``ValueError`` naming the setting when ``settings.jobs`` names a user that does not
    exist, is root, or cannot be taken by a non-root agent, or a jobs root the job user cannot
    reach (:mod:`workers.isolation`).
    """

    def __init__(self, store: JobStore, settings, name: str, pool: str, backend, runtime=None,
                 gpu_type: str | None = None, on_change=None):
        from workers.isolation import jobs_root, prepare_jobs_root, resolve_job_user
        from workers.runtime import ProcessRuntime

        self.store = store
        self.settings = settings
        self.name = name
        self.pool = pool
        self.backend = backend
        state_dir = Path(settings.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)  # the embedded database and every attempt's control files
        users = [resolve_job_user(settings.jobs, team, pool) for team in settings.jobs.team_users]
        self.jobs_root = prepare_jobs_root(jobs_root(settings), [resolve_job_user(settings.jobs, None, pool), *users])
        self.runtime = runtime or ProcessRuntime(state_dir / "agents" / name)
        self.gpu_type = gpu_type
        self.agent_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_change = on_change  # called after a job ended (e.g. kick the planner)
        self._last_hb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._launch_lock = threading.Lock()
        self._lost_seen: dict = {}

    # ------------------------------------------------------------------ heartbeat
    def heartbeat(self) -> None:
        """Read NVML and upsert this node with its healthy GPUs and telemetry."""
        inv = self.backend.read()
        gtype = self.gpu_type or inv.gpu_type or "unknown"
        self.store.heartbeat(self.name, self.pool, gtype, len(inv.gpus), inv.gpu_memory_gb or 0.0,
                             inv.healthy_indices, self.agent_id, telemetry=inv.to_dict())
        self._last_hb = time.monotonic()

    # ------------------------------------------------------------------ dispatch
    def run_attempt(self, job_id: str, attempt: int, rank: int = 0) -> str:
        """Start rank ``rank`` of ``attempt`` of ``job_id`` here if it is due; returns what happened.

        Idempotent: returns ``"stale: ..."`` when the job is not ``starting`` with that attempt on
        this node, ``"duplicate"`` when this (job, attempt, rank) was launched already.
        """
        with self._launch_lock:  # a concurrent report-and-forget of the same attempt cannot interleave
            return self._run_attempt_locked(job_id, attempt, rank)

    def _run_attempt_locked(self, job_id: str, attempt: int, rank: int) -> str:
        from workers.runtime import AlreadyLaunched, AttemptKey, LaunchFailed

        with self.store.session() as s:
            j = s.get(Job, job_id)
            if j is None:
                return "stale: no such job"
            if j.attempt != attempt or j.state not in (S.starting.value, S.running.value):
                return f"stale: job is {j.state} at attempt {j.attempt}"
            if j.cancel_requested or j.stop_reason:
                return "stale: stop requested"
            parts = (j.placement or {}).get("nodes", [])
            mine = [p for p in parts if p["node"] == self.name and p["rank"] == rank]
            if not mine:
                return f"stale: rank {rank} is not placed on {self.name}"
            part = mine[0]
            spec = dict(j.spec)
        key = AttemptKey(job_id, attempt, rank)
        try:
            ls = self._launch_spec(job_id, attempt, rank, spec, parts, part)
            # the runtime adds the base (PATH, HOME, ...), CUDA_VISIBLE_DEVICES and FEDBROKER_JOB_ID/ATTEMPT/RANK
            env = process_environment(ls)
            user = resolve_job_user(self.settings.jobs, ls.team, self.pool)
            private_dir(Path(ls.checkpoint_dir), user)
            workdir = private_dir(self._workdir(key), user)
            self.runtime.launch(key, list(ls.command), env=env, gpus=part["gpus"], workdir=workdir, user=user)
        except AlreadyLaunched:
            self._mark_running(job_id, attempt)
            return "duplicate"
        except (LaunchFailed, OSError, ValueError) as e:
            # this node could not start it: end the attempt, requeue (or fail after max_attempts)
            log.error("could not launch %s attempt %d rank %d: %s", job_id, attempt, rank, e)
            with self.store.session() as s:
                j = s.get(Job, job_id)
                if j is not None and j.attempt == attempt and j.state in (S.starting.value, S.running.value):
                    requeue_lost(s, j, utcnow(), f"could not start on {self.name}: {e}", "launch_failed",
                                 max_attempts=self.settings.max_attempts)
            try:
                self.runtime.forget(key)
                self._remove_workdir(key)
            except Exception:  # noqa: BLE001 - nothing claimed, or already gone (or still running: keep its directory)
                if not self.runtime.attempt_dir(key).exists():
                    self._remove_workdir(key)
            return f"launch failed: {e}"
        self._mark_running(job_id, attempt)
        return "started"

    def _workdir(self, key) -> Path:
        """The attempt's working directory (and ``HOME``): ``<jobs root>/work/<node>/<job>/<attempt>-<rank>``."""
        return self.jobs_root / "work" / self.name / key.job_id / f"{key.attempt}-{key.rank}"

    def _remove_workdir(self, key) -> None:
        """Delete the attempt's working directory (its end was reported; checkpoints stay)."""
        import shutil

        wd = self._workdir(key)
        shutil.rmtree(wd, ignore_errors=True)  # fd-based on Linux: never follows the job's symlinks
        try:
            wd.parent.rmdir()
        except OSError:
            pass

    def _launch_spec(self, job_id: str, attempt: int, rank: int, spec: dict, parts: list, part: dict):
        """The :class:`providers.launch.LaunchSpec` of this rank: the same environment as a container
        or a cloud instance would get (:func:`providers.launch.job_environment`). Rank 0's node name
        is the rendezvous address (``127.0.0.1`` for a single node); checkpoints live under
        ``<jobs root>/checkpoints/<team>/<job_id>``; the NCCL interface is the agent's
        ``$NCCL_SOCKET_IFNAME`` if set, else the interface of the default route."""
        from broker.model import JobSpec

        return launch_spec(
            JobSpec.model_validate(spec), job_id, attempt, rank, nnodes=len(parts),
            master_addr=parts[0]["node"] if len(parts) > 1 else "127.0.0.1",
            gpu_devices=tuple(part["gpus"]),
            checkpoint_root=str(self.jobs_root / "checkpoints"),
            grace_s=self.settings.cancel_grace_s,
            nccl_socket_ifname=os.environ.get("NCCL_SOCKET_IFNAME") or default_route_interface(),
        )

    def _mark_running(self, job_id: str, attempt: int) -> None:
        for _ in range(10):
            with self.store.session() as s:
                j = s.get(Job, job_id)
                if j is None or j.attempt != attempt or j.state != S.starting.value:
                    return
                now = utcnow()
                if JobStore.cas(s, job_id, j.version, S.starting.value, S.running.value,
                                f"running on {self.name}", now, started_at=j.started_at or now, state_deadline_at=None):
                    a = s.execute(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)
                                  ).scalar_one_or_none()
                    if a is not None and a.started_at is None:
                        a.started_at = now
                    return

    # ------------------------------------------------------------------ supervision
    def supervise_once(self) -> None:
        """One supervision step (see the module docstring)."""
        if time.monotonic() - self._last_hb >= self.settings.heartbeat_interval_s:
            try:
                self.heartbeat()
            except Exception:
                log.exception("heartbeat failed")
        self.runtime.poll()
        # Read the store BEFORE listing local attempts: a job the store shows running here was
        # launched before this read (launch precedes the move to running), so the listing below
        # includes it; the other order races with a dispatch and requeues a job that runs.
        with self.store.session() as s:
            mine_running = [(j.id, j.attempt, j.placement) for j in s.execute(
                select(Job).where(Job.state == S.running.value)).scalars()
                if any(p["node"] == self.name for p in (j.placement or {}).get("nodes", []))]
        local = self.runtime.list()
        ids = {a.key.job_id for a in local}
        with self.store.session() as s:
            jobs = {j.id: (j.state, j.attempt, j.cancel_requested, j.stop_reason)
                    for j in s.execute(select(Job).where(Job.id.in_(ids))).scalars()} if ids else {}
        local_keys = {(a.key.job_id, a.key.attempt, a.key.rank) for a in local}
        changed = False
        for a in local:
            info = jobs.get(a.key.job_id)
            current = info is not None and info[1] == a.key.attempt and info[0] in (S.starting.value, S.running.value)
            if a.status == "running":
                if not current:
                    self.runtime.terminate(a.key, self.settings.cancel_grace_s, "stale")
                elif info[2]:
                    self.runtime.terminate(a.key, self.settings.cancel_grace_s, "cancel")
                elif info[3]:
                    self.runtime.terminate(a.key, self.settings.cancel_grace_s, info[3])
                self._ship_logs(a)
                continue
            if a.status == "lost":
                # confirm over LOST_CONFIRM_S: never requeue a job on one odd reading
                first = self._lost_seen.setdefault(a.key, time.monotonic())
                if time.monotonic() - first < LOST_CONFIRM_S:
                    continue
            self._lost_seen.pop(a.key, None)
            self._ship_logs(a, final=True)
            with self._launch_lock:  # see run_attempt
                if self._report_end(a):
                    self.runtime.forget(a.key)
                    self._remove_workdir(a.key)
                    changed = True
        # jobs the store showed running here, with no process and no exit code on this node
        for job_id, attempt, pl in mine_running:
            for part in pl.get("nodes", []):
                if part["node"] == self.name and (job_id, attempt, part["rank"]) not in local_keys:
                    if len(pl["nodes"]) == 1:
                        with self.store.session() as s:
                            j = s.get(Job, job_id)
                            if j is not None and j.attempt == attempt and j.state == S.running.value:
                                changed |= requeue_lost(s, j, utcnow(), f"process of rank {part['rank']} is gone "
                                                        f"from {self.name} without an exit code",
                                                        max_attempts=self.settings.max_attempts)
        if changed and self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("on_change callback failed")

    def _ship_logs(self, a, final: bool = False) -> None:
        """Append the attempt's new log bytes to the store in chunks (resumable; duplicates ignored)."""
        import json

        meta = a.log_path.parent / "shipped.json"
        try:
            state = json.loads(meta.read_text()) if meta.exists() else {"offset": 0, "seq": 0, "truncated": False}
        except (OSError, ValueError):
            state = {"offset": 0, "seq": 0, "truncated": False}
        limit = self.settings.log_max_bytes
        chunk = self.settings.log_chunk_bytes
        moved = False
        while state["offset"] < limit:
            try:
                data, new_off = self.runtime.read_log(a.key, state["offset"], min(chunk, limit - state["offset"]))
            except ValueError:  # the job truncated its own log (ftruncate on its stdout): ship nothing more
                break
            if not data:
                break
            if not final and len(data) < chunk and b"\n" in data:  # ship whole lines while running
                cut = data.rfind(b"\n") + 1
                data, new_off = data[:cut], state["offset"] + cut
            elif not final and len(data) < chunk:
                break
            self.store.append_log(a.key.job_id, a.key.attempt, a.key.rank, state["seq"],
                                  data.decode("utf-8", errors="replace"))
            state["offset"], state["seq"] = new_off, state["seq"] + 1
            moved = True
        if final and state["offset"] >= limit and not state["truncated"]:
            self.store.append_log(a.key.job_id, a.key.attempt, a.key.rank, state["seq"],
                                  f"\n[fedbroker: log truncated at {limit} bytes]\n")
            state["seq"] += 1
            state["truncated"] = moved = True
        if moved:
            tmp = meta.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, meta)

    def _report_end(self, a) -> bool:
        """Record the end of a local attempt's rank and, when every rank has ended, the job's outcome.

        Returns True once recorded (or when the attempt is no longer the job's), False if the
        store could not be updated (the attempt is kept and reported again next step)."""
        now = utcnow()
        key = a.key
        code = a.exit_code if a.status == "exited" else None
        for _ in range(10):
            with self.store.session() as s:
                j = s.get(Job, key.job_id)
                att = s.execute(select(Attempt).where(Attempt.job_id == key.job_id, Attempt.number == key.attempt)
                                .with_for_update()).scalar_one_or_none()
                if j is None or att is None:
                    return True
                exits = dict(att.rank_exits or {})
                exits[str(key.rank)] = code if code is not None else "lost"
                att.rank_exits = exits
                if j.attempt != key.attempt or j.state not in (S.starting.value, S.running.value):
                    if att.ended_at is None:
                        att.ended_at, att.outcome = now, att.outcome or "stale"
                    return True
                nranks = len((j.placement or {}).get("nodes", [])) or 1
                if j.state == S.starting.value:  # ended before the dispatch marked it running
                    if not JobStore.cas(s, j.id, j.version, S.starting.value, S.running.value,
                                        f"running on {self.name}", now, started_at=j.started_at or now):
                        continue
                    j = s.get(Job, key.job_id)
                    s.refresh(j)
                if att.started_at is None:
                    att.started_at = now
                failed = code is None or code != 0
                if len(exits) < nranks:
                    if failed and not j.stop_reason and not j.cancel_requested:
                        # all or nothing: stop the other ranks
                        JobStore.bump(s, j.id, j.version, now, stop_reason="peer-ended",
                                      reason=f"rank {key.rank} on {self.name} ended ({exits[str(key.rank)]}); "
                                             "stopping the other ranks")
                    return True
                att.ended_at = now
                att.exit_code = code
                if j.cancel_requested:
                    att.outcome = "cancelled"
                    ok = JobStore.cas(s, j.id, j.version, S.running.value, S.cancelled.value,
                                      "cancelled by user; process stopped", now, finished_at=now, exit_code=code)
                elif j.stop_reason == "preempt" or code is None:
                    att.outcome = "interrupted"
                    why = ("preempted by a higher-priority job" if j.stop_reason == "preempt"
                           else f"process lost on {self.name}")
                    ok = requeue_lost(s, j, now, why, "interrupted",
                                      max_attempts=None if j.stop_reason == "preempt" else self.settings.max_attempts)
                elif all(v == 0 for v in exits.values()):
                    att.outcome = "succeeded"
                    ok = JobStore.cas(s, j.id, j.version, S.running.value, S.succeeded.value,
                                      "exit code 0", now, finished_at=now, exit_code=0)
                else:
                    att.outcome = "failed"
                    bad = {r: c for r, c in exits.items() if c != 0}
                    ok = JobStore.cas(s, j.id, j.version, S.running.value, S.failed.value,
                                      f"exit code {code} on {self.name}" if nranks == 1
                                      else f"ranks ended with {bad}", now, finished_at=now, exit_code=code)
                if ok:
                    return True
        log.error("could not record the end of %s attempt %d rank %d; retrying", key.job_id, key.attempt, key.rank)
        return False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Heartbeat once, then supervise in a background thread until :meth:`stop`."""
        self.heartbeat()
        self._thread = threading.Thread(target=self._loop, name=f"agent-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(SUPERVISE_S):
            try:
                self.supervise_once()
            except Exception:
                log.exception("supervision step failed")

    def stop(self) -> None:
        """Stop supervising (running jobs keep running under their shims)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


@shared_task(name="fedbroker.agent.run_attempt", ignore_result=True, acks_late=True)
def run_attempt(job_id: str, attempt: int, rank: int = 0) -> str:
    """Celery entry point on ``node.<name>``: start the attempt on this process's agent."""
    return current_agent().run_attempt(job_id, attempt, rank)
