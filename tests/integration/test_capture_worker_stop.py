"""A worker told to stop stops storing at once (issue 27 item 5).

The real detached worker of a shard (``eagleflow capture run``, four requests in flight to the real hf
server) is frozen with SIGSTOP, then stopped the way a recovery stops it (the one stop: SIGTERM, SIGCONT,
grace, SIGKILL). It must exit well inside the grace, by itself, having stored at most the samples that
were already being written, and leave "stopped by SIGTERM" in its heartbeat; a re-run resumes exactly.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from eagleflow.engines.hf.server import DELAY_ENV
from eagleflow.phases.extract.lifecycle import (start_capture_server, start_or_attach_worker, wait_capture_server_ready,
                                         worker_role)
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes.proc import read_proc_state
from tests.integration.test_watchdog_failures import WATCH, N, _manifest, _run, started  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GRACE_S = 10.0


def test_a_stopped_then_terminated_worker_stops_storing_and_exits_within_seconds(demo_assets, tmp_path, started,
                                                                                  monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.3")
    # a health timeout a loaded CI box meets while the tiny model's forward queues behind others' work
    run = _run(tmp_path, demo_assets, "stop", watch={**WATCH, "health_timeout_s": 5.0}, shards=1, in_flight=4)
    started.append(run)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
    rec, _ = start_or_attach_worker(run, 0)
    deadline = time.monotonic() + 120
    while len(_manifest(run, 0)) < 3:
        assert time.monotonic() < deadline, "fewer than 3 samples stored in 120 s"
        time.sleep(0.05)
    os.kill(rec.pid, signal.SIGSTOP)
    time.sleep(1.0)   # the server answers the requests in flight meanwhile: their dumps wait for the worker
    stored_at_stop = len(_manifest(run, 0))
    t0 = time.monotonic()
    res = run.node.stop_recorded(str(run.layout.pid_file(worker_role(0))), grace_s=GRACE_S)
    took = time.monotonic() - t0
    # it exited on TERM by itself inside the grace, no SIGKILL (before the fix: "killed", storing meanwhile)
    assert res.outcome == "terminated", res.detail
    assert took < GRACE_S, f"the worker took {took:.1f} s to exit after SIGTERM (grace {GRACE_S:.0f} s)"
    st = read_proc_state(rec.pid)
    assert st is None or st.state == "Z"
    stored_after = len(_manifest(run, 0))
    print(f"worker exited {took:.1f} s after the stop began; {stored_after - stored_at_stop} sample(s) stored after it")
    # at most what was already being written when it was frozen, or finished writing in the moment after
    assert stored_after - stored_at_stop <= 1, f"{stored_after - stored_at_stop} samples stored after SIGTERM"
    hb = Heartbeat.read(str(run.layout.heartbeat_file(0)))
    assert hb.state == "failed" and "stopped by SIGTERM" in (hb.error or ""), hb
    assert stored_after < N

    # a re-run resumes from the manifest: every sample exactly once
    start_or_attach_worker(run, 0)
    deadline = time.monotonic() + 120
    while (hb := Heartbeat.read(str(run.layout.heartbeat_file(0)))) is None or hb.state != "complete" \
            or hb.pid == rec.pid:
        assert time.monotonic() < deadline, "the re-run did not complete the shard"
        time.sleep(0.2)
    got = [e["index"] for e in _manifest(run, 0)]
    assert sorted(got) == list(range(N)) and len(got) == len(set(got)), "every sample exactly once"
