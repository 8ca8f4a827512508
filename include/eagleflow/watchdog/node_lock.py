"""A lock on the node: ``flock`` on a file under <state_dir>/locks, held by the process that runs the guarded work.

Why flock: the kernel drops it when the holder dies (SIGKILL, OOM, node
reboot), so a crashed recovery never leaves a lock that needs a person to
delete it. The file also says who holds it, for the message of a waiter.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from eagleflow.durable import open_owned, read_owned


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
        fd = open_owned(self.path, os.O_RDWR | os.O_CREAT, 0o644, narrow=True)   # UnsafeFile for a planted link or foreign file
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
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                                 "since": time.time()}).encode())
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
