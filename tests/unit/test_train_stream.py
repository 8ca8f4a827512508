"""The streaming trainer's commit protocol (issue 53): a trainer killed after its checkpoint was durable but before
the ledger recorded the checkpoint's batches as trained finds them in the checkpoint at resume: recorded then,
released after their last epoch, never served again (0 trained twice); the rest of the epoch is served once."""
from __future__ import annotations

from eagleflow.stores.ledger import EpochLedger, read_ledger, require_exactly_once
from eagleflow.train.data import StreamLoader
from eagleflow.train.stream import reconcile_ledger
from tests.unit.test_stream_ledger import MemorySource


def test_a_kill_between_the_checkpoint_and_its_commit_is_repaired_at_resume(tmp_path):
    src = MemorySource()
    for i in range(7):
        src.add(i)
    path = tmp_path / "l.jsonl"
    first = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=7, shuffle_window=3)
    _, a = first.next_batch()
    first.commit(1)
    _, b = first.next_batch()
    # the checkpoint of step 2 is durable and records b; the trainer dies before first.commit(2)
    ck_state = {"step": 2, "stream": {"uncommitted": first.uncommitted}}
    assert first.uncommitted == [(0, [r.id for r in b])] and first.uncommitted_bytes == sum(r.bytes for r in b)
    assert set(read_ledger(path).epoch(0).pending) == {r.id for r in b}      # taken, not trained: as a kill leaves
    logs: list[str] = []
    assert reconcile_ledger(path, ck_state, 1, src, fsync=False, log=logs.append) == 2
    assert sorted(src.released) == sorted(r.id for r in (*a, *b)) and "recorded now" in logs[0]
    assert reconcile_ledger(path, ck_state, 1, src, fsync=False, log=logs.append) == 0   # once only
    again = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=7, shuffle_window=3)
    served = []
    step = 2
    while not again.finished:
        _, refs = again.next_batch()
        served += [r.id for r in refs]
        step += 1
        again.commit(step)
    assert not {r.id for r in (*a, *b)} & set(served) and len(served) == 3
    require_exactly_once(path, {f"s{i}" for i in range(7)}, epochs=1)       # 0 lost, 0 twice


def test_no_checkpoint_or_nothing_uncommitted_writes_nothing(tmp_path):
    src = MemorySource()
    assert reconcile_ledger(tmp_path / "l.jsonl", None, 1, src) == 0
    assert reconcile_ledger(tmp_path / "l.jsonl", {"step": 3, "stream": {"uncommitted": []}}, 1, src) == 0


def test_ready_says_whether_a_step_can_be_drawn_without_waiting(tmp_path):
    src = MemorySource()
    for i in range(3):
        src.add(i)
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=5,
                          shuffle_window=8)
    assert loader.ready(2) and not loader.ready(4)
    loader.next_batch()
    assert not loader.ready(2) and loader.ready(1)        # one arrived, not served: a step of 2 would wait
    src.add(3)
    assert loader.ready(2) and loader.uncommitted and loader.uncommitted_bytes > 0
    loader.next_batch()
    src.add(4)
    assert loader.ready(2)                                 # the epoch has one left: a short last batch
