"""The heartbeat file a long job (extraction worker, trainer) rewrites every few seconds.

Two clocks on purpose: ``time`` says the process is alive and writing;
``last_progress_at`` says work advances. The seeds' worker kept logging while
nothing advanced: a watchdog must read both (and more, see eagleflow.watchdog).
Written atomically (temp, fsync, rename) so a reader never sees half a file.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

from . import bounded_json
from .durable import atomic_write
from .stop_signal import start_helper_thread

HeartbeatState = Literal["starting", "running", "complete", "failed"]


@dataclass
class InFlight:
    id: str
    since: float          # unix time the request was sent
    tokens: int = 0
    timeout_s: float = 0.0


# a streaming trainer's heartbeat ``extra``: since when (unix time) it waits for the producer's next sample, None
# while it has samples (train.data.StreamLoader's on_wait); its watch blames a starved trainer on the producer
WAITING_FOR_SAMPLES = "waiting_for_samples_since"
# ... since when it waits for its store to run again (lost mid-run: StreamLoader's on_store_wait): not stuck
WAITING_FOR_STORE = "waiting_for_store_since"
# a capture worker's heartbeat ``extra``: since when it waits for room in a streaming store (backpressure: the store
# holds stream.buffer_gib until the trainer takes samples), None once its sample is put; its watch says the producer
# is held back by the consumer, never stalled (a restart would redo its samples and hold it back all the same)
WAITING_FOR_ROOM = "waiting_for_room_since"
# ... and when its last such wait ended: it could not put before then, so its watch counts its progress from then
# (a look between a wait's end and the put's record would otherwise read a shard stale for the whole wait)
ROOM_WAIT_ENDED = "room_wait_ended_at"
# ... and, while its wait is at the gate between capture passes (a run that re-captures per epoch), which pass it
# waits to start: every shard's previous pass must be put first, so the wait is the other shards', not the buffer's
WAITING_FOR_PASS = "waiting_for_pass"
# a trainer's heartbeat ``extra``: what its main thread is busy with ("step", "eval" or "checkpoint") and since when
# (unix time; a step's clock restarts when a wait for samples or for the store ends), and its last steps' compute
# times: its watch judges a step running far past this run's own step time as stuck (a hung collective or transfer
# keeps the heartbeat thread, and an NCCL hang the GPU, busy); an evaluation or a checkpoint has the no-step limit
BUSY_WITH, BUSY_SINCE, STEP_TIMES = "busy_with", "busy_since", "recent_step_s"


@dataclass
class Heartbeat:
    job: str                       # e.g. "extract shard 3/8", "train"
    pid: int
    state: HeartbeatState = "starting"
    time: float = 0.0              # when this file was written
    started_at: float = 0.0
    done: int = 0                  # units completed (samples, steps), including those resumed
    total: int = 0
    unit: str = "samples"
    resumed: int = 0               # units already complete when this process started
    tokens: int = 0
    rate: float = 0.0              # units/s over this process's life
    tokens_per_s: float = 0.0
    last_progress_at: float = 0.0  # when the last unit completed (started_at if none yet)
    in_flight: list[InFlight] = field(default_factory=list)
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = "heartbeat") -> "Heartbeat":
        data = bounded_json.loads(text, source=source)   # JsonRefused (a ValueError) beyond the bounds
        data["in_flight"] = [InFlight(**x) for x in data.get("in_flight", [])]
        return cls(**data)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Heartbeat | None":
        try:
            with open(path) as f:
                return cls.from_json(f.read(), source=os.fspath(path))
        except FileNotFoundError:
            return None

    def write(self, path: str | os.PathLike) -> None:
        self.time = time.time()
        atomic_write(path, self.to_json())

    @property
    def eta_s(self) -> float | None:
        if self.rate <= 0 or self.total <= self.done:
            return None
        return (self.total - self.done) / self.rate

    def eta_text(self) -> str:
        """How long the rest takes at this process's rate ("4.2 min"), "n/a" when it cannot be said."""
        eta = self.eta_s
        return f"{eta / 60:.1f} min" if eta is not None else "n/a"

    def latest_figures(self) -> str:
        """The trainer's latest loss and acc_0 from ``extra`` ("loss 3.412, acc_0 0.418"); "" when it wrote none."""
        out = []
        for key in ("loss", "acc_0"):
            v = self.extra.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.append(f"{key} {v:.3f}")
        return ", ".join(out)

    def progress_line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 0.0
        figures = self.latest_figures()
        return (f"{self.job}: {self.done:,}/{self.total:,} {self.unit} ({pct:.1f} %), "
                f"{self.rate:.2f} {self.unit}/s, {self.tokens_per_s:,.0f} tokens/s, ETA {self.eta_text()}, "
                + (f"{figures}, " if figures else "") + f"state {self.state}")


PACE_WINDOW = 64  # completions kept for the watchdog's "usual pace" (p95 of recent gaps and request times)


def record_pace(hb: Heartbeat, *, gap_s: float, request_s: float | None = None) -> None:
    """Append one completion's gap since the previous one (and its request time) to the heartbeat.

    The watchdog judges a stale heartbeat against this run's own pace: 20 s without a sample is a stall
    at 1 sample/s and normal at 20 s per forward (see eagleflow.watchdog.signals.Pace).
    """
    for key, value in (("recent_gaps_s", gap_s), ("recent_request_s", request_s)):
        if value is None:
            continue
        hist = hb.extra.setdefault(key, [])
        hist.append(round(max(0.0, value), 3))
        del hist[:-PACE_WINDOW]


def set_busy(hb: Heartbeat, what: str, since: float | None = None) -> None:
    """The trainer's word on what it is busy with, from now (or ``since``)."""
    hb.extra[BUSY_WITH], hb.extra[BUSY_SINCE] = what, time.time() if since is None else since


def record_step_time(hb: Heartbeat, seconds: float) -> None:
    """One step's compute time (its waits for samples left out), for the watch's step pace."""
    hist = hb.extra.setdefault(STEP_TIMES, [])
    hist.append(round(max(0.0, seconds), 3))
    del hist[:-PACE_WINDOW]


class HeartbeatWriter:
    """Rewrites a heartbeat every ``interval_s`` from a daemon thread.

    The job updates fields under ``lock`` (``update``); the thread only
    writes. ``mark_progress`` bumps ``last_progress_at``.
    """

    def __init__(self, path: str | os.PathLike, hb: Heartbeat, interval_s: float = 2.0):
        self.path = path
        self.hb = hb
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = time.time()
        hb.started_at = hb.started_at or now
        hb.last_progress_at = hb.last_progress_at or now

    def update(self, fn: Callable[[Heartbeat], None]) -> None:
        with self.lock:
            fn(self.hb)
            elapsed = max(time.time() - self.hb.started_at, 1e-9)
            self.hb.rate = (self.hb.done - self.hb.resumed) / elapsed
            self.hb.tokens_per_s = self.hb.extra.get("tokens_this_run", self.hb.tokens) / elapsed

    def mark_progress(self) -> None:
        self.hb.last_progress_at = time.time()

    def flush(self) -> None:
        with self.lock:
            self.hb.write(self.path)

    def start(self) -> "HeartbeatWriter":
        self.flush()
        self._thread = start_helper_thread(self._loop, name="heartbeat")
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except OSError:
                pass  # disk full: the stale heartbeat is itself the signal

    def stop(self, state: HeartbeatState | None = None, error: str | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        with self.lock:
            if state:
                self.hb.state = state
            if error:
                self.hb.error = error
        self.flush()
