"""The Celery application of the live broker (Redis transport).

Queues:

* ``planning`` — ``fedbroker.plan`` (one planning cycle, under the leader lock) and
  ``fedbroker.reconcile`` (lost nodes, state deadlines, re-dispatch, recurring runs);
* ``provisioning`` — ``fedbroker.provision`` and ``fedbroker.teardown`` (cloud instances: create calls take
  seconds, a GCE operation up to ``gcp.operation_timeout_s``; run a worker of its own on this queue in production),
  and ``fedbroker.signals_refresh`` (live signal fetches: network calls of seconds, kept off the planning queue).
  A placed cloud job goes straight here (on-prem jobs need no message: node agents poll the node API,
  :mod:`broker.service.node_api`);
* ``dispatch`` — only ``fedbroker.dispatch``, the relay to provisioning of earlier releases: declared for one
  release so messages already queued there still run; remove it with the task next release.

Rules from ARCHITECTURE.md §5: every task is short and idempotent; ``acks_late`` with
prefetch 1, so a task whose worker dies is delivered again; nothing is ever
parked in ``eta``/``countdown`` (deferred starts are ``jobs.not_before`` in the
database); results are not kept (``task_ignore_result``; expiry 1 h for any that are).
The Redis ``visibility_timeout`` is 300 s: tasks take milliseconds, so a message
unacknowledged for 5 minutes belongs to a dead worker and is delivered again.
Beat sends ``plan`` every ``plan_interval_s``, ``reconcile`` every
``reconcile_interval_s`` and, when the ``signals:`` section configures a zone or cloud price regions,
``signals_refresh`` every
:data:`SIGNALS_TICK_S`; two beats running at once are harmless (both tasks are
idempotent and the planner is fenced).
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from broker.service.settings import BrokerSettings, load_settings

__all__ = ["make_celery", "get_app", "SIGNALS_TICK_S", "quiet_root_warning"]

#: seconds between beat's ``fedbroker.signals_refresh`` ticks; each zone is fetched once per its own
#: ``signals.refresh_s`` period (>= 60 s) whatever the tick (broker.service.signal_cache)
SIGNALS_TICK_S = 60.0

_APP: Celery | None = None


def make_celery(settings: BrokerSettings) -> Celery:
    """A configured Celery app for ``settings`` (tasks from :mod:`broker.service.tasks`)."""
    app = Celery("fedbroker", broker=settings.redis_url, include=["broker.service.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_expires=3600,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options={"visibility_timeout": 300},
        task_default_queue="planning",
        task_queues=[Queue("planning"), Queue("dispatch"), Queue("provisioning")],
        task_routes={
            "fedbroker.plan": {"queue": "planning"},
            "fedbroker.reconcile": {"queue": "planning"},
            "fedbroker.dispatch": {"queue": "dispatch"},
            "fedbroker.provision": {"queue": "provisioning"},
            "fedbroker.teardown": {"queue": "provisioning"},
            "fedbroker.signals_refresh": {"queue": "provisioning"},
        },
        beat_schedule={
            "plan": {"task": "fedbroker.plan", "schedule": settings.plan_interval_s,
                     "options": {"expires": max(settings.plan_interval_s * 2, 5.0)}},
            "reconcile": {"task": "fedbroker.reconcile", "schedule": settings.reconcile_interval_s,
                          "options": {"expires": max(settings.reconcile_interval_s * 2, 10.0)}},
            **({"signals": {"task": "fedbroker.signals_refresh", "schedule": SIGNALS_TICK_S,
                            "options": {"expires": SIGNALS_TICK_S}}}
               if settings.signals.enabled or settings.signals.cloud_enabled else {}),
        },
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    app.fedbroker_settings = settings
    return app


def get_app(settings: BrokerSettings | None = None) -> Celery:
    """The process-wide app (built from ``settings`` or :func:`load_settings` on first use)."""
    global _APP
    if _APP is None or settings is not None:
        _APP = make_celery(settings or load_settings())
    return _APP


#: the start of Celery's warning for a worker run as root (``celery.platforms.ROOT_DISCOURAGED``, Celery 5.x)
ROOT_WARNING_START = "You're running the worker with superuser privileges"


def quiet_root_warning(app: Celery) -> bool:
    """Silence Celery's 8-line ``SecurityWarning`` "You're running the worker with superuser privileges: this is
    absolutely not recommended!" for ``app``'s worker, and only it, when ``app`` accepts JSON messages only.

    Why this is safe: the warning is about a root worker that unpickles messages (Celery refuses to start one
    that accepts pickle, ``ROOT_DISALLOWED``); ours accepts ``json`` only, and the worker and beat run the broker's
    own tasks (planning, reconciling, cloud calls), never a job's code: jobs run under the node agent with
    per-attempt uids, in a scheduler's pool or on cloud instances. The one-machine recipe (``serve all`` as root,
    so its agent can give jobs their own uids) printed it into every log. Returns whether it was silenced (an app
    that accepts anything but JSON keeps the warning and Celery's own refusal)."""
    import warnings

    from celery.exceptions import SecurityWarning

    if set(app.conf.accept_content or ()) - {"json", "application/json"}:
        return False
    warnings.filterwarnings("ignore", message=ROOT_WARNING_START, category=SecurityWarning)
    return True
