"""At most one log line per interval for a condition that repeats (Redis down, seen by every submit)."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable


class LogThrottle:
    """``due()`` is true at most once per ``interval_s`` seconds of ``clock`` (default the monotonic clock, s),
    thread-safe; the first call is due. Use: ``if throttle.due(): log.warning(...)``."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = float(interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -math.inf

    def due(self) -> bool:
        """Whether to log now (and if so, the next line waits ``interval_s``)."""
        now = self._clock()
        with self._lock:
            if now - self._last < self.interval_s:
                return False
            self._last = now
            return True
