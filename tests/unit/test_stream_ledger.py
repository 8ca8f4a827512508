"""The epoch ledger and the streaming loader over the store contract (issue 53): each sample trained exactly once
per epoch, a duplicate or a missing sample fails the check naming it, a resumed loader re-serves what was taken
but not trained."""
from __future__ import annotations

import io
from typing import Callable

import pytest
import torch

from eagleflow.stores.contract import SampleRef, SampleRefused, SampleSource, StoreUnavailable
from eagleflow.stores.encoding import encode_sample
from eagleflow.stores.ledger import EpochLedger, LedgerError, check_exactly_once, read_ledger, require_exactly_once
from eagleflow.train.data import StreamLoader, StreamStarved


class MemorySource:
    """The contract in memory: samples 'arrive' when added."""
    store = "memory store"
    streaming = True

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.refs: list[SampleRef] = []
        self.released: list[str] = []
        self.down = False                       # lost (its master killed): every call fails
        self.comes_back: Callable[[], None] | None = None   # what a restart does (its shards re-capture)

    def add(self, i: int) -> None:
        enc = encode_sample(index=i, sample_id=f"s{i}", input_ids=torch.arange(3 + i % 4), loss_mask=[1] * (3 + i % 4),
                            aux_hidden_states=torch.zeros(3 + i % 4, 6), hidden_states=torch.zeros(3 + i % 4, 2),
                            aux_layers=[1, 2, 3], model="m")
        key = f"run/shard_00000/{i:08d}"
        self.data[key] = enc.to_bytes()
        self.refs.append(SampleRef(0, i, f"s{i}", key, enc.tokens, enc.size, enc.sha256()))

    def scan(self):
        return list(self.refs)

    def open(self, ref):
        if self.down:
            raise StoreUnavailable(self.store, f"get {ref.path}: the master does not answer")
        if ref.path not in self.data:    # as Mooncake's source: a line naming a sample the store does not hold
            raise SampleRefused(f"{self.store}: sample {ref.id} (key {ref.path}) is recorded in shard "
                                f"{ref.shard}'s manifest but not in the store")
        return io.BytesIO(self.data[ref.path])

    def release(self, ref):   # as the contract says: a sample already gone is no error
        if self.down:
            raise StoreUnavailable(self.store, f"remove {ref.path}: the master does not answer")
        if self.data.pop(ref.path, None) is not None:
            self.released.append(ref.id)

    def lose(self) -> None:
        """The store is killed: its samples and the lines naming them are gone (scan names a store's own)."""
        self.down, self.data, self.refs = True, {}, []

    def wait_for_store(self, timeout_s, on_wait=None):
        if on_wait is not None:
            on_wait(123.0)
        if self.down and self.comes_back is None:
            raise StoreUnavailable(self.store, f"the store did not come back within {timeout_s:g} s")
        if self.down:
            self.down = False
            self.comes_back()
        if on_wait is not None:
            on_wait(None)
        return True

    def close(self):
        pass


def test_the_memory_source_keeps_the_contract():
    assert isinstance(MemorySource(), SampleSource)


def test_exactly_once_fails_on_a_duplicate_and_on_a_missing_sample(tmp_path):
    led = EpochLedger(tmp_path / "ledger.jsonl", fsync=False)
    led.taken(0, ["a", "b"])
    led.trained(0, ["a", "b"], step=1)
    led.trained(0, ["a"], step=2)                     # a trained twice, c never
    led.close()
    check = check_exactly_once(read_ledger(tmp_path / "ledger.jsonl"), {"a", "b", "c"}, epochs=1)
    assert not check.ok and check.duplicates == {0: ["a"]} and check.missing == {0: ["c"]}
    with pytest.raises(LedgerError, match=r"epoch 0: 1 trained twice or more \(a\); epoch 0: 1 never trained \(c\)"):
        require_exactly_once(tmp_path / "ledger.jsonl", {"a", "b", "c"}, epochs=1)
    assert check_exactly_once(read_ledger(tmp_path / "ledger.jsonl"), {"a", "b"}, 1).duplicates == {0: ["a"]}


def test_a_cut_off_line_is_ignored_and_sealed(tmp_path):
    path = tmp_path / "ledger.jsonl"
    led = EpochLedger(path, fsync=False)
    led.trained(0, ["a"], step=1)
    led.close()
    with open(path, "ab") as f:
        f.write(b'{"epoch":0,"event":"trained","ids":["b"')     # a crash mid-append
    led = EpochLedger(path, fsync=False)
    led.trained(0, ["c"], step=2)
    led.close()
    st = read_ledger(path)
    assert set(st.epoch(0).trained) == {"a", "c"} and st.bad_lines == [2]


def test_two_epochs_each_sample_once_and_released_after_its_last(tmp_path):
    src = MemorySource()
    for i in range(10):
        src.add(i)
    led = EpochLedger(tmp_path / "l.jsonl", fsync=False)
    loader = StreamLoader(src, led, batch_size=3, corpus_size=10, shuffle_window=4, epochs=2)
    step = 0
    orders = []
    while not loader.finished:
        batch, refs = loader.next_batch()
        assert batch.input_ids.shape[0] == len(refs)
        orders.append([r.id for r in refs])
        step += 1
        loader.commit(step)
    require_exactly_once(tmp_path / "l.jsonl", {f"s{i}" for i in range(10)}, epochs=2)
    assert sorted(src.released) == sorted(f"s{i}" for i in range(10)) and not src.data
    flat = [i for o in orders for i in o]
    assert flat[:10] != [f"s{i}" for i in range(10)]        # the window shuffles


def test_a_resumed_loader_serves_again_what_was_taken_but_not_trained(tmp_path):
    src = MemorySource()
    for i in range(9):
        src.add(i)
    led = EpochLedger(tmp_path / "l.jsonl", fsync=False)
    first = StreamLoader(src, led, batch_size=2, corpus_size=9, shuffle_window=3)
    _, a = first.next_batch()
    first.commit(1)
    _, lost = first.next_batch()                             # taken, then the trainer dies before its step
    assert set(read_ledger(tmp_path / "l.jsonl").epoch(0).pending) == {r.id for r in lost}
    again = StreamLoader(src, led, batch_size=2, corpus_size=9, shuffle_window=3)
    _, b = again.next_batch()
    assert [r.id for r in b] == sorted(r.id for r in lost)   # served again, first
    step = 2
    again.commit(step)
    while not again.finished:
        again.next_batch()
        step += 1
        again.commit(step)
    require_exactly_once(tmp_path / "l.jsonl", {f"s{i}" for i in range(9)}, epochs=1)


def test_a_starved_loader_names_the_store_and_the_producer(tmp_path):
    src = MemorySource()
    src.add(0)
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=5,
                          starve_after_s=0.3)
    with pytest.raises(StreamStarved, match=r"memory store: no new sample for 0.3 s in epoch 0 .*producer"):
        loader.next_batch()


def test_a_loader_says_when_it_waits_for_the_producer_and_when_it_stops(tmp_path):
    """Issue 53: on_wait(the time it began) once a draw has to wait, on_wait(None) once a sample came: the
    trainer's heartbeat carries it, so its watch tells a starved trainer from a stuck one."""
    import threading
    import time
    src = MemorySource()
    src.add(0)
    calls: list = []
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=2,
                          shuffle_window=1, starve_after_s=30, on_wait=calls.append)
    t0 = time.time()
    threading.Timer(0.4, lambda: src.add(1)).start()   # the producer's next sample, late
    _, refs = loader.next_batch()
    assert sorted(r.id for r in refs) == ["s0", "s1"]
    assert len(calls) == 2 and calls[1] is None and t0 <= calls[0] <= t0 + 0.4
    # the seconds it waited, for the step's metrics (the benchmark's steps/s when the producer keeps up)
    assert 0.3 <= loader.waited_s <= 5.0, loader.waited_s


def test_a_store_lost_mid_epoch_is_waited_for_and_what_it_lost_trained_once(tmp_path):
    """Issue 53: the store dies with a batch trained but not committed and the next being read. The loader waits
    for the new incarnation (saying so), serves the unread batch again first once re-captured, never draws the
    uncommitted one again (its commit records it), and the epoch ends with every sample trained once."""
    src = MemorySource()
    for i in range(8):
        src.add(i)
    path = tmp_path / "l.jsonl"
    waits: list = []
    loader = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=8, shuffle_window=3,
                          starve_after_s=5, on_store_wait=waits.append, read_ahead=False)   # the read in line
    _, a = loader.next_batch()
    loader.commit(1)
    _, held = loader.next_batch()                 # trained, not committed when the store dies
    trained = set(read_ledger(path).epoch(0).trained)

    def recapture():                              # the shards' resume: every line not trained is put again
        for i in range(8):
            if f"s{i}" not in trained:
                src.add(i)
    src.comes_back = recapture
    src.lose()
    _, b = loader.next_batch()                    # its first read fails: the store is waited for
    assert waits == [123.0, None] and loader.stores_lost == 1
    pending = read_ledger(path).epoch(0).pending
    assert {r.id for r in held} | {r.id for r in b} <= pending
    loader.commit(2)
    step = 2
    while not loader.finished:
        _, refs = loader.next_batch()
        assert not {r.id for r in refs} & {r.id for r in held}     # never drawn again in the epoch
        step += 1
        loader.commit(step)
    require_exactly_once(path, {f"s{i}" for i in range(8)}, epochs=1)


def test_a_store_lost_between_reads_and_first_seen_by_a_commit_drops_the_lost_stores_refs(tmp_path):
    """The race of test_stream_master_killed: the master dies between two reads, so the first call to fail is the
    commit's release, not a read. The new incarnation holds none of the lost samples until their shards capture
    them again: the loader must forget the refs it knew from the lost store (its window), waiting for the
    re-captured ones, never draw a stale ref and fail with SampleRefused ('recorded ... but not in the store')."""
    src = MemorySource()
    for i in range(8):
        src.add(i)
    path = tmp_path / "l.jsonl"
    loader = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=8, shuffle_window=8,
                          starve_after_s=0.3, poll_s=0.01, read_ahead=False)
    loader.next_batch()
    src.comes_back = lambda: None                 # the new store comes back empty: no shard re-ran yet
    src.lose()
    loader.commit(1)                              # its release sees the store lost and waits for the new one
    with pytest.raises(StreamStarved):            # waits for the re-capture: nothing stale is drawn and opened
        loader.next_batch()
    assert loader.stores_lost == 1 and not loader.ready(2)
    trained = set(read_ledger(path).epoch(0).trained)
    for i in range(8):                            # the shards' resume: every line not trained is put again
        if f"s{i}" not in trained:
            src.add(i)
    step = 1
    while not loader.finished:
        loader.next_batch()
        step += 1
        loader.commit(step)
    require_exactly_once(path, {f"s{i}" for i in range(8)}, epochs=1)


def test_a_store_that_does_not_come_back_fails_naming_it(tmp_path):
    src = MemorySource()
    for i in range(4):
        src.add(i)
    loader = StreamLoader(src, EpochLedger(tmp_path / "l.jsonl", fsync=False), batch_size=2, corpus_size=4,
                          store_down_timeout_s=0.5)
    src.down = True
    with pytest.raises(StoreUnavailable, match=r"memory store: the store did not come back within 0.5 s"):
        loader.next_batch()


def test_after_a_lost_store_the_window_is_drawn_while_a_sample_to_serve_again_is_not_back(tmp_path):
    """The unread batch is served again first only once re-captured: until then the loader draws from the window
    (the buffer may be full of later samples, and only a draw makes room for it: waiting would deadlock)."""
    src = MemorySource()
    for i in range(8):
        src.add(i)
    path = tmp_path / "l.jsonl"
    loader = StreamLoader(src, EpochLedger(path, fsync=False), batch_size=2, corpus_size=8, shuffle_window=3,
                          starve_after_s=1, read_ahead=False)
    loader.next_batch()
    loader.commit(1)
    late: set[str] = set()

    def recapture():          # every untrained sample back, except the batch being read when the store died
        state = read_ledger(path).epoch(0)
        late.update(state.pending)
        for i in range(8):
            if f"s{i}" not in set(state.trained) | late:
                src.add(i)
    src.comes_back = recapture
    src.lose()
    _, b = loader.next_batch()                    # would starve (1 s) waiting for the late ones
    assert len(late) == 2 and not {r.id for r in b} & late
    loader.commit(2)
    for i in range(8):
        if f"s{i}" in late:
            src.add(i)                            # captured again, later
    step = 2
    while not loader.finished:
        loader.next_batch()
        step += 1
        loader.commit(step)
    require_exactly_once(path, {f"s{i}" for i in range(8)}, epochs=1)
