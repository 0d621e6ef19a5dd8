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
