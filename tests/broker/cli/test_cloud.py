"""``fedbroker cloud``: settings from Terraform outputs (the shape `terraform output -json` prints) and bad input."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from broker.cli.main import app
from broker.service.settings import load_settings
from broker.service.tokens import create_token

AWS_OUT = {
    "region": {"sensitive": False, "type": "string", "value": "us-east-1"},
    "ami_id": {"sensitive": False, "type": "string", "value": "ami-0123456789abcdef0"},
    "subnet_ids_by_az": {"sensitive": False, "type": ["map", "string"],
                         "value": {"us-east-1a": "subnet-0aa", "us-east-1b": "subnet-0bb"}},
    "security_group_id": {"sensitive": False, "type": "string", "value": "sg-0123456789abcdef0"},
    "placement_group_name": {"sensitive": False, "type": "string", "value": "fedbroker-gang"},
    "instance_profile_name": {"sensitive": False, "type": "string", "value": "fedbroker-node"},
    "launch_template_id": {"sensitive": False, "type": "string", "value": "lt-0123456789abcdef0"},
}
GCP_OUT = {
    "project": {"sensitive": False, "type": "string", "value": "ml-burst-123"},
    "region": {"sensitive": False, "type": "string", "value": "us-central1"},
    "network": {"sensitive": False, "type": "string", "value": "projects/ml-burst-123/global/networks/fedbroker"},
    "subnetwork": {"sensitive": False, "type": "string",
                   "value": "projects/ml-burst-123/regions/us-central1/subnetworks/fedbroker-nodes"},
    "service_account_email": {"sensitive": False, "type": "string",
                              "value": "fedbroker-node@ml-burst-123.iam.gserviceaccount.com"},
    "gpu_image": {"sensitive": False, "type": "string", "value": "projects/p/global/images/family/gpu"},
}


def _run(*args):
    return CliRunner().invoke(app, ["cloud", *args])


def test_aws_outputs_become_settings_the_broker_loads(tmp_path):
    east = tmp_path / "east.json"
    east.write_text(json.dumps(AWS_OUT))
    west = tmp_path / "west.json"
    west.write_text(json.dumps({**AWS_OUT, "region": {"value": "us-west-2"},
                                "subnet_ids_by_az": {"value": {"us-west-2a": "subnet-0cc"}}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(east), str(west))
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(r.output)
    assert data["cloud_providers"] == ["aws"]
    assert data["aws"]["regions"]["us-east-1"] == {
        "ami_id": "ami-0123456789abcdef0", "subnet_ids_by_az": {"us-east-1a": "subnet-0aa", "us-east-1b": "subnet-0bb"},
        "security_group_id": "sg-0123456789abcdef0", "placement_group_name": "fedbroker-gang",
        "instance_profile_name": "fedbroker-node", "launch_template_id": "lt-0123456789abcdef0"}
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(r.output)
    st = load_settings(cfg)
    assert sorted(st.aws.regions) == ["us-east-1", "us-west-2"]
    from broker.service.cloud import build_computes

    aws = build_computes(st)["aws"]
    assert aws.subnet_by_zone == {"us-east-1a": "subnet-0aa", "us-east-1b": "subnet-0bb", "us-west-2a": "subnet-0cc"}
    assert aws.placement_group_by_region == {"us-east-1": "fedbroker-gang", "us-west-2": "fedbroker-gang"}


def test_gcp_outputs_become_settings(tmp_path):
    f = tmp_path / "gcp.json"
    f.write_text(json.dumps(GCP_OUT))
    r = _run("settings-from-terraform", "--provider", "gcp", str(f))
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(r.output)
    assert data["gcp"] == {k: v["value"] for k, v in GCP_OUT.items()}
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(r.output)
    assert load_settings(cfg).gcp.subnetwork.endswith("/subnetworks/fedbroker-nodes")


def test_bad_outputs_name_the_file_and_the_output(tmp_path):
    f = tmp_path / "out.json"
    f.write_text("{not json")
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2 and "out.json: not JSON" in r.output
    f.write_text(json.dumps({k: v for k, v in AWS_OUT.items() if k != "ami_id"}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2 and "outputs ['ami_id'] are missing" in r.output
    f.write_text(json.dumps({**AWS_OUT, "ami_id": {"value": "ubuntu-22.04"}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2 and "regions.us-east-1.ami_id='ubuntu-22.04'" in r.output
    f.write_text(json.dumps({"region": "us-east-1"}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2 and "output 'region' has no 'value'" in r.output
    r = _run("settings-from-terraform", "--provider", "azure", str(f))
    assert r.exit_code == 2 and "provider='azure': must be aws or gcp" in r.output


def test_a_null_output_is_named(tmp_path):
    f = tmp_path / "out.json"
    f.write_text(json.dumps({**AWS_OUT, "ami_id": {"sensitive": False, "type": "string", "value": None}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2
    assert f"{f}: output 'ami_id' is null" in r.output and "regions.us-east-1" not in r.output
    f.write_text(json.dumps({**AWS_OUT, "region": {"value": None}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2 and f"{f}: output 'region' is null" in r.output
    f.write_text(json.dumps({**GCP_OUT, "project": {"value": None}}))
    r = _run("settings-from-terraform", "--provider", "gcp", str(f))
    assert r.exit_code == 2 and f"{f}: output 'project' is null" in r.output
    # an optional output that is null is left out, as before
    f.write_text(json.dumps({**AWS_OUT, "placement_group_name": {"value": None}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 0 and "placement_group_name" not in yaml.safe_load(r.output)["aws"]["regions"]["us-east-1"]


def test_a_bad_region_or_zone_output_is_named(tmp_path):
    f = tmp_path / "out.json"
    f.write_text(json.dumps({**AWS_OUT, "region": {"value": "us-eest-1"},
                             "subnet_ids_by_az": {"value": {"us-eest-1a": "subnet-0aa"}}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2
    assert f"aws settings from {f}: regions: 'us-eest-1' is not an AWS region (did you mean 'us-east-1'?)" \
        in " ".join(r.output.split())
    f.write_text(json.dumps({**AWS_OUT, "subnet_ids_by_az": {"value": {"us-west-2a": "subnet-0aa"}}}))
    r = _run("settings-from-terraform", "--provider", "aws", str(f))
    assert r.exit_code == 2
    assert "regions.us-east-1.subnet_ids_by_az: 'us-west-2a' is not a zone of us-east-1" in " ".join(r.output.split())


def test_two_outputs_pasted_into_one_file_are_refused_not_merged(tmp_path):
    aws = tmp_path / "aws.json"
    aws.write_text(json.dumps(AWS_OUT))
    gcp = tmp_path / "gcp.json"
    gcp.write_text(json.dumps(GCP_OUT))
    a = _run("settings-from-terraform", "--provider", "aws", str(aws))
    g = _run("settings-from-terraform", "--provider", "gcp", str(gcp))
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(a.output + g.output)
    second = (a.output + g.output).splitlines().index("cloud_providers:", 3) + 1
    r = _run("instances", "--config", str(cfg))
    assert r.exit_code == 2
    assert (f"FEDBROKER_CONFIG={str(cfg)!r}: key 'cloud_providers' appears twice (lines 3 and {second})"
            in " ".join(r.output.split()))


def test_instances_on_a_database_without_tables_says_start_the_broker(tmp_path):
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'fresh'}\n")
    r = _run("instances", "--config", str(cfg))
    assert r.exit_code == 2, r.output
    assert ("error: the broker's database has no tables yet: start the broker once (fedbroker serve ...) or check "
            "database_url") in " ".join(r.output.split())
    assert "Traceback" not in r.output and "OperationalError" not in r.output


def test_instances_with_a_config_that_does_not_exist(tmp_path):
    r = _run("instances", "--config", str(tmp_path / "nope.yaml"))
    assert r.exit_code == 2
    assert (f"FEDBROKER_CONFIG={str(tmp_path / 'nope.yaml')!r}: cannot read (No such file or directory)"
            in " ".join(r.output.split()))


# ----------------------------------------------------------------------------- sweep --dry-run (moto EC2)

def _submit_cloud_job(store, team: str = "ml", to: str = "starting", failover: list | None = None) -> str:
    """A cloud job moved to ``to`` (``provisioning`` or ``starting``) at attempt 1, as the broker does."""
    from datetime import timedelta

    from broker.service.store.tables import Attempt, Job, utcnow
    from broker.model import JobSpec
    from broker.service.store.core import JobStore

    view, _ = store.submit(team, JobSpec(image="ghcr.io/acme/train:1", command=["python", "train.py"], gpus_per_node=1,
                                         nodes=2, gpu_types=["V100"], estimated_duration_s=3600))
    now = utcnow()
    placement = {"kind": "cloud", "offer_id": "aws:us-east-1a:p3.2xlarge:spot", "provider": "aws",
                 "region": "us-east-1", "zone": "us-east-1a", "instance_type": "p3.2xlarge", "market": "spot"}
    with store.session() as s:
        j = s.get(Job, view.id)
        assert JobStore.cas(s, j.id, j.version, "submitted", "queued", "accepted", now)
        s.refresh(j)
        assert JobStore.cas(s, j.id, j.version, "queued", "provisioning", "placed", now, attempt=1,
                            placement=placement, dispatched_at=now, state_deadline_at=now + timedelta(seconds=900))
        s.add(Attempt(job_id=j.id, number=1, kind="cloud", offer_id=placement["offer_id"], nodes=[], gpu_type="V100",
                      gpus=2, created_at=now, failover=failover or []))
        if to == "starting":
            s.refresh(j)
            assert JobStore.cas(s, j.id, j.version, "provisioning", "starting", "instances created", now)
    return view.id


def test_sweep_dry_run_lists_orphans_and_terminates_nothing(moto_server, tmp_path):
    import uuid

    import boto3

    from broker.service.store.core import JobStore
    from providers.base import instance_tags

    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_server)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    subnets = {s["AvailabilityZone"]: s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]}
    broker_id = f"b-{uuid.uuid4().hex[:10]}"
    db = tmp_path / "fedbroker.db"
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(yaml.safe_dump({
        "database_url": f"sqlite:///{db}", "cloud_providers": ["aws"],
        "aws": {"endpoint_url": moto_server,
                "regions": {"us-east-1": {"ami_id": ami, "subnet_ids_by_az": {"us-east-1a": subnets["us-east-1a"]}}}},
        "cloud": {"broker_id": broker_id}}))
    store = JobStore(f"sqlite:///{db}")
    store.migrate()
    live = _submit_cloud_job(store)

    def launch(tags: dict) -> str:
        made = ec2.run_instances(ImageId=ami, InstanceType="p3.2xlarge", MinCount=1, MaxCount=1,
                                 SubnetId=subnets["us-east-1a"], TagSpecifications=[{
                                     "ResourceType": "instance",
                                     "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
        return made["Instances"][0]["InstanceId"]

    keep = launch(instance_tags(live, 1, 0, "ml", broker_id))  # the live attempt: not an orphan
    stale = launch(instance_tags(live, 0, 0, "ml", broker_id))  # an earlier attempt of the live job
    garbage = launch({**instance_tags("job-dead", 1, 0, "ml", broker_id), "fedbroker-attempt": "one"})
    other = launch(instance_tags("job-dead", 1, 0, "ml", broker_id + "x"))  # another broker's: not ours
    try:
        r = _run("sweep", "--dry-run", "--config", str(cfg))
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        assert sorted(lines[:-1]) == sorted([
            f"orphan aws/{stale} in us-east-1a (running; job {live} attempt 0)",
            f"orphan aws/{garbage} in us-east-1a (running; job job-dead attempt one)"])
        assert lines[-1] == f"2 orphan instance(s) of broker {broker_id!r} (dry run: none terminated)"
        states = {i["InstanceId"]: i["State"]["Name"] for res in ec2.describe_instances(
            InstanceIds=[keep, stale, garbage, other])["Reservations"] for i in res["Instances"]}
        assert states == {keep: "running", stale: "running", garbage: "running", other: "running"}
    finally:
        ec2.terminate_instances(InstanceIds=[keep, stale, garbage, other])
        store.engine.dispose()


def test_sweep_on_a_database_without_tables_says_start_the_broker(tmp_path):
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(yaml.safe_dump({
        "state_dir": str(tmp_path / "fresh"), "cloud_providers": ["aws"],
        "aws": {"endpoint_url": "http://127.0.0.1:9", "regions": {"us-east-1": {
            "ami_id": "ami-0123456789abcdef0", "subnet_ids_by_az": {"us-east-1a": "subnet-0aa"}}}}}))
    for args in (("sweep", "--dry-run"), ("sweep",)):
        r = _run(*args, "--config", str(cfg))
        assert r.exit_code == 2, r.output
        assert "the broker's database has no tables yet" in r.output


# ----------------------------------------------------------------------------- job commands on cloud jobs

def test_cancel_and_explain_of_a_cloud_job(sqlite_store, monkeypatch):
    from rich.console import Console

    from broker.cli import console as cli_console

    from broker.service.api import create_app
    from tests.broker.harness import ServerThread

    monkeypatch.setattr(cli_console, "console", Console(width=300, force_terminal=False, color_system=None))
    token = create_token(sqlite_store, "ml").token
    jid = _submit_cloud_job(sqlite_store, failover=[
        {"option": "aws:us-east-1a:p3.2xlarge:spot", "error": "NoCapacity", "message": "no p3.2xlarge in us-east-1a",
         "at": "2030-01-01T00:00:00+00:00"},
        {"option": "aws:us-east-1b:p3.2xlarge:spot", "error": None, "message": "", "at": "2030-01-01T00:00:05+00:00",
         "rank": 0},
        {"option": "aws:us-east-1b:p3.2xlarge:spot", "error": None, "message": "", "at": "2030-01-01T00:00:06+00:00",
         "rank": 1}])
    with ServerThread(create_app(sqlite_store)) as srv:
        env = {"FEDBROKER_API_URL": srv.url, "FEDBROKER_TOKEN": token, "FEDBROKER_CONFIG": None}
        r = CliRunner().invoke(app, ["explain", jid], env=env)
        assert r.exit_code == 0, r.output
        rows = [" ".join(line.split()) for line in r.output.splitlines()]
        assert "┃ # ┃ at ┃ option ┃ rank ┃ result ┃" in rows
        assert ("│ 1 │ 2030-01-01T00:00:00 │ aws:us-east-1a:p3.2xlarge:spot │ - │ NoCapacity: no p3.2xlarge in "
                "us-east-1a │") in rows
        assert "│ 1 │ 2030-01-01T00:00:05 │ aws:us-east-1b:p3.2xlarge:spot │ 0 │ created │" in rows
        assert "│ 1 │ 2030-01-01T00:00:06 │ aws:us-east-1b:p3.2xlarge:spot │ 1 │ created │" in rows
        r = CliRunner().invoke(app, ["cancel", jid], env=env)
        assert r.exit_code == 0, r.output
        assert r.output.strip() == f"{jid} starting: cancel requested; the broker terminates its instances"
    assert sqlite_store.get(jid).cancel_requested
