"""The training reader's reused host buffers (train/data.py HostBufferPool): reuse must never change a batch
the caller still holds, a reused padded batch must pad with zeros like a fresh one, and a buffer comes back
to its pool only when the last tensor viewing it is gone.

Real stored samples (the capture storage format, tests/fixtures/train_hidden_states.py), bf16 and fp8 stores.
"""
from __future__ import annotations

import pytest
import torch

from eagleflow.train.data import (SAMPLE_KEYS, Batch, HiddenStateLoader, HostBufferPool, collate, epoch_batches,
                                  read_sample_keys, scan_samples)
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states

FIELDS = ("input_ids", "loss_mask", "attention_mask", "aux_hidden_states", "hidden_states", "aux_scale",
          "hidden_scale")


def _clone(b: Batch) -> dict[str, torch.Tensor | None]:
    return {k: None if getattr(b, k) is None else getattr(b, k).clone() for k in FIELDS}


def _assert_same(b: Batch, want: dict[str, torch.Tensor | None], what: str) -> None:
    for k in FIELDS:
        got = getattr(b, k)
        if want[k] is None:
            assert got is None, (what, k)
        else:
            assert got.dtype == want[k].dtype and torch.equal(got.view(torch.uint8) if got.dtype ==
                                                              torch.float8_e4m3fn else got,
                                                              want[k].view(torch.uint8) if got.dtype ==
                                                              torch.float8_e4m3fn else want[k]), (what, k)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, demo_assets):
    out = {}
    for store in ("auto", "fp8_e4m3"):
        hs = tmp_path_factory.mktemp(f"hs-{store}")
        write_synthetic_hidden_states(hs, demo_assets["target_model"], samples=12, shards=2, min_len=8,
                                      max_len=40, dtype=torch.bfloat16, store_dtype=store)
        out[store] = scan_samples(hs, log=lambda _m: None)
    return out


@pytest.mark.parametrize("store", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_held_batch_is_never_overwritten_by_the_next_reads(stores, store, batch_size):
    refs = stores[store]
    # one kept buffer per pool: any early give-back would hand batch 1's memory to the very next read
    loader = HiddenStateLoader(refs, batch_size=batch_size, seed=5, buffers=1)
    held = loader.next_batch()
    want = _clone(held)
    for _ in range(6):               # read, use and drop several batches while batch 1 is held
        b = loader.next_batch()
        assert b.aux_hidden_states.data_ptr() != held.aux_hidden_states.data_ptr()
        del b
    _assert_same(held, want, "held batch after later reads")
    pool = loader.sample_buffers if batch_size == 1 else loader.batch_buffers
    assert pool.reused >= 2, (pool.allocated, pool.reused)   # the dropped batches' buffers were reused
    # a view that outlives the batch object keeps the buffer too (the trainer keeps what Batch.to returns:
    # on the CPU without a cast it is the same memory)
    kept = held.to(torch.device("cpu")).hidden_states[0] if store == "auto" else held.hidden_states[0]
    del held
    for _ in range(3):
        loader.next_batch()
    assert torch.equal(kept.view(torch.uint8), want["hidden_states"][0].view(torch.uint8))
    loader.close()


@pytest.mark.parametrize("store", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("batch_size,max_length", [(1, None), (3, None), (3, 20), (1, 12)])
def test_reused_buffers_give_the_batches_fresh_ones_give(stores, store, batch_size, max_length):
    """The whole epoch, twice (buffers reused across the epoch boundary): equal to collating freshly read
    samples, padding zeros included (a reused padded batch held a longer batch's rows before)."""
    refs = stores[store]
    loader = HiddenStateLoader(refs, batch_size=batch_size, seed=2, buffers=2, max_length=max_length)
    for epoch in range(2):
        for members in epoch_batches(refs, batch_size, 2, epoch):
            want = collate([read_sample_keys(refs[i], SAMPLE_KEYS) for i in members], max_length)
            got = loader.next_batch()
            _assert_same(got, _clone(want), f"epoch {epoch} batch {members}")
            if batch_size > 1:
                n = got.attention_mask.sum(1)
                for row, k in enumerate(n.tolist()):
                    assert bool((got.aux_hidden_states[row, k:].float() == 0).all())
            del got
    assert loader.sample_buffers.reused > 0
    if batch_size > 1 or max_length:        # padded or cut: built in the batch pool's buffers
        assert loader.batch_buffers.reused > 0
    loader.close()


def test_fresh_allocation_mode_reads_the_same_batches(stores):
    refs = stores["auto"]
    a = HiddenStateLoader(refs, batch_size=3, seed=1, buffers=0, prefetch=False)
    b = HiddenStateLoader(refs, batch_size=3, seed=1, buffers=3)
    assert a.sample_buffers is None and a.batch_buffers is None
    for _ in range(4):
        _assert_same(b.next_batch(), _clone(a.next_batch()), "buffers=0 vs 3")
    b.close()


def test_pool_gives_a_buffer_back_only_when_its_last_view_is_gone():
    pool = HostBufferPool(keep=2, round_to=4096)
    t = pool.take(1000)
    assert t.dtype == torch.uint8 and t.numel() == 1000 and pool.allocated == 1
    ptr = t.data_ptr()
    v = t[64:128].view(torch.bfloat16).view(4, 8).unsqueeze(0)     # the shapes the reader hands out
    del t
    assert pool.free == 0                       # the view still holds it
    other = pool.take(1000)                     # so this one cannot be that memory
    assert other.data_ptr() != ptr and pool.allocated == 2
    del v
    assert pool.free == 1
    again = pool.take(900)
    assert again.data_ptr() == ptr and pool.reused == 1 and pool.free == 0
    del again, other
    assert pool.free == 2
    big = pool.take(10_000)                     # larger than any kept block: a new one, sized to it
    assert pool.allocated == 3 and big.numel() == 10_000
    del big
    assert pool.free == 2                       # at most keep: the smallest (a 4 KiB one) went
    small = [pool.take(100) for _ in range(3)]
    assert pool.reused == 3 and pool.allocated == 4    # the 4 KiB block, the big one, then a new one
    del small
    assert pool.free == 2                       # the 4 KiB block is smaller than the largest request: not kept
    big = [pool.take(10_000) for _ in range(2)]
    assert all(t.numel() == 10_000 for t in big)
    assert pool.reused == 5 and pool.allocated == 4     # the new block was sized to the largest request


def test_collate_checks_the_lengths_it_is_given(stores):
    refs = stores["auto"][:2]
    samples = [read_sample_keys(r, SAMPLE_KEYS) for r in refs]
    wrong = [refs[0].tokens + 1, refs[1].tokens]
    with pytest.raises(ValueError, match=f"sample 0 of the batch has {refs[0].tokens} tokens, lengths says"):
        collate(iter(samples), lengths=wrong)


def test_a_sample_read_into_one_buffer_is_what_a_fresh_read_gives(stores):
    for store, refs in stores.items():
        pool = HostBufferPool(keep=1)
        for r in refs[:4]:
            fresh = read_sample_keys(r, SAMPLE_KEYS)
            pooled = read_sample_keys(r, SAMPLE_KEYS, pool.take)
            assert set(fresh) == set(pooled)
            base = {t.untyped_storage().data_ptr() for t in pooled.values() if t.numel()}
            assert len(base) == 1, store                # one block for the sample
            for k in fresh:
                assert fresh[k].dtype == pooled[k].dtype and fresh[k].shape == pooled[k].shape
                assert torch.equal(fresh[k].view(torch.uint8), pooled[k].view(torch.uint8)), (store, k)
            del pooled
        assert pool.reused == 3, store
