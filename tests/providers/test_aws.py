"""providers.aws: AwsCompute against a moto EC2 *server* (real HTTP, real botocore), and botocore
``Stubber`` for the EC2 errors moto cannot produce (capacity, quota, throttling, ...)."""

from __future__ import annotations

import base64
import sys
import uuid

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.stub import ANY, Stubber

from providers.aws import QUOTA_CODES, TOKEN_TAG, AwsCompute, quota_bucket
from providers.base import (
    MANAGED_TAG,
    FailoverHistory,
    InstanceRequest,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    Throttled,
    Unsupported,
    idempotency_token,
    instance_tags,
)

REGION = "us-east-1"
BROKER = "broker-test"  # replaced per test (the moto server is shared by the module, not reset)


@pytest.fixture(autouse=True)
def _own_broker_id(monkeypatch):
    """Each test has its own broker id, so tests sharing the moto server never see each other's instances
    (resetting moto costs ~1.5 s a test)."""
    monkeypatch.setattr(sys.modules[__name__], "BROKER", f"broker-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def endpoint(moto_server):
    return moto_server


@pytest.fixture
def ec2(endpoint):
    return boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)


@pytest.fixture(scope="module")
def ami(moto_server):
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_server)
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


@pytest.fixture
def aws(endpoint, ami):
    return AwsCompute(endpoint_url=endpoint, ami_by_region={REGION: ami})


def make_req(job="job-1", attempt=1, rank=0, zone="us-east-1b", itype="g5.xlarge", market="on_demand",
             broker=None, user_data="#!/bin/bash\necho hello\n", region=REGION) -> InstanceRequest:
    offer_id = f"aws:{zone}:{itype}:{market}"
    return InstanceRequest(
        job_id=job, attempt=attempt, rank=rank, team="team-a", offer_id=offer_id, region=region, zone=zone,
        instance_type=itype, market=market, gpu_type="A10G", gpu_count=1, user_data=user_data,
        tags=instance_tags(job, attempt, rank, "team-a", broker or BROKER), token=idempotency_token(job, attempt, offer_id, rank))


def _tags(lst) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in lst}


def expected_tags(req: InstanceRequest) -> dict[str, str]:
    return {"Name": f"fedbroker-{req.job_id}-{req.attempt}-{req.rank}", **req.tags, TOKEN_TAG: req.token}


# -- moto server -------------------------------------------------------------------------------


def test_launch_creates_tagged_instance_of_the_right_type_zone_and_user_data(aws, ec2):
    req = make_req(user_data="#!/bin/bash\nset -e\ndocker run --gpus all img:1 python train.py\n")
    info = aws.launch(req)

    assert info.provider == "aws" and info.instance_id.startswith("i-")
    assert (info.zone, info.instance_type, info.state, info.spot) == ("us-east-1b", "g5.xlarge", "pending", False)
    assert info.private_ip
    assert aws.describe(info.instance_id, info.zone).state == "running"
    assert info.tags == expected_tags(req)
    assert info.tags[MANAGED_TAG] == BROKER and info.tags["fedbroker-job"] == "job-1"

    inst = ec2.describe_instances(InstanceIds=[info.instance_id])["Reservations"][0]["Instances"][0]
    assert inst["InstanceType"] == "g5.xlarge"
    assert inst["Placement"]["AvailabilityZone"] == "us-east-1b"
    assert _tags(inst["Tags"]) == expected_tags(req)
    assert inst["MetadataOptions"]["HttpTokens"] == "required"
    assert inst["ClientToken"] == req.token
    vol_ids = [m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]]
    assert len(vol_ids) == 1
    vols = ec2.describe_volumes(VolumeIds=vol_ids)["Volumes"]
    assert [_tags(v["Tags"]) for v in vols] == [expected_tags(req)]

    ud = ec2.describe_instance_attribute(InstanceId=info.instance_id, Attribute="userData")["UserData"]["Value"]
    assert base64.b64decode(ud).decode() == req.user_data


def test_spot_launch_is_a_spot_instance(aws, ec2):
    info = aws.launch(make_req(itype="p4d.24xlarge", market="spot", zone="us-east-1c"))
    assert (info.spot, info.instance_type, info.zone) == (True, "p4d.24xlarge", "us-east-1c")
    inst = ec2.describe_instances(InstanceIds=[info.instance_id])["Reservations"][0]["Instances"][0]
    assert inst["InstanceLifecycle"] == "spot"


def test_launch_with_the_same_token_returns_the_same_instance(aws, ec2):
    req = make_req()
    first = aws.launch(req)
    again = aws.launch(req)
    assert again.instance_id == first.instance_id
    # another (fresh) adapter, as after a broker restart: still the same instance
    assert AwsCompute(endpoint_url=aws.endpoint_url, ami_by_region=aws.ami_by_region).launch(req).instance_id \
        == first.instance_id
    res = ec2.describe_instances(Filters=[{"Name": "tag:fedbroker-job", "Values": ["job-1"]},
                                          {"Name": f"tag:{MANAGED_TAG}", "Values": [BROKER]}])["Reservations"]
    assert [i["InstanceId"] for r in res for i in r["Instances"]] == [first.instance_id]
    # another rank is another token: another instance
    assert aws.launch(make_req(rank=1)).instance_id != first.instance_id


def test_terminate_twice_and_unknown_instance_are_fine(aws):
    info = aws.launch(make_req())
    aws.terminate(info.instance_id, info.zone)
    assert aws.describe(info.instance_id, info.zone).state == "terminated"
    aws.terminate(info.instance_id, info.zone)
    assert aws.describe(info.instance_id, info.zone).state == "terminated"
    aws.terminate("i-0123456789abcdef0", "us-east-1b")  # never existed


def test_describe_unknown_instance_is_not_found(aws):
    with pytest.raises(ProviderError) as ei:
        aws.describe("i-0123456789abcdef0", "us-east-1b")
    assert ei.value.code == "NotFound"


def test_list_managed_sees_only_our_broker_and_live_instances(aws, endpoint, ami):
    ours = [aws.launch(make_req(job=j)) for j in ("job-1", "job-2", "job-3")]
    theirs = aws.launch(make_req(job="job-9", broker=BROKER + "-other"))
    aws.terminate(ours[2].instance_id, ours[2].zone)

    listed = aws.list_managed(BROKER)
    assert sorted(i.instance_id for i in listed) == sorted([ours[0].instance_id, ours[1].instance_id])
    assert all(i.tags[MANAGED_TAG] == BROKER for i in listed)
    assert [i.instance_id for i in aws.list_managed(BROKER + "-other")] == [theirs.instance_id]
    # a region with none of ours
    other = AwsCompute(endpoint_url=endpoint, ami_by_region={"us-west-2": ami})
    assert other.list_managed(BROKER) == []


def test_list_managed_pages_through_many_instances(aws):
    aws.page_size = 5
    seen = []
    aws.client(REGION).meta.events.register("after-call.ec2.DescribeInstances",
                                            lambda parsed, **_: seen.append(len(parsed["Reservations"])))
    ids = {aws.launch(make_req(job=f"job-{n}")).instance_id for n in range(12)}
    seen.clear()
    assert {i.instance_id for i in aws.list_managed(BROKER)} == ids
    assert seen == [5, 5, 2]


def test_sweep_terminates_instances_of_dead_attempts_and_keeps_live_ones(aws):
    live = aws.launch(make_req(job="job-live", attempt=2))
    dead_attempt = aws.launch(make_req(job="job-live", attempt=1))
    orphan = aws.launch(make_req(job="job-orphan"))

    gone = aws.sweep(BROKER, live=[("job-live", 2)])

    assert sorted(i.instance_id for i in gone) == sorted([dead_attempt.instance_id, orphan.instance_id])
    assert aws.describe(live.instance_id, live.zone).state == "running"
    assert aws.describe(orphan.instance_id, orphan.zone).state == "terminated"
    assert aws.describe(dead_attempt.instance_id, dead_attempt.zone).state == "terminated"
    assert [i.instance_id for i in aws.list_managed(BROKER)] == [live.instance_id]


def test_broker_killed_between_create_and_record_leaves_no_orphan_after_one_sweep(aws, endpoint, ami):
    # the create call succeeded but the broker died before it recorded the instance id
    created = aws.launch(make_req(job="job-crash"))
    # a new broker process (a fresh adapter) sweeps with no live record of that attempt
    restarted = AwsCompute(endpoint_url=endpoint, ami_by_region={REGION: ami})
    gone = restarted.sweep(BROKER, live=[])
    assert [i.instance_id for i in gone] == [created.instance_id]
    assert restarted.list_managed(BROKER) == []
    assert restarted.sweep(BROKER, live=[]) == []


def test_preflight_counts_the_regions_vcpus_of_the_bucket(endpoint, ami):
    quotas = {QUOTA_CODES[("G", "on_demand")]: 8.0, QUOTA_CODES[("G", "spot")]: 4.0}
    asked = []

    def source(region, code):
        asked.append((region, code))
        return quotas.get(code)

    # its own region: preflight counts every instance of the account in the region, and the moto server
    # is shared by the module
    region, zone = "eu-west-1", "eu-west-1a"
    aws = AwsCompute(endpoint_url=endpoint, ami_by_region={region: ami}, quota_source=source)

    def make_req(**kw):
        return globals()["make_req"](region=region, zone=zone, **kw)

    first = make_req(job="j1")  # g5.xlarge: 4 vCPUs
    aws.preflight(first)
    aws.launch(first)
    aws.preflight(make_req(job="j2"))  # 4 in use + 4 = 8 <= 8
    aws.launch(make_req(job="j2"))
    with pytest.raises(QuotaExceeded) as ei:
        aws.preflight(make_req(job="j3"))
    err = ei.value
    assert (err.code, err.option) == ("L-DB2E81BA", "aws:eu-west-1a:g5.xlarge:on_demand")
    assert (err.quota, err.in_use, err.needed) == (8.0, 8, 4)
    assert "quota 8, in use 8, g5.xlarge needs 4" in str(err)
    # spot is its own bucket: on-demand instances do not count against it
    aws.preflight(make_req(job="j4", market="spot"))
    with pytest.raises(QuotaExceeded):
        aws.preflight(make_req(job="j5", market="spot", itype="g5.2xlarge"))  # 8 > 4
    # P bucket: quota unknown (None) -> no check; a CPU family has no bucket at all
    aws.preflight(make_req(job="j6", itype="p4d.24xlarge"))
    aws.preflight(make_req(job="j7", itype="m5.large"))
    assert asked == [(region, "L-DB2E81BA")] * 3 + [(region, "L-3819A6DF")] * 2 + [(region, "L-417A185B")]


def test_quota_buckets():
    assert [quota_bucket(t) for t in ("p4d.24xlarge", "p5.48xlarge", "g5.xlarge", "g6e.xlarge", "vt1.3xlarge",
                                      "gr6.4xlarge", "m5.large", "inf2.xlarge")] == \
        ["P", "P", "G", "G", "G", "G", None, None]


def test_launch_without_image_is_unsupported(endpoint):
    aws = AwsCompute(endpoint_url=endpoint, ami_by_region={})
    with pytest.raises(Unsupported) as ei:
        aws.launch(make_req())
    assert (ei.value.code, ei.value.option) == ("NoImage", "aws:us-east-1b:g5.xlarge:on_demand")


# -- botocore Stubber: what moto cannot produce -------------------------------------------------


@pytest.fixture
def stubbed(aws_env):
    client = boto3.client("ec2", region_name=REGION)
    stub = Stubber(client)
    aws = AwsCompute(region_clients=lambda region: client, ami_by_region={REGION: "ami-12345678"})
    with stub:
        yield aws, stub
    stub.assert_no_pending_responses()


def _no_instance_with_token(stub, req):
    stub.add_response("describe_instances", {"Reservations": []}, {"Filters": [
        {"Name": f"tag:{TOKEN_TAG}", "Values": [req.token]}, {"Name": f"tag:{MANAGED_TAG}", "Values": [BROKER]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}], "MaxResults": 500})


def test_run_instances_parameters_are_exact(stubbed):
    aws, stub = stubbed
    aws.security_group_by_region = {REGION: "sg-1"}
    aws.subnet_by_zone = {"us-east-1b": "subnet-1"}
    aws.key_name, aws.instance_profile = "ops", "fedbroker-node"
    req = make_req(market="spot", user_data="#!/bin/bash\ntrue\n")
    tags = [{"Key": k, "Value": v} for k, v in expected_tags(req).items()]
    _no_instance_with_token(stub, req)
    stub.add_response("run_instances", {"Instances": [{
        "InstanceId": "i-0abc", "InstanceType": "g5.xlarge", "Placement": {"AvailabilityZone": "us-east-1b"},
        "State": {"Name": "pending"}, "PrivateIpAddress": "10.0.0.5", "InstanceLifecycle": "spot", "Tags": tags}]}, {
        "MinCount": 1, "MaxCount": 1, "InstanceType": "g5.xlarge", "ImageId": "ami-12345678",
        "UserData": ANY, "ClientToken": req.token, "Placement": {"AvailabilityZone": "us-east-1b"},
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1,
                            "InstanceMetadataTags": "enabled"},
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tags}, {"ResourceType": "volume", "Tags": tags}],
        "InstanceInitiatedShutdownBehavior": "terminate",
        "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}},
        "SubnetId": "subnet-1", "SecurityGroupIds": ["sg-1"], "KeyName": "ops",
        "IamInstanceProfile": {"Name": "fedbroker-node"}})
    info = aws.launch(req)
    assert (info.instance_id, info.state, info.private_ip, info.spot) == ("i-0abc", "pending", "10.0.0.5", True)


@pytest.mark.parametrize("code, message, error_class", [
    ("InsufficientInstanceCapacity", "We currently do not have sufficient g5.xlarge capacity in us-east-1b.",
     NoCapacity),
    ("InsufficientCapacity", "Insufficient capacity.", NoCapacity),
    ("SpotMaxPriceTooLow", "Your Spot request price is lower than the minimum required.", NoCapacity),
    ("VcpuLimitExceeded", "You have requested more vCPU capacity than your current vCPU limit of 0 allows.",
     QuotaExceeded),
    ("MaxSpotInstanceCountExceeded", "Max spot instance count exceeded", QuotaExceeded),
    ("RequestLimitExceeded", "Request limit exceeded.", Throttled),
    ("Unsupported", ("Your requested instance type (g5.xlarge) is not supported in your requested Availability "
                     "Zone (us-east-1b)."), Unsupported),
    ("InvalidParameterValue", "The instance type g5.xlarge is not supported in us-east-1b", Unsupported),
    ("InvalidParameterValue", "Value (x) for parameter userData is invalid.", ProviderError),
    ("IdempotentParameterMismatch", "The client token has been used with different parameters.", ProviderError),
    ("InternalError", "An internal error has occurred.", ProviderError),
])
def test_run_instances_errors_map_to_typed_errors(stubbed, code, message, error_class):
    aws, stub = stubbed
    req = make_req()
    _no_instance_with_token(stub, req)
    stub.add_client_error("run_instances", service_error_code=code, service_message=message, http_status_code=400)
    with pytest.raises(ProviderError) as ei:
        aws.launch(req)
    err = ei.value
    assert type(err) is error_class
    assert (err.option, err.code) == ("aws:us-east-1b:g5.xlarge:on_demand", code)
    assert message in str(err)
    if code == "IdempotentParameterMismatch":
        assert "different parameters" in str(err) and "token" in str(err)


def test_throttled_token_lookup_carries_the_option(stubbed):
    aws, stub = stubbed
    stub.add_client_error("describe_instances", service_error_code="RequestLimitExceeded",
                          service_message="Request limit exceeded.", http_status_code=503)
    with pytest.raises(Throttled) as ei:
        aws.launch(make_req())
    assert (ei.value.option, ei.value.code, ei.value.retry_after_s) == (
        "aws:us-east-1b:g5.xlarge:on_demand", "RequestLimitExceeded", None)


def test_terminate_not_found_is_fine_but_throttling_is_not(stubbed):
    aws, stub = stubbed
    stub.add_client_error("terminate_instances", service_error_code="InvalidInstanceID.NotFound",
                          service_message="The instance ID 'i-0abc' does not exist", http_status_code=400)
    aws.terminate("i-0abc", "us-east-1b")
    stub.add_client_error("terminate_instances", service_error_code="RequestLimitExceeded",
                          service_message="Request limit exceeded.", http_status_code=503)
    with pytest.raises(Throttled):
        aws.terminate("i-0abc", "us-east-1b")


# -- the provisioner with the real adapter -----------------------------------------------------


def _capacity_error_in(client, zone: str):
    """Make ``client`` answer RunInstances in ``zone`` with InsufficientInstanceCapacity (moto never does)."""
    def note_zone(params, context, **_):
        context["fake_zone"] = params.get("Placement", {}).get("AvailabilityZone")

    def handler(context, **_):
        if context.get("fake_zone") == zone:
            return (AWSResponse("https://ec2", 500, {}, None),
                    {"Error": {"Code": "InsufficientInstanceCapacity",
                               "Message": f"We currently do not have sufficient capacity in {zone}."},
                     "ResponseMetadata": {"HTTPStatusCode": 500}})
        return None
    client.meta.events.register("before-parameter-build.ec2.RunInstances", note_zone)
    client.meta.events.register("before-call.ec2.RunInstances", handler)


def test_provision_with_failover_on_moto_moves_past_a_zone_without_capacity(endpoint, ami, ec2):
    from providers.provisioner import OfferOption, provision_with_failover

    client = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)
    _capacity_error_in(client, "us-east-1a")
    aws = AwsCompute(region_clients=lambda region: client, ami_by_region={REGION: ami},
                     quota_source=lambda region, code: 1000.0)
    options = [OfferOption("aws", REGION, z, "g5.xlarge", "spot", "A10G", 1) for z in ("us-east-1a", "us-east-1b")]
    intents, history = [], FailoverHistory()

    chosen, info = provision_with_failover(
        "job-f", 1, 0, "team-a", options, {"aws": aws}, lambda o: f"#!/bin/bash\necho {o.zone}\n", BROKER, history,
        intents.append, sleep=lambda s: pytest.fail("no throttling expected"))

    assert chosen == options[1]
    assert (info.zone, info.instance_type, info.spot, info.state) == ("us-east-1b", "g5.xlarge", True, "pending")
    assert [(a.option, a.error) for a in history.attempts] == [
        ("aws:us-east-1a:g5.xlarge:spot", "NoCapacity"), ("aws:us-east-1b:g5.xlarge:spot", None)]
    assert [r.zone for r in intents] == ["us-east-1a", "us-east-1b"]
    # exactly one instance exists, tagged for job-f attempt 1, with the right user data
    assert [i.instance_id for i in aws.list_managed(BROKER)] == [info.instance_id]
    ud = ec2.describe_instance_attribute(InstanceId=info.instance_id, Attribute="userData")["UserData"]["Value"]
    assert base64.b64decode(ud).decode() == "#!/bin/bash\necho us-east-1b\n"


def test_a_zone_named_by_az_id_launches_in_its_subnet(endpoint, ami, ec2):
    """Price catalogs name zones by AZ ID (use1-az1); the subnet mapped to that ID fixes the zone."""
    sub = {s["AvailabilityZoneId"]: (s["SubnetId"], s["AvailabilityZone"]) for s in ec2.describe_subnets(
        Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]}
    subnet, zone_name = sub["use1-az1"]
    aws = AwsCompute(endpoint_url=endpoint, ami_by_region={REGION: ami}, subnet_by_zone={"use1-az1": subnet},
                     region_by_zone={"use1-az1": REGION}, quota_source=lambda r, c: None)
    info = aws.launch(make_req(zone="use1-az1"))
    got = ec2.describe_instances(InstanceIds=[info.instance_id])["Reservations"][0]["Instances"][0]
    assert (got["SubnetId"], got["Placement"]["AvailabilityZone"]) == (subnet, zone_name)
    assert aws.region_of("use1-az1") == REGION
    assert aws.describe(info.instance_id, "use1-az1").instance_id == info.instance_id
    aws.terminate(info.instance_id, "use1-az1")


def test_launch_starts_from_the_regions_launch_template_and_exposes_tags_in_imds(endpoint, ami, ec2):
    lt = ec2.create_launch_template(LaunchTemplateName=f"fb-{BROKER}", LaunchTemplateData={
        "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 200, "VolumeType": "gp3",
                                                                   "Encrypted": True}}]})["LaunchTemplate"]
    aws = AwsCompute(endpoint_url=endpoint, ami_by_region={REGION: ami}, quota_source=lambda r, c: None,
                     launch_template_by_region={REGION: lt["LaunchTemplateId"]})
    info = aws.launch(make_req())
    got = ec2.describe_instances(InstanceIds=[info.instance_id])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in got["Tags"]}
    assert tags["aws:ec2launchtemplate:id"] == lt["LaunchTemplateId"]  # created from the template
    assert tags["fedbroker-rank"] == "0" and got["InstanceType"] == "g5.xlarge"  # our fields win
    assert (got["MetadataOptions"]["HttpTokens"], got["MetadataOptions"]["InstanceMetadataTags"]) == ("required", "enabled")
    aws.terminate(info.instance_id, "us-east-1b")
