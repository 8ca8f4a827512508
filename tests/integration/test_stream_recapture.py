"""Two epochs of a streaming run whose corpus is about three times the store's buffer (issue 53): each shard is
captured once per epoch (its pass 1 under its own keys and manifest), epoch e trains only on pass e's samples,
each key leaves the store after its use in that epoch. Through the node CLI as tests/integration/test_stream_run.py
(the real master and segment holder from the wheel on 127.0.0.1 free ports, the tiny hf capture server, two
`eagleflow capture run` workers, `eagleflow train`); only the processes the test started are stopped, by PID."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.local_run import LocalRun
from eagleflow.stores.ledger import read_ledger, require_exactly_once
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.stream_run import Peak, kill_trainer_mid_epoch, train_beside_workers

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.mooncake.master import metrics  # noqa: E402
from tests.integration.test_stream_run import StreamRun  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAMPLES = 24
BUFFER_BYTES = 150 << 10     # about a third of the corpus's hidden states (443 tokens x 1,033 bytes here)


def _two_epochs(tmp_path, demo_assets, run_id: str, **train):
    """SAMPLES samples in 2 shards, 2 epochs of 12 micro-batches of 2; the corpus's statistics as `corpus prepare`
    writes them, from which both sides' plan estimates the corpus's bytes (over the buffer: re-captured)."""
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2)
    data = yaml.safe_load(cfgp.read_text())
    data["stream"] = {"storage": "mooncake", "buffer_gib": BUFFER_BYTES / (1 << 30), "shuffle_window": 4,
                      "put_timeout_s": 300}
    data["train"] = {"device": "cpu", "max_steps": SAMPLES, "batch_size": 2, "ttt_length": 2,
                     "draft_vocab_size": 64, "checkpoint_every": 3, "log_every": 1, "warmup_steps": 1, **train}
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    ctx = LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, run_id), config_path=str(cfgp))
    rows = write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", SAMPLES, 300)
    (Path(ctx.layout.corpus_dir) / "stats.json").write_text(json.dumps(
        {"records": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows)}))
    return cfgp, ctx, {r["id"] for r in rows}


def _passes_on_disk(ctx) -> dict[str, int]:
    """Lines per manifest of every shard (pass 0's and pass 1's), each pass's keys its own; nothing else but the
    heartbeats and the verification record: no hidden state on disk."""
    hs = Path(ctx.layout.hidden_states_dir)
    files = sorted(p.relative_to(hs).as_posix() for p in hs.rglob("*") if p.is_file())
    assert files == ["shard_00000/heartbeat.json", "shard_00000/manifest.jsonl", "shard_00000/manifest.pass1.jsonl",
                     "shard_00001/heartbeat.json", "shard_00001/manifest.jsonl", "shard_00001/manifest.pass1.jsonl",
                     "stream_verified.json"], files
    run_dir = Path(ctx.layout.run_dir)
    assert not [p for p in run_dir.rglob("*.safetensors") if "draft" not in p.relative_to(run_dir).parts]
    lines: dict[str, int] = {}
    for m in sorted(hs.glob("shard_*/manifest*.jsonl")):
        recs = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
        assert all(("/pass1/" in r["file"]) == m.name.endswith("pass1.jsonl") for r in recs), m
        lines[m.relative_to(hs).as_posix()] = len(recs)
    return lines


def _corpus_bytes(ctx) -> int:
    m = Path(ctx.layout.hidden_states_dir).glob("shard_*/manifest.jsonl")
    return sum(json.loads(x)["bytes"] for f in m for x in f.read_text().splitlines() if x.strip())


def test_two_epochs_beyond_the_buffer_capture_each_shard_once_per_epoch(tmp_path, demo_assets):
    cfgp, ctx, ids = _two_epochs(tmp_path, demo_assets, "recapture")
    with StreamRun(cfgp, ctx) as sr:
        assert sr.ep is not None
        peak = Peak(sr.ep)
        rc, out, err = train_beside_workers(sr.run, sr.start_workers, lambda: sr.wait_workers(timeout=600),
                                            timeout=600)
        top = peak.stop()
        assert rc == 0, out[-3000:] + err[-3000:]
        assert "2 epoch(s) = 24 steps" in out and "each shard is captured again for each epoch" in out, out[-3000:]
        assert "exactly once: every sample trained exactly once in every epoch" in out
        assert peak.samples > 10 and 0 < top <= BUFFER_BYTES, (top, BUFFER_BYTES)
        corpus = _corpus_bytes(ctx)
        print(f"store peak {top} of {BUFFER_BYTES} bytes ({peak.samples} samples); corpus {corpus} bytes a pass")
        assert 2.5 * BUFFER_BYTES < corpus < 3.5 * BUFFER_BYTES
        assert int(metrics(sr.ep)["master_key_count"]) == 0        # each pass's keys removed after their epoch
    lines = _passes_on_disk(ctx)
    assert sum(v for k, v in lines.items() if k.endswith("/manifest.jsonl")) == SAMPLES
    assert sum(v for k, v in lines.items() if k.endswith("pass1.jsonl")) == SAMPLES
    for shard in (0, 1):             # the watch's figures: done/total over both passes
        hb = json.loads((Path(ctx.layout.hidden_states_dir) / f"shard_{shard:05d}" / "heartbeat.json").read_text())
        assert hb["state"] == "complete" and hb["done"] == hb["total"] == 2 * lines[f"shard_{shard:05d}/manifest.jsonl"]
    require_exactly_once(ctx.layout.stream_ledger_file, ids, epochs=2)
    record = json.loads(Path(ctx.layout.stream_verified_file).read_text())
    assert record["ok"] and record["epochs"] == 2 and record["trained_per_epoch"] == {"0": SAMPLES, "1": SAMPLES}
    rows = [json.loads(x) for x in (Path(ctx.layout.draft_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 25))


def test_a_trainer_killed_in_epoch_two_resumes_with_none_lost_and_none_twice(tmp_path, demo_assets):
    cfgp, ctx, ids = _two_epochs(tmp_path, demo_assets, "recapture-killed", checkpoint_every=4)
    ledger = Path(ctx.layout.stream_ledger_file)
    with StreamRun(cfgp, ctx) as sr:
        assert sr.ep is not None
        peak = Peak(sr.ep)
        # killed once epoch 1 has a commit and later batches taken, not trained
        killed = kill_trainer_mid_epoch(sr.run, sr.start_workers, ledger, epoch=1, timeout=600)
        assert 0 < len(killed.trained) < SAMPLES and killed.pending
        rc, out, err = train_beside_workers(sr.run, lambda: None, lambda: sr.wait_workers(timeout=600), timeout=600)
        top = peak.stop()
        assert rc == 0, out[-3000:] + err[-3000:]
        assert "resuming from" in out and "exactly once: every sample trained exactly once" in out, out[-3000:]
        assert 0 < top <= BUFFER_BYTES, (top, BUFFER_BYTES)
        assert int(metrics(sr.ep)["master_key_count"]) == 0
    state = read_ledger(ledger)
    assert killed.pending <= set(state.epoch(1).trained)           # served again in epoch 1, from pass 1
    require_exactly_once(ledger, ids, epochs=2)                      # 0 lost, 0 trained twice, both epochs
    assert json.loads(Path(ctx.layout.stream_verified_file).read_text())["ok"]
    _passes_on_disk(ctx)
