"""Worker pieces that need no server: shard selection, timeouts, orphaned dumps."""
from __future__ import annotations

import pytest

from eagleflow.capture.protocol import request_id
from eagleflow.capture.worker import ExtractionError, WorkerSettings, load_samples, remove_orphan_dumps, shard_indexes
from tests.fixtures.capture_corpus import write_corpus


def test_load_samples_reads_only_the_shard_and_skips_done(tmp_path):
    rows = write_corpus(tmp_path / "corpus.parquet", 50, 300)
    total, todo = load_samples(str(tmp_path / "corpus.parquet"), 1, 3, skip={1, 4})
    assert total == 17
    assert [s.index for s in todo] == [i for i in range(50) if i % 3 == 1 and i not in (1, 4)]
    for s in todo:
        assert s.input_ids == rows[s.index]["input_ids"] and s.loss_mask == rows[s.index]["loss_mask"]
        assert s.id == rows[s.index]["id"]
    assert shard_indexes(str(tmp_path / "corpus.parquet"), 2, 3) == list(range(2, 50, 3))
    with pytest.raises(ExtractionError, match="run `eagleflow corpus prepare` first"):
        load_samples(str(tmp_path / "missing.parquet"), 0, 1, set())


def test_request_timeout_grows_with_length_and_is_bounded():
    s = WorkerSettings(run_id="r", shard=0, num_shards=1, corpus_file="", shard_dir="", dump_dir="", server_url="",
                       request_timeout_base_s=60, request_timeout_per_token_s=0.05)
    assert s.request_timeout(0) == 60 and s.request_timeout(8192) == pytest.approx(60 + 409.6)


def test_orphaned_dumps_of_this_shard_only_are_removed(tmp_path):
    mine = [request_id("run1", 3, 7), request_id("run1", 3, 11)]
    others = [request_id("run1", 4, 8), request_id("run2", 3, 7)]
    for rid in mine + others:
        (tmp_path / f"{rid}.safetensors").write_bytes(b"x")
    (tmp_path / f".tmp-{request_id('run1', 3, 15)}.99.safetensors").write_bytes(b"x")
    assert remove_orphan_dumps(str(tmp_path), "run1", 3) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r}.safetensors" for r in others)
