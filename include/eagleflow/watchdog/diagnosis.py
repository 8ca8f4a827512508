"""The watchdog's verdict on one job (an extraction shard or the trainer), with its evidence.

A verdict alone ("stalled") tells a person nothing they can act on. A
``StallDiagnosis`` carries every signal it was decided from, in numbers and
wall-clock times, and renders the one line an alert starts with, e.g.

    STALLED shard 3/8 on gpu-node-1: no sample completed for 612 s (18,402/37,312
    done, last at 14:02:11); server /health_generate timed out after 20 s; ...

followed by a GPU table. It round-trips through JSON so the node-side
``eagleflow watch --json`` can hand it to a trigger in one SSH call.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from eagleflow import bounded_json

Verdict = Literal["starting", "healthy", "slow", "stalled", "dead", "failed", "complete"]

# What the trigger yields for each verdict; None = keep watching.
VERDICT_STATUS: dict[str, str | None] = {
    "starting": None, "healthy": None, "slow": None,
    "stalled": "stalled", "dead": "dead", "failed": "failed", "complete": "complete",
}

# `eagleflow watch` exit codes (2 is taken by the CLI for config errors).
VERDICT_EXIT_CODE: dict[str, int] = {
    "complete": 0, "healthy": 0, "starting": 0, "slow": 3, "stalled": 4, "dead": 5, "failed": 6,
}


class StallDetected(Exception):
    """A watched job is stalled, dead or failed. A plain Exception: Airflow retries it."""

    def __init__(self, subject: str, diagnosis: str):
        super().__init__(subject, diagnosis)
        self.subject = subject
        self.diagnosis = diagnosis

    def __str__(self) -> str:
        return f"{self.subject}\n{self.diagnosis}"


@dataclass
class GpuRow:
    """One GPU as the watchdog saw it at its last look, plus its window summary."""
    index: int
    name: str = ""
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_pct: float | None = None
    held: bool = False          # memory above the idle baseline + margin
    max_util_window_pct: float | None = None  # highest utilisation seen over the window


@dataclass
class StallDiagnosis:
    verdict: Verdict
    job: str                    # "shard 3/8" or "training"
    node: str
    observed_at: float          # unix time of the observation
    headline: str               # the one-line summary after "VERDICT job on node: "
    evidence: list[str] = field(default_factory=list)   # each a phrase with numbers and times
    done: int = 0
    total: int = 0
    progress_age_s: float | None = None
    gpus: list[GpuRow] = field(default_factory=list)
    gpu_note: str = ""          # e.g. "not applicable: node.has_gpu is false"
    log_tail: list[str] = field(default_factory=list)
    # What the stall is blamed on, for incidents: "capture_server" (frozen, dead, hung /generate, idle GPUs),
    # "worker" (stopped, dead, D state, frozen heartbeat), "disk", "job" (its own error) or "" (not a stall).
    cause: str = ""
    recheck_in_s: float | None = None   # look again this soon: progress turns stale then
    stale_after_s: float | None = None  # the threshold progress was judged against (this run's pace)

    @property
    def status(self) -> str | None:
        return VERDICT_STATUS[self.verdict]

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT_CODE[self.verdict]

    @property
    def summary(self) -> str:
        """The one line: 'STALLED shard 3/8 on gpu-node-1: <headline>; <evidence>; ...'."""
        parts = [self.headline, *self.evidence]
        return f"{self.verdict.upper()} {self.job} on {self.node}: " + "; ".join(p for p in parts if p)

    @property
    def subject(self) -> str:
        return f"[eagleflow] {self.verdict.upper()} {self.job} on {self.node}"

    def gpu_table(self) -> str:
        if not self.gpus:
            return f"GPUs: {self.gpu_note or 'no reading'}"
        lines = [f"GPUs{' (' + self.gpu_note + ')' if self.gpu_note else ''}:",
                 "  idx  memory used / total      util now  max util in window  held"]
        for g in self.gpus:
            mem = (f"{_gb(g.memory_used_mib)} / {_gb(g.memory_total_mib)}"
                   if g.memory_used_mib is not None else "n/a")
            util = f"{g.utilization_pct:.0f} %" if g.utilization_pct is not None else "n/a"
            win = f"{g.max_util_window_pct:.0f} %" if g.max_util_window_pct is not None else "n/a"
            lines.append(f"  {g.index:>3}  {mem:<24} {util:>8}  {win:>18}  {'yes' if g.held else 'no'}")
        return "\n".join(lines)

    def render(self) -> str:
        """The full text: summary, GPU table, the last lines of the job's log."""
        out = [self.summary, "", self.gpu_table()]
        if self.log_tail:
            out += ["", "last lines of the job's log:", *("  " + line for line in self.log_tail)]
        return "\n".join(out)

    def event_payload(self) -> dict:
        """The TriggerEvent payload (see eagleflow.airflow.shard_watch)."""
        if self.verdict == "complete":
            return {"status": "complete", "summary": self.summary}
        return {"status": self.status, "verdict": self.verdict, "diagnosis": self.render(),
                "subject": self.subject, "cause": self.cause, "observed_at": self.observed_at,
                "job": self.job, "node": self.node, "done": self.done, "total": self.total}

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> "StallDiagnosis":
        data = dict(data)
        known = cls.__dataclass_fields__
        data = {k: v for k, v in data.items() if k in known}  # a newer node may say more
        data["gpus"] = [GpuRow(**g) for g in data.get("gpus", [])]
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "StallDiagnosis":
        return cls.from_dict(bounded_json.loads(text, source="stall diagnosis"))


def _gb(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib / 1024:.1f} GB"
