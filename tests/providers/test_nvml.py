"""providers.nvml: the real-NVML backend against a fake pynvml module, the fake backend, open_backend."""

from __future__ import annotations

import ctypes.util
import json
import logging
from types import SimpleNamespace

import pynvml
import pytest

from providers.nvml import (
    FakeNvmlBackend, GpuTelemetry, NodeInventory, NvmlBackend, NvmlUnavailable, PynvmlBackend,
    gpu_type_of, open_backend,
)

MIB = 1024 * 1024


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class FakePynvml:
    """A module-like NVML: the real pynvml exception classes and constants, canned per-device answers.

    ``devices``: list of dicts of query name -> value, or an exception *instance* to raise.
    """

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(self, devices, init_error=None, driver=b"550.54.15", cuda=12040):
        self.devices = devices
        self.init_error = init_error
        self.driver, self.cuda = driver, cuda
        self.calls: list[str] = []
        self.init_calls = 0
        self.shutdown_calls = 0

    def _answer(self, index, query, *args):
        self.calls.append(f"{query}[{index}]")
        v = self.devices[index][query]
        if isinstance(v, BaseException):
            raise v
        return v(*args) if callable(v) else v

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda

    def nvmlDeviceGetHandleByIndex(self, i):
        h = self.devices[i].get("handle", ("h", i))
        if isinstance(h, BaseException):
            raise h
        return h

    def nvmlDeviceGetUUID(self, h): return self._answer(h[1], "uuid")
    def nvmlDeviceGetName(self, h): return self._answer(h[1], "name")
    def nvmlDeviceGetMemoryInfo(self, h): return self._answer(h[1], "memory")
    def nvmlDeviceGetUtilizationRates(self, h): return self._answer(h[1], "util")
    def nvmlDeviceGetPowerUsage(self, h): return self._answer(h[1], "power_mw")
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return self._answer(h[1], "energy_mj")

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._answer(h[1], "temp")

    def nvmlDeviceGetTotalEccErrors(self, h, etype, counter):
        assert (etype, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._answer(h[1], "ecc")

    def nvmlDeviceGetMigMode(self, h): return self._answer(h[1], "mig_mode")
    def nvmlDeviceGetMaxMigDeviceCount(self, h): return self._answer(h[1], "mig_max")

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if j in self.devices[h[1]]["mig_present"]:
            return ("mig", h[1], j)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


def healthy_device(**over):
    d = dict(
        uuid="GPU-11111111-2222-3333-4444-555555555555", name="NVIDIA A100-SXM4-80GB",
        memory=SimpleNamespace(total=81920 * MIB, used=1024 * MIB + 5, free=0),
        util=SimpleNamespace(gpu=87, memory=40), power_mw=312456, energy_mj=123456789, temp=61, ecc=0,
        mig_mode=[0, 0], mig_max=7, mig_present=(),
    )
    d.update(over)
    return d


def nvml_err(code):
    return pynvml.NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass


def test_pynvml_backend_reads_units_mig_lost_gpu_and_not_supported():
    nv = FakePynvml([
        healthy_device(mig_mode=[1, 1], mig_present=(0, 3)),
        healthy_device(uuid="GPU-lost", name="NVIDIA A100-SXM4-80GB", memory=nvml_err(pynvml.NVML_ERROR_GPU_IS_LOST)),
        healthy_device(uuid=b"GPU-old-bytes", name=b"Tesla V100-SXM2-16GB",
                       memory=SimpleNamespace(total=16384 * MIB, used=0),
                       power_mw=nvml_err(pynvml.NVML_ERROR_NOT_SUPPORTED),
                       energy_mj=pynvml.NVMLError_FunctionNotFound(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
                       mig_mode=nvml_err(pynvml.NVML_ERROR_NOT_SUPPORTED), ecc=3),
        healthy_device(handle=nvml_err(pynvml.NVML_ERROR_UNKNOWN)),
    ])
    assert isinstance(nv.devices[1]["memory"], pynvml.NVMLError_GpuIsLost)
    backend = PynvmlBackend(nvml=nv)
    assert isinstance(backend, NvmlBackend)
    inv = backend.read()
    assert inv.gpus[0] == GpuTelemetry(
        index=0, uuid="GPU-11111111-2222-3333-4444-555555555555", name="NVIDIA A100-SXM4-80GB",
        gpu_type="A100-80GB", memory_total_mib=81920, memory_used_mib=1024, utilisation_pct=87.0,
        power_w=312.456, energy_mj=123456789, temperature_c=61.0, mig_mode=True, mig_instances=2,
        ecc_uncorrected=0, healthy=True, error=None,
    )
    assert inv.gpus[1] == GpuTelemetry(
        index=1, uuid="GPU-lost", name="NVIDIA A100-SXM4-80GB", gpu_type="A100-80GB",
        memory_total_mib=None, memory_used_mib=None, utilisation_pct=None, power_w=None, energy_mj=None,
        temperature_c=None, mig_mode=None, mig_instances=0, ecc_uncorrected=None,
        healthy=False, error="nvmlDeviceGetMemoryInfo: GPU is lost",
    )
    assert "util[1]" not in nv.calls  # a lost GPU is not queried further
    assert inv.gpus[2] == GpuTelemetry(
        index=2, uuid="GPU-old-bytes", name="Tesla V100-SXM2-16GB", gpu_type="V100",
        memory_total_mib=16384, memory_used_mib=0, utilisation_pct=87.0, power_w=None, energy_mj=None,
        temperature_c=61.0, mig_mode=None, mig_instances=0, ecc_uncorrected=3, healthy=True, error=None,
    )
    assert inv.gpus[3] == GpuTelemetry(
        index=3, uuid="", name="", gpu_type=None, memory_total_mib=None, memory_used_mib=None,
        utilisation_pct=None, power_w=None, energy_mj=None, temperature_c=None, mig_mode=None,
        mig_instances=0, ecc_uncorrected=None, healthy=False, error="nvmlDeviceGetHandleByIndex: Unknown Error",
    )
    assert (inv.backend, inv.driver_version, inv.cuda_driver_version) == ("nvml", "550.54.15", 12040)
    assert inv.healthy_indices == (0, 2)
    assert inv.gpu_type == "A100-80GB"  # tie 1-1 among healthy GPUs: lowest index first
    assert inv.gpu_memory_gb == 16.0
    d = inv.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert (d["healthy_indices"], d["gpu_type"], d["gpu_memory_gb"], len(d["gpus"])) == ([0, 2], "A100-80GB", 16.0, 4)
    assert d["gpus"][1]["error"] == "nvmlDeviceGetMemoryInfo: GPU is lost"
    assert nv.init_calls == 1
    backend.read()
    assert nv.init_calls == 1  # nvmlInit once
    backend.close()
    backend.close()
    assert nv.shutdown_calls == 1
    with pytest.raises(NvmlUnavailable, match="closed"):
        backend.read()


def test_pynvml_backend_init_failure_is_nvml_unavailable():
    nv = FakePynvml([], init_error=nvml_err(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NvmlUnavailable, match="^nvmlInit failed: NVML Shared Library Not Found$"):
        PynvmlBackend(nvml=nv)
    assert issubclass(NvmlUnavailable, ValueError)


def test_real_pynvml_without_driver_is_unavailable():
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(NvmlUnavailable, match="nvmlInit failed"):
        PynvmlBackend()
    with pytest.raises(NvmlUnavailable):
        open_backend("nvml")


def test_fake_energy_counter_follows_the_clock():
    clock = FakeClock()
    fake = FakeNvmlBackend(clock=clock)
    inv = fake.read()
    assert [g.energy_mj for g in inv.gpus] == [0, 0, 0, 0]
    clock.advance(10.0)
    inv = fake.read()
    assert [g.energy_mj for g in inv.gpus] == [2_500_000] * 4
    assert inv.gpus[0] == GpuTelemetry(
        index=0, uuid="GPU-00000000-fa4e-0000-0000-000000000000", name="Tesla V100-SXM2-16GB", gpu_type="V100",
        memory_total_mib=16384, memory_used_mib=0, utilisation_pct=0.0, power_w=250.0, energy_mj=2_500_000,
        temperature_c=35.0, mig_mode=False, mig_instances=0, ecc_uncorrected=0, healthy=True, error=None,
    )
    assert (inv.backend, inv.driver_version, inv.cuda_driver_version) == ("fake", "fake", None)
    assert (inv.healthy_indices, inv.gpu_type, inv.gpu_memory_gb) == ((0, 1, 2, 3), "V100", 16.0)
    clock.advance(0.25)
    assert fake.read().gpus[3].energy_mj == 2_562_500


def test_fake_gpu_lost_mid_run_then_restored():
    clock = FakeClock()
    fake = FakeNvmlBackend(gpu_count=2, clock=clock, seed=7)
    clock.advance(4.0)
    fake.lose_gpu(1)
    clock.advance(6.0)
    inv = fake.read()
    assert inv.healthy_indices == (0,)
    assert inv.gpus[1] == GpuTelemetry(
        index=1, uuid="GPU-00000007-fa4e-0000-0000-000000000001", name="Tesla V100-SXM2-16GB", gpu_type="V100",
        memory_total_mib=None, memory_used_mib=None, utilisation_pct=None, power_w=None, energy_mj=None,
        temperature_c=None, mig_mode=None, mig_instances=0, ecc_uncorrected=None, healthy=False, error="GPU is lost",
    )
    assert inv.gpus[0].energy_mj == 2_500_000
    fake.lose_gpu(0, error="Unknown Error")
    assert fake.read().gpus[0].error == "Unknown Error"
    assert fake.read().healthy_indices == ()
    assert fake.read().gpu_memory_gb == 0.0 and fake.read().gpu_type is None
    fake.restore_gpu(1)
    clock.advance(2.0)
    g1 = fake.read().gpus[1]
    assert (g1.healthy, g1.error, g1.energy_mj) == (True, None, 1_500_000)  # 4 s + 2 s at 250 W


def test_fake_utilisation_and_determinism():
    clock = FakeClock()
    a = FakeNvmlBackend(gpu_count=3, gpu_name="NVIDIA A100-SXM4-80GB", memory_mib=81920, power_w=400.0, clock=clock)
    b = FakeNvmlBackend(gpu_count=3, gpu_name="NVIDIA A100-SXM4-80GB", memory_mib=81920, power_w=400.0, clock=clock)
    a.set_utilisation(2, 50)
    g = a.read().gpus[2]
    assert (g.utilisation_pct, g.memory_used_mib, g.temperature_c, g.gpu_type) == (50.0, 40960, 55.0, "A100-80GB")
    b.set_utilisation(2, 50)
    assert a.read() == b.read()
    assert a.read().gpu_memory_gb == 80.0
    assert FakeNvmlBackend(seed=1).uuid(0) != FakeNvmlBackend(seed=2).uuid(0)
    assert FakeNvmlBackend(gpu_count=0).read().gpus == ()


def test_fake_bad_input_names_field_and_value():
    with pytest.raises(ValueError, match="gpu_count must be an int >= 0, got -1"):
        FakeNvmlBackend(gpu_count=-1)
    with pytest.raises(ValueError, match="memory_mib must be an int >= 1, got 0"):
        FakeNvmlBackend(memory_mib=0)
    with pytest.raises(ValueError, match="power_w must be a finite number >= 0.0, got nan"):
        FakeNvmlBackend(power_w=float("nan"))
    with pytest.raises(ValueError, match="gpu_name must be a non-empty str, got ''"):
        FakeNvmlBackend(gpu_name="")
    fake = FakeNvmlBackend(gpu_count=2)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 1\], got 2"):
        fake.lose_gpu(2)
    with pytest.raises(ValueError, match=r"pct must be a finite number \[0.0, 100.0\], got 101"):
        fake.set_utilisation(0, 101)


def test_unknown_gpu_name_has_no_type():
    assert gpu_type_of("NVIDIA GeForce RTX 4090") is None
    assert gpu_type_of("NVIDIA H200") == "H200"
    inv = FakeNvmlBackend(gpu_count=1, gpu_name="NVIDIA GeForce RTX 4090").read()
    assert (inv.gpus[0].gpu_type, inv.gpu_type, inv.healthy_indices) == (None, None, (0,))


def test_open_backend_kinds(caplog):
    fake = open_backend("fake", fake_gpus=2, fake_gpu_name="Tesla T4")
    assert isinstance(fake, FakeNvmlBackend)
    inv = fake.read()
    assert (len(inv.gpus), inv.gpu_type) == (2, "T4")
    working = FakePynvml([healthy_device()])
    assert isinstance(open_backend("auto", nvml=working), PynvmlBackend)
    assert isinstance(open_backend("nvml", nvml=working), PynvmlBackend)
    broken = FakePynvml([], init_error=nvml_err(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    with caplog.at_level(logging.WARNING, logger="providers.nvml"):
        auto = open_backend("auto", fake_gpus=3, nvml=broken)
    assert isinstance(auto, FakeNvmlBackend) and auto.read().backend == "fake" and auto.gpu_count == 3
    assert "NVML unavailable (nvmlInit failed: Driver Not Loaded)" in caplog.text
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        open_backend("nvml", nvml=broken)
    with pytest.raises(ValueError, match="kind must be one of 'auto', 'nvml', 'fake', got 'cuda'"):
        open_backend("cuda")


def test_node_inventory_type_is_most_common_among_healthy():
    def g(i, t, healthy=True, mem=16384):
        return GpuTelemetry(i, f"u{i}", t or "x", t, mem, 0, 0.0, None, None, None, None, 0, None, healthy,
                            None if healthy else "GPU is lost")
    inv = NodeInventory((g(0, "T4"), g(1, "V100"), g(2, "V100", mem=32768), g(3, "T4", False), g(4, None)),
                        None, None, "nvml")
    assert (inv.gpu_type, inv.healthy_indices, inv.gpu_memory_gb) == ("V100", (0, 1, 2, 4), 16.0)
