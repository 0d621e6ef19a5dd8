"""Shared set-up of the live-signal tests: settings for DE-LU on Electricity Maps, a fake clock and sleep,
recorded Electricity Maps answers (tests/pricing/recorded.py shapes) and a cache on real Redis + a store."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import redis as redis_lib
import responses

from broker.service.signal_cache import SignalCache
from broker.service.signal_settings import SignalsSettings
from tests.conftest import REDIS_URL
from tests.pricing.recorded import em_forecast, em_point, utc

EM = "https://api.electricitymap.org/v3"
#: the fake "now" of the tests: 2024-03-31 12:20 UTC
T0 = utc(2024, 3, 31, 12, 20)


def settings(**over) -> SignalsSettings:
    """DE-LU carbon from Electricity Maps (zone DE) then bundled: 3 h back, 3 h ahead, stale after 1 h."""
    base = {"zones": {"DE-LU": {"carbon": ["electricitymaps", "bundled"], "ids": {"electricitymaps": "DE"}}},
            "sources": {"electricitymaps": {"requests_per_s": 100, "burst": 100, "max_retries": 2, "backoff_s": 2.0,
                                            "max_backoff_s": 30.0}},
            "history_h": 3, "forecast_h": 3, "refresh_s": 900, "stale_after_s": 3600}
    base.update(over)
    return SignalsSettings.model_validate(base)


class Clock:
    """A settable clock (POSIX s)."""

    def __init__(self, t: datetime):
        self.t = t.timestamp()

    def __call__(self) -> float:
        return self.t


class Sleeps(list):
    """Records each sleep instead of sleeping."""

    def __call__(self, s: float) -> None:
        self.append(round(s, 6))


def cache(store, sg: SignalsSettings, clock, sleep=None, prefix: str | None = None) -> SignalCache:
    r = redis_lib.Redis.from_url(REDIS_URL)
    return SignalCache(store, r, sg, prefix=prefix or f"test:{uuid.uuid4().hex[:10]}:", clock=clock,
                       sleep=sleep or Sleeps())


def drop(c: SignalCache) -> None:
    """Delete the test's Redis keys."""
    for k in c.redis.scan_iter(match=c.prefix + "*"):
        c.redis.delete(k)


def em_history(rsps, status: int = 200, **kw):
    """Electricity Maps past-range for 09:00..12:00 of T0's day: 300, 310, null, 330 gCO2e/kWh."""
    h = lambda k: utc(2024, 3, 31, 9) + timedelta(hours=k)  # noqa: E731
    body = {"zone": "DE", "data": [em_point("DE", h(0), 300), em_point("DE", h(1), 310), em_point("DE", h(2), None),
                                   em_point("DE", h(3), 330)]}
    return rsps.add(responses.GET, f"{EM}/carbon-intensity/past-range", json=body if status == 200 else {},
                    status=status, **kw)


def em_fc(rsps, status: int = 200, **kw):
    """Electricity Maps forecast: 12:00 335, 13:00 340, 14:00 350 gCO2e/kWh."""
    body = em_forecast("DE", [(utc(2024, 3, 31, 12), 335), (utc(2024, 3, 31, 13), 340), (utc(2024, 3, 31, 14), 350)])
    return rsps.add(responses.GET, f"{EM}/carbon-intensity/forecast", json=body if status == 200 else {},
                    status=status, **kw)
