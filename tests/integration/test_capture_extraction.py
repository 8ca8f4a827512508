"""Extraction end to end on CPU: the hf capture server (detached, as in production) and CLI workers.

Checks the stored tensors against a direct transformers forward, and that
crashes (worker SIGKILL, also between temp write and rename; server hang or
death) neither lose, duplicate nor expose a partial sample.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagleflow.phases.extract.lifecycle import (start_capture_server, start_or_attach_worker, stop_capture_server,
                                         stop_worker, wait_capture_server_ready, worker_role)
from eagleflow.local_run import LocalRun
from eagleflow.capture.manifest import read_manifest
from eagleflow.phases.extract.worker import GIVE_UP_FACTOR, request_deadline
from eagleflow.capture.storage import SAMPLE_SUFFIX, read_sample
from eagleflow.config import load_config
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from tests.fixtures.waiting import wait_until
from tests.fixtures.capture_corpus import write_corpus, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
N_SAMPLES = 12
VOCAB = 300


def _ctx(cfgp: Path, run_id: str, n: int = N_SAMPLES) -> LocalRun:
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, run_id)
    corpus = Path(lay.corpus_dir) / "corpus.parquet"
    if not corpus.exists():
        write_corpus(corpus, n, VOCAB, seed=sum(map(ord, run_id)))
    return LocalRun(cfg=cfg, layout=lay, config_path=str(cfgp))


def _worker_argv(ctx: LocalRun, shard: int, url: str | None = None, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", ctx.config_path,
            "--run-id", ctx.layout.run_id, "--shard", str(shard), *extra]
    return argv + (["--url", url] if url else [])


def _run_worker(ctx, shard, url=None, env=None, timeout=120, extra=()) -> subprocess.CompletedProcess:
    return subprocess.run(_worker_argv(ctx, shard, url, *extra), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _manifest_lines(ctx, shard) -> list[dict]:
    p = Path(ctx.layout.manifest_file(shard))
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _assert_shard_exact(ctx, shard):
    """Exactly the shard's samples, each once, each file whole; no temp file visible."""
    d = Path(ctx.layout.shard_dir(shard))
    expected = [i for i in range(N_SAMPLES) if i % ctx.cfg.capture.shards == shard]
    lines = _manifest_lines(ctx, shard)
    assert sorted(e["index"] for e in lines) == expected, "manifest must list every sample exactly once"
    assert sorted(p.name for p in d.glob("*.safetensors")) == [f"{i:08d}.safetensors" for i in expected]
    assert not list(d.glob(".tmp-*"))
    for e in lines:
        tensors, meta = read_sample(d / e["file"])
        assert int(meta["index"]) == e["index"] and tensors["input_ids"].shape[0] == e["tokens"]


@pytest.fixture(scope="module")
def server(demo_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capture")
    cfgp = write_run_config(tmp, demo_assets["target_model"])
    ctx = _ctx(cfgp, "full")
    start_capture_server(ctx)
    try:
        info = wait_capture_server_ready(ctx, timeout_s=120, poll_s=0.3)
        yield ctx, info
    finally:
        stop_capture_server(ctx, grace_s=10)
        assert not Path(ctx.layout.pid_file("capture_server")).exists()


@pytest.fixture(scope="module")
def reference(demo_assets):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(demo_assets["target_model"]).eval()


def test_every_sample_matches_a_direct_forward(server, reference):
    ctx, info = server
    assert info["aux_layers"] == [1, 3, 4] and info["hidden_size"] == 64 and info["backend"] == "hf"
    health = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "health", "--config", ctx.config_path,
                             "--run-id", "full"], capture_output=True, text=True, timeout=60)
    assert health.returncode == 0 and json.loads(health.stdout)["healthy"] is True
    for shard in (0, 1):
        # Python lists every module it imports: a worker storing the target's dtype moves bytes, no torch
        res = _run_worker(ctx, shard, env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert res.returncode == 0, res.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "eagleflow.phases.extract.worker" in imported and "pyarrow" in imported and "pandas" not in imported
        assert not {m for m in imported if m == "torch" or m.startswith("torch.") or m == "safetensors.torch"}, \
            "the extraction worker imported torch"
        assert "6/6 samples" in res.stdout
        _assert_shard_exact(ctx, shard)
        hb = Heartbeat.read(ctx.layout.heartbeat_file(shard))
        assert hb.state == "complete" and hb.done == hb.total == 6 and hb.in_flight == []
    import pyarrow.parquet as pq
    rows = pq.read_table(Path(ctx.layout.corpus_dir) / "corpus.parquet").to_pylist()
    for row in rows:
        t, meta = read_sample(Path(ctx.layout.shard_dir(row["index"] % 2)) / f"{row['index']:08d}.safetensors")
        with torch.inference_mode():
            hs = reference(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
        assert t["input_ids"].tolist() == row["input_ids"]
        assert t["loss_mask"].tolist() == row["loss_mask"]
        torch.testing.assert_close(t["aux_hidden_states"], torch.cat([hs[i + 1][0] for i in (1, 3, 4)], -1))
        torch.testing.assert_close(t["hidden_states"], hs[-1][0])
        assert meta["id"] == row["id"] and json.loads(meta["aux_layers"]) == [1, 3, 4]
    verify = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "verify", "--config",
                             ctx.config_path, "--run-id", "full"], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "OK: 12/12 samples verified" in verify.stdout
    assert not [p for p in Path(ctx.cfg.server.dump_dir).iterdir() if p.name.startswith("full.")]
    # a second run is a no-op resume
    again = _run_worker(ctx, 0)
    assert again.returncode == 0 and "6 already stored, 0 to do" in again.stdout


def test_held_out_capture_stores_the_first_held_out_samples_apart_and_verifies_them(server, reference):
    import pyarrow.parquet as pq
    base, info = server
    ctx = _ctx(Path(base.config_path), "heldout")
    rows = write_corpus(Path(ctx.layout.corpus_dir) / "eval.parquet", 7, VOCAB, seed=5)
    held = [{**r, "id": f"held:{r['index']}"} for r in rows]
    import pyarrow as pa
    pq.write_table(pa.Table.from_pylist(held, schema=pq.read_schema(Path(ctx.layout.corpus_dir) / "eval.parquet")),
                   Path(ctx.layout.corpus_dir) / "eval.parquet")

    def held_out(*extra):
        return subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "held-out", "--config",
                               ctx.config_path, "--run-id", "heldout", "--url", info["url"], "--json", *extra],
                              capture_output=True, text=True, timeout=120)
    res = held_out("--set", "train.held_out_samples=5")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and report["stored"] == report["expected"] == 5 and report["held_out_samples"] == 5
    d = Path(ctx.layout.held_out_hidden_states_dir) / "shard_00000"
    assert sorted(e["index"] for e in (json.loads(x) for x in (d / "manifest.jsonl").read_text().splitlines())) \
        == [0, 1, 2, 3, 4]
    assert (Path(ctx.layout.held_out_hidden_states_dir) / "verified.json").is_file()
    assert not Path(ctx.layout.hidden_states_dir).exists(), "nothing written into the training store"
    t, meta = read_sample(d / "00000003.safetensors")
    with torch.inference_mode():
        hs = reference(torch.tensor([held[3]["input_ids"]]), output_hidden_states=True).hidden_states
    assert meta["id"] == "held:3" and t["input_ids"].tolist() == held[3]["input_ids"]
    torch.testing.assert_close(t["hidden_states"], hs[-1][0])
    # request ids of their own (shard 99999): no dump of a training shard's name, none left behind
    assert not [p for p in Path(ctx.cfg.server.dump_dir).rglob("heldout.*")]
    # a rerun with a larger cap resumes: the 5 stay, 2 more are captured
    res = held_out()
    assert res.returncode == 0 and json.loads(res.stdout)["stored"] == 7, res.stderr
    assert "5 already stored, 2 to do" in res.stderr


def test_worker_killing_itself_between_temp_write_and_rename_resumes_exactly(server):
    base, info = server
    ctx = _ctx(Path(base.config_path), "selfkill")
    # one request in flight: the kill lands at a known point (with two, the other may be anywhere)
    res = _run_worker(ctx, 0, url=info["url"], env={"EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME": "kill",
                                                    "EAGLEFLOW_CAPTURE_FAULT_AFTER_N": "2"},
                      extra=("--set", "capture.in_flight=1"))
    assert res.returncode == -signal.SIGKILL
    d = Path(ctx.layout.shard_dir(0))
    assert len(_manifest_lines(ctx, 0)) == 2
    assert list(d.glob(".tmp-*")), "the fault fires after the temp file is written"
    assert len(list(d.glob("0*.safetensors"))) == 2, "no final-named file before its rename"
    res = _run_worker(ctx, 0, url=info["url"])
    assert res.returncode == 0, res.stderr
    assert "2 already stored, 4 to do" in res.stdout and "removed 1 temp file(s)" in res.stdout
    _assert_shard_exact(ctx, 0)


def test_worker_sigkilled_mid_shard_resumes_exactly(server):
    base, info = server
    ctx = _ctx(Path(base.config_path), "extkill")
    d = Path(ctx.layout.shard_dir(1))
    proc = subprocess.Popen(_worker_argv(ctx, 1, info["url"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME": "pause:60",
                                 "EAGLEFLOW_CAPTURE_FAULT_AFTER_N": "3"})
    try:
        # every sample passes through a temp file: wait until both threads hold one, paused before its rename
        # (paused once 3 are stored; the other thread may have stored a 4th before it reached the pause): nothing
        # moves after that. A sample's temp file, not the heartbeat's (.tmp-heartbeat.json.*, at each beat).
        wait_until(lambda: len(list(d.glob(f".tmp-*{SAMPLE_SUFFIX}.*"))) == 2 and len(_manifest_lines(ctx, 1)) >= 3,
                   60, every_s=0.1, what="both threads paused before a rename with 3 samples stored")
        stored = len(_manifest_lines(ctx, 1))
        # the heartbeat counts them; a request leaves in_flight once the server has answered, before its put
        # (a put held back is not the server's delay), so two paused renames list no request in flight
        hb = wait_until(lambda: (h := Heartbeat.read(ctx.layout.heartbeat_file(1))) and h.done == stored
                        and not h.in_flight and h, 10, every_s=0.1, what="a heartbeat counting the stored samples",
                        describe=lambda: (Heartbeat.read(ctx.layout.heartbeat_file(1)), len(_manifest_lines(ctx, 1))))
        assert hb.state == "running" and hb.total == 6
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert len(_manifest_lines(ctx, 1)) == stored in (3, 4)
    res = _run_worker(ctx, 1, url=info["url"])
    assert res.returncode == 0, res.stderr
    assert f"{stored} already stored, {6 - stored} to do" in res.stdout
    _assert_shard_exact(ctx, 1)


def test_rerun_attaches_to_the_live_worker(server):
    base, info = server
    ctx = _ctx(Path(base.config_path), "attach")
    # the worker reads the server URL from the run's capture_server.json
    Path(ctx.layout.server_info_file).parent.mkdir(parents=True, exist_ok=True)
    Path(ctx.layout.server_info_file).write_text(json.dumps(info))
    os.environ["EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"] = "pause:60"
    try:
        rec1, attached1 = start_or_attach_worker(ctx, 0)
    finally:
        del os.environ["EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"]
    try:
        # a sample's temp file, not the heartbeat's (.tmp-heartbeat.json.*): that one exists while torch
        # still imports, and a TERM then tested the startup, not the pause
        wait_until(lambda: list(Path(ctx.layout.shard_dir(0)).glob(f".tmp-*{SAMPLE_SUFFIX}.*")), 60, every_s=0.1,
                   what="the worker paused before its first rename")
        rec2, attached2 = start_or_attach_worker(ctx, 0)
        assert (attached1, attached2) == (False, True) and rec2.pid == rec1.pid
    finally:
        assert stop_worker(ctx, 0, grace_s=15) == "terminated"  # TERM handled (a loaded machine may be slow)
    assert not Path(ctx.layout.pid_file(worker_role(0))).exists()
    hb = Heartbeat.read(ctx.layout.heartbeat_file(0))
    assert hb.state == "failed" and "stopped by SIGTERM" in hb.error
    # a dead worker's record does not block a new start
    rec3, attached3 = start_or_attach_worker(ctx, 0)
    assert not attached3 and rec3.pid != rec1.pid
    wait_until(lambda: (Heartbeat.read(ctx.layout.heartbeat_file(0)) or Heartbeat("", 0)).state == "complete", 60,
               every_s=0.2, what="shard 0 complete")
    _assert_shard_exact(ctx, 0)


def test_a_worker_stopped_while_it_starts_says_so(server):
    """TERM as soon as the worker's first heartbeat is down: it lands in the corpus read or in torch's import
    (whose op lookup once renamed our stop to an AttributeError), and the heartbeat still names the signal."""
    base, info = server
    ctx = _ctx(Path(base.config_path), "stop-at-start")
    Path(ctx.layout.server_info_file).parent.mkdir(parents=True, exist_ok=True)
    Path(ctx.layout.server_info_file).write_text(json.dumps(info))
    rec, _ = start_or_attach_worker(ctx, 1)
    try:
        wait_until(lambda: Path(ctx.layout.heartbeat_file(1)).exists(), 60, every_s=0.02,
                   what="the worker's first heartbeat")
    finally:
        assert stop_worker(ctx, 1, grace_s=15) == "terminated"
    hb = Heartbeat.read(ctx.layout.heartbeat_file(1))
    assert hb.state == "failed" and hb.error.startswith("shard 1: stopped by SIGTERM; stored samples are kept"), hb
    assert hb.pid == rec.pid


def test_server_hang_or_death_fails_the_worker_clearly_within_its_timeout(demo_assets, tmp_path, monkeypatch):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], request_timeout_base_s=2.0,
                            request_timeout_per_token_s=0.01, in_flight=1)
    ctx = _ctx(cfgp, "hang")
    monkeypatch.setenv("EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S", "0.3")   # slow enough to act mid-shard
    start_capture_server(ctx)
    try:
        wait_capture_server_ready(ctx, timeout_s=120, poll_s=0.3)
        rec = json.loads(Path(ctx.layout.pid_file("capture_server")).read_text())
        proc = subprocess.Popen(_worker_argv(ctx, 0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: len(_manifest_lines(ctx, 0)) >= 2, 60, what="2 samples stored")
        os.killpg(rec["pgid"], signal.SIGSTOP)                       # hung: accepts, never answers
        stopped_at = time.time()
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            os.killpg(rec["pgid"], signal.SIGCONT)
        took = time.time() - stopped_at
        assert proc.returncode == 3, err
        assert "got no answer within" in err and "check its log, restart it" in err and "hang.s00000." in err
        # overdue is evidence for the watch; the worker alone gives up at GIVE_UP_FACTOR deadlines
        # (own 2.4 s + PACE_MARGIN x its ~0.3 s pace), not at the first one
        assert took < GIVE_UP_FACTOR * request_deadline(2.0 + 0.01 * 40, 0, 1.0) + 8, \
            f"worker took {took:.1f} s to notice the hung server"
        hb = Heartbeat.read(ctx.layout.heartbeat_file(0))
        assert hb.state == "failed" and "got no answer" in hb.error
        assert len(_manifest_lines(ctx, 0)) >= 2

        os.killpg(rec["pgid"], signal.SIGKILL)                       # dead: connection refused at once
        time.sleep(0.5)
        t0 = time.time()
        res = _run_worker(ctx, 0)
        assert res.returncode == 3 and "Connection" in res.stderr and time.time() - t0 < 30
        assert Heartbeat.read(ctx.layout.heartbeat_file(0)).state == "failed"
        health = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "health", "--config",
                                 ctx.config_path, "--run-id", "hang", "--timeout", "2"], capture_output=True, text=True)
        assert health.returncode == 1 and json.loads(health.stdout)["healthy"] is False
    finally:
        stop = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "stop", "--config", ctx.config_path,
                               "--run-id", "hang", "--grace", "5"], capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert not Path(ctx.layout.pid_file("capture_server")).exists()


def test_queued_requests_on_a_slow_serial_server_complete_at_the_runs_pace(demo_assets, tmp_path, monkeypatch):
    """Issue 27 item 4, scaled: 4 requests queued on a serial server whose forwards (3 s) outlast the
    config's own figure for one request alone (base 8 s + 0.001 s/token, the shipped 61.4 s against 20 s
    forwards, scaled): the fixed rule failed the 3rd in the queue (9 s); deadlines that count the queue and the run's pace let the shard complete, none overdue."""
    own_max = 8.0 + 0.001 * 40
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], request_timeout_base_s=8.0,
                            request_timeout_per_token_s=0.001, in_flight=4)
    ctx = _ctx(cfgp, "pace")
    monkeypatch.setenv("EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S", "3")   # the hf server runs one forward at a time
    start_capture_server(ctx)
    try:
        wait_capture_server_ready(ctx, timeout_s=120, poll_s=0.3)
        monkeypatch.delenv("EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S")
        rec, attached = start_or_attach_worker(ctx, 0)               # the real detached worker
        assert not attached
        # each request's send time, deadline and the longest it was seen in flight
        flights: dict[str, list[float]] = {}
        deadlines, hb = set(), None
        end = time.time() + 150
        while time.time() < end:
            hb = Heartbeat.read(ctx.layout.heartbeat_file(0))
            if hb is not None:
                for r in hb.in_flight:
                    f = flights.setdefault(r.id, [r.since, r.timeout_s, 0.0])
                    f[2] = max(f[2], hb.time - r.since)
                    deadlines.add(r.timeout_s)
                if hb.state in ("complete", "failed"):
                    break
            time.sleep(0.2)
        assert hb is not None and hb.state == "complete", (hb and hb.error, hb and hb.state)
        _assert_shard_exact(ctx, 0)
        assert hb.done == hb.total == N_SAMPLES // 2 and hb.in_flight == []
        waited = max(hb.extra["recent_request_s"])
        assert waited > own_max, f"the queue never outlasted the old fixed deadline ({waited:.1f} s)"
        # the first in_flight requests are sent at once: the serial server takes them in whatever order their
        # connections arrive, not the order their deadlines counted, so among them the k-th served has the k-th
        # deadline (as a set, the deadlines count the queue); every later one is sent alone, as a slot frees
        first = min(f[0] for f in flights.values())
        batch = [f for f in flights.values() if f[0] - first < 1.0]
        for k, (seen, limit) in enumerate(zip(sorted(f[2] for f in batch), sorted(f[1] for f in batch))):
            assert seen < limit, f"the {k + 1}th of the first requests served outlived its place's deadline: " \
                                 f"{seen:.1f} s of {limit} s; {sorted(map(tuple, batch))}"
        late = {rid: f for rid, f in flights.items() if f not in batch and f[2] >= f[1]}
        assert not late, f"a request outlived its deadline: {late}; waits {hb.extra['recent_request_s']}"
        assert max(deadlines) >= 3 * own_max, f"deadlines did not count the queue: {sorted(deadlines)}"
    finally:
        stop_worker(ctx, 0, grace_s=10)   # only if the test failed mid-shard: a finished worker has no record
        stop_capture_server(ctx, grace_s=10)
