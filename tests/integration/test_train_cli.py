"""`eagleflow train` and `eagleflow export` as node commands, on hidden states the hf capture server stored."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
from eagleflow.local_run import LocalRun
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from tests.fixtures.capture_corpus import write_corpus, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_train_and_export_commands_on_captured_hidden_states(tmp_path, demo_assets):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2)
    data = yaml.safe_load(cfgp.read_text())
    data["train"] = {"device": "cpu", "max_steps": 12, "batch_size": 4, "ttt_length": 3, "draft_vocab_size": 128,
                     "checkpoint_every": 5, "log_every": 4, "warmup_steps": 2}
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    ctx = LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, "cli"), config_path=str(cfgp))
    write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", 16, 300)
    start_capture_server(ctx)
    try:
        wait_capture_server_ready(ctx, timeout_s=120, poll_s=0.3)
        for shard in (0, 1):
            res = _cli("capture", "run", "--config", str(cfgp), "--run-id", "cli", "--shard", str(shard))
            assert res.returncode == 0, res.stderr
    finally:
        stop_capture_server(ctx, grace_s=10)

    run = ["--config", str(cfgp), "--run-id", "cli"]
    refused = _cli("train", *run)   # training takes only data that `capture verify` passed
    assert refused.returncode == 1 and "have not passed verification" in refused.stderr, refused.stderr
    assert "eagleflow capture verify" in refused.stderr and "Traceback" not in refused.stderr
    verified = _cli("capture", "verify", *run)
    assert verified.returncode == 0 and "OK: 16/16 samples verified" in verified.stdout, verified.stdout
    first = _cli("train", *run, "--stop-after-steps", "7")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "step 4/12" in first.stdout and "checkpoint" in first.stdout
    second = _cli("train", *run)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from" in second.stdout and "at step 7" in second.stdout
    draft = Path(ctx.layout.draft_dir)
    rows = [json.loads(x) for x in (draft / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    # A random target's top token is seldom in a 128-id draft vocabulary: some batches score none.
    assert sum(r["positions"] for r in rows) > 0, "real loss masks must give scored positions"
    assert json.loads((draft / "heartbeat.json").read_text())["state"] == "complete"
    assert sorted(p.name for p in (draft / "checkpoints").iterdir()) == ["step_00000010", "step_00000012"]

    exp = _cli("export", *run, "--dtype", "bfloat16")
    assert exp.returncode == 0, exp.stderr
    out = Path(exp.stdout.strip().splitlines()[-1])
    conf = json.loads((out / "config.json").read_text())
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]   # what the capture recorded
    assert conf["torch_dtype"] == "bfloat16" and conf["draft_vocab_size"] == 128
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype.is_floating_point and str(f.get_tensor("fc.weight").dtype) == "torch.bfloat16"
        assert str(f.get_tensor("d2t").dtype) == "torch.int64"

    missing = _cli("export", "--config", str(cfgp), "--run-id", "nothing-here")
    assert missing.returncode == 1 and "no checkpoint under" in missing.stderr and "eagleflow train" in missing.stderr


def test_two_process_ddp_training_on_cpu_under_torchrun(tmp_path, demo_assets):
    """torchrun + gloo: the DDP path (process group, no_sync accumulation, all-reduced metrics, rank-0 files)."""
    import os
    import socket

    from eagleflow.train.job import trainer_argv
    from tests.fixtures.train_hidden_states import write_synthetic_hidden_states

    data = {"run_root": str(tmp_path / "runs"), "target_model": demo_assets["target_model"],
            "node": {"has_gpu": False, "state_dir": str(tmp_path / "state")},
            "train": {"device": "cpu", "nproc_per_node": 2, "max_steps": 6, "batch_size": 2, "grad_accum": 2,
                      "ttt_length": 2, "draft_vocab_size": 64, "checkpoint_every": 3, "log_every": 3}}
    cfgp = tmp_path / "ddp.yaml"
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    ctx = LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, "ddp"), config_path=str(cfgp))
    write_synthetic_hidden_states(ctx.layout.hidden_states_dir, demo_assets["target_model"], samples=24)
    argv = trainer_argv(ctx)
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc_per_node=2" in argv
    with socket.socket() as s:        # loopback only in tests: a fixed local rendezvous instead of --standalone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [argv[0], "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={port}", *argv[5:]]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2 process(es)" in res.stdout
    draft = Path(ctx.layout.draft_dir)
    rows = [json.loads(x) for x in (draft / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)), "rank 0 alone writes metrics"
    # every step saw 2 processes x 2 micro-batches of 2 samples
    assert all(r["tokens"] > 0 for r in rows)
    state = json.loads((draft / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["data_position"]["cursor"] % 2 == 0
    assert json.loads((draft / "heartbeat.json").read_text())["state"] == "complete"
