"""Priced cloud GPU offers (AWS, GCP) from the bundled SkyPilot-schema catalogs.

``load_offers(providers, markets) -> OfferCatalog(offers, skipped)``.

AWS (``aws_gpu_vms_skypilot_catalog_v9_subset.csv``, SkyPilot catalog v9, build
date unknown): one offer per (instance type, availability zone, market).
``zone`` is the AWS zone ID (e.g. ``use1-az2``) as in the catalog; on-demand
``Price`` is per region, ``SpotPrice`` a single per-zone snapshot, USD/hour
(in 37 of 208 rows the catalog's spot price equals on-demand; kept as given).

GCP (``gcp_gpu_vms_skypilot_schema_anycloud_2026-05-20.csv.gz``, 2026-05-20
snapshot): SkyPilot convention — a VM row holds the host price only and an
accelerator row (empty ``InstanceType``) the GPUs' price only; an instance
costs VM row + accelerator row in the same zone and market
(:func:`combine_gcp_price`).

* a2/a3/a4/g2 VMs have fixed GPUs (:data:`GCP_FIXED_GPU_VMS`).
* n1 VMs take attachable V100/T4/P100/P4 GPUs on a host of the n1-standard or
  n1-highmem family (:data:`GCP_N1_HOST_FAMILIES`) with at least SkyPilot's
  vCPUs for that GPU and count (:data:`GCP_N1_MIN_HOST_VCPUS`) and at most GCP's
  vCPU/memory limit (:data:`GCP_N1_HOST_LIMITS`). Per (zone, GPU, count,
  market) we offer the cheapest such host (:func:`gcp_n1_hosts`) and name the
  offer ``"<host>+<GPU>x<count>"`` (e.g. ``n1-highmem-8+T4x1``).
* **Caveat** (``pricing/data/SOURCES.md``): the H100 accelerator rows look wrong
  — a3-highgpu-8g prices at 9.46006 + 33.60609 = 43.07 USD/h against
  88.49 USD/h in Cyclenerd's GCP price list. H100 offers on GCP are kept as
  the catalog gives them; treat their prices with caution.

Per offer: ``gpu_type`` from :func:`pricing.power.canonical_gpu_type`,
``gpu_memory_gb`` from :data:`pricing.power.GPU_SPECS`, ``carbon_zone`` from
:func:`pricing.regions.grid_zone_for` and ``carbon_estimated`` from
:func:`pricing.carbon.carbon_estimated`, ``pue`` from :data:`pricing.power.CLOUD_PUE`,
``provisioning_delay_s`` from :data:`PROVISIONING_DELAY_S`, ``min_billed_s`` =
60 (:data:`MIN_BILLED_S`), and for spot ``interruption_rate_per_hour`` from the
bundled spot traces (:func:`spot_interruption_rate`); on-demand 0.

Offers that cannot be priced or placed are counted in ``skipped`` by reason
(:data:`SKIP_REASONS`), never given a made-up value.

Errors: ``ValueError`` naming the argument for an unknown provider or market.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Iterable

import pandas as pd

from pricing._data import data_path
from pricing.carbon import carbon_estimated
from pricing.errors import UnknownGpuTypeError
from pricing.offers import MIN_BILLED_S, CloudOffer, Market
from pricing.power import CLOUD_PUE, GPU_SPECS, canonical_gpu_type
from pricing.regions import PROVIDERS, grid_zone_for
from pricing.spot import SpotTrace, load_spot_traces, pooled_interruption_rate

__all__ = [
    "OfferCatalog", "load_offers", "combine_gcp_price", "gcp_instance_price", "gcp_offer_parts", "gcp_host_shape",
    "spot_interruption_rate",
    "GCP_FIXED_GPU_VMS", "GCP_N1_HOST_FAMILIES", "GCP_N1_MIN_HOST_VCPUS", "GCP_N1_HOST_LIMITS", "gcp_n1_hosts",
    "PROVISIONING_DELAY_S", "MIN_BILLED_S", "SKIP_REASONS",
    "AWS_CATALOG_FILE", "GCP_CATALOG_FILE",
]

AWS_CATALOG_FILE = "aws_gpu_vms_skypilot_catalog_v9_subset.csv"
GCP_CATALOG_FILE = "gcp_gpu_vms_skypilot_schema_anycloud_2026-05-20.csv.gz"

#: Seconds from create call to a running container. Assumption: GPU VM boot to
#: SSH-ready is typically 1-3 min on both clouds (SkyPilot/dstack users report
#: minutes) plus pulling a multi-GB NCCL training image; we use 5 min for both
#: providers since no bundled measurement tells them apart.
PROVISIONING_DELAY_S: MappingProxyType[str, float] = MappingProxyType({"aws": 300.0, "gcp": 300.0})

#: Fixed-GPU GCP machine families: instance type -> (catalog accelerator name, count).
GCP_FIXED_GPU_VMS: MappingProxyType[str, tuple[str, int]] = MappingProxyType({
    **{f"a2-highgpu-{n}g": ("A100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("A100", 16),
    **{f"a2-ultragpu-{n}g": ("A100-80GB", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": ("H100", n) for n in (1, 2, 4, 8)},
    "a3-edgegpu-8g": ("H100", 8),
    "a3-edgegpu-8g-nolssd": ("H100", 8),
    "a3-megagpu-8g": ("H100-MEGA", 8),
    "a3-ultragpu-8g": ("H200", 8),
    "a3-ultragpu-8g-nolssd": ("H200", 8),
    "a4-highgpu-8g": ("B200", 8),
    # G2: one L4 per 4-32 vCPU shape, then 2/4/8 (Compute Engine GPU machine types)
    **{f"g2-standard-{c}": ("L4", 1) for c in (4, 8, 12, 16, 32)},
    "g2-standard-24": ("L4", 2),
    "g2-standard-48": ("L4", 4),
    "g2-standard-96": ("L4", 8),
})

#: Machine families whose VMs take attachable GPUs (Compute Engine "GPU machine types": N1 + GPUs).
GCP_N1_HOST_FAMILIES = ("n1-standard", "n1-highmem")
#: GPU -> GPU count -> fewest host vCPUs we offer (GCP itself allows 1): SkyPilot's host size per GPU
#: count (``_NUM_ACC_TO_NUM_CPU`` of its GCP catalog, "based on the AWS setting": p3 for V100, g4dn for
#: T4, 8 per GPU otherwise; 4 x T4: 48 rounded down to a power of two, as SkyPilot does for N1).
GCP_N1_MIN_HOST_VCPUS: MappingProxyType[str, MappingProxyType[int, int]] = MappingProxyType({
    "T4": MappingProxyType({1: 4, 2: 8, 4: 32}),
    "P4": MappingProxyType({1: 8, 2: 16, 4: 32}),
    "V100": MappingProxyType({1: 8, 2: 16, 4: 32, 8: 64}),
    "P100": MappingProxyType({1: 8, 2: 16, 4: 32}),
})
#: GPU -> GPU count -> (max vCPUs, max memory GB) of an N1 host (Compute Engine "GPU machine types",
#: N1 table, as also in SkyPilot's ``_NUM_ACC_TO_MAX_CPU_AND_MEMORY``; P100 x4: the 64-vCPU/208-GB
#: limit of the zones where it is lowest, so that it holds in every zone).
GCP_N1_HOST_LIMITS: MappingProxyType[str, MappingProxyType[int, tuple[int, float]]] = MappingProxyType({
    "T4": MappingProxyType({1: (48, 312.0), 2: (48, 312.0), 4: (96, 624.0)}),
    "P4": MappingProxyType({1: (24, 156.0), 2: (48, 312.0), 4: (96, 624.0)}),
    "V100": MappingProxyType({1: (12, 78.0), 2: (24, 156.0), 4: (48, 312.0), 8: (96, 624.0)}),
    "P100": MappingProxyType({1: (16, 104.0), 2: (32, 208.0), 4: (64, 208.0)}),
})


def gcp_n1_hosts(accelerator: str, count: int, hosts: Iterable[tuple[str, float, float]]) -> list[str]:
    """Host types among ``hosts`` (``(instance type, vCPUs, memory GB)`` rows) that may carry ``count`` x
    ``accelerator``: family in :data:`GCP_N1_HOST_FAMILIES`, vCPUs at least :data:`GCP_N1_MIN_HOST_VCPUS`
    and vCPUs/memory within :data:`GCP_N1_HOST_LIMITS`. Empty for a GPU/count GCP does not attach to N1."""
    lim = GCP_N1_HOST_LIMITS.get(accelerator, {}).get(count)
    min_cpu = GCP_N1_MIN_HOST_VCPUS.get(accelerator, {}).get(count)
    if lim is None or min_cpu is None:
        return []
    max_cpu, max_mem = lim
    return [t for t, cpu, mem in hosts
            if t.rsplit("-", 1)[0] in GCP_N1_HOST_FAMILIES and min_cpu <= cpu <= max_cpu and mem <= max_mem]


SKIP_REASONS = (
    "no grid zone for region",
    "unknown GPU type",
    "missing price",
    "no matching GCP VM/accelerator row",
)


@dataclass
class OfferCatalog:
    """Offers plus what was left out.

    Attributes:
        offers: priced offers (USD/hour per instance).
        skipped: reason -> number of (instance type, zone, market) candidates
            left out; reasons are those of :data:`SKIP_REASONS`.
    """

    offers: list[CloudOffer] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[tuple[str, str, str], int]:
        """Number of offers by ``(provider, market, gpu_type)``."""
        return dict(Counter((o.provider, o.market.value, o.gpu_type) for o in self.offers))


def combine_gcp_price(vm_price: float | None, accelerator_price: float | None) -> float:
    """GCP instance price, USD/hour = host VM row price + accelerator row price (SkyPilot convention).

    Returns ``NaN`` if either part is missing (``None``/``NaN``): the sum is
    then unknown, never the known half alone.
    """
    parts = [float("nan") if p is None else float(p) for p in (vm_price, accelerator_price)]
    if any(math.isnan(p) for p in parts):
        return float("nan")
    return parts[0] + parts[1]


@lru_cache(maxsize=1)
def _gcp_frame() -> pd.DataFrame:
    g = pd.read_csv(data_path(GCP_CATALOG_FILE))
    g["InstanceType"] = g["InstanceType"].fillna("")
    g["AcceleratorName"] = g["AcceleratorName"].fillna("")
    return g


def _price_col(market: Market | str) -> str:
    m = Market(market)
    return "SpotPrice" if m is Market.spot else "Price"


def gcp_offer_parts(instance_type: str) -> tuple[str, str, int]:
    """(host VM type, catalog accelerator name, GPU count) of a GCP offer instance type: ``a2-highgpu-1g`` ->
    ``("a2-highgpu-1g", "A100", 1)``, ``n1-standard-8+V100x1`` -> ``("n1-standard-8", "V100", 1)``.
    Raises ``ValueError`` naming ``instance_type`` if it is neither form."""
    if instance_type in GCP_FIXED_GPU_VMS:
        acc, n = GCP_FIXED_GPU_VMS[instance_type]
        return instance_type, acc, n
    m = re.fullmatch(r"(n1-[a-z]+-\d+)\+(.+)x(\d+)", instance_type)
    if m:
        return m.group(1), m.group(2), int(m.group(3))
    raise ValueError(f"instance_type={instance_type!r}: not a GCP GPU instance type this catalog prices")


def gcp_instance_price(instance_type: str, zone: str, market: Market | str, frame: pd.DataFrame | None = None) -> float:
    """USD/hour of GCP ``instance_type`` in ``zone`` for ``market``: VM row + accelerator row.

    ``instance_type`` is a fixed-GPU type (``a2-highgpu-1g``) or an n1 offer name
    (``n1-standard-8+V100x1``). ``frame`` defaults to the bundled catalog.
    Returns ``NaN`` if either row or its price is missing. Raises ``ValueError``
    naming ``instance_type``/``market`` if unrecognised.
    """
    g = _gcp_frame() if frame is None else frame
    col = _price_col(market)
    host, acc, n = gcp_offer_parts(instance_type)
    vm = g[(g["InstanceType"] == host) & (g["AvailabilityZone"] == zone)]
    ac = g[(g["InstanceType"] == "") & (g["AcceleratorName"] == acc)
           & (g["AcceleratorCount"] == n) & (g["AvailabilityZone"] == zone)]
    if vm.empty or ac.empty:
        return float("nan")
    return combine_gcp_price(vm[col].iloc[0], ac[col].iloc[0])


def gcp_host_shape(host: str) -> tuple[float, float]:
    """(vCPUs, memory GiB) of GCP VM type ``host`` (``n1-standard-8``) as the bundled catalog gives it.

    Raises ``ValueError`` naming ``host`` when the catalog has no row of it."""
    g = _gcp_frame()
    rows = g[g["InstanceType"] == host]
    if rows.empty:
        raise ValueError(f"host={host!r}: no GCP VM row of that type in {GCP_CATALOG_FILE}")
    return float(rows["vCPUs"].iloc[0]), float(rows["MemoryGiB"].iloc[0])


@lru_cache(maxsize=1)
def _spot_traces() -> tuple[SpotTrace, ...]:
    return tuple(load_spot_traces())


@lru_cache(maxsize=None)
def spot_interruption_rate(gpu_type: str, gpu_count: int = 1) -> float:
    """Expected spot interruptions per instance-hour for ``gpu_count`` x ``gpu_type``.

    From the bundled AWS 1-node availability traces (drops per available
    hour, pooled: total drops / total available hours): traces of the same
    canonical GPU type and GPUs per instance if any; else the same GPU type;
    else all traces pooled (the traces only cover V100 and K80, AWS only, so
    every other GPU type, and every GCP offer, gets the V100/K80 figure).
    These are availability probes — a 1->0 step means a new spot request
    would fail, which we use as the interruption rate of a held instance.
    """
    traces = _spot_traces()
    gt = canonical_gpu_type(gpu_type)
    same = [t for t in traces if canonical_gpu_type(t.accelerator) == gt]
    exact = [t for t in same if t.count == gpu_count]
    return pooled_interruption_rate(exact or same or list(traces))


def _check(providers: Iterable[str], markets: Iterable[Market | str]) -> tuple[tuple[str, ...], tuple[Market, ...]]:
    ps = tuple(providers)
    for p in ps:
        if p not in PROVIDERS:
            raise ValueError(f"providers: unknown provider {p!r}; expected among {PROVIDERS}")
    ms = []
    for m in markets:
        try:
            ms.append(Market(m))
        except ValueError:
            raise ValueError(f"markets: unknown market {m!r}; expected among {[x.value for x in Market]}") from None
    return ps, tuple(ms)


def _offer(provider: str, region: str, zone: str, itype: str, gpu: str, n: int, market: Market,
           price: float, carbon_zone: str) -> CloudOffer:
    return CloudOffer(
        provider=provider, region=region, zone=zone, instance_type=itype, gpu_type=gpu, gpu_count=n,
        gpu_memory_gb=GPU_SPECS[gpu].memory_gb, market=market, usd_per_hour=price, carbon_zone=carbon_zone,
        provisioning_delay_s=PROVISIONING_DELAY_S[provider], pue=CLOUD_PUE[provider],
        interruption_rate_per_hour=spot_interruption_rate(gpu, n) if market is Market.spot else 0.0,
        min_billed_s=MIN_BILLED_S, carbon_estimated=carbon_estimated(carbon_zone),
    )


def _add(cat: OfferCatalog, skipped: Counter, provider: str, region: str, zone: str, itype: str,
         acc_name: str, n: int, market: Market, price: float) -> None:
    cz = grid_zone_for(provider, region)
    if cz is None:
        skipped["no grid zone for region"] += 1
        return
    try:
        gpu = canonical_gpu_type(acc_name)
    except UnknownGpuTypeError:
        skipped["unknown GPU type"] += 1
        return
    if price is None or not math.isfinite(price) or price <= 0:
        skipped["missing price"] += 1
        return
    cat.offers.append(_offer(provider, region, zone, itype, gpu, n, market, float(price), cz))


def _aws(cat: OfferCatalog, skipped: Counter, markets: tuple[Market, ...]) -> None:
    a = pd.read_csv(data_path(AWS_CATALOG_FILE))
    for r in a.itertuples(index=False):
        for m in markets:
            price = r.SpotPrice if m is Market.spot else r.Price
            _add(cat, skipped, "aws", r.Region, r.AvailabilityZone, r.InstanceType, r.AcceleratorName,
                 int(r.AcceleratorCount), m, float(price))


def _gcp(cat: OfferCatalog, skipped: Counter, markets: tuple[Market, ...]) -> None:
    g = _gcp_frame()
    acc = g[g["InstanceType"] == ""]
    vm = g[g["InstanceType"] != ""]
    acc_idx = {(r.AcceleratorName, int(r.AcceleratorCount), r.AvailabilityZone): r for r in acc.itertuples(index=False)}
    vm_idx = {(r.InstanceType, r.AvailabilityZone): r for r in vm.itertuples(index=False)}
    # 1) fixed-GPU families: every a2/a3/a4/g2 VM row
    for r in vm.itertuples(index=False):
        if r.InstanceType.startswith("n1-"):
            continue
        if r.InstanceType not in GCP_FIXED_GPU_VMS:
            skipped["no matching GCP VM/accelerator row"] += len(markets)
            continue
        acc_name, n = GCP_FIXED_GPU_VMS[r.InstanceType]
        ar = acc_idx.get((acc_name, n, r.AvailabilityZone))
        for m in markets:
            if ar is None:
                skipped["no matching GCP VM/accelerator row"] += 1
                continue
            col = _price_col(m)
            _add(cat, skipped, "gcp", r.Region, r.AvailabilityZone, r.InstanceType, acc_name, n, m,
                 combine_gcp_price(getattr(r, col), getattr(ar, col)))
    # 2) n1 + attachable GPUs: per (zone, GPU, count, market) the cheapest allowed host
    n1 = vm[vm["InstanceType"].str.rsplit("-", n=1).str[0].isin(GCP_N1_HOST_FAMILIES)]
    hosts_by_zone: dict[str, list] = {}
    for r in n1.itertuples(index=False):
        hosts_by_zone.setdefault(r.AvailabilityZone, []).append(r)
    for r in acc.itertuples(index=False):
        if r.AcceleratorName not in GCP_N1_HOST_LIMITS:
            continue  # priced through the fixed-GPU VM rows above
        n = int(r.AcceleratorCount)
        zone_hosts = {h.InstanceType: h for h in hosts_by_zone.get(r.AvailabilityZone, [])}
        allowed = gcp_n1_hosts(r.AcceleratorName, n,
                               ((h.InstanceType, float(h.vCPUs), float(h.MemoryGiB)) for h in zone_hosts.values()))
        for m in markets:
            col = _price_col(m)
            priced = [(combine_gcp_price(getattr(zone_hosts[t], col), getattr(r, col)), t) for t in allowed]
            priced = [(p, t) for p, t in priced if math.isfinite(p)]
            if not priced:
                skipped["no matching GCP VM/accelerator row"] += 1
                continue
            price, host = min(priced)
            _add(cat, skipped, "gcp", r.Region, r.AvailabilityZone, f"{host}+{r.AcceleratorName}x{n}",
                 r.AcceleratorName, n, m, price)


def load_offers(providers: Iterable[str] = ("aws", "gcp"),
                markets: Iterable[Market | str] = ("spot", "on_demand")) -> OfferCatalog:
    """All priced GPU offers of ``providers`` in ``markets`` from the bundled catalogs.

    Args:
        providers: subset of ``("aws", "gcp")``.
        markets: subset of ``("spot", "on_demand")`` (strings or :class:`Market`).

    Returns:
        :class:`OfferCatalog`: ``offers`` (``CloudOffer``, ``usd_per_hour`` per
        instance) in catalog order, and ``skipped`` reason -> count.
    Raises ``ValueError`` naming an unknown provider or market.
    """
    ps, ms = _check(providers, markets)
    cat = OfferCatalog()
    skipped: Counter = Counter()
    if "aws" in ps:
        _aws(cat, skipped, ms)
    if "gcp" in ps:
        _gcp(cat, skipped, ms)
    cat.skipped = dict(skipped)
    return cat
