"""The facade: :class:`CloudBroker`, one object over the cloud parts.

Callers (the API's instance reports, the provisioning and teardown tasks, the reconciler, ``fedbroker cloud
sweep``) hold one object because the parts share state: the provider adapters, the report-token key read
once per process, the teardown callback, and the watch's poll and sweep clocks. Each part lives in its own
module and is mixed in here: :class:`.provision.Provisioning`, :class:`.reports.Reports`,
:class:`.watch.Watching`, :class:`.cooldown.Cooldown`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from broker.service.cloud.adapters import build_computes
from broker.service.cloud.cooldown import Cooldown
from broker.service.cloud.provision import Provisioning
from broker.service.cloud.reports import Reports
from broker.service.cloud.watch import Watching
from broker.service.store.core import JobStore
from providers.base import Compute

__all__ = ["CloudBroker"]

log = logging.getLogger("fedbroker.cloud")


class CloudBroker(Provisioning, Reports, Watching, Cooldown):
    """Provisioning, reports, watching and sweeping of cloud instances (see :mod:`broker.service.cloud`).

    Args:
        store: the job store.
        settings: :class:`broker.service.settings.BrokerSettings` (``cloud``, ``aws``, ``gcp``, ``max_attempts``).
        offers: every ``CloudOffer`` the planner knows (failover options are taken from them).
        priced: ``now_s -> offers`` in the same order, priced for that instant (the live environment's
            :meth:`broker.service.live.LiveEnvironment.offers_at`: live cloud prices where configured); default:
            ``offers`` as given.
        computes: provider name -> adapter; default :func:`.adapters.build_computes` (settings).
        teardown: ``teardown(job_id, attempt)`` asks for an attempt's instances to be terminated soon
            (a Celery task in the broker); default: terminate here and now.
        canon: canonical GPU type names (default ``pricing.power.canonical_or_same``).
        sleep: for throttling back-off (tests pass a recorder).
    """

    def __init__(self, store: JobStore, settings, offers: Iterable = (), computes: dict[str, Compute] | None = None,
                 teardown: Callable[[str, int], None] | None = None, canon: Callable[[str], str] | None = None,
                 sleep: Callable[[float], None] = time.sleep, priced: Callable[[float], list] | None = None):
        self.store = store
        self.settings = settings
        self.offers = list(offers)
        self._priced = priced
        self.computes = build_computes(settings) if computes is None else computes
        self._teardown_cb = teardown
        from pricing.power import canonical_or_same

        self.canon = canon or canonical_or_same
        self.sleep = sleep
        self._secret: bytes | None = None
        self._last_poll: dict[str, float] = {}
        host = (urlsplit(settings.effective_report_url).hostname or "").lower()
        if settings.cloud_providers and (host in ("localhost", "0.0.0.0", "::", "::1") or host.startswith("127.")):
            log.warning("cloud instances report to %s, a local address they cannot reach: set cloud.report_url to "
                        "an address of this broker's API reachable from the instances' subnets",
                        settings.effective_report_url)
        self._last_sweep = float("-inf")

    def offers_at(self, now_s: float) -> list:
        """The offers priced at ``now_s`` (POSIX s): ``priced(now_s)`` when given, else :attr:`offers`."""
        return self._priced(now_s) if self._priced is not None else self.offers
