"""The queued-jobs quota as the store enforces it: the error a submit over ``quotas.max_queued_jobs`` raises.

The store counts a team's unfinished jobs in the submit's own transaction
(:meth:`broker.service.store.core.JobStore.submit`); the rate limit and the API's answer (429 with
``Retry-After``) are :mod:`broker.service.limits`, which re-exports these names.
"""

from __future__ import annotations

__all__ = ["LimitExceeded", "QuotaExceeded", "ScheduleCapExceeded", "quota_exceeded"]


class LimitExceeded(Exception):
    """A team hit one of its limits; answered 429 with ``Retry-After: retry_after_s``.

    Attributes:
        limit: the dotted setting that refused (``"quotas.submits_per_s"``, ``"quotas.max_queued_jobs"``,
            ``"quotas.max_schedules"``).
        retry_after_s: whole seconds to wait before trying again (>= 1); ``None`` when waiting cannot help
            (the schedule cap: delete a schedule first), answered without ``Retry-After``.
    """

    def __init__(self, message: str, limit: str, retry_after_s: int | None):
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = None if retry_after_s is None else max(1, int(retry_after_s))

    def body(self) -> dict:
        """The 429 response body: ``{"detail", "limit", "retry_after_s"}``."""
        return {"detail": str(self), "limit": self.limit, "retry_after_s": self.retry_after_s}


class QuotaExceeded(LimitExceeded):
    """The team would hold more unfinished jobs than ``quotas.max_queued_jobs``."""


def quota_exceeded(team: str, limit: int, unfinished: int, n: int, retry_after_s: int) -> QuotaExceeded:
    """The :class:`QuotaExceeded` for ``team`` holding ``unfinished`` jobs and asking for ``n`` more."""
    return QuotaExceeded(
        f"quotas.max_queued_jobs: team {team!r} may hold {limit} unfinished jobs and holds {unfinished}; "
        f"{'this submit' if n == 1 else f'these {n} jobs'} would exceed it (retry after {retry_after_s} s, "
        f"or cancel jobs)", "quotas.max_queued_jobs", retry_after_s)


class ScheduleCapExceeded(LimitExceeded):
    """The team already holds ``quotas.max_schedules`` schedules (enabled or paused); nothing was stored. No
    ``retry_after_s``: waiting frees no place (the SDK raises at once instead of retrying)."""

    def __init__(self, team: str, limit: int, held: int):
        super().__init__(f"quotas.max_schedules: team {team!r} may hold {limit} schedules and holds {held}; "
                         f"delete one first (fedbroker schedule delete) or ask for a higher quota",
                         "quotas.max_schedules", None)
