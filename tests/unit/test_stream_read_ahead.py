"""The streaming loader reads the next micro-batch while the trainer steps (issue 53: steps/s while capture runs):
what is read ahead is neither served nor taken until handed out, never waits for the producer, and a store lost
under it or a trainer killed with it in flight leaves every sample trained exactly once."""
from __future__ import annotations

import threading

import pytest

from eagleflow.stores.contract import SampleRefused
from eagleflow.stores.ledger import EpochLedger, read_ledger, require_exactly_once
from eagleflow.train.data import StreamLoader
from tests.unit.test_stream_ledger import MemorySource


class GatedSource(MemorySource):
    """MemorySource whose reads on the read-ahead thread wait for ``gate`` and note which thread read them."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.read_on: dict[str, str] = {}

    @classmethod
    def holding(cls, n: int) -> "GatedSource":
        """A source whose first ``n`` samples have arrived."""
        src = cls()
        for i in range(n):
            src.add(i)
        return src

    def open(self, ref):
        name = threading.current_thread().name
        if name.startswith("stream-read-ahead"):
            assert self.gate.wait(10), "the test never opened the gate"
        self.read_on[ref.id] = name
        return super().open(ref)


def _drain(loader: StreamLoader, step: int) -> None:
    while not loader.finished:
        loader.next_batch()
        step += 1
        loader.commit(step)


def test_the_next_batch_is_read_on_the_thread_and_taken_only_when_handed_out(tmp_path):
    src = GatedSource.holding(10)
    path = tmp_path / "l.jsonl"
    loader = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=10, shuffle_window=4)
    try:
        _, first = loader.next_batch()
        assert {src.read_on[r.id] for r in first} == {"MainThread"}    # nothing was ahead of the first
        assert loader.ready(4)               # the batch read ahead counts: a step of 2 x 2 needs no early commit
        assert set(read_ledger(path).epoch(0).pending) == {r.id for r in first}   # the one ahead: not taken
        assert loader.uncommitted == [(0, [r.id for r in first])]           # nor uncommitted
        _, second = loader.next_batch()
        assert all(src.read_on[r.id].startswith("stream-read-ahead") for r in second)
        assert not {r.id for r in first} & {r.id for r in second}
        loader.commit(1)
        _drain(loader, 1)
        require_exactly_once(path, {f"s{i}" for i in range(10)}, epochs=1)
    finally:
        loader.close()


def test_read_ahead_never_waits_for_the_producer(tmp_path):
    """Only samples already in the store are read ahead: a draw that must wait does so in next_batch, where the
    heartbeat says so (else the watch would see a trainer 'waiting for the producer' while it steps)."""
    src = MemorySource()
    for i in range(3):
        src.add(i)
    waits: list = []
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=4,
                          shuffle_window=4, on_wait=waits.append, starve_after_s=5)
    try:
        loader.next_batch()                  # 1 sample left in the store, 2 wanted: nothing read ahead
        assert loader._ahead is None and waits == [] and not loader.ready(2)
        src.add(3)
        assert loader.ready(2)
        _, refs = loader.next_batch()
        assert {r.id for r in refs} <= {"s0", "s1", "s2", "s3"} and len(refs) == 2
    finally:
        loader.close()


def test_a_trainer_killed_with_a_batch_read_ahead_trains_it_once_after_resume(tmp_path):
    src = GatedSource.holding(9)
    path = tmp_path / "l.jsonl"
    first = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=9, shuffle_window=3)
    first.next_batch()
    first.commit(1)
    first._ahead[1].result()                 # the second batch is read (with the gate open)
    src.gate.clear()                         # the next read ahead hangs: the trainer is killed meanwhile
    _, lost = first.next_batch()             # taken and handed out, never trained
    ahead = [r.id for r in first._ahead[0]]
    assert set(read_ledger(path).epoch(0).pending) == {r.id for r in lost}     # not the batch read ahead
    src.gate.set()
    first.close()
    again = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=9, shuffle_window=3)
    try:
        _, b = again.next_batch()
        assert [r.id for r in b] == sorted(r.id for r in lost)    # served again first; the one ahead: as never chosen
        again.commit(2)
        _drain(again, 2)
        assert set(ahead) <= set(read_ledger(path).epoch(0).trained)
        require_exactly_once(path, {f"s{i}" for i in range(9)}, epochs=1)
    finally:
        again.close()


def test_a_store_lost_under_the_read_ahead_is_waited_for_and_every_sample_trained_once(tmp_path):
    """The store dies while the batch ahead is being read: its read fails on the thread, the next draw waits for
    the new incarnation, and the batch's samples are drawn again once their shards put them back."""
    src = GatedSource.holding(8)
    path = tmp_path / "l.jsonl"
    waits: list = []
    loader = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=8, shuffle_window=3,
                          starve_after_s=5, on_store_wait=waits.append)
    try:
        loader.next_batch()
        loader.commit(1)
        loader._ahead[1].result()            # the second batch is read (with the gate open)
        src.gate.clear()
        _, held = loader.next_batch()        # trained, not committed when the store dies; the next one ahead
        ahead = {r.id for r in loader._ahead[0]}
        trained = set(read_ledger(path).epoch(0).trained)

        def recapture():                     # the shards' resume: every line not trained is put again
            for i in range(8):
                if f"s{i}" not in trained:
                    src.add(i)
        src.comes_back = recapture
        src.lose()
        src.gate.set()                       # the read ahead now meets the lost store
        _, b = loader.next_batch()
        assert waits == [123.0, None] and loader.stores_lost == 1
        assert not {r.id for r in b} & {r.id for r in held}
        loader.commit(2)
        _drain(loader, 2)
        require_exactly_once(path, {f"s{i}" for i in range(8)}, epochs=1)
        assert ahead <= set(read_ledger(path).epoch(0).trained)
    finally:
        loader.close()


def test_close_waits_out_a_read_in_flight(tmp_path):
    src = GatedSource.holding(6)
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=6)
    src.gate.clear()
    loader.next_batch()
    fut = loader._ahead[1]
    threading.Timer(0.2, src.gate.set).start()
    loader.close()                           # before the source's client closes under the read
    assert fut.done() and loader._ahead is None


def test_a_read_ahead_error_other_than_a_lost_store_reaches_the_trainer(tmp_path):
    """A sample the store does not hold (SampleRefused) fails the next_batch that hands the batch out, as in line."""
    src = GatedSource.holding(4)
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=4,
                          shuffle_window=4)
    try:
        src.gate.clear()
        loader.next_batch()
        gone = loader._ahead[0][0]
        del src.data[gone.path]
        src.gate.set()
        with pytest.raises(SampleRefused, match=gone.id):
            loader.next_batch()
    finally:
        loader.close()


def test_window_low_says_how_many_samples_a_batch_was_chosen_from(tmp_path):
    """The step's metrics carry it (stream_window): under the shuffle window the producer was not ahead, however
    little the trainer waited; the benchmark's "producer keeps up" counts only the steps drawn from a full one."""
    src = MemorySource()
    for i in range(3):
        src.add(i)
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=10,
                          shuffle_window=8, read_ahead=False)
    loader.next_batch()
    assert loader.window_low() == 3 and loader.window_low() is None     # asked again: no batch chosen since
    for i in range(3, 10):
        src.add(i)
    loader.next_batch()                                  # 1 left + 7 arrived: a full window of 8
    loader.next_batch()
    assert loader.window_low() == 6                      # the fewer of the two (8, then 6)
