"""The usage routes over a big ledger: ``GET /v1/usage/summary`` (SQL GROUP BY) and ``GET /v1/usage/focus``
(FOCUS 1.2 CSV) for one month of N lines on a fresh PostgreSQL schema (dropped after), in-process (ASGI).

    PYTHONPATH=. python3 benchmarks/bench_usage.py --lines 50000 [--pg postgresql+psycopg://postgres@127.0.0.1:5432/test]

Prints the seconds and bytes of each answer (one call each: the first, uncached).
"""

from __future__ import annotations

import argparse
import time
import uuid
from datetime import datetime, timedelta, timezone

from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.settings import BrokerSettings
from broker.service.store import usage
from broker.service.store.core import JobStore, hash_token
from broker.usage import UsageRecord


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=50_000, help="ledger lines in March 2024 (default 50,000)")
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/test", help="PostgreSQL URL")
    a = ap.parse_args()
    store = JobStore(a.pg, schema=f"bench_{uuid.uuid4().hex[:10]}")
    store.migrate()
    try:
        t0 = datetime(2024, 3, 1, tzinfo=timezone.utc)
        step = 31 * 86400 / max(1, a.lines)  # spread over March
        recs = [UsageRecord(job_id=f"job-{i:016x}", attempt=1, rank=0, line="instance", resource=f"i-{i}",
                            team=f"t{i % 20}", start=t0 + timedelta(seconds=i * step),
                            end=t0 + timedelta(seconds=i * step + 3600), provider="aws", region="us-east-1",
                            gpu_type="A100", gpu_count=8, run_s=3600, billed_s=3600, list_unit_price_usd=32.0,
                            billed_usd=32.0, energy_kwh=4.0, carbon_kg=1.5) for i in range(a.lines)]
        with store.session() as s:
            usage.add_usage(s, recs, t0)
        admin = "bench-" + uuid.uuid4().hex
        c = TestClient(create_app(store, BrokerSettings.model_construct(admin_token_sha256=hash_token(admin))))
        for path, extra in (("/v1/usage/summary", {"by": "team"}), ("/v1/usage/summary", {"by": "day"}),
                            ("/v1/usage/focus", {})):
            start = time.perf_counter()
            r = c.get(path, params={"from": "2024-03-01", "to": "2024-04-01", **extra},
                      headers={"Authorization": f"Bearer {admin}"})
            r.raise_for_status()
            print(f"{path} {extra or ''}: {time.perf_counter() - start:.2f} s, {len(r.content):,} bytes")
    finally:
        store.drop_schema()


if __name__ == "__main__":
    main()
