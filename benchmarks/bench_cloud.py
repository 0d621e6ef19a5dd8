"""Cloud provisioning and watching at scale: time and provider calls, on a moto EC2 server.

Measures, with the real boto3 client against a local moto server (``moto.server.ThreadedMotoServer``)
and the job store on PostgreSQL (``FEDBROKER_TEST_PG``, default the local ``test`` database, in a schema
of its own that is dropped afterwards):

1. **Provisioning** (s per gang): ``--jobs`` 2-node gangs, each through ``CloudBroker.provision`` (intent
   rows, rank 0 then rank 1 with rank 0's address, the job moved to ``starting``).
2. **One reconciler watch pass** (s) over all of them running, and the provider calls it made: one
   ``list_managed`` listing per provider (``DescribeInstances`` pages) instead of one ``describe`` per
   instance (the calls a per-instance poll would make are shown for comparison).

moto answers in-process with no network delay or throttling, so the seconds measure the broker's own
work plus moto's; on AWS each call also costs its round trip (tens of ms) and counts against the EC2
API rate limits, which is why the number of calls is the figure that matters.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cloud.py [--jobs 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import code_version, machine_info  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """Run the measurements (see the module docstring); print and return the results (seconds, call counts)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=200, help="2-node gangs to provision and watch")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    import boto3
    from moto.server import ThreadedMotoServer
    from sqlalchemy import select

    from broker.service.cloud import CloudBroker, build_computes
    from broker.service.store.tables import Job, utcnow
    from broker.model import CloudOffer, JobSpec, Market
    from broker.service.settings import load_settings
    from broker.service.store.core import JobStore

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    pg = os.environ.get("FEDBROKER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    store = JobStore(pg, schema=f"bench_{uuid.uuid4().hex[:8]}")
    try:
        store.migrate()
        ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=url)
        ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        subnets = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
        with tempfile.TemporaryDirectory() as tmp:
            settings = load_settings(
                state_dir=tmp, cloud_providers=["aws"],
                aws={"endpoint_url": url, "regions": {"us-east-1": {
                    "ami_id": ami, "subnet_ids_by_az": {s["AvailabilityZone"]: s["SubnetId"] for s in subnets}}}},
                cloud={"broker_id": f"bench-{uuid.uuid4().hex[:8]}", "report_url": "https://10.0.0.2:8600/r"})
            compute = build_computes(settings)["aws"]
            compute.quota_source = lambda region, code: None  # moto has no Service Quotas defaults
            calls = {"list_managed": 0, "describe": 0}
            provider_s = [0.0]
            real_list, real_describe = compute.list_managed, compute.describe

            def counted_list(broker_id):
                calls["list_managed"] += 1
                t0 = time.perf_counter()
                try:
                    return real_list(broker_id)
                finally:
                    provider_s[0] += time.perf_counter() - t0

            def counted_describe(iid, zone):
                calls["describe"] += 1
                t0 = time.perf_counter()
                try:
                    return real_describe(iid, zone)
                finally:
                    provider_s[0] += time.perf_counter() - t0

            compute.list_managed, compute.describe = counted_list, counted_describe
            offer = CloudOffer(provider="aws", region="us-east-1", zone="us-east-1a", instance_type="p3.2xlarge",
                               gpu_type="V100", gpu_count=1, gpu_memory_gb=16, market=Market.spot, usd_per_hour=0.9,
                               carbon_zone="US-MIDA-PJM")
            cb = CloudBroker(store, settings, offers=[offer], computes={"aws": compute})
            spec = JobSpec(image="ghcr.io/x/train@sha256:" + "a" * 64, command=["python", "train.py"], nodes=2,
                           gpu_types=["V100"])
            per_gang = []
            ids = []
            for _ in range(args.jobs):
                view, _ = store.submit("bench", spec)
                now = utcnow()
                with store.session() as s:
                    j = s.get(Job, view.id)
                    JobStore.cas(s, j.id, j.version, "submitted", "queued", "accepted", now)
                    s.refresh(j)
                    JobStore.cas(s, j.id, j.version, "queued", "provisioning", "bench", now, attempt=1,
                                 placement={"kind": "cloud", "offer_id": offer.offer_id, "provider": "aws"},
                                 dispatched_at=now, state_deadline_at=now + timedelta(seconds=900))
                t = time.perf_counter()
                out = cb.provision(view.id, 1)
                per_gang.append(time.perf_counter() - t)
                assert out.startswith("starting"), out
                cb.report(view.id, 1, 0, "running")
                cb.report(view.id, 1, 1, "running")
                ids.append(view.id)
            calls.update(list_managed=0, describe=0)
            provider_s[0] = 0.0
            t = time.perf_counter()
            res = cb.watch(force=True)
            watch_s = time.perf_counter() - t
            assert res["lost"] == 0, res
            with store.session() as s:
                running = s.execute(select(Job.id).where(Job.state == "running")).all()
            result = {
                "gangs": args.jobs, "instances": 2 * args.jobs, "running_after_watch": len(running),
                "provision_s_per_gang_median": round(statistics.median(per_gang), 4),
                "provision_s_per_gang_p95": round(sorted(per_gang)[int(0.95 * (len(per_gang) - 1))], 4),
                "watch_pass_s": round(watch_s, 3),
                "watch_provider_s": round(provider_s[0], 3),
                "watch_broker_s": round(watch_s - provider_s[0], 3),
                "watch_provider_calls": dict(calls),
                "per_instance_poll_would_call_describe": 2 * args.jobs,
                "machine": machine_info(), "code": code_version(),
            }
    finally:
        try:
            store.drop_schema()
        finally:
            server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
