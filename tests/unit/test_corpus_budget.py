"""Disk budget: the estimate (checked against a real safetensors file and the seeds' figures),
and the go/no-go with a free-space figure the test sets through the node."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eagleflow.capture.storage import SampleWriter
from eagleflow.serving.dump_protocol import expand_dump_dir
from eagleflow.config import load_config
from eagleflow.corpus.budget import (BudgetError, TargetShape, bytes_per_token, check_budget, estimate,
                                     safetensors_header_bytes, target_shape)
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from tests.fixtures.corpus import GOOD_SOURCES, write_config


class FixedFreeNode(LocalNode):
    """A local node whose free space is whatever the test says; remembers where it was asked."""

    def __init__(self, free: int, free_at: dict[str, int] | None = None):
        super().__init__(name="test-node")
        self.free = free
        self.free_at = free_at or {}
        self.asked: list[str] = []

    def free_bytes(self, path: str) -> int:
        self.asked.append(path)
        return self.free_at.get(path, self.free)


@pytest.mark.parametrize("dtype, n, model", [("bfloat16", 37, "/models/tiny"), ("float32", 1234, "/m/x"),
                                              ("float16", 5, "/a/much/longer/model/path/for/the/header")])
@pytest.mark.parametrize("store_dtype", ["auto", "fp8_e4m3"])
def test_header_estimate_matches_a_real_capture_file(tmp_path, dtype, n, model, store_dtype):
    shape = TargetShape(hidden_size=64, dtype=dtype, num_layers=8)
    tdt = getattr(torch, dtype)
    st = SampleWriter(tmp_path, fsync=False, store_dtype=store_dtype).write(
        index=57, sample_id="sharegpt:12", input_ids=torch.zeros(n, dtype=torch.int64),
        loss_mask=torch.zeros(n, dtype=torch.uint8), aux_hidden_states=torch.randn(n, 192).to(tdt),
        hidden_states=torch.randn(n, 64).to(tdt), aux_layers=[1, 3, 4], model=model)
    predicted = (n * bytes_per_token(shape, store_dtype)
                 + safetensors_header_bytes(n, shape, [1, 3, 4], model, "sharegpt:12", 57, store_dtype))
    assert os.path.getsize(st.path) == st.bytes == predicted


def test_fp8_budget_at_the_seeds_size_is_half_and_names_what_auto_needs():
    shape = TargetShape(hidden_size=7168, dtype="bfloat16", num_layers=61)
    # by arithmetic: 4 x 7168 one-byte elements + 4 float32 scales + int64 id + uint8 mask
    assert bytes_per_token(shape, "fp8_e4m3") == 4 * 7168 + 4 * 4 + 9 == 28_697
    assert bytes_per_token(shape) == 57_353
    assert bytes_per_token(shape, "fp8_e4m3") / bytes_per_token(shape) <= 0.51
    kw = dict(aux_layers=shape.default_aux_layers(), model="/models/Kimi-K2.5", longest_id="ultrachat_200k:37311",
              headroom_fraction=0.05)
    fp8 = estimate(37_312, 87_800_000, shape, store_dtype="fp8_e4m3", **kw)
    auto = estimate(37_312, 87_800_000, shape, **kw)
    assert fp8.store_dtype == "fp8_e4m3" and fp8.auto_needed_bytes == auto.needed_bytes
    assert 0.49 < fp8.needed_bytes / auto.needed_bytes < 0.51
    assert 2.25 < fp8.total_bytes / 2**40 < 2.35 and 4.55 < auto.total_bytes / 2**40 < 4.65


def test_seeds_corpus_needs_about_4_6_tib():
    kimi = json.dumps({"model_type": "kimi_k25", "text_config": {"hidden_size": 7168, "num_hidden_layers": 61,
                                                                 "torch_dtype": "bfloat16"}})
    shape = target_shape(kimi, "kimi/config.json")
    assert (shape.hidden_size, shape.dtype, shape.dtype_bytes) == (7168, "bfloat16", 2)
    est = estimate(37_312, 87_800_000, shape, aux_layers=shape.default_aux_layers(), model="/models/Kimi-K2.5",
                   longest_id="ultrachat_200k:37311", headroom_fraction=0.05)
    assert est.bytes_per_token == 4 * 7168 * 2 + 8 + 1
    assert 4.55 < est.total_bytes / 2**40 < 4.65   # the seeds planned ~4.6 TB
    assert est.needed_bytes == int(est.total_bytes * 1.05)


def test_bad_target_config_is_named():
    with pytest.raises(BudgetError, match="hidden_size = None"):
        target_shape("{}", "/m/config.json")
    with pytest.raises(BudgetError, match="set server.dtype"):
        target_shape('{"hidden_size": 8, "torch_dtype": "int4"}', "/m/config.json")


def _setup(tmp_path, demo_assets, **disk):
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], GOOD_SOURCES, disk=disk or None))
    layout = RunLayout.for_run(cfg, "b")
    corpus = Path(str(layout.corpus_dir))
    corpus.mkdir(parents=True)
    (corpus / "stats.json").write_text(json.dumps({"records": 100, "tokens": 20_000, "length": {"max": 400},
                                                   "per_source": {"sg": {}, "oa_json": {}}}))
    return cfg, layout


def test_disk_check_passes_and_fails_on_the_nodes_free_space(tmp_path, demo_assets):
    cache_root = tmp_path / "caches"
    (cache_root / "old_run").mkdir(parents=True)
    (cache_root / "old_run" / "blob.bin").write_bytes(b"\1" * 300_000)
    cfg, layout = _setup(tmp_path, demo_assets, cache_root=str(cache_root),
                         old_caches=[str(cache_root / "old_run"), str(cache_root / "gone")])
    # demo target: hidden 64, float32 -> 4*64*4 + 8 + 1 bytes a token
    probe = check_budget(cfg, layout, FixedFreeNode(free=10**12))
    est = probe.estimate
    assert est.bytes_per_token == 1033 and est.tensor_bytes == 20_000 * 1033
    assert est.needed_bytes == int(est.total_bytes * 1.05)

    node = FixedFreeNode(free=est.needed_bytes)
    ok = check_budget(cfg, layout, node)
    assert ok.ok and ok.message.startswith("disk OK")
    assert node.asked == [str(layout.hidden_states_dir), str(expand_dump_dir(cfg.server.dump_dir))]  # the node user's

    short = check_budget(cfg, layout, FixedFreeNode(free=est.needed_bytes - 1))
    assert not short.ok
    msg = short.message
    assert msg.startswith("NOT ENOUGH DISK")
    assert f"({est.needed_bytes} bytes" in msg and f"({est.needed_bytes - 1} bytes)" in msg
    assert str(layout.hidden_states_dir) in msg and "node test-node" in msg
    assert f"{cache_root / 'old_run'}: " in msg and "gone" not in msg
    assert short.old_caches[str(cache_root / "old_run")] >= 300_000
    assert short.old_caches[str(cache_root / "gone")] is None
    assert "Deleting them would be enough" in msg and "delete_old_caches" in msg


def test_disk_check_without_corpus_says_what_to_run(tmp_path, demo_assets):
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], GOOD_SOURCES))
    with pytest.raises(BudgetError, match="run `eagleflow corpus prepare`"):
        check_budget(cfg, RunLayout.for_run(cfg, "none"), FixedFreeNode(free=1))


def test_disk_check_counts_the_dump_dir(tmp_path, demo_assets):
    """A full server.dump_dir fails the budget by name before capture (not later as a 'dead server')."""
    cfg, layout = _setup(tmp_path, demo_assets)
    dump_dir = str(expand_dump_dir(cfg.server.dump_dir))   # the node user's folder ({uid} filled in)
    dumps = cfg.capture.shards * cfg.capture.in_flight   # fewer than the 100 records
    need = dumps * 400 * 1033                             # longest sample x bytes per token
    fine = check_budget(cfg, layout, FixedFreeNode(free=10**12, free_at={dump_dir: need}))
    assert fine.ok and "dump_dir" in fine.message
    full = check_budget(cfg, layout, FixedFreeNode(free=10**12, free_at={dump_dir: need - 1}))
    assert not full.ok
    assert full.message.startswith("NOT ENOUGH SPACE IN server.dump_dir") and dump_dir in full.message


def test_disk_check_with_fp8_store_halves_the_need_and_says_what_auto_would_need(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets)
    auto = check_budget(cfg, layout, FixedFreeNode(free=10**12)).estimate
    cfg8 = cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"store_dtype": "fp8_e4m3"})})
    v = check_budget(cfg8, layout, FixedFreeNode(free=10**12))
    # demo target: hidden 64, float32 -> fp8: 4*64 + 16 + 9 bytes a token
    assert v.estimate.bytes_per_token == 281 and v.estimate.tensor_bytes == 20_000 * 281
    assert v.estimate.auto_needed_bytes == auto.needed_bytes > 3 * v.estimate.needed_bytes
    assert "fp8_e4m3 + scales" in v.message and "capture.store_dtype auto (float32) would need" in v.message
    # free space between the two: fp8 fits where auto would not
    between = FixedFreeNode(free=v.estimate.needed_bytes)
    assert check_budget(cfg8, layout, between).ok and not check_budget(cfg, layout, between).ok


def test_the_budget_counts_the_held_out_records_captured_for_training_time_evaluation(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets)
    stats_file = Path(str(layout.corpus_dir)) / "stats.json"
    stats = json.loads(stats_file.read_text())
    stats.update(eval_records=10, eval_tokens=2_000)
    stats_file.write_text(json.dumps(stats))
    cfg.train.held_out_samples = 4
    verdict = check_budget(cfg, layout, FixedFreeNode(free=10**12))
    assert verdict.estimate.records == 104 and verdict.estimate.tokens == 20_800   # 4 of mean length 200
    assert "hidden states for 104 samples (4 of them held out) / 20800 tokens" in verdict.message
    cfg.train.eval_every = 0     # no training-time evaluation: nothing held out is captured
    assert check_budget(cfg, layout, FixedFreeNode(free=10**12)).estimate.records == 100
