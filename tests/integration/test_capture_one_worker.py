"""One worker per shard, enforced on the node by the lock the worker holds (issue 11 item 2); exact dump names (item 5).

Real CLI workers against the real hf capture server: two `capture run --shard 1`
at once, two start-or-attach calls at once, a hand-started worker beside a
recorded one, and a SIGKILLed holder whose lock the kernel releases.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagleflow.phases.extract.lifecycle import (start_capture_server, start_or_attach_worker, stop_capture_server,
                                         stop_worker, wait_capture_server_ready, worker_role)
from eagleflow.local_run import LocalRun
from eagleflow.config import load_config
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.nodes import JobAlreadyRunning
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.processes import alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
N_SAMPLES = 12
EXIT_ALREADY_RUNNING = 4


def _ctx(cfgp: Path, run_id: str) -> LocalRun:
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, run_id)
    corpus = Path(lay.corpus_dir) / "corpus.parquet"
    if not corpus.exists():
        write_corpus(corpus, N_SAMPLES, 300, seed=sum(map(ord, run_id)))
    return LocalRun(cfg=cfg, layout=lay, config_path=str(cfgp))


def _worker(ctx: LocalRun, shard: int, env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", ctx.config_path,
            "--run-id", ctx.layout.run_id, "--shard", str(shard)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _assert_each_sample_once(ctx: LocalRun, shard: int) -> None:
    p = Path(ctx.layout.manifest_file(shard))
    lines = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    expected = [i for i in range(N_SAMPLES) if i % ctx.cfg.capture.shards == shard]
    assert sorted(e["index"] for e in lines) == expected, f"{len(lines)} manifest lines for {len(expected)} samples"


def _wait_complete(ctx: LocalRun, shard: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        hb = Heartbeat.read(ctx.layout.heartbeat_file(shard))
        if hb is not None and hb.state == "complete":
            return
        time.sleep(0.2)
    raise AssertionError(f"shard {shard} did not complete")


@pytest.fixture(scope="module")
def server(demo_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one-worker")
    cfgp = write_run_config(tmp, demo_assets["target_model"])
    ctx = _ctx(cfgp, "srv")
    start_capture_server(ctx)
    try:
        info = wait_capture_server_ready(ctx, timeout_s=120, poll_s=0.3)
        yield cfgp, info
    finally:
        stop_capture_server(ctx, grace_s=10)


def _with_server(cfgp: Path, info: dict, run_id: str) -> LocalRun:
    ctx = _ctx(cfgp, run_id)
    Path(ctx.layout.server_info_file).parent.mkdir(parents=True, exist_ok=True)
    Path(ctx.layout.server_info_file).write_text(json.dumps(info))
    return ctx


def test_two_capture_runs_of_one_shard_at_once_one_refuses_naming_the_other(server):
    ctx = _with_server(*server, "twice")
    slow = {"EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME": "pause:0.4"}  # the winner is still running when the loser asks
    a, b = _worker(ctx, 1, slow), _worker(ctx, 1, slow)
    outs = {p.pid: (p, *p.communicate(timeout=180)) for p in (a, b)}
    codes = sorted(p.returncode for p, _, _ in outs.values())
    assert codes == [0, EXIT_ALREADY_RUNNING], {pid: (p.returncode, err[-500:]) for pid, (p, _, err) in outs.items()}
    winner = next(p for p, _, _ in outs.values() if p.returncode == 0)
    loser_err = next(err for p, _, err in outs.values() if p.returncode == EXIT_ALREADY_RUNNING)
    assert f"already running as pid {winner.pid}" in loser_err and "shard 1 of run twice" in loser_err
    _assert_each_sample_once(ctx, 1)


def test_start_or_attach_twice_at_once_starts_one_worker(server):
    ctx = _with_server(*server, "race")
    os.environ["EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"] = "pause:0.3"
    results: list = []
    try:
        callers = [threading.Thread(target=lambda: results.append(start_or_attach_worker(ctx, 0))) for _ in range(2)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=60)
    finally:
        del os.environ["EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"]
    try:
        assert sorted(att for _, att in results) == [False, True], results
        assert results[0][0].pid == results[1][0].pid
        rec = ctx.node.live_record(str(ctx.layout.pid_file(worker_role(0))))
        assert rec is not None and rec.pid == results[0][0].pid, "the record names the one worker that runs"
        _wait_complete(ctx, 0)
    finally:
        stop_worker(ctx, 0, grace_s=5)
    _assert_each_sample_once(ctx, 0)


def test_hand_started_worker_refuses_while_the_recorded_one_runs_and_a_killed_holder_frees_the_shard(server):
    ctx = _with_server(*server, "manual")
    os.environ["EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"] = "pause:60"   # keep the recorded worker busy
    try:
        rec, attached = start_or_attach_worker(ctx, 1)
    finally:
        del os.environ["EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"]
    assert not attached
    try:
        hand = _worker(ctx, 1)
        _, err = hand.communicate(timeout=120)
        assert hand.returncode == EXIT_ALREADY_RUNNING and f"already running as pid {rec.pid}" in err
        lock = Path(ctx.layout.lock_file(worker_role(1)))
        assert json.loads(lock.read_text())["pid"] == rec.pid, "the lock names the worker, not the detach helper"
        # a worker started by hand holds the shard too: start-or-attach refuses, naming it
        os.kill(rec.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while alive(rec.pid) and time.time() < deadline:
            time.sleep(0.05)
        hand = _worker(ctx, 1, {"EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME": "pause:60"})
        deadline = time.time() + 60
        while time.time() < deadline and json.loads(lock.read_text() or "{}").get("pid") != hand.pid:
            time.sleep(0.1)
        with pytest.raises(JobAlreadyRunning, match=f"already running as pid {hand.pid}") as refused:
            start_or_attach_worker(ctx, 1)
        assert refused.value.holder_pid == hand.pid
        hand.kill()
        hand.wait(timeout=30)
        # the kernel released the dead holder's lock: the next start just works
        rec2, attached2 = start_or_attach_worker(ctx, 1)
        assert not attached2 and rec2.pid != rec.pid
        _wait_complete(ctx, 1)
    finally:
        stop_worker(ctx, 1, grace_s=5)
    _assert_each_sample_once(ctx, 1)


def test_capture_stop_removes_exactly_its_runs_dumps(tmp_path, demo_assets):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"])
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    mine = ["exp.s00000.00000001.safetensors", ".tmp-exp.s00001.00000002.safetensors.k3j_x9",
            ".tmp-exp.s00001.00000003.4242.safetensors"]
    others = ["exp.s2.s00000.00000001.safetensors", ".tmp-exp.s2.s00001.00000004.safetensors.ab12cd",
              "exp2.s00000.00000001.safetensors", "exp.s00001.x.s00000.00000005.safetensors", "exp.notes.txt"]
    for name in mine + others:
        (dumps / name).write_bytes(b"x")
    res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "stop", "--config", str(cfgp),
                          "--run-id", "exp", "--grace", "1"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["dumps_removed"] == len(mine)
    assert sorted(p.name for p in dumps.iterdir()) == sorted(others)
