"""Evidence true at the moment it is stated, slow judged against the run's own pace, causes named (issue 15).

Real processes (detached sleepers with pid records) and real heartbeat files; the health check and the
clock are injected so "a health check that takes 19 s" runs in milliseconds.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.heartbeat import Heartbeat, InFlight
from eagleflow.layout import RunLayout
from eagleflow.watchdog.policy import decide
from eagleflow.watchdog.signals import (HealthSignal, WatchedJob, WatchMemory, kernel_oom_killed, observe,
                                        pace_of)
from tests.fixtures.waiting import wait_until
from tests.fixtures.watchdog_jobs import backdate_record, kill_group, spawn_sleeper, wait_gone, watch_config

REPO = Path(__file__).resolve().parents[2]


def stop_and_wait(pid: int) -> None:
    """SIGSTOP, then wait until /proc shows state T (delivery is not instantaneous on a busy machine)."""
    from eagleflow.nodes.proc import read_proc_state
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: (st := read_proc_state(pid)) is None or st.state in ("T", "t"), 5, every_s=0.02,
               what=f"pid {pid} stopped (state T)")


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _hb(layout: RunLayout, shard: int, *, pid: int, now: float, written_at: float, progress_at: float,
        in_flight_since: float | None = None, gaps: list[float] | None = None, done: int = 10, total: int = 100,
        resumed: int = 0, requests: list[float] | None = None) -> None:
    hb = Heartbeat(job=f"extract shard {shard}/4", pid=pid, state="running", started_at=now - 600, done=done,
                   total=total, resumed=resumed, last_progress_at=progress_at,
                   in_flight=[] if in_flight_since is None else [InFlight(id="r1", since=in_flight_since, tokens=300,
                                                                          timeout_s=600)],
                   extra={"recent_gaps_s": gaps or [], "recent_request_s": requests or []})
    path = Path(str(layout.heartbeat_file(shard)))
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(hb.to_json())
    data["time"] = written_at
    path.write_text(json.dumps(data))


@pytest.fixture
def job(tmp_path):
    cfg = watch_config(tmp_path, stall_after_s=15, health_timeout_s=20, poll_interval_s=20, startup_grace_s=120,
                       gpu_window_s=20, d_state_after_s=20)
    cfg.capture.heartbeat_interval_s = 2.0
    layout = RunLayout.for_run(cfg, "r1")
    os.makedirs(str(layout.run_dir), exist_ok=True)
    Path(str(layout.server_info_file)).write_text('{"url": "http://127.0.0.1:9"}')
    worker = spawn_sleeper(layout, "worker_shard_00000")
    server = spawn_sleeper(layout, "capture_server")
    backdate_record(layout, "worker_shard_00000", 600)
    backdate_record(layout, "capture_server", 700)
    yield cfg, layout, worker, server
    kill_group(worker.pgid)
    kill_group(server.pgid)


def test_a_19_s_health_check_does_not_age_a_heartbeat_the_worker_kept_rewriting(job):
    """The issue's false evidence: heartbeat read, 19 s health check, age judged after it -> '20 s ago'."""
    cfg, layout, worker, _ = job
    t0 = time.time()
    clock = FakeClock(t0)
    _hb(layout, 0, pid=worker.pid, now=t0, written_at=t0 - 1, progress_at=t0 - 16, in_flight_since=t0 - 16)

    def slow_health(url, timeout_s):
        # 19 s pass; the live worker rewrote its heartbeat every 2 s meanwhile (its last write 0.5 s ago)
        clock.t += 19
        _hb(layout, 0, pid=worker.pid, now=clock.t, written_at=clock.t - 0.5, progress_at=t0 - 16,
            in_flight_since=t0 - 16)
        return HealthSignal(checked=True, ok=False, outcome="timeout", latency_s=19.0, url=url, read_at=clock.t)

    obs = observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(), health_check=slow_health,
                  clock=clock)
    assert obs.health.checked and obs.heartbeat_read_at == pytest.approx(t0 + 19)
    d = decide(obs, cfg)
    assert "heartbeat was last written" not in d.summary, d.summary
    # the cause is named: the server, not the healthy worker
    assert d.verdict == "stalled" and d.cause == "capture_server" and "timed out after 20 s" in d.summary

    # the same check while the worker really is frozen: its heartbeat is then 20 s old when read
    clock.t = t0
    _hb(layout, 0, pid=worker.pid, now=t0, written_at=t0 - 1, progress_at=t0 - 16, in_flight_since=t0 - 16)

    def slow_health_frozen(url, timeout_s):
        clock.t += 19
        return HealthSignal(checked=True, ok=True, outcome="ok", latency_s=0.01, url=url, read_at=clock.t)

    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(),
                       health_check=slow_health_frozen, clock=clock), cfg)
    assert "heartbeat was last written 20 s before it was read" in d.summary and d.cause == "worker"


def test_a_slow_run_is_judged_against_its_own_pace_not_stall_after(job):
    cfg, layout, worker, _ = job
    now = time.time()
    gaps = [19.0, 21.0, 20.5, 20.0, 19.5, 22.0, 20.0]
    _hb(layout, 0, pid=worker.pid, now=now, written_at=now - 0.5, progress_at=now - 25, in_flight_since=now - 25,
        gaps=gaps, requests=[40.0] * 7)
    pace = pace_of(Heartbeat.read(str(layout.heartbeat_file(0))), cfg)
    assert pace.gap_p95_s == 22.0 and pace.stale_after_s == 66.0
    called = []
    obs = observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(),
                  health_check=lambda u, t: called.append(u) or HealthSignal())
    d = decide(obs, cfg)
    # 25 s without a sample is this run's normal pace: healthy, no health check, look again when it turns stale
    assert d.verdict == "healthy" and not called and "slow run" in d.summary
    assert d.recheck_in_s == pytest.approx(41, abs=1.5)


def test_hung_generate_is_a_server_stall_even_though_health_answers(job):
    cfg, layout, worker, _ = job
    now = time.time()
    fast = [0.4] * 20
    _hb(layout, 0, pid=worker.pid, now=now, written_at=now - 0.5, progress_at=now - 16, in_flight_since=now - 16,
        gaps=fast, requests=[0.8] * 20)
    ok = lambda u, t: HealthSignal(checked=True, ok=True, outcome="ok", latency_s=0.05, url=u, read_at=time.time())
    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(), health_check=ok), cfg)
    assert d.verdict == "stalled" and d.cause == "capture_server", d.summary
    assert "but its /generate does not: request r1 in flight for 16 s" in d.summary


def test_busy_gpus_exempt_a_late_health_answer_and_a_long_request(tmp_path):
    from tests.unit.test_watchdog_policy import NOW, busy_gpus, cfg, obs
    late = HealthSignal(checked=True, ok=False, outcome="timeout", latency_s=20)
    d = decide(obs(progress_ago=40, written_ago=1, health=late, gpu=busy_gpus()), cfg())
    assert d.verdict == "slow", d.summary
    answered = HealthSignal(checked=True, ok=True, outcome="ok", latency_s=0.1)
    d = decide(obs(progress_ago=40, written_ago=1, health=answered, gpu=busy_gpus(),
                   in_flight=[InFlight(id="r", since=NOW - 40, tokens=8000, timeout_s=460)]), cfg())
    assert d.verdict == "slow", d.summary


def test_a_stopped_server_is_recovered_without_waiting_for_a_health_timeout(job):
    cfg, layout, worker, server = job
    now = time.time()
    _hb(layout, 0, pid=worker.pid, now=now, written_at=now - 0.5, progress_at=now - 20, in_flight_since=now - 20)
    stop_and_wait(server.pid)
    called = []
    obs = observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(),
                  health_check=lambda u, t: called.append(u) or HealthSignal())
    d = decide(obs, cfg)
    assert not called and "server pid" in obs.health.skipped and "stopped" in obs.health.skipped
    assert d.verdict == "stalled" and d.cause == "capture_server" and "(state T: SIGSTOP" in d.summary


def test_a_frozen_worker_is_counted_from_its_manifest_not_inside_the_startup_grace(job):
    cfg, layout, worker, _ = job
    now = time.time()
    # the worker stored 5 samples and was SIGSTOPped before its heartbeat thread wrote any of them
    shard_dir = Path(str(layout.shard_dir(0)))
    shard_dir.mkdir(parents=True, exist_ok=True)
    with open(layout.manifest_file(0), "w") as f:
        for i in range(5):
            f.write(json.dumps({"id": f"s{i}", "index": i * 4, "file": f"{i * 4:08d}.safetensors", "tokens": 300,
                                "bytes": 10, "sha256": "0" * 64}) + "\n")
    _hb(layout, 0, pid=worker.pid, now=now, written_at=now - 20, progress_at=now - 20, in_flight_since=now - 20,
        done=0, total=450)
    rec = json.loads(Path(str(layout.pid_file("worker_shard_00000"))).read_text())
    rec["started_at"] = now - 25
    Path(str(layout.pid_file("worker_shard_00000"))).write_text(json.dumps(rec))
    stop_and_wait(worker.pid)
    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(),
                       health_check=lambda u, t: HealthSignal()), cfg)
    assert d.verdict == "stalled" and d.cause == "worker", d.summary
    assert "5/450 done" in d.summary and "startup grace" not in d.summary
    assert "stopped (state T: SIGSTOP" in d.summary


def test_a_kill_9_and_an_oom_kill_are_told_apart(job, tmp_path):
    cfg, layout, worker, _ = job
    now = time.time()
    _hb(layout, 0, pid=worker.pid, now=now, written_at=now - 1, progress_at=now - 1, in_flight_since=now - 1)
    os.killpg(worker.pgid, signal.SIGKILL)
    wait_gone(worker.pid)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,1;systemd: started\n")
    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(), kmsg_path=str(kmsg)), cfg)
    assert d.verdict == "dead" and d.cause == "worker"
    # a reaped worker leaves only its silence; an unreaped one (zombie) its exit status: both name SIGKILL
    assert "SIGKILL" in d.summary and "no OOM kill of it" in d.summary, d.summary
    kmsg.write_text(f"3,2,2;Out of memory: Killed process {worker.pid} (python) total-vm:1kB\n")
    assert kernel_oom_killed(worker.pid, str(kmsg)) is True
    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(), kmsg_path=str(kmsg)), cfg)
    assert "the kernel's OOM killer killed it" in d.summary
    assert kernel_oom_killed(worker.pid, str(tmp_path / "unreadable")) is None


def test_every_shipped_config_detects_a_stall_within_60_s():
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        wd = load_config(path).watchdog
        bound = wd.stall_after_s + wd.RECHECK_SLACK_S + 2 * wd.WATCH_COMMAND_ALLOWANCE_S + wd.health_timeout_s
        assert wd.detection_bound_s == bound
        assert bound <= 60.0, f"{path.name}: detection bound {bound:.0f} s is over the 60 s promise"


def test_one_incident_per_node_and_cause(tmp_path):
    from eagleflow.watchdog.incidents import history, open_or_join, record_recovery
    a, opened = open_or_join(tmp_path, node="n1", cause="capture_server", run_id="r", shard=0, summary="x",
                             join_window_s=40, now=1000.0)
    b, opened_b = open_or_join(tmp_path, node="n1", cause="capture_server", run_id="r", shard=3, summary="y",
                               join_window_s=40, now=1010.0)
    c, opened_c = open_or_join(tmp_path, node="n1", cause="worker", run_id="r", shard=1, summary="z",
                               join_window_s=40, now=1011.0)
    assert opened and not opened_b and opened_c and a["id"] == b["id"] != c["id"]
    assert sorted(b["shards"]) == ["0", "3"]
    record_recovery(tmp_path, a, {"ok": True, "action": "restarted"})
    ended = json.loads(next((tmp_path / "incidents").glob("n1.capture_server.json")).read_text())["ended_at"]
    _, late = open_or_join(tmp_path, node="n1", cause="capture_server", run_id="r", shard=5, summary="w",
                           join_window_s=40, now=ended + 10)
    assert not late  # shard 5 saw the same frozen server a little later: joins, no second mail
    again_inc, again = open_or_join(tmp_path, node="n1", cause="capture_server", run_id="r", shard=0, summary="u",
                                    join_window_s=40, now=ended + 11)
    assert again  # shard 0 stalling again is a new fault, not the same one seen twice
    ended2 = record_recovery(tmp_path, again_inc, {"ok": True, "action": "restarted"})["ended_at"]
    _, fresh = open_or_join(tmp_path, node="n1", cause="capture_server", run_id="r", shard=6, summary="v",
                            join_window_s=40, now=ended2 + 100)
    assert fresh  # the same cause long after the incident ended: a new incident
    assert [e["event"] for e in history(tmp_path)].count("opened") == 4


def test_mail_links_use_airflows_configured_base_url(monkeypatch):
    from eagleflow.airflow.alerts import airflow_base_url
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.org/")
    assert airflow_base_url("http://localhost:8080") == "https://airflow.example.org"
    monkeypatch.delenv("AIRFLOW__API__BASE_URL")
    assert airflow_base_url("http://fallback:8080") in ("http://fallback:8080",)


def test_a_sample_completed_during_a_timed_out_health_check_proves_the_server_works(job):
    """A CPU node (no GPU signal): the probe queued behind a 16 s forward; meanwhile a sample completed."""
    cfg, layout, worker, _ = job
    t0 = time.time()
    clock = FakeClock(t0)
    _hb(layout, 0, pid=worker.pid, now=t0, written_at=t0 - 1, progress_at=t0 - 15, in_flight_since=t0 - 15,
        gaps=[0.3] * 20, requests=[0.6] * 20)

    def queued_health(url, timeout_s):
        clock.t += 20
        _hb(layout, 0, pid=worker.pid, now=clock.t, written_at=clock.t - 0.5, progress_at=t0 + 1,
            in_flight_since=t0 + 1, gaps=[0.3] * 19 + [16.0], requests=[0.6] * 19 + [16.0], done=11)
        return HealthSignal(checked=True, ok=False, outcome="timeout", latency_s=20.0, url=url, read_at=clock.t)

    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(), health_check=queued_health,
                       clock=clock), cfg)
    assert d.verdict == "slow", d.summary
    assert "a sample completed at" in d.summary and "while it waited (busy, not hung)" in d.summary


def test_a_slow_health_answer_means_a_queue_not_a_hung_generate(job):
    """The probe took 17 s (one forward now): a request 48 s old behind two others is queued, not hung."""
    cfg, layout, worker, _ = job
    now = time.time()
    _hb(layout, 0, pid=worker.pid, now=now, written_at=now - 0.5, progress_at=now - 32, in_flight_since=now - 48,
        gaps=[0.3] * 20, requests=[0.6] * 20)
    slow_ok = lambda u, t: HealthSignal(checked=True, ok=True, outcome="ok", latency_s=17.0, url=u, read_at=time.time())
    d = decide(observe(cfg, layout, WatchedJob(shard=0, num_shards=4), WatchMemory(), health_check=slow_ok), cfg)
    assert d.verdict == "slow" and "server answered /health_generate in 17.0 s" in d.summary, d.summary
