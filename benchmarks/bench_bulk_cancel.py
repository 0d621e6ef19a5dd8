"""Bulk cancel against one cancel per job (issue 20: 10,000 jobs took 52 s from 8 SDK threads).

Over real HTTP (the app under uvicorn in a thread, :class:`tests.broker.harness.ServerThread`) on a fresh
PostgreSQL schema: ``--jobs`` submitted jobs of one team are cancelled by one ``Client.cancel_many(all=True)``
(``POST /v1/jobs:cancel``), ``--reps`` times (fresh jobs each time); with ``--singles N``, N other jobs are then
cancelled one request each (``Client.cancel``) from ``--threads`` SDK threads, the way it had to be done before.
Prints one line per measurement (seconds, jobs per second).

::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_bulk_cancel.py --jobs 10000 --reps 3 --singles 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from broker.client import Client
from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.store.core import JobStore
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread

PG_URL = os.environ.get("FEDBROKER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _submit(store: JobStore, team: str, n: int) -> list[str]:
    """``n`` submitted jobs of ``team`` (stored directly, 1,000 a transaction); their ids."""
    ids: list[str] = []
    for start in range(0, n, 1000):
        out = store.submit_many(team, [(JobSpec(command=["true"]), None, None)] * min(1000, n - start))
        ids += [job.id for job, _ in out]
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000, help="jobs per bulk cancel")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--singles", type=int, default=0, help="jobs cancelled one request each afterwards (0: none)")
    ap.add_argument("--threads", type=int, default=8, help="SDK threads of the one-request-per-job cancels")
    args = ap.parse_args()
    store = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    try:
        team = "bench"
        token = create_token(store, team).token
        with ServerThread(create_app(store)) as srv:
            c = Client(srv.url, token, timeout=600)
            times = []
            for _ in range(args.reps):
                _submit(store, team, args.jobs)
                t0 = time.perf_counter()
                res = c.cancel_many(all=True)
                times.append(time.perf_counter() - t0)
                assert res.count == args.jobs and not res.more, res.count
            med = statistics.median(times)
            print(f"bulk: {args.jobs:,} jobs in one request: median {med:.2f} s of {args.reps} "
                  f"({args.jobs / med:,.0f} jobs/s; runs {', '.join(f'{t:.2f}' for t in times)} s)")
            if args.singles:
                ids = _submit(store, team, args.singles)
                clients = [Client(srv.url, token, timeout=600) for _ in range(args.threads)]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.threads) as pool:
                    list(pool.map(lambda k: [clients[k].cancel(j) for j in ids[k::args.threads]],
                                  range(args.threads)))
                dt = time.perf_counter() - t0
                print(f"singles: {args.singles:,} jobs, one request each from {args.threads} threads: {dt:.2f} s "
                      f"({args.singles / dt:,.0f} jobs/s; {args.jobs / (args.singles / dt):.1f} s for {args.jobs:,})")
    finally:
        store.drop_schema()


if __name__ == "__main__":
    main()
