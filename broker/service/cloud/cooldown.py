"""Offers that just failed cool down: the planner and the failover walk skip them for a while.

An offer is cooling while an instance record of it carries an error (``"Class: message"``) younger than
that error's cooldown: no capacity, a spot reclaim or a start timeout -> ``cloud.capacity_cooldown_s``;
quota or an unsupported option -> ``cloud.quota_cooldown_s``; another provider error (an outage) ->
``cloud.error_cooldown_s``. An attempt that created nothing does not count against ``max_attempts``: the
cooldown is the back-off.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from broker.service.store import cloud as instances
from broker.service.store.tables import utcnow

__all__ = ["Cooldown"]


class Cooldown:
    """The cooldown part of :class:`broker.service.cloud.CloudBroker`; needs ``self.settings``
    (:class:`broker.service.settings.BrokerSettings`)."""

    def cooldown_s(self, error: str | None) -> float:
        """Seconds an offer is not chosen again after an instance record with ``error`` (``"Class: message"``):
        ``capacity_cooldown_s`` after no capacity, a spot reclaim or a start timeout; ``quota_cooldown_s`` after a
        quota error or an option the provider does not support; ``error_cooldown_s`` after any other provider
        error (an outage); 0 for anything else (a plain teardown)."""
        c = self.settings.cloud
        kind = (error or "").split(":", 1)[0]
        if kind in ("NoCapacity", "Reclaimed", "StartTimeout"):
            return c.capacity_cooldown_s
        if kind in ("QuotaExceeded", "Unsupported"):
            return c.quota_cooldown_s
        if kind in ("ProviderError", "Throttled"):
            return c.error_cooldown_s
        return 0.0

    def cooling_offers(self, s, now: datetime) -> set[str]:
        """Offer ids not to choose now (inside session ``s``): an instance record of the offer failed or was
        lost within its cooldown (:meth:`cooldown_s`). The planner and the failover walk both skip them."""
        c = self.settings.cloud
        since = now - timedelta(seconds=max(c.capacity_cooldown_s, c.quota_cooldown_s, c.error_cooldown_s))
        return {offer_id for offer_id, err, at in instances.recent_errors(s, since)
                if (now - at).total_seconds() <= self.cooldown_s(err)}

    @staticmethod
    def mark_attempt(s, job_id: str, attempt: int, error: str, now: datetime | None = None) -> None:
        """Inside session ``s``: record ``error`` (``"Reclaimed: ..."``, ``"StartTimeout: ..."``) on every instance
        record of the attempt, so its offer cools down (:meth:`cooling_offers`) from ``now``; the teardown keeps it."""
        instances.mark_attempt_error(s, job_id, attempt, error, now or utcnow())
