"""broker.service.cloud: a cloud attempt from provisioning to its end, on the real boto3 client against a moto EC2 server
and the real job store (PostgreSQL).

Errors moto cannot produce (no capacity in a zone) come from a thin subclass of the real adapter that
raises the adapter's own typed error for one zone; everything else is moto answering real API calls.
"""

from __future__ import annotations

import base64
import uuid
from datetime import timedelta

import boto3
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from broker.service.api import create_app
from broker.service.cloud import CloudBroker, failover_options, offer_allowed, report_token
from broker.service.store.tables import Attempt, CloudInstance, Job, utcnow
from broker.model import CloudOffer, JobSpec, Market
from broker.service.reconciler import Reconciler
from broker.service.settings import load_settings
from broker.service.store.core import JobStore
from providers.aws import AwsCompute
from providers.base import NoCapacity

REGION = "us-east-1"
IMAGE = "ghcr.io/fedbroker/nccl-train@sha256:" + "ab" * 32


def offer(zone: str, itype: str = "p3.2xlarge", market: str = "spot", price: float = 0.9, gpus: int = 1,
          region: str = REGION) -> CloudOffer:
    return CloudOffer(provider="aws", region=region, zone=zone, instance_type=itype, gpu_type="V100", gpu_count=gpus,
                      gpu_memory_gb=16, market=Market(market), usd_per_hour=price, carbon_zone="US-MIDA-PJM")


OFFERS = [offer("us-east-1a"), offer("us-east-1b", price=1.0), offer("us-east-1c", price=0.8),
          offer("us-east-1a", "p3.8xlarge", gpus=4, price=3.6), offer("us-east-1a", market="on_demand", price=3.06),
          offer("us-west-2a", region="us-west-2", price=0.7)]


@pytest.fixture(scope="module")
def net(moto_server):
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_server)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    default = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
    subnets = {s["AvailabilityZone"]: s["SubnetId"] for s in default}
    subnets.update({s["AvailabilityZoneId"]: s["SubnetId"] for s in default})
    return ami, subnets


@pytest.fixture
def settings(moto_server, net, tmp_path):
    ami, subnets = net
    return load_settings(
        state_dir=tmp_path, cloud_providers=["aws"],
        aws={"endpoint_url": moto_server, "checkpoint_uri": "s3://ckpt-bucket/runs",
             "regions": {REGION: {"ami_id": ami,
                                  "subnet_ids_by_az": {z: subnets[z] for z in ("us-east-1a", "us-east-1b", "us-east-1c")},
                                  # the catalog's zones are AZ IDs (the same zones here: a=az6, b=az1, c=az2)
                                  "subnet_ids_by_az_id": {z: subnets[z] for z in ("use1-az6", "use1-az1", "use1-az2")}}}},
        cloud={"broker_id": f"b-{uuid.uuid4().hex[:10]}", "report_url": "https://10.0.0.2:8600/v1/instances/report",
               "checkpoint_root": "/var/lib/fedbroker/checkpoints", "poll_interval_s": 1000})


class NoCapacityIn(AwsCompute):
    """The real adapter, except that creates in ``zones`` fail the way EC2 says "InsufficientInstanceCapacity"."""

    def __init__(self, zones, **kw):
        super().__init__(**kw)
        self.zones = set(zones)
        self.launches: list[str] = []

    def launch(self, req):
        self.launches.append(req.offer_id)
        if req.zone in self.zones:
            raise NoCapacity(f"We currently do not have sufficient {req.instance_type} capacity in {req.zone}",
                             req.offer_id, "InsufficientInstanceCapacity")
        return super().launch(req)


def adapter(settings, cls=AwsCompute, **kw):
    from broker.service.cloud import build_computes

    base = build_computes(settings)["aws"]
    return cls(endpoint_url=base.endpoint_url, regions=base.regions, ami_by_region=base.ami_by_region,
               subnet_by_zone=base.subnet_by_zone, quota_source=lambda region, code: None, **kw)


def place(store: JobStore, spec: JobSpec, o: CloudOffer, team: str = "ml") -> str:
    """Submit a job and move it to provisioning on offer ``o``, as the planning cycle does."""
    view, _ = store.submit(team, spec)
    now = utcnow()
    with store.session() as s:
        j = s.get(Job, view.id)
        assert JobStore.cas(s, j.id, j.version, "submitted", "queued", "accepted", now)
        s.refresh(j)
        assert JobStore.cas(s, j.id, j.version, "queued", "provisioning", "test placement", now, attempt=1,
                            placement={"kind": "cloud", "offer_id": o.offer_id, "provider": "aws", "region": o.region,
                                       "zone": o.zone, "instance_type": o.instance_type, "market": o.market.value,
                                       "gpu_type": o.gpu_type}, dispatched_at=now,
                            state_deadline_at=now + timedelta(seconds=900))
    return view.id


def ec2_of(settings):
    return boto3.client("ec2", region_name=REGION, endpoint_url=settings.aws.endpoint_url)


def instance(ec2, iid) -> dict:
    return ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]


def user_data(ec2, iid) -> str:
    raw = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")["UserData"]["Value"]
    return base64.b64decode(raw).decode()


def spec(**kw) -> JobSpec:
    base = dict(image=IMAGE, command=["python", "train.py", "--lr", "3e-4; reboot"], gpus_per_node=1, nodes=2,
                gpu_types=["V100"], estimated_duration_s=7200, checkpoint_interval_s=600)
    base.update(kw)
    return JobSpec(**base)


# ----------------------------------------------------------------------------- failover order

def test_failover_options_go_zone_then_type_then_region(settings):
    allowed = lambda o: offer_allowed(settings, o)  # noqa: E731
    got = [o.offer_id for o in failover_options(OFFERS, OFFERS[0].offer_id, spec(nodes=1).model_dump(), allowed)]
    # chosen first; then the same type and market in the other zones, cheapest per GPU first; then the other
    # market; the 4-GPU type does not fit a 1-GPU job; us-west-2 has no subnet configured (not allowed)
    assert got == ["aws:us-east-1a:p3.2xlarge:spot", "aws:us-east-1c:p3.2xlarge:spot",
                   "aws:us-east-1b:p3.2xlarge:spot", "aws:us-east-1a:p3.2xlarge:on_demand"]
    no_spot = failover_options(OFFERS, OFFERS[0].offer_id, spec(nodes=1, spot_allowed=False).model_dump(), allowed)
    assert [o.offer_id for o in no_spot] == ["aws:us-east-1a:p3.2xlarge:spot", "aws:us-east-1a:p3.2xlarge:on_demand"]
    cooled = failover_options(OFFERS, OFFERS[0].offer_id, spec(nodes=1).model_dump(), allowed,
                              cooling={"aws:us-east-1c:p3.2xlarge:spot"}, limit=2)
    assert [o.offer_id for o in cooled] == ["aws:us-east-1a:p3.2xlarge:spot", "aws:us-east-1b:p3.2xlarge:spot"]


# ----------------------------------------------------------------------------- provisioning

def test_a_two_node_gang_is_created_tagged_with_rank0_as_rendezvous(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    assert cb.provision(jid, 1) == "starting on aws:us-east-1a:p3.2xlarge:spot (2 instance(s))"
    j = pg_store.get(jid)
    assert j.state == "starting"
    nodes = j.placement["nodes"]
    assert [n["rank"] for n in nodes] == [0, 1] and all(n["zone"] == "us-east-1a" for n in nodes)
    ec2 = ec2_of(settings)
    i0, i1 = (instance(ec2, n["instance_id"]) for n in nodes)
    tags = {t["Key"]: t["Value"] for t in i1["Tags"]}
    assert {k: tags[k] for k in ("fedbroker-broker", "fedbroker-job", "fedbroker-attempt", "fedbroker-rank",
                                 "fedbroker-team")} == {"fedbroker-broker": settings.cloud.broker_id,
                                                        "fedbroker-job": jid, "fedbroker-attempt": "1",
                                                        "fedbroker-rank": "1", "fedbroker-team": "ml"}
    assert i1["InstanceLifecycle"] == "spot" and i1["SubnetId"] == settings.aws.regions[REGION].subnet_ids_by_az["us-east-1a"]
    ud0, ud1 = user_data(ec2, i0["InstanceId"]), user_data(ec2, i1["InstanceId"])
    # rank 1 rendezvous at rank 0's private address; rank 0 finds its own at boot
    assert f"-e MASTER_ADDR={i0['PrivateIpAddress']}" in ud1 and "-e MASTER_ADDR " in ud0
    assert "'3e-4; reboot'" in ud0 and "'3e-4; reboot'" in ud1
    assert f"CKPT_URI=s3://ckpt-bucket/runs/ml/{jid}" in ud0
    assert f"REPORT_TOKEN={cb.token(jid, 1, 1)}" in ud1
    with pg_store.session() as s:
        rows = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid).order_by(CloudInstance.rank)).scalars().all()
        assert [(r.rank, r.state, r.provider_instance_id, r.private_ip) for r in rows] == [
            (0, "running", i0["InstanceId"], i0["PrivateIpAddress"]), (1, "running", i1["InstanceId"], i1["PrivateIpAddress"])]
        att = s.execute(select(Attempt).where(Attempt.job_id == jid)).scalar_one()
        assert [(a["option"], a["error"]) for a in att.failover] == [("aws:us-east-1a:p3.2xlarge:spot", None)] * 2
    # provisioning again (a redelivered task) creates nothing new
    assert cb.provision(jid, 1) == "stale"


def test_no_capacity_in_one_zone_moves_the_attempt_to_the_next_and_cools_the_offer(pg_store, settings):
    compute = adapter(settings, NoCapacityIn, zones={"us-east-1a"})
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": compute})
    jid = place(pg_store, spec(nodes=1), OFFERS[0])
    assert cb.provision(jid, 1) == "starting on aws:us-east-1c:p3.2xlarge:spot (1 instance(s))"
    assert compute.launches == ["aws:us-east-1a:p3.2xlarge:spot", "aws:us-east-1c:p3.2xlarge:spot"]
    assert pg_store.get(jid).placement["zone"] == "us-east-1c"
    with pg_store.session() as s:
        att = s.execute(select(Attempt).where(Attempt.job_id == jid)).scalar_one()
        assert [(a["option"], a["error"]) for a in att.failover] == [
            ("aws:us-east-1a:p3.2xlarge:spot", "NoCapacity"), ("aws:us-east-1c:p3.2xlarge:spot", None)]
        failed = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid, CloudInstance.state == "failed")).scalar_one()
        assert failed.offer_id == "aws:us-east-1a:p3.2xlarge:spot" and failed.provider_instance_id is None
        assert failed.error.startswith("NoCapacity: We currently do not have sufficient p3.2xlarge capacity")
        assert cb.cooling_offers(s, utcnow()) == {"aws:us-east-1a:p3.2xlarge:spot"}
        assert cb.cooling_offers(s, utcnow() + timedelta(seconds=settings.cloud.capacity_cooldown_s + 1)) == set()


def test_every_instance_state_change_is_in_the_instance_history(pg_store, settings):
    """The history of a 1-node attempt whose first zone has no capacity: the failed option's row is written
    (intent) and fails; the next option's row is written, created (running) and terminated when the job ends."""
    from broker.service.store import cloud as instances

    compute = adapter(settings, NoCapacityIn, zones={"us-east-1a"})
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": compute})
    jid = place(pg_store, spec(nodes=1), OFFERS[0])
    assert cb.provision(jid, 1).startswith("starting on aws:us-east-1c:p3.2xlarge:spot")
    iid = pg_store.get(jid).placement["nodes"][0]["instance_id"]
    assert cb.report(jid, 1, 0, "exited", 0) == "succeeded"
    with pg_store.session() as s:
        got = [(h["offer_id"], h["from_state"], h["to_state"], h["reason"]) for h in instances.instance_history(s, jid)]
        rows = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid).order_by(CloudInstance.id)).scalars()
        assert [r.state for r in rows] == ["failed", "terminated"]
    a, c = OFFERS[0].offer_id, "aws:us-east-1c:p3.2xlarge:spot"
    nocap = "NoCapacity: We currently do not have sufficient p3.2xlarge capacity in us-east-1a"
    assert got == [(a, None, "intent", f"intent to create on {a}"), (c, None, "intent", f"intent to create on {c}"),
                   (a, "intent", "failed", nocap), (c, "intent", "running", f"created {iid}"),
                   (c, "running", "terminated", "the attempt ended")]


def test_every_option_failing_requeues_the_job_with_the_history(pg_store, settings):
    compute = adapter(settings, NoCapacityIn, zones={"us-east-1a", "us-east-1b", "us-east-1c"})
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": compute})
    jid = place(pg_store, spec(nodes=1), OFFERS[0])
    assert cb.provision(jid, 1) == "requeued"
    j = pg_store.get(jid)
    assert j.state == "queued" and j.placement is None
    msg = "We currently do not have sufficient p3.2xlarge capacity in us-east-1a"
    assert j.reason == ("cloud provisioning failed: "
                        f"aws:us-east-1a:p3.2xlarge:spot: NoCapacity ({msg}); "
                        f"aws:us-east-1c:p3.2xlarge:spot: NoCapacity ({msg.replace('1a', '1c')}); "
                        f"aws:us-east-1b:p3.2xlarge:spot: NoCapacity ({msg.replace('1a', '1b')}); "
                        f"aws:us-east-1a:p3.2xlarge:on_demand: NoCapacity ({msg})")
    assert [(a.outcome, [f["rank"] for f in a.failover]) for a in pg_store.attempts(jid)] == [("unprovisioned", [0] * 4)]
    # every option tried now cools down: the planner will not pick them again for capacity_cooldown_s, and
    # an attempt that created nothing does not count against max_attempts
    with pg_store.session() as s:
        assert cb.cooling_offers(s, utcnow()) == {o.offer_id for o in OFFERS[:3]} | {OFFERS[4].offer_id}
    for attempt in range(2, settings.max_attempts + 3):
        with pg_store.session() as s:
            j = s.get(Job, jid)
            assert JobStore.cas(s, jid, j.version, "queued", "provisioning", "again", utcnow(), attempt=attempt,
                                placement={"kind": "cloud", "offer_id": OFFERS[0].offer_id, "provider": "aws"})
        assert cb.provision(jid, attempt) == "requeued"
    assert pg_store.get(jid).state == "queued"


# ----------------------------------------------------------------------------- reports and teardown

def _api(store, settings, cb):
    return TestClient(create_app(store, settings, cloud=cb))


_SEQ = iter(range(1, 10**9))


def _report(client, token, **form):
    """POST a report as an instance's user data does (a fresh ``seq`` unless given)."""
    form.setdefault("seq", next(_SEQ))
    return client.post("/v1/instances/report", data={k: str(v) for k, v in form.items()},
                       headers={"Authorization": f"Bearer {token}"})


def test_reports_run_the_job_to_success_and_terminate_its_instances(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    api = _api(pg_store, settings, cb)
    # another rank's token, a made-up token, a missing field: refused, nothing recorded
    r = _report(api, cb.token(jid, 1, 0), job_id=jid, attempt=1, rank=1, event="running")
    assert r.status_code == 401
    assert _report(api, "x" * 43, job_id=jid, attempt=1, rank=0, event="running").status_code == 401
    r = _report(api, cb.token(jid, 1, 0), job_id=jid, attempt="one", rank=0, event="running")
    assert r.status_code == 422 and r.json()["detail"][0]["msg"] == "attempt='one': must be an integer in [0, 2147483647]"
    r = _report(api, cb.token(jid, 1, 0), job_id=jid, attempt=1, rank=0, event="rebooted")
    assert r.status_code == 422 and "event='rebooted'" in r.json()["detail"][0]["msg"]
    assert pg_store.get(jid).state == "starting"

    assert _report(api, cb.token(jid, 1, 0), job_id=jid, attempt=1, rank=0, event="running").json() == {"outcome": "running"}
    assert pg_store.get(jid).state == "running"
    r = _report(api, cb.token(jid, 1, 1), job_id=jid, attempt=1, rank=1, event="exited", exit_code=0,
                log_tail="step 100 loss 0.1\n")
    assert r.json() == {"outcome": "rank done"} and pg_store.get(jid).state == "running"
    r = _report(api, cb.token(jid, 1, 0), job_id=jid, attempt=1, rank=0, event="exited", exit_code=0)
    assert r.json() == {"outcome": "succeeded"}
    j = pg_store.get(jid)
    assert (j.state, j.exit_code) == ("succeeded", 0)
    ec2 = ec2_of(settings)
    assert {instance(ec2, n["instance_id"])["State"]["Name"] for n in j.placement["nodes"]} <= {"shutting-down", "terminated"}
    assert pg_store.log_chunks(jid, 1, 1)[0][1].endswith("step 100 loss 0.1\n")
    # a late duplicate report of an ended attempt changes nothing
    assert _report(api, cb.token(jid, 1, 0), job_id=jid, attempt=1, rank=0, event="exited", exit_code=1).json() == {
        "outcome": "stale"}
    assert pg_store.get(jid).state == "succeeded"


def test_a_replayed_or_older_report_changes_nothing_and_appends_the_log_once(pg_store, settings):
    """Replay protection (issue #9): each rank's reports carry a rising ``seq``; a copy or an older one is
    answered 200 ``duplicate`` and changes nothing (no state, no event, no second log tail)."""
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    api = _api(pg_store, settings, cb)
    t0, t1 = cb.token(jid, 1, 0), cb.token(jid, 1, 1)
    assert _report(api, t0, job_id=jid, attempt=1, rank=0, event="running", seq=1).json() == {"outcome": "running"}
    assert _report(api, t0, job_id=jid, attempt=1, rank=0, event="running", seq=1).json() == {"outcome": "duplicate"}
    exited = dict(job_id=jid, attempt=1, rank=1, event="exited", exit_code=0, log_tail="step 100 loss 0.1\n")
    assert _report(api, t1, **exited, seq=2).json() == {"outcome": "rank done"}
    version = pg_store.get(jid).version
    for seq in (2, 1, 0):  # the same report again, then older ones
        r = _report(api, t1, **exited, seq=seq)
        assert r.status_code == 200 and r.json() == {"outcome": "duplicate"}
    j = pg_store.get(jid)
    assert (j.state, j.version) == ("running", version)
    assert len(pg_store.log_chunks(jid, 1, 1)) == 1
    # seq is per rank: rank 0's counter is its own
    assert _report(api, t0, job_id=jid, attempt=1, rank=0, event="exited", exit_code=0, seq=2).json() == {
        "outcome": "succeeded"}
    r = _report(api, t0, job_id=jid, attempt=1, rank=0, event="running")
    assert r.status_code == 200  # a fresh seq from the test's counter: taken, and stale (the attempt ended)
    r = api.post("/v1/instances/report", data={"job_id": jid, "attempt": "1", "rank": "0", "event": "running"},
                 headers={"Authorization": f"Bearer {t0}"})
    assert r.status_code == 422 and r.json()["detail"][0]["msg"] == "seq=None: field required"


def test_a_failed_rank_fails_the_job_and_tears_down_every_node(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    nodes = pg_store.get(jid).placement["nodes"]
    ec2 = ec2_of(settings)
    assert cb.report(jid, 1, 1, "exited", 1) == "stopping the other ranks"
    j = pg_store.get(jid)
    assert j.state == "running" and j.reason == f"rank 1 on aws/{nodes[1]['instance_id']} ended (1); stopping the other ranks"
    assert instance(ec2, nodes[0]["instance_id"])["State"]["Name"] in ("shutting-down", "terminated")  # rank 0 stopped
    # rank 0 got SIGTERM from its instance's shutdown: 143
    assert cb.report(jid, 1, 0, "exited", 143) == "failed"
    j = pg_store.get(jid)
    assert (j.state, j.exit_code, j.reason) == ("failed", 1, "ranks ended with {'1': 1, '0': 143}")
    assert {instance(ec2, n["instance_id"])["State"]["Name"] for n in nodes} <= {"shutting-down", "terminated"}


def test_spot_notice_requeues_the_job_from_its_checkpoint(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    t0 = utcnow()
    assert cb.report(jid, 1, 0, "running", now=t0) == "running"
    assert cb.report(jid, 1, 1, "notice", reason="EC2 spot interruption notice", now=t0 + timedelta(seconds=1290)) == "notice"
    assert pg_store.get(jid).state == "running"
    # the script stopped the container (SIGTERM, it checkpointed): exit 143; rank 0 is stopped the same way
    assert cb.report(jid, 1, 1, "exited", 143, now=t0 + timedelta(seconds=1295)) == "stopping the other ranks"
    rank0 = pg_store.get(jid).placement["nodes"][0]["instance_id"]
    assert instance(ec2_of(settings), rank0)["State"]["Name"] in ("shutting-down", "terminated")
    assert pg_store.get(jid).state == "running"
    assert cb.report(jid, 1, 0, "exited", 143, now=t0 + timedelta(seconds=1300)) == "requeued"
    j = pg_store.get(jid)
    with pg_store.session() as s:
        row = s.get(Job, jid)
        # 1300 s run, checkpoints every 600 s: 1200 s of work kept (the next attempt resumes there)
        assert (row.state, row.work_done_s, row.placement, row.stop_reason) == ("queued", 1200.0, None, None)
    assert "spot interruption" in j.reason and "1200 s of work kept from checkpoints" in j.reason
    assert [a.outcome for a in pg_store.attempts(jid)] == ["interrupted"]
    with pg_store.session() as s:
        states = [r.state for r in s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalars()]
    assert states == ["terminated", "terminated"]


def test_losing_one_instance_requeues_the_gang_and_terminates_the_other(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    cb.report(jid, 1, 0, "running")
    nodes = pg_store.get(jid).placement["nodes"]
    ec2 = ec2_of(settings)
    ec2.terminate_instances(InstanceIds=[nodes[1]["instance_id"]])  # reclaimed, no report ever came
    out = cb.watch(force=True)
    assert out["lost"] == 1
    j = pg_store.get(jid)
    assert j.state == "queued" and f"instance {nodes[1]['instance_id']} was reclaimed (spot interruption)" in j.reason
    assert instance(ec2, nodes[0]["instance_id"])["State"]["Name"] in ("shutting-down", "terminated")


def test_cancel_of_a_running_cloud_job_terminates_its_instances(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(nodes=1), OFFERS[0])
    cb.provision(jid, 1)
    cb.report(jid, 1, 0, "running")
    pg_store.request_cancel(jid)
    assert cb.watch()["cancelled"] == 1
    j = pg_store.get(jid)
    assert j.state == "cancelled"
    assert instance(ec2_of(settings), j.placement["nodes"][0]["instance_id"])["State"]["Name"] in ("shutting-down",
                                                                                                 "terminated")


class Crash(BaseException):
    """The broker process dying right after the create call returned (nothing after it runs)."""


class CrashAfterCreate(AwsCompute):
    def launch(self, req):
        super().launch(req)
        raise Crash()


def test_broker_killed_between_create_and_record_leaves_no_orphan_after_one_sweep(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings, CrashAfterCreate)})
    jid = place(pg_store, spec(nodes=1), OFFERS[0])
    with pytest.raises(Crash):
        cb.provision(jid, 1)
    with pg_store.session() as s:
        row = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalar_one()
        assert (row.state, row.provider_instance_id) == ("intent", None)  # the intent was written first
    ec2 = ec2_of(settings)
    flt = [{"Name": "tag:fedbroker-broker", "Values": [settings.cloud.broker_id]},
           {"Name": "instance-state-name", "Values": ["pending", "running"]}]
    leaked = [i["InstanceId"] for r in ec2.describe_instances(Filters=flt)["Reservations"] for i in r["Instances"]]
    assert len(leaked) == 1
    # a restarted broker: the provisioning deadline passes, the reconciler requeues the job, one sweep
    fresh = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    out = Reconciler(pg_store, settings, cloud=fresh).run(utcnow() + timedelta(seconds=901))
    assert out["timed_out"] == 1 and out["cloud"]["swept"] == 1
    assert instance(ec2, leaked[0])["State"]["Name"] in ("shutting-down", "terminated")
    assert ec2.describe_instances(Filters=flt)["Reservations"] == []
    with pg_store.session() as s:
        row = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalar_one()
        assert row.state == "abandoned"


def test_report_tokens_are_per_rank_and_attempt():
    key = b"k" * 32
    t = report_token(key, "job-1", 1, 0)
    assert len(t) == 43 and t != report_token(key, "job-1", 1, 1) != report_token(key, "job-1", 2, 0)
    assert t == report_token(key, "job-1", 1, 0) != report_token(b"j" * 32, "job-1", 1, 0)


# ----------------------------------------------------------------------------- GCP: the same flow on Compute Engine

def _gcp_settings(tmp_path, endpoint):
    return load_settings(
        state_dir=tmp_path, cloud_providers=["gcp"],
        gcp={"project": "fedbroker-test", "region": "us-central1", "api_endpoint": endpoint,
             "operation_timeout_s": 5, "checkpoint_uri": "gs://ckpt-bucket/runs"},
        cloud={"broker_id": f"b-{uuid.uuid4().hex[:10]}", "report_url": "https://10.0.0.2:8600/v1/instances/report"})


GCP_OFFERS = [CloudOffer(provider="gcp", region=z[:-2], zone=z, instance_type="n1-standard-8", gpu_type="V100",
                         gpu_count=1, gpu_memory_gb=16, market=Market.spot, usd_per_hour=p, carbon_zone="US-MIDW-MISO")
              for z, p in (("us-central1-a", 0.9), ("us-central1-b", 1.0), ("europe-west4-a", 0.5))]


def test_gcp_stockout_fails_over_and_a_preempted_vm_requeues_the_gang(pg_store, tmp_path):
    from tests.providers.fake_gce import FakeGce

    with FakeGce("fedbroker-test", wait_block_s=0.05) as fake:
        settings = _gcp_settings(tmp_path, fake.endpoint)
        cb = CloudBroker(pg_store, settings, offers=GCP_OFFERS)
        fake.fail_next_insert("us-central1-a", "stockout_details")
        jid = place(pg_store, spec(), GCP_OFFERS[0])
        # us-central1-a is out of V100s; europe-west4 is outside the configured region: us-central1-b holds the gang
        assert cb.provision(jid, 1) == "starting on gcp:us-central1-b:n1-standard-8:spot (2 instance(s))"
        j = pg_store.get(jid)
        with pg_store.session() as s:
            att = s.execute(select(Attempt).where(Attempt.job_id == jid)).scalar_one()
            assert [(a["option"], a["error"]) for a in att.failover] == [
                ("gcp:us-central1-a:n1-standard-8:spot", "NoCapacity"), ("gcp:us-central1-b:n1-standard-8:spot", None),
                ("gcp:us-central1-b:n1-standard-8:spot", None)]
        n0, n1 = j.placement["nodes"]
        inst0, inst1 = fake.instance("us-central1-b", n0["instance_id"]), fake.instance("us-central1-b", n1["instance_id"])
        script1 = {i["key"]: i["value"] for i in inst1["metadata"]["items"]}["startup-script"]
        assert f"-e MASTER_ADDR={inst0['networkInterfaces'][0]['networkIP']}" in script1
        assert inst1["scheduling"]["provisioningModel"] == "SPOT"
        assert inst1["labels"]["fedbroker-job"] == jid.lower()
        cb.report(jid, 1, 0, "running")
        fake.preempt("us-central1-b", n1["instance_id"])  # no notice got through: the VM is simply gone
        assert cb.watch(force=True)["lost"] == 1
        j = pg_store.get(jid)
        assert j.state == "queued" and f"instance {n1['instance_id']} was reclaimed (spot interruption)" in j.reason
        assert fake.instance("us-central1-b", n0["instance_id"]) is None or \
            fake.instance("us-central1-b", n0["instance_id"])["status"] in ("STOPPING", "TERMINATED")


def test_a_rank_that_never_reports_requeues_the_gang_and_cools_the_offer(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    cb.report(jid, 1, 0, "running")  # rank 1 never says a word (its user data failed before the container)
    later = utcnow() + timedelta(seconds=settings.cloud.start_deadline_s + 1)
    out = cb.watch(later)
    assert (out["lost"], out["changed"]) == (1, 1)
    j = pg_store.get(jid)
    assert j.state == "queued" and "rank(s) [1] never reported running within 1200 s" in j.reason
    with pg_store.session() as s:
        assert cb.cooling_offers(s, later) == {OFFERS[0].offer_id}
        errors = {r.error.split(":")[0] for r in s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalars()}
    assert errors == {"StartTimeout"}  # kept through the teardown
    ec2 = ec2_of(settings)
    assert {instance(ec2, n["instance_id"])["State"]["Name"] for n in pg_store.attempts(jid)[0].nodes} <= {
        "shutting-down", "terminated"}


def test_a_spot_reclaim_cools_the_offer_and_work_is_counted_per_attempt(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(nodes=1), OFFERS[0])
    cb.provision(jid, 1)
    t0 = utcnow()
    cb.report(jid, 1, 0, "running", now=t0)
    cb.report(jid, 1, 0, "notice", now=t0 + timedelta(seconds=700))
    assert cb.report(jid, 1, 0, "exited", 143, now=t0 + timedelta(seconds=710)) == "requeued"
    with pg_store.session() as s:
        assert cb.cooling_offers(s, t0 + timedelta(seconds=710)) == {OFFERS[0].offer_id}
        assert s.get(Job, jid).work_done_s == 600.0
    # attempt 2 starts an hour later and is reclaimed after 650 s: 600 s more kept, counted from ITS start
    with pg_store.session() as s:
        j = s.get(Job, jid)
        assert JobStore.cas(s, jid, j.version, "queued", "provisioning", "again", utcnow(), attempt=2,
                            placement={"kind": "cloud", "offer_id": OFFERS[1].offer_id, "provider": "aws"})
    cb.provision(jid, 2)
    t1 = t0 + timedelta(hours=1)
    cb.report(jid, 2, 0, "running", now=t1)
    cb.report(jid, 2, 0, "exited", None, now=t1 + timedelta(seconds=650))
    with pg_store.session() as s:
        assert s.get(Job, jid).work_done_s == 1200.0
    assert [(a.number, a.started_at) for a in pg_store.attempts(jid)] == [(1, t0), (2, t1)]


def test_the_sweep_takes_an_instance_whose_attempt_tag_was_edited(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    ec2 = ec2_of(settings)
    ami = settings.aws.regions[REGION].ami_id
    bad = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="p3.2xlarge", TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "fedbroker-broker", "Value": settings.cloud.broker_id},
                                              {"Key": "fedbroker-job", "Value": "job-x"},
                                              {"Key": "fedbroker-attempt", "Value": "garbage"}]}])["Instances"][0]
    other = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="p3.2xlarge", TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "fedbroker-broker", "Value": "another-broker"}]}])["Instances"][0]
    assert [i.instance_id for i in cb.sweep()] == [bad["InstanceId"]]
    assert instance(ec2, bad["InstanceId"])["State"]["Name"] in ("shutting-down", "terminated")
    assert instance(ec2, other["InstanceId"])["State"]["Name"] == "running"
    ec2.terminate_instances(InstanceIds=[other["InstanceId"]])


# ----------------------------------------------------------------------------- the planning cycle with a cloud

def test_the_planner_bursts_a_pinned_gang_and_says_why_a_tag_only_one_cannot_go(pg_store, settings):
    from functools import partial

    from broker.service.cloud import offer_allowed as allowed
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment

    env = LiveEnvironment(settings.planner, None, settings.cloud_providers, offer_allowed=partial(allowed, settings))
    cb = CloudBroker(pg_store, settings, offers=env.offers, computes={"aws": adapter(settings)})
    sent = []
    cyc = PlanningCycle(pg_store, env, settings, dispatch=lambda j, a: sent.append((j, a)), cloud=cb)
    pg_store.heartbeat("n1", "local", "V100", 4, 16.0, [0, 1, 2, 3], "agent-1")  # one node: no 2-node gang fits
    pinned = pg_store.submit("ml", spec())[0].id
    tagged = pg_store.submit("ml", spec(image="ghcr.io/fedbroker/nccl-train:latest"))[0].id
    cyc.run()
    j = pg_store.get(pinned)
    assert j.state == "provisioning" and j.placement["provider"] == "aws" and sent == [(pinned, 1)]
    assert offer_allowed(settings, next(o for o in env.offers if o.offer_id == j.placement["offer_id"]))
    t = pg_store.get(tagged)
    assert t.state == "failed" and t.reason.startswith("no on-prem pool can ever hold 2x1 GPUs") and t.reason.endswith(
        "; cloud offers were not considered: cloud launches need the image pinned by digest "
        "(image: repo@sha256:<64 hex>), so all ranks of a gang run the same bits")


class Counting(AwsCompute):
    """The real adapter, counting the provider calls the watch makes."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: dict[str, int] = {"list_managed": 0, "describe": 0}

    def list_managed(self, broker_id):
        self.calls["list_managed"] += 1
        return super().list_managed(broker_id)

    def describe(self, instance_id, zone):
        self.calls["describe"] += 1
        return super().describe(instance_id, zone)


def test_one_listing_polls_every_cloud_attempt(pg_store, settings):
    compute = adapter(settings, Counting)
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": compute})
    ids = []
    for _ in range(5):
        jid = place(pg_store, spec(), OFFERS[0])
        cb.provision(jid, 1)
        cb.report(jid, 1, 0, "running")
        ids.append(jid)
    out = cb.watch(force=True)
    # 5 gangs, 10 instances: one DescribeInstances listing (plus the sweep's), no describe per instance
    assert (out["listed"], out["lost"], compute.calls["describe"]) == (1, 0, 0)
    assert compute.calls["list_managed"] == 2  # the poll's listing and the sweep's
    victim = pg_store.get(ids[2]).placement["nodes"][0]["instance_id"]
    ec2_of(settings).terminate_instances(InstanceIds=[victim])
    out = cb.watch(force=True)
    assert out["lost"] == 1 and compute.calls["describe"] == 1  # only the missing one is described
    assert [pg_store.get(j).state for j in ids] == ["running", "running", "queued", "running", "running"]


def test_a_notice_from_on_demand_is_ignored_and_a_stale_report_changes_nothing(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(nodes=1), OFFERS[4])  # on-demand
    cb.provision(jid, 1)
    cb.report(jid, 1, 0, "running")
    assert cb.report(jid, 1, 0, "notice") == "ignored: a notice from an instance that is not spot"
    with pg_store.session() as s:
        assert s.get(Job, jid).stop_reason is None
    assert cb.report(jid, 1, 0, "exited", 0) == "succeeded"
    assert cb.report(jid, 1, 0, "running") == "stale"
    with pg_store.session() as s:
        row = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalar_one()
        assert row.last_event == "exited"


class Gangs(AwsCompute):
    """The real adapter; each create takes 0.3 s, and rank 2 finds no capacity in ``bad_zone``."""

    def __init__(self, bad_zone, **kw):
        super().__init__(**kw)
        import threading

        self.bad_zone, self.lock, self.in_flight, self.most = bad_zone, threading.Lock(), 0, 0

    def launch(self, req):
        import time

        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(0.3)
            if req.rank == 2 and req.zone == self.bad_zone:
                raise NoCapacity(f"no capacity in {req.zone}", req.offer_id, "InsufficientInstanceCapacity")
            return super().launch(req)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_a_gang_is_created_in_parallel_and_fails_over_as_a_whole(pg_store, settings):
    compute = adapter(settings, Gangs, bad_zone="us-east-1a")
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": compute})
    jid = place(pg_store, spec(nodes=4), OFFERS[0])
    assert cb.provision(jid, 1) == "starting on aws:us-east-1c:p3.2xlarge:spot (4 instance(s))"
    assert compute.most == 3  # ranks 1-3 at once, after rank 0
    j = pg_store.get(jid)
    assert [n["rank"] for n in j.placement["nodes"]] == [0, 1, 2, 3]
    with pg_store.session() as s:
        rows = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalars().all()
        first = [r for r in rows if r.zone == "us-east-1a"]
        # the partial gang in us-east-1a (ranks 0, 1, 3) was terminated; rank 2 there never existed
        assert sorted((r.rank, r.state) for r in first) == [(0, "terminated"), (1, "terminated"), (2, "failed"),
                                                            (3, "terminated")]
        assert sorted(r.rank for r in rows if r.zone == "us-east-1c" and r.state == "running") == [0, 1, 2, 3]
    ec2 = ec2_of(settings)
    for r in first:
        if r.provider_instance_id:
            assert instance(ec2, r.provider_instance_id)["State"]["Name"] in ("shutting-down", "terminated")


def test_a_stopping_gang_whose_rank_never_reports_ends_after_the_stop_window(pg_store, settings):
    cb = CloudBroker(pg_store, settings, offers=OFFERS, computes={"aws": adapter(settings)})
    jid = place(pg_store, spec(), OFFERS[0])
    cb.provision(jid, 1)
    t0 = utcnow()
    cb.report(jid, 1, 0, "running", now=t0)
    cb.report(jid, 1, 1, "notice", now=t0 + timedelta(seconds=650))
    assert cb.report(jid, 1, 1, "exited", 143, now=t0 + timedelta(seconds=660)) == "stopping the other ranks"
    # rank 0's instance died with its report: nothing happens within the window (90 s grace + 180 s from the
    # notice)...
    assert cb.watch(t0 + timedelta(seconds=650 + 269), force=True)["lost"] == 0
    assert pg_store.get(jid).state == "running"
    # ...then the attempt ends without it: requeued from its checkpoint (a spot notice started it)
    assert cb.watch(t0 + timedelta(seconds=650 + 271), force=True)["lost"] == 1
    with pg_store.session() as s:
        j = s.get(Job, jid)
        assert (j.state, j.work_done_s) == ("queued", 600.0)
        assert s.execute(select(Attempt).where(Attempt.job_id == jid)).scalar_one().rank_exits == {"1": 143, "0": "lost"}
