"""NvmlProbe against a stand-in for pynvml: v2 memory, NotSupported -> None, missing library named."""
from __future__ import annotations

import sys
import types

import pytest

from eagleflow.gpu.errors import NoGpuError
from eagleflow.gpu.nvml_probe import NvmlProbe

MIB = 1024 * 1024


def fake_pynvml(*, has_v2=True, init_error=None):
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    for n in ("NotSupported", "NoPermission", "FunctionNotFound", "NoData", "LibraryNotFound", "DriverNotLoaded"):
        setattr(nv, f"NVMLError_{n}", type(f"NVMLError_{n}", (NVMLError,), {}))
    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU = 0
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    nv.NVML_VOLATILE_ECC = 0
    if has_v2:
        nv.nvmlMemory_v2 = object()
    mem = types.SimpleNamespace
    proc = types.SimpleNamespace

    def init():
        if init_error:
            raise getattr(nv, f"NVMLError_{init_error}")()
    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA A100-SXM4-80GB"

    def meminfo(h, version=None):
        if version is not None and version is getattr(nv, "nvmlMemory_v2", None):
            return mem(total=81920 * MIB, used=8 * MIB, free=0, reserved=900 * MIB)
        if version is not None:
            raise TypeError("unknown version")
        return mem(total=81920 * MIB, used=908 * MIB, free=0)  # v1 counts reserved as used
    nv.nvmlDeviceGetMemoryInfo = meminfo
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=0 if h == 0 else 100, memory=0)
    nv.nvmlDeviceGetTemperature = lambda h, s: 33

    def power(h):
        if h == 1:
            raise nv.NVMLError_NotSupported()
        return 61234
    nv.nvmlDeviceGetPowerUsage = power

    def ecc(h, a, b):
        raise nv.NVMLError_NotSupported()
    nv.nvmlDeviceGetTotalEccErrors = ecc
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [proc(pid=999999, usedGpuMemory=None)] if h == 1 else []
    nv.nvmlSystemGetProcessName = lambda pid: b"/usr/bin/python3"
    return nv


def test_v2_memory_and_unsupported_readings(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    a, b = NvmlProbe("n1").snapshot()
    assert (a.uuid, a.name, a.memory_used_mib, a.memory_total_mib) == ("GPU-0", "NVIDIA A100-SXM4-80GB", 8, 81920)
    assert a.power_w == 61.23 and a.ecc_uncorrected is None and a.source == "nvml"
    assert b.power_w is None and b.utilization_pct == 100
    (p,) = b.processes
    assert p.pid == 999999 and p.used_mib is None and p.user is None  # PID not visible here: unknown, not guessed


def test_falls_back_to_v1_without_v2(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(has_v2=False))
    assert NvmlProbe().snapshot()[0].memory_used_mib == 908


@pytest.mark.parametrize("err,text", [("LibraryNotFound", r"NVML library \(libnvidia-ml.so.1\) not found"),
                                      ("DriverNotLoaded", "driver is not loaded")])
def test_no_driver_is_a_clear_no_gpu_error(monkeypatch, err, text):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=err))
    with pytest.raises(NoGpuError, match=text):
        NvmlProbe("cpu-box").snapshot()
