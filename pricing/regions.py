"""Cloud region -> grid zone table (the zone whose carbon figure applies).

One row per (provider, region); every region of the bundled catalogs has one
(``tests/pricing/test_regions.py`` checks it). The zone id is the Electricity
Maps zone. Reasons give the metro of the region (AWS "Regions and Availability
Zones" and Google Cloud "Cloud locations" pages) and the grid that serves it.
The same mapping is suggested by ``/work/shared/data/SOURCES.md`` §2.1/§2.2.

A zone has either a bundled hourly series or one published annual figure
(:mod:`pricing.carbon`); :func:`pricing.carbon.carbon_estimated` says whether
the figure is an estimate (annual, or another year's hours copied), and offers
carry that flag. Electricity prices are not needed for cloud regions (the cloud
bill is the price).

Caveats: GCP us-west2 is in Los Angeles, where much load is served by LADWP
rather than CAISO; we follow SOURCES.md and use US-CAL-CISO. AWS us-east-2
(Ohio, AEP) and GCP us-east5 (Columbus) are in PJM but not in its DOM zone,
whose prices the US-MIDA-PJM price series carries. AWS eu-north-1 (Stockholm)
is in bidding zone SE3; the country-level SE series is used (SE-SE3 exists for
2022 only; its 2022 mean, 23.4 gCO2e/kWh, is within 1.4 of SE's 24.8). GCP
us-east1 (Moncks Corner, SC) is in the Santee Cooper area (US-CAR-SC), hourly
for 2022 only. AWS me-central-1 (UAE) has no figure of its own in the shared
data: the Qatari grid's (GCP Doha) stands in (see ``carbon_annual_zones.csv``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

__all__ = ["RegionZone", "REGION_GRID_ZONES", "grid_zone_for", "PROVIDERS"]

PROVIDERS = ("aws", "gcp")


class RegionZone(NamedTuple):
    """Grid zone of one cloud region, with the metro and the reason."""

    zone: str
    city: str
    reason: str


_R = RegionZone
#: (provider, region) -> RegionZone. The only region->zone table in fedbroker.
REGION_GRID_ZONES: MappingProxyType[tuple[str, str], RegionZone] = MappingProxyType({
    # ---- AWS
    ("aws", "us-east-1"): _R("US-MIDA-PJM", "N. Virginia", "Dominion zone of PJM"),
    ("aws", "us-east-2"): _R("US-MIDA-PJM", "Ohio (Columbus)", "AEP Ohio is in PJM"),
    ("aws", "us-west-1"): _R("US-CAL-CISO", "N. California", "CAISO balancing area"),
    ("aws", "eu-central-1"): _R("DE-LU", "Frankfurt", "German bidding zone DE-LU"),
    ("aws", "eu-west-2"): _R("GB", "London", "Great Britain grid"),
    ("aws", "ap-northeast-1"): _R("JP-TK", "Tokyo", "TEPCO area"),
    ("aws", "ap-northeast-2"): _R("KR", "Seoul", "single national grid (KPX)"),
    ("aws", "ap-southeast-1"): _R("SG", "Singapore", "single national grid"),
    ("aws", "ap-southeast-2"): _R("AU-NSW", "Sydney", "NEM region NSW1"),
    ("aws", "ap-southeast-4"): _R("AU-VIC", "Melbourne", "NEM region VIC1"),
    ("aws", "ap-south-1"): _R("IN-WE", "Mumbai", "Western regional grid of India"),
    ("aws", "sa-east-1"): _R("BR-SP", "São Paulo", "Southeast/Central-West subsystem (file zone BR-CS)"),
    ("aws", "af-south-1"): _R("ZA", "Cape Town", "Eskom national grid"),
    ("aws", "us-west-2"): _R("US-NW-BPAT", "Oregon (Boardman)", "Bonneville Power Administration area"),
    ("aws", "ca-central-1"): _R("CA-QC", "Montréal", "Hydro-Québec"),
    ("aws", "eu-west-1"): _R("IE", "Dublin", "Irish grid (all hours estimated by Electricity Maps)"),
    ("aws", "eu-north-1"): _R("SE", "Stockholm", "Swedish grid (country series; Stockholm is in SE3)"),
    ("aws", "ap-northeast-3"): _R("JP-KN", "Osaka", "Kansai area (annual figure)"),
    ("aws", "ap-southeast-3"): _R("ID", "Jakarta", "Java-Bali grid (annual figure)"),
    ("aws", "eu-south-2"): _R("ES", "Aragón", "Spanish peninsular grid (annual figure)"),
    ("aws", "me-central-1"): _R("AE", "UAE", "annual figure of the Qatari grid as a proxy"),
    # ---- GCP
    ("gcp", "us-east4"): _R("US-MIDA-PJM", "Ashburn, N. Virginia", "Dominion zone of PJM"),
    ("gcp", "us-east5"): _R("US-MIDA-PJM", "Columbus, Ohio", "AEP Ohio is in PJM"),
    ("gcp", "us-west2"): _R("US-CAL-CISO", "Los Angeles", "CAISO per SOURCES.md (LADWP also serves LA)"),
    ("gcp", "us-south1"): _R("US-TEX-ERCO", "Dallas", "ERCOT"),
    ("gcp", "europe-west3"): _R("DE-LU", "Frankfurt", "German bidding zone DE-LU"),
    ("gcp", "europe-west10"): _R("DE-LU", "Berlin", "German bidding zone DE-LU"),
    ("gcp", "europe-west2"): _R("GB", "London", "Great Britain grid"),
    ("gcp", "northamerica-northeast2"): _R("CA-ON", "Toronto", "Ontario IESO"),
    ("gcp", "asia-northeast1"): _R("JP-TK", "Tokyo", "TEPCO area"),
    ("gcp", "asia-northeast3"): _R("KR", "Seoul", "single national grid (KPX)"),
    ("gcp", "asia-southeast1"): _R("SG", "Jurong West, Singapore", "single national grid"),
    ("gcp", "asia-south1"): _R("IN-WE", "Mumbai", "Western regional grid of India"),
    ("gcp", "australia-southeast1"): _R("AU-NSW", "Sydney", "NEM region NSW1"),
    ("gcp", "australia-southeast2"): _R("AU-VIC", "Melbourne", "NEM region VIC1"),
    ("gcp", "southamerica-east1"): _R("BR-SP", "Osasco, São Paulo", "Southeast/Central-West subsystem (file zone BR-CS)"),
    ("gcp", "southamerica-west1"): _R("CL-SIC", "Santiago", "Chile national grid SEN (file zone CL-SEN)"),
    ("gcp", "africa-south1"): _R("ZA", "Johannesburg", "Eskom national grid"),
    ("gcp", "us-central1"): _R("US-MIDW-MISO", "Council Bluffs, Iowa", "MISO"),
    ("gcp", "us-east1"): _R("US-CAR-SC", "Moncks Corner, S. Carolina", "Santee Cooper balancing area"),
    ("gcp", "us-west1"): _R("US-NW-BPAT", "The Dalles, Oregon", "Bonneville Power Administration area"),
    ("gcp", "us-west3"): _R("US-NW-PACE", "Salt Lake City", "PacifiCorp East (annual figure)"),
    ("gcp", "us-west4"): _R("US-NW-NEVP", "Las Vegas", "NV Energy (Nevada Power)"),
    ("gcp", "northamerica-northeast1"): _R("CA-QC", "Montréal", "Hydro-Québec"),
    ("gcp", "europe-west1"): _R("BE", "St. Ghislain", "Belgian grid"),
    ("gcp", "europe-west4"): _R("NL", "Eemshaven", "Dutch grid"),
    ("gcp", "europe-west9"): _R("FR", "Paris", "French grid"),
    ("gcp", "europe-north1"): _R("FI", "Hamina", "Finnish grid"),
    ("gcp", "europe-west6"): _R("CH", "Zurich", "Swiss grid (annual figure)"),
    ("gcp", "europe-central2"): _R("PL", "Warsaw", "Polish grid (annual figure)"),
    ("gcp", "asia-east1"): _R("TW", "Changhua County", "Taiwan grid (annual figure)"),
    ("gcp", "asia-east2"): _R("HK", "Hong Kong", "Hong Kong grid (annual figure)"),
    ("gcp", "asia-south2"): _R("IN-NO", "Delhi", "northern Indian grid (annual figure)"),
    ("gcp", "asia-southeast2"): _R("ID", "Jakarta", "Java-Bali grid (annual figure)"),
    ("gcp", "me-central2"): _R("SA", "Dammam", "Saudi grid (annual figure)"),
    ("gcp", "me-west1"): _R("IL", "Tel Aviv", "Israeli grid (annual figure)"),
})


def grid_zone_for(provider: str, region: str) -> str | None:
    """Grid zone id (e.g. ``"US-MIDA-PJM"``) of cloud ``region`` of ``provider`` (``"aws"``/``"gcp"``).

    Returns ``None`` for a region not in :data:`REGION_GRID_ZONES` (no region of
    the bundled catalogs; callers skip and count such offers). Raises ``ValueError`` naming ``provider`` if
    it is not one of :data:`PROVIDERS`.
    """
    if provider not in PROVIDERS:
        raise ValueError(f"provider={provider!r}: expected one of {PROVIDERS}")
    row = REGION_GRID_ZONES.get((provider, region))
    return row.zone if row else None
