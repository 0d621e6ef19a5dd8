"""The uids a root node agent gives its jobs (``jobs.uid_range``): one rule for the broker's settings
(:class:`broker.service.settings.JobsSettings`) and the node agent (:mod:`workers.isolation`).

Standard library only: the node's per-attempt supervisor process (:mod:`workers.shim`) imports it at each start.
"""

from __future__ import annotations

__all__ = ["DEFAULT_UID_RANGE", "MIN_UID_RANGE_SIZE", "check_uid_range"]

#: systemd's dynamic-user range (``DynamicUser=``), inclusive
DEFAULT_UID_RANGE = (61184, 65519)
#: the fewest ids a ``jobs.uid_range`` may hold
MIN_UID_RANGE_SIZE = 16
#: the largest uid a range may hold (uids are stored as 32-bit signed integers)
_MAX_ID = 2**31 - 1


def check_uid_range(value: object, field: str = "jobs.uid_range") -> tuple[int, int]:
    """``value`` as ``(lo, hi)``, inclusive. Raises ``ValueError`` naming ``field`` unless it is two ints with
    ``1 <= lo <= hi <= 2**31-1`` holding at least :data:`MIN_UID_RANGE_SIZE` ids (0, root, is never in it)."""
    if (isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
        shown = list(value) if isinstance(value, (list, tuple)) else value
        raise ValueError(f"{field}={shown!r}: must be [lo, hi], two integer uids")
    lo, hi = value
    if lo < 1 or hi > _MAX_ID:
        raise ValueError(f"{field}={list(value)!r}: must lie within 1..{_MAX_ID} (uid 0 is root)")
    if lo > hi:
        raise ValueError(f"{field}={list(value)!r}: lo must be <= hi")
    if hi - lo + 1 < MIN_UID_RANGE_SIZE:
        raise ValueError(f"{field}={list(value)!r}: holds {hi - lo + 1} ids, at least {MIN_UID_RANGE_SIZE} needed")
    return int(lo), int(hi)
