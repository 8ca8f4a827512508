"""Each signal on its own: real HTTP servers for health, real processes for /proc, a scripted GPU sampler."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagleflow.layout import RunLayout
from eagleflow.watchdog.policy import decide
from eagleflow.watchdog.signals import (GpuReading, WatchedJob, WatchMemory, check_health, memory_path, observe,
                                        read_gpus, read_process)
from tests.fixtures.watchdog_jobs import backdate_record, kill_group, spawn_sleeper, watch_config, write_heartbeat


class _Health(BaseHTTPRequestHandler):
    delay_s = 0.0
    status = 200

    def do_GET(self):
        time.sleep(self.delay_s)
        self.send_response(self.status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server():
    servers = []

    def make(delay_s=0.0, status=200):
        handler = type("H", (_Health,), {"delay_s": delay_s, "status": status})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"
    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.timeout(30)
def test_health_ok_timeout_http_error_and_refused(http_server):
    assert check_health(http_server(), 2).outcome == "ok"
    slow = check_health(http_server(delay_s=1.5), 0.5)
    assert slow.outcome == "timeout" and not slow.ok and 0.4 < slow.latency_s < 1.4
    assert check_health(http_server(status=503), 2).outcome == "http 503"
    from tests.fixtures.smtp import free_port
    assert check_health(f"http://127.0.0.1:{free_port()}", 2).outcome == "refused"
    assert check_health(None, 2).outcome == "no server info"


@pytest.mark.timeout(30)
def test_health_names_the_error_when_the_server_drops_the_request():
    # the check goes through serving/client: a connection closed without an answer is named, not a timeout
    import socket
    srv = socket.create_server(("127.0.0.1", 0))

    def drop_one():
        conn, _ = srv.accept()
        conn.recv(65536)   # read the request first: closing then sends FIN, not RST
        conn.close()
    t = threading.Thread(target=drop_one, daemon=True)
    t.start()
    try:
        h = check_health(f"http://127.0.0.1:{srv.getsockname()[1]}", 5)
    finally:
        t.join(5)
        srv.close()
    assert h.checked and not h.ok and h.outcome.startswith("error: RemoteDisconnected: "), h
    assert h.read_at is not None and h.latency_s < 5


class ScriptedGpus:
    """GPU readings a test dictates (the real probes need a driver these machines lack)."""

    def __init__(self, util, used=92_262.0):
        self.util, self.used = util, used

    def sample(self):
        return [GpuReading(index=i, name="RTX PRO 6000", memory_used_mib=self.used, memory_total_mib=97_887,
                           utilization_pct=self.util, held=self.used > 16) for i in range(8)]


def test_gpu_window_needs_idle_held_readings_for_the_whole_window(tmp_path):
    cfg = watch_config(tmp_path, gpu_window_s=20).model_copy(update={"node": watch_config(tmp_path).node.model_copy(
        update={"has_gpu": True})})
    mem = WatchMemory()
    s = read_gpus(cfg, ScriptedGpus(0), mem, now=1000.0, samples=2, spacing_s=0)
    assert s.idle_held_since == 1000.0 and s.busy_now is False
    s = read_gpus(cfg, ScriptedGpus(35), mem, now=1010.0, samples=1, spacing_s=0)
    assert s.idle_held_since is None and s.busy_now and s.max_util_window[0] == 35
    read_gpus(cfg, ScriptedGpus(0), mem, now=1020.0, samples=1, spacing_s=0)
    s = read_gpus(cfg, ScriptedGpus(0), mem, now=1045.0, samples=1, spacing_s=0)
    assert s.idle_held_since == 1020.0 and s.max_util_window[0] == 0  # the 35 % look left the 20 s window
    assert read_gpus(watch_config(tmp_path), None, WatchMemory(), now=1.0).applicable is False


def test_gpu_probe_failure_is_reported_not_a_stall(tmp_path):
    cfg = watch_config(tmp_path)
    cfg = cfg.model_copy(update={"node": cfg.node.model_copy(update={"has_gpu": True})})

    class Broken:
        def sample(self):
            raise RuntimeError("NVMLError_DriverNotLoaded")
    s = read_gpus(cfg, Broken(), WatchMemory(), now=1.0)
    assert s.applicable and not s.readings and "NVMLError_DriverNotLoaded" in s.note


@pytest.mark.timeout(30)
def test_process_signal_alive_stopped_gone_and_d_state_memory(tmp_path):
    cfg = watch_config(tmp_path)
    layout = RunLayout.for_run(cfg, "r1")
    p = spawn_sleeper(layout, "worker_shard_00000")
    try:
        mem = WatchMemory()
        sig = read_process(layout, "worker_shard_00000", mem, now=10.0)
        assert sig.recorded and sig.alive and sig.state in ("S", "R") and not sig.d_state
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert read_process(layout, "worker_shard_00000", mem, now=11.0).stopped
        # D state cannot be produced on demand: the memory logic is checked on its own key
        key = next(iter([f"{p.pid}:{p.start_ticks}"]))
        mem.d_since[key] = 5.0
        os.kill(p.pid, signal.SIGCONT)
        read_process(layout, "worker_shard_00000", mem, now=12.0)
        assert key not in mem.d_since  # left D: the next D episode starts a new clock
    finally:
        kill_group(p.pgid)
    time.sleep(0.3)
    gone = read_process(layout, "worker_shard_00000", WatchMemory(), now=13.0)
    assert gone.recorded and not gone.alive
    assert not read_process(layout, "worker_shard_00009", WatchMemory(), now=13.0).recorded


@pytest.mark.timeout(30)
def test_observe_asks_the_server_only_once_progress_is_stale(tmp_path, http_server):
    cfg = watch_config(tmp_path, stall_after_s=3)
    layout = RunLayout.for_run(cfg, "r1")
    url = http_server()
    os.makedirs(str(layout.run_dir), exist_ok=True)
    with open(str(layout.server_info_file), "w") as f:
        f.write(f'{{"url": "{url}"}}')
    p = spawn_sleeper(layout, "worker_shard_00001")
    srv = spawn_sleeper(layout, "capture_server")
    backdate_record(layout, "worker_shard_00001", 600)
    try:
        job = WatchedJob(shard=1, num_shards=4)
        write_heartbeat(layout, 1, pid=p.pid, progress_ago_s=1, in_flight=[("r", 1, 60)])
        o = observe(cfg, layout, job, WatchMemory())
        assert not o.health.checked and decide(o, cfg).verdict == "healthy"
        # no pace yet: a request is hung only past the stall bound (3 + 1 + 4 + 1 = 9 s here)
        write_heartbeat(layout, 1, pid=p.pid, progress_ago_s=6, in_flight=[("r", 6, 60)])
        o = observe(cfg, layout, job, WatchMemory())
        assert o.health.checked and o.health.ok
        d = decide(o, cfg)
        assert d.verdict == "slow" and "server answered /health_generate in" in d.summary
    finally:
        kill_group(p.pgid)
        kill_group(srv.pgid)


@pytest.mark.slow  # runs the CLI in subprocesses
@pytest.mark.timeout(60)
def test_watch_cli_exit_code_says_the_verdict_and_memory_persists(tmp_path):
    cfg = watch_config(tmp_path)
    layout = RunLayout.for_run(cfg, "r1")
    cfg_file = tmp_path / "run-config.json"
    cfg_file.write_text(cfg.model_dump_json())
    p = spawn_sleeper(layout, "worker_shard_00002")
    argv = [sys.executable, "-m", "eagleflow.cli", "watch", "--config", str(cfg_file), "--run-id", "r1",
            "--shard", "2"]
    try:
        write_heartbeat(layout, 2, pid=p.pid, progress_ago_s=0, done=3, total=9)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.startswith("HEALTHY shard 2/4 on test-node: 3/9 samples done")
        assert os.path.exists(memory_path(layout, WatchedJob(2, 4)))
        write_heartbeat(layout, 2, pid=p.pid, state="failed", error="OSError: [Errno 27] File too large")
        r = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 6 and '"verdict": "failed"' in r.stdout and "File too large" in r.stdout
        kill_group(p.pgid)
        time.sleep(0.3)
        write_heartbeat(layout, 2, pid=p.pid, done=4, total=9)
        r = subprocess.run(argv + ["--follow"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 5 and "DEAD shard 2/4" in r.stdout
        bad = subprocess.run(argv[:-1] + ["7"], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "outside 0..3" in bad.stderr
    finally:
        kill_group(p.pgid)


@pytest.mark.slow  # runs the fake nvidia-smi in subprocesses
@pytest.mark.timeout(90)
def test_gpu_signal_through_the_real_probe_on_a_fake_nvidia_smi(tmp_path, http_server):
    """The seeds' picture (8 GPUs holding 90 GB at 0 %) read by eagleflow.gpu's smi probe via `eagleflow watch`."""
    from tests.fixtures.gpu_scenarios import fake_smi_env, gpu, write_scenario

    cfg = watch_config(tmp_path, gpu_window_s=1.0, stall_after_s=3)
    cfg = cfg.model_copy(update={"node": cfg.node.model_copy(update={"has_gpu": True}),
                                 "gpu": cfg.gpu.model_copy(update={"probe": "smi"})})
    layout = RunLayout.for_run(cfg, "r1")
    cfg_file = tmp_path / "run-config.json"
    cfg_file.write_text(cfg.model_dump_json())
    os.makedirs(str(layout.run_dir), exist_ok=True)
    with open(str(layout.server_info_file), "w") as f:
        f.write(f'{{"url": "{http_server(delay_s=5)}"}}')  # answers too late: a frozen server
    scenario = write_scenario(tmp_path / "smi.json", {"driver": True, "gpus": [
        gpu(i, 92_262, total=97_887, util=0, name="NVIDIA RTX PRO 6000 Blackwell") for i in range(8)]})
    env = {**os.environ, **fake_smi_env(scenario, sys.executable)}
    p = spawn_sleeper(layout, "worker_shard_00000")
    srv = spawn_sleeper(layout, "capture_server")
    backdate_record(layout, "worker_shard_00000", 600)
    argv = [sys.executable, "-m", "eagleflow.cli", "watch", "--config", str(cfg_file), "--run-id", "r1",
            "--shard", "0", "--json"]
    try:
        write_heartbeat(layout, 0, pid=p.pid, progress_ago_s=30, in_flight=[("r", 30, 600)], done=18, total=37)
        first = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        time.sleep(1.2)
        write_heartbeat(layout, 0, pid=p.pid, progress_ago_s=32, in_flight=[("r", 32, 600)], done=18, total=37)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        from eagleflow.watchdog.diagnosis import StallDiagnosis
        d = StallDiagnosis.from_json(second.stdout.strip().splitlines()[-1])
        assert second.returncode == 4 and d.verdict == "stalled", (first.stderr, second.stderr)
        assert "GPUs 0-7 hold 90.1 GB at 0 % for" in d.summary
        assert "server /health_generate timed out after 1 s" in d.summary
        assert len(d.gpus) == 8 and all(g.held and g.utilization_pct == 0 for g in d.gpus)
        # the same stall with busy GPUs and a late health answer reads as slow (a long kernel, not a hang)
        write_scenario(scenario, {"driver": True, "gpus": [gpu(i, 92_262, total=97_887, util=97) for i in range(8)]})
        # a live worker rewrites its heartbeat while the watch runs (however long the machine makes it take)
        last_progress = time.time() - 40
        alive = threading.Event()

        def rewrite():
            while not alive.wait(0.5):
                write_heartbeat(layout, 0, pid=p.pid, progress_ago_s=time.time() - last_progress,
                                in_flight=[("r", time.time() - last_progress, 600)], done=18, total=37)
        writer = threading.Thread(target=rewrite, daemon=True)
        write_heartbeat(layout, 0, pid=p.pid, progress_ago_s=40, in_flight=[("r", 40, 600)], done=18, total=37)
        writer.start()
        try:
            busy = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        finally:
            alive.set()
            writer.join()
        d = StallDiagnosis.from_json(busy.stdout.strip().splitlines()[-1])
        assert d.verdict == "slow" and busy.returncode == 3, d.summary
        assert "GPUs 0-7 busy (97 % now" in d.summary
    finally:
        kill_group(p.pgid)
        kill_group(srv.pgid)


@pytest.mark.timeout(30)
def test_a_dead_workers_count_comes_from_its_manifest_not_its_lagging_heartbeat(tmp_path):
    import json as _json
    cfg = watch_config(tmp_path)
    layout = RunLayout.for_run(cfg, "r1")
    p = spawn_sleeper(layout, "worker_shard_00001")
    write_heartbeat(layout, 1, pid=p.pid, done=1, total=6, progress_ago_s=1)
    lines = [_json.dumps({"id": f"s:{i}", "index": i, "file": f"{i:08d}.safetensors", "tokens": 5, "bytes": 9,
                          "sha256": "0" * 64}) for i in (1, 5)]
    with open(str(layout.manifest_file(1)), "w") as f:
        f.write("\n".join(lines) + "\n" + '{"id": "s:9", "ind')  # a crash mid-append leaves a partial line
    job = WatchedJob(shard=1, num_shards=4)
    assert observe(cfg, layout, job, WatchMemory()).heartbeat.done == 1  # alive: the heartbeat is its word
    kill_group(p.pgid)
    for _ in range(50):
        if not os.path.exists(f"/proc/{p.pid}"):
            break
        time.sleep(0.05)
    d = decide(observe(cfg, layout, job, WatchMemory()), cfg)
    assert d.verdict == "dead" and "2/6 samples done" in d.summary, d.summary


@pytest.mark.timeout(30)
def test_a_refused_pid_record_is_named_as_refused_not_absent(tmp_path):
    """A record others could have written (an older eagleflow's 0664 file) is never trusted or signalled; the
    diagnosis says it is refused and why, so the operator fixes the record instead of hunting a missing file."""
    cfg = watch_config(tmp_path)
    layout = RunLayout.for_run(cfg, "r1")
    p = spawn_sleeper(layout, "worker_shard_00002")
    try:
        write_heartbeat(layout, 2, pid=p.pid, done=3, total=6, progress_ago_s=1)
        os.chmod(layout.pid_file("worker_shard_00002"), 0o664)
        sig = read_process(layout, "worker_shard_00002", WatchMemory(), now=10.0)
        assert not sig.recorded and not sig.alive and sig.pid is None
        assert sig.refused and "writable" in sig.refused, sig.refused
        d = decide(observe(cfg, layout, WatchedJob(shard=2, num_shards=4), WatchMemory()), cfg)
        assert d.verdict == "dead" and "pid record is refused" in d.summary and "(no pid file)" not in d.summary
        assert str(layout.pid_file("worker_shard_00002")) in d.summary
        assert os.path.exists(f"/proc/{p.pid}")          # the process it names was left alone
    finally:
        kill_group(p.pgid)
    assert read_process(layout, "worker_shard_00009", WatchMemory(), now=13.0).refused is None
