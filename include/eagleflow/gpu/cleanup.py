"""Stop what this pipeline started on the node, and nothing else unless told to.

Runs ON the node (``eagleflow gpu free``), where it can signal and read /proc
directly. Every process we start is recorded by ``eagleflow.nodes.detach`` in
``<state_dir>/pids/*.json``; each record is stopped by the one stop of
``eagleflow.nodes.process_record`` (TERM, grace, KILL to what is proven ours:
the recorded leader with its start time, or group members carrying the
record's token; a stale record is reported and never signalled). A process
in uninterruptible sleep (D) ignores SIGKILL until it leaves the kernel: it is
reported with its wchan, not waited on forever. A process we did not start is
killed only with ``force``, only when it holds a selected GPU, and only that
PID (never its group).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eagleflow.nodes.process_record import StopResult, members, read_proc_state, scan_records, stop, stop_pid

from .process_info import user_of
from .snapshot import GpuProcess

StopOutcome = StopResult  # what one stop reports, recorded or foreign: the process_record shape


@dataclass
class CleanupReport:
    outcomes: list[StopResult] = field(default_factory=list)

    @property
    def unkillable(self) -> list[StopResult]:
        return [o for o in self.outcomes if o.stuck]

    @property
    def left_running(self) -> list[StopResult]:
        return [o for o in self.outcomes if o.outcome == "left_running"]

    def to_dict(self) -> dict:
        return {"outcomes": [asdict(o) for o in self.outcomes]}

    def message(self) -> str:
        if not self.outcomes:
            return "no recorded process and no process on the selected GPUs"
        return "\n".join(o.describe() for o in self.outcomes)


def free_recorded_processes(state_dir: str | Path, *, grace_s: float = 15.0, force: bool = False,
                            gpu_processes: list[GpuProcess] | None = None, kill_wait_s: float = 5.0,
                            log: Callable[[str], None] = print) -> CleanupReport:
    """Stop every recorded process of this node; then, with force, foreign PIDs on the selected GPUs."""
    report = CleanupReport()
    ours: set[int] = set()
    recs, refused = scan_records(Path(state_dir) / "pids")
    for path, why in refused:   # a record file we cannot trust names nothing we may signal
        out = StopResult("refused", record=path, detail=f"{why}; nothing signalled")
        log(out.detail)
        report.outcomes.append(out)
    for rec in recs:
        mine = members(rec)
        ours |= set(mine) | ({rec.pgid} if mine else set())  # a stale group id is not ours
        out = stop(rec, grace_s=grace_s, kill_wait_s=kill_wait_s)
        if out.outcome in ("stale_record", "not_ours"):
            log(out.detail)
        else:
            log(f"recorded {out.describe()}" + (f" ({out.detail.split('; ', 1)[1]})" if out.left_alone else ""))
        report.outcomes.append(out)

    seen: set[int] = set()
    for gp in gpu_processes or []:
        if gp.pid in seen or gp.pid in ours or (gp.pgid is not None and gp.pgid in ours):
            continue
        seen.add(gp.pid)
        st = read_proc_state(gp.pid)
        if st is None or not st.alive:
            continue
        user = gp.user or user_of(gp.pid)
        if not force:
            out = StopResult("left_running", pid=gp.pid, role="foreign", user=user, command=gp.name, foreign=True,
                             gpu_mib=gp.used_mib)
            log(f"{out.describe()} (not started by eagleflow; set gpu.force_free / --force to kill it)")
        else:
            outcome, wchan = stop_pid(gp.pid, grace_s=grace_s, kill_wait_s=kill_wait_s)
            out = StopResult(outcome, pid=gp.pid, role="foreign", user=user, command=gp.name, wchan=wchan,
                             foreign=True, gpu_mib=gp.used_mib)
            log(f"FORCED: {out.describe()}")
        report.outcomes.append(out)
    return report
