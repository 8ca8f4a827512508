"""Locks on the node: an ``flock`` on a file, held by the process doing the guarded work.

Why flock: the kernel releases it when the holder dies (SIGKILL, OOM, node
reboot), so a crash never leaves a lock for a person to delete, and whoever
comes next either gets it or is told, from the lock file, who holds it (PID,
host, purpose, since). Two uses, one rule:

- a job's life lock (``lock_exclusive``, ``hold_for_life``; the file is
  ``RunLayout.lock_file(role)``): one job at a time, refused at once with
  ``JobLockHeld`` while the first one lives, whether the second is a start, a
  retry, a reconcile run or a hand-started command. ``eagleflow.nodes.detach
  --lock`` takes it before starting the job and the job inherits the locked
  descriptor (fd and path in ``EAGLEFLOW_JOB_LOCK_FD``), so check and start are
  one atomic step; ``hold_for_life`` in the job adopts that descriptor, or takes
  the lock when the job was started by hand;
- a lock around a step (``NodeLock``, under ``<state_dir>/locks``: a server
  restart, a reconcile claim, the incident book): waited for, up to a bound
  (``NodeLockTimeout``), and released when the step is done.

Standard library (and ``eagleflow.durable``) only: detach runs it with whatever interpreter the node has.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from eagleflow import bounded_json
from eagleflow.durable import open_owned, read_owned

LOCK_FD_ENV = "EAGLEFLOW_JOB_LOCK_FD"


def _open_lock_file(path: str | os.PathLike) -> int:
    # UnsafeFile for a planted link or a foreign file
    return open_owned(path, os.O_RDWR | os.O_CREAT, 0o644, narrow=True)


def read_holder(path: str | os.PathLike) -> dict:
    try:
        d = bounded_json.loads(read_owned(path, limit=1 << 16), source=os.fspath(path))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def write_holder(fd: int, pid: int, purpose: str) -> None:
    """Name the holder in the lock file (read by whoever is refused or waits)."""
    doc = json.dumps({"pid": pid, "host": socket.gethostname(), "purpose": purpose, "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, doc, 0)


# ----------------------------------------------------------------------------- a job's life lock
class JobLockHeld(RuntimeError):
    """The lock is held by a live process: ``holder_pid`` (None when it has not written its name yet)."""

    def __init__(self, message: str, holder_pid: int | None, path: str):
        super().__init__(message)
        self.holder_pid, self.path = holder_pid, path


def lock_exclusive(path: str | os.PathLike, purpose: str) -> int:
    """Take the lock now or raise JobLockHeld naming the holder; returns the locked descriptor."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = _open_lock_file(path)
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


# ----------------------------------------------------------------------------- a lock around a step
class NodeLockTimeout(TimeoutError):
    """Someone else held the lock for longer than we were willing to wait."""


class NodeLock:
    def __init__(self, path: str | os.PathLike, purpose: str):
        self.path = Path(path)
        self.purpose = purpose
        self._fd: int | None = None

    def holder(self) -> str:
        try:
            return read_owned(self.path, limit=1 << 16).decode(errors="replace").strip() or "(unknown)"
        except (OSError, ValueError):
            return "(unknown)"

    def acquire(self, timeout_s: float | None = None, poll_s: float = 0.2) -> bool:
        """Block until held (or ``timeout_s``, then NodeLockTimeout). Returns True when we waited for someone."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_lock_file(self.path)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = True
                if deadline is not None and time.monotonic() >= deadline:
                    holder = self.holder()
                    os.close(fd)
                    raise NodeLockTimeout(f"lock {self.path} ({self.purpose}) is still held after {timeout_s:.0f} s "
                                          f"by {holder}; if that process is gone the kernel has already released "
                                          "it, so someone is genuinely working: wait for it") from None
                time.sleep(poll_s)
        write_holder(fd, os.getpid(), self.purpose)
        self._fd = fd
        return waited

    def try_acquire(self) -> bool:
        """Take the lock if free, else return False at once."""
        try:
            self.acquire(timeout_s=0)
            return True
        except NodeLockTimeout:
            return False

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "NodeLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
