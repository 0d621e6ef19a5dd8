"""Cloud offers: GCP VM+accelerator pricing, AWS rows, skips, metadata."""

import math

import pytest

from broker.model import Market
from pricing.carbon import available_carbon_zones
from pricing.catalog import (
    MIN_BILLED_S, combine_gcp_price, gcp_instance_price, load_offers, spot_interruption_rate)
from pricing.spot import load_spot_traces, pooled_interruption_rate


@pytest.fixture(scope="module")
def cat():
    return load_offers()


def test_combine_gcp_price():
    # a2-highgpu-1g us-central1 (SOURCES.md 1.3): VM 0.73948 + A100x1 2.93391
    assert combine_gcp_price(0.73948, 2.93391) == pytest.approx(3.67339)
    assert math.isnan(combine_gcp_price(0.73948, None))
    assert math.isnan(combine_gcp_price(float("nan"), 1.0))


def test_gcp_instance_price_from_bundled_rows():
    # us-central1 rows:
    # "a2-highgpu-1g,12.0,85.0,,,,us-central1,us-central1-a,0.73948,0.36975"
    # ",,,A100,1,{...},us-central1,us-central1-a,2.93391,1.4341"
    assert gcp_instance_price("a2-highgpu-1g", "us-central1-a", "on_demand") == pytest.approx(3.67339)
    assert gcp_instance_price("a2-highgpu-1g", "us-central1-a", Market.spot) == pytest.approx(0.36975 + 1.4341)
    assert math.isnan(gcp_instance_price("a2-highgpu-1g", "nowhere-1a", "spot"))
    with pytest.raises(ValueError, match="instance_type='c2-standard-4'"):
        gcp_instance_price("c2-standard-4", "us-central1-a", "spot")


def _find(cat, **kw):
    return [o for o in cat.offers if all(getattr(o, k) == v for k, v in kw.items())]


def test_aws_known_row(cat):
    # aws_gpu_vms_skypilot_catalog_v9_subset.csv line 40:
    # p3.2xlarge,V100,1.0,8.0,61.0,3.06,0.370900,us-east-1,use1-az2
    od, = _find(cat, provider="aws", zone="use1-az2", instance_type="p3.2xlarge", market=Market.on_demand)
    sp, = _find(cat, provider="aws", zone="use1-az2", instance_type="p3.2xlarge", market=Market.spot)
    assert od.usd_per_hour == 3.06 and sp.usd_per_hour == 0.3709
    assert (od.gpu_type, od.gpu_count, od.gpu_memory_gb, od.carbon_zone) == ("V100", 1, 16.0, "US-MIDA-PJM")
    assert od.pue == 1.15 and od.min_billed_s == MIN_BILLED_S == 60.0
    assert od.interruption_rate_per_hour == 0.0
    v100_1 = [t for t in load_spot_traces() if t.accelerator == "v100" and t.count == 1]
    assert sp.interruption_rate_per_hour == pytest.approx(pooled_interruption_rate(v100_1))


def test_gcp_known_rows(cat):
    # "a2-highgpu-1g,...,asia-northeast1,asia-northeast1-a,0.94803,0.47407" + A100x1 there "1.70586,1.3974"
    o, = _find(cat, provider="gcp", zone="asia-northeast1-a", instance_type="a2-highgpu-1g", market=Market.on_demand)
    assert o.usd_per_hour == pytest.approx(0.94803 + 1.70586)
    assert (o.gpu_type, o.gpu_count, o.carbon_zone, o.pue) == ("A100", 1, "JP-TK", 1.10)
    # n1 host + T4 (hosts of >= 4 vCPUs): "n1-standard-4,4.0,15.0,...,asia-northeast1-a,0.24376,0.06996",
    # "n1-highmem-4,4.0,26.0,...,0.30337,0.08707", "n1-standard-8,...,0.48751,0.13993" + ",,,T4,1,...,0.37,0.1514":
    # the cheapest host is n1-standard-4 in both markets
    n1, = _find(cat, zone="asia-northeast1-a", gpu_type="T4", gpu_count=1, market=Market.spot)
    assert n1.instance_type == "n1-standard-4+T4x1" and n1.usd_per_hour == pytest.approx(0.06996 + 0.1514)
    od, = _find(cat, zone="asia-northeast1-a", gpu_type="T4", gpu_count=1, market=Market.on_demand)
    assert od.instance_type == "n1-standard-4+T4x1" and od.usd_per_hour == pytest.approx(0.24376 + 0.37)
    assert gcp_instance_price("n1-highmem-4+T4x1", "asia-northeast1-a", "spot") == pytest.approx(0.08707 + 0.1514)
    assert n1.gpu_type == "T4" and n1.interruption_rate_per_hour == pytest.approx(pooled_interruption_rate(load_spot_traces()))
    g2 = _find(cat, instance_type="g2-standard-24", market=Market.on_demand)
    assert g2 and all(o.gpu_type == "L4" and o.gpu_count == 2 for o in g2)


def test_catalog_invariants(cat):
    zones = set(available_carbon_zones())
    assert len(cat.offers) > 500
    ids = [o.offer_id for o in cat.offers]
    assert len(ids) == len(set(ids))
    for o in cat.offers:
        assert o.carbon_zone in zones and o.usd_per_hour > 0 and math.isfinite(o.usd_per_hour)
        assert (o.interruption_rate_per_hour > 0) == (o.market is Market.spot)
    assert _find(cat, region="us-west-2") and _find(cat, region="us-central1")  # once dropped: no hourly data
    assert "no grid zone for region" not in cat.skipped  # every catalog region has a carbon figure
    assert cat.skipped["unknown GPU type"] > 0  # GCP P4, AWS B300: no power/throughput figures
    assert set(cat.skipped) <= {"no grid zone for region", "unknown GPU type", "missing price",
                                "no matching GCP VM/accelerator row"}
    assert {o.gpu_type for o in cat.offers} >= {"V100", "A100", "A100-80GB", "H100", "H200", "B200", "L4", "T4", "L40S"}


def test_carbon_estimated_on_offers(cat):
    from pricing.carbon import carbon_estimated
    assert all(o.carbon_estimated == carbon_estimated(o.carbon_zone) for o in cat.offers)
    assert {o.carbon_estimated for o in _find(cat, region="asia-east1")} == {True}  # TW: annual figure
    assert {o.carbon_estimated for o in _find(cat, region="europe-north1")} == {False}  # FI: hourly 2023-2024


def test_gcp_n1_host_rule():
    from pricing.catalog import gcp_n1_hosts
    hosts = [("n1-standard-4", 4, 15), ("n1-highmem-4", 4, 26), ("n1-standard-8", 8, 30), ("n1-highmem-8", 8, 52),
             ("n1-highmem-16", 16, 104), ("n1-highcpu-8", 8, 7.2), ("n1-standard-64", 64, 240),
             ("n1-highmem-32", 32, 208)]
    # T4 x1: >= 4 vCPUs, <= 48 vCPUs / 312 GB
    assert gcp_n1_hosts("T4", 1, hosts) == ["n1-standard-4", "n1-highmem-4", "n1-standard-8", "n1-highmem-8",
                                            "n1-highmem-16", "n1-highmem-32"]
    # V100 x1: >= 8 vCPUs, <= 12 vCPUs / 78 GB
    assert gcp_n1_hosts("V100", 1, hosts) == ["n1-standard-8", "n1-highmem-8"]
    # P100 x4: >= 32 vCPUs, <= 64 vCPUs / 208 GB: n1-standard-64 has 240 GB
    assert gcp_n1_hosts("P100", 4, hosts) == ["n1-highmem-32"]
    assert gcp_n1_hosts("A100", 1, hosts) == [] and gcp_n1_hosts("T4", 8, hosts) == []


def test_filters_and_bad_args():
    c = load_offers(providers=("gcp",), markets=("spot",))
    assert c.offers and all(o.provider == "gcp" and o.market is Market.spot for o in c.offers)
    with pytest.raises(ValueError, match="'azure'"):
        load_offers(providers=("azure",))
    with pytest.raises(ValueError, match="'reserved'"):
        load_offers(markets=("reserved",))


def test_spot_rate_fallbacks():
    traces = load_spot_traces()
    v8 = [t for t in traces if t.accelerator == "v100" and t.count == 8]
    assert spot_interruption_rate("V100", 8) == pytest.approx(pooled_interruption_rate(v8))
    v_all = [t for t in traces if t.accelerator == "v100"]
    assert spot_interruption_rate("V100", 4) == pytest.approx(pooled_interruption_rate(v_all))
    assert spot_interruption_rate("H100", 8) == pytest.approx(pooled_interruption_rate(traces))
