"""One reading of one GPU, keyed by UUID.

Indices differ between CUDA and nvidia-smi unless CUDA_DEVICE_ORDER=PCI_BUS_ID,
so every decision is made per UUID; the index is only for people. A reading the
hardware or driver does not support is ``None``, never 0: a 0 would read as
"idle" or "cold" and hide the fact that we do not know.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict, cast


class GpuProcessDict(TypedDict):
    """A ``GpuProcess`` as JSON (``GpuSnapshot.to_dict``)."""
    pid: int
    name: str
    used_mib: int | None
    user: str | None
    state: str | None
    pgid: int | None
    wchan: str | None


class GpuFields(TypedDict):
    """What a GPU reads as (None: not known, never 0), in a snapshot and in a node's status document alike."""
    index: int
    uuid: str
    name: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None
    temperature_c: int | None
    power_w: float | None
    ecc_uncorrected: int | None


class GpuSnapshotDict(GpuFields):
    """A ``GpuSnapshot`` as JSON: its fields, the processes as ``GpuProcessDict``."""
    processes: list[GpuProcessDict]
    source: str
    taken_at: float


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, as the driver lists it, plus what the node's /proc says."""
    pid: int
    name: str
    used_mib: int | None = None
    user: str | None = None          # from /proc on the node; None when it cannot tell (container)
    state: str | None = None         # R S D Z ... from /proc/<pid>/stat
    pgid: int | None = None
    wchan: str | None = None         # kernel function a D-state process waits in

    def describe(self) -> str:
        mem = f"{self.used_mib} MiB" if self.used_mib is not None else "memory n/a"
        user = self.user or "user ?"
        state = f", state {self.state}" if self.state else ""
        wchan = f" in {self.wchan}" if self.state == "D" and self.wchan else ""
        return f"pid {self.pid} ({user}, `{self.name}`, {mem}{state}{wchan})"


@dataclass(frozen=True)
class GpuSnapshot:
    index: int
    uuid: str
    name: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None
    processes: tuple[GpuProcess, ...] = field(default=())
    source: str = ""                 # "nvml" or "smi"
    taken_at: float = field(default_factory=time.time)

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    def to_dict(self) -> GpuSnapshotDict:
        d: dict[str, Any] = asdict(self)
        d["processes"] = [asdict(p) for p in self.processes]
        return cast(GpuSnapshotDict, d)

    @classmethod
    def from_dict(cls, d: GpuSnapshotDict) -> "GpuSnapshot":
        data: dict[str, Any] = dict(d)
        data["processes"] = tuple(GpuProcess(**p) for p in d.get("processes") or ())
        return cls(**data)


def snapshots_to_json(snaps: list[GpuSnapshot]) -> list[GpuSnapshotDict]:
    return [s.to_dict() for s in snaps]


def snapshots_from_json(data: list[GpuSnapshotDict]) -> list[GpuSnapshot]:
    return [GpuSnapshot.from_dict(d) for d in data]


def format_table(snaps: list[GpuSnapshot], node: str) -> str:
    """A compact table like nvidia-smi's: one line per GPU, then one per process."""
    def cell(v, unit=""):
        return "n/a" if v is None else f"{v}{unit}"
    lines = [f"node {node}: {len(snaps)} GPU(s)",
             f"{'idx':>3}  {'uuid':<40} {'name':<24} {'mem used/total':>18} {'util':>5} {'temp':>5} {'power':>8} {'ecc':>4}"]
    for s in snaps:
        mem = f"{cell(s.memory_used_mib)}/{cell(s.memory_total_mib)} MiB"
        power = "n/a" if s.power_w is None else f"{s.power_w:.0f} W"
        lines.append(f"{s.index:>3}  {s.uuid:<40} {s.name[:24]:<24} {mem:>18} {cell(s.utilization_pct, '%'):>5} "
                     f"{cell(s.temperature_c, 'C'):>5} {power:>8} {cell(s.ecc_uncorrected):>4}")
    procs = [(s, p) for s in snaps for p in s.processes]
    if procs:
        lines.append("processes:")
        for s, p in procs:
            lines.append(f"  GPU {s.index}: {p.describe()}")
    else:
        lines.append("processes: none")
    return "\n".join(lines)
