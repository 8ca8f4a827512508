"""A retry looks before it acts (issue 27): the control plane dies mid-extraction, try 2 attaches.

Non-deferrable mode (``AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE=False``), so the watch runs inside the task's
own process. Try 1 is a real extraction ShardOperator in a process of its own: it starts the shard's detached
worker through the real code and watches it; that process is SIGKILLed mid-shard (the control plane gone,
the worker on the node untouched). Try 2 is the same operator with ``try_number=2``: it looks first (one
``eagleflow watch`` look), finds the worker healthy and attaches to it. The one worker finishes the shard:
the same pid throughout, one worker start in its log (no orphaned in-flight dump), every sample once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.engines.hf.server import DELAY_FILE_ENV
from eagleflow.phases.extract.lifecycle import start_capture_server, wait_capture_server_ready, worker_role
from eagleflow.heartbeat import Heartbeat
from tests.integration.test_watchdog_failures import N, _manifest, _run, started  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 20.0, "health_timeout_s": 5.0, "startup_grace_s": 60.0}

TRY_1 = """
import sys
from types import SimpleNamespace
from eagleflow.airflow.shard_operators import ShardOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.config import load_config
from eagleflow.layout import RunLayout

cfg = load_config(sys.argv[1])
ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, sys.argv[2]))
op = ShardOperator(phase="extract", task_id="extract_shard", shard=0)
assert not op.deferrable, "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE=False: the watch runs in this process"
print("try 1 watching", flush=True)
op.run(ctx, {"ti": SimpleNamespace(try_number=1)})
"""


def test_try_2_after_a_killed_control_plane_attaches_to_the_live_worker(demo_assets, tmp_path, started,
                                                                        monkeypatch, capfd):
    delay = tmp_path / "forward-delay"
    delay.write_text("0.5")   # slow enough to kill try 1 mid-shard and look again before the shard ends
    monkeypatch.setenv(DELAY_FILE_ENV, str(delay))
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "False")
    run = _run(tmp_path, demo_assets, "attach", watch=WATCH, shards=1, in_flight=2)
    started.append(run)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
    ctx = RunContext(cfg=run.cfg, layout=run.layout)

    try_1 = subprocess.Popen([sys.executable, "-c", TRY_1, run.config_path, run.layout.run_id],
                             env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        deadline = time.monotonic() + 150
        while len(_manifest(run, 0)) < 3:
            assert try_1.poll() is None, f"try 1 ended (rc {try_1.returncode}) before the shard was under way"
            assert time.monotonic() < deadline, "fewer than 3 samples stored 150 s after try 1 began"
            time.sleep(0.1)
        worker = ctx.node.live_record(str(run.layout.pid_file(worker_role(0))))
        assert worker is not None
        try_1.send_signal(signal.SIGKILL)   # the control plane dies mid-extraction; the worker lives on the node
        try_1.wait(10)
    finally:
        if try_1.poll() is None:
            try_1.kill()
    delay.write_text("0.8")   # slower still while try 2 starts, so it finds the shard under way
    stored_at_kill = len(_manifest(run, 0))
    assert stored_at_kill < N, "the shard finished before try 1 was killed"

    from eagleflow.airflow.shard_operators import ShardOperator
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=0)
    assert not op.deferrable
    capfd.readouterr()
    result = op.run(ctx, {"ti": SimpleNamespace(try_number=2)})   # looks, attaches, watches to the end here
    out = capfd.readouterr()
    log = out.out + out.err

    assert result["shard"] == 0
    assert "try 2 attaches, nothing stopped: HEALTHY shard 0/1" in log \
        or "try 2 attaches, nothing stopped: SLOW shard 0/1" in log, log[-3000:]
    assert f"worker pid {worker.pid} is still running" in log and "recover" not in log, log[-3000:]
    hb = Heartbeat.read(str(run.layout.heartbeat_file(0)))
    assert hb.state == "complete" and hb.pid == worker.pid, "the worker of try 1 finished the shard"
    # one worker start in the shard's log: no worker was stopped and none started again, so no in-flight
    # request's dump was orphaned and redone
    starts = [x for x in Path(run.layout.log_file(worker_role(0))).read_text().splitlines()
              if "already stored" in x]
    assert len(starts) == 1 and "0 already stored" in starts[0], starts
    got = [e["index"] for e in _manifest(run, 0)]
    assert sorted(got) == list(range(N)) and len(got) == len(set(got)), "every sample stored exactly once"
    names = sorted(p.name for p in Path(run.layout.shard_dir(0)).glob("*.safetensors"))
    assert names == [f"{i:08d}.safetensors" for i in range(N)]
    assert not [p for p in Path(run.cfg.server.dump_dir).iterdir() if not p.name.startswith(".")], \
        "every dump consumed"
    assert json.loads(Path(run.layout.pid_file(worker_role(0))).read_text())["pid"] == worker.pid
