"""Per-team admission limits of the API: a submit rate limit (token bucket in Redis) and the
queued-jobs quota (checked by the store in the submit transaction).

Settings: :class:`broker.service.settings.QuotaSettings` (``quotas:`` in the YAML file, per-team overrides
under ``quotas.per_team``). Both limits answer ``429 Too Many Requests`` with a ``Retry-After``
header (integer seconds, rounded up) and a body naming the limit::

    {"detail": "quotas.submits_per_s: team 'vision' may submit 50 jobs/s (burst 200); retry after 1 s",
     "limit": "quotas.submits_per_s", "retry_after_s": 1}

Rate limit: one bucket per team (Redis key ``fedbroker:rate:<team>``) shared by every API process;
the refill and the charge run in one Lua script, atomically, on Redis's own clock (``TIME``), so
API hosts with skewed clocks agree. A request of ``n`` jobs (a batch charges its new items) needs
``min(n, burst)`` tokens and takes ``n``: a batch larger than the bucket is let in once the bucket is
full and leaves it in debt, so the long-run rate still holds. If Redis cannot be reached the limit
**fails open** (submits are let through; the queued-jobs quota, kept in the database, still caps a
team) and the API logs one warning a minute: a Redis outage must not stop job intake.

A bucket written by anyone but this script (a job on a host that reaches a password-less Redis ran
``HSET fedbroker:rate:victim tokens -1000000``: the victim team got 429 "retry after 19998 s") is not
trusted: tokens that are not a finite number or lie outside ``[min(0, burst - MAX_BATCH_ITEMS), burst]``
(the lowest a real charge leaves: a full bucket minus the largest batch), or an ``at`` that is not a
number or lies more than :data:`CLOCK_SLACK_S` ahead of Redis's clock, make the bucket start full again.
So a forged bucket refuses a team for at most ``MAX_BATCH_ITEMS / rate`` seconds (20 s at 50/s), as a
real batch could. The key's TTL is set by every charge to the time the bucket takes to refill (at most
``(burst + MAX_BATCH_ITEMS) / rate`` seconds plus 1 s).

Idempotent replays are never refused: a refused submit that repeats an existing job's idempotency
key is answered with that job (200).

Priority classes are team entitlements (``quotas.priority_classes``, per team under ``quotas.per_team``):
:func:`priority_refusal` says why a spec's class is above its team's; the API answers it 403 (single submit,
batch item, schedule), the reconciler skips such a schedule's fire, and the planning cycle never ranks a
stored job above its team's highest class (:meth:`TeamLimits.max_priority_rank`), so it cannot preempt
with a class it was not granted.

Exceptions::

    LimitExceeded (Exception)     limit (dotted setting name), retry_after_s (int >= 1), str(e) the detail
     +-- RateLimitExceeded        quotas.submits_per_s
     +-- QuotaExceeded            quotas.max_queued_jobs, quotas.max_queued_spec_bytes (raised by the store:
                                  broker.service.store.quota)
"""

from __future__ import annotations

import logging
import math
import threading
import time

from pydantic import BaseModel

from broker.batch import MAX_BATCH_ITEMS
from broker.service.log_throttle import LogThrottle
from broker.service.settings import QuotaSettings, TeamLimits
from broker.service.store.quota import LimitExceeded, QuotaExceeded, quota_exceeded
from providers.base import pool_time_limit_s

__all__ = ["LimitExceeded", "RateLimitExceeded", "QuotaExceeded", "RateLimiter", "LimitBody", "TOKEN_BUCKET_LUA",
           "quota_exceeded", "priority_refusal",
           "time_limit_refusal"]

log = logging.getLogger(__name__)


def priority_refusal(quotas: QuotaSettings, team: str, priority_class, field: str = "spec.priority_class") -> str | None:
    """Why ``team`` may not use ``priority_class`` (a :class:`broker.model.PriorityClass`), or ``None`` when its
    entitlement (``quotas.priority_classes`` / ``quotas.per_team.<team>.priority_classes``) holds it. The message
    names ``field``, the value and the allowed classes: ``"spec.priority_class='critical': team 'evil' may use
    low, normal (quotas.per_team.<team>.priority_classes grants more)"``."""
    allowed = quotas.for_team(team).priority_classes
    if priority_class in allowed:
        return None
    names = ", ".join(c.value for c in sorted(allowed, key=lambda c: c.rank))
    return (f"{field}={getattr(priority_class, 'value', priority_class)!r}: team {team!r} may use {names} "
            f"(an operator grants more in quotas.per_team.{team}.priority_classes)")


def time_limit_refusal(quotas: QuotaSettings, team: str, spec, prefix: str = "spec.") -> tuple[str, float, str] | None:
    """Why ``spec`` (a :class:`broker.model.JobSpec`) of ``team`` asks for a longer wall-clock limit than the team's
    ``quotas.max_time_limit_s``, as ``(field, value, message)`` for a 422, or ``None`` when it fits (or there is no
    ceiling). The limit is the one the agent and the pools enforce (:func:`providers.base.pool_time_limit_s`): the
    spec's ``time_limit_s``, else ``estimated_duration_s x 1.2 + 300 s``; the field named is the one that set it
    (``prefix`` + ``time_limit_s`` or ``estimated_duration_s``). E.g. ``time_limit_s=31000000`` with the default
    7 days -> ``("spec.time_limit_s", 31000000.0, "... at most 604800 s (quotas.max_time_limit_s) ...")``."""
    ceiling = quotas.for_team(team).max_time_limit_s
    if ceiling is None:
        return None
    limit = pool_time_limit_s(spec.estimated_duration_s, time_limit_s=spec.time_limit_s)
    if limit <= ceiling:
        return None
    if spec.time_limit_s is not None:
        return (f"{prefix}time_limit_s", spec.time_limit_s,
                f"longer than team {team!r} may ask for: at most {ceiling:g} s (quotas.max_time_limit_s)")
    return (f"{prefix}estimated_duration_s", spec.estimated_duration_s,
            f"its default time limit ({limit:g} s: the estimate x 1.2 + 300 s) is longer than team {team!r} may ask "
            f"for, at most {ceiling:g} s (quotas.max_time_limit_s); split the run at checkpoints or ask an operator "
            f"for quotas.per_team.{team}.max_time_limit_s")


#: seconds a bucket's ``at`` may lie ahead of Redis's clock before the bucket is taken as forged (``at`` is written from
#: that same clock, so a real bucket is never ahead; the slack covers a failover to a replica whose clock is behind)
CLOCK_SLACK_S = 1.0


class RateLimitExceeded(LimitExceeded):
    """More submits per second than ``quotas.submits_per_s`` (and ``burst``) allow."""


#: KEYS[1] the team's bucket; ARGV: rate (tokens/s), burst (tokens), n (cost), the largest batch (items: the most
#: debt a charge can leave), the clock slack (s: an ``at`` further ahead is forged). Returns
#: {1, tokens left} when charged, {0, seconds until min(n, burst) tokens are there} when refused
#: (as strings: Redis truncates Lua numbers to integers). Tokens may go negative (debt, see above).
TOKEN_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1])
local at = tonumber(b[2])
local lowest = math.min(0, burst - tonumber(ARGV[4]))
-- a bucket this script did not write (NaN fails every comparison, so the 'not' forms catch it too)
if tokens == nil or at == nil or not (tokens >= lowest and tokens <= burst)
   or not (at <= now + tonumber(ARGV[5])) then
  tokens = burst
  at = now
end
if now > at then
  tokens = math.min(burst, tokens + (now - at) * rate)
end
local need = math.min(n, burst)
local ok = 0
if tokens >= need then
  tokens = tokens - n
  ok = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
if ok == 1 then
  return {1, tostring(tokens)}
end
return {0, tostring((need - tokens) / rate)}
"""


class RateLimiter:
    """The per-team submit rate limit over Redis (see the module docstring).

    Args:
        redis_url: the Redis server (``settings.redis_url``); one connection pool per process.
        quotas: the limits (``settings.quotas``); a team without a rate is never charged.
        prefix: key prefix of the buckets.
        timeout_s: socket timeout of every Redis call; after a failure Redis is not asked again for
            ``retry_down_s`` seconds (submits are let through meanwhile).
    """

    def __init__(self, redis_url: str, quotas: QuotaSettings, prefix: str = "fedbroker:rate:",
                 timeout_s: float = 0.5, retry_down_s: float = 5.0):
        import redis

        self.quotas = quotas
        self.prefix = prefix
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self.redis.register_script(TOKEN_BUCKET_LUA)
        self._retry_down_s = retry_down_s
        self._down_until = 0.0
        self._warn = LogThrottle(60.0)
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings) -> "RateLimiter":
        """A limiter on ``settings.redis_url`` with ``settings.quotas``."""
        return cls(settings.redis_url, settings.quotas)

    def limits(self, team: str) -> TeamLimits:
        """The effective limits of ``team``."""
        return self.quotas.for_team(team)

    def charge(self, team: str, n: int = 1) -> None:
        """Take ``n`` submits (jobs) from ``team``'s bucket.

        Raises:
            RateLimitExceeded: not enough tokens; ``retry_after_s`` = seconds until there are (ceil).
            ValueError: ``n`` < 1.
        Never raises for Redis errors: the limit fails open (a warning is logged at most once a minute).
        """
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        lim = self.limits(team)
        if lim.submits_per_s is None:
            return
        if time.monotonic() < self._down_until:
            return
        import redis

        try:
            ok, value = self._script(keys=[self.prefix + team], args=[repr(lim.submits_per_s), lim.burst, n, MAX_BATCH_ITEMS, CLOCK_SLACK_S])
        except redis.RedisError as e:
            self._failed(e)
            return
        if int(ok) == 1:
            return
        wait = float(value)
        retry = max(1, math.ceil(wait - 1e-9))
        raise RateLimitExceeded(
            f"quotas.submits_per_s: team {team!r} may submit {lim.submits_per_s:g} jobs/s (burst {lim.burst})"
            + (f"; a request of {n} jobs" if n > 1 else "") + f"; retry after {retry} s",
            "quotas.submits_per_s", retry)

    def reset(self, team: str) -> None:
        """Forget ``team``'s bucket (it starts full again). Raises ``redis.RedisError``."""
        self.redis.delete(self.prefix + team)

    def _failed(self, e: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._down_until = now + self._retry_down_s
        if self._warn.due():
            log.warning("rate limit: Redis unreachable (%s: %s); submits are let through without a rate limit "
                        "until it answers (the queued-jobs quota still holds)", type(e).__name__, e)


class LimitBody(BaseModel):
    """A 429 answer's body: ``detail`` (the message), ``limit`` (the dotted setting that refused) and
    ``retry_after_s`` (also in the ``Retry-After`` header; ``null`` without one: waiting cannot help)."""

    detail: str
    limit: str
    retry_after_s: int | None = None
