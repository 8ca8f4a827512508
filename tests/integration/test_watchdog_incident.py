"""One cause, one incident, one mail, one restart: a hung /generate seen by two shards at once (issue 15).

The real hf capture server (its /generate hangs while /health_generate answers, the sglang 4191
failure), two real CLI workers, both shards watched by the real ShardWatchTrigger with in-watch
recovery, then the operator's recovery call (``recover_after_stall``) for both at the same time.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.engines.hf.server import DELAY_ENV, HANG_FILE_ENV
from eagleflow.phases.extract.lifecycle import start_capture_server, start_or_attach_worker, wait_capture_server_ready
from eagleflow.heartbeat import Heartbeat
from eagleflow.watchdog.incidents import history
from eagleflow.watchdog.policy import hung_generate_bound_s
from eagleflow.watchdog.recovery import restarts_path, recover_after_stall
from eagleflow.watchdog.signals import pace_of
from tests.integration.test_watchdog_failures import N, _manifest, _run, started  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 4.0, "health_timeout_s": 2.0, "startup_grace_s": 60.0,
         "gpu_window_s": 4.0, "d_state_after_s": 4.0}


async def _both_events(run, timeout_s: float) -> list[dict]:
    async def one(shard: int) -> dict:
        agen = ShardWatchTrigger(RunContext(cfg=run.cfg, layout=run.layout).serialize(), shard,
                                 recoveries_left=1).run()
        try:
            return (await asyncio.wait_for(agen.__anext__(), timeout_s)).payload
        finally:
            await agen.aclose()
    return list(await asyncio.gather(one(0), one(1)))


def test_a_hung_generate_seen_by_two_shards_is_one_incident_one_mail_one_restart(
        demo_assets, tmp_path, started, monkeypatch):
    hang = tmp_path / "hang"
    monkeypatch.setenv(HANG_FILE_ENV, str(hang))   # the restarted server inherits it too: a real hook
    monkeypatch.setenv(DELAY_ENV, "0.3")
    # The server's torch on one thread: two OMP threads spinning on two busy cores made each forward of the tiny
    # model seconds long at load 8-10 (issue 52 item 9's runs: p95 gap 2.3-4.3 s, probe 1.5-2 s and twice over its
    # timeout, a server stall all the same but not the hung-/generate rule this test is about); on one thread:
    # p95 gap 0.6-0.7 s, probe 0.3-0.6 s at the same load.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = _run(tmp_path, demo_assets, "incident", watch=WATCH, shards=2, in_flight=1)
    started.append(run)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
    for shard in (0, 1):
        start_or_attach_worker(run, shard)
    deadline = time.monotonic() + 120
    while min(len(_manifest(run, 0)), len(_manifest(run, 1))) < 3:   # some pace history for both
        assert time.monotonic() < deadline, (
            f"the workers stored {len(_manifest(run, 0))} and {len(_manifest(run, 1))} samples, fewer than 3 each, "
            f"in 120 s; logs: " + "; ".join(f"{p.name}: {' | '.join(p.read_text(errors='replace').splitlines()[-4:])}"
                                             for p in sorted(Path(run.layout.logs_dir).glob("*.log"))))
        time.sleep(0.1)
    old_server = json.loads(Path(run.layout.pid_file("capture_server")).read_text())["pid"]
    hang.write_text("hang")
    t_hang = time.time()

    events = asyncio.run(_both_events(run, 90))
    hung = [Heartbeat.read(str(run.layout.heartbeat_file(shard))) for shard in (0, 1)]   # still hung: as judged
    for ev, hb in zip(events, hung):
        assert ev["status"] == "recovering" and ev["cause"] == "capture_server", ev
        assert "server answers /health_generate" in ev["diagnosis"] and "but its /generate does not" in ev["diagnosis"]
        # Issue 52 item 9: a hung /generate is judged by the hung request's age against a limit that follows this
        # run's pace and the probe's latency (hung_request_limit_s), not by stall_after_s, and that request is
        # sent only once the one in progress at the hang has finished: the bound counts from its send and is
        # derived from the configured values and the pace the node judged (detection_bound_s is the bound of a
        # progress stall at the usual pace, stall_after_s 4 s; a loaded machine's p95 gap of 2.3 s made it 6.9 s).
        assert hb is not None and hb.in_flight, hb
        sent = min(r.since for r in hb.in_flight)
        bound = hung_generate_bound_s(run.cfg, pace_of(hb, run.cfg), len(hb.in_flight))
        timing = (f"{ev['job']}: detected {ev['detected_at'] - t_hang:.1f} s after the hang, "
                  f"{ev['detected_at'] - sent:.1f} s after the hung request was sent {sent - t_hang:.1f} s after it "
                  f"(bound {bound:.1f} s from the send)")
        print(timing + "\n  " + ev["diagnosis"].splitlines()[0])
        assert ev["detected_at"] - sent <= bound, timing + "\n" + ev["diagnosis"]
    incidents = [ev["incident"] for ev in events]
    assert incidents[0]["incident"] == incidents[1]["incident"], incidents
    assert sorted(i["opened"] for i in incidents) == [False, True], "exactly one shard mails"
    hang.unlink()

    # both shards' operators recover at the same time: one restart, both resume
    results: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda s=s, ev=ev: results.update(
        {s: recover_after_stall(RunContext(cfg=run.cfg, layout=run.layout), s, ev, lambda m: None)}))
        for s, ev in enumerate(events)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert sorted(results) == [0, 1] and all(r["ok"] for r in results.values()), results
    restarts = [json.loads(x) for x in Path(restarts_path(run)).read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["old_pid"] == old_server, restarts
    assert restarts[0]["incident"] == incidents[0]["incident"]
    assert "alive but the watch found it stuck" in restarts[0]["reason"]
    book = [e for e in history(run.layout.state_dir) if e.get("id") == incidents[0]["incident"]]
    assert [e["event"] for e in book].count("opened") == 1

    for shard in (0, 1):   # each worker resumes from its manifest and finishes: every sample exactly once
        deadline = time.monotonic() + 180
        while (hb := Heartbeat.read(str(run.layout.heartbeat_file(shard)))) is None or hb.state != "complete":
            assert time.monotonic() < deadline, f"shard {shard} did not complete after the recovery"
            time.sleep(0.2)
        expected = [i for i in range(N) if i % 2 == shard]
        assert sorted(e["index"] for e in _manifest(run, shard)) == expected, "every sample exactly once"
        names = sorted(p.name for p in Path(run.layout.shard_dir(shard)).glob("*.safetensors"))
        assert names == [f"{i:08d}.safetensors" for i in expected]
