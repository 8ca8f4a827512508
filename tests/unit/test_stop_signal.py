"""A worker told to stop says "stopped by SIGTERM" in its last heartbeat, even when the signal lands inside
library code that catches RuntimeError (torch's op lookup does, and renames it AttributeError): the CI
failure of test_rerun_attaches_to_the_live_worker, whose TERM landed in the worker's torch import."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from eagleflow.heartbeat import Heartbeat

# Runs in its own process: the handler replaces this interpreter's SIGTERM handling.
CHILD = r"""
import sys, time
from pathlib import Path
from eagleflow.heartbeat import Heartbeat, HeartbeatWriter
from eagleflow.stop_signal import failure_text, stop_on_term

class OwnError(RuntimeError):
    pass


out, mode = Path(sys.argv[1]), sys.argv[2]
stop_on_term("shard 7", "stored samples are kept")
hbw = HeartbeatWriter(out / "heartbeat.json", Heartbeat(job="extract shard 7/8", pid=0), interval_s=0.1)
hbw.start()
try:
    if mode == "torch-op-lookup":
        import torch
        packet = torch.ops.aten.add
        (out / "ready").write_text("1")
        while True:     # torch's op lookup, where the signal once landed: it turns a RuntimeError into an
            packet.__getattr__("default")     # AttributeError "The underlying op of ... has no overload name"
    (out / "ready").write_text("1")
    while True:
        try:
            time.sleep(0.05)
        except BaseException:
            raise AttributeError("a library that wraps even BaseException") from None
except BaseException as e:
    hbw.stop(state="failed", error=failure_text(e, OwnError))
    raise
"""


@pytest.mark.parametrize("mode", ["torch-op-lookup", "wraps-everything"])
def test_a_stop_inside_library_code_is_named_in_the_heartbeat(tmp_path, mode):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), mode], stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < end, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    hb = Heartbeat.read(tmp_path / "heartbeat.json")
    assert hb.state == "failed"
    assert hb.error == "shard 7: stopped by SIGTERM; stored samples are kept", json.dumps(hb.to_json())
    assert ("Stopped: shard 7: stopped by SIGTERM" in err) == (mode == "torch-op-lookup"), err


def test_other_failures_keep_their_own_text_or_type():
    from eagleflow.stop_signal import failure_text

    class OwnError(RuntimeError):
        pass
    assert failure_text(OwnError("shard 1: disk full; free space"), OwnError) == "shard 1: disk full; free space"
    assert failure_text(KeyError("x"), OwnError) == "KeyError: 'x'"


# A worker's shape: helper threads that keep running, a main thread waiting on one of them in a long join.
HELPERS = r"""
import sys, threading, time
from eagleflow.stop_signal import start_helper_thread, stop_on_term

stop_on_term("shard 3", "stored samples are kept")
def spin():
    while True:
        sum(range(2000))   # runnable, so a helper is first to run when the process is continued
try:
    helpers = [start_helper_thread(spin, name=f"capture-{k}") for k in range(4)]
    print("ready", flush=True)
    helpers[0].join(60)   # a worker's join(0.2), long enough here that only an interrupted wait ends it in time
except BaseException as e:
    print(f"{type(e).__name__}: {e}", flush=True)
    sys.exit(3)
sys.exit(0)
"""


def test_a_stop_sent_to_a_stopped_worker_interrupts_its_main_threads_wait_at_once():
    """The recovery's stop (SIGTERM to a frozen worker, then SIGCONT): while every thread is stopped the signal
    waits for the process, and the first thread to run takes it. Helpers block it, so the main thread does,
    and its wait ends at once; had a helper taken it, the main thread would learn of it only when its join
    returned (a sample stored per helper meanwhile, the CI failure of test_capture_worker_stop)."""
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", HELPERS], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            # parked in its join first: a signal that lands as the main thread is entering its wait is seen only
            # when the wait ends (CPython checks for handlers before a lock's wait, not in it)
            time.sleep(0.5)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
            t0 = time.monotonic()
            out = proc.communicate(timeout=50)[0]
            took = time.monotonic() - t0
        finally:
            proc.kill()
        assert proc.returncode == 3 and "Stopped: shard 3: stopped by SIGTERM" in out, out
        assert took < 30, f"the main thread learnt of the stop {took:.1f} s late: a helper took the signal"


def test_a_helper_thread_blocks_the_stop_signals_and_its_creator_keeps_its_own_mask():
    from eagleflow.stop_signal import STOP_SIGNALS, start_helper_thread
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen: list[set] = []
    start_helper_thread(lambda: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])), name="probe").join(10)
    assert STOP_SIGNALS <= seen[0]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


# The main thread busy in C code that released the GIL (a worker's main thread in a long call): its handler
# waits for that call to return; a helper must know of the stop before then.
ARRIVAL = r"""
import hashlib, sys, threading, time
from eagleflow.stop_signal import Stopped, start_helper_thread, stop_arrived, stop_on_term

stop_on_term("shard 5", "stored samples are kept")
seen = {}
def helper():
    while not stop_arrived():
        time.sleep(0.001)
    seen["helper"] = time.monotonic()
t = start_helper_thread(helper, name="capture-0")
print("ready", flush=True)
try:
    hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 10_000_000)   # seconds in C, the GIL released, no signal check
    time.sleep(5)
except Stopped:
    seen["handler"] = time.monotonic()
t.join(5)
print(seen.get("helper", 0) < seen.get("handler", 0), seen.get("handler", 0) - seen.get("helper", 0), flush=True)
"""


def test_a_helper_learns_of_the_stop_at_delivery_before_the_main_threads_handler_runs():
    proc = subprocess.Popen([sys.executable, "-c", ARRIVAL], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    first, lead = out.split()
    assert first == "True", f"the helper saw the stop {-float(lead):.2f} s after the handler ran"
    assert float(lead) > 0.5, f"the helper knew only {float(lead):.2f} s before the handler"


def test_without_stop_on_term_no_stop_has_arrived():
    from eagleflow import stop_signal
    assert stop_signal._wakeup_read_fd is None or stop_signal.stop_arrived() is False
