"""Cloud region -> grid zone table (the zone whose hourly carbon/price series applies).

One row per (provider, region) whose data centres sit in a grid zone that has a
bundled hourly carbon-intensity series (:func:`pricing.carbon.available_carbon_zones`).
The zone id is the Electricity Maps zone (as used by green-dcc). Reasons give
the metro of the region (AWS "Regions and Availability Zones" and Google Cloud
"Cloud locations" pages) and the grid operator that serves it. The same
mapping is suggested by ``/work/shared/data/SOURCES.md`` §2.1 for the main rows.

Regions NOT in the table return ``None`` from :func:`grid_zone_for`: there is
no bundled hourly series for their grid (e.g. AWS us-west-2 Oregon / BPA, AWS
ca-central-1 Montréal / Hydro-Québec, AWS eu-west-1 Ireland, AWS eu-north-1
Stockholm, GCP us-central1 Iowa / MISO, GCP us-east1 South Carolina / SERC,
GCP europe-west4 Netherlands, GCP asia-south2 Delhi — northern Indian grid,
not IN-WE). Offers there are skipped and counted, never given a made-up value.

Caveats: GCP us-west2 is in Los Angeles, where much load is served by LADWP
rather than CAISO; we follow SOURCES.md and use US-CAL-CISO. AWS us-east-2
(Ohio, AEP) and GCP us-east5 (Columbus) are in PJM but not in its DOM zone,
whose prices the US-MIDA-PJM price series carries.
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
})


def grid_zone_for(provider: str, region: str) -> str | None:
    """Grid zone id (e.g. ``"US-MIDA-PJM"``) of cloud ``region`` of ``provider`` (``"aws"``/``"gcp"``).

    Returns ``None`` when the region has no bundled hourly grid data (callers
    skip and count such offers). Raises ``ValueError`` naming ``provider`` if
    it is not one of :data:`PROVIDERS`.
    """
    if provider not in PROVIDERS:
        raise ValueError(f"provider={provider!r}: expected one of {PROVIDERS}")
    row = REGION_GRID_ZONES.get((provider, region))
    return row.zone if row else None
