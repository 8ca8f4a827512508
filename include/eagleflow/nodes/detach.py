"""Start a command detached from the caller and record it atomically.

Run on the node as ``python -m eagleflow.nodes.detach --role R --pid-file F
--log-file L [--lock K] -- argv...``. The child gets its own session (so it
survives the SSH channel or Airflow task that started it, and can be
signalled as a group) and a random token, in its environment and in an
inherited descriptor (``process_record.StartProof``: the proof that a process
of its group is ours, even one whose process title overwrote its environ); the pid record is
on disk before this prints it: nothing we start is ever unrecorded.

With ``--lock K`` the start is exclusive (one worker per shard): detach takes
``flock`` on K without waiting, the child inherits the locked descriptor and
holds it for its whole life (the kernel releases it when the child dies), so
check-then-start cannot race. When a live process holds K, nothing is started
and the answer names its PID (exit 75).

Prints one JSON line, ``eagleflow.nodes.base.DetachAnswer``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from eagleflow.durable import UnsafeFile, open_owned, owned_dir

from .locks import LOCK_FD_ENV, JobLockHeld, lock_exclusive, write_holder
from .proc import read_start_ticks
from .process_record import RECORD_ENV, ProcessRecord, StartProof, write_record

EXIT_LOCKED = 75  # = eagleflow.nodes.base.EXIT_LOCKED


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.nodes.detach")
    ap.add_argument("--role", required=True)
    ap.add_argument("--pid-file", required=True)
    ap.add_argument("--log-file", required=True)
    ap.add_argument("--lock", help="hold this lock file for the child's lifetime; refuse if it is held")
    ap.add_argument("--owned-root", action="append", default=[],
                    help="a folder (the run dir, the state dir) that, with every folder under it down to the pid "
                         "file's, the log's and the lock's, must be this user's (durable.owned_dir)")
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
    # where its record is, beside its token: what `make airflow-stop` finds the jobs its runs detached by
    env[RECORD_ENV] = os.path.abspath(a.pid_file)
    # the token in the leader's own environment and descriptors from exec: what process_record checks before a signal
    try:
        with StartProof() as proof:
            return _start(a, cmd, env, proof)
    except UnsafeFile as e:   # a planted link or someone else's file or folder at the lock, record or log path
        print(f"eagleflow.nodes.detach: {a.role} not started: {e}", file=sys.stderr, flush=True)
        return 2


def _own_folders(a) -> None:
    """The folders of the record, the log and the lock made or proven ours from their root down (UnsafeFolder)."""
    roots = [os.path.abspath(r) for r in a.owned_root]
    for f in (a.pid_file, a.log_file, a.lock):
        folder = os.path.dirname(os.path.abspath(f)) if f else None
        root = next((r for r in roots if folder == r or (folder or "").startswith(r.rstrip("/") + "/")), None)
        if folder and root:
            owned_dir(folder, root=root)


def _start(a, cmd: list[str], env: dict[str, str], proof: StartProof) -> int:
    pass_fds: tuple[int, ...] = proof.pass_fds
    _own_folders(a)   # before the lock is taken: a lock in another user's folder proves nothing
    lock_fd = None
    if a.lock:
        try:
            lock_fd = lock_exclusive(a.lock, purpose=a.role)
        except JobLockHeld as e:
            print(json.dumps({"started": False, "holder_pid": e.holder_pid, "lock_file": e.path,
                              "detail": str(e)}), flush=True)
            return EXIT_LOCKED
        env[LOCK_FD_ENV] = f"{lock_fd}:{os.path.abspath(a.lock)}"
        pass_fds += (lock_fd,)
    os.makedirs(os.path.dirname(os.path.abspath(a.log_file)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.pid_file)), exist_ok=True)
    with os.fdopen(open_owned(a.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, narrow=True), "ab", buffering=0) as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=a.cwd, env=proof.env(env), start_new_session=True, pass_fds=pass_fds)
    if lock_fd is not None:
        write_holder(lock_fd, proc.pid, a.role)  # the holder a refused start names is the child, not us
    rec = ProcessRecord(pid=proc.pid, pgid=proc.pid, start_ticks=read_start_ticks(proc.pid) or 0, role=a.role,
                        pid_file=os.path.abspath(a.pid_file), log_file=os.path.abspath(a.log_file),
                        argv=tuple(cmd), started_at=time.time(), user=_user(), token=proof.token)
    write_record(rec)
    print(json.dumps({"started": True, "record": rec.to_dict(), "lock_file": a.lock or "",
                      "detail": f"{a.role} started: pid {proc.pid}"}), flush=True)
    return 0


def _user() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_name
    except Exception:
        return str(os.getuid())


if __name__ == "__main__":
    sys.exit(main())
