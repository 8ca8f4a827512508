"""One job at a time, enforced on the node: an ``flock`` the job's own process holds for its whole life.

Why flock: the kernel releases it when the holder dies (SIGKILL, OOM,
reboot), so a crash never leaves a lock for a person to delete, and a second
start, a retry, a reconcile run or a hand-started command all refuse while
the first one lives. The file says who holds it (PID, host, role, since) for
the refusal's message.

Two ways to hold one:
- ``eagleflow.nodes.detach --lock``: detach takes it before starting the job
  and the job inherits the locked descriptor (fd and path in
  ``EAGLEFLOW_JOB_LOCK_FD``): check and start are one atomic step;
- ``hold_for_life`` in the job itself: adopts that inherited descriptor, or
  takes the lock when the job was started by hand.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from eagleflow.durable import open_owned, read_owned

LOCK_FD_ENV = "EAGLEFLOW_JOB_LOCK_FD"


class JobLockHeld(RuntimeError):
    """The lock is held by a live process: ``holder_pid`` (None when it has not written its name yet)."""

    def __init__(self, message: str, holder_pid: int | None, path: str):
        super().__init__(message)
        self.holder_pid, self.path = holder_pid, path


def read_holder(path: str | os.PathLike) -> dict:
    try:
        d = json.loads(read_owned(path, limit=1 << 16))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def write_holder(fd: int, pid: int, purpose: str) -> None:
    """Name the holder in the lock file (read by whoever is refused)."""
    doc = json.dumps({"pid": pid, "host": socket.gethostname(), "purpose": purpose, "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, doc, 0)


def lock_exclusive(path: str | os.PathLike, purpose: str) -> int:
    """Take the lock now or raise JobLockHeld naming the holder; returns the locked descriptor."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = open_owned(path, os.O_RDWR | os.O_CREAT, 0o644, narrow=True)   # UnsafeFile for a planted link or a foreign file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = {}
        for _ in range(20):  # the winner names itself right after taking the lock
            holder = read_holder(path)
            if holder.get("pid"):
                break
            time.sleep(0.05)
        pid = holder.get("pid")
        raise JobLockHeld(f"{purpose}: already running as pid {pid if pid else '?'} (lock {path} held"
                          + (f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))}"
                             if holder.get("since") else "")
                          + "); not starting a second one. Stop that process first if it must be replaced",
                          int(pid) if pid else None, path) from None
    write_holder(fd, os.getpid(), purpose)
    return fd


def hold_for_life(path: str | os.PathLike, purpose: str) -> int:
    """Hold the job's lock until this process exits: the inherited one from detach, or a fresh one.

    Raises JobLockHeld when another live process holds it. The descriptor is
    kept open on purpose (never closed: exiting releases it) and is not passed
    on to children, so a leftover child cannot keep a dead job's lock.
    """
    path = os.path.abspath(path)
    inherited = os.environ.get(LOCK_FD_ENV, "")
    fd_text, _, inherited_path = inherited.partition(":")
    if inherited_path == path and fd_text.isdigit():
        fd = int(fd_text)
        try:
            same = os.path.samestat(os.fstat(fd), os.lstat(path))   # lstat: a link there is not our lock
            if same:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # already ours through detach: succeeds at once
                os.set_inheritable(fd, False)
                os.environ.pop(LOCK_FD_ENV, None)
                write_holder(fd, os.getpid(), purpose)
                return fd
        except OSError:
            pass  # not the descriptor detach passed (closed, or another file): take the lock ourselves
    return lock_exclusive(path, purpose)
