"""Slurm pool adapter on a real local Slurm (tests/slurm/cluster.py; root and the Debian packages needed):
time from ``submit()`` to the job running, and the cost of one ``poll()`` (every tracked job in one request)
and of one ``describe()`` with N held jobs of the broker queued. Both paths: CLI and slurmrestd.

    PYTHONPATH=. python3 benchmarks/bench_slurm.py [N]      # N held jobs, default 1000; about 35 s
"""
import statistics
import sys
import time

sys.path.insert(0, ".")
from tests.slurm.cluster import LocalSlurm
from providers.slurm import SlurmJobRequest, SlurmPool, SlurmSettings

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
c = LocalSlurm().start()
try:
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
