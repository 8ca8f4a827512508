"""Liveness from true evidence (issue 52 item 6): a late heartbeat is judged by the CPU time the job uses.

Real detached processes with pid records, the real ``eagleflow watch --train`` command behind the real
TrainWatchTrigger: a trainer-like process that keeps burning CPU while its heartbeat file is older than the
heartbeat window (what a starved heartbeat thread looks like on a node at load 50) is slow or starting, never
stalled; stopped with SIGSTOP it is stalled at once (state T); see test_watchdog_trigger for a live job that
uses no CPU at all. The false "STALLED training" mails of the fault drills came from the first case.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import TrainWatchTrigger
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from eagleflow.nodes.proc import read_stat
from eagleflow.watchdog.policy import frozen_window_s
from tests.fixtures.waiting import wait_until
from tests.fixtures.watchdog_jobs import backdate_record, kill_group, watch_config

# 50 % of one core: busy 50 ms, asleep 50 ms (a trainer stepping on the CPU)
BURN = "import time\nwhile True:\n    t = time.monotonic()\n    while time.monotonic() - t < 0.05: pass\n    time.sleep(0.05)"
SPIN = "while True: pass"


@pytest.fixture
def run(tmp_path):
    cfg = watch_config(tmp_path, startup_grace_s=120)   # the drills' case: the trainer inside its startup grace
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "manual__2026-12-06T04:00:00+00:00"))
    ctx.write_run_config()
    started: list = []
    yield ctx, started
    for p in started:
        kill_group(p.pgid)


def spawn(ctx: RunContext, role: str, code: str):
    return LocalNode(name="test-node").spawn_detached(
        [sys.executable, "-c", code], role=role, pid_file=str(ctx.layout.pid_file(role)),
        log_file=str(ctx.layout.log_file(role)))


def write_late_train_heartbeat(ctx: RunContext, pid: int, *, written_ago_s: float, done: int = 0) -> None:
    """The trainer's heartbeat as its (starved, or frozen) writer left it ``written_ago_s`` ago."""
    now = time.time()
    hb = Heartbeat(job="train", pid=pid, state="running", started_at=now - 30, done=done, total=200,
                   unit="steps", last_progress_at=now - 30)
    path = str(ctx.layout.train_heartbeat_file)
    hb.write(path)
    data = json.loads(Path(path).read_text())
    data["time"] = now - written_ago_s
    Path(path).write_text(json.dumps(data))


async def _events_within(trigger: TrainWatchTrigger, seconds: float) -> list[dict]:
    """Every event the trigger yields within ``seconds`` (it yields one only on a verdict it acts on)."""
    agen = trigger.run()
    try:
        return [(await asyncio.wait_for(agen.__anext__(), seconds)).payload]
    except asyncio.TimeoutError:
        return []
    finally:
        await agen.aclose()


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: (st := read_stat(pid)) is None or st.state in ("T", "t"), 5, every_s=0.02,
               what=f"pid {pid} stopped (state T)")


@pytest.mark.timeout(120)
def test_a_trainer_burning_cpu_with_a_late_heartbeat_is_slow_not_stalled_until_it_is_stopped(run):
    ctx, started = run
    window = frozen_window_s(ctx.cfg)
    p = spawn(ctx, "trainer", BURN)
    started.append(p)
    write_late_train_heartbeat(ctx, p.pid, written_ago_s=40)   # past the 10 s heartbeat window from the start

    # inside its startup grace (the drills' false alarm): watched over more than the CPU window, no event
    t0 = time.time()
    events = asyncio.run(_events_within(TrainWatchTrigger(ctx.serialize()), window + 5))
    assert events == [], events
    d = TrainWatchTrigger(ctx.serialize()).look_once(ctx)   # the look a retry takes, the same memory
    assert d.verdict == "starting", d.summary
    assert f"worker pid {p.pid} is alive but its heartbeat was last written" in d.summary
    assert "is using CPU (" in d.summary and "slow, not frozen" in d.summary, d.summary

    # past the grace: slow, not stalled (the same process: the CPU reads go on)
    backdate_record(ctx.layout, "trainer", 600)
    write_late_train_heartbeat(ctx, p.pid, written_ago_s=60, done=40)
    d = TrainWatchTrigger(ctx.serialize()).look_once(ctx)
    assert d.verdict == "slow" and "slow, not frozen" in d.summary, d.summary
    assert time.time() - t0 >= window

    # SIGSTOP: stalled at the next look, blamed on the job's own process
    _stop(p.pid)
    t_stop = time.time()
    events = asyncio.run(_events_within(TrainWatchTrigger(ctx.serialize()), 30))
    assert len(events) == 1 and events[0]["status"] == "stalled", events
    assert f"worker pid {p.pid} is stopped (state T" in events[0]["diagnosis"], events[0]["diagnosis"]
    assert events[0]["detected_at"] - t_stop <= ctx.cfg.watchdog.detection_bound_s


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_under_a_cpu_burner_load_a_working_trainer_with_a_late_heartbeat_is_never_stalled(run):
    """Spinners at 3 per core (a few seconds over the CPU window, no more) compete with the trainer and with the
    watch's own commands: the trainer still gains CPU time between looks, so it stays starting, not stalled."""
    ctx, started = run
    window = frozen_window_s(ctx.cfg)
    p = spawn(ctx, "trainer", BURN)
    started.append(p)
    write_late_train_heartbeat(ctx, p.pid, written_ago_s=40)
    for i in range(3 * (os.cpu_count() or 2)):
        started.append(spawn(ctx, f"load_{i:02d}", SPIN))
    events = asyncio.run(_events_within(TrainWatchTrigger(ctx.serialize()), window + 4))
    load = os.getloadavg()[0]
    for q in started[1:]:
        kill_group(q.pgid)
    assert events == [], (events, f"load {load:.1f}")
    d = TrainWatchTrigger(ctx.serialize()).look_once(ctx)
    assert d.verdict == "starting" and "slow, not frozen" in d.summary, d.summary


def test_cpu_progress_is_compared_member_by_member_across_reads():
    """A member that exits takes nothing away, one that appears brings what it used, another leader (or a
    damaged memory) starts over: nothing is known about CPU before the first read."""
    from eagleflow.watchdog.signals import WatchMemory, track_cpu
    mem = WatchMemory()
    first = track_cpu(mem, "trainer", "100:5", {"100:5": 50, "101:6": 10}, now=1000.0)
    assert (first.quiet_since, first.first_at, first.last_gain_at, first.ticks) == (1000.0, 1000.0, None, 0)
    # 101 exited (its 10 ticks leave), 102 appeared with 3, the leader gained nothing: +3 ticks
    second = track_cpu(mem, "trainer", "100:5", {"100:5": 50, "102:9": 3}, now=1004.0)
    assert second.ticks == 3 and second.quiet_since == 1004.0 and second.last_gain_over_s == 4.0
    # nothing gained for 12 s: quiet since the last read that gained
    third = track_cpu(mem, "trainer", "100:5", {"100:5": 50, "102:9": 3}, now=1016.0)
    assert third.quiet_since == 1004.0 and third.ticks == 3 and third.last_gain_at == 1004.0
    # a new leader (a restarted trainer): starts over
    other = track_cpu(mem, "trainer", "200:7", {"200:7": 500}, now=1017.0)
    assert (other.quiet_since, other.first_at, other.last_gain_at) == (1017.0, 1017.0, None)
    # a damaged memory (numbers that are not, a clock gone back): starts over, never raises
    mem.cpu["trainer"] = {**mem.cpu["trainer"], "at": "soon"}
    assert track_cpu(mem, "trainer", "200:7", {"200:7": 900}, now=1018.0).first_at == 1018.0
    assert track_cpu(mem, "trainer", "200:7", {"200:7": 950}, now=1010.0).first_at == 1010.0
    mem.cpu = "garbage"   # type: ignore[assignment]
    assert track_cpu(mem, "trainer", "200:7", {"200:7": 950}, now=1020.0).members == 1


def test_group_cpu_ticks_reads_every_live_member_of_a_real_group(run):
    from eagleflow.nodes.proc import group_cpu_ticks
    ctx, started = run
    # a leader that burns CPU and a child of it (same group) that does too
    p = spawn(ctx, "trainer", "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
                              + BURN)
    started.append(p)
    wait_until(lambda: len(group_cpu_ticks(p.pgid)) == 2, 10, what="leader and child in the group")
    before = group_cpu_ticks(p.pgid)
    assert any(k.startswith(f"{p.pid}:") for k in before)
    wait_until(lambda: all(group_cpu_ticks(p.pgid).get(k, 0) > v for k, v in before.items()), 10,
               what="both members gained CPU ticks", describe=lambda: (before, group_cpu_ticks(p.pgid)))
    assert group_cpu_ticks(1) == {} and group_cpu_ticks(999_999_999) == {}
