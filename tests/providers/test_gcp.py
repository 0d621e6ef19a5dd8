"""GcpCompute with the real google-cloud-compute REST client against the local fake GCE (tests/providers/fake_gce.py)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("google.cloud.compute_v1")

from google.auth.credentials import AnonymousCredentials  # noqa: E402
from google.cloud import compute_v1  # noqa: E402

from providers.base import (MANAGED_TAG, InstanceRequest, NoCapacity, ProviderError, QuotaExceeded,  # noqa: E402
                            Throttled, Unsupported, as_uuid, idempotency_token, instance_tags)
from providers.gcp import (GcpCompute, gce_accelerator, instance_name, label_key, label_value,  # noqa: E402
                           map_state)
from tests.providers.fake_gce import FakeGce, parse_filter  # noqa: E402

PROJECT = "test-project"
ZA, ZB = "us-central1-a", "us-central1-b"


@pytest.fixture
def fake():
    with FakeGce(PROJECT, wait_block_s=0.1) as f:
        yield f


@pytest.fixture
def gcp(fake):
    opts = {"api_endpoint": fake.endpoint}
    return GcpCompute(
        PROJECT,
        instances_client=compute_v1.InstancesClient(transport="rest", client_options=opts,
                                                    credentials=AnonymousCredentials()),
        zone_operations_client=compute_v1.ZoneOperationsClient(transport="rest", client_options=opts,
                                                               credentials=AnonymousCredentials()),
        op_timeout_s=5.0, poll_interval_s=0.02)


def req(job="job-0123456789abcdef", attempt=1, rank=0, zone=ZA, itype="n1-standard-8", market="spot",
        gpu="T4", n=1, broker="broker-1", team="team-A", user_data="#!/bin/bash\necho start job\n"):
    offer = f"gcp:{zone}:{itype}:{market}"
    return InstanceRequest(job_id=job, attempt=attempt, rank=rank, team=team, offer_id=offer,
                           region=zone.rsplit("-", 1)[0], zone=zone, instance_type=itype, market=market,
                           gpu_type=gpu, gpu_count=n, user_data=user_data,
                           tags=instance_tags(job, attempt, rank, team, broker),
                           token=idempotency_token(job, attempt, offer, rank))


def metadata(inst: dict) -> dict:
    return {i["key"]: i["value"] for i in inst["metadata"]["items"]}


# ---- launch ------------------------------------------------------------------------------------


def test_launch_spot_n1_t4_creates_labelled_instance(gcp, fake):
    r = req()
    info = gcp.launch(r)
    name = instance_name(r.token)
    assert name == "fb-" + r.token[:20] and len(name) == 23
    assert info.instance_id == name and info.zone == ZA and info.instance_type == "n1-standard-8"
    assert info.provider == "gcp" and info.state == "running" and info.spot is True
    assert info.private_ip == "10.128.0.2"
    assert info.tags == r.tags  # exact tags (team-A keeps its capital letter)
    assert info.launched_at is not None and info.launched_at.tzinfo is not None

    insts = fake.instances_in()
    assert len(insts) == 1
    inst = insts[0]
    assert inst["name"] == name
    assert inst["machineType"].endswith(f"/projects/{PROJECT}/zones/{ZA}/machineTypes/n1-standard-8")
    assert fake.insert_bodies[0]["machineType"] == f"zones/{ZA}/machineTypes/n1-standard-8"
    assert inst["labels"] == {MANAGED_TAG: "broker-1", "fedbroker-job": "job-0123456789abcdef",
                              "fedbroker-attempt": "1", "fedbroker-rank": "0", "fedbroker-team": "team-a"}
    acc = inst["guestAccelerators"]
    assert len(acc) == 1 and acc[0]["acceleratorCount"] == 1
    assert acc[0]["acceleratorType"].endswith(f"zones/{ZA}/acceleratorTypes/nvidia-tesla-t4")
    assert inst["scheduling"] == {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                                  "onHostMaintenance": "TERMINATE", "automaticRestart": False}
    md = metadata(inst)
    assert md["startup-script"] == "#!/bin/bash\necho start job\n"
    assert json.loads(md["fedbroker-tags"]) == r.tags
    assert inst["disks"][0]["boot"] is True and inst["disks"][0]["autoDelete"] is True
    # requestId is the token as a UUID
    posts = [q for m, p, q in fake.requests if m == "POST" and p.endswith("/instances")]
    assert posts == [{"requestId": as_uuid(r.token)}]


def test_launch_on_demand_builtin_gpu_has_no_accelerators(gcp, fake):
    r = req(itype="a2-highgpu-1g", market="on_demand", gpu="A100")
    info = gcp.launch(r)
    assert info.spot is False and info.instance_type == "a2-highgpu-1g"
    inst = fake.instance(ZA, info.instance_id)
    assert inst.get("guestAccelerators", []) == []
    assert inst["scheduling"] == {"provisioningModel": "STANDARD", "onHostMaintenance": "TERMINATE",
                                  "automaticRestart": True}


def test_launch_n1_v100_count(gcp, fake):
    info = gcp.launch(req(itype="n1-standard-16", gpu="V100", n=2, market="on_demand"))
    acc = fake.instance(ZA, info.instance_id)["guestAccelerators"]
    assert acc[0]["acceleratorCount"] == 2 and acc[0]["acceleratorType"].endswith("/nvidia-tesla-v100")


def test_launch_unattachable_gpu_is_unsupported_without_api_call(gcp, fake):
    r = req(itype="n1-standard-8", gpu="A100")
    with pytest.raises(Unsupported) as ei:
        gcp.launch(r)
    assert ei.value.option == r.offer_id and ei.value.code == "UnsupportedAccelerator"
    assert fake.requests == []


def test_same_token_twice_creates_nothing_new(gcp, fake):
    r = req()
    a = gcp.launch(r)
    b = gcp.launch(r)
    assert a.instance_id == b.instance_id
    assert len(fake.instances_in()) == 1
    assert len(fake.insert_bodies) == 1  # the second insert was answered from its requestId
    assert fake.count("POST", "/instances") == 2


def test_same_token_after_request_id_expired_finds_instance_by_name(gcp, fake):
    r = req()
    a = gcp.launch(r)
    fake.forget_request_ids()
    b = gcp.launch(r)  # HTTP 409 alreadyExists -> the instance by name
    assert b.instance_id == a.instance_id and len(fake.instances_in()) == 1


def test_same_token_name_conflict_as_operation_error(fake):
    fake.conflict_as_http = False
    g = GcpCompute.for_endpoint(PROJECT, fake.endpoint, op_timeout_s=5.0, poll_interval_s=0.02)
    r = req()
    a = g.launch(r)
    fake.forget_request_ids()
    b = g.launch(r)  # operation error RESOURCE_ALREADY_EXISTS -> the instance by name
    assert b.instance_id == a.instance_id and len(fake.instances_in()) == 1


def test_different_ranks_get_different_instances(gcp, fake):
    a = gcp.launch(req(rank=0))
    b = gcp.launch(req(rank=1))
    assert a.instance_id != b.instance_id and len(fake.instances_in()) == 2
    assert a.private_ip != b.private_ip


# ---- error mapping -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind,code", [("stockout", "ZONE_RESOURCE_POOL_EXHAUSTED"),
                                       ("stockout_details", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")])
def test_stockout_is_no_capacity_and_next_zone_works(gcp, fake, kind, code):
    fake.fail_next_insert(ZA, kind)
    ra = req(zone=ZA)
    with pytest.raises(NoCapacity) as ei:
        gcp.launch(ra)
    assert ei.value.code == code and ei.value.option == f"gcp:{ZA}:n1-standard-8:spot"
    assert "does not have enough resources" in str(ei.value)
    assert fake.instances_in() == []
    info = gcp.launch(req(zone=ZB))  # failover to the next zone
    assert info.zone == ZB and info.state == "running"


@pytest.mark.parametrize("via,code", [("operation", "QUOTA_EXCEEDED"), ("http", "quotaExceeded")])
def test_quota_exceeded(gcp, fake, via, code):
    fake.fail_next_insert(ZA, "quota", metric="NVIDIA_T4_GPUS", via=via)
    r = req()
    with pytest.raises(QuotaExceeded) as ei:
        gcp.launch(r)
    assert ei.value.code == code and ei.value.option == r.offer_id
    assert "NVIDIA_T4_GPUS" in str(ei.value)
    assert fake.instances_in() == []


def test_rate_limit_429_is_throttled_with_retry_after(gcp, fake):
    fake.fail_next_insert(ZA, "rate_limit", status=429, retry_after=7)
    r = req()
    with pytest.raises(Throttled) as ei:
        gcp.launch(r)
    assert ei.value.code == "rateLimitExceeded" and ei.value.option == r.offer_id
    assert ei.value.retry_after_s == 7.0
    assert fake.instances_in() == []
    assert gcp.launch(r).state == "running"  # the same option after backing off


def test_rate_limit_403_is_throttled_not_quota(gcp, fake):
    fake.fail_next_insert(ZA, "rate_limit", status=403)
    with pytest.raises(Throttled) as ei:
        gcp.launch(req())
    assert ei.value.code == "rateLimitExceeded" and ei.value.retry_after_s is None


def test_machine_type_not_in_zone_is_unsupported(gcp, fake):
    fake.fail_next_insert(ZA, "unsupported")
    r = req(itype="a3-highgpu-8g", gpu="H100", n=8)
    with pytest.raises(Unsupported) as ei:
        gcp.launch(r)
    assert ei.value.code == "invalid" and ei.value.option == r.offer_id
    assert "does not exist in zone" in str(ei.value)


def test_unknown_operation_error_is_provider_error(gcp, fake):
    fake.fail_next_insert(ZA, "op_error", code="INTERNAL_ERROR", message="boom", http_status=500,
                          http_message="INTERNAL SERVER ERROR")
    r = req()
    with pytest.raises(ProviderError) as ei:
        gcp.launch(r)
    assert type(ei.value) is ProviderError
    assert ei.value.code == "INTERNAL_ERROR" and ei.value.option == r.offer_id


def test_hung_operation_returns_instance_found_by_name(fake):
    g = GcpCompute.for_endpoint(PROJECT, fake.endpoint, op_timeout_s=0.5, poll_interval_s=0.02)
    fake.hang_next_insert(ZA)
    r = req()
    t0 = time.monotonic()
    info = g.launch(r)
    took = time.monotonic() - t0
    assert 0.45 <= took < 3.0
    assert info.instance_id == instance_name(r.token) and info.state == "pending"
    assert fake.count("POST", "/wait") >= 1
    # the operation finishes later; the same request (same token) finds the same instance
    fake.finish_hung_operations()
    again = g.launch(r)
    assert again.instance_id == info.instance_id and again.state == "running"
    assert len(fake.instances_in()) == 1


def test_hung_operation_without_instance_is_operation_timeout(fake):
    g = GcpCompute.for_endpoint(PROJECT, fake.endpoint, op_timeout_s=0.3, poll_interval_s=0.02)
    fake.hang_next_insert(ZA, create_instance=False)
    r = req()
    with pytest.raises(ProviderError) as ei:
        g.launch(r)
    assert type(ei.value) is ProviderError
    assert ei.value.code == "OperationTimeout" and ei.value.option == r.offer_id


def test_wait_longer_than_deadline_is_not_a_failure(fake):
    """The fake's wait blocks longer than the adapter's remaining time: the HTTP timeout is absorbed."""
    fake.wait_block_s = 5.0
    g = GcpCompute.for_endpoint(PROJECT, fake.endpoint, op_timeout_s=0.4, poll_interval_s=0.02)
    fake.hang_next_insert(ZA)
    t0 = time.monotonic()
    info = g.launch(req())
    assert time.monotonic() - t0 < 3.0 and info.state == "pending"


# ---- describe / terminate / list / sweep -------------------------------------------------------


def test_describe_states_and_not_found(gcp, fake):
    info = gcp.launch(req())
    for status, state in [("STAGING", "pending"), ("RUNNING", "running"), ("STOPPING", "stopping"),
                          ("SUSPENDING", "stopping"), ("TERMINATED", "stopped"), ("SUSPENDED", "stopped"),
                          ("PROVISIONING", "pending")]:
        fake.set_status(ZA, info.instance_id, status)
        assert gcp.describe(info.instance_id, ZA).state == state
    gcp.terminate(info.instance_id, ZA)
    with pytest.raises(ProviderError) as ei:
        gcp.describe(info.instance_id, ZA)
    assert ei.value.code == "NotFound"
    assert map_state("WHATEVER") == "unknown"


def test_terminate_twice_and_unknown_is_fine(gcp, fake):
    info = gcp.launch(req())
    gcp.terminate(info.instance_id, ZA)
    assert fake.instances_in() == []
    gcp.terminate(info.instance_id, ZA)
    gcp.terminate("fb-doesnotexist", ZB)
    assert fake.count("DELETE", "/instances/") == 3


def test_list_managed_filters_by_broker_label(gcp, fake):
    a = gcp.launch(req(job="job-aaaa", broker="broker-1", zone=ZA))
    b = gcp.launch(req(job="job-bbbb", broker="broker-1", zone=ZB))
    gcp.launch(req(job="job-cccc", broker="broker-2", zone=ZA))
    fake.set_status(ZB, b.instance_id, "TERMINATED")  # stopped: still listed (disks bill)
    got = gcp.list_managed("broker-1")
    assert [(i.zone, i.instance_id, i.state) for i in got] == sorted(
        [(ZA, a.instance_id, "running"), (ZB, b.instance_id, "stopped")])
    assert {i.tags["fedbroker-job"] for i in got} == {"job-aaaa", "job-bbbb"}
    assert [i.tags["fedbroker-job"] for i in gcp.list_managed("broker-2")] == ["job-cccc"]
    assert gcp.list_managed("broker-3") == []
    flt = [q.get("filter") for m, p, q in fake.requests if p.endswith("/aggregated/instances")]
    assert flt[0] == 'labels.fedbroker-broker = "broker-1"'


def test_list_managed_exact_broker_id_despite_label_sanitising(gcp, fake):
    gcp.launch(req(job="job-1", broker="Broker.1"))
    gcp.launch(req(job="job-2", broker="broker_1"))  # same label value "broker_1"
    assert [i.tags["fedbroker-job"] for i in gcp.list_managed("Broker.1")] == ["job-1"]
    assert [i.tags["fedbroker-job"] for i in gcp.list_managed("broker_1")] == ["job-2"]


def test_sweep_terminates_instances_without_live_attempt(gcp, fake):
    live = gcp.launch(req(job="job-live", attempt=2))
    old = gcp.launch(req(job="job-live", attempt=1))
    orphan = gcp.launch(req(job="job-orphan", attempt=1))
    other = gcp.launch(req(job="job-other-broker", broker="broker-2"))
    gone = gcp.sweep("broker-1", live=[("job-live", 2)])
    assert sorted(i.instance_id for i in gone) == sorted([old.instance_id, orphan.instance_id])
    assert sorted(i["name"] for i in fake.instances_in()) == sorted([live.instance_id, other.instance_id])


# ---- preemption --------------------------------------------------------------------------------


def test_spot_preempted_with_delete_action(gcp, fake):
    info = gcp.launch(req())
    assert gcp.was_preempted(info) is False
    fake.preempt(ZA, info.instance_id)
    with pytest.raises(ProviderError) as ei:
        gcp.describe(info.instance_id, ZA)
    assert ei.value.code == "NotFound"
    assert gcp.was_preempted(info) is True
    other = gcp.launch(req(rank=1))
    assert gcp.was_preempted(other) is False


def test_user_delete_is_not_preemption(gcp, fake):
    info = gcp.launch(req())
    gcp.terminate(info.instance_id, ZA)
    assert gcp.was_preempted(info) is False


def test_on_demand_is_never_preempted(gcp, fake):
    info = gcp.launch(req(market="on_demand"))
    assert info.spot is False and gcp.was_preempted(info) is False


# ---- helpers -----------------------------------------------------------------------------------


def test_label_sanitising_and_names():
    assert label_key("Fedbroker.Job") == "fedbroker_job"
    assert label_key("1abc") == "k1abc"
    assert label_value("Team A/B") == "team_a_b"
    assert len(label_value("x" * 100)) == 63
    assert instance_name("ABCDEF0123456789abcdef0123") == "fb-abcdef0123456789abcd"
    n = instance_name("not hex at all!")
    assert n.startswith("fb-") and len(n) == 23 and n == instance_name("not hex at all!")
    assert gce_accelerator("T4") == "nvidia-tesla-t4" and gce_accelerator("H100") == "nvidia-h100-80gb"
    assert gce_accelerator("l4") == "nvidia-l4" and gce_accelerator("nvidia-tesla-v100") == "nvidia-tesla-v100"
    with pytest.raises(Unsupported):
        gce_accelerator("TPUv5")


def test_fake_filter_parser():
    assert parse_filter('labels.fedbroker-broker = "b1"') == [("labels.fedbroker-broker", "=", "b1")]
    assert parse_filter('(status != "TERMINATED") (labels.a = "x")') == [("status", "!=", "TERMINATED"),
                                                                        ("labels.a", "=", "x")]
    assert parse_filter('status eq RUNNING AND labels.a ne "y"') == [("status", "=", "RUNNING"),
                                                                    ("labels.a", "!=", "y")]
    with pytest.raises(ValueError):
        parse_filter("labels.a ~ foo")


def test_instances_carry_the_firewall_network_tag_and_no_external_ip(gcp, fake):
    """terraform/gcp's NCCL rule matches instances tagged fedbroker-node; its design has no public IPs."""
    gcp.launch(req(job="job-00000000000000ee"))
    body = fake.insert_bodies[-1]
    assert body["tags"] == {"items": ["fedbroker-node"]}
    assert "accessConfigs" not in body["networkInterfaces"][0]
