"""The composition root of the live broker: every process builds its parts here, from its settings.

* :data:`services` — this process's store, Redis client, planning environment, planning cycle,
  reconciler, cloud broker and live signal cache, each built on first use from the Celery app's settings
  (:func:`broker.service.celery_app.get_app`). The Celery tasks (:mod:`broker.service.tasks`) run on it.
* :func:`build_api` — one API process: a submit, an agent's or an instance's report wakes the planner
  (:func:`kick_planner`), cloud instances report to it, the Redis rate limit and ``/healthz``'s Redis check.
  :func:`app_from_settings` is its uvicorn factory; ``fedbroker serve api`` (also with ``--workers N``)
  builds each process through :func:`build_api`.
* The messages the parts are wired with: :func:`kick_planner` (a planning cycle soon, debounced),
  :func:`send_provision` (a placed cloud job straight to the provisioning queue) and :func:`send_teardown`.

It lives in the service, not in :mod:`broker.cli`: the Celery worker and uvicorn's worker processes build
their parts without the CLI, and the import rules let the CLI call the service, never the reverse.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from functools import partial

import redis

from broker.service.celery_app import get_app
from broker.service.log_throttle import LogThrottle
from broker.service.settings import BrokerSettings

__all__ = ["Services", "services", "build_api", "app_from_settings", "kick_planner", "send_provision",
           "send_teardown", "KICK_KEY"]

log = logging.getLogger("fedbroker.tasks")  # the planner kick's warnings keep the logger name they had
#: the Redis key of the cross-process planner-kick debounce (:func:`kick_planner`)
KICK_KEY = "fedbroker:plan-kick"
#: monotonic instant of this process's last planner kick (:func:`kick_planner`)
_last_kick = -1e9


def _cloud_broker(store, settings: BrokerSettings, offers=(), priced=None):
    """The cloud broker for ``settings`` (``offers``: the catalog provisioning fails over in; none in an
    API process, which only takes the instances' reports; ``priced``: ``now_s -> offers`` with live cloud prices),
    or ``None`` when no cloud provider is configured."""
    if not settings.cloud_providers:
        return None
    from broker.service.cloud import CloudBroker

    return CloudBroker(store, settings, offers=offers, teardown=send_teardown, priced=priced)


class Services:
    """Per-process store, planning environment and Redis client, each built on first use.

    An API process only ever touches ``redis`` (to wake the planner), so it never loads the
    offer catalog and grid signals the planning environment needs."""

    _BUILDERS = ("settings", "store", "redis", "env", "cycle", "reconciler", "cloud", "signal_cache", "schedulers")

    def __init__(self):
        self._lock = threading.RLock()

    def __getattr__(self, name):
        if name not in self._BUILDERS:
            raise AttributeError(name)
        with self._lock:
            if name not in self.__dict__:
                self.__dict__[name] = getattr(self, f"_build_{name}")()
            return self.__dict__[name]

    def _build_settings(self) -> BrokerSettings:
        return get_app().fedbroker_settings

    def _build_store(self):
        from broker.service import ledger
        from broker.service.store.core import JobStore

        # the usage ledger prices with this process's planning environment (built on first metering): the
        # cluster file's pools, the offers, the live signals and cloud price cache the planner uses
        ledger.configure(self.settings.cluster, build=self.ledger_prices)
        return JobStore.from_settings(self.settings)

    def _build_redis(self):
        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=5, socket_connect_timeout=5)

    def _build_env(self):
        from broker.service.cloud import offer_allowed
        from broker.service.live import LiveEnvironment

        from broker.service import ledger

        st = self.settings
        signals = (st.signals, self.signal_cache) if st.signals.enabled or st.signals.cloud_enabled else None
        env = LiveEnvironment(st.planner, st.cluster, st.cloud_providers, offer_allowed=partial(offer_allowed, st),
                              signals=signals)
        ledger.install(ledger.LedgerPrices.from_environment(env))  # one load of the offers and signals
        return env

    def ledger_prices(self):
        """The usage ledger's prices (:class:`broker.service.ledger.LedgerPrices`) of this process: its planning
        environment's (:attr:`env`; building it installs them), so the worker's watch and reconciler and the API's
        instance and node reports meter at the live prices and signals the planner used."""
        from broker.service import ledger

        return ledger.LedgerPrices.from_environment(self.env)

    def _build_signal_cache(self):
        """The live signal cache (:mod:`broker.service.signal_cache`) on this process's store and Redis."""
        from broker.service.signal_cache import SignalCache

        return SignalCache(self.store, self.redis, self.settings.signals)

    def _build_cycle(self):
        from broker.service.cycle import PlanningCycle

        leader = f"{socket.gethostname()}:{os.getpid()}"
        return PlanningCycle(self.store, self.env, self.settings, dispatch=send_provision, leader=leader,
                             cloud=self.cloud, schedulers=self.schedulers)

    def _build_reconciler(self):
        from broker.service.reconciler import Reconciler

        return Reconciler(self.store, self.settings, dispatch=send_provision, cloud=self.cloud,
                          schedulers=self.schedulers)

    def _build_schedulers(self):
        """The pools of existing schedulers in the cluster file (``kind: slurm``), or ``None`` when it has none.
        Read from the cluster file itself, not the planning environment: a process that only reconciles never
        loads the offer catalog and grid signals for it."""
        from broker.cluster import load_cluster
        from broker.service.live import LIVE_CLUSTER_PATH
        from broker.service.schedulers import SchedulerPools

        pools = SchedulerPools(load_cluster(self.settings.cluster or LIVE_CLUSTER_PATH), self.settings)
        return pools if pools else None

    def _build_cloud(self):
        """The cloud broker (provisioning fails over in the planning environment's offers), or ``None`` when no
        cloud provider is configured."""
        if not self.settings.cloud_providers:
            return None
        return _cloud_broker(self.store, self.settings, offers=self.env.offers, priced=self.env.offers_at)

    def reset(self):
        """Forget everything (tests, or after the settings changed), the usage ledger's prices built from it too."""
        from broker.service import ledger

        with self._lock:
            for k in self._BUILDERS:
                self.__dict__.pop(k, None)
        ledger.configure(None)


services = Services()


def build_api(settings: BrokerSettings):
    """The FastAPI app of one API process for ``settings``: submits, agents' and instances' reports wake the
    planner (:func:`kick_planner`, through the Celery app of ``settings``), cloud instances report to it when a
    cloud provider is configured, the Redis rate limit and ``/healthz``'s Redis check. Migrates nothing."""
    from broker.service.api import create_app, redis_client
    from broker.service.limits import RateLimiter
    from broker.service.store.core import JobStore

    from broker.service import ledger

    get_app(settings)
    store = JobStore.from_settings(settings)
    # cloud reports and node heartbeats end attempts here: meter them with the wiring's planning environment
    # (the live signal cache and cloud prices the planner uses), built on first metering
    ledger.configure(settings.cluster, build=services.ledger_prices)
    from broker.service.schedulers import PoolNotes

    return create_app(store, settings, on_submit=PlannerWake(), cloud=_cloud_broker(store, settings),
                      redis=redis_client(settings.redis_url), rate_limiter=RateLimiter.from_settings(settings),
                      pool_notes=PoolNotes(settings))


def app_from_settings():
    """The API for :func:`broker.service.settings.load_settings`
    (``uvicorn --factory broker.service.wiring:app_from_settings``): :func:`build_api` after bringing the
    store's schema to the latest migration (idempotent), so a fresh embedded SQLite trial needs no separate step.
    Raises :class:`broker.service.settings.SettingsError` naming a bad setting."""
    from broker.service.settings import load_settings
    from broker.service.store.core import JobStore

    settings = load_settings()
    JobStore.from_settings(settings).migrate()
    return build_api(settings)


class PlannerWake:
    """The API's ``on_submit``: wakes the planner (:func:`kick_planner`) from a thread of its own, so that a
    submit never waits on Redis (a Redis that accepts connections and never answers held each kick for its
    5 s socket timeout). Calls while a kick is under way are folded into one more kick after it."""

    def __init__(self) -> None:
        self._due = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def __call__(self, job_id: str | None = None) -> None:
        self._due.set()
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                    self._pid = os.getpid()
                    self._thread = threading.Thread(target=self._run, name="fedbroker-planner-wake", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            try:
                kick_planner()
            except Exception:  # noqa: BLE001 - beat plans anyway within plan_interval_s
                log.exception("waking the planner failed; beat will run a cycle")


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
        if _kick_failed_log.due():  # every submit kicks: one line a minute while Redis is down
            log.warning("could not request a planning cycle (%s); beat will run one (logged at most once a "
                        "minute)", e)
        return False


#: the kick's "could not request" warning: at most once a minute
_kick_failed_log = LogThrottle(60.0)


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


def send_provision(job_id: str, attempt: int) -> None:
    """Queue ``fedbroker.provision`` for a job placed on a cloud offer (the planning cycle's and the
    reconciler's dispatch): it goes straight to the provisioning queue."""
    get_app().send_task("fedbroker.provision", args=[job_id, attempt], queue="provisioning")


def send_teardown(job_id: str, attempt: int) -> None:
    """Queue ``fedbroker.teardown`` for an ended cloud attempt."""
    get_app().send_task("fedbroker.teardown", args=[job_id, attempt], queue="provisioning")
