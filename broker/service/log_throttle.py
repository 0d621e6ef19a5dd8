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


class KeyedLogThrottle:
    """``due(key)`` is true at most once per ``interval_s`` seconds of ``clock`` (s) *for each key* (a client
    address: one line a minute per address), thread-safe; a key's first call is due.

    It remembers at most ``max_keys`` keys: keys whose interval has passed are forgotten first (oldest first,
    amortised O(1)); when all ``max_keys`` are still within their interval, a new key is not due, so a flood of
    distinct keys (many IPv6 addresses) logs at most ``max_keys`` lines per interval and holds bounded memory."""

    def __init__(self, interval_s: float = 60.0, max_keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        if max_keys < 1:
            raise ValueError(f"max_keys={max_keys!r}: must be >= 1")
        self.interval_s = float(interval_s)
        self.max_keys = int(max_keys)
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict = {}  # key -> when it was last due; insertion order is time order (a due key is moved last)

    def __len__(self) -> int:
        return len(self._last)

    def due(self, key) -> bool:
        """Whether to log now for ``key`` (and if so, its next line waits ``interval_s``)."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                return False
            while self._last:  # forget the keys whose interval has passed, oldest first
                oldest = next(iter(self._last))
                if now - self._last[oldest] < self.interval_s:
                    break
                del self._last[oldest]
            if len(self._last) >= self.max_keys:
                return False
            self._last[key] = now
            return True
