"""Reading /proc: the one place eagleflow parses a process's state (``ProcState``).

Everything that asks "does this PID still run, is it ours, is it stopped, a
zombie, stuck in D, how did it end" reads it here: ``read_stat`` (one read of
``/proc/<pid>/stat``: cheap enough to scan every PID), ``read_proc_state``
(that plus the D-state threads and the wchan, for a diagnosis) or
``group_cpu_ticks`` (the CPU time each member of a process group has used:
what tells a slow process from a frozen one, judged across two reads).

``comm`` (field 2 of /proc/<pid>/stat) may hold spaces and parentheses, so the
fields are split after the last ')'. Standard library only: it runs on the
node with whatever interpreter the node has.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

# /proc/<pid>/stat fields, numbered as in proc(5); the list after the state starts at field 4
_PPID, _PGRP, _STARTTIME, _EXIT_CODE = 4, 5, 22, 52
# CPU time in clock ticks: its own (user, system) and that of its children it has reaped (user, system)
_UTIME, _STIME, _CUTIME, _CSTIME = 14, 15, 16, 17


@dataclass(frozen=True)
class ProcState:
    pid: int
    comm: str
    state: str                 # R S D Z T t X ...
    start_ticks: int           # field 22: tells a process from a later one with the same PID
    d_state_threads: tuple[int, ...] = field(default=())  # tids in D (uninterruptible); read_proc_state only
    wchan: str | None = None   # read_proc_state only
    pgid: int = 0              # field 5
    exit_code: int | None = None    # a zombie's, from field 52 (Linux >= 3.5); None while it runs
    exit_signal: int | None = None  # the signal that killed a zombie
    ppid: int = 0              # field 4: the parent
    cpu_ticks: int = 0         # fields 14-17: CPU time used (user + system, its own and its reaped children's),
                               # in clock ticks (``clock_ticks_per_s``); only ever grows while the process lives

    @property
    def alive(self) -> bool:
        """Runs (or sleeps, or is stopped): not a zombie waiting to be reaped, not dead."""
        return self.state not in ("Z", "X")

    @property
    def zombie(self) -> bool:
        return self.state == "Z"

    @property
    def stopped(self) -> bool:
        """SIGSTOP (T) or stopped by a tracer (t): alive, but does nothing until SIGCONT."""
        return self.state in ("T", "t")

    @property
    def in_d_state(self) -> bool:
        return self.state == "D" or bool(self.d_state_threads)


def state_phrase(state: str | None) -> str:
    """Why a process that should be working is not, from its state letter (None: no such process): the one
    wording for the watch's diagnoses and its skipped health checks. '' while it runs (or sleeps)."""
    if state is None or state == "X":
        return "gone"
    if state == "Z":
        return "a zombie (exited, not yet reaped)"
    if state in ("T", "t"):
        return f"stopped (state {state}: SIGSTOP, Ctrl-Z or a debugger)"
    return ""


def parse_stat(text: str) -> tuple[str, str, list[str]]:
    """(comm, state, fields after state) from a /proc/<pid>/stat line."""
    lpar = text.index("(")
    rpar = text.rindex(")")
    comm = text[lpar + 1:rpar]
    rest = text[rpar + 2:].split()
    return comm, rest[0], rest[1:]


def _field(rest: list[str], n: int) -> int:
    return int(rest[n - 4])


def read_stat(pid: int, proc_root: str = "/proc") -> ProcState | None:
    """The PID's state, process group, start time and (a zombie's) exit status; None when it does not exist."""
    try:
        with open(f"{proc_root}/{pid}/stat") as f:
            comm, state, rest = parse_stat(f.read())
        st = ProcState(pid=pid, comm=comm, state=state, start_ticks=_field(rest, _STARTTIME),
                       pgid=_field(rest, _PGRP), ppid=_field(rest, _PPID),
                       cpu_ticks=sum(_field(rest, n) for n in (_UTIME, _STIME, _CUTIME, _CSTIME)))
    except (OSError, ValueError, IndexError):
        return None
    if st.zombie:
        try:
            status = _field(rest, _EXIT_CODE)   # the wait status: low 7 bits the signal, else code << 8
        except (ValueError, IndexError):
            return st
        return replace(st, exit_signal=status & 0x7F) if status & 0x7F else replace(st, exit_code=status >> 8)
    return st


def clock_ticks_per_s() -> int:
    """The unit of /proc's CPU times (USER_HZ, 100 on Linux)."""
    try:
        hz = os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100
    return hz if hz > 0 else 100


GROUP_MEMBERS_MAX = 4096   # a group larger than this is read in part (its first members by PID)


def group_cpu_ticks(pgid: int, proc_root: str = "/proc") -> dict[str, int]:
    """The CPU ticks each live member of process group ``pgid`` has used so far, keyed "<pid>:<start_ticks>" (a
    PID reused by a later process is another key). Zombies and vanished members are left out: whoever compares
    two reads compares member by member, so a member that exits takes nothing away from the group's progress.
    Empty when no member runs (or /proc cannot be read)."""
    out: dict[str, int] = {}
    if pgid <= 1:
        return out
    try:
        names = sorted((int(n) for n in os.listdir(proc_root) if n.isdigit()))
    except OSError:
        return out
    for pid in names:
        st = read_stat(pid, proc_root)
        if st is not None and st.pgid == pgid and st.alive:
            out[f"{pid}:{st.start_ticks}"] = st.cpu_ticks
            if len(out) >= GROUP_MEMBERS_MAX:
                break
    return out


def read_start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    st = read_stat(pid, proc_root)
    return None if st is None else st.start_ticks


def read_proc_state(pid: int, proc_root: str = "/proc") -> ProcState | None:
    """``read_stat`` plus the threads in D and the wchan: where a process waits in the kernel."""
    st = read_stat(pid, proc_root)
    if st is None:
        return None
    d_threads = []
    try:
        for tid in os.listdir(f"{proc_root}/{pid}/task"):
            try:
                with open(f"{proc_root}/{pid}/task/{tid}/stat") as f:
                    _, tstate, _ = parse_stat(f.read())
                if tstate == "D":
                    d_threads.append(int(tid))
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    wchan = None
    try:
        with open(f"{proc_root}/{pid}/wchan") as f:
            wchan = f.read().strip() or None
    except OSError:
        pass
    return replace(st, d_state_threads=tuple(sorted(d_threads)), wchan=wchan)


def thread_wchan(pid: int, tid: int, proc_root: str = "/proc") -> str | None:
    """Where one thread waits in the kernel, named with its tid; None when it does not wait or is gone."""
    try:
        with open(f"{proc_root}/{pid}/task/{tid}/wchan") as f:
            w = f.read().strip()
        return f"{w} (thread {tid})" if w and w != "0" else None
    except OSError:
        return None
