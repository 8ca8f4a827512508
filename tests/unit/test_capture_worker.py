"""Worker pieces that need no server: shard selection, timeouts, orphaned dumps."""
from __future__ import annotations

import pytest

from eagleflow.serving.dump_protocol import request_id
from eagleflow.heartbeat import WAITING_FOR_ROOM, Heartbeat
from eagleflow.phases.extract.worker import (DEADLINE_CAP_S, HELD_BACK, PACE_MARGIN, ExtractionError, WorkerSettings,
                                     load_samples, note_held_back, remove_orphan_dumps, request_deadline,
                                     shard_indexes)
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


def test_request_deadline_counts_the_queue_and_the_runs_pace():
    own = 60 + 0.05 * 28   # the shipped figure for a 28-token request: 61.4 s
    # nothing observed yet: each request in the queue is counted at the config's own figure
    assert request_deadline(own, 0, None) == pytest.approx(own)
    assert request_deadline(own, 3, None) == pytest.approx(4 * own)
    # issue 27's run: 20 s forwards, 4 queued on a serial server, so each request waits 80 s (> 61.4 s)
    assert request_deadline(own, 3, 20.0) == pytest.approx(own + PACE_MARGIN * 4 * 20.0)
    assert request_deadline(own, 3, 20.0) > 80
    # one request in flight on a node slower than the config's figure: its own pace, not a fixed 61.4 s
    assert request_deadline(own, 0, 100.0) > 100
    # a fast run keeps the config's figure as the floor
    assert request_deadline(own, 3, 0.01) == pytest.approx(own + PACE_MARGIN * 4 * 0.01)
    # capped; a config figure above the cap is kept as it is
    assert request_deadline(own, 255, 1000.0) == DEADLINE_CAP_S
    assert request_deadline(2 * DEADLINE_CAP_S, 3, None) == 2 * DEADLINE_CAP_S


def test_orphaned_dumps_of_this_shard_only_are_removed(tmp_path):
    mine = [request_id("run1", 3, 7), request_id("run1", 3, 11)]
    others = [request_id("run1", 4, 8), request_id("run2", 3, 7)]
    for rid in mine + others:
        (tmp_path / f"{rid}.safetensors").write_bytes(b"x")
    (tmp_path / f".tmp-{request_id('run1', 3, 15)}.99.safetensors").write_bytes(b"x")
    assert remove_orphan_dumps(str(tmp_path), "run1", 3) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r}.safetensors" for r in others)


def test_each_wait_for_room_is_kept_in_the_heartbeat_after_it_ends(tmp_path):
    hb = Heartbeat(job="extract shard 0/1", pid=1)
    note_held_back(hb, None, 5.0)          # an end with no wait begun: nothing
    assert HELD_BACK not in hb.extra and WAITING_FOR_ROOM not in hb.extra
    note_held_back(hb, 10.0, 10.0)
    note_held_back(hb, 11.0, 11.0)         # a second thread begins to wait: the earliest is kept
    assert hb.extra[WAITING_FOR_ROOM] == 10.0 and HELD_BACK not in hb.extra
    note_held_back(hb, None, 13.5)
    assert WAITING_FOR_ROOM not in hb.extra
    assert hb.extra[HELD_BACK] == {"waits": 1, "seconds": 3.5, "longest": [10.0, 13.5]}
    note_held_back(hb, 20.0, 20.0)
    note_held_back(hb, None, 21.0)         # shorter: counted, the longest kept
    assert hb.extra[HELD_BACK] == {"waits": 2, "seconds": 4.5, "longest": [10.0, 13.5]}
    note_held_back(hb, 30.0, 30.0)
    note_held_back(hb, None, 40.0)
    assert hb.extra[HELD_BACK] == {"waits": 3, "seconds": 14.5, "longest": [30.0, 40.0]}
    # written and read back as the watch and the test read it
    hb.write(tmp_path / "heartbeat.json")
    back = Heartbeat.read(tmp_path / "heartbeat.json")
    assert back is not None and back.extra[HELD_BACK]["waits"] == 3 and back.extra[HELD_BACK]["longest"] == [30.0, 40.0]
