"""Time the live environment's re-pricing of the cloud offers from the signal cache (issue 13, cloud prices).

Caches live prices for every AWS and GCP offer of four regions (AWS spot: 360 hours each, the 15 days the cache
keeps; on-demand and GCP: 15 hourly refreshes), then times ``LiveEnvironment.offers_at``: the first call (reads
the cache and re-prices), the second (after the first read warmed Redis, which bumps the cache version: a rebuild)
and the third (same version: the memo).

    PYTHONPATH=. python3 benchmarks/bench_cloud_prices.py [--redis redis://127.0.0.1:6379/8]

Needs a local Redis; uses an SQLite file in a temporary folder and its own Redis key prefix (deleted after).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from datetime import datetime, timezone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/8")
    args = ap.parse_args()
    import redis

    from broker.service.live import LiveEnvironment
    from broker.service.settings import BrokerSettings
    from broker.service.signal_cache import SignalCache
    from broker.service.signal_settings import SignalsSettings
    from broker.service.store import signals as rows
    from broker.service.store.core import JobStore
    from broker.service.store.signals import CachedHour
    from pricing.cloud_price_sources import AWS_SPOT, live_source_for

    store = JobStore(f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    store.migrate()
    sg = SignalsSettings.model_validate({"cloud_prices": {"aws": ["us-east-1", "us-west-2"],
                                                          "gcp": ["us-central1", "europe-west4"]}})
    r = redis.Redis.from_url(args.redis)
    cache = SignalCache(store, r, sg, prefix=f"bench:{uuid.uuid4().hex[:8]}:")
    try:
        env = LiveEnvironment(BrokerSettings().planner, signals=(sg, cache))
        now = time.time()
        h0 = now // 3600 * 3600
        at = lambda t: datetime.fromtimestamp(t, tz=timezone.utc)  # noqa: E731
        live = [o for o in env.offers if o.region in sg.cloud_prices.regions(o.provider)]
        hours = [CachedHour(live_source_for(o), o.offer_id, at(h0 - k * 3600), o.usd_per_hour * 0.9, False, False,
                            at(now - 60))
                 for o in live for k in range(360 if live_source_for(o) == AWS_SPOT else 15)]
        with store.session() as s:
            rows.put_values(s, "cloud", "USD/h", hours)
        cache._mirror_many({(h.source, h.zone) for h in hours}, h0 - 16 * 86400, h0 + 3600)
        ms = []
        for _ in range(3):
            t = time.perf_counter()
            got = env.offers_at(now)
            ms.append((time.perf_counter() - t) * 1000)
        changed = sum(1 for a, b in zip(got, env.offers) if a.usd_per_hour != b.usd_per_hour)
        print(f"{len(env.offers)} offers, {len(live)} in the configured regions, {len(hours)} cached hours, "
              f"{changed} re-priced; offers_at ms: first {ms[0]:.0f}, second {ms[1]:.0f}, third {ms[2]:.2f}")
    finally:
        for k in r.scan_iter(match=cache.prefix + "*"):
            r.delete(k)


if __name__ == "__main__":
    main()
