"""Stop what this pipeline started on the node, and nothing else unless told to.

Runs ON the node (``eagleflow gpu free``), where it can signal and read /proc
directly. Every process we start is recorded by ``eagleflow.nodes.detach`` in
``<state_dir>/pids/*.json`` with its pid, process group and start time; a
record whose PID now belongs to another process (start time differs) is stale
and is never signalled. Ours get SIGTERM to their process group (children such
as DataLoader workers included), a grace period, then SIGKILL. A process in
uninterruptible sleep (D) ignores SIGKILL until it leaves the kernel: it is
reported with its wchan, not waited on forever. A process we did not start is
killed only with ``force``, and only when it holds a selected GPU.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eagleflow.nodes.proc import parse_stat, read_proc_state, read_start_ticks

from .process_info import user_of
from .snapshot import GpuProcess


@dataclass
class StopOutcome:
    pid: int
    role: str
    outcome: str          # terminated | killed | already_gone | stale_record | unkillable | survived | left_running
    user: str | None = None
    command: str = ""
    wchan: str | None = None
    record: str | None = None
    foreign: bool = False
    gpu_mib: int | None = None

    def describe(self) -> str:
        what = "foreign process" if self.foreign else f"{self.role}"
        wchan = f", waiting in kernel function {self.wchan}" if self.wchan else ""
        mem = f", {self.gpu_mib} MiB on GPU" if self.gpu_mib is not None else ""
        return f"{what} pid {self.pid} ({self.user or 'user ?'}, `{self.command}`{mem}): {self.outcome}{wchan}"


@dataclass
class CleanupReport:
    outcomes: list[StopOutcome] = field(default_factory=list)

    @property
    def unkillable(self) -> list[StopOutcome]:
        return [o for o in self.outcomes if o.outcome in ("unkillable", "survived")]

    @property
    def left_running(self) -> list[StopOutcome]:
        return [o for o in self.outcomes if o.outcome == "left_running"]

    def to_dict(self) -> dict:
        return {"outcomes": [asdict(o) for o in self.outcomes]}

    @classmethod
    def from_dict(cls, d: dict) -> "CleanupReport":
        return cls([StopOutcome(**o) for o in d.get("outcomes", [])])

    def message(self) -> str:
        if not self.outcomes:
            return "no recorded process and no process on the selected GPUs"
        return "\n".join(o.describe() for o in self.outcomes)


def _alive(pid: int) -> bool:
    """Exists and is not a zombie (a zombie holds no memory; its parent reaps it)."""
    st = read_proc_state(pid)
    return st is not None and not st.is_zombie


def group_members(pgid: int, proc_root: str = "/proc") -> list[int]:
    """Live PIDs whose process group is pgid (children may outlive the leader)."""
    out = []
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat") as f:
                _, state, rest = parse_stat(f.read())
        except (OSError, ValueError):
            continue
        if state != "Z" and len(rest) > 1 and int(rest[1]) == pgid:
            out.append(int(name))
    return out


def _wait_gone(pids: Callable[[], list[int]], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if not pids():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def terminate(pid: int, *, group: bool, grace_s: float, kill_wait_s: float = 5.0) -> tuple[str, str | None]:
    """SIGTERM, grace, SIGKILL. Returns (outcome, wchan when it is stuck in D)."""
    def remaining() -> list[int]:
        return group_members(pid) if group else ([pid] if _alive(pid) else [])

    if not remaining():
        return "already_gone", None
    _signal(pid, signal.SIGTERM, group)
    if _wait_gone(remaining, grace_s):
        return "terminated", None
    _signal(pid, signal.SIGKILL, group)
    if _wait_gone(remaining, kill_wait_s):
        return "killed", None
    for p in remaining():
        st = read_proc_state(p)
        if st is not None and st.in_d_state:
            return "unkillable", st.wchan or "?"
    return "survived", None


def read_records(pids_dir: str | Path) -> list[tuple[Path, dict]]:
    out = []
    d = Path(pids_dir)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):
            continue  # a half-written record cannot exist (detach renames); skip unreadable ones
    return out


def free_recorded_processes(state_dir: str | Path, *, grace_s: float = 15.0, force: bool = False,
                            gpu_processes: list[GpuProcess] | None = None, kill_wait_s: float = 5.0,
                            log: Callable[[str], None] = print) -> CleanupReport:
    """Stop every recorded process of this node; then, with force, foreign PIDs on the selected GPUs."""
    report = CleanupReport()
    our_groups: set[int] = set()
    for path, rec in read_records(Path(state_dir) / "pids"):
        pid, pgid = int(rec["pid"]), int(rec.get("pgid") or rec["pid"])
        role = rec.get("role", "?")
        command = " ".join(rec.get("argv") or [])[:200]
        ticks = read_start_ticks(pid)
        leader_is_ours = ticks is not None and (not rec.get("start_ticks") or ticks == rec["start_ticks"])
        if ticks is not None and not leader_is_ours:
            out = StopOutcome(pid, role, "stale_record", rec.get("user"), command, record=str(path))
            log(f"record {path.name}: pid {pid} now belongs to another process (start time differs); not signalled")
            path.unlink(missing_ok=True)
            report.outcomes.append(out)
            continue
        our_groups.add(pgid)
        group = pgid == pid  # detach starts a new session: the record's pid leads its group
        outcome, wchan = terminate(pid, group=group, grace_s=grace_s, kill_wait_s=kill_wait_s)
        out = StopOutcome(pid, role, outcome, rec.get("user"), command, wchan=wchan, record=str(path))
        log(f"recorded {out.describe()}")
        if outcome not in ("unkillable", "survived"):
            path.unlink(missing_ok=True)
        report.outcomes.append(out)

    seen: set[int] = set()
    for gp in gpu_processes or []:
        if gp.pid in seen or gp.pgid in our_groups or gp.pid in our_groups:
            continue
        seen.add(gp.pid)
        if not _alive(gp.pid):
            continue
        user = gp.user or user_of(gp.pid)
        if not force:
            out = StopOutcome(gp.pid, "foreign", "left_running", user, gp.name, foreign=True, gpu_mib=gp.used_mib)
            log(f"{out.describe()} (not started by eagleflow; set gpu.force_free / --force to kill it)")
        else:
            outcome, wchan = terminate(gp.pid, group=False, grace_s=grace_s, kill_wait_s=kill_wait_s)
            out = StopOutcome(gp.pid, "foreign", outcome, user, gp.name, wchan=wchan, foreign=True, gpu_mib=gp.used_mib)
            log(f"FORCED: {out.describe()}")
        report.outcomes.append(out)
    return report
