"""Celery tasks of the central broker. Each is short and idempotent ("advance this"); they run on this
process's parts (:data:`broker.service.wiring.services`, the composition root).

* ``fedbroker.plan`` — one planning cycle (:class:`broker.service.cycle.PlanningCycle`) under the
  planner's Redis lock (TTL ``planner_lock_ttl_s``; :mod:`broker.service.planner_lock`: a value the broker did
  not write, or a longer TTL, is overridden); the database fence makes a second
  planner harmless even if the lock is lost (Redis restarted).
* ``fedbroker.reconcile`` — one reconciler pass (:class:`broker.service.reconciler.Reconciler`).
* ``fedbroker.provision(job_id, attempt)`` — create a ``provisioning`` job's cloud instances
  (:meth:`broker.service.cloud.CloudBroker.provision`, under a per-job Redis lock); without a configured
  provider adapter the job goes back to the queue with the reason. The planning cycle and the reconciler
  send it straight to the provisioning queue (:func:`broker.service.wiring.send_provision`); on-prem jobs
  need no message (node agents poll ``GET /v1/node/work``).
* ``fedbroker.teardown(job_id, attempt)`` — terminate an ended cloud attempt's instances.
* ``fedbroker.signals_refresh`` — fetch the live signal sources of every configured zone whose period this
  process claims (:meth:`broker.service.signal_cache.SignalCache.refresh_all`: one fetch per zone per period
  however many workers run); a planning cycle is requested when new values came in.
* ``fedbroker.dispatch(job_id, attempt)`` — the relay of earlier releases (forwards to provisioning); kept
  registered for one release so messages already on the ``dispatch`` queue still run. Remove it next release.

:func:`broker.service.wiring.kick_planner` asks for a cycle soon (debounced through a Redis key) — the API
calls it after a submit, agents after a job ends.
"""

from __future__ import annotations

import logging

import redis
from celery import shared_task

from broker.service.celery_app import get_app
from broker.service.planner_lock import PLANNER_LOCK as _PLANNER_LOCK_KEY
from broker.service.planner_lock import PlannerLock, lock_key
from broker.service.wiring import kick_planner, services

__all__ = ["plan", "reconcile", "dispatch", "provision", "teardown", "signals_refresh"]

log = logging.getLogger("fedbroker.tasks")
PLANNER_LOCK = _PLANNER_LOCK_KEY  # defined once, in broker.service.planner_lock
#: a planning cycle at least this long is logged at INFO even when it decided nothing, seconds
SLOW_CYCLE_S = 0.25
#: seconds one ``signals_refresh`` may start new zones for; the zones left are taken at the next tick (60 s), so
#: feeds that time out hold a worker that also plans for about this long plus one zone's fetch at most
SIGNALS_BUDGET_S = 20.0


_lock: tuple | None = None  # (redis client, ttl_s, PlannerLock) of this process


def _planner_lock() -> PlannerLock:
    """This process's :class:`PlannerLock` on ``services.redis``, keyed from the store's ``instance_secret``
    (made again when the Redis client or ``planner_lock_ttl_s`` changed)."""
    global _lock
    r, ttl = services.redis, services.settings.planner_lock_ttl_s
    if _lock is None or _lock[0] is not r or _lock[1] != ttl:
        _lock = (r, ttl, PlannerLock(r, lock_key(services.store.instance_secret()), ttl))
    return _lock[2]


@shared_task(name="fedbroker.plan", ignore_result=True)
def plan() -> dict:
    """One planning cycle if this worker gets the leader lock; returns a summary."""
    st = services.settings
    lock = _planner_lock()
    token = lock.acquire()
    if token is None:
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
            if not lock.release(token):
                log.warning("planner lock expired during the cycle (TTL %.0f s); the fence kept it safe",
                            st.planner_lock_ttl_s)
        except redis.RedisError as e:
            log.warning("could not release the planner lock (%s); it lapses in %.0f s", e, st.planner_lock_ttl_s)
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
    """Forward a ``provisioning`` job's attempt to the provisioning queue (idempotent).

    Kept registered for one release only, for the messages an earlier release queued on the ``dispatch``
    queue: placements now go straight to ``fedbroker.provision`` (:func:`broker.service.wiring.send_provision`)."""
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


@shared_task(name="fedbroker.signals_refresh", ignore_result=True)
def signals_refresh() -> dict:
    """Fetch the live signals whose refresh period this process claims, starting no zone after
    :data:`SIGNALS_BUDGET_S`; returns ``{"zone kind": summary}``."""
    out = {}
    fetched = False
    cache = services.signal_cache
    results = cache.refresh_all(budget_s=SIGNALS_BUDGET_S)
    if cache.settings.cloud_enabled:
        results += cache.refresh_cloud()
    for r in results:
        if r.claimed:
            out[f"{r.zone} {r.kind}"] = {"fetched": r.fetched, "errors": r.errors, "skipped": r.skipped}
            fetched |= bool(r.fetched)
    if out:
        log.info("signals refresh: %s", out)
    if fetched:
        kick_planner()
    return out
