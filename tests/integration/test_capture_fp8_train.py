"""capture.store_dtype fp8_e4m3 end to end on CPU: the hf capture server and CLI workers store fp8, `capture
verify --stats` reports the error, `eagleflow train` trains from the fp8 store and the export loads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
from eagleflow.local_run import LocalRun
from eagleflow.capture.manifest import read_manifest
from eagleflow.capture.storage import read_sample
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from tests.fixtures.capture_corpus import write_corpus, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_hf_capture_to_fp8_store_then_verify_stats_and_train(tmp_path, demo_assets):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2, store_dtype="fp8_e4m3")
    data = yaml.safe_load(cfgp.read_text())
    data["train"] = {"device": "cpu", "max_steps": 6, "batch_size": 4, "ttt_length": 3, "draft_vocab_size": 128,
                     "checkpoint_every": 6, "log_every": 2, "warmup_steps": 2}
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    ctx = LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, "fp8"), config_path=str(cfgp))
    rows = write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", 12, 300)
    start_capture_server(ctx)
    try:
        wait_capture_server_ready(ctx, timeout_s=120, poll_s=0.3)
        for shard in (0, 1):
            res = _cli("capture", "run", "--config", str(cfgp), "--run-id", "fp8", "--shard", str(shard))
            assert res.returncode == 0, res.stderr
    finally:
        stop_capture_server(ctx, grace_s=10)

    for shard in (0, 1):
        scan = read_manifest(Path(ctx.layout.manifest_file(shard)))
        assert {e.store_dtype for e in scan.entries.values()} == {"fp8_e4m3"}
        for e in scan.entries.values():
            raw, meta = read_sample(Path(ctx.layout.shard_dir(shard)) / e.file, raw=True)
            assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn and meta["store_dtype"] == "fp8_e4m3"
            assert raw["input_ids"].tolist() == rows[e.index]["input_ids"]           # exact
            assert raw["loss_mask"].tolist() == rows[e.index]["loss_mask"]
    run = ["--config", str(cfgp), "--run-id", "fp8"]
    verified = _cli("capture", "verify", *run, "--stats")
    assert verified.returncode == 0 and "OK: 12/12 samples verified" in verified.stdout, verified.stdout
    assert "fp8_e4m3" in verified.stdout and "quantisation error over 12 of 12 stored file(s)" in verified.stdout
    line = next(x for x in verified.stdout.splitlines() if x.strip().startswith("aux_hidden_states"))
    mx = float(line.split("max")[1].split()[0])
    assert 0 < mx < 0.05, line
    trained = _cli("train", *run)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "store fp8_e4m3, de-quantised on cpu" in trained.stdout
    draft = Path(ctx.layout.draft_dir)
    steps = [json.loads(x) for x in (draft / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 7)) and all(r["loss"] == r["loss"] for r in steps)
    exported = _cli("export", *run)
    assert exported.returncode == 0, exported.stdout + exported.stderr
