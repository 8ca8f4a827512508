"""Disk budget: the estimate (checked against a real safetensors file and the seeds' figures),
and the go/no-go with a free-space figure the test sets through the node."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagleflow.capture.protocol import expand_dump_dir
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
def test_header_estimate_matches_a_real_capture_file(tmp_path, dtype, n, model):
    shape = TargetShape(hidden_size=64, dtype=dtype, num_layers=8)
    tdt = getattr(torch, dtype)
    tensors = {"input_ids": torch.zeros(n, dtype=torch.int64), "loss_mask": torch.zeros(n, dtype=torch.uint8),
               "aux_hidden_states": torch.zeros(n, 192, dtype=tdt), "hidden_states": torch.zeros(n, 64, dtype=tdt)}
    meta = {"id": "sharegpt:12", "index": "57", "aux_layers": json.dumps([1, 3, 4]), "model": model}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata=meta)
    predicted = n * bytes_per_token(shape) + safetensors_header_bytes(n, shape, [1, 3, 4], model, "sharegpt:12", 57)
    assert os.path.getsize(tmp_path / "x.safetensors") == predicted


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
    with pytest.raises(BudgetError, match="set capture.dtype"):
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
    assert node.asked == [str(layout.hidden_states_dir), str(expand_dump_dir(cfg.capture.dump_dir))]  # the node user's

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
    """A full capture.dump_dir fails the budget by name before capture (not later as a 'dead server')."""
    cfg, layout = _setup(tmp_path, demo_assets)
    dump_dir = str(expand_dump_dir(cfg.capture.dump_dir))   # the node user's folder ({uid} filled in)
    dumps = cfg.capture.shards * cfg.capture.in_flight   # fewer than the 100 records
    need = dumps * 400 * 1033                             # longest sample x bytes per token
    fine = check_budget(cfg, layout, FixedFreeNode(free=10**12, free_at={dump_dir: need}))
    assert fine.ok and "dump_dir" in fine.message
    full = check_budget(cfg, layout, FixedFreeNode(free=10**12, free_at={dump_dir: need - 1}))
    assert not full.ok
    assert full.message.startswith("NOT ENOUGH SPACE IN capture.dump_dir") and dump_dir in full.message
