"""GPU state on a node: snapshots, probes (NVML, nvidia-smi), the idle policy, safe cleanup.

Nothing here imports Airflow: it runs on a GPU node under the CLI, in tests,
and behind the operators in ``eagleflow.airflow.gpu_operators``.
"""
from .errors import GpuProbeError, NoGpuError, SmiParseError
from .idle_policy import IdlePolicy, IdleReport
from .probes import probe_for
from .snapshot import GpuProcess, GpuSnapshot
from .cleanup import free_recorded_processes as _free

__all__ = ["GpuProbeError", "NoGpuError", "SmiParseError", "IdlePolicy", "IdleReport", "probe_for",
           "GpuProcess", "GpuSnapshot", "free_recorded_processes"]


def free_recorded_processes(*args, **kwargs):
    """See ``eagleflow.gpu.cleanup.free_recorded_processes`` (imported lazily: it reads /proc)."""
    return _free(*args, **kwargs)
