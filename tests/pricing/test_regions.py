"""Region -> grid zone table."""

import pytest

from pricing.carbon import available_carbon_zones
from pricing.regions import REGION_GRID_ZONES, grid_zone_for


@pytest.mark.parametrize("provider, region, zone", [
    ("aws", "us-east-1", "US-MIDA-PJM"), ("aws", "us-east-2", "US-MIDA-PJM"), ("aws", "us-west-1", "US-CAL-CISO"),
    ("aws", "eu-central-1", "DE-LU"), ("aws", "eu-west-2", "GB"), ("aws", "ap-northeast-1", "JP-TK"),
    ("aws", "ap-northeast-2", "KR"), ("aws", "ap-southeast-1", "SG"), ("aws", "ap-southeast-2", "AU-NSW"),
    ("aws", "ap-south-1", "IN-WE"), ("aws", "sa-east-1", "BR-SP"),
    ("gcp", "us-east4", "US-MIDA-PJM"), ("gcp", "us-west2", "US-CAL-CISO"), ("gcp", "us-south1", "US-TEX-ERCO"),
    ("gcp", "europe-west3", "DE-LU"), ("gcp", "europe-west2", "GB"), ("gcp", "northamerica-northeast2", "CA-ON"),
    ("gcp", "asia-northeast1", "JP-TK"), ("gcp", "asia-northeast3", "KR"), ("gcp", "asia-southeast1", "SG"),
    ("gcp", "asia-south1", "IN-WE"), ("gcp", "australia-southeast1", "AU-NSW"),
    ("gcp", "australia-southeast2", "AU-VIC"), ("gcp", "southamerica-east1", "BR-SP"),
    ("gcp", "southamerica-west1", "CL-SIC"),
    ("aws", "us-west-2", "US-NW-BPAT"), ("aws", "ca-central-1", "CA-QC"), ("aws", "eu-north-1", "SE"),
    ("aws", "me-central-1", "AE"), ("gcp", "us-central1", "US-MIDW-MISO"), ("gcp", "europe-west4", "NL"),
    ("gcp", "europe-north1", "FI"), ("gcp", "asia-south2", "IN-NO"), ("gcp", "us-east1", "US-CAR-SC"),
])
def test_known_rows(provider, region, zone):
    assert grid_zone_for(provider, region) == zone


def test_unmapped_regions_are_none():
    assert grid_zone_for("gcp", "no-such-region") is None


def test_every_catalog_region_has_a_zone():
    """No region of the bundled catalogs is left without a grid zone (read from the raw files)."""
    import pandas as pd

    from pricing._data import data_path
    from pricing.catalog import AWS_CATALOG_FILE, GCP_CATALOG_FILE

    regions = {("aws", r) for r in pd.read_csv(data_path(AWS_CATALOG_FILE))["Region"]}
    regions |= {("gcp", r) for r in pd.read_csv(data_path(GCP_CATALOG_FILE))["Region"]}
    assert len(regions) >= 18 + 31
    missing = sorted(k for k in regions if grid_zone_for(*k) is None)
    assert not missing


def test_every_row_has_bundled_carbon_and_a_reason():
    zones = set(available_carbon_zones())
    for key, row in REGION_GRID_ZONES.items():
        assert row.zone in zones, key
        assert row.city and row.reason


def test_bad_provider():
    with pytest.raises(ValueError, match="provider='azure'"):
        grid_zone_for("azure", "eastus")
