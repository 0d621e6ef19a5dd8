"""GcpCompute with the real google-cloud-compute REST client against the local fake GCE (tests/providers/fake_gce.py)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

pytest.importorskip("google.cloud.compute_v1")

from google.cloud import compute_v1  # noqa: E402

from providers.base import (MANAGED_TAG, FailoverHistory, InstanceRequest, NoCapacity, ProviderError,  # noqa: E402
                            QuotaExceeded, Throttled, Unsupported, as_uuid, idempotency_token, instance_tags)
from providers.gcp import (GCE_GPU_QUOTA_METRICS, GcpCompute, gce_accelerator, gpu_quota_metric,  # noqa: E402
                           instance_name, label_key, label_value, map_state, zone_region)
from providers.provisioner import OfferOption, ProvisioningFailed, provision_with_failover, quota_scope  # noqa: E402
from tests.providers.fake_gce import FakeGce, parse_filter  # noqa: E402

PROJECT = "test-project"
ZA, ZB = "us-central1-a", "us-central1-b"


@pytest.fixture
def fake():
    with FakeGce(PROJECT, wait_block_s=0.1) as f:
        yield f


@pytest.fixture
def gcp(fake):
    return GcpCompute.for_endpoint(PROJECT, fake.endpoint, op_timeout_s=5.0, poll_interval_s=0.02)


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


def test_launch_catalog_n1_offer_name_sends_the_host_machine_type(gcp, fake):
    # the bundled catalog names n1 hosts with attached GPUs "<host>+<GPU>x<count>": GCE gets the host
    info = gcp.launch(req(itype="n1-highmem-8+T4x1", gpu="T4", n=1))
    assert fake.insert_bodies[0]["machineType"] == f"zones/{ZA}/machineTypes/n1-highmem-8"
    assert info.instance_type == "n1-highmem-8"
    acc = fake.instance(ZA, info.instance_id)["guestAccelerators"]
    assert acc[0]["acceleratorCount"] == 1 and acc[0]["acceleratorType"].endswith("/nvidia-tesla-t4")


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


# ---- quota preflight ---------------------------------------------------------------------------

REGION = "us-central1"
T4, T4_SPOT = "NVIDIA_T4_GPUS", "PREEMPTIBLE_NVIDIA_T4_GPUS"


def test_gpu_quota_metric_table():
    assert gpu_quota_metric("T4") == "NVIDIA_T4_GPUS"
    assert gpu_quota_metric("T4", "spot") == "PREEMPTIBLE_NVIDIA_T4_GPUS"
    assert gpu_quota_metric("A100") == "NVIDIA_A100_GPUS"
    assert gpu_quota_metric("A100-80GB", "spot") == "PREEMPTIBLE_NVIDIA_A100_80GB_GPUS"
    assert gpu_quota_metric("H100") == "NVIDIA_H100_GPUS"
    assert gpu_quota_metric("L4") == "NVIDIA_L4_GPUS"
    assert gpu_quota_metric("V100") == "NVIDIA_V100_GPUS"
    assert gpu_quota_metric("nvidia-tesla-t4") == "NVIDIA_T4_GPUS"
    assert gpu_quota_metric("TPUv5") is None and gpu_quota_metric("nvidia-b200") is None
    assert zone_region("us-central1-a") == "us-central1" and zone_region("europe-west4-b") == "europe-west4"
    # every metric of the table that google-cloud-compute knows is spelled as its enum spells it
    known = {m.name for m in compute_v1.Quota.Metric}
    for metric in GCE_GPU_QUOTA_METRICS.values():
        if "H100" not in metric:  # the client's enum lags: it lists only PREEMPTIBLE_/COMMITTED_NVIDIA_H100_GPUS
            assert metric in known and "PREEMPTIBLE_" + metric in known, metric
    assert "PREEMPTIBLE_NVIDIA_H100_GPUS" in known


def test_preflight_on_demand_t4_limit_8_usage_6(gcp, fake):
    fake.set_quota(REGION, T4, limit=8, usage=6)
    gcp.preflight(req(market="on_demand", n=2))  # 8 - 6 = 2 >= 2: passes
    r = req(market="on_demand", n=4)
    with pytest.raises(QuotaExceeded) as ei:
        gcp.preflight(r)
    e = ei.value
    assert type(e) is QuotaExceeded and e.code == "QUOTA_EXCEEDED" and e.option == r.offer_id
    msg = str(e)
    assert "NVIDIA_T4_GPUS" in msg and "PREEMPTIBLE" not in msg and REGION in msg
    assert "limit 8" in msg and "usage 6" in msg and "requested 4" in msg
    assert (e.metric, e.region, e.quota, e.in_use, e.needed) == ("NVIDIA_T4_GPUS", REGION, 8.0, 6.0, 4)
    assert fake.count("GET", f"/regions/{REGION}") == 2
    assert fake.count("POST", "/instances") == 0  # preflight never creates anything


def test_preflight_region_from_zone_when_request_has_none(gcp, fake):
    fake.set_quota(REGION, T4, limit=1, usage=1)
    r = dataclasses.replace(req(market="on_demand"), region="")
    with pytest.raises(QuotaExceeded):
        gcp.preflight(r)
    assert fake.count("GET", f"/regions/{REGION}") == 1


def test_preflight_spot_uses_preemptible_metric_independent_of_on_demand(gcp, fake):
    fake.set_quota(REGION, T4, limit=8, usage=8)        # on-demand full
    fake.set_quota(REGION, T4_SPOT, limit=16, usage=12)
    gcp.preflight(req(market="spot", n=4))               # 16 - 12 = 4: passes despite the full on-demand quota
    with pytest.raises(QuotaExceeded) as ei:
        gcp.preflight(req(market="on_demand", n=1))
    assert ei.value.metric == T4
    with pytest.raises(QuotaExceeded) as ei:
        gcp.preflight(req(market="spot", n=5))
    assert ei.value.metric == T4_SPOT and "PREEMPTIBLE_NVIDIA_T4_GPUS" in str(ei.value)
    assert "limit 16" in str(ei.value) and "usage 12" in str(ei.value) and "requested 5" in str(ei.value)
    # the other way round: spot full, on-demand free
    fake.set_quota(REGION, T4, limit=8, usage=0)
    fake.set_usage(REGION, T4_SPOT, 16)
    gcp.preflight(req(market="on_demand", n=8))
    with pytest.raises(QuotaExceeded) as ei:
        gcp.preflight(req(market="spot", n=1))
    assert ei.value.metric == T4_SPOT


def test_preflight_spot_without_preemptible_quota_checks_the_standard_metric(gcp, fake):
    """GCE charges Spot VMs to the standard quota where the region grants no preemptible quota."""
    fake.set_quota(REGION, T4, limit=4, usage=3)
    gcp.preflight(req(market="spot", n=1))
    with pytest.raises(QuotaExceeded) as ei:
        gcp.preflight(req(market="spot", n=2))
    assert ei.value.metric == T4
    fake.set_quota(REGION, T4_SPOT, limit=0, usage=0)  # listed but not granted: still the standard metric
    with pytest.raises(QuotaExceeded) as ei:
        gcp.preflight(req(market="spot", n=2))
    assert ei.value.metric == T4


def test_preflight_unknown_metric_or_gpu_does_not_block(gcp, fake):
    fake.set_quota(REGION, "NVIDIA_V100_GPUS", limit=0, usage=0)
    fake.set_quota(REGION, "CPUS", limit=0, usage=0)
    assert gcp.preflight(req(market="on_demand", gpu="T4", n=64)) is None       # NVIDIA_T4_GPUS not listed
    assert gcp.preflight(req(market="spot", gpu="T4", n=64)) is None            # neither T4 metric listed
    assert gcp.preflight(req(gpu="TPUv5", n=1)) is None                         # no GCE accelerator
    assert gcp.preflight(req(gpu="T4", n=0)) is None                            # no GPUs: nothing to check
    assert fake.count("GET", "/regions/") == 2                                  # the last two made no call
    with pytest.raises(QuotaExceeded):                                          # a listed metric still counts
        gcp.preflight(req(market="on_demand", gpu="V100", itype="n1-standard-16", n=1))


@pytest.mark.parametrize("status", [403, 404, 500])
def test_preflight_read_failure_is_a_plain_provider_error(gcp, fake, status):
    """Even a 403 "Quota exceeded for quota metric 'Read requests'" must not read as a GPU quota error."""
    fake.set_quota(REGION, T4, limit=0, usage=0)
    fake.fail_next_region_get(REGION, status)
    r = req(market="on_demand")
    with pytest.raises(ProviderError) as ei:
        gcp.preflight(r)
    assert type(ei.value) is ProviderError
    assert ei.value.code == "QuotaPreflightFailed" and ei.value.option == r.offer_id
    assert REGION in str(ei.value)
    assert fake.count("GET", f"/regions/{REGION}") == 1  # not retried


def test_preflight_retries_503_within_its_time_bound(fake):
    g = GcpCompute.for_endpoint(PROJECT, fake.endpoint, preflight_timeout_s=0.8)
    fake.set_quota(REGION, T4, limit=0, usage=0)
    fake.fail_next_region_get(REGION, 503)  # one transient error: the client retries, the verdict stands
    with pytest.raises(QuotaExceeded):
        g.preflight(req(market="on_demand"))
    assert fake.count("GET", f"/regions/{REGION}") == 2
    fake.fail_next_region_get(REGION, 503, times=1000)  # down: gives up after ~preflight_timeout_s
    t0 = time.monotonic()
    with pytest.raises(ProviderError) as ei:
        g.preflight(req(market="on_demand"))
    assert time.monotonic() - t0 < 3.0
    assert type(ei.value) is ProviderError and ei.value.code == "QuotaPreflightFailed"


def test_preflight_without_regions_client_uses_the_endpoint(fake):
    g = GcpCompute.for_endpoint(PROJECT, fake.endpoint, op_timeout_s=5.0, poll_interval_s=0.02)
    fake.set_quota(REGION, T4, limit=2, usage=2)
    with pytest.raises(QuotaExceeded):
        g.preflight(req(market="on_demand"))
    assert fake.count("GET", f"/projects/{PROJECT}/regions/{REGION}") == 1


def test_gcp_quota_scope_is_the_gpu_type(gcp):
    """No quota_family: the scope is the option's gpu_type, so a T4 quota error on n1 does not skip V100 on n1."""
    assert not hasattr(gcp, "quota_family")
    t4 = OfferOption("gcp", REGION, ZA, "n1-standard-8", "on_demand", "T4", 1)
    v100 = OfferOption("gcp", REGION, ZB, "n1-standard-8", "on_demand", "V100", 1)
    assert quota_scope(t4, gcp) == ("gcp", REGION, "on_demand", "T4")
    assert quota_scope(t4, gcp) != quota_scope(v100, gcp)


def _failover(gcp, options, history):
    intents = []
    return provision_with_failover("job-0123456789abcdef", 1, 0, "team-A", options, {"gcp": gcp},
                                   lambda o: "#!/bin/bash\n", "broker-1", history, intents.append,
                                   sleep=lambda s: None), intents


def test_failover_quota_preflight_blocks_before_insert(gcp, fake):
    fake.set_quota(REGION, T4, limit=8, usage=6)
    fake.set_quota("europe-west4", T4, limit=8, usage=0)
    a = OfferOption("gcp", REGION, ZA, "n1-standard-8", "on_demand", "T4", 4)
    b = OfferOption("gcp", REGION, ZB, "n1-standard-16", "on_demand", "T4", 4)  # same scope: skipped
    c = OfferOption("gcp", "europe-west4", "europe-west4-a", "n1-standard-8", "on_demand", "T4", 4)
    history = FailoverHistory()
    (chosen, info), intents = _failover(gcp, [a, b, c], history)
    assert chosen is c and info.zone == "europe-west4-a" and info.state == "running"
    assert [(x.option, x.error) for x in history.attempts] == [(a.offer_id, "QuotaExceeded"), (c.offer_id, None)]
    assert "NVIDIA_T4_GPUS" in history.attempts[0].message and REGION in history.attempts[0].message
    assert [i.offer_id for i in intents] == [c.offer_id]  # no intent for the option the preflight refused
    assert fake.count("POST", f"/zones/{ZA}/instances") == 0 and fake.count("POST", f"/zones/{ZB}/instances") == 0
    assert fake.count("POST", "/instances") == 1
    assert fake.count("GET", f"/regions/{REGION}") == 1  # b was skipped without a call


def test_failover_all_options_quota_blocked_makes_no_insert(gcp, fake):
    fake.set_quota(REGION, T4, limit=8, usage=6)
    fake.set_quota(REGION, T4_SPOT, limit=4, usage=4)
    opts = [OfferOption("gcp", REGION, ZA, "n1-standard-8", "spot", "T4", 4),
            OfferOption("gcp", REGION, ZA, "n1-standard-8", "on_demand", "T4", 4)]
    history = FailoverHistory()
    with pytest.raises(ProvisioningFailed) as ei:
        _failover(gcp, opts, history)
    assert [(x.option, x.error) for x in ei.value.history.attempts] == [
        (opts[0].offer_id, "QuotaExceeded"), (opts[1].offer_id, "QuotaExceeded")]
    assert "PREEMPTIBLE_NVIDIA_T4_GPUS" in history.attempts[0].message
    assert "NVIDIA_T4_GPUS" in history.attempts[1].message
    assert fake.count("POST", "/instances") == 0 and fake.insert_bodies == [] and fake.instances_in() == []


def test_failover_preflight_read_failure_is_advisory(gcp, fake):
    fake.set_quota(REGION, T4, limit=0, usage=0)  # would block, but the read fails: the create call decides
    fake.fail_next_region_get(REGION, 403)
    opt = OfferOption("gcp", REGION, ZA, "n1-standard-8", "on_demand", "T4", 1)
    history = FailoverHistory()
    (chosen, info), _ = _failover(gcp, [opt], history)
    assert chosen is opt and info.state == "running"
    assert [(x.option, x.error) for x in history.attempts] == [(opt.offer_id, None)]
    assert fake.count("POST", "/instances") == 1
