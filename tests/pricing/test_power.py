"""GPU specs, name canonicalisation, power model."""

import csv

import pytest

from pricing._data import data_path
from pricing.errors import UnknownGpuTypeError
from pricing.power import CLOUD_PUE, DEFAULT_UTILISATION, GPU_SPECS, canonical_gpu_type, gpu_power_w


def test_required_types():
    for t in ("K80", "P100", "V100", "V100-32GB", "T4", "A10G", "L4", "L40S", "A100", "A100-80GB", "H100", "H200", "B200"):
        s = GPU_SPECS[t]
        assert 0 < s.idle_w < s.tdp_w and s.memory_gb > 0 and s.rel_throughput > 0 and s.source
    assert GPU_SPECS["V100"].rel_throughput == 1.0


def test_tdps_cited_from_mlco2_match_the_bundled_table():
    with open(data_path("mlco2_impact_gpus.csv"), newline="") as f:
        tdp = {row[0]: float(row[2]) for row in csv.reader(f) if len(row) > 2 and row[0] != "name"}
    # mlco2 rows: "T4,gpu,70,...", "L4,gpu,72,...", "L40S,gpu,350,...", "A100 SXM4 80 GB,gpu,400,...",
    # "H100 SXM,gpu,700,...", "Tesla V100-SXM2-32GB,gpu,300,...", "Tesla P100,gpu,250,...", "A10G,gpu,150,..."
    for ours, theirs in [("T4", "T4"), ("L4", "L4"), ("L40S", "L40S"), ("A100-80GB", "A100 SXM4 80 GB"),
                         ("H100", "H100 SXM"), ("V100-32GB", "Tesla V100-SXM2-32GB"), ("P100", "Tesla P100"),
                         ("A10G", "A10G")]:
        assert GPU_SPECS[ours].tdp_w == tdp[theirs]


@pytest.mark.parametrize("name, canon", [
    ("A100-80GB", "A100-80GB"), ("V100-32GB", "V100-32GB"), ("H100-MEGA", "H100"), ("nvidia-tesla-v100", "V100"),
    ("Tesla V100-SXM2-16GB", "V100"), ("Tesla V100-SXM2-32GB", "V100-32GB"), ("v100", "V100"), ("k80", "K80"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("nvidia-tesla-a100", "A100"), ("nvidia-l4", "L4"), ("L40S", "L40S"),
    ("nvidia-tesla-t4", "T4"), ("nvidia-h100-mega-80gb", "H100"), ("H200", "H200"), ("B200", "B200"),
])
def test_canonical_names(name, canon):
    assert canonical_gpu_type(name) == canon


@pytest.mark.parametrize("bad", ["P4", "B300", "RTX 3090", "L40", "", "A10"])
def test_unknown_gpu_type_names_value(bad):
    with pytest.raises(UnknownGpuTypeError) as e:
        canonical_gpu_type(bad)
    assert f"gpu_type={bad!r}" in str(e.value) and isinstance(e.value, ValueError)


def test_power_model():
    # V100: idle 40 W, TDP 300 W -> 40 + 0.5 x 260
    assert gpu_power_w("V100", 0.5) == pytest.approx(170.0)
    assert gpu_power_w("Tesla V100-SXM2-16GB", 1.0) == 300.0
    assert gpu_power_w("H100", 0.0) == GPU_SPECS["H100"].idle_w
    assert gpu_power_w("T4") == pytest.approx(10 + DEFAULT_UTILISATION * 60)


@pytest.mark.parametrize("u", [1.5, -0.1, float("nan"), "high"])
def test_bad_utilisation(u):
    with pytest.raises(ValueError, match="utilisation="):
        gpu_power_w("A100", u)


def test_cloud_pue():
    assert CLOUD_PUE["gcp"] == pytest.approx(1.10) and CLOUD_PUE["aws"] == pytest.approx(1.15)
