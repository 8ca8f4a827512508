"""The worker skeleton every sharded phase's worker runs in: its heartbeat, its threads, its stop.

A phase's worker (``phases/<name>/worker.py``) subclasses ``PhaseWorker`` with its descriptor and its own error,
and writes only what is its own: ``_run`` (the manifest read at resume, what is left to do, each unit's work).
The skeleton owns what both phases did alike around it:

- ``run``: the shard's folder, the heartbeat (``<kind.phase> shard S/N``, counting ``kind.unit``) written every
  ``heartbeat_interval_s`` from a thread, "complete" when ``_run`` returns, "failed" with the error's text
  (``stop_signal.failure_text``: a stop's reason first) however it ends;
- ``_drive``: a queue of units worked by N helper threads (they never take SIGTERM: the main thread waits in
  short joins so its signal handler runs), the first unit that fails stops the others, a stop (SIGTERM,
  Ctrl-C) calls the phase's ``halt`` and is raised; ``_raise_failure`` raises the first unit's error once the
  phase has closed what it writes.
"""
from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, TypeVar

from eagleflow.heartbeat import Heartbeat, HeartbeatWriter
from eagleflow.stop_signal import failure_text, start_helper_thread

from eagleflow.phases.descriptor import HEARTBEAT, ShardKind

T = TypeVar("T")


class PhaseWorker:
    """One shard's worker of the phase ``kind``; ``error`` is the phase's own error (its text is what to do)."""
    kind: ClassVar[ShardKind]
    error: ClassVar[type[BaseException]] = RuntimeError

    def __init__(self, shard: int, num_shards: int, shard_dir: str, heartbeat_interval_s: float,
                 log: Callable[[str], Any] = print) -> None:
        self.shard, self.num_shards = shard, num_shards
        self.shard_dir = Path(shard_dir)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log = log
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def job_name(self) -> str:
        """How the heartbeat names the job (the watch's ``WatchedJob`` reads the same)."""
        return f"{self.kind.phase} shard {self.shard}/{self.num_shards}"

    def heartbeat_extra(self) -> dict[str, Any]:
        """The phase's own fields of the first heartbeat (``Heartbeat.extra``)."""
        return {"shard": self.shard, "tokens_this_run": 0}

    def run(self) -> Heartbeat:
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        hb = Heartbeat(job=self.job_name(), pid=os.getpid(), unit=self.kind.unit, extra=self.heartbeat_extra())
        hbw = HeartbeatWriter(self.shard_dir / HEARTBEAT, hb, interval_s=self.heartbeat_interval_s)
        try:
            hbw.start()   # inside: a stop held back while its thread started is raised as the mask lifts
            self._run(hbw)
        except BaseException as e:
            hbw.stop(state="failed", error=failure_text(e, self.error))
            raise
        hbw.stop(state="complete")
        return hbw.hb

    def _run(self, hbw: HeartbeatWriter) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _run (the phase's work)")

    def _drive(self, items: Iterable[T], workers: int, name: str, make_one: Callable[[], Callable[[T], None]],
               halt: Callable[[list[threading.Thread]], None]) -> None:
        """Work ``items`` with ``workers`` threads, each calling its own ``make_one()`` per item, until all are
        done or one failed (then ``halt``, and ``_raise_failure`` raises it); a stop is halted and raised."""
        work: queue.Queue[T] = queue.Queue()
        n = 0
        for item in items:
            work.put(item)
            n += 1
        threads = [start_helper_thread(self._work_loop, work, make_one(), name=f"{name}-{k}")
                   for k in range(min(workers, n))]
        try:
            for t in threads:
                while t.is_alive() and self._error is None:
                    t.join(0.2)   # short waits: a signal handler runs only in this thread, and only between them
        except BaseException:
            halt(threads)   # told to stop (SIGTERM, Ctrl-C)
            raise
        if self._error is not None:
            # one unit failed: say so now, not after the other requests' own deadlines (up to hours)
            halt(threads)

    def _work_loop(self, work: "queue.Queue[T]", one: Callable[[T], None]) -> None:
        while not self._stop.is_set():
            try:
                item = work.get_nowait()
            except queue.Empty:
                return
            try:
                one(item)
            except BaseException as e:
                with self._lock:
                    if self._error is None:
                        self._error = e
                self._stop.set()
                return

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error
