"""Tests for broker.cluster: default cluster, node-group expansion, error messages."""

from __future__ import annotations

import json

import pytest

from broker.cluster import DEFAULT_CLUSTER_PATH, ClusterError, load_cluster, parse_cluster
from broker.model import Pool, PoolNode


def test_default_cluster():
    pools = load_cluster()
    assert len(pools) == 1
    (p,) = pools
    assert isinstance(p, Pool)
    assert (p.name, p.carbon_zone, p.price_zone, p.timezone) == ("toronto", "CA-ON", "CA-ON", "America/Toronto")
    assert p.site == "Toronto, Ontario (IESO grid)"
    assert (p.pue, p.amortised_usd_per_gpu_hour) == (1.3, 0.55)
    assert len(p.nodes) == 48 and p.total_gpus == 384
    assert p.nodes[0] == PoolNode(name="v100-00", gpu_type="V100", gpu_count=8, gpu_memory_gb=16.0)
    assert p.nodes[-1].name == "v100-47"
    assert load_cluster(DEFAULT_CLUSTER_PATH) == pools


def test_bundled_caiso_alternative():
    (p,) = load_cluster(DEFAULT_CLUSTER_PATH.parent / "clusters" / "bay_area_caiso.yaml")
    assert (p.name, p.carbon_zone, p.timezone, p.total_gpus) == ("bay-area", "US-CAL-CISO", "America/Los_Angeles", 384)


def test_expansion_counts_and_explicit_nodes(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("""
pools:
  - name: lab
    carbon_zone: DE-LU
    price_zone: DE-LU
    nodes:
      - {name: special, gpu_type: H100, gpu_count: 4, gpu_memory_gb: 80}
    node_groups:
      - {count: 3, gpu_type: A100, gpus_per_node: 8, gpu_memory_gb: 40}
      - {count: 12, gpu_type: T4, gpus_per_node: 1, name_prefix: "t4-"}
  - name: edge
    carbon_zone: GB
    price_zone: GB
    node_groups: [{count: 1, gpu_type: L4, gpus_per_node: 2}]
""")
    lab, edge = load_cluster(f)
    assert len(lab.nodes) == 1 + 3 + 12
    assert lab.total_gpus == 4 + 24 + 12
    assert [n.name for n in lab.nodes[:4]] == ["special", "lab-a100-0", "lab-a100-1", "lab-a100-2"]
    assert lab.nodes[4].name == "t4-00" and lab.nodes[-1].name == "t4-11"
    assert lab.nodes[-1].gpu_memory_gb == 16.0  # PoolNode default
    assert (edge.total_gpus, edge.nodes[0].name, edge.pue) == (2, "edge-l4-0", 1.3)


def test_json_and_bare_list(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps([{"name": "p", "carbon_zone": "GB", "price_zone": "GB",
                              "node_groups": [{"count": 2, "gpu_type": "V100", "gpus_per_node": 4}]}]))
    (p,) = load_cluster(f)
    assert p.total_gpus == 8


@pytest.mark.parametrize("body,field", [
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: GB, node_groups: [{count: 0, gpu_type: V100, gpus_per_node: 8}]}",
     "pools[0].node_groups[0].count"),
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: GB, pue: 0.9, node_groups: [{count: 1, gpu_type: V100, gpus_per_node: 8}]}",
     "pools[0].pue"),
    ("pools:\n  - {name: p, price_zone: GB, node_groups: [{count: 1, gpu_type: V100, gpus_per_node: 8}]}",
     "pools[0].carbon_zone"),
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: GB, nodes: [{name: a, gpu_type: V100, gpu_count: many}]}",
     "pools[0].nodes[0].gpu_count"),
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: GB, node_groups: [{count: 1, gpu_type: V100, gpus_per_node: 8, colour: red}]}",
     "pools[0].node_groups[0].colour"),
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: GB}", "pools[0].nodes"),
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: GB, node_groups: [{count: 1, gpu_type: V, gpus_per_node: 1, name_prefix: x}, {count: 1, gpu_type: V, gpus_per_node: 1, name_prefix: x}]}",
     "duplicate node name 'x0'"),
    ("pools: [", "not valid YAML"),
    ("pools:\n  - {name: p, carbon_zone: GB, price_zone: [1, 2], nodes: [{name: a, gpu_type: V100, gpu_count: 1}]}",
     "pools[0].price_zone: Input should be a valid string (got [1, 2])"),
    # a key given twice: refused, as in settings and job files (the last one silently won)
    ("pools:\n  - name: p\n    carbon_zone: GB\n    price_zone: GB\n    pue: 1.3\n    pue: 2.5\n"
     "    nodes: [{name: a, gpu_type: V100, gpu_count: 1}]\n",
     "key 'pue' under 'pools.0' appears twice (lines 5 and 6)"),
])
def test_bad_cluster_names_file_and_field(tmp_path, body, field):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(ClusterError) as ei:
        load_cluster(f)
    msg = str(ei.value)
    assert str(f) in msg
    assert field in msg


def test_missing_file_and_empty(tmp_path):
    with pytest.raises(ClusterError, match="nope.yaml"):
        load_cluster(tmp_path / "nope.yaml")
    with pytest.raises(ClusterError, match="pools"):
        parse_cluster({"pools": []}, "x.yaml")
    assert issubclass(ClusterError, ValueError)


# ----------------------------------------------------------------------------- pools of an existing scheduler
_SITE = {"name": "hpc", "carbon_zone": "CA-ON", "price_zone": "CA-ON", "pue": 1.2, "amortised_usd_per_gpu_hour": 0.4}


def test_slurm_pool_keeps_site_parameters_and_its_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pools:\n  - name: hpc\n    kind: slurm\n    carbon_zone: CA-ON\n    price_zone: CA-ON\n"
                 "    pue: 1.2\n    amortised_usd_per_gpu_hour: 0.4\n"
                 "    slurm: {partition: gpu, slurm_conf: /etc/slurm/slurm.conf, qos_by_class: {high: urgent}}\n"
                 "  - name: local\n    carbon_zone: CA-ON\n    price_zone: CA-ON\n"
                 "    nodes: [{name: n1, gpu_type: V100, gpu_count: 4}]\n")
    hpc, local = load_cluster(f)
    assert (hpc.kind, hpc.external, hpc.nodes, hpc.pue, hpc.amortised_usd_per_gpu_hour) == ("slurm", True, (), 1.2, 0.4)
    assert hpc.scheduler == {"partition": "gpu", "slurm_conf": "/etc/slurm/slurm.conf", "qos_by_class": {"high": "urgent"}}
    assert (local.kind, local.external, local.scheduler) == ("agent", False, None)


@pytest.mark.parametrize("extra, message", [
    ({"kind": "slurm"}, "pools[0].slurm: required for a pool of kind 'slurm'"),
    ({"kind": "pbs", "slurm": {}}, "pools[0].kind: 'pbs' is not one of agent, slurm, kubernetes"),
    ({"kind": "slurm", "slurm": {"partiton": "gpu"}}, "pools[0].slurm: unknown key(s) ['partiton']"),
    ({"kind": "slurm", "slurm": {"partition": "a b"}}, "pools[0].slurm: partition='a b': must be 1-64 of"),
    ({"kind": "slurm", "slurm": {"term_grace_s": "30"}}, "pools[0].slurm.term_grace_s='30': must be a number"),
    ({"kind": "slurm", "slurm": {"rest_url": "http://h:6820"}}, "rest_url is set: jwt_file and rest_user are required"),
    ({"slurm": {"partition": "gpu"}}, "pools[0].slurm: a 'slurm' section on a pool of kind 'agent' (set pools[0].kind: slurm)"),
    ({"kind": "slurm", "slurm": {}, "scheduler": {}}, "pools[0].scheduler: not a cluster-file key"),
    ({"kind": "slurm", "slurm": {"qos_by_class": {"hgh": "urgent"}}},
     "pools[0].slurm.qos_by_class: 'hgh' is not a priority class (low, normal, high, critical)"),
    ({"kind": "kubernetes", "kubernetes": {"namespace": "ml", "priority_class_by_class": {"urgent": "p"}}},
     "pools[0].kubernetes.priority_class_by_class: 'urgent' is not a priority class"),
])
def test_bad_scheduler_pool_names_the_field(extra, message):
    with pytest.raises(ClusterError) as e:
        parse_cluster([{**_SITE, **extra}], "c.yaml")
    assert str(e.value).startswith("c.yaml: ") and message in str(e.value), str(e.value)


def test_agent_pool_still_needs_nodes():
    with pytest.raises(ClusterError, match=r"pools\[0\].nodes: pool 'hpc' has no nodes"):
        parse_cluster([_SITE], "c.yaml")


def test_a_json_cluster_file_with_a_key_twice_is_refused(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"pools": [{"name": "p", "name": "q", "carbon_zone": "GB", "price_zone": "GB", '
                 '"nodes": [{"name": "a", "gpu_type": "V100", "gpu_count": 1}]}]}')
    with pytest.raises(ClusterError, match=r"c\.json: not valid JSON: key 'name' appears twice in one object"):
        load_cluster(f)
