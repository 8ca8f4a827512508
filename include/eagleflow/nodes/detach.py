"""Start a command detached from the caller and record its PID atomically.

Run on the node as ``python -m eagleflow.nodes.detach --role R --pid-file F
--log-file L -- argv...``. The child gets its own session (so it survives the
SSH channel or Airflow task that started it, and can be signalled as a group)
and the pid record is on disk before this prints it: nothing we start is ever
unrecorded.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .proc import read_start_ticks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.nodes.detach")
    ap.add_argument("--role", required=True)
    ap.add_argument("--pid-file", required=True)
    ap.add_argument("--log-file", required=True)
    ap.add_argument("--cwd")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("no command given after --")
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    os.makedirs(os.path.dirname(os.path.abspath(a.log_file)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.pid_file)), exist_ok=True)
    with open(a.log_file, "ab", buffering=0) as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=a.cwd, env=env, start_new_session=True)
    rec = {"pid": proc.pid, "pgid": proc.pid, "start_ticks": read_start_ticks(proc.pid) or 0,
           "role": a.role, "argv": cmd, "started_at": time.time(), "log_file": os.path.abspath(a.log_file),
           "user": _user()}
    tmp = a.pid_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, a.pid_file)
    print(json.dumps(rec), flush=True)
    return 0


def _user() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_name
    except Exception:
        return str(os.getuid())


if __name__ == "__main__":
    sys.exit(main())
