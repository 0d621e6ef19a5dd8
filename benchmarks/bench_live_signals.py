"""How long the live planner takes to build its context with live signals vs the bundled replay (issue 13).

Every zone of the default live environment (pools and cloud offers: 35 zones) gets an Electricity Maps carbon
chain; 96 cached hours per zone (24 measured back, 72 forecast ahead) are put in a fresh SQLite store and a
Redis database (key prefix ``bench:<random>:``, deleted afterwards). Times the context build plus every zone's
carbon and price series, 3 runs each. Usage::

    PYTHONPATH=. python3 benchmarks/bench_live_signals.py [redis://127.0.0.1:6379/13]
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone

import redis

from broker.service.live import LiveEnvironment
from broker.service.settings import BrokerSettings
from broker.service.signal_cache import SignalCache
from broker.service.signal_settings import SignalsSettings
from broker.service.store import signals as rows
from broker.service.store.core import JobStore
from broker.service.store.signals import CachedHour


def main(redis_url: str = "redis://127.0.0.1:6379/13") -> None:
    store = JobStore(f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    store.migrate()
    st = BrokerSettings()
    replay = LiveEnvironment(st.planner)
    zones = replay.base_signals.zones
    sg = SignalsSettings.model_validate({"zones": {z: {"carbon": ["electricitymaps", "bundled"]} for z in zones}})
    r = redis.Redis.from_url(redis_url)
    cache = SignalCache(store, r, sg, prefix=f"bench:{uuid.uuid4().hex[:8]}:")
    now = time.time()
    h0 = math.floor(now / 3600) * 3600
    at = datetime.fromtimestamp(now - 60, tz=timezone.utc)
    try:
        for z in zones:
            hs = [CachedHour("electricitymaps", z, datetime.fromtimestamp(h0 + k * 3600, tz=timezone.utc), 100.0 + k,
                             False, k > 0, at) for k in range(-24, 72)]
            with store.session() as s:
                rows.put_values(s, "carbon", "gCO2e/kWh", hs)
            cache._mirror("electricitymaps", z, h0 - 25 * 3600, h0 + 73 * 3600)
        for label, env in (("replay", replay), ("live", LiveEnvironment(st.planner, signals=(sg, cache)))):
            ts = []
            for _ in range(3):
                env._ctx_key = None
                t = time.perf_counter()
                ctx = env.context([], now)
                for z in zones:
                    ctx.signals.carbon(z)
                    ctx.signals.price(z)
                ts.append(time.perf_counter() - t)
            print(f"{label}: {len(zones)} zones, context + every series: "
                  f"{', '.join(f'{x * 1000:.0f}' for x in ts)} ms")
    finally:
        for k in r.scan_iter(match=cache.prefix + "*"):
            r.delete(k)


if __name__ == "__main__":
    main(*sys.argv[1:])
