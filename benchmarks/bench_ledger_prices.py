"""Time what billing with the live prices adds to metering one attempt (issues 12/13: the ledger's live prices).

Caches 25 hours of an AWS spot offer's price and of CA-ON's tariff and carbon (electricitymaps), then times, for
a 24-hour window: ``ledger.cloud_price`` (one instance's hourly price schedule from the cloud price cache) and
``LedgerPrices.signals_for`` + the tariff series + ``ledger.signal_origin`` of price and carbon (an on-prem
energy line's signals: a ``LiveSignals`` over the window and its per-hour origins). Prints each mean over 50 runs
and the 24-hour bill, hand-checkable: sum over k = 0..23 of (1 + k/100) USD/h x 1 h = 26.76 USD.

    PYTHONPATH=. python3 benchmarks/bench_ledger_prices.py [--redis redis://127.0.0.1:6379/8]

Needs a local Redis; uses an SQLite file in a temporary folder and its own Redis key prefix (deleted after).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/8")
    args = ap.parse_args()
    import redis

    from broker.service import ledger
    from broker.service.live import LiveEnvironment
    from broker.service.settings import BrokerSettings
    from broker.service.signal_cache import SignalCache
    from broker.service.signal_settings import SignalsSettings
    from broker.service.store import signals as rows
    from broker.service.store.core import JobStore
    from broker.service.store.signals import CachedHour
    from pricing.cloud_price_sources import AWS_SPOT

    store = JobStore(f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    store.migrate()
    sg = SignalsSettings.model_validate({
        "zones": {"CA-ON": {"carbon": ["electricitymaps", "bundled"], "price": ["tariff", "bundled"]}},
        "tariffs": {"CA-ON": {"timezone": "America/Toronto", "currency": "USD", "per": "kWh", "default": 0.1}},
        "cloud_prices": {"aws": ["us-east-1"]}})
    t1 = datetime(2024, 3, 6, tzinfo=timezone.utc)
    t0 = t1 - timedelta(hours=24)
    c = SignalCache(store, redis.Redis.from_url(args.redis), sg, prefix=f"bench:{uuid.uuid4().hex[:8]}:",
                    clock=lambda: t1.timestamp())
    try:
        env = LiveEnvironment(BrokerSettings().planner, signals=(sg, c))
        p = ledger.LedgerPrices.from_environment(env)
        offer = next(o for o in env.offers if o.provider == "aws" and o.region == "us-east-1"
                     and o.market.value == "spot")
        hours = [t0 + timedelta(hours=k) for k in range(25)]
        with store.session() as s:
            rows.put_values(s, "cloud", "USD/h", [CachedHour(AWS_SPOT, offer.offer_id, h, 1.0 + k / 100, False, False,
                                                             t1) for k, h in enumerate(hours)])
            rows.put_values(s, "price", "USD/MWh", [CachedHour("tariff", "CA-ON", h, 100.0, False, False, t1)
                                                    for h in hours])
            rows.put_values(s, "carbon", "gCO2e/kWh", [CachedHour("electricitymaps", "CA-ON", h, 40.0, False, False, t1)
                                                       for h in hours])
        c._mirror_many([(AWS_SPOT, offer.offer_id), ("tariff", "CA-ON"), ("electricitymaps", "CA-ON")],
                       t0.timestamp(), t1.timestamp() + 3600)
        row = SimpleNamespace(created_at=t0, launch_usd_per_hour=offer.usd_per_hour)
        a, b = t0.timestamp(), t1.timestamp()

        def onprem():
            sig = p.signals_for(a, b)
            sig.price("CA-ON")
            ledger.signal_origin(sig, "CA-ON", "price", a, b, "electricity price")
            ledger.signal_origin(sig, "CA-ON", "carbon", a, b, "carbon intensity")

        for name, fn in (("cloud_price, 24 h spot instance", lambda: ledger.cloud_price(p, row, offer, b)),
                         ("on-prem signals + origins, 24 h", onprem)):
            fn()
            n, s0 = 50, time.perf_counter()
            for _ in range(n):
                fn()
            print(f"{name}: {(time.perf_counter() - s0) / n * 1000:.1f} ms")
        cp = ledger.cloud_price(p, row, offer, b)
        print(f"24 h spot bill: {cp.bill(86400.0):.2f} USD, price_source {cp.note(a, b)[0]}")
    finally:
        for k in c.redis.scan_iter(match=c.prefix + "*"):
            c.redis.delete(k)


if __name__ == "__main__":
    main()
