"""A small in-process cache of authenticated API tokens, so a burst of requests does not cost one
database transaction per request for the token lookup.

Entries are keyed by the token's SHA-256 (:func:`broker.service.store.core.hash_token`; the token itself is not
kept), live ``ttl_s`` seconds and are evicted least-recently-used beyond ``max_entries``. Only
successful lookups are cached: a new token works at once, an unknown one is asked every time.
Revocation therefore takes effect within ``ttl_s`` (``settings.api_token_cache_s``, default 5 s) in
every API process; ``ttl_s = 0`` disables the cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Generic, NamedTuple, TypeVar

__all__ = ["TokenCache"]

P = TypeVar("P")


class _Entry(NamedTuple):
    """A cached principal and the clock reading (``clock()`` seconds) at which it stops being served."""

    expires_at: float
    principal: object


class TokenCache(Generic[P]):
    """``token hash -> principal`` for ``ttl_s`` seconds, at most ``max_entries`` (LRU). Thread-safe.

    Raises ``ValueError`` for a negative ``ttl_s`` or ``max_entries`` < 1.
    """

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic):
        if ttl_s < 0:
            raise ValueError(f"ttl_s={ttl_s}: must be >= 0")
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: must be >= 1")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> P | None:
        """The cached principal of ``key`` (a token hash), or ``None`` (absent or expired)."""
        if self.ttl_s <= 0:
            return None
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            if hit.expires_at <= self._clock():
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return hit.principal

    def put(self, key: str, principal: P) -> None:
        """Remember ``principal`` for ``key`` for ``ttl_s`` seconds (a no-op when the cache is disabled)."""
        if self.ttl_s <= 0:
            return
        with self._lock:
            self._entries[key] = _Entry(self._clock() + self.ttl_s, principal)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def discard(self, key: str) -> None:
        """Forget ``key`` (a token hash), e.g. when this process revokes the token."""
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
