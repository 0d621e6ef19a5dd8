"""The line that stands for the bytes dropped from the middle of a job's log (issue #20 item 3).

A log over its cap keeps its head and its tail, where a crash's traceback is: the node's shim
(``workers/shim.py``, ``log_max_bytes``) and the store (:mod:`broker.service.log_budget`: the per-attempt cap
and the team's ``quotas.log_bytes`` budget) both put this one line between them. Pure; no imports beyond the
standard library, so the shim loads it at once.
"""

from __future__ import annotations

import re

__all__ = ["dropped_marker", "dropped_bytes", "MARKER_MAX_BYTES"]

#: the most bytes :func:`dropped_marker` takes (a 20-digit count: 57)
MARKER_MAX_BYTES = 64

_MARKER_RE = re.compile(r"\n\[fedbroker: \.\.\. (\d{1,20}) bytes dropped \.\.\.\]\n")


def dropped_marker(n: int) -> str:
    """``"\\n[fedbroker: ... 1234 bytes dropped ...]\\n"``: ``n`` (>= 0) bytes of output were dropped here."""
    return f"\n[fedbroker: ... {int(n)} bytes dropped ...]\n"


def dropped_bytes(text: str) -> int:
    """The bytes the markers in ``text`` stand for (0: nothing was dropped). A job that prints the marker itself
    only misreports its own log."""
    return sum(int(m.group(1)) for m in _MARKER_RE.finditer(text))
