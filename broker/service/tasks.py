"""Celery tasks of the central broker. Each is short and idempotent ("advance this").

* ``fedbroker.plan`` — one planning cycle (:class:`broker.service.cycle.PlanningCycle`) under the
  planner's Redis lock (TTL ``planner_lock_ttl_s``); the database fence makes a second
  planner harmless even if the lock is lost (Redis restarted).
* ``fedbroker.reconcile`` — one reconciler pass (:class:`broker.service.reconciler.Reconciler`).
* ``fedbroker.dispatch(job_id, attempt)`` — hand a ``provisioning`` cloud job to the provisioning
  queue; a no-op otherwise (on-prem jobs need no message: node agents poll ``GET /v1/node/work``).
* ``fedbroker.provision(job_id, attempt)`` — create a ``provisioning`` job's cloud instances
  (:meth:`broker.service.cloud.CloudBroker.provision`, under a per-job Redis lock); without a configured
  provider adapter the job goes back to the queue with the reason.
* ``fedbroker.teardown(job_id, attempt)`` — terminate an ended cloud attempt's instances.

:func:`kick_planner` asks for a cycle soon (debounced through a Redis key) — the API
calls it after a submit, agents after a job ends.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis
from celery import shared_task

from broker.service.celery_app import get_app

__all__ = ["services", "kick_planner", "send_dispatch", "send_teardown", "plan", "reconcile", "dispatch", "provision",
           "teardown"]

log = logging.getLogger("fedbroker.tasks")
PLANNER_LOCK = "fedbroker:planner-lock"
KICK_KEY = "fedbroker:plan-kick"
#: a planning cycle at least this long is logged at INFO even when it decided nothing, seconds
SLOW_CYCLE_S = 0.25
#: monotonic instant of this process's last planner kick (:func:`kick_planner`)
_last_kick = -1e9


class _Services:
    """Per-process store, planning environment and Redis client, each built on first use.

    The API process only ever touches ``redis`` (to wake the planner), so it never loads the
    offer catalog and grid signals the planning environment needs."""

    _BUILDERS = ("settings", "store", "redis", "env", "cycle", "reconciler", "cloud")

    def __init__(self):
        self._lock = threading.RLock()

    def __getattr__(self, name):
        if name not in self._BUILDERS:
            raise AttributeError(name)
        with self._lock:
            if name not in self.__dict__:
                self.__dict__[name] = getattr(self, f"_build_{name}")()
            return self.__dict__[name]

    def _build_settings(self):
        return get_app().fedbroker_settings

    def _build_store(self):
        from broker.service.store.core import JobStore

        return JobStore.from_settings(self.settings)

    def _build_redis(self):
        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=5, socket_connect_timeout=5)

    def _build_env(self):
        from broker.service.live import LiveEnvironment

        from functools import partial

        from broker.service.cloud import offer_allowed

        st = self.settings
        return LiveEnvironment(st.planner, st.cluster, st.cloud_providers, offer_allowed=partial(offer_allowed, st))

    def _build_cycle(self):
        from broker.service.cycle import PlanningCycle

        leader = f"{socket.gethostname()}:{os.getpid()}"
        return PlanningCycle(self.store, self.env, self.settings, dispatch=send_dispatch, leader=leader,
                             cloud=self.cloud)

    def _build_reconciler(self):
        from broker.service.reconciler import Reconciler

        return Reconciler(self.store, self.settings, dispatch=send_dispatch, cloud=self.cloud)

    def _build_cloud(self):
        """The cloud broker, or ``None`` when no cloud provider is configured."""
        if not self.settings.cloud_providers:
            return None
        from broker.service.cloud import CloudBroker

        return CloudBroker(self.store, self.settings, offers=self.env.offers, teardown=send_teardown)

    def reset(self):
        """Forget everything (tests, or after the settings changed)."""
        with self._lock:
            for k in self._BUILDERS:
                self.__dict__.pop(k, None)


services = _Services()


def kick_planner(debounce_ms: int = 200) -> bool:
    """Ask for a planning cycle soon; at most one request per ``debounce_ms`` (per process without a
    Redis call, across processes by a Redis key). Returns whether one was sent now.

    A suppressed kick is not lost: the process arms one trailing kick at the end of the window (a
    daemon timer), so a job committed just after a cycle began its intake is planned within about
    ``debounce_ms`` rather than at beat's next ``plan_interval_s``."""
    global _last_kick
    now = time.monotonic()
    if now - _last_kick < debounce_ms / 1000:
        _arm_trailing_kick(_last_kick + debounce_ms / 1000 - now + 0.01, debounce_ms)  # just after the Redis key expires
        return False
    _last_kick = now
    try:
        if not services.redis.set(KICK_KEY, b"1", nx=True, px=debounce_ms):
            _arm_trailing_kick(debounce_ms / 1000 + 0.01, debounce_ms)
            return False
        get_app().send_task("fedbroker.plan", queue="planning")
        return True
    except (redis.RedisError, OSError) as e:  # beat plans anyway within plan_interval_s
        log.warning("could not request a planning cycle (%s); beat will run one", e)
        return False


_trailing_lock = threading.Lock()
#: this process's armed trailing kick (:func:`kick_planner`), or None
_trailing: threading.Timer | None = None


def _arm_trailing_kick(delay_s: float, debounce_ms: int) -> None:
    """Arm one trailing :func:`kick_planner` ``delay_s`` from now unless one is armed already."""
    global _trailing

    def fire() -> None:
        global _trailing, _last_kick
        with _trailing_lock:
            _trailing = None
        _last_kick = -1e9  # the window has passed; this kick goes to Redis
        kick_planner(debounce_ms)

    with _trailing_lock:
        if _trailing is not None:
            return
        _trailing = threading.Timer(max(delay_s, 0.0), fire)
        _trailing.daemon = True
        _trailing.start()


def send_dispatch(job_id: str, attempt: int) -> None:
    """Queue ``fedbroker.dispatch`` for a placed cloud job (it goes on to provisioning)."""
    get_app().send_task("fedbroker.dispatch", args=[job_id, attempt], queue="dispatch")


def send_teardown(job_id: str, attempt: int) -> None:
    """Queue ``fedbroker.teardown`` for an ended cloud attempt."""
    get_app().send_task("fedbroker.teardown", args=[job_id, attempt], queue="provisioning")


@shared_task(name="fedbroker.plan", ignore_result=True)
def plan() -> dict:
    """One planning cycle if this worker gets the leader lock; returns a summary."""
    st = services.settings
    lock = services.redis.lock(PLANNER_LOCK, timeout=st.planner_lock_ttl_s, blocking=False)
    if not lock.acquire(blocking=False):
        return {"skipped": "another planner holds the lock"}
    try:
        res = services.cycle.run()
        out = {"applied": res.applied, "stale": res.stale, "intake": res.intake, "decisions": res.decisions,
               "kinds": res.kinds, "dispatched": len(res.dispatched), "plan_s": round(res.plan_s, 4),
               "total_s": round(res.total_s, 4)}
        if res.decisions or res.intake or res.total_s >= SLOW_CYCLE_S:
            log.info("planning cycle: %s", out)
        return out
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:
            log.warning("planner lock expired during the cycle (TTL %.0f s); the fence kept it safe",
                        st.planner_lock_ttl_s)
        if services.cycle.intake_capped:  # a burst: take the next intake_per_cycle jobs at once
            try:
                get_app().send_task("fedbroker.plan", queue="planning")
            except Exception as e:  # noqa: BLE001 - beat plans anyway within plan_interval_s
                log.warning("could not request the next planning cycle (%s); beat will run one", e)


@shared_task(name="fedbroker.reconcile", ignore_result=True)
def reconcile() -> dict:
    """One reconciler pass; requests a planning cycle when it changed anything."""
    out = services.reconciler.run()
    if out.get("changed"):
        kick_planner()
    return out


@shared_task(name="fedbroker.dispatch", ignore_result=True)
def dispatch(job_id: str, attempt: int) -> str:
    """Forward a ``provisioning`` job's attempt to the provisioning queue (idempotent)."""
    from broker.service.store.core import JobStore

    with services.store.session() as s:
        j = JobStore.job_row(s, job_id)
        if j is not None and j.state == "provisioning" and j.attempt == attempt:
            get_app().send_task("fedbroker.provision", args=[job_id, attempt], queue="provisioning")
            return "sent to provisioning"
    return "stale"


@shared_task(name="fedbroker.provision", ignore_result=True)
def provision(job_id: str, attempt: int) -> str:
    """Create a ``provisioning`` job's cloud instances (idempotent; one run per job at a time)."""
    from broker.service.store.core import JobStore

    cloud = services.cloud
    if cloud is None:
        with services.store.session() as s:
            j = JobStore.job_row(s, job_id)
            if j is None or j.state != "provisioning" or j.attempt != attempt:
                return "stale"
            JobStore.cas(s, j.id, j.version, "provisioning", "queued",
                         f"no adapter for provider {(j.placement or {}).get('provider')!r} is configured")
        return "requeued"
    # a provision message delivered twice (re-sent by the reconciler) must not run alongside the first
    lock = services.redis.lock(f"fedbroker:provision:{job_id}:{attempt}", timeout=900, blocking=False)
    if not lock.acquire(blocking=False):
        return "already provisioning"
    try:
        out = cloud.provision(job_id, attempt)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:
            pass
    log.info("provision %s attempt %d: %s", job_id, attempt, out)
    kick_planner()
    return out


@shared_task(name="fedbroker.teardown", ignore_result=True)
def teardown(job_id: str, attempt: int) -> str:
    """Terminate the instances of an ended cloud attempt (idempotent)."""
    cloud = services.cloud
    if cloud is None:
        return "no cloud provider configured"
    return f"{cloud.teardown(job_id, attempt)} instance(s) terminated"
