"""ShardWatchTrigger / TrainWatchTrigger against real detached processes and the real `eagleflow watch` CLI."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger, TrainWatchTrigger
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.watchdog.policy import frozen_window_s
from tests.fixtures.watchdog_jobs import backdate_record, kill_group, spawn_sleeper, wait_gone, watch_config, write_heartbeat


@pytest.fixture
def run(tmp_path):
    cfg = watch_config(tmp_path)
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "manual__2026-11-29T15:00:00+00:00"))
    ctx.write_run_config()
    started = []
    yield ctx, started
    for p in started:
        kill_group(p.pgid)


async def _first_event(trigger, timeout_s: float):
    agen = trigger.run()
    try:
        return await asyncio.wait_for(agen.__anext__(), timeout_s)
    finally:
        await agen.aclose()


def test_serialize_round_trips_every_argument(run):
    ctx, _ = run
    t = ShardWatchTrigger(ctx.serialize(), 3, poll_interval_s=2.5)
    path, kwargs = t.serialize()
    assert path == "eagleflow.airflow.shard_watch.ShardWatchTrigger"
    again = ShardWatchTrigger(**kwargs)
    assert again.serialize() == (path, kwargs) and kwargs == {"run": ctx.serialize(), "shard": 3,
                                                              "poll_interval_s": 2.5, "recoveries_left": 0,
                                                              "phase": "extract"}
    tpath, tkw = TrainWatchTrigger(ctx.serialize()).serialize()
    assert tpath.endswith("TrainWatchTrigger") and TrainWatchTrigger(**tkw).serialize() == (tpath, tkw)


@pytest.mark.timeout(60)
def test_complete_heartbeat_yields_complete(run):
    ctx, started = run
    p = spawn_sleeper(ctx.layout, "worker_shard_00001")
    started.append(p)
    write_heartbeat(ctx.layout, 1, pid=p.pid, state="complete", done=25, total=25)
    ev = asyncio.run(_first_event(ShardWatchTrigger(ctx.serialize(), 1), 30))
    assert ev.payload["status"] == "complete"
    assert "25/25" in ev.payload["summary"]


@pytest.mark.timeout(60)
def test_worker_killed_without_completing_yields_dead_with_its_pid(run):
    ctx, started = run
    p = spawn_sleeper(ctx.layout, "worker_shard_00002")
    started.append(p)
    write_heartbeat(ctx.layout, 2, pid=p.pid, done=7, total=25)
    kill_group(p.pgid)
    wait_gone(p.pid)
    ev = asyncio.run(_first_event(ShardWatchTrigger(ctx.serialize(), 2), 30))
    assert ev.payload["status"] == "dead"
    assert ev.payload["subject"] == "[eagleflow] DEAD shard 2/4 on test-node"
    # gone, or a zombie until whoever inherited it reaps it: both are dead
    assert (f"worker pid {p.pid} is gone without completing" in ev.payload["diagnosis"]
            or f"worker pid {p.pid} is a zombie (exited, not yet reaped) without completing" in ev.payload["diagnosis"])
    assert "7/25 samples done" in ev.payload["diagnosis"]


@pytest.mark.timeout(60)
def test_stopped_worker_is_caught_within_the_bound(run):
    """A live but frozen (SIGSTOP) worker: progress and heartbeat go stale; the event comes within the bound."""
    ctx, started = run
    wd = ctx.cfg.watchdog
    p = spawn_sleeper(ctx.layout, "worker_shard_00000")
    started.append(p)
    hb = write_heartbeat(ctx.layout, 0, pid=p.pid, done=5, total=25, in_flight=[("r", 0.0, 60.0)])
    import os
    os.kill(p.pid, signal.SIGSTOP)
    ev = asyncio.run(_first_event(ShardWatchTrigger(ctx.serialize(), 0), 30))
    latency = time.time() - hb.last_progress_at
    assert ev.payload["status"] == "stalled", ev.payload
    d = ev.payload["diagnosis"]
    assert f"worker pid {p.pid} is stopped (state T: SIGSTOP" in d
    assert "no sample completed for" in d
    assert latency <= wd.detection_bound_s


@pytest.mark.timeout(90)
def test_live_job_with_a_stale_heartbeat_and_no_cpu_is_stalled_once_the_cpu_window_closes(run):
    """The process runs (not stopped) but its heartbeat stopped being rewritten 30 s ago and it uses no CPU (a
    sleeper): frozen, once the watch's CPU reads span the heartbeat window (issue 52: a late heartbeat alone is
    what a starved writer shows too). The trainer: a shard's watch would blame its missing server first."""
    ctx, started = run
    window = frozen_window_s(ctx.cfg)
    p = spawn_sleeper(ctx.layout, "trainer")
    started.append(p)
    backdate_record(ctx.layout, "trainer", 600)
    now = time.time()
    Heartbeat(job="train", pid=p.pid, state="running", started_at=now - 600, done=5, total=25, unit="steps",
              last_progress_at=now - 40).write(str(ctx.layout.train_heartbeat_file))
    data = json.loads(Path(str(ctx.layout.train_heartbeat_file)).read_text())
    data["time"] = now - 30
    Path(str(ctx.layout.train_heartbeat_file)).write_text(json.dumps(data))
    t0 = time.time()
    ev = asyncio.run(_first_event(TrainWatchTrigger(ctx.serialize()), 60))
    assert ev.payload["status"] == "stalled" and ev.payload["cause"] == "worker", ev.payload
    d = ev.payload["diagnosis"]
    # its age is judged when it was read: 30 s at the write plus the window the CPU was read over
    m = re.search(rf"worker pid {p.pid} is alive but its heartbeat was last written (\d+) s before it was read", d)
    assert m and 30 + window <= int(m.group(1)) <= 30 + window + 15, d
    q = re.search(r"its process group \(1 process\) used no CPU time for (\d+) s: frozen", d)
    assert q and window <= int(q.group(1)) <= window + 10, d
    # the slow look before asked for the one that closes the window: not a poll interval per look
    assert ev.payload["detected_at"] - t0 <= window + ctx.cfg.watchdog.detection_bound_s, d


@pytest.mark.timeout(60)
def test_train_trigger_watches_the_trainer_heartbeat(run):
    ctx, started = run
    p = spawn_sleeper(ctx.layout, "trainer")
    started.append(p)
    Heartbeat(job="train", pid=p.pid, state="complete", done=60, total=60, unit="steps").write(
        str(ctx.layout.train_heartbeat_file))
    ev = asyncio.run(_first_event(TrainWatchTrigger(ctx.serialize()), 30))
    assert ev.payload["status"] == "complete" and "60/60" in ev.payload["summary"]


@pytest.mark.timeout(60)
def test_unreachable_node_becomes_a_failed_event(run, monkeypatch):
    ctx, _ = run
    data = ctx.serialize()  # the node's python comes from the frozen config the trigger carries: break it there
    data["control"] = {**data["control"], "node.python": "/nonexistent/python3"}
    ev = asyncio.run(_first_event(ShardWatchTrigger(data, 0, poll_interval_s=0.2), 30))
    assert ev.payload["status"] == "failed" and ev.payload["verdict"] == "unreachable"
    assert "/nonexistent/python3" in ev.payload["diagnosis"]


@pytest.mark.timeout(60)
def test_a_watch_closes_the_incidents_its_task_mailed_once_they_are_over(run):
    """The outage is over at the first answer; the stall only once a sample was stored after it."""
    ctx, started = run
    p = spawn_sleeper(ctx.layout, "worker_shard_00001")
    started.append(p)
    write_heartbeat(ctx.layout, 1, pid=p.pid, done=9, total=25)
    stall = {"kind": "stall", "id": "test-node-capture_server-1", "subject": "[eagleflow] STALLED shard 1/4",
             "since": time.time() - 20, "done": 9}
    outage = {"kind": "outage", "id": "outage-1.000", "subject": "[eagleflow] UNREACHABLE shard 1/4", "since": 1.0,
              "done": 0}
    t = ShardWatchTrigger(ctx.serialize(), 1, recoveries_left=2, close_incidents=[stall, outage])
    assert t.serialize()[1]["close_incidents"] == [stall, outage]     # plain values, as Airflow stores a trigger
    assert ShardWatchTrigger(**t.serialize()[1]).close_incidents == t.close_incidents   # as the triggerer rebuilds it
    ev = asyncio.run(_first_event(t, 30)).payload
    assert ev["status"] == "resumed" and ev["closed"] == [outage] and ev["still_open"] == [stall]
    assert ev["recoveries_left"] == 2 and ev["done"] == 9
    write_heartbeat(ctx.layout, 1, pid=p.pid, done=10, total=25)   # the first sample after the stall
    ev = asyncio.run(_first_event(ShardWatchTrigger(ctx.serialize(), 1, close_incidents=ev["still_open"]), 30)).payload
    assert ev["status"] == "resumed" and ev["closed"] == [stall] and ev["still_open"] == []
