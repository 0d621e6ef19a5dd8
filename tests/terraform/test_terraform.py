"""Static checks of the Terraform modules in terraform/aws and terraform/gcp.

Every ``.tf`` file is parsed with python-hcl2 (no terraform binary, no cloud
credentials). The tests pin the module contracts the provider adapters rely on
(the exact variables and outputs) and the security properties of the job nodes.
When a ``terraform`` binary and the AWS provider mirror are present, the AWS
module is also validated and its offline plan tests (mocked provider) run; when
checkov is installed, ``terraform/check.sh`` must report no failed check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

hcl2 = pytest.importorskip("hcl2")

ROOT = Path(__file__).resolve().parents[2] / "terraform"
MODULES = ("aws", "gcp")

EXPECTED_OUTPUTS = {
    "aws": {"region", "subnet_ids_by_az", "subnet_ids_by_az_id", "security_group_id", "placement_group_name",
            "instance_profile_name", "launch_template_id", "ami_id"},
    "gcp": {"project", "region", "network", "subnetwork", "service_account_email",
            "instance_template", "gpu_image", "network_tag"},
}
EXPECTED_VARIABLES = {
    "aws": {"region", "name_prefix", "vpc_cidr", "availability_zones", "admin_cidr", "gpu_ami_id",
            "gpu_ami_name_filter", "root_volume_size_gb", "ebs_kms_key_arn", "enable_nat_gateway",
            "broker_cidr_blocks", "broker_ports", "enable_ssm", "ecr_repository_arns",
            "checkpoint_bucket_arn", "checkpoint_prefix", "tags"},
    "gcp": {"project", "region", "name_prefix", "subnet_cidr", "admin_cidr", "gpu_image",
            "machine_type", "boot_disk_size_gb", "boot_disk_type", "enable_secure_boot", "enable_nat",
            "checkpoint_bucket", "artifact_registry_repositories", "labels"},
}
REQUIRED_FILES = ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md")
NODE_TAG = "fedbroker-node"


# ---------------------------------------------------------------- parsing

def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s


def _norm(x: Any) -> Any:
    """python-hcl2 4..8 differ in quoting and metadata keys; reduce all to one shape."""
    if isinstance(x, dict):
        return {_unquote(k): _norm(v) for k, v in x.items() if not (k.startswith("__") and k.endswith("__"))}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    if isinstance(x, str):
        return _unquote(x)
    return x


def _load(module: str) -> dict[str, list]:
    """All top-level blocks of a module, merged over its .tf files."""
    merged: dict[str, list] = {}
    for path in sorted((ROOT / module).glob("*.tf")):
        with path.open() as f:
            doc = _norm(hcl2.load(f))
        for kind, blocks in doc.items():
            merged.setdefault(kind, []).extend(blocks if isinstance(blocks, list) else [blocks])
    return merged


def _named(doc: dict, kind: str) -> dict[str, dict]:
    """variable/output blocks: {name: body}."""
    out: dict[str, dict] = {}
    for block in doc.get(kind, []):
        for name, body in block.items():
            out[name] = body
    return out


def _resources(doc: dict, rtype: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for block in doc.get("resource", []):
        for t, named in block.items():
            if t == rtype:
                out.update(named)
    return out


def _one(v: Any) -> Any:
    """A nested block is a list of one dict in python-hcl2; a list of one value likewise."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def _as_list(v: Any) -> list:
    return v if isinstance(v, list) else [v]


@pytest.fixture(scope="module", params=MODULES)
def module(request) -> tuple[str, dict]:
    return request.param, _load(request.param)


# ---------------------------------------------------------------- both modules

@pytest.mark.parametrize("name", MODULES)
def test_module_has_its_files(name):
    missing = [f for f in REQUIRED_FILES if not (ROOT / name / f).is_file()]
    assert not missing, f"terraform/{name} lacks {missing}"


def test_outputs_are_exactly_the_adapter_contract(module):
    name, doc = module
    assert set(_named(doc, "output")) == EXPECTED_OUTPUTS[name]
    for out, body in _named(doc, "output").items():
        assert body.get("description"), f"{name}: output {out} has no description"


def test_variables_are_exactly_documented_and_typed(module):
    name, doc = module
    variables = _named(doc, "variable")
    assert set(variables) == EXPECTED_VARIABLES[name]
    for var, body in variables.items():
        assert body.get("description"), f"{name}: variable {var} has no description"
        assert body.get("type"), f"{name}: variable {var} has no type"


def test_admin_cidr_defaults_to_none(module):
    _, doc = module
    assert _named(doc, "variable")["admin_cidr"]["default"] is None


def test_versions_pin_terraform_and_provider(module):
    name, doc = module
    tf = _one(doc["terraform"])
    assert tf["required_version"] == ">= 1.5"
    providers = _one(tf["required_providers"])
    want = {"aws": ("aws", "hashicorp/aws"), "gcp": ("google", "hashicorp/google")}[name]
    spec = providers[want[0]]
    assert spec["source"] == want[1] and spec["version"] == "~> 5.0"


def test_no_ingress_from_anywhere(module):
    name, _ = module
    text = "\n".join(p.read_text() for p in (ROOT / name).glob("*.tf"))
    doc = _load(name)
    for rule in _resources(doc, "aws_vpc_security_group_ingress_rule").values():
        assert rule.get("cidr_ipv4") != "0.0.0.0/0"
    for rule in _resources(doc, "aws_security_group_rule").values():
        assert not (rule.get("type") == "ingress" and "0.0.0.0/0" in _as_list(rule.get("cidr_blocks", [])))
    for fw in _resources(doc, "google_compute_firewall").values():
        assert "0.0.0.0/0" not in _as_list(fw.get("source_ranges", []))
    assert "ingress {" not in text, "inline security group rules mix with rule resources; use rule resources"


def test_checkov_skips_are_justified(module):
    name, _ = module
    for path in (ROOT / name).glob("*.tf"):
        for m in re.finditer(r"checkov:skip=([A-Z0-9_]+)(.*)", path.read_text()):
            reason = m.group(2).lstrip(": ").strip()
            assert len(reason) >= 20, f"{path.name}: skip of {m.group(1)} has no real reason"


# ---------------------------------------------------------------- AWS

@pytest.fixture(scope="module")
def aws() -> dict:
    return _load("aws")


def test_aws_security_group_talks_to_itself_both_ways(aws):
    sg_ref = "${aws_security_group.nodes.id}"
    ingress = [r for r in _resources(aws, "aws_vpc_security_group_ingress_rule").values()
               if r.get("referenced_security_group_id") == sg_ref]
    egress = [r for r in _resources(aws, "aws_vpc_security_group_egress_rule").values()
              if r.get("referenced_security_group_id") == sg_ref]
    assert ingress and egress
    for r in ingress + egress:
        assert r["security_group_id"] == sg_ref
        assert str(r["ip_protocol"]) == "-1", "NCCL/EFA need all protocols and ports among members"


def test_aws_ssh_only_from_admin_cidr(aws):
    ssh = _resources(aws, "aws_vpc_security_group_ingress_rule")["nodes_ssh"]
    assert ssh["cidr_ipv4"] == "${var.admin_cidr}"
    assert ssh["from_port"] == 22 and ssh["to_port"] == 22
    assert "var.admin_cidr == null ? 0 : 1" in ssh["count"]


def test_aws_launch_template_imdsv2_encrypted_private(aws):
    lt = _resources(aws, "aws_launch_template")["node"]
    md = _one(lt["metadata_options"])
    assert md["http_tokens"] == "required"
    assert md["http_put_response_hop_limit"] == 1
    ebs = _one(_one(lt["block_device_mappings"])["ebs"])
    assert ebs["encrypted"] is True
    assert "network_interfaces" not in lt, "the broker passes SubnetId; public IPs come from the subnet (none)"
    assert "instance_type" not in lt, "the broker picks the instance type per offer"
    assert lt["image_id"] == "${local.ami_id}"
    for subnet in _resources(aws, "aws_subnet").values():
        assert subnet["map_public_ip_on_launch"] is False


def test_aws_private_subnets_per_az_and_cluster_placement(aws):
    private = _resources(aws, "aws_subnet")["private"]
    assert private["availability_zone"] == "${each.key}"
    assert _resources(aws, "aws_placement_group")["gang"]["strategy"] == "cluster"


def test_aws_iam_has_no_wildcard_s3_or_admin(aws):
    text = (ROOT / "aws" / "main.tf").read_text()
    assert '"s3:*"' not in text and '"*:*"' not in text and "AdministratorAccess" not in text
    assert "arn:aws:s3:::*" not in text
    # the only "*" resource is ecr:GetAuthorizationToken, which has no resource-level permissions
    assert text.count('resources = ["*"]') == 1
    assert re.search(r'actions\s*=\s*\["ecr:GetAuthorizationToken"\]\s*\n\s*resources\s*=\s*\["\*"\]', text)


# ---------------------------------------------------------------- GCP

@pytest.fixture(scope="module")
def gcp() -> dict:
    return _load("gcp")


def test_gcp_nccl_firewall_between_tagged_nodes(gcp):
    fw = _resources(gcp, "google_compute_firewall")["nodes_internal"]
    assert _as_list(fw["source_tags"]) == ["${local.network_tag}"]
    assert _as_list(fw["target_tags"]) == ["${local.network_tag}"]
    protocols = {_one(a)["protocol"] for a in _as_list(fw["allow"])}
    assert {"tcp", "udp"} <= protocols
    assert all("ports" not in _one(a) for a in _as_list(fw["allow"])), "all ports: NCCL picks them at run time"
    assert _one(gcp["locals"])["network_tag"] == NODE_TAG


def test_gcp_ssh_only_from_admin_cidr(gcp):
    ssh = _resources(gcp, "google_compute_firewall")["nodes_ssh"]
    assert _as_list(ssh["source_ranges"]) == ["${var.admin_cidr}"]
    assert _one(ssh["allow"])["ports"] == ["22"]
    assert "var.admin_cidr == null ? 0 : 1" in ssh["count"]


def test_gcp_template_no_external_ip_terminate_shielded(gcp):
    tpl = _resources(gcp, "google_compute_instance_template")["node"]
    nic = _one(tpl["network_interface"])
    assert "access_config" not in nic
    assert _one(tpl["scheduling"])["on_host_maintenance"] == "TERMINATE"
    shielded = _one(tpl["shielded_instance_config"])
    assert shielded["enable_vtpm"] is True and shielded["enable_integrity_monitoring"] is True
    assert _as_list(tpl["tags"]) == ["${local.network_tag}"]
    assert _one(tpl["disk"])["source_image"] == "${var.gpu_image}"
    sa = _one(tpl["service_account"])
    assert sa["email"] == "${google_service_account.node.email}"


def test_gcp_subnetwork_private_google_access(gcp):
    assert _resources(gcp, "google_compute_subnetwork")["nodes"]["private_ip_google_access"] is True


def test_gcp_service_account_roles_are_least_privilege(gcp):
    member = _resources(gcp, "google_project_iam_member")["node"]
    text = (ROOT / "gcp" / "main.tf").read_text()
    roles = set(re.findall(r'"(roles/[A-Za-z.]+)"', text))
    assert roles == {"roles/logging.logWriter", "roles/monitoring.metricWriter",
                     "roles/artifactregistry.reader", "roles/storage.objectUser"}
    assert "roles/logging.logWriter" in member["for_each"] and "roles/monitoring.metricWriter" in member["for_each"]
    assert "roles/editor" not in text and "roles/owner" not in text
    assert _named(gcp, "variable")["gpu_image"]["default"].startswith(
        "projects/deeplearning-platform-release/global/images/family/")


# ---------------------------------------------------------------- tools, when present

def _mirror() -> Path | None:
    p = Path(os.environ.get("FEDBROKER_TF_PLUGIN_DIR", "/opt/tf-plugins"))
    return p if (p / "registry.terraform.io/hashicorp/aws").is_dir() else None


@pytest.mark.skipif(shutil.which("terraform") is None or _mirror() is None,
                    reason="needs the terraform binary and a local AWS provider mirror")
def test_aws_module_validates_and_plan_tests_pass(tmp_path):
    work = tmp_path / "aws"
    shutil.copytree(ROOT / "aws", work, ignore=shutil.ignore_patterns(".terraform*"))
    env = {**os.environ, "TF_CLI_CONFIG_FILE": "/dev/null", "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}

    def tf(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["terraform", *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)

    r = tf("init", "-backend=false", "-input=false", f"-plugin-dir={_mirror()}")
    assert r.returncode == 0, r.stdout + r.stderr
    r = tf("validate", "-no-color")
    assert r.returncode == 0, r.stdout + r.stderr
    r = tf("test", "-no-color")
    assert r.returncode == 0, r.stdout + r.stderr
    r = tf("fmt", "-check", "-recursive", str(ROOT))
    assert r.returncode == 0, f"terraform fmt would change: {r.stdout}"


@pytest.mark.skipif(shutil.which(os.environ.get("CHECKOV", "checkov")) is None,
                    reason="checkov not installed (see terraform/check.sh)")
def test_checkov_finds_nothing():
    r = subprocess.run(["bash", str(ROOT / "check.sh")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
