"""The planner's Redis lock (``fedbroker:planner-lock``): one planning cycle at a time, and a lock nobody but a
planner can hold.

The lock only saves work: the database fence (:meth:`broker.service.store.core.JobStore.advance_fence`) keeps a
second planner harmless. But a lock anyone could write was a switch that stopped intake: a job on a host that
reached the password-less Redis ran ``SET fedbroker:planner-lock x EX 300``, and no job of any team was taken in
for 5 minutes. So a lock value is only honoured when the broker wrote it and it is still live:

``v1|<holder>|<deadline_ms>|<nonce>|<mac>``
    ``holder``: who took it (host and pid); ``deadline_ms``: Redis's clock (``TIME``, ms since the epoch) when it
    lapses, ``ttl_s`` after it was taken; ``nonce``: 16 random hex digits; ``mac``: HMAC-SHA256 (first 32 hex
    digits) over the rest, keyed by
    :func:`lock_key` (derived from the store's ``instance_secret``, which only the broker's database holds).

A planner that finds the lock taken overrides it (and logs one warning naming the reason) when the value is not
of that form, its MAC is wrong, its deadline has passed or lies more than ``ttl_s`` (+ :data:`SLACK_MS`) ahead, or
its key has no TTL or a longer one than that. A forged value is overridden at once; the most a copy of a genuine
value replayed after its release can hold planning up is that lock's remaining life (at most
``planner_lock_ttl_s``, 60 s by default). (Overriding a lock whose cycle had already applied, by the planner fence,
was tried and dropped: two planners then ran at once whenever a cycle outlived its apply, and on a loaded host the
extra database load made agents' reports time out.)
Every planner of one broker should use the same ``planner_lock_ttl_s``: a lock taken with a longer one is
overridden by a planner with a shorter one (harmless: the fence drops a stale cycle's plan).

Errors: ``redis.RedisError`` from the Redis calls (the caller skips the cycle; beat tries again).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import socket

__all__ = ["PLANNER_LOCK", "SLACK_MS", "PlannerLock", "lock_key"]

log = logging.getLogger("fedbroker.planner_lock")

#: the lock's Redis key (the name every release has used)
PLANNER_LOCK = "fedbroker:planner-lock"
#: milliseconds a live lock's TTL or deadline may exceed ``ttl_s`` (Redis rounds; a call takes time)
SLACK_MS = 1000

#: set KEYS[1] to ARGV[2] for ARGV[3] ms if it still holds ARGV[1] ('' = absent); 1 if set
_TAKE_OVER = """
local v = redis.call('GET', KEYS[1])
if (v == false and ARGV[1] == '') or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""
#: delete KEYS[1] if it holds ARGV[1]; 1 if deleted
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def lock_key(instance_secret: bytes) -> bytes:
    """The MAC key of lock values (32 bytes): HMAC-SHA256 of ``instance_secret`` (the store's random key,
    :meth:`broker.service.store.core.JobStore.instance_secret`) over a label of its own, so the instance report
    tokens' key is never used for anything else."""
    return hmac.new(instance_secret, b"fedbroker planner lock v1", hashlib.sha256).digest()


class PlannerLock:
    """Take and release the planner lock (format and rules: the module docstring).

    Args:
        redis: a ``redis.Redis`` client.
        key: the MAC key (:func:`lock_key`).
        ttl_s: the lock's life, seconds (``settings.planner_lock_ttl_s``); a value asking for longer is forged.
        name: the Redis key.
        holder: who takes it, written into the value (default ``<host>:<pid>``; ``|`` is replaced).
    """

    def __init__(self, redis, key: bytes, ttl_s: float, name: str = PLANNER_LOCK, holder: str | None = None):
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"planner_lock_ttl_s={ttl_s!r}: must be a finite number of seconds > 0")
        self.redis = redis
        self.key = key
        self.ttl_ms = math.ceil(ttl_s * 1000)
        self.name = name
        self.holder = (holder or f"{socket.gethostname()}:{os.getpid()}").replace("|", "_")[:100]
        self._take_over = redis.register_script(_TAKE_OVER)
        self._release = redis.register_script(_RELEASE)

    def _now_ms(self) -> int:
        sec, usec = self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    def _mac(self, body: str) -> str:
        return hmac.new(self.key, body.encode(), hashlib.sha256).hexdigest()[:32]

    def value(self, deadline_ms: int) -> str:
        """A lock value this broker writes: it lapses at ``deadline_ms`` (Redis's clock, ms since the epoch)."""
        body = f"v1|{self.holder}|{deadline_ms}|{secrets.token_hex(8)}"
        return f"{body}|{self._mac(body)}"

    def why_not_honoured(self, value: bytes | None, pttl_ms: int, now_ms: int) -> str | None:
        """``None`` when ``value`` (the key's content, with ``pttl_ms`` from ``PTTL``) is a live lock this broker
        wrote, else the reason it is overridden (a short phrase for the log). ``now_ms``: Redis's clock."""
        if value is None:
            return "it lapsed"
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        parts = text.split("|")
        if len(parts) != 5 or parts[0] != "v1" or not parts[2].isdigit():
            return "its value is not one a planner writes"
        if not hmac.compare_digest(parts[4], self._mac("|".join(parts[:4]))):
            return "its value is not signed by this broker"
        deadline = int(parts[2])
        if deadline <= now_ms:
            return "its own deadline has passed (its TTL was extended)"
        if deadline > now_ms + self.ttl_ms + SLACK_MS:
            return f"its deadline is {(deadline - now_ms) / 1000:.0f} s ahead, over planner_lock_ttl_s"
        if pttl_ms < 0 or pttl_ms > self.ttl_ms + SLACK_MS:
            return "its key has no TTL" if pttl_ms < 0 else f"its TTL is {pttl_ms / 1000:.0f} s, over planner_lock_ttl_s"
        return None

    def acquire(self) -> str | None:
        """Take the lock for ``ttl_s``. Returns the value written (pass it to
        :meth:`release`), or ``None`` when a live lock of this broker is held. A lock that is not honoured is
        overridden (one WARNING with its reason). Raises ``redis.RedisError``."""
        now = self._now_ms()
        token = self.value(now + self.ttl_ms)
        if self.redis.set(self.name, token, nx=True, px=self.ttl_ms):
            return token
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(self.name)
        pipe.pttl(self.name)
        current, pttl = pipe.execute()
        why = self.why_not_honoured(current, int(pttl), now)
        if why is None:
            return None
        if not self._take_over(keys=[self.name], args=[current or b"", token, self.ttl_ms]):
            return None  # changed meanwhile: another planner took it
        if current is not None:
            log.warning("planner lock %s overridden: %s (value %r, TTL %d ms); a lock only a planner of this broker "
                        "can write is honoured", self.name, why, (current or b"")[:80], int(pttl))
        return token

    def release(self, token: str) -> bool:
        """Delete the lock if it still holds ``token``; False when it lapsed or was taken over meanwhile.
        Raises ``redis.RedisError``."""
        return bool(self._release(keys=[self.name], args=[token]))
