"""When is a GPU idle: memory at its idle baseline (plus a margin) and no compute process.

Utilisation is deliberately not a test: a hung kernel reads 100 %, a dead
server 0 %. The baseline is per UUID (``eagleflow gpu baseline`` records it)
because a display card carries Xorg's memory and a MIG slice ~13 MiB, while an
idle H100 shows 1 MiB.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagleflow import bounded_json

from .snapshot import GpuSnapshot


@dataclass(frozen=True)
class GpuVerdict:
    snapshot: GpuSnapshot
    idle: bool
    allowed_mib: int
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        s = self.snapshot
        used = "memory used n/a" if s.memory_used_mib is None else f"{s.memory_used_mib} MiB used"
        head = f"{s.label}: {used} (idle allows <= {self.allowed_mib} MiB)"
        if self.idle:
            return head + ", idle"
        lines = [head + ", NOT idle: " + "; ".join(self.reasons)]
        lines += [f"    process {p.describe()}" for p in s.processes]
        return "\n".join(lines)


@dataclass(frozen=True)
class IdleReport:
    node: str
    verdicts: tuple[GpuVerdict, ...] = field(default=())

    @property
    def all_idle(self) -> bool:
        return all(v.idle for v in self.verdicts)

    @property
    def busy(self) -> list[GpuVerdict]:
        return [v for v in self.verdicts if not v.idle]

    def message(self) -> str:
        if self.all_idle:
            return f"node {self.node}: all {len(self.verdicts)} selected GPU(s) idle"
        busy = self.busy
        return (f"node {self.node}: {len(busy)} of {len(self.verdicts)} selected GPU(s) not idle:\n"
                + "\n".join("  " + v.describe() for v in busy))

    def to_dict(self) -> dict:
        return {"node": self.node, "all_idle": self.all_idle,
                "gpus": [{"index": v.snapshot.index, "uuid": v.snapshot.uuid, "idle": v.idle,
                          "memory_used_mib": v.snapshot.memory_used_mib, "allowed_mib": v.allowed_mib,
                          "reasons": list(v.reasons), "processes": [p.__dict__ for p in v.snapshot.processes]}
                         for v in self.verdicts]}


class SelectionError(ValueError):
    pass


def select_gpus(snaps: list[GpuSnapshot], select: list[str], node: str = "?") -> list[GpuSnapshot]:
    """The GPUs named by UUID or index in ``gpu.select``; all when empty. Unknown names are an error."""
    if not select:
        return list(snaps)
    out: list[GpuSnapshot] = []
    for item in select:
        key = str(item).strip()
        match = [s for s in snaps if s.uuid == key or (key.isdigit() and s.index == int(key))]
        if not match:
            have = ", ".join(f"{s.index}={s.uuid}" for s in snaps) or "none"
            raise SelectionError(f"gpu.select names {key!r}, but node {node} has no such GPU (it has: {have}); "
                                 f"fix gpu.select in the config")
        out.extend(m for m in match if m not in out)
    return out


class IdlePolicy:
    def __init__(self, threshold_mib: int = 16, baselines: dict[str, int] | None = None):
        self.threshold_mib = threshold_mib
        self.baselines = dict(baselines or {})

    @classmethod
    def from_config(cls, cfg, baseline_text: str | None = None) -> "IdlePolicy":
        return cls(cfg.gpu.idle_threshold_mib, parse_baselines(baseline_text) if baseline_text else None)

    def allowed_mib(self, uuid: str) -> int:
        return self.baselines.get(uuid, 0) + self.threshold_mib

    def judge(self, snap: GpuSnapshot) -> GpuVerdict:
        allowed = self.allowed_mib(snap.uuid)
        reasons = []
        if snap.processes:
            reasons.append(f"{len(snap.processes)} compute process(es)")
        if snap.memory_used_mib is not None and snap.memory_used_mib > allowed:
            reasons.append(f"{snap.memory_used_mib} MiB used > {allowed} MiB")
        return GpuVerdict(snapshot=snap, idle=not reasons, allowed_mib=allowed, reasons=tuple(reasons))

    def evaluate(self, snaps: list[GpuSnapshot], select: list[str] | None = None, node: str = "?") -> IdleReport:
        chosen = select_gpus(snaps, list(select or []), node)
        return IdleReport(node=node, verdicts=tuple(self.judge(s) for s in chosen))


def baseline_document(snaps: list[GpuSnapshot], node: str) -> dict:
    """What ``eagleflow gpu baseline`` writes: memory used per UUID on a GPU with no process."""
    busy = [s for s in snaps if s.processes]
    if busy:
        raise ValueError(f"node {node}: cannot record an idle baseline while processes run on "
                         + ", ".join(f"{s.label} ({', '.join(str(p.pid) for p in s.processes)})" for s in busy)
                         + "; free the GPUs first (eagleflow gpu free)")
    return {"node": node, "recorded_at": time.time(),
            "gpus": {s.uuid: {"index": s.index, "name": s.name, "memory_used_mib": s.memory_used_mib or 0,
                              "memory_total_mib": s.memory_total_mib} for s in snaps}}


def parse_baselines(text: str, where: str = "baseline file") -> dict[str, int]:
    try:
        doc = bounded_json.loads(text, source=where)
        return {uuid: int(v["memory_used_mib"]) for uuid, v in doc["gpus"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where} is not a baseline written by `eagleflow gpu baseline` ({e}); "
                         f"record it again") from None
