"""GPU inventory and telemetry of this node through NVML, or a deterministic fake.

``open_backend(kind) -> NvmlBackend``; ``backend.read() -> NodeInventory`` (one
:class:`GpuTelemetry` per GPU, one reading). The node agent heartbeats this
inventory; the broker uses :attr:`NodeInventory.healthy_indices`,
:attr:`NodeInventory.gpu_type` and :attr:`NodeInventory.gpu_memory_gb` for
placement, and the energy counters for metering.

Backends:

* :class:`PynvmlBackend` — the real NVML through the ``pynvml`` module of the
  ``nvidia-ml-py`` package (NVIDIA's official bindings). Units as NVML gives them,
  converted: memory bytes -> MiB (floor), power mW -> W, energy mJ (total since
  the driver was loaded, ``nvmlDeviceGetTotalEnergyConsumption``, Volta and
  newer), temperature of the GPU die, degrees C, utilisation % of time over
  NVML's last sample period, uncorrected ECC errors since the driver was loaded
  (volatile counter).
* :class:`FakeNvmlBackend` — for machines without GPUs (tests, the simulator,
  developer laptops): deterministic readings, an energy counter driven by a
  clock, and ``lose_gpu`` / ``restore_gpu`` to play a GPU falling off the bus.

Health: a query that NVML answers with ``NVMLError_NotSupported`` (or
``NVMLError_FunctionNotFound``: the installed driver predates the query) is a
missing value (``None``), not a fault. Any other NVML error on a device
(``NVMLError_GpuIsLost``, ``NVMLError_Unknown``, ...) marks that GPU
``healthy=False`` with ``error="<nvml function>: <NVML message>"``; the
remaining queries of that GPU are skipped, the other GPUs are still read, and
:meth:`PynvmlBackend.read` does not raise for it. A non-zero uncorrected ECC
count is reported, not judged here.

Errors::

    ValueError
     +-- NvmlUnavailable   NVML cannot be used at all (no pynvml, no driver,
                           nvmlInit / nvmlDeviceGetCount failed); carries the reason

Bad arguments raise ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from pricing.errors import UnknownGpuTypeError
from pricing.power import canonical_gpu_type

__all__ = [
    "GpuTelemetry", "NodeInventory", "NvmlBackend", "PynvmlBackend", "FakeNvmlBackend",
    "NvmlUnavailable", "open_backend", "gpu_type_of", "BACKEND_KINDS",
]

log = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "nvml", "fake")
_MIB = 1024 * 1024


class NvmlUnavailable(ValueError):
    """NVML cannot be used on this machine; the message says why (missing module, driver, init failure)."""


def gpu_type_of(name: str) -> str | None:
    """Canonical GPU type (:func:`pricing.power.canonical_gpu_type`) of an NVML device name, ``None`` if unknown.

    ``"Tesla V100-SXM2-16GB"`` -> ``"V100"``; ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100-80GB"``;
    ``"NVIDIA GeForce RTX 4090"`` -> ``None``. Never raises.
    """
    try:
        return canonical_gpu_type(name)
    except (UnknownGpuTypeError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class GpuTelemetry:
    """One GPU, one reading. ``None`` means the value is not available (not supported, or not read).

    ``index``: NVML device index (0-based, the ``CUDA_VISIBLE_DEVICES`` index when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); ``uuid``: ``"GPU-..."`` (``""`` if unreadable);
    ``name``: NVML product name (``""`` if unreadable); ``gpu_type``: canonical type
    or ``None``; ``memory_total_mib`` / ``memory_used_mib``: MiB; ``utilisation_pct``:
    0-100; ``power_w``: W; ``energy_mj``: mJ since driver load; ``temperature_c``: C;
    ``mig_mode``: MIG currently enabled; ``mig_instances``: MIG devices present
    (0 without MIG); ``ecc_uncorrected``: volatile uncorrected ECC error count;
    ``healthy``: ``False`` when NVML reported a fault, with the text in ``error``.
    """

    index: int
    uuid: str
    name: str
    gpu_type: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    utilisation_pct: float | None
    power_w: float | None
    energy_mj: int | None
    temperature_c: float | None
    mig_mode: bool | None
    mig_instances: int
    ecc_uncorrected: int | None
    healthy: bool
    error: str | None


@dataclass(frozen=True)
class NodeInventory:
    """All GPUs of this node, one reading each.

    ``gpus``: ordered by index; ``driver_version``: e.g. ``"550.54.15"``;
    ``cuda_driver_version``: NVML's integer, e.g. ``12040`` for CUDA 12.4;
    ``backend``: ``"nvml"`` or ``"fake"``.
    """

    gpus: tuple[GpuTelemetry, ...]
    driver_version: str | None
    cuda_driver_version: int | None
    backend: str

    @property
    def healthy_indices(self) -> tuple[int, ...]:
        """Indices of the healthy GPUs, ascending."""
        return tuple(sorted(g.index for g in self.gpus if g.healthy))

    @property
    def gpu_type(self) -> str | None:
        """The most common canonical type among healthy GPUs of known type (ties: lowest index first);
        ``None`` if there is none."""
        counts = Counter(g.gpu_type for g in sorted(self.gpus, key=lambda g: g.index)
                         if g.healthy and g.gpu_type is not None)
        return counts.most_common(1)[0][0] if counts else None

    @property
    def gpu_memory_gb(self) -> float:
        """Smallest total memory among healthy GPUs, GiB (MiB / 1024); ``0.0`` if no healthy GPU reports it."""
        mems = [g.memory_total_mib for g in self.gpus if g.healthy and g.memory_total_mib is not None]
        return min(mems) / 1024 if mems else 0.0

    def to_dict(self) -> dict:
        """JSON-safe dict: the fields (``gpus`` as a list of dicts) plus ``healthy_indices`` (list),
        ``gpu_type`` and ``gpu_memory_gb``."""
        return {
            "backend": self.backend,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "gpu_type": self.gpu_type,
            "gpu_memory_gb": self.gpu_memory_gb,
            "healthy_indices": list(self.healthy_indices),
            "gpus": [asdict(g) for g in self.gpus],
        }


@runtime_checkable
class NvmlBackend(Protocol):
    """Something that reads the node's GPUs: ``read() -> NodeInventory``."""

    def read(self) -> NodeInventory:
        """One reading of every GPU. Raises :class:`NvmlUnavailable` only if the node cannot be read at all."""
        ...


# --------------------------------------------------------------------------- real NVML

class _DeviceFault(Exception):
    """Internal: an NVML error that makes one GPU unhealthy."""


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class PynvmlBackend:
    """The real NVML. Calls ``nvmlInit`` once, in the constructor; :meth:`close` shuts it down.

    ``nvml``: the ``pynvml`` module, or a module-like object with the same
    functions, constants and exception classes (tests inject one); default:
    ``import pynvml``.

    Raises :class:`NvmlUnavailable` (with the reason) if ``pynvml`` cannot be
    imported or ``nvmlInit`` fails (no driver / ``libnvidia-ml.so.1``).
    """

    def __init__(self, nvml: Any = None):
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError as exc:
                raise NvmlUnavailable(f"the pynvml module is not installed (pip install nvidia-ml-py): {exc}") from exc
        self._nvml = nvml
        self._error = nvml.NVMLError
        self._unsupported = tuple(
            c for c in (getattr(nvml, "NVMLError_NotSupported", None), getattr(nvml, "NVMLError_FunctionNotFound", None))
            if c is not None
        )
        self._not_found = tuple(
            c for c in (getattr(nvml, "NVMLError_NotFound", None), getattr(nvml, "NVMLError_InvalidArgument", None))
            if c is not None
        )
        try:
            nvml.nvmlInit()
        except (self._error, OSError) as exc:
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from exc
        self._open = True

    def close(self) -> None:
        """``nvmlShutdown`` (once; later calls do nothing). Errors from NVML are ignored."""
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._error:
                pass

    def _q(self, fn: str, *args: Any) -> Any:
        """Call ``nvml.<fn>(*args)``: the value, ``None`` if unsupported; raises _DeviceFault otherwise."""
        try:
            return getattr(self._nvml, fn)(*args)
        except self._unsupported:
            return None
        except self._error as exc:
            raise _DeviceFault(f"{fn}: {exc}") from exc

    def read(self) -> NodeInventory:
        """One reading of every GPU (see the module docstring for units and health rules).

        Raises :class:`NvmlUnavailable` only if ``nvmlDeviceGetCount`` fails or the
        backend was closed; per-GPU faults never raise.
        """
        if not self._open:
            raise NvmlUnavailable("this PynvmlBackend was closed")
        nv = self._nvml
        try:
            count = int(nv.nvmlDeviceGetCount())
        except self._error as exc:
            raise NvmlUnavailable(f"nvmlDeviceGetCount failed: {exc}") from exc
        driver = self._system("nvmlSystemGetDriverVersion")
        cuda = self._system("nvmlSystemGetCudaDriverVersion")
        return NodeInventory(
            gpus=tuple(self._read_gpu(i) for i in range(count)),
            driver_version=None if driver is None else _text(driver),
            cuda_driver_version=None if cuda is None else int(cuda),
            backend="nvml",
        )

    def _system(self, fn: str) -> Any:
        try:
            return self._q(fn)
        except _DeviceFault as exc:
            log.warning("NVML system query failed: %s", exc)
            return None

    def _read_gpu(self, index: int) -> GpuTelemetry:
        nv = self._nvml
        f: dict[str, Any] = dict(
            index=index, uuid="", name="", gpu_type=None, memory_total_mib=None, memory_used_mib=None,
            utilisation_pct=None, power_w=None, energy_mj=None, temperature_c=None, mig_mode=None,
            mig_instances=0, ecc_uncorrected=None, healthy=True, error=None,
        )
        try:
            h = self._q("nvmlDeviceGetHandleByIndex", index)
            if h is None:
                raise _DeviceFault("nvmlDeviceGetHandleByIndex: not supported")
            uuid = self._q("nvmlDeviceGetUUID", h)
            f["uuid"] = "" if uuid is None else _text(uuid)
            name = self._q("nvmlDeviceGetName", h)
            f["name"] = "" if name is None else _text(name)
            f["gpu_type"] = gpu_type_of(f["name"])
            mem = self._q("nvmlDeviceGetMemoryInfo", h)
            if mem is not None:
                f["memory_total_mib"] = int(mem.total) // _MIB
                f["memory_used_mib"] = int(mem.used) // _MIB
            util = self._q("nvmlDeviceGetUtilizationRates", h)
            if util is not None:
                f["utilisation_pct"] = float(util.gpu)
            mw = self._q("nvmlDeviceGetPowerUsage", h)
            if mw is not None:
                f["power_w"] = int(mw) / 1000.0
            mj = self._q("nvmlDeviceGetTotalEnergyConsumption", h)
            if mj is not None:
                f["energy_mj"] = int(mj)
            temp = self._q("nvmlDeviceGetTemperature", h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
            if temp is not None:
                f["temperature_c"] = float(temp)
            ecc = self._q("nvmlDeviceGetTotalEccErrors", h,
                          getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), getattr(nv, "NVML_VOLATILE_ECC", 0))
            if ecc is not None:
                f["ecc_uncorrected"] = int(ecc)
            mig = self._q("nvmlDeviceGetMigMode", h)
            if mig is not None:
                f["mig_mode"] = int(mig[0]) == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
                if f["mig_mode"]:
                    f["mig_instances"] = self._count_mig(h)
        except _DeviceFault as exc:
            f["healthy"] = False
            f["error"] = str(exc)
        return GpuTelemetry(**f)

    def _count_mig(self, h: Any) -> int:
        slots = self._q("nvmlDeviceGetMaxMigDeviceCount", h) or 0
        n = 0
        for j in range(int(slots)):
            try:
                self._nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except self._not_found:
                continue  # no MIG device in this slot
            except self._unsupported:
                return n
            except self._error as exc:
                raise _DeviceFault(f"nvmlDeviceGetMigDeviceHandleByIndex: {exc}") from exc
            n += 1
        return n


# --------------------------------------------------------------------------- fake

def _finite(field: str, value: object, lo: float, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        rng = f"[{lo}, {hi}]" if math.isfinite(hi) else f">= {lo}"
        raise ValueError(f"{field} must be a finite number {rng}, got {value!r}")
    return float(value)


def _int(field: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{field} must be an int >= {lo}, got {value!r}")
    return value


class FakeNvmlBackend:
    """Deterministic stand-in for NVML on machines without GPUs.

    ``gpu_count`` GPUs (int >= 0) named ``gpu_name`` (non-empty str), each with
    ``memory_mib`` MiB (int >= 1) and a constant board power ``power_w`` W
    (>= 0, whatever the utilisation). ``seed`` (int >= 0) goes into the UUIDs
    (``f"GPU-{seed:08x}-fa4e-0000-0000-{index:012x}"``), so two fake nodes differ.
    ``clock``: seconds, monotonic (default ``time.monotonic``).

    Readings of GPU i: utilisation ``u`` % (0 until :meth:`set_utilisation`),
    ``memory_used_mib = round(memory_mib * u / 100)``, ``temperature_c = 35 + 0.4 u``,
    ``power_w``, no MIG, 0 ECC errors, driver ``"fake"``, CUDA ``None``.
    ``energy_mj`` starts at 0 at construction and grows by ``power_w x elapsed s
    x 1000`` while the GPU is not lost (10 s at 250 W = 2,500,000 mJ); rounded
    to the nearest mJ. A lost GPU (:meth:`lose_gpu`) reports ``healthy=False``,
    ``error`` as given, its index, uuid, name and type, and ``None`` for every
    reading; its counter stands still until :meth:`restore_gpu`.

    Raises ``ValueError`` naming the field for any argument out of range.
    Thread-safe.
    """

    def __init__(
        self,
        gpu_count: int = 4,
        gpu_name: str = "Tesla V100-SXM2-16GB",
        memory_mib: int = 16384,
        power_w: float = 250.0,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.gpu_count = _int("gpu_count", gpu_count, 0)
        if not isinstance(gpu_name, str) or not gpu_name.strip():
            raise ValueError(f"gpu_name must be a non-empty str, got {gpu_name!r}")
        self.gpu_name = gpu_name
        self.memory_mib = _int("memory_mib", memory_mib, 1)
        self.power_w = _finite("power_w", power_w, 0.0)
        self.seed = _int("seed", seed, 0)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self._clock = clock
        self._lock = threading.Lock()
        self._last = float(clock())
        self._energy_j = [0.0] * self.gpu_count
        self._util = [0.0] * self.gpu_count
        self._lost: dict[int, str] = {}

    def _check_index(self, index: object) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.gpu_count:
            raise ValueError(f"index must be an int in [0, {self.gpu_count - 1}], got {index!r}")
        return index

    def _advance(self) -> None:
        now = float(self._clock())
        dt = max(0.0, now - self._last)
        self._last = max(now, self._last)
        for i in range(self.gpu_count):
            if i not in self._lost:
                self._energy_j[i] += self.power_w * dt

    def uuid(self, index: int) -> str:
        """UUID of fake GPU ``index``. Raises ``ValueError`` naming ``index`` if out of range."""
        self._check_index(index)
        return f"GPU-{self.seed:08x}-fa4e-0000-0000-{index:012x}"

    def lose_gpu(self, index: int, error: str = "GPU is lost") -> None:
        """GPU ``index`` falls off the bus: unhealthy with ``error`` until :meth:`restore_gpu`.

        Raises ``ValueError`` naming ``index`` or ``error`` (non-empty str).
        """
        self._check_index(index)
        if not isinstance(error, str) or not error:
            raise ValueError(f"error must be a non-empty str, got {error!r}")
        with self._lock:
            self._advance()
            self._lost[index] = error

    def restore_gpu(self, index: int) -> None:
        """GPU ``index`` is back (healthy; its energy counter resumes). Raises ``ValueError`` naming ``index``."""
        self._check_index(index)
        with self._lock:
            self._advance()
            self._lost.pop(index, None)

    def set_utilisation(self, index: int, pct: float) -> None:
        """Set GPU ``index``'s utilisation, % in [0, 100]. Raises ``ValueError`` naming ``index`` or ``pct``."""
        self._check_index(index)
        pct = _finite("pct", pct, 0.0, 100.0)
        with self._lock:
            self._advance()
            self._util[index] = pct

    def read(self) -> NodeInventory:
        """One deterministic reading of every fake GPU (class docstring). Never raises."""
        gpu_type = gpu_type_of(self.gpu_name)
        with self._lock:
            self._advance()
            gpus = []
            for i in range(self.gpu_count):
                base = dict(index=i, uuid=self.uuid(i), name=self.gpu_name, gpu_type=gpu_type)
                if i in self._lost:
                    gpus.append(GpuTelemetry(
                        **base, memory_total_mib=None, memory_used_mib=None, utilisation_pct=None,
                        power_w=None, energy_mj=None, temperature_c=None, mig_mode=None, mig_instances=0,
                        ecc_uncorrected=None, healthy=False, error=self._lost[i]))
                    continue
                u = self._util[i]
                gpus.append(GpuTelemetry(
                    **base, memory_total_mib=self.memory_mib, memory_used_mib=round(self.memory_mib * u / 100),
                    utilisation_pct=u, power_w=self.power_w, energy_mj=round(self._energy_j[i] * 1000),
                    temperature_c=35.0 + 0.4 * u, mig_mode=False, mig_instances=0, ecc_uncorrected=0,
                    healthy=True, error=None))
        return NodeInventory(gpus=tuple(gpus), driver_version="fake", cuda_driver_version=None, backend="fake")


# --------------------------------------------------------------------------- factory

def open_backend(
    kind: str = "auto",
    fake_gpus: int = 4,
    fake_gpu_name: str = "Tesla V100-SXM2-16GB",
    *,
    nvml: Any = None,
) -> NvmlBackend:
    """The GPU backend of this node.

    ``kind``: ``"nvml"`` — :class:`PynvmlBackend`, raises :class:`NvmlUnavailable`
    if NVML cannot be initialised; ``"fake"`` — ``FakeNvmlBackend(fake_gpus,
    fake_gpu_name)``; ``"auto"`` — NVML if ``nvmlInit`` works, else the fake (logged
    as a warning with the reason; ``NodeInventory.backend`` says ``"fake"``).
    ``nvml``: a module-like NVML to use instead of ``pynvml`` (tests).

    Raises ``ValueError`` naming ``kind`` if it is not one of :data:`BACKEND_KINDS`,
    and the fake's ``ValueError`` for bad ``fake_gpus`` / ``fake_gpu_name``.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, BACKEND_KINDS))}, got {kind!r}")
    if kind == "fake":
        return FakeNvmlBackend(gpu_count=fake_gpus, gpu_name=fake_gpu_name)
    if kind == "nvml":
        return PynvmlBackend(nvml)
    try:
        return PynvmlBackend(nvml)
    except NvmlUnavailable as exc:
        log.warning("NVML unavailable (%s); using a fake backend with %s x %s", exc, fake_gpus, fake_gpu_name)
        return FakeNvmlBackend(gpu_count=fake_gpus, gpu_name=fake_gpu_name)
