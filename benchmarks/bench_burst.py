"""A 10,000-job burst from one team, and submit throughput (single and bulk), on the live broker.

Starts the broker as real processes on this machine (PostgreSQL, a private redis-server,
``fedbroker serve api`` and later ``worker``, ``beat`` and node agents with fake GPUs; see
``tests/e2e/harness.py``) with ``quotas`` set so the benchmark's teams are not rate limited (the
queued-jobs quota is on: ``max_queued_jobs`` 50,000, so its check is part of every submit), and measures:

1. **Single submits** (jobs/s): ``--single-jobs`` ``POST /v1/jobs`` from ``--threads`` client threads
   (one keep-alive ``requests`` session each, a fresh idempotency key per job, the body the SDK sends),
   with only the API running (on 2 cores the planner would take the CPU the API is measured on).
   With ``--client wrk`` the same requests come from ``wrk`` (``--threads`` connections, ``--wrk-seconds``):
   a load generator on another machine in a real deployment; here it takes ~1/20 of the client CPU
   ``requests`` takes, so the 2 shared cores go to the broker. Every answer must be 2xx and every answered
   request a stored job (checked; the requests in flight when wrk stops are stored, not counted).
2. **Bulk submits** (jobs/s): the same through ``POST /v1/jobs:batch``, 1,000 items a request
   (``Client.submit_many``), API only.
3. **The burst**: worker, beat and ``--nodes`` agents (8 fake GPUs each) are started; team ``burst``
   sends ``--burst-jobs`` jobs through the bulk endpoint (jobs that ask for a GPU type no node has, so
   they queue); while the queue is absorbed:
   * planner cycle durations (``total_s`` of every ``planning cycle`` line of the worker's log),
   * another team's fitting job (1 GPU, 0.5 s) submit -> ``running`` latency, ``--probes`` of them one
     after the other (from the job's events: ``submitted`` -> ``running``; and ``submitted`` ->
     ``starting``, the planner's part of it),
   * cancel latency: ``--probes`` cancels of burst jobs (HTTP round trip of ``POST .../cancel``).

Usage (keep it to a few minutes on a shared machine)::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_burst.py [--single-jobs 2000] [--threads 8]
        [--client requests|wrk] [--wrk-seconds 15]
        [--batch-jobs 10000] [--burst-jobs 10000] [--probes 20] [--api-workers 2] [--json FILE]

Results go to stdout (and ``--json FILE``); record them in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine_info  # noqa: E402
from broker.client import Client, WaitTimeout  # noqa: E402
from tests.e2e.harness import LiveBroker, wait_for  # noqa: E402

#: a job no node can run (no node has H100s): it stays queued, so only intake and planning are measured
QUEUED_SPEC = {"command": ["/bin/true"], "gpu_types": ["H100"], "estimated_duration_s": 60.0}
#: a job that fits the fake V100 nodes at once
PROBE_SPEC = {"command": ["/bin/sh", "-c", "sleep 0.5"], "gpus_per_node": 1, "estimated_duration_s": 60.0}
_CYCLE = re.compile(r"planning cycle: (\{.*\})")


def _stats(a: list[float]) -> dict:
    x = np.array(a, dtype=float)
    if x.size == 0:
        return {"n": 0}
    return {"n": int(x.size), "p50": round(float(np.percentile(x, 50)), 1), "p99": round(float(np.percentile(x, 99)), 1),
            "max": round(float(x.max()), 1)}


def single_throughput(url: str, token: str, n: int, threads: int) -> float:
    """Jobs/s of ``n`` ``POST /v1/jobs`` from ``threads`` threads (one keep-alive session each)."""
    per = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]

    def run(k: int) -> None:
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {token}"
        for _ in range(k):
            r = s.post(f"{url}/v1/jobs", json={"spec": QUEUED_SPEC, "idempotency_key": str(uuid.uuid4())}, timeout=60)
            if r.status_code != 201:
                raise RuntimeError(f"submit answered {r.status_code}: {r.text[:300]}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, per))
    return n / (time.perf_counter() - t0)


#: wrk script: one ``POST /v1/jobs`` of :data:`QUEUED_SPEC` per request, each with its own idempotency key
#: (``<wrk thread>-<counter>-<run>``), as the SDK sends it
_WRK_LUA = """
local counter, tid = 0, 0
local n = 0
function setup(thread) n = n + 1; thread:set("tid", n) end
function init(args) tid = wrk.thread:get("tid") end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(token)s"
function request()
  counter = counter + 1
  return wrk.format(nil, "/v1/jobs", nil,
    '{"spec": %(spec)s, "idempotency_key": "' .. tid .. '-' .. counter .. '-%(run)s"}')
end
"""


def single_throughput_wrk(url: str, token: str, seconds: float, connections: int) -> tuple[float, int]:
    """Jobs/s and jobs created by ``wrk`` (a C load generator, ~1/20 of ``requests``' CPU per request, so the
    API is measured with the 2 cores it shares with its client) sending ``POST /v1/jobs`` over ``connections``
    keep-alive connections from one thread for ``seconds``. Raises ``RuntimeError`` if any answer was not 2xx."""
    import shutil

    if shutil.which("wrk") is None:
        raise RuntimeError("--client wrk: the wrk command is not installed (Debian: apt-get install wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_LUA % {"token": token, "spec": json.dumps(QUEUED_SPEC), "run": uuid.uuid4().hex[:8]})
    try:
        r = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{int(seconds)}s", "--timeout", "30s",
                            "-s", f.name, url], capture_output=True, text=True, check=True)
    finally:
        Path(f.name).unlink()
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", r.stdout)
    if m is None or "Non-2xx" in r.stdout or "Socket errors" in r.stdout:
        raise RuntimeError(f"wrk: errors or unreadable output:\n{r.stdout}")
    n, wall = int(m.group(1)), float(m.group(2)) / (1000 if m.group(3) == "ms" else 1)
    return n / wall, n


def batch_throughput(url: str, token: str, n: int, threads: int = 2) -> tuple[float, list[float]]:
    """Jobs/s of ``n`` jobs through ``submit_many`` (1,000 a request) from ``threads`` clients, and each
    request's duration in ms."""
    per = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    durations: list[float] = []

    def run(k: int) -> None:
        c = Client(url, token, timeout=120)
        for start in range(0, k, 1000):
            m = min(1000, k - start)
            t = time.perf_counter()
            res = c.submit_many([QUEUED_SPEC] * m)
            durations.append((time.perf_counter() - t) * 1000)
            bad = [r for r in res if r.status != 201]
            if bad:
                raise RuntimeError(f"{len(bad)} items not created, first: {bad[0]}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, per))
    return n / (time.perf_counter() - t0), durations


def proc_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (from /proc; Linux)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(d)] = int(fields[1])
        cpu[int(d)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += [c for c, pp in parents.items() if pp == p]
    return total


def measured(api_pid: int, fn, n: int) -> tuple[float, dict]:
    """Run ``fn()`` (which submits ``n`` jobs) and return its jobs/s and the CPU it cost per job:
    the API processes' (``api_cpu_ms_per_job``) and this client's (``client_cpu_ms_per_job``)."""
    import resource

    a0, c0 = proc_tree_cpu_s(api_pid), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    a1, c1 = proc_tree_cpu_s(api_pid), resource.getrusage(resource.RUSAGE_SELF)
    client = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    return n / wall, {"api_cpu_ms_per_job": round((a1 - a0) / n * 1000, 3),
                      "client_cpu_ms_per_job": round(client / n * 1000, 3)}


def cycles_last_line_age_s(log: Path) -> float | None:
    """Seconds since the worker's last ``planning cycle`` line (a lower bound on a cycle still running)."""
    from datetime import datetime

    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) INFO fedbroker.tasks: planning cycle",
                        log.read_text(errors="replace"), re.M)
    if not stamps:
        return None
    return time.time() - datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def cycles_in(log: Path, start: int) -> list[dict]:
    """The ``planning cycle`` summaries logged after byte ``start`` of the worker's log."""
    text = log.read_bytes()[start:].decode(errors="replace")
    out = []
    for m in _CYCLE.finditer(text):
        try:
            out.append(json.loads(m.group(1).replace("'", '"').replace("True", "true").replace("False", "false")))
        except ValueError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--single-jobs", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--client", choices=("requests", "wrk"), default="requests",
                    help="single submits from Python threads (requests sessions) or from wrk (C, needs `wrk`)")
    ap.add_argument("--wrk-seconds", type=float, default=15.0, help="--client wrk: seconds of single submits")
    ap.add_argument("--batch-jobs", type=int, default=10000)
    ap.add_argument("--burst-jobs", type=int, default=10000)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--api-workers", type=int, default=2)
    ap.add_argument("--probe-timeout", type=float, default=30.0, help="s a probe job may take to run")
    ap.add_argument("--max-burst-s", type=float, default=150.0,
                    help="stop probing and waiting for intake after this many seconds of the burst")
    ap.add_argument("--skip-burst", action="store_true", help="only the submit throughputs (API alone)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, help="keep the broker's config and process logs here (default: a "
                                                  "temporary directory, removed at the end)")
    args = ap.parse_args()
    import signal

    def _term(signum, frame):  # so that `finally` stops the broker's processes
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    out: dict = {"machine": machine_info(), "commit": commit, "args": vars(args) | {"json": str(args.json),
                                                                                "workdir": str(args.workdir)}}
    quotas = {"max_queued_jobs": 50000, "submits_per_s": 0, "burst": 0}
    with tempfile.TemporaryDirectory() as tmp:
        if args.workdir is not None:
            args.workdir.mkdir(parents=True, exist_ok=True)
            tmp = str(args.workdir.resolve())
        Path(tmp).chmod(0o755)  # the job user (nobody when run as root) must reach jobs.root inside it
        b = LiveBroker(Path(tmp) / "broker", nodes={f"node-{i}": 8 for i in range(args.nodes)}, quotas=quotas,
                       api_workers=args.api_workers)
        from broker.service.store.core import JobStore
        from tests.conftest import PG_URL

        try:
            b.start_redis()
            b.store = JobStore(PG_URL, schema=b.schema)
            b.store.migrate()
            b._spawn("api", "api")
            wait_for(lambda: requests.get(f"{b.url}/healthz", timeout=2).status_code == 200, 60, "the API")
            tok = b.token("bench")
            single_throughput(b.url, tok, 200, args.threads)  # warm up every worker's pools and caches
            api_pid = b.procs["api"].pid
            if args.client == "wrk":
                from sqlalchemy import text

                def stored() -> int:
                    with b.store.engine.connect() as c:
                        return int(c.execute(text("SELECT count(*) FROM jobs WHERE team = 'bench'")).scalar_one())

                a0, s0 = proc_tree_cpu_s(api_pid), stored()
                rate, n = single_throughput_wrk(b.url, tok, args.wrk_seconds, args.threads)
                # every answered request is a stored job; at most one request per connection was still in
                # flight when wrk stopped counting (stored, not counted)
                if not 0 <= stored() - s0 - n <= args.threads:
                    raise RuntimeError(f"wrk counted {n} submits but {stored() - s0} jobs were stored")
                cpu = {"api_cpu_ms_per_job": round((proc_tree_cpu_s(api_pid) - a0) / n * 1000, 3),
                       "client": "wrk", "jobs": n}
            else:
                rate, cpu = measured(api_pid, lambda: single_throughput(b.url, tok, args.single_jobs, args.threads),
                                     args.single_jobs)
            out["single_submit_jobs_per_s"] = round(rate, 1)
            out["single_submit_cpu"] = cpu
            print("single", out["single_submit_jobs_per_s"], cpu, flush=True)
            if args.batch_jobs:
                batch_throughput(b.url, tok, 2000)  # warm up
                durs: list[float] = []
                rate, cpu = measured(api_pid, lambda: durs.extend(batch_throughput(b.url, tok, args.batch_jobs)[1]),
                                     args.batch_jobs)
                out["batch_submit_jobs_per_s"] = round(rate, 1)
                out["batch_submit_cpu"] = cpu
                out["batch_request_ms"] = _stats(durs)
                print("batch", out["batch_submit_jobs_per_s"], cpu, flush=True)
            # clear the queue before the burst (cancelled jobs are not planned)
            with b.store.engine.begin() as c:
                from sqlalchemy import text

                c.execute(text("UPDATE jobs SET state = 'cancelled' WHERE team = 'bench'"))

            if args.skip_burst:
                return _report(out, args)
            # ---------------------------------------------------------------- the burst
            b.start_worker()
            b.start_beat()
            for n in b.nodes:
                b.start_agent(n)
            wait_for(lambda: {n.name for n in b.store.nodes() if n.state == "up"} >= set(b.nodes), 60, "the agents")
            other = Client(b.url, b.token("other"))
            other.wait(other.submit(PROBE_SPEC).id, timeout=60, poll_s=0.05)  # warm up the planner and agents
            worker_log = b.dir / "worker.log"
            mark = worker_log.stat().st_size
            burst_token = b.token("burst")
            done = threading.Event()
            burst_result: dict = {}

            def burst() -> None:
                t = time.perf_counter()
                rate, durs = batch_throughput(b.url, burst_token, args.burst_jobs, threads=1)
                burst_result.update(jobs_per_s=round(rate, 1), seconds=round(time.perf_counter() - t, 2),
                                    request_ms=_stats(durs))
                done.set()

            t_burst = time.perf_counter()
            th = threading.Thread(target=burst)
            th.start()
            probe_ids, cancel_ms, probes_late = [], [], 0
            canceller = Client(b.url, burst_token)
            end = t_burst + args.max_burst_s
            for _ in range(args.probes):
                if time.perf_counter() > end:
                    break
                j = other.submit(PROBE_SPEC)
                probe_ids.append(j.id)
                try:
                    other.wait(j.id, timeout=args.probe_timeout, poll_s=0.05)
                except WaitTimeout:
                    probes_late += 1
                queued = canceller.list(state=["submitted", "queued"], limit=1)
                if queued:
                    t = time.perf_counter()
                    canceller.cancel(queued[0].id)
                    cancel_ms.append((time.perf_counter() - t) * 1000)
            th.join()
            # absorbed: no burst job left in submitted
            try:
                wait_for(lambda: not b.store.list_jobs(team="burst", states=["submitted"], limit=1),
                         max(end - time.perf_counter(), 1.0), "intake")
                out["burst_absorbed_s"] = round(time.perf_counter() - t_burst, 2)
                time.sleep(2 * float(b.settings["plan_interval_s"]))
            except AssertionError:
                out["burst_absorbed_s"] = None
                out["burst_still_submitted"] = len(b.store.list_jobs(states=["submitted"], limit=1000))  # at most 1000
            cycles = cycles_in(worker_log, mark)
            last = cycles_last_line_age_s(worker_log)
            out["planner_cycle_running_for_s"] = None if last is None else round(last, 1)
            out["probes_not_running_within_timeout"] = probes_late
            out["burst_submit"] = burst_result
            out["planner_cycle_ms"] = _stats([c["total_s"] * 1000 for c in cycles])
            out["planner_cycles_over_2s"] = sum(c["total_s"] > 2 for c in cycles)
            out["planner_intake_per_cycle_max"] = max((c.get("intake", 0) for c in cycles), default=0)
            lat, placed = [], []
            for i in probe_ids:
                ev = {e.to_state: e.at for e in b.store.events(i)}
                if "running" in ev:
                    lat.append((ev["running"] - ev["submitted"]).total_seconds() * 1000)
                if "starting" in ev:  # the planner's part: placed (the agent's part is starting -> running)
                    placed.append((ev["starting"] - ev["submitted"]).total_seconds() * 1000)
            out["other_team_submit_to_running_ms"] = _stats(lat)
            out["other_team_submit_to_starting_ms"] = _stats(placed)
            out["cancel_ms"] = _stats(cancel_ms)
        finally:
            b.stop()
    _report(out, args)


def _report(out: dict, args) -> None:
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
