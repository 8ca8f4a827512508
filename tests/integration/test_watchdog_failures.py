"""Each failure of a real extraction gets its own diagnosis: the hf capture server and the CLI worker,
both detached through LocalNode as in production, watched by the real ShardWatchTrigger.

- server SIGKILLed mid-shard; worker SIGKILLed between write and rename; a worker frozen (SIGSTOP) so
  its heartbeat goes stale while the process lives; the disk "filling up" (RLIMIT_FSIZE on the worker);
- no false positive: a slow model (each forward sleeps longer than the poll interval) completes.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.engines.hf.server import DELAY_ENV
from eagleflow.phases.extract.lifecycle import (start_capture_server, start_or_attach_worker, stop_capture_server,
                                         stop_worker, wait_capture_server_ready, worker_role)
from eagleflow.local_run import LocalRun
from eagleflow.capture.storage import FAULT_AFTER_ENV, FAULT_ENV
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from tests.fixtures.capture_corpus import write_corpus, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
N = 24
SHARDS = 4
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 4.0, "health_timeout_s": 0.8, "startup_grace_s": 60.0,
         "gpu_window_s": 4.0, "d_state_after_s": 4.0}


def _run(tmp: Path, assets: dict, run_id: str, watch: dict | None = None, shards: int = SHARDS,
         **capture) -> LocalRun:
    cfgp = write_run_config(tmp, assets["target_model"], shards=shards, request_timeout_base_s=120, **capture)
    data = json.loads(json.dumps(load_config(cfgp).model_dump(mode="json")))
    data["watchdog"] = {**data["watchdog"], **(watch or WATCH)}
    cfgp.write_text(json.dumps(data))  # JSON is YAML
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, run_id)
    write_corpus(Path(lay.corpus_dir) / "corpus.parquet", N, 300, seed=3)
    RunContext(cfg=cfg, layout=lay).write_run_config()  # what the pipeline's first task does
    return LocalRun(cfg=cfg, layout=lay, config_path=str(cfgp))


def _ctx(run: LocalRun) -> RunContext:
    return RunContext(cfg=run.cfg, layout=run.layout)


def _watch(run: LocalRun, shard: int, timeout_s: float = 120) -> dict:
    async def first():
        agen = ShardWatchTrigger(_ctx(run).serialize(), shard).run()
        try:
            return (await asyncio.wait_for(agen.__anext__(), timeout_s)).payload
        finally:
            await agen.aclose()
    return asyncio.run(first())


def _manifest(run: LocalRun, shard: int) -> list[dict]:
    p = Path(run.layout.manifest_file(shard))
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wait_manifest(run: LocalRun, shard: int, n: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_manifest(run, shard)) < n:
        assert time.monotonic() < deadline, f"shard {shard}: fewer than {n} samples after {timeout_s} s"
        time.sleep(0.1)


def _expected(shard: int) -> list[int]:
    return [i for i in range(N) if i % SHARDS == shard]


def _assert_exact(run: LocalRun, shard: int) -> None:
    got = sorted(e["index"] for e in _manifest(run, shard))
    assert got == _expected(shard), "every sample exactly once"
    names = sorted(p.name for p in Path(run.layout.shard_dir(shard)).glob("*.safetensors"))
    assert names == [f"{i:08d}.safetensors" for i in _expected(shard)]


def _server_pid(run: LocalRun) -> int:
    return json.loads(Path(run.layout.pid_file("capture_server")).read_text())["pid"]


@pytest.fixture
def started():
    """Runs whose server and workers the test started; all stopped by their pid records afterwards."""
    runs: list[LocalRun] = []
    yield runs
    for run in runs:
        for shard in range(SHARDS):
            stop_worker(run, shard, grace_s=2)
        try:
            os.kill(_server_pid(run), signal.SIGCONT)
        except (OSError, ValueError):
            pass
        stop_capture_server(run, grace_s=2)


@pytest.fixture
def server_run(demo_assets, tmp_path, started, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.15")  # slow enough to interrupt mid-shard
    # one request at a time: "kill after 2 stored samples" then stores exactly 2
    run = _run(tmp_path, demo_assets, "failures", in_flight=1)
    started.append(run)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
    monkeypatch.delenv(DELAY_ENV)
    return run


def test_server_killed_worker_killed_before_rename_frozen_worker_and_full_disk(server_run, monkeypatch):
    run = server_run

    # 1. worker SIGKILLed between the temp write and the rename: DEAD, and the temp file is not counted
    monkeypatch.setenv(FAULT_ENV, "kill")
    monkeypatch.setenv(FAULT_AFTER_ENV, "2")
    rec, _ = start_or_attach_worker(run, 1)
    monkeypatch.delenv(FAULT_ENV)
    monkeypatch.delenv(FAULT_AFTER_ENV)
    ev = _watch(run, 1)
    assert ev["status"] == "dead", ev
    assert f"worker pid {rec.pid} is" in ev["diagnosis"] and "without completing" in ev["diagnosis"]
    assert "2/6 samples done" in ev["diagnosis"]
    assert len(_manifest(run, 1)) == 2 and list(Path(run.layout.shard_dir(1)).glob(".tmp-*"))
    start_or_attach_worker(run, 1)  # resume: the temp file is dropped, the sample redone once
    assert _watch(run, 1)["status"] == "complete"
    _assert_exact(run, 1)

    # 2. a live worker whose heartbeat goes stale (frozen with SIGSTOP)
    rec, _ = start_or_attach_worker(run, 2)
    _wait_manifest(run, 2, 1)
    os.kill(rec.pid, signal.SIGSTOP)
    ev = _watch(run, 2)
    assert ev["status"] == "stalled", ev
    assert f"worker pid {rec.pid} is stopped (state T: SIGSTOP" in ev["diagnosis"] and ev["cause"] == "worker"
    # frozen before or after its first sample: "no sample completed for N s" or "nothing completed ... grace"
    assert "completed" in ev["diagnosis"] and "/6 done" in ev["diagnosis"]
    os.kill(rec.pid, signal.SIGCONT)
    stop_worker(run, 2, grace_s=2)

    # 3. the disk fills up: the worker may not write files beyond 20 kB (RLIMIT_FSIZE), a sample is larger
    argv = ["prlimit", "--fsize=20000", "--", *run.eagleflow_argv("capture", "run", "--shard", "3")]
    proc = run.node.spawn_detached(argv, role=worker_role(3), pid_file=str(run.layout.pid_file(worker_role(3))),
                                   log_file=str(run.layout.log_file(worker_role(3))))
    ev = _watch(run, 3)
    assert ev["status"] == "failed", ev
    assert "File too large" in ev["diagnosis"] and ev["subject"] == "[eagleflow] FAILED shard 3/4 on local"
    assert ev["cause"] == "job"  # its own error: not recovered in the watch, the task fails with it
    assert _manifest(run, 3) == [] and not list(Path(run.layout.shard_dir(3)).glob("0*.safetensors"))
    del proc

    # 4. the server SIGKILLed mid-shard: the worker's request fails; the diagnosis names the dead server
    rec, _ = start_or_attach_worker(run, 0)
    _wait_manifest(run, 0, 1)
    spid = _server_pid(run)
    os.kill(spid, signal.SIGKILL)
    ev = _watch(run, 0)
    assert ev["status"] in ("failed", "stalled"), ev
    assert f"server pid {spid} is gone" in ev["diagnosis"] or f"server pid {spid} is a zombie" in ev["diagnosis"]
    assert ev["subject"].endswith("shard 0/4 on local") and ev["cause"] == "capture_server"


def test_slow_model_runs_to_completion_without_an_alert(demo_assets, tmp_path, started, monkeypatch):
    """Each forward sleeps 2.5 s: longer than the 1 s poll and than stall_after (2 s); no alarm."""
    watch = {**WATCH, "stall_after_s": 2.0, "health_timeout_s": 9.0, "poll_interval_s": 1.0}
    monkeypatch.setenv(DELAY_ENV, "2.5")
    run = _run(tmp_path, demo_assets, "slow", watch=watch, shards=8, in_flight=1)
    started.append(run)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=120, poll_s=0.5)
    start_or_attach_worker(run, 5)
    ev = _watch(run, 5, timeout_s=180)
    assert ev["status"] == "complete", ev
    got = sorted(e["index"] for e in _manifest(run, 5))
    assert got == [i for i in range(N) if i % 8 == 5]
