"""``fedbroker cloud``: settings from Terraform outputs (the shape `terraform output -json` prints) and bad input."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from broker.cli import app
from broker.settings import load_settings

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
    from broker.cloud import build_computes

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
