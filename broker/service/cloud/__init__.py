"""The cloud side of the live broker: provision a placed job's instances, hear from them, watch them, tear them down.

Flow of a cloud attempt (ARCHITECTURE.md §3 and §5)::

    planner: queued -> provisioning (placement = the chosen offer)          broker.service.cycle
    fedbroker.provision -> CloudBroker.provision: failover, intent rows     .provision
    instance user data reports running / notice / exited                    .reports
        -> what the end of a rank means for the job                         broker.service.lifecycle
    reconciler -> CloudBroker.watch: cancels, gone instances, stop windows,
        silent ranks, dead rows, the orphan sweep                           .watch

Modules:

* :mod:`.adapters` — provider adapters from settings, through :mod:`providers.registry`;
* :mod:`.provision` — failover options and provisioning (intent rows first);
* :mod:`.reports` — instance reports and per-rank report tokens;
* :mod:`.watch` — watch, teardown, sweep, silent ranks;
* :mod:`.cooldown` — offers that just failed are not chosen again for a while;
* :mod:`.broker` — :class:`CloudBroker`, the one object callers hold (the parts share adapters, the token
  key and the watch clocks).

Instance rows (``cloud_instances``) move through the states of :mod:`broker.instance_states`, with
history; their SQL is :mod:`broker.service.store.cloud`.
"""

from broker.instance_states import LIVE_INSTANCE_STATES
from broker.service.cloud.adapters import build_computes, offer_allowed
from broker.service.cloud.broker import CloudBroker
from broker.service.cloud.provision import failover_options
from broker.service.cloud.reports import LOG_TAIL_MAX, REPORT_EVENTS, ReportError, report_token
from broker.service.cloud.watch import NOT_FOUND_GRACE_S

#: cloud_instances states whose instance may still exist (:data:`broker.instance_states.LIVE_INSTANCE_STATES`)
LIVE_ROW_STATES = LIVE_INSTANCE_STATES

__all__ = ["build_computes", "offer_allowed", "failover_options", "CloudBroker", "report_token", "ReportError",
           "REPORT_EVENTS", "LIVE_ROW_STATES", "LOG_TAIL_MAX", "NOT_FOUND_GRACE_S"]
