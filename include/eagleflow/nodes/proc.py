"""Reading /proc: process state, start time, D-state threads, wchan.

``comm`` (field 2 of /proc/<pid>/stat) may hold spaces and parentheses, so the
fields are split after the last ')'.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProcState:
    pid: int
    comm: str
    state: str                 # R S D Z T ...
    start_ticks: int
    d_state_threads: tuple[int, ...] = field(default=())  # tids in D (uninterruptible)
    wchan: str | None = None

    @property
    def is_zombie(self) -> bool:
        return self.state == "Z"

    @property
    def in_d_state(self) -> bool:
        return self.state == "D" or bool(self.d_state_threads)


def parse_stat(text: str) -> tuple[str, str, list[str]]:
    """(comm, state, fields after state) from a /proc/<pid>/stat line."""
    lpar = text.index("(")
    rpar = text.rindex(")")
    comm = text[lpar + 1:rpar]
    rest = text[rpar + 2:].split()
    return comm, rest[0], rest[1:]


def read_start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    try:
        with open(f"{proc_root}/{pid}/stat") as f:
            _, _, rest = parse_stat(f.read())
    except (OSError, ValueError):
        return None
    # starttime is field 22 overall; rest starts at field 4
    return int(rest[22 - 4])


def read_proc_state(pid: int, proc_root: str = "/proc") -> ProcState | None:
    try:
        with open(f"{proc_root}/{pid}/stat") as f:
            comm, state, rest = parse_stat(f.read())
    except (OSError, ValueError):
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
    return ProcState(pid=pid, comm=comm, state=state, start_ticks=int(rest[22 - 4]),
                     d_state_threads=tuple(sorted(d_threads)), wchan=wchan)
