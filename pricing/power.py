"""GPU power model and specs: board power, idle power, memory, relative training speed.

``GPU_SPECS[canonical type] -> GpuSpec(tdp_w, idle_w, memory_gb, rel_throughput, source)``

* ``tdp_w`` — board power / TDP per GPU, W. Source per row (``source``): the
  bundled ``pricing/data/mlco2_impact_gpus.csv`` (mlco2/impact, MIT) where its
  row matches the cloud part, else the NVIDIA datasheet. Where they disagree
  the NVIDIA datasheet wins and the row says so (mlco2 lists V100-SXM2-16GB at
  250 W, but NVIDIA's V100 datasheet gives 300 W for SXM2 and 250 W for PCIe;
  cloud V100s are SXM2).
* ``idle_w`` — power drawn by an allocated GPU doing no work, W. An
  **approximation** from publicly reported ``nvidia-smi``/NVML readings of idle
  data-centre GPUs (tens of watts: ~10-20 W for 70-150 W cards, ~25-60 W for
  250-400 W cards, more for 700 W+ parts); not measured by us.
* ``memory_gb`` — memory per GPU, GB (datasheet).
* ``rel_throughput`` — approximate mixed-precision deep-learning **training**
  throughput relative to V100 = 1.0, rounded to 1-2 significant digits, from
  public benchmarks (Lambda Labs GPU benchmarks for PyTorch training, MLPerf
  Training results per accelerator, NVIDIA's generation-over-generation
  claims). It is workload-dependent; treat as a default that callers may
  override (``dataclasses.replace`` / their own table).

Power model: ``P(u) = idle_w + u x (tdp_w - idle_w)`` per GPU, u = average
utilisation in [0, 1]. ``DEFAULT_UTILISATION = 0.9``: an assumption for
data-parallel training, which keeps GPUs near full load apart from
data-loading/communication stalls.

``CLOUD_PUE``: data-centre power usage effectiveness per provider —
Google: fleet-wide trailing-twelve-month PUE ~1.10 (Google Environmental
Report 2023, 2022 data); AWS: global PUE ~1.15 (Amazon Sustainability Report
2023, 2023 data). Approximate and dated; one value per provider.

Errors: :class:`pricing.errors.UnknownGpuTypeError` (a ``ValueError``) names a
GPU name that maps to no canonical type; ``ValueError`` names a utilisation
outside [0, 1].
"""

from __future__ import annotations

import math
import functools
import re
from types import MappingProxyType
from typing import NamedTuple

from pricing.errors import UnknownGpuTypeError

__all__ = [
    "GpuSpec", "GPU_SPECS", "DEFAULT_UTILISATION", "CLOUD_PUE",
    "canonical_gpu_type", "gpu_spec", "gpu_power_w",
]


class GpuSpec(NamedTuple):
    """Per-GPU specs (see module docstring for units and sources)."""

    tdp_w: float
    idle_w: float
    memory_gb: float
    rel_throughput: float
    source: str


_MLCO2 = "mlco2_impact_gpus.csv"
GPU_SPECS: MappingProxyType[str, GpuSpec] = MappingProxyType({
    # K80 board = 2 GPUs, 300 W (mlco2 'Tesla K80' 300 W; NVIDIA K80 datasheet); clouds expose
    # each GK210 die (12 GB) as one GPU -> 150 W per GPU. No tensor cores.
    "K80": GpuSpec(150.0, 25.0, 12.0, 0.15, "NVIDIA Tesla K80 datasheet (300 W per 2-GPU board); mlco2 'Tesla K80'"),
    "P100": GpuSpec(250.0, 30.0, 16.0, 0.45, f"{_MLCO2} 'Tesla P100' (PCIe 16 GB, 250 W)"),
    "V100": GpuSpec(300.0, 40.0, 16.0, 1.0, "NVIDIA V100 datasheet: SXM2 300 W (mlco2 row says 250 W: PCIe value)"),
    "V100-32GB": GpuSpec(300.0, 40.0, 32.0, 1.0, f"{_MLCO2} 'Tesla V100-SXM2-32GB' 300 W; NVIDIA V100 datasheet"),
    "T4": GpuSpec(70.0, 10.0, 16.0, 0.3, f"{_MLCO2} 'T4' 70 W (NVIDIA T4 datasheet)"),
    "A10G": GpuSpec(150.0, 20.0, 24.0, 0.8, f"{_MLCO2} 'A10G' 150 W (techpowerup); 24 GB per AWS G5 docs"),
    "L4": GpuSpec(72.0, 15.0, 24.0, 0.5, f"{_MLCO2} 'L4' 72 W (NVIDIA L4 product brief)"),
    "L40S": GpuSpec(350.0, 35.0, 48.0, 1.6, f"{_MLCO2} 'L40S' 350 W (NVIDIA L40S datasheet)"),
    "A100": GpuSpec(400.0, 50.0, 40.0, 2.2, "NVIDIA A100 datasheet: SXM4 40 GB 400 W (mlco2 250 W row is PCIe)"),
    "A100-80GB": GpuSpec(400.0, 55.0, 80.0, 2.4, f"{_MLCO2} 'A100 SXM4 80 GB' 400 W"),
    "H100": GpuSpec(700.0, 70.0, 80.0, 4.0, f"{_MLCO2} 'H100 SXM' 700 W"),
    "H200": GpuSpec(700.0, 75.0, 141.0, 4.6, "NVIDIA H200 datasheet: SXM up to 700 W, 141 GB"),
    "B200": GpuSpec(1000.0, 120.0, 180.0, 8.0, "NVIDIA HGX B200 datasheet: up to 1000 W per GPU, 180 GB"),
})

DEFAULT_UTILISATION = 0.9
CLOUD_PUE: MappingProxyType[str, float] = MappingProxyType({"aws": 1.15, "gcp": 1.10})

# Base model token -> canonical type (memory suffix refines V100 / A100).
_BASES = ("K80", "P100", "V100", "T4", "A10G", "L4", "L40S", "A100", "H100", "H200", "B200")
_ALIASES = {"V100S": "V100", "H100-MEGA": "H100", "H100-SXM": "H100", "H100SXM": "H100"}
_MEM_RE = re.compile(r"^(\d+)GB?$")


@functools.lru_cache(maxsize=4096)
def canonical_or_same(name: str) -> str:
    """:func:`canonical_gpu_type` of ``name``, or ``name`` itself when no canonical type matches (a job may ask
    for a type no catalog knows: it then simply matches nothing). Cached: the planner calls it per job."""
    try:
        return canonical_gpu_type(name)
    except UnknownGpuTypeError:
        return name


def canonical_gpu_type(name: str) -> str:
    """Canonical GPU type for a catalog / trace / nvidia-smi spelling.

    Examples: ``"A100-80GB"`` -> ``"A100-80GB"``; ``"V100-32GB"`` -> ``"V100-32GB"``;
    ``"H100-MEGA"`` -> ``"H100"``; ``"nvidia-tesla-v100"`` -> ``"V100"``;
    ``"Tesla V100-SXM2-16GB"`` -> ``"V100"``; ``"v100"`` -> ``"V100"``;
    ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100-80GB"``.

    Raises :class:`UnknownGpuTypeError` naming ``name`` if no canonical type matches.
    """
    if not isinstance(name, str) or not name.strip():
        raise UnknownGpuTypeError(name, GPU_SPECS)
    s = re.sub(r"[\s_]+", "-", name.strip().upper())
    if s in GPU_SPECS:
        return s
    if s in _ALIASES:
        return _ALIASES[s]
    tokens = [t for t in s.split("-") if t and t not in ("NVIDIA", "TESLA")]
    base = next((_ALIASES.get(t, t) for t in tokens if _ALIASES.get(t, t) in _BASES), None)
    if base is None:
        raise UnknownGpuTypeError(name, GPU_SPECS)
    mem = [int(m.group(1)) for t in tokens if (m := _MEM_RE.match(t))]
    if base == "V100" and 32 in mem:
        return "V100-32GB"
    if base == "A100" and 80 in mem:
        return "A100-80GB"
    return base


def gpu_spec(gpu_type: str) -> GpuSpec:
    """:class:`GpuSpec` of ``gpu_type`` (any spelling :func:`canonical_gpu_type` accepts).

    Raises :class:`UnknownGpuTypeError`.
    """
    return GPU_SPECS[canonical_gpu_type(gpu_type)]


def gpu_power_w(gpu_type: str, utilisation: float = DEFAULT_UTILISATION) -> float:
    """Electrical power of ONE GPU, W: ``idle_w + utilisation x (tdp_w - idle_w)``.

    Args:
        gpu_type: any spelling accepted by :func:`canonical_gpu_type`.
        utilisation: average GPU utilisation, a fraction in [0, 1].

    Excludes host CPU/memory and PUE (multiply by PUE for facility power).
    Raises :class:`UnknownGpuTypeError` for an unknown type and ``ValueError``
    naming ``utilisation`` if it is not a finite number in [0, 1].
    """
    spec = gpu_spec(gpu_type)
    try:
        u = float(utilisation)
    except (TypeError, ValueError):
        raise ValueError(f"utilisation={utilisation!r}: must be a number in [0, 1]") from None
    if not math.isfinite(u) or not 0.0 <= u <= 1.0:
        raise ValueError(f"utilisation={utilisation!r}: must be in [0, 1]")
    return spec.idle_w + u * (spec.tdp_w - spec.idle_w)
