"""Read this machine's GPUs through NVML (nvidia-ml-py, module ``pynvml``).

Memory comes from memory info v2 where the driver has it: "used" then matches
nvidia-smi, while v1 counts reserved memory as used (an idle A100 reads ~900 MB
under v1, ~8 MB under v2). A reading the GPU does not support is None.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import GpuProbeError, NoGpuError
from .process_info import describe_pid
from .snapshot import GpuProcess, GpuSnapshot

MIB = 1024 * 1024


def _nvml():
    try:
        import pynvml
    except ImportError:
        raise NoGpuError("the Python package nvidia-ml-py (module pynvml) is not installed; "
                         "pip install nvidia-ml-py, or use gpu.probe: smi") from None
    return pynvml


def _optional_errors(nv) -> tuple[type[BaseException], ...]:
    names = ("NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound", "NVMLError_NoData")
    return tuple(getattr(nv, n) for n in names if hasattr(nv, n))


class NvmlProbe:
    """In-process NVML on this machine. ``node_name`` is only for messages."""

    def __init__(self, node_name: str = "local"):
        self.node_name = node_name
        self._nv: Any = None  # the pynvml module once initialised (it ships no types)

    def _init(self):
        if self._nv is not None:
            return self._nv
        nv = _nvml()
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            if isinstance(e, getattr(nv, "NVMLError_LibraryNotFound", ())):
                raise NoGpuError(f"on node {self.node_name}: NVML library (libnvidia-ml.so.1) not found: no NVIDIA "
                                 f"driver here; install it, or set node.has_gpu: false for a CPU node") from None
            if isinstance(e, getattr(nv, "NVMLError_DriverNotLoaded", ())):
                raise NoGpuError(f"on node {self.node_name}: the NVIDIA driver is not loaded ({e}); "
                                 f"check `nvidia-smi` there") from None
            raise GpuProbeError(f"on node {self.node_name}: nvmlInit failed: {e}") from None
        self._nv = nv
        return nv

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception:
                pass
            self._nv = None

    def _maybe(self, fn: Callable[[], Any], what: str):
        """The reading, None when the GPU does not support it; other NVML errors are named and raised."""
        nv = self._nv
        try:
            return fn()
        except _optional_errors(nv):
            return None
        except nv.NVMLError as e:
            raise GpuProbeError(f"on node {self.node_name}: NVML {what} failed: {e}") from None

    def snapshot(self) -> list[GpuSnapshot]:
        nv = self._init()
        count = self._maybe(nv.nvmlDeviceGetCount, "device count") or 0
        out = []
        for i in range(count):
            h = self._maybe(lambda: nv.nvmlDeviceGetHandleByIndex(i), f"handle of GPU {i}")
            uuid = _text(self._maybe(lambda: nv.nvmlDeviceGetUUID(h), "UUID"))
            name = _text(self._maybe(lambda: nv.nvmlDeviceGetName(h), "name")) or "?"
            used, total = self._memory(h)
            util = self._maybe(lambda: nv.nvmlDeviceGetUtilizationRates(h), "utilization")
            temp = self._maybe(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), "temperature")
            power_mw = self._maybe(lambda: nv.nvmlDeviceGetPowerUsage(h), "power")
            ecc = self._maybe(lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC), "ECC count")
            out.append(GpuSnapshot(
                index=i, uuid=uuid, name=name, memory_used_mib=used, memory_total_mib=total,
                utilization_pct=None if util is None else int(util.gpu),
                temperature_c=None if temp is None else int(temp),
                power_w=None if power_mw is None else round(power_mw / 1000.0, 2),
                ecc_uncorrected=None if ecc is None else int(ecc),
                processes=tuple(self._processes(h)), source="nvml"))
        return out

    def _memory(self, h) -> tuple[int | None, int | None]:
        nv = self._nv
        info = None
        if hasattr(nv, "nvmlMemory_v2"):
            try:
                info = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            except (nv.NVMLError, TypeError):
                info = None  # driver without v2: fall back to v1 below
        if info is None:
            info = self._maybe(lambda: nv.nvmlDeviceGetMemoryInfo(h), "memory info")
        if info is None:
            return None, None
        return int(info.used) // MIB, int(info.total) // MIB

    def _processes(self, h) -> list[GpuProcess]:
        nv = self._nv
        procs = self._maybe(lambda: nv.nvmlDeviceGetComputeRunningProcesses(h), "compute processes") or []
        out = []
        for p in procs:
            mem = getattr(p, "usedGpuMemory", None)
            info = describe_pid(int(p.pid))
            name = None
            try:
                name = _text(nv.nvmlSystemGetProcessName(p.pid))
            except Exception:
                name = info.get("comm")
            out.append(GpuProcess(pid=int(p.pid), name=name or "?", used_mib=None if mem is None else int(mem) // MIB,
                                  user=info["user"], state=info["state"], pgid=info["pgid"], wchan=info["wchan"]))
        return out


def _text(v) -> str:
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else str(v)
