"""What can go wrong when reading GPUs, each with a message that says where and what to do."""
from __future__ import annotations


class GpuProbeError(RuntimeError):
    """A GPU reading failed; the message names the node, the tool and the cause."""


class NoGpuError(GpuProbeError):
    """The node has no usable GPU stack: no driver, no NVML library or no nvidia-smi."""


class SmiParseError(GpuProbeError):
    """An nvidia-smi line that does not have the expected shape; the message quotes it."""
