"""Which probe reads a node's GPUs: ``probe_for(node, cfg)``.

NVML is the first choice where it loads (nvidia-smi's output format is not
guaranteed stable); nvidia-smi is the fallback and the only choice where the
node's Python has no nvidia-ml-py. On a remote node NVML runs there through
``eagleflow.gpu.node_report``.
"""
from __future__ import annotations

from typing import Protocol

from eagleflow.nodes import LocalNode, Node

from .errors import GpuProbeError, NoGpuError
from .nvml_probe import NvmlProbe
from .smi_probe import SmiProbe, read_node_report, snapshots_from_report
from .snapshot import GpuSnapshot
from .node_report import smi_report


class GpuProbe(Protocol):
    def snapshot(self) -> list[GpuSnapshot]: ...


class RemoteNvmlProbe:
    """NvmlProbe run on the node through node_report: one round trip."""

    def __init__(self, node: Node, timeout_s: float = 30.0):
        self.node = node
        self.timeout_s = timeout_s

    def snapshot(self) -> list[GpuSnapshot]:
        argv = [self.node.python, "-m", "eagleflow.gpu.node_report", "--probe", "nvml"]
        return snapshots_from_report(self.node.name, read_node_report(self.node, argv, self.timeout_s))


class AutoProbe:
    """NVML first; on the first NoGpuError from NVML, nvidia-smi from then on."""

    def __init__(self, nvml: GpuProbe, smi: GpuProbe):
        self.nvml: GpuProbe | None = nvml
        self.smi = smi
        self.nvml_error: str | None = None

    def snapshot(self) -> list[GpuSnapshot]:
        if self.nvml is not None:
            try:
                return self.nvml.snapshot()
            except NoGpuError as e:
                self.nvml_error = str(e)
                self.nvml = None
        try:
            return self.smi.snapshot()
        except NoGpuError as e:
            raise NoGpuError(f"{e} (NVML before it: {self.nvml_error})") from None


def probe_for(node: Node, cfg) -> GpuProbe:
    kind = cfg.gpu.probe
    local = isinstance(node, LocalNode)
    nvml: GpuProbe = NvmlProbe(node.name) if local else RemoteNvmlProbe(node)
    if kind == "nvml":
        return nvml
    # locally the helper would only add a process start: read /proc in-process instead
    smi = SmiProbe(node, helper=not local) if not local else _LocalSmiProbe(node)
    if kind == "smi":
        return smi
    return AutoProbe(nvml, smi)


class _LocalSmiProbe(SmiProbe):
    """nvidia-smi on this machine, users and states from this machine's /proc."""

    def snapshot(self) -> list[GpuSnapshot]:
        return snapshots_from_report(self.node.name, smi_report(self.nvidia_smi))
