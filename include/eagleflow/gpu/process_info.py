"""Who owns a GPU process and what state it is in, read from this machine's /proc.

Runs on the node (inside ``node_report`` or a local probe). A PID the driver
lists may be missing here (PID namespaces in containers): then every field is
None rather than a guess.
"""
from __future__ import annotations

import os
from typing import Any

from eagleflow.nodes.proc import read_proc_state


def user_of(pid: int, proc_root: str = "/proc") -> str | None:
    try:
        uid = os.stat(f"{proc_root}/{pid}").st_uid
    except OSError:
        return None
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def describe_pid(pid: int, proc_root: str = "/proc") -> dict[str, Any]:
    """{user, state, pgid, wchan, comm} for one PID; all None when it is not visible here."""
    st = read_proc_state(pid, proc_root)
    if st is None:
        return {"user": None, "state": None, "pgid": None, "wchan": None, "comm": None}
    state = "D" if st.in_d_state else st.state
    return {"user": user_of(pid, proc_root), "state": state, "pgid": st.pgid,
            "wchan": st.wchan if st.in_d_state else None, "comm": st.comm}
