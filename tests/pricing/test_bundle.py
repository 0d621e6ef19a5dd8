"""The bundle in pricing/data: small, complete, attributed."""

from pricing._data import DATA_DIR

EXPECTED = {
    "carbon_intensity_lca_2023-2024_utc.csv.gz", "carbon_zones.csv", "electricity_prices_2023-2024_utc.csv.gz",
    "electricity_price_zones.csv", "aws_gpu_vms_skypilot_catalog_v9_subset.csv",
    "gcp_gpu_vms_skypilot_schema_anycloud_2026-05-20.csv.gz", "spot_availability_1node.csv.gz",
    "mlco2_impact_gpus.csv", "carbon_annual_zones.csv", "SOURCES.md",
}


def test_bundle_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in DATA_DIR.iterdir() if p.is_file()}
    assert EXPECTED <= set(files)
    assert sum(files.values()) < 4_000_000


def test_sources_attributes_every_file():
    text = (DATA_DIR / "SOURCES.md").read_text(encoding="utf-8")
    for name in EXPECTED - {"SOURCES.md"}:
        assert f"`{name}`" in text or name in text, name
    assert "Redistribution terms were not checked" in text
    assert "Electricity Maps" in text
