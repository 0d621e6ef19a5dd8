"""Submit throughput and submit-to-dispatch latency of the live broker, through the HTTP API.

Starts the whole broker as real processes on this machine (PostgreSQL, a private
redis-server, ``fedbroker serve api/worker/beat`` and node agents with fake GPUs;
see ``tests/e2e/harness.py``) and measures:

1. **Submit throughput** (jobs/s): ``--submit-jobs`` submits through the SDK
   (``broker.Client``), from 1 and from ``--threads`` client threads. Nothing can
   start (the jobs ask for a GPU type no node has), so only the API and the store
   are measured.
2. **Submit-to-dispatch latency** (p50/p99, ms): ``--latency-jobs`` jobs submitted
   at ``--rate`` jobs/s onto nodes with enough free GPUs; for each job, the time from
   its ``submitted`` event to its ``starting`` event (the planner placed it and
   sent the dispatch) and to ``running`` (its process was started by the agent).

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_api.py [--submit-jobs 1000] [--threads 4]
        [--latency-jobs 200] [--rate 10]

Results go to stdout (and ``--json FILE``); record them in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine_info  # noqa: E402
from broker.client import Client  # noqa: E402
from broker.model import JobSpec  # noqa: E402
from tests.e2e.harness import LiveBroker, wait_for  # noqa: E402


def submit_throughput(client_factory, n: int, threads: int) -> float:
    """Jobs/s for ``n`` submits from ``threads`` clients (one ``Client`` each)."""
    spec = JobSpec(command=["/bin/true"], gpu_types=("H100",), estimated_duration_s=60.0)
    per = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]

    def run(k: int) -> None:
        c = client_factory()
        for _ in range(k):
            c.submit(spec)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, per))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--submit-jobs", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--latency-jobs", type=int, default=200)
    ap.add_argument("--rate", type=float, default=10.0, help="jobs/s offered in the latency run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict = {"machine": machine_info()}
    with tempfile.TemporaryDirectory() as tmp:
        b = LiveBroker(Path(tmp) / "broker", nodes={"node-a": 16, "node-b": 16})
        try:
            b.start()
            token = b.token("bench")
            factory = lambda: Client(b.url, token)  # noqa: E731
            out["submit_jobs_per_s_1_client"] = submit_throughput(factory, args.submit_jobs, 1)
            out[f"submit_jobs_per_s_{args.threads}_clients"] = submit_throughput(factory, args.submit_jobs, args.threads)
            while True:  # clear the queue before the latency run
                left = b.store.list_jobs(limit=1000, states=["queued", "submitted"])
                if not left:
                    break
                for j in left:
                    b.store.request_cancel(j.id)
            # latency: short jobs that find free GPUs
            c = factory()
            spec = JobSpec(command=["/bin/sh", "-c", "sleep 0.5"], estimated_duration_s=60.0)
            ids = []
            t_next = time.perf_counter()
            for _ in range(args.latency_jobs):
                ids.append(c.submit(spec).id)
                t_next += 1.0 / args.rate
                time.sleep(max(t_next - time.perf_counter(), 0.0))
            wait_for(lambda: all(b.store.get(i).state == "succeeded" for i in ids), 300, "latency jobs")
            to_start, to_run = [], []
            for i in ids:
                ev = {e.to_state: e.at for e in b.store.events(i)}
                to_start.append((ev["starting"] - ev["submitted"]).total_seconds() * 1000)
                to_run.append((ev["running"] - ev["submitted"]).total_seconds() * 1000)
            for name, arr in (("submit_to_dispatch_ms", to_start), ("submit_to_running_ms", to_run)):
                a = np.array(arr)
                out[name] = {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                             "max": float(a.max()), "n": int(a.size)}
            out["settings"] = {k: b.settings[k] for k in ("plan_interval_s", "heartbeat_interval_s")}
        finally:
            b.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
