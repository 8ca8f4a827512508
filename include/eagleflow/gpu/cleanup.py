"""Stop what this run started on the node, and nothing else unless told to.

Runs ON the node (``eagleflow gpu free``), where it can signal and read /proc
directly. Every process we start is recorded by ``eagleflow.nodes.detach`` in
``<state_dir>/pids/<run_id>.<role>.json``: the state dir is the node's, shared
by every run on it. Each record of THIS run is stopped by the one stop of
``eagleflow.nodes.process_record`` (TERM, grace, KILL to what is proven ours:
the recorded leader with its start time, or group members carrying the
record's token; a stale record is reported and never signalled). A process
in uninterruptible sleep (D) ignores SIGKILL until it leaves the kernel: it is
reported with its wchan, not waited on forever.

Another run's records (the run named by the record's file name) are never
signalled without ``force``:
- a live job of another run (its record names a live process proven ours) is
  left running and reported as an ``OtherRunJob`` (run id, role, pid, user,
  command, record, whether it holds one of the selected GPUs); the GPU gate
  waits for it and refuses naming it (``FreeGpusOperator``);
- with ``force`` such a job is stopped only when the GPU reading shows it on
  one of the selected GPUs (two runs may share a node on different GPUs);
- a finished run's records are cleaned: a run is finished on this node when
  none of its records names a live process of ours (every leader gone or its
  PID now someone else's, no token-carrying member left). Cleaning is the one
  stop with nothing to signal: the record is removed, a record whose PID runs
  without the token is kept (``not_ours``). A dead record of a run that still
  has a live job is left to that run: its watch reads the exit code there.

A process we did not start is killed only with ``force``, only when it holds a
selected GPU, and only that PID (never its group).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Collection

from eagleflow.nodes.process_record import (ProcessRecord, StopResult, members, read_proc_state, record_run_id,
                                            scan_records, stop, stop_pid)
from eagleflow.protocol import OtherRunJob, path_component

from .process_info import user_of
from .snapshot import GpuProcess

StopOutcome = StopResult  # what one stop reports, recorded or foreign: the process_record shape


@dataclass
class CleanupReport:
    """What ``eagleflow gpu free`` answers (read by ``FreeGpusOperator`` through ``Node.run_json``)."""
    outcomes: list[StopResult] = field(default_factory=list)
    other_runs: list[OtherRunJob] = field(default_factory=list)   # other runs' live jobs, left running
    run_id: str = ""                                              # the run that asked

    @property
    def unkillable(self) -> list[StopResult]:
        return [o for o in self.outcomes if o.stuck]

    @property
    def left_running(self) -> list[StopResult]:
        return [o for o in self.outcomes if o.outcome == "left_running"]

    @property
    def other_runs_in_the_way(self) -> list[OtherRunJob]:
        """Other runs' live jobs on the selected GPUs, or on GPUs that were not read: what the gate waits for."""
        return [j for j in self.other_runs if j.on_selected_gpus is not False]

    def to_dict(self) -> dict:
        return {"outcomes": [asdict(o) for o in self.outcomes],
                "other_runs": [j.model_dump() for j in self.other_runs], "run_id": self.run_id}

    def message(self) -> str:
        lines = [o.describe() for o in self.outcomes]
        lines += [f"left running, another run's live job: {j.describe()}" for j in self.other_runs]
        if not lines:
            return "no recorded process and no process on the selected GPUs"
        return "\n".join(lines)


def free_recorded_processes(state_dir: str | Path, *, run_id: str, grace_s: float = 15.0, force: bool = False,
                            gpu_processes: list[GpuProcess] | None = None, kill_wait_s: float = 5.0,
                            log: Callable[[str], None] = print, keep_roles: Collection[str] = ()) -> CleanupReport:
    """Stop every recorded process of run ``run_id`` on this node; leave other runs' live jobs, named (module doc);
    then, with force, foreign PIDs on the selected GPUs. ``gpu_processes``: the processes on the selected GPUs,
    None when the GPUs were not read (then no other run's job is stopped, even with force). ``keep_roles``: this
    run's live processes of these roles are left running, named (a streaming run's store, its trainer beside the
    capture); they count as ours, so force never kills them either."""
    report = CleanupReport(run_id=run_id)
    ours: set[int] = set()
    recs, refused = scan_records(Path(state_dir) / "pids")
    for path, why in refused:   # a record file we cannot trust names nothing we may signal
        out = StopResult("refused", record=path, detail=f"{why}; nothing signalled")
        log(out.detail)
        report.outcomes.append(out)
    live: dict[str, list[int]] = {r.pid_file: members(r) for r in recs}
    runs_alive = {record_run_id(r) for r in recs if live[r.pid_file]}
    for rec in recs:
        owner = record_run_id(rec)
        mine = live[rec.pid_file]
        ours |= set(mine) | ({rec.pgid} if mine else set())  # a stale group id is not ours
        if owner == run_id and mine and rec.role in keep_roles:
            log(f"kept: this run's {rec.role} pid {rec.pid} (it outlives this gate: stopped by its own task)")
            continue
        if owner != run_id:
            if mine:
                _other_run_job(rec, owner, mine, report, force=force, gpu_processes=gpu_processes, grace_s=grace_s,
                               kill_wait_s=kill_wait_s, log=log)
                continue
            if owner in runs_alive:
                continue   # that run still runs here: its dead job's record is its watch's to read
        out = stop(rec, grace_s=grace_s, kill_wait_s=kill_wait_s)
        out.run_id = owner or ""
        if out.outcome in ("stale_record", "not_ours"):
            log(out.detail)
        elif owner != run_id:
            log(f"finished run {owner}: record {rec.pid_file} cleaned ({out.outcome}; nothing signalled)")
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


def _other_run_job(rec: ProcessRecord, owner: str | None, mine: list[int], report: CleanupReport, *, force: bool,
                   gpu_processes: list[GpuProcess] | None, grace_s: float, kill_wait_s: float,
                   log: Callable[[str], None]) -> None:
    """A live job of another run: named and left running; with force, stopped when it holds a selected GPU."""
    group = set(mine)
    on_gpu = None if gpu_processes is None else [g for g in gpu_processes if g.pid in group]
    mib = sum(g.used_mib or 0 for g in on_gpu) if on_gpu else None
    if force and on_gpu:
        out = stop(rec, grace_s=grace_s, kill_wait_s=kill_wait_s)
        out.run_id, out.gpu_mib = owner or "", mib
        log(f"FORCED: run {owner}'s {out.describe()}")
        report.outcomes.append(out)
        return
    job = OtherRunJob(run_id=_run_name(owner), role=rec.role, pid=rec.pid, user=rec.user or None,
                      command=rec.command, record=os.path.abspath(rec.pid_file),
                      on_selected_gpus=None if on_gpu is None else bool(on_gpu),
                      gpu_mib=mib)
    why = ("set gpu.force_free / --force to stop it" if job.on_selected_gpus
           else "not on the selected GPUs: left alone even with force" if job.on_selected_gpus is False
           else "the GPUs were not read: left alone even with force")
    log(f"left running, another run's live job: {job.describe()} (never stopped by this run; {why})")
    report.other_runs.append(job)


def _run_name(owner: str | None) -> str | None:
    try:
        return None if owner is None else path_component(owner)
    except ValueError:
        return None
