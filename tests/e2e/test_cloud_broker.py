"""End to end in the cloud: the live broker (real processes, PostgreSQL, Redis) bursts a 2-node gang to AWS
(the real boto3 client against a moto EC2 server); the instances it creates really run their user data on this
machine (tests/e2e/cloudsim.py: fake docker, a fake object store for checkpoints, a fake instance-metadata
endpoint per instance) and report to the broker's API.

The job counts steps and keeps its step in ``$CHECKPOINT_DIR``. A spot interruption notice on one instance
reaches that rank's process as SIGTERM (it checkpoints and exits), the broker requeues the job, tears down
both instances, provisions a new gang, and the new ranks resume from the uploaded checkpoint to the end.
"""

from __future__ import annotations

import re
import sys
import uuid

import boto3
import pytest

from broker.client import Client
from broker.model import JobSpec
from tests.e2e.cloudsim import InstanceEmulator
from tests.e2e.harness import LiveBroker, wait_for

REGION = "us-east-1"
IMAGE = "ghcr.io/fedbroker/nccl-train@sha256:" + "cd" * 32
STEPS = 40

TRAIN = f"""
import os, pathlib, signal, sys, time
rank = os.environ["NODE_RANK"]
ck = pathlib.Path(os.environ["CHECKPOINT_DIR"]) / f"rank{{rank}}.step"
step = int(ck.read_text()) if ck.exists() else 0
print(f"rank {{rank}} of {{os.environ['NNODES']}} resumed at step {{step}}; master {{os.environ['MASTER_ADDR']}}", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while step < {STEPS}:
    time.sleep(0.5)
    step += 1
    ck.write_text(str(step))
    if stop:
        print(f"rank {{rank}} got SIGTERM: checkpointed at step {{step}}", flush=True)
        sys.exit(143)
print(f"rank {{rank}} done at step {{step}}", flush=True)
"""


@pytest.fixture
def cloud(tmp_path, moto_server):
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_server)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    subnets = [s for s in ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]]
    broker_id = f"e2e-{uuid.uuid4().hex[:10]}"
    settings = {
        "cloud_providers": ["aws"],
        "aws": {"endpoint_url": moto_server, "checkpoint_uri": "s3://ckpt-bucket/runs",
                "regions": {REGION: {"ami_id": ami,
                                     "subnet_ids_by_az": {s["AvailabilityZone"]: s["SubnetId"] for s in subnets},
                                     "subnet_ids_by_az_id": {s["AvailabilityZoneId"]: s["SubnetId"] for s in subnets}}}},
        "cloud": {"broker_id": broker_id, "poll_interval_s": 2.0, "sweep_interval_s": 5.0, "notice_grace_s": 5,
                  "checkpoint_sync_s": 10, "start_deadline_s": 60.0},
    }
    emu = InstanceEmulator(tmp_path / "cloud", "aws", ec2_endpoint_url=moto_server, regions=[REGION],
                           broker_id=broker_id,
                           path_rewrite=("/var/lib/fedbroker/checkpoints", tmp_path / "disks"))
    b = LiveBroker(tmp_path / "broker", nodes={"node-a": 4}, **settings)
    try:
        b.start()
        emu.start()
        yield b, emu, ec2, broker_id
    except BaseException:
        print(b.logs())
        raise
    finally:
        emu.stop()
        b.stop()


def test_spot_notice_requeues_the_gang_which_resumes_from_its_checkpoint_on_new_instances(cloud):
    b, emu, ec2, broker_id = cloud
    client = Client(b.url, b.token("ml"))
    # 2 nodes x 1 V100: the one on-prem node cannot hold the gang, so the planner bursts to AWS
    job = client.submit(JobSpec(image=IMAGE, command=[sys.executable, "-c", TRAIN], nodes=2, gpus_per_node=1,
                                gpu_types=["V100"], estimated_duration_s=1800, checkpoint_interval_s=1))
    try:
        j = wait_for(lambda: (lambda v: v if v.state == "running" else None)(client.get(job.id)), 90,
                     "the job running on its cloud instances", interval=0.3)
        assert j.placement["kind"] == "cloud" and j.placement["provider"] == "aws"
        first = [n["instance_id"] for n in j.placement["nodes"]]
        assert len(first) == 2
        wait_for(lambda: all(emu.instances().get(i) for i in first), 30, "both instances booted")
        wait_for(lambda: any("resumed at step 0" in p.read_text()
                             for p in (emu.instances()[first[1]].dir / "log").glob("*.log")),
                 30, "rank 1 training", interval=0.3)
        emu.notice(first[1])  # EC2 says: this spot instance is reclaimed in 2 minutes

        def second_gang():
            v = client.get(job.id)
            nodes = (v.placement or {}).get("nodes") or []
            return v if v.attempt == 2 and v.state == "running" and nodes else None

        j2 = wait_for(second_gang, 90, "attempt 2 running on new instances", interval=0.3)
        second = [n["instance_id"] for n in j2.placement["nodes"]]
        assert not set(second) & set(first)
        done = wait_for(lambda: (lambda v: v if v.state in ("succeeded", "failed") else None)(client.get(job.id)),
                        90, "the job to finish", interval=0.5)
    except BaseException:
        for iid, st in emu.instances().items():
            print(f"==== instance {iid}: {st}\n{emu.console(iid)[-3000:]}")
        raise
    assert done.state == "succeeded", done.reason
    attempts = client.explain(job.id).attempts
    assert [(a.number, a.kind, a.outcome) for a in attempts] == [(1, "cloud", "interrupted"), (2, "cloud", "succeeded")]
    assert [f["error"] for f in attempts[0].failover] == [None, None]  # both ranks created on the first option
    assert attempts[1].offer_id != attempts[0].offer_id  # the reclaimed offer cools down: another zone or type
    # attempt 1: the notice reached rank 1's process, which checkpointed; the broker says why it requeued
    log1 = client.logs(job.id, attempt=1, rank=1)
    stopped_at = int(re.search(r"rank 1 got SIGTERM: checkpointed at step (\d+)", log1).group(1))
    assert 0 < stopped_at < STEPS
    events = [e.reason for e in client.explain(job.id).events]
    assert any(r.startswith("spot interruption notice for rank 1") for r in events), events
    assert any("requeued after interruption (spot interruption)" in r for r in events), events
    # rank 0 was stopped by its instance's shutdown: SIGTERM, it checkpointed, pushed and reported before the
    # broker requeued the gang
    log0 = client.logs(job.id, attempt=1, rank=0)
    stopped0 = int(re.search(r"rank 0 got SIGTERM: checkpointed at step (\d+)", log0).group(1))
    assert any("stopping the other ranks" in r for r in events), events
    # attempt 2: each rank resumed exactly where it was stopped, and finished
    for rank, step in ((0, stopped0), (1, stopped_at)):
        log2 = client.logs(job.id, attempt=2, rank=rank)
        assert int(re.search(rf"rank {rank} of 2 resumed at step (\d+)", log2).group(1)) == step, log2
        assert f"rank {rank} done at step {STEPS}" in log2
    # no instance is left: the broker terminated both gangs
    live = wait_for(lambda: not ec2.describe_instances(Filters=[
        {"Name": "tag:fedbroker-broker", "Values": [broker_id]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}])["Reservations"],
        30, "every instance terminated")
    assert live
