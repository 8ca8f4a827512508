"""A server start is exclusive like a worker's: two concurrent starts (shard retries) give one server."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.phases.extract import lifecycle as capture
from eagleflow.phases.generate import lifecycle as generate
from eagleflow.nodes import LocalNode


class _Layout:
    run_id = "r"

    def __init__(self, root: Path):
        self.root = root
        self.locks_dir = root / "locks"
        self.generate_server_info_file = root / "generate_server.json"
        self.server_info_file = root / "capture_server.json"
        self.owned_roots = (root,)   # RunLayout.owned_roots: the run's folders are made or proven ours

    def pid_file(self, role):
        return self.root / "pids" / f"r.{role}.json"

    def lock_file(self, role):
        return self.root / "locks" / f"r.{role}.lock"

    def restart_lock_file(self, role):
        return self.root / "locks" / f"r.{role}.restart.lock"

    def log_file(self, role):
        return self.root / "logs" / f"r.{role}.log"


def _cfg():   # what the starts read of a config: the engines of capture and generation
    return SimpleNamespace(capture=SimpleNamespace(backend="hf"), generate=SimpleNamespace(backend=None))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start,role", [(generate.start_generate_server, generate.SERVER_ROLE),
                                        (capture.start_capture_server, capture.SERVER_ROLE)])
def test_a_second_start_that_raced_the_first_attaches_instead_of_spawning(tmp_path, start, role):
    node = LocalNode(name="t")
    ctx = SimpleNamespace(node=node, layout=_Layout(tmp_path), cfg=_cfg(),
                          eagleflow_argv=lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    first, started = start(ctx)
    assert started
    try:
        real = node.live_record
        seen = []

        def raced(pid_file):   # the second retry looked before the first had recorded its server
            if not seen:
                seen.append(pid_file)
                return None
            return real(pid_file)
        node.live_record = raced
        second, started2 = start(ctx)
        node.live_record = real
        assert (second.pid, started2) == (first.pid, False)
        assert node.live_record(str(ctx.layout.pid_file(role))).pid == first.pid
    finally:
        node.stop_recorded(str(ctx.layout.pid_file(role)), grace_s=2)


@pytest.mark.timeout(60)
def test_a_retry_after_a_stall_blamed_on_the_server_stops_the_recorded_worker_and_restarts_the_server(tmp_path):
    layout = _Layout(tmp_path)
    layout.generate_shard_dir = lambda s: tmp_path / "generated" / f"shard_{s:05d}"
    layout.generate_shard_dir(0).mkdir(parents=True)
    node = LocalNode(name="t")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ctx = SimpleNamespace(node=node, layout=layout, cfg=_cfg(),
                          eagleflow_argv=lambda *a: sleep)
    server, _ = generate.start_generate_server(ctx)
    role = generate.worker_role(0)
    worker = node.spawn_detached(sleep, role=role, pid_file=str(layout.pid_file(role)),
                                 log_file=str(layout.log_file(role)))
    try:
        assert not generate.stop_after_server_stall(ctx, 0)      # no stall recorded: nothing stopped
        assert not generate.record_server_stall(ctx, 0, {"status": "stalled", "cause": "worker"})
        assert not generate.record_server_stall(ctx, 0, {"status": "dead", "cause": "capture_server"})
        assert generate.record_server_stall(ctx, 0, {"status": "stalled", "cause": "capture_server",
                                                     "subject": "STALLED generate shard 0/1"})
        said = []
        assert generate.stop_after_server_stall(ctx, 0, grace_s=2, log=said.append)
        assert "STALLED generate shard 0/1" in said[0]
        fresh = node.live_record(str(layout.pid_file(generate.SERVER_ROLE)))   # the stalled one, replaced
        assert fresh is not None and fresh.pid != server.pid
        assert node.live_record(str(layout.pid_file(role))) is None
        assert not (layout.generate_shard_dir(0) / generate.SERVER_STALL).exists()
        assert not generate.stop_after_server_stall(ctx, 0)      # once: the next retry attaches as usual
    finally:
        for pid_file in (layout.pid_file(generate.SERVER_ROLE), layout.pid_file(role)):
            node.stop_recorded(str(pid_file), grace_s=2)
    assert server.pid != worker.pid
