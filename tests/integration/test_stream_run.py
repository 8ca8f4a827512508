"""A streaming run end to end through the node CLI (issue 53): `eagleflow store start` (the real Mooncake master
and segment holder from the wheel, on 127.0.0.1 free ports, recorded processes), the tiny hf capture server and
two `eagleflow capture run` workers writing into the store while `eagleflow train` trains on the stream, then
`eagleflow export` and `eagleflow store stop`. Only the processes the test started are stopped, by their PIDs."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from eagleflow.phases.extract.lifecycle import stop_capture_server
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.local_run import LocalRun
from eagleflow.nodes.process_record import status
from eagleflow.stores.ledger import read_ledger, require_exactly_once
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.stream_run import (Peak, kill_trainer_mid_epoch, kill_workers, run_cli as _run,
                                       start_server, start_workers, train_beside_workers,
                                       store_start, wait_workers)

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.mooncake.master import MooncakeEndpoint, metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SAMPLES = 24
BUFFER_BYTES = 96 << 10          # a few samples (each 2-21 KiB here): capture must wait for the trainer


def _setup(tmp_path, demo_assets, run_id: str, **train):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2)
    data = yaml.safe_load(cfgp.read_text())
    data["stream"] = {"storage": "mooncake", "buffer_gib": BUFFER_BYTES / (1 << 30), "shuffle_window": 4,
                      "put_timeout_s": 300}
    data["train"] = {"device": "cpu", "max_steps": SAMPLES // 2, "batch_size": 2, "ttt_length": 2,
                     "draft_vocab_size": 64, "checkpoint_every": 3, "log_every": 1, "warmup_steps": 1, **train}
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    ctx = LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, run_id), config_path=str(cfgp))
    rows = write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", SAMPLES, 300)
    return cfgp, ctx, {r["id"] for r in rows}


class StreamRun:
    """The store, the capture server and the workers of one run, each stopped by the test that started it."""

    def __init__(self, cfgp: Path, ctx: LocalRun):
        self.cfgp, self.ctx = cfgp, ctx
        self.run = ["--config", str(cfgp), "--run-id", ctx.layout.run_id]
        self.workers: list[subprocess.Popen] = []
        self.ep: MooncakeEndpoint | None = None

    def __enter__(self) -> "StreamRun":
        info = store_start(self.run)
        assert info["started"] and info["host"] == "127.0.0.1"
        self.ep = MooncakeEndpoint.read(info["endpoint_file"])
        again = _run("store", "start", *self.run)          # one store per run: the live one is named, not doubled
        assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])["attached"]
        start_server(self.ctx)
        return self

    def start_workers(self) -> None:
        self.workers = start_workers(self.run)

    def wait_workers(self, timeout: float = 300) -> None:
        wait_workers(self.workers, timeout)

    def __exit__(self, *exc) -> None:
        kill_workers(self.workers)
        stop_capture_server(self.ctx, grace_s=10)
        stopped = _run("store", "stop", *self.run, "--grace", "5")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert self.ep is not None
        for f in (self.ep.master_pid_file, self.ep.segment_pid_file):
            assert not status(f).alive, status(f).detail


def _no_hidden_states_on_disk(ctx: LocalRun) -> None:
    hs = Path(ctx.layout.hidden_states_dir)
    files = sorted(p.relative_to(hs).as_posix() for p in hs.rglob("*") if p.is_file())
    assert files == ["shard_00000/heartbeat.json", "shard_00000/manifest.jsonl", "shard_00001/heartbeat.json",
                     "shard_00001/manifest.jsonl", "stream_verified.json"], files
    run_dir = Path(ctx.layout.run_dir)
    stray = [p for p in run_dir.rglob("*.safetensors") if "draft" not in p.relative_to(run_dir).parts]
    assert not stray, stray


def _manifest_bytes(ctx: LocalRun) -> int:
    total = 0
    for m in Path(ctx.layout.hidden_states_dir).glob("shard_*/manifest.jsonl"):
        total += sum(json.loads(x)["bytes"] for x in m.read_text().splitlines() if x.strip())
    return total


def test_capture_and_training_run_together_through_the_store(tmp_path, demo_assets):
    cfgp, ctx, ids = _setup(tmp_path, demo_assets, "stream")
    with StreamRun(cfgp, ctx) as sr:
        assert sr.ep is not None
        peak = Peak(sr.ep)
        rc, out, err = train_beside_workers(sr.run, sr.start_workers, sr.wait_workers, timeout=300)
        top = peak.stop()
        assert rc == 0, out[-3000:] + err[-3000:]
        assert "streaming from the Mooncake store" in out and "1 epoch(s) = 12 steps" in out, out[-3000:]
        assert "exactly once: every sample trained exactly once in every epoch" in out
        # the store never held more than its buffer, though the corpus is several buffers
        assert peak.samples > 10 and 0 < top <= BUFFER_BYTES, (top, BUFFER_BYTES)
        assert _manifest_bytes(ctx) > 2 * BUFFER_BYTES
        assert int(metrics(sr.ep)["master_key_count"]) == 0        # each sample removed after its last epoch
    _no_hidden_states_on_disk(ctx)
    require_exactly_once(ctx.layout.stream_ledger_file, ids, epochs=1)
    record = json.loads(Path(ctx.layout.stream_verified_file).read_text())
    assert record["ok"] and record["kind"] == "stream" and record["samples"] == SAMPLES
    assert record["trained_per_epoch"] == {"0": SAMPLES}
    draft = Path(ctx.layout.draft_dir)
    rows = [json.loads(x) for x in (draft / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert json.loads((draft / "heartbeat.json").read_text())["state"] == "complete"
    exp = _run("export", "--config", str(cfgp), "--run-id", "stream", "--dtype", "bfloat16")
    assert exp.returncode == 0, exp.stderr[-3000:]
    conf = json.loads((Path(exp.stdout.strip().splitlines()[-1]) / "config.json").read_text())
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]   # what the capture recorded


def test_a_trainer_killed_mid_epoch_resumes_from_its_checkpoint_and_ledger(tmp_path, demo_assets):
    cfgp, ctx, ids = _setup(tmp_path, demo_assets, "killed", checkpoint_every=4)
    ledger = Path(ctx.layout.stream_ledger_file)
    with StreamRun(cfgp, ctx) as sr:
        killed = kill_trainer_mid_epoch(sr.run, sr.start_workers, ledger, epoch=0, timeout=300)
        assert 0 < len(killed.trained) < SAMPLES and killed.pending
        rc, out, err = train_beside_workers(sr.run, lambda: None, sr.wait_workers, timeout=300)
        assert rc == 0, out[-3000:] + err[-3000:]
        assert "resuming from" in out and "exactly once: every sample trained exactly once" in out, out[-3000:]
        assert int(metrics(sr.ep)["master_key_count"]) == 0
    state = read_ledger(ledger)
    # the samples taken but not trained when it was killed were served again, each trained once
    assert killed.pending <= set(state.epoch(0).trained)
    require_exactly_once(ledger, ids, epochs=1)                      # 0 lost, 0 trained twice
    assert json.loads(Path(ctx.layout.stream_verified_file).read_text())["ok"]
    rows = [json.loads(x) for x in (Path(ctx.layout.draft_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))           # the steps after the checkpoint redone once
    _no_hidden_states_on_disk(ctx)
