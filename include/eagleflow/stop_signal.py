"""A worker told to stop (SIGTERM) says so in its final heartbeat, whatever it was doing when told.

The stop is raised in the main thread as ``Stopped``, a BaseException like KeyboardInterrupt: library code
that catches Exception or RuntimeError cannot swallow or rename it. (It did: a worker stopped while torch
was still importing left "AttributeError: The underlying op of 'mkldnn._convolution_pointwise' has no
overload name 'default'" in its heartbeat, because torch's op lookup turns a RuntimeError into an
AttributeError.) The reason is also kept here, so a heartbeat written after a library did wrap the stop
still names the signal.
"""
from __future__ import annotations

import os
import select
import signal
import threading
from typing import Any, Callable

_reason: str | None = None
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_wakeup_read_fd: int | None = None
_arrived = threading.Event()


def start_helper_thread(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Start a daemon thread that never takes SIGTERM or SIGINT, so the kernel hands them to the main thread.

    A process signal goes to any thread not blocking it, but Python runs its handler only in the main
    thread, and only when that thread next runs: with a helper taking the signal, a main thread waiting in
    ``join(0.2)`` learnt of a stop up to 0.2 s late, time in which the helpers stored two more samples (CI,
    stop 45). Blocked in every helper, the signal interrupts the main thread's wait itself.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()   # a new thread starts with its creator's mask: the stop signals blocked
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return t


class Stopped(BaseException):
    """Raised by the stop signal's handler; its text says what was stopped, by what and what is kept."""


def stop_on_term(what: str, kept: str) -> None:
    """From now on SIGTERM raises ``Stopped("<what>: stopped by SIGTERM; <kept>")`` in the main thread, and
    ``stop_arrived()`` says so in every thread from the moment the signal is delivered (main thread only)."""
    global _wakeup_read_fd

    def _stopped(signum, _frame):
        global _reason
        _reason = f"{what}: stopped by {signal.Signals(signum).name}; {kept}"
        _arrived.set()
        raise Stopped(_reason)
    signal.signal(signal.SIGTERM, _stopped)
    if _wakeup_read_fd is None:
        # Python's own C handler writes each signal's number here at delivery, before the main thread holds
        # the GIL to run _stopped: helpers read it without waiting for the interpreter's turn
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _wakeup_read_fd = r


def stop_arrived() -> bool:
    """True once SIGTERM or SIGINT reached this process after ``stop_on_term``, in any thread and at once.

    The handler that raises ``Stopped`` runs only when the main thread next holds the GIL; helper threads with
    a result in hand got there first on a loaded machine and stored two more samples after the stop (CI, stops
    45 and 46). A helper asks this just before it stores."""
    if _arrived.is_set():
        return True
    fd = _wakeup_read_fd
    if fd is None or not select.select([fd], [], [], 0)[0]:
        return False
    try:
        got = os.read(fd, 512)
    except BlockingIOError:   # another helper read it first: it sets the flag
        return _arrived.wait(0.05)
    if any(b in (signal.SIGTERM, signal.SIGINT) for b in got):
        _arrived.set()
    return _arrived.is_set()


def failure_text(e: BaseException, own: type[BaseException]) -> str:
    """The error a failed worker's last heartbeat carries: a stop's reason first (even if a library wrapped
    it), our own errors' text as written (it says what to do), anything else with its type."""
    if _reason is not None:
        return _reason
    return str(e) if isinstance(e, (own, Stopped)) else f"{type(e).__name__}: {e}"
