"""A priced cloud option and its market: :class:`CloudOffer`, :class:`Market`, :data:`MIN_BILLED_S`.

The offer model lives with the prices (:mod:`pricing.catalog` builds offers from the bundled
catalogs); :mod:`broker.model` re-exports it for the planner, the service and users.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Market", "CloudOffer", "MIN_BILLED_S"]

#: Minimum billed seconds per instance. AWS: per-second billing with a 60-s
#: minimum for Linux On-Demand and Spot (EC2 pricing page, "Per Second
#: Billing"); GCP: per-second billing with a 1-minute minimum for VMs and GPUs
#: (Compute Engine "VM instance pricing" / billing model).
MIN_BILLED_S = 60.0


class Market(str, Enum):
    """Cloud purchase market."""

    spot = "spot"
    on_demand = "on_demand"


class CloudOffer(BaseModel):
    """A priced cloud option: one instance type in one zone and market.

    Fields:
        provider: ``"aws"`` or ``"gcp"``.
        region, zone: provider region and zone.
        instance_type: e.g. ``p3.2xlarge`` or ``a2-highgpu-1g``.
        gpu_type: canonical GPU type (``V100``, ``A100``, ``A100-80GB``, ``H100``, ``L4``, ``T4`` ...).
        gpu_count: GPUs per instance.
        gpu_memory_gb: memory per GPU, GB.
        market: spot or on-demand.
        usd_per_hour: price of one instance, USD/hour.
        carbon_zone: grid zone of the region (see ``pricing.regions``).
        provisioning_delay_s: expected seconds from create call to a running container.
        pue: data-centre PUE used for energy.
        interruption_rate_per_hour: expected spot interruptions per instance-hour (0 for on-demand).
        min_billed_s: minimum billed seconds per instance (per-second billing after it;
            default :data:`MIN_BILLED_S`).
        carbon_estimated: True when the region's carbon figure is an estimate (an annual figure, or
            an hourly series partly copied from another year; :func:`pricing.carbon.carbon_estimated`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["aws", "gcp"]
    region: str
    zone: str
    instance_type: str
    gpu_type: str
    gpu_count: int = Field(ge=1, le=16)
    gpu_memory_gb: float = Field(gt=0)
    market: Market
    usd_per_hour: float = Field(gt=0)
    carbon_zone: str
    provisioning_delay_s: float = Field(300.0, ge=0)
    pue: float = Field(1.1, ge=1.0, le=3.0)
    interruption_rate_per_hour: float = Field(0.0, ge=0)
    min_billed_s: float = Field(MIN_BILLED_S, ge=0)
    carbon_estimated: bool = False

    @property
    def offer_id(self) -> str:
        """Stable id ``provider:zone:instance_type:market``."""
        return f"{self.provider}:{self.zone}:{self.instance_type}:{self.market.value}"
