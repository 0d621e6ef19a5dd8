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
])
def test_known_rows(provider, region, zone):
    assert grid_zone_for(provider, region) == zone


def test_unmapped_regions_are_none():
    for p, r in [("aws", "us-west-2"), ("aws", "ca-central-1"), ("gcp", "us-central1"), ("gcp", "asia-south2"),
                 ("gcp", "no-such-region")]:
        assert grid_zone_for(p, r) is None


def test_every_row_has_bundled_carbon_and_a_reason():
    zones = set(available_carbon_zones())
    for key, row in REGION_GRID_ZONES.items():
        assert row.zone in zones, key
        assert row.city and row.reason


def test_bad_provider():
    with pytest.raises(ValueError, match="provider='azure'"):
        grid_zone_for("azure", "eastus")
