"""The queued-jobs quotas as the store enforces them: the error a submit over ``quotas.max_queued_jobs`` (unfinished
jobs) or ``quotas.max_queued_spec_bytes`` (bytes of their stored specs) raises.

The store counts a team's unfinished jobs and sums their spec bytes in the submit's own transaction
(:meth:`broker.service.store.core.JobStore.submit`; on PostgreSQL the ``team_usage`` counters, migrations 0007 and
0017); the rate limit and the API's answer (429 with ``Retry-After``) are :mod:`broker.service.limits`, which
re-exports these names.
"""

from __future__ import annotations

import json

__all__ = ["LimitExceeded", "QuotaExceeded", "ScheduleCapExceeded", "quota_exceeded", "spec_bytes_exceeded",
           "queue_refusal", "spec_bytes"]


class LimitExceeded(Exception):
    """A team hit one of its limits; answered 429 with ``Retry-After: retry_after_s``.

    Attributes:
        limit: the dotted setting that refused (``"quotas.submits_per_s"``, ``"quotas.max_queued_jobs"``,
            ``"quotas.max_queued_spec_bytes"``, ``"quotas.max_schedules"``).
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
    """The team would hold more unfinished jobs than ``quotas.max_queued_jobs``, or more bytes of their specs than
    ``quotas.max_queued_spec_bytes`` (:attr:`limit` says which); nothing of the submit was stored."""


def spec_bytes(dumped: dict) -> int:
    """The bytes a job's spec takes in the store, as ``quotas.max_queued_spec_bytes`` counts them: the UTF-8 length
    of ``json.dumps(dumped)`` (``dumped`` = ``JobSpec.model_dump(mode="json")``), the text the driver writes into
    ``jobs.spec`` (psycopg's and SQLAlchemy's default JSON serializer; ASCII, non-ASCII as ``\\uXXXX``): PostgreSQL's
    ``octet_length(spec::text)`` (the ``team_usage`` triggers) and SQLite's ``length(CAST(spec AS BLOB))``."""
    return len(json.dumps(dumped).encode())


def quota_exceeded(team: str, limit: int, unfinished: int, n: int, retry_after_s: int) -> QuotaExceeded:
    """The :class:`QuotaExceeded` for ``team`` holding ``unfinished`` jobs and asking for ``n`` more."""
    return QuotaExceeded(
        f"quotas.max_queued_jobs: team {team!r} may hold {limit} unfinished jobs and holds {unfinished}; "
        f"{'this submit' if n == 1 else f'these {n} jobs'} would exceed it (retry after {retry_after_s} s, "
        f"or cancel jobs)", "quotas.max_queued_jobs", retry_after_s)


def spec_bytes_exceeded(team: str, limit: int, held: int, n: int, new_bytes: int,
                        retry_after_s: int) -> QuotaExceeded:
    """The :class:`QuotaExceeded` (``limit="quotas.max_queued_spec_bytes"``) for ``team`` whose unfinished jobs hold
    ``held`` bytes of spec (:func:`spec_bytes`) asking for ``n`` more jobs of ``new_bytes`` bytes in all."""
    return QuotaExceeded(
        f"quotas.max_queued_spec_bytes: team {team!r} may hold {limit} bytes of unfinished jobs' specs and holds "
        f"{held}; {'this submit' if n == 1 else f'these {n} jobs'} ({new_bytes} bytes) would exceed it (retry after "
        f"{retry_after_s} s, or cancel jobs; a spec's bytes are its stored JSON)", "quotas.max_queued_spec_bytes",
        retry_after_s)


def queue_refusal(team: str, max_unfinished: int | None, max_spec_bytes: int | None, unfinished: int, held_bytes: int,
                  new_rows: list[dict], retry_after_s: int) -> QuotaExceeded | None:
    """Why the ``new_rows`` (``jobs`` rows, their ``spec`` as stored) just inserted put ``team`` over its queue quotas,
    ``None`` when they fit: ``unfinished`` jobs and ``held_bytes`` spec bytes are the team's counts with them
    (``team_usage`` after the insert). The job count (``quotas.max_queued_jobs``) is checked first, then the spec
    bytes (``quotas.max_queued_spec_bytes``); ``None`` or 0 = unlimited."""
    n = len(new_rows)
    if max_unfinished and unfinished > max_unfinished:
        return quota_exceeded(team, max_unfinished, unfinished - n, n, retry_after_s)
    if max_spec_bytes and held_bytes > max_spec_bytes:
        new_bytes = sum(spec_bytes(r["spec"]) for r in new_rows)
        return spec_bytes_exceeded(team, max_spec_bytes, held_bytes - new_bytes, n, new_bytes, retry_after_s)
    return None


class ScheduleCapExceeded(LimitExceeded):
    """The team already holds ``quotas.max_schedules`` schedules (enabled or paused); nothing was stored. No
    ``retry_after_s``: waiting frees no place (the SDK raises at once instead of retrying)."""

    def __init__(self, team: str, limit: int, held: int):
        super().__init__(f"quotas.max_schedules: team {team!r} may hold {limit} schedules and holds {held}; "
                         f"delete one first (fedbroker schedule delete) or ask for a higher quota",
                         "quotas.max_schedules", None)
