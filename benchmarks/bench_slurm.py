"""Slurm pool adapter on a real local Slurm (tests/slurm/cluster.py; root and the Debian packages needed):
time from ``submit()`` to the job running, and the cost of one ``poll()`` (every tracked job in one request)
and of one ``describe()`` with N held jobs of the broker queued. Both paths: CLI and slurmrestd.

With ``--broker`` (needs the test PostgreSQL, ``FEDBROKER_TEST_PG``), the live broker on a Slurm pool (CLI path):
the time from the planning cycle's decision to the job running in Slurm, and the cost of one reconciler watch
pass (:meth:`broker.service.schedulers.SchedulerPools.watch`: one ``poll()`` plus the store's N tracked jobs).

    PYTHONPATH=. python3 benchmarks/bench_slurm.py [N] [--broker]   # N held jobs, default 1000; ~35 s (+ ~40 s)
"""
import statistics
import sys
import time

sys.path.insert(0, ".")
from tests.slurm.cluster import LocalSlurm
from providers.slurm import SlurmJobRequest, SlurmPool, SlurmSettings

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
N = int(ARGS[0]) if ARGS else 1000
BROKER = "--broker" in sys.argv


def bench_broker(c: LocalSlurm, n: int) -> None:
    """Decision -> running, and one watch pass with ``n`` tracked jobs (the module docstring)."""
    import json
    import tempfile
    import uuid
    from pathlib import Path

    from broker.model import JobSpec
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment
    from broker.service.schedulers import SchedulerPools
    from broker.service.settings import BrokerSettings
    from broker.service.store import attempts as repo
    from broker.service.store import planning
    from broker.service.store.core import JobStore
    from tests.conftest import PG_URL

    f = Path(tempfile.mkdtemp()) / "cluster.json"
    f.write_text(json.dumps({"pools": [{"name": "hpc", "kind": "slurm", "carbon_zone": "CA-ON", "price_zone": "CA-ON",
                                        "slurm": {"partition": "gpu", "broker_id": "benchb", "slurm_conf": str(c.conf),
                                                  "log_dir": str(c.root / "jobs"), "term_grace_s": 0}}]}))
    st = BrokerSettings(cluster=f)
    env = LiveEnvironment(st.planner, f)
    store = JobStore(PG_URL, schema=f"bench_{uuid.uuid4().hex[:8]}")
    store.migrate()
    try:
        pools = SchedulerPools(env.site_pools.values(), st)
        cycle = PlanningCycle(store, env, st, schedulers=pools)
        ad = pools.adapter("hpc")
        spec = JobSpec(command=["sleep", "2"], gpu_types=["A100"], estimated_duration_s=60.0)
        cyc, lat = [], []
        for _ in range(10):
            job, _ = store.submit("bench", spec)
            t0 = time.monotonic()
            res = cycle.run()
            cyc.append(time.monotonic() - t0)
            sid = res.submitted[(job.id, 1)].split()[1]
            while ad.describe(sid).state != "running":
                time.sleep(0.01)
            lat.append(time.monotonic() - t0)
            ad.cancel(sid, grace_s=0)
            pools.watch(store)
        print(f"broker: planning cycle (decision + sbatch) median {statistics.median(cyc)*1000:.0f} ms; decision -> "
              f"running in Slurm median {statistics.median(lat)*1000:.0f} ms, max {max(lat)*1000:.0f} ms (10 jobs)")
        # n tracked jobs: store rows placed on the pool (starting, attempt 1) and a held Slurm job each
        jobs = [store.submit("bench", spec)[0] for _ in range(n)]
        t0 = time.monotonic()
        with store.session() as s:
            for j in jobs:
                JobStore.cas(s, j.id, j.version, "submitted", "queued", "bench")
                JobStore.cas(s, j.id, j.version + 1, "queued", "starting", "bench", placement={
                    "kind": "slurm", "pool": "hpc", "gpu_type": "A100", "scheduler_gpu_type": "a100",
                    "nodes": [{"node": "hpc/a001", "gpus": [0], "rank": 0}]}, attempt=1)
                planning.add_onprem_attempt(s, j.id, 1, "hpc", [{"node": "hpc/a001", "gpus": [0], "rank": 0}],
                                            "A100", jobs[0].created_at, kind="slurm")
        for j in jobs:
            sid = c.run("sbatch", "--parsable", "--hold", "-p", "gpu", "-t", "5", "--gpus-per-node=a100:1", "-o",
                        "/dev/null", f"--comment=fedbroker-broker=benchb,fedbroker-job={j.id},fedbroker-attempt=1,"
                        "fedbroker-team=bench", "--wrap", "true").stdout.strip()
            with store.session() as s:
                repo.set_external_id(s, j.id, 1, sid)
        print(f"tracked {n} held jobs in the store and Slurm in {time.monotonic()-t0:.1f} s")
        ts = []
        for _ in range(5):
            t0 = time.monotonic()
            out = pools.watch(store)
            ts.append(time.monotonic() - t0)
        assert out["polled"] == n and out["swept"] == 0 and out["changed"] == 0, out
        t0 = time.monotonic()
        polled = ad.poll()
        print(f"broker: watch pass over {out['polled']} tracked jobs (one poll() of {len(polled)}): median "
              f"{statistics.median(ts)*1000:.0f} ms, max {max(ts)*1000:.0f} ms (5 passes); the poll() alone "
              f"{(time.monotonic()-t0)*1000:.0f} ms")
        c.run("scancel", "--user=root", check=False)
    finally:
        store.drop_schema()


c = LocalSlurm().start()
try:
    if BROKER:
        bench_broker(c, N)
    base = dict(partition="gpu", broker_id="bench", log_dir=str(c.root / "jobs"), slurm_conf=str(c.conf))
    pools = {"cli": SlurmPool(SlurmSettings(**base)),
             "rest": SlurmPool(SlurmSettings(**base, rest_url=c.rest_url, jwt_file=str(c.jwt_file), rest_user="root"))}
    for name, p in pools.items():
        lat, sub = [], []
        for k in range(10):
            t0 = time.monotonic()
            info = p.submit(SlurmJobRequest(f"lat{k}", 0, "t", "sleep 2", "a100", 1, 60))
            sub.append(time.monotonic() - t0)
            while p.describe(info.slurm_job_id).state != "running":
                time.sleep(0.01)
            lat.append(time.monotonic() - t0)
            p.cancel(info.slurm_job_id, grace_s=0)
        print(f"{name}: submit() median {statistics.median(sub)*1000:.0f} ms; submit -> running median "
              f"{statistics.median(lat)*1000:.0f} ms, max {max(lat)*1000:.0f} ms (10 jobs, describe polled every 10 ms)")
    # N held jobs tagged for this broker (sbatch --hold: queued, never started)
    t0 = time.monotonic()
    for k in range(N):
        c.run("sbatch", "--hold", "-p", "gpu", "-t", "5", "--gpus-per-node=a100:1", "-o", "/dev/null",
              f"--comment=fedbroker-broker=bench,fedbroker-job=held{k},fedbroker-attempt=0,fedbroker-team=t",
              "--wrap", "true")
    print(f"queued {N} held jobs in {time.monotonic()-t0:.1f} s")
    for name, p in pools.items():
        ts = []
        for _ in range(5):
            t0 = time.monotonic(); got = p.poll(); ts.append(time.monotonic() - t0)
        print(f"{name}: poll() of {len(got)} jobs: median {statistics.median(ts)*1000:.0f} ms, max {max(ts)*1000:.0f} ms")
        some = list(got)[:50]
        t0 = time.monotonic()
        for sid in some:
            p.describe(sid)
        print(f"{name}: describe() one job: {(time.monotonic()-t0)/len(some)*1000:.1f} ms each")
finally:
    c.cleanup()
