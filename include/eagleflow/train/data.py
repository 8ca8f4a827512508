"""Streaming the stored hidden states into training batches.

- Index: every shard's manifest (``hidden_states/shard_*/manifest.jsonl``);
  each entry's file must exist with the recorded size (and, when asked, the
  recorded sha256). A mismatch raises naming the file, or is skipped and
  reported, per ``on_bad``. Given the verification record, only its shards
  are read, and a file written after verification counts as a mismatch
  (training takes only what ``capture verify`` passed).
- Reading: the safetensors header is parsed and checked here, then the
  tensors asked for are read straight into host memory with large sequential
  reads (no mmap page faults, no second copy). Only the tensors asked for are
  read. The loader reads into reused buffers (``HostBufferPool``): a fresh
  470 MB allocation per sample costs more in first-touch page faults than the
  read itself (glibc gives big frees back to the OS, so every sample paid
  again); reused, the reader runs at the disk's sequential rate
  (bench/train.py --real-size). A buffer goes back to its pool only when the
  last tensor viewing it is gone, so a batch still held is never overwritten.
- Order: a pure function of (seed, epoch): shuffle, group ~``bucket_batches``
  batches' worth of samples, sort each group by length (less padding), cut
  into batches, shuffle the batches. The position in that order
  (epoch, cursor) is all a resume needs.
- Several processes (DDP): global batch ``cursor + rank`` goes to ``rank``.
- FP8 stores (``capture.store_dtype: fp8_e4m3``): batches carry the float8
  bytes and their per-token scales; ``Batch.to`` de-quantises on the training
  device, so the host copies and the transfer stay at half width. One run's
  shards must share a store dtype (``scan_samples`` refuses a mix, naming them).
"""
from __future__ import annotations

import os
import random
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from eagleflow.safetensors_format import DTYPES, read_header
from eagleflow.stores.contract import BadSampleError, SampleRef, SampleSource, StoreUnavailable
from eagleflow.stores.disk.store import DiskSource, MixedStoreError, scan_samples
from eagleflow.stores.encoding import QUANTISED_KEYS, SCALE_SUFFIX, dequantise_fp8

__all__ = ["BadSampleError", "MixedStoreError", "SampleRef", "scan_samples"]   # their homes: eagleflow.stores

SAMPLE_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")


# every safetensors dtype a stored sample may hold (F8_E5M2 never is)
_ST_DTYPES = {code: getattr(torch, name) for code, (_size, name) in DTYPES.items() if code != "F8_E5M2"}
_READ_CHUNK = 16 << 20
_ALIGN = 64                  # tensors carved from one buffer start on a 64-byte boundary (any dtype's alignment)

Buffer = Callable[[int], torch.Tensor]   # nbytes -> a 1-D uint8 host tensor of exactly that many bytes
_DISK = DiskSource(".")                  # opens a ref's file: what read_sample_keys reads without a source


class HostBufferPool:
    """Reusable host buffers: ``take(nbytes)`` gives a uint8 tensor backed by a kept block when one fits.

    The block goes back to the pool when the last tensor sharing its memory is freed (views, ``unsqueeze``,
    ``.to`` that returns self included: they all hold the one storage, whose release drops the numpy array
    the finalizer watches), never earlier, so a caller may hold a batch as long as it likes. Blocks are
    sized to the largest request seen (rounded to 2 MiB) so they fit the next sample; at most ``keep``
    free ones are kept (the smallest dropped first; one smaller than the largest request is not kept).
    Thread-safe (the prefetch thread takes, any thread frees).
    """

    def __init__(self, keep: int = 3, round_to: int = 2 << 20):
        self.keep = keep
        self.round_to = round_to
        self.largest = 0
        self.allocated = 0      # fresh blocks made
        self.reused = 0         # takes served from a kept block
        self._free: list[torch.Tensor] = []
        self._lock = threading.RLock()   # a give-back can run inside take() on the same thread (a freed view)

    def take(self, nbytes: int) -> torch.Tensor:
        block = None
        with self._lock:
            self.largest = max(self.largest, nbytes)
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                block = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self.reused += 1
            else:
                self.allocated += 1
        if block is None:
            cap = max(self.largest, 1)
            block = torch.empty(-(-cap // self.round_to) * self.round_to, dtype=torch.uint8)
        arr = block.numpy()[:nbytes]
        weakref.finalize(arr, self._give_back, block).atexit = False
        return torch.from_numpy(arr)

    def _give_back(self, block: torch.Tensor) -> None:
        with self._lock:
            if block.numel() >= self.largest:
                self._free.append(block)
                if len(self._free) > self.keep:     # the smallest goes: the largest fit every sample
                    self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    @property
    def free(self) -> int:
        return len(self._free)


def _carve(buffer: Buffer | None, specs: Sequence[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised tensors of the given shapes: views into one ``buffer`` block, or each its own allocation."""
    import math
    if buffer is None:
        return [torch.empty(shape, dtype=dt) for shape, dt in specs]
    offsets, total = [], 0
    for shape, dt in specs:
        offsets.append(total)
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        total += -(-nbytes // _ALIGN) * _ALIGN
    block = buffer(total)
    out = []
    for (shape, dt), off in zip(specs, offsets):
        n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        out.append(block[off:off + n].view(dt).view(shape) if n else torch.empty(shape, dtype=dt))
    return out


def _read_safetensors(f: Any, keys: Sequence[str], buffer: Buffer | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """(the named tensors, metadata, keys in the file): each tensor in its own allocation, or all of them
    carved from one ``buffer`` block.

    Raises ValueError for a header safetensors would refuse (bad length or JSON, unknown dtype, offsets
    that do not match the shape or run past the file) and OSError for a file cut short."""
    with f:
        h = read_header(f, f.seek(0, os.SEEK_END))    # the one check, shared with the extraction worker
        base = h.data_start
        found: list[tuple[str, int, int, list[int], torch.dtype]] = []
        for k in keys:
            e = h.entries.get(k)
            if e is None:
                continue
            dt = _ST_DTYPES.get(e.dtype)
            if dt is None:
                raise ValueError(f"{k}: dtype {e.dtype!r} is not a stored-sample dtype")
            found.append((k, e.start, e.end - e.start, list(e.shape), dt))
        found.sort(key=lambda x: x[1])       # in file order: one sequential pass
        tensors = _carve(buffer, [(shape, dt) for _k, _s, _n, shape, dt in found])
        out: dict[str, torch.Tensor] = {}
        for (k, start, nbytes, _shape, _dt), t in zip(found, tensors):
            view = t.view(torch.uint8).reshape(-1).numpy().data if nbytes else memoryview(b"")
            f.seek(base + start)
            got = 0
            while got < nbytes:
                k_read = f.readinto(view[got:got + _READ_CHUNK])
                if not k_read:
                    raise OSError(f"file ends after {base + start + got} bytes, inside {k}")
                got += k_read
            out[k] = t
    return out, h.metadata, list(h.entries)


def read_sample_keys(ref: SampleRef, keys: Sequence[str], buffer: Buffer | None = None,
                     source: SampleSource | None = None) -> dict[str, torch.Tensor]:
    """The named tensors of one stored sample, checked for presence and length.

    From an fp8 store a hidden-state key comes as float8 with its ``<key>_scale`` beside it
    (``Batch.to`` de-quantises on the device); the file's own metadata must say fp8_e4m3.
    With ``buffer`` (e.g. ``HostBufferPool.take``) all of them are views into one block from it. ``source``
    gives the bytes (default: the disk store's file at ``ref.path``).
    """
    wanted = list(keys)
    if ref.store_dtype == "fp8_e4m3":
        wanted += [k + SCALE_SUFFIX for k in keys if k in QUANTISED_KEYS]
    f = (source or _DISK).open(ref)    # a streaming source checks the digest here (SampleRefused names the key)
    try:
        out, meta, have = _read_safetensors(f, wanted, buffer)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise BadSampleError(f"{ref.path}: not a readable safetensors file ({e}); re-run its shard's extraction") from None
    stored_as = meta.get("store_dtype", "auto")
    if stored_as != ref.store_dtype:
        raise BadSampleError(f"{ref.path}: its metadata says store_dtype {stored_as}, its manifest line "
                             f"says {ref.store_dtype}; re-run its shard's extraction")
    missing = [k for k in wanted if k not in out]
    if missing:
        raise BadSampleError(f"{ref.path}: missing key(s) {missing}; a stored sample has "
                             f"{list(SAMPLE_KEYS)}" + (" and their _scale keys" if wanted != list(keys) else ""))
    for k, t in out.items():
        if int(t.shape[0]) != ref.tokens:
            raise BadSampleError(f"{ref.path}: {k} has {int(t.shape[0])} rows but the manifest records "
                                 f"{ref.tokens} tokens")
    return out


def read_aux_layers(ref: SampleRef, source: SampleSource | None = None) -> list[int]:
    """The target layers whose outputs were captured (sample metadata ``aux_layers``); ``source`` gives the
    bytes (default: the disk store's file at ``ref.path``)."""
    import json

    if source is None:
        from safetensors import safe_open
        with safe_open(ref.path, framework="pt") as f:
            meta = f.metadata() or {}
    else:
        f = source.open(ref)
        try:
            meta = dict(read_header(f, ref.bytes).metadata or {})
        except ValueError as e:
            raise BadSampleError(f"{ref.path}: not a readable safetensors sample ({e})") from None
        finally:
            f.close()
    if "aux_layers" not in meta:
        raise BadSampleError(f"{ref.path}: metadata has no aux_layers; the export needs the capture layers")
    return [int(x) for x in json.loads(meta["aux_layers"])]


@dataclass
class Batch:
    input_ids: torch.Tensor          # [B, T] int64, 0 past each length
    loss_mask: torch.Tensor          # [B, T] bool
    attention_mask: torch.Tensor     # [B, T] bool, True on real tokens
    aux_hidden_states: torch.Tensor  # [B, T, 3H]
    hidden_states: torch.Tensor      # [B, T, H]
    aux_scale: torch.Tensor | None = None     # [B, T, 3] float32 when the two above are float8 (fp8 store)
    hidden_scale: torch.Tensor | None = None  # [B, T, 1]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "Batch":
        """On ``device`` (and in ``dtype``); float8 hidden states are de-quantised there, after the copy."""
        def mv(t: torch.Tensor, cast: bool, scale: torch.Tensor | None = None) -> torch.Tensor:
            t = t.to(device, non_blocking=True)
            if scale is not None:
                return dequantise_fp8(t, scale.to(device, non_blocking=True), dtype or torch.float32)
            return t.to(dtype) if cast and dtype is not None else t
        return Batch(mv(self.input_ids, False), mv(self.loss_mask, False), mv(self.attention_mask, False),
                     mv(self.aux_hidden_states, True, self.aux_scale), mv(self.hidden_states, True, self.hidden_scale))


def collate(samples: Iterable[dict[str, torch.Tensor]], max_length: int | None = None, *,
            lengths: Sequence[int] | None = None, buffer: Buffer | None = None) -> Batch:
    """Right-pad to the longest sample (causal attention never looks right, so padding needs no mask).

    With ``lengths`` (each sample's tokens, from the manifest) ``samples`` may be a lazy iterable: each
    is copied in and let go before the next is read, so one sample's memory is held at a time. ``buffer``
    gives the padded batch's host memory (the loader's pool); by default it is a fresh allocation.
    """
    if lengths is None:
        samples = list(samples)
        lengths = [int(s["input_ids"].shape[0]) for s in samples]
    it = iter(samples)
    t = max(lengths) if max_length is None else min(max(lengths), max_length)
    b = len(lengths)
    s = next(it)
    if b == 1 and lengths[0] == t:   # nothing to pad: the read buffers are the batch (no 470 MB copy)
        one = lambda k: s[k].unsqueeze(0) if k in s else None  # noqa: E731  (the scales: fp8 stores only)
        return Batch(s["input_ids"].to(torch.int64).unsqueeze(0), s["loss_mask"].bool().unsqueeze(0),
                     torch.ones(1, t, dtype=torch.bool), s["aux_hidden_states"].unsqueeze(0),
                     s["hidden_states"].unsqueeze(0),
                     one("aux_hidden_states" + SCALE_SUFFIX), one("hidden_states" + SCALE_SUFFIX))
    aux_w = s["aux_hidden_states"].shape[1]
    h = s["hidden_states"].shape[1]
    dtype = s["hidden_states"].dtype
    fp8 = "aux_hidden_states" + SCALE_SUFFIX in s
    scale_w = {k: s[k + SCALE_SUFFIX].shape[1] for k in QUANTISED_KEYS} if fp8 else {}
    ids, lm, am, aux, hid, *sc = _carve(buffer, [([b, t], torch.int64), ([b, t], torch.bool), ([b, t], torch.bool),
                                                 ([b, t, aux_w], dtype), ([b, t, h], dtype)]
                                        + [([b, t, w], torch.float32) for w in scale_w.values()])
    scales = dict(zip(scale_w, sc))
    for small in (ids, lm, am, *sc):     # padding keeps scale 0: it de-quantises to zeros
        small.zero_()
    for i in range(b):
        if i:
            s = next(it)
        if int(s["input_ids"].shape[0]) != lengths[i]:
            raise ValueError(f"sample {i} of the batch has {int(s['input_ids'].shape[0])} tokens, "
                             f"lengths says {lengths[i]}")
        n = min(lengths[i], t)
        ids[i, :n] = s["input_ids"][:n]
        lm[i, :n] = s["loss_mask"][:n].bool()
        am[i, :n] = True
        aux[i, :n] = s["aux_hidden_states"][:n]
        hid[i, :n] = s["hidden_states"][:n]
        aux[i, n:].zero_()                # only the padding is zeroed: the rest is overwritten
        hid[i, n:].zero_()
        for k, x in scales.items():
            x[i, :n] = s[k + SCALE_SUFFIX][:n]
        del s                             # let its buffer go before the next sample is read
    return Batch(ids, lm, am, aux, hid, scales.get("aux_hidden_states"), scales.get("hidden_states"))


def epoch_batches(refs: Sequence[SampleRef], batch_size: int, seed: int, epoch: int, world_size: int = 1,
                  bucket_batches: int = 32) -> list[list[int]]:
    """The epoch's batches as lists of positions in ``refs``; the same on every process."""
    rng = random.Random(f"eagleflow-train/{seed}/{epoch}")
    order = list(range(len(refs)))
    rng.shuffle(order)
    group = batch_size * bucket_batches
    batches: list[list[int]] = []
    for g in range(0, len(order), group):
        chunk = sorted(order[g:g + group], key=lambda i: (-refs[i].tokens, refs[i].index))
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    usable = len(batches) - len(batches) % world_size
    if usable == 0:
        raise ValueError(f"{len(refs)} samples make {len(batches)} batch(es) of {batch_size}, fewer than the "
                         f"{world_size} training processes; lower train.batch_size or nproc_per_node")
    return batches[:usable]


@dataclass
class DataPosition:
    epoch: int = 0
    cursor: int = 0      # next global batch of the epoch

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}


class HiddenStateLoader:
    """Yields this process's micro-batches in the planned order, reading one ahead on a thread.

    Samples are read into, and padded batches built in, reused host buffers (``buffers`` kept per
    pool; 0: a fresh allocation every time): a batch's buffer is reused only once the batch is dropped.
    """

    def __init__(self, refs: Sequence[SampleRef], *, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, position: DataPosition | None = None, prefetch: bool = True,
                 max_length: int | None = None, buffers: int = 3):
        self.refs = list(refs)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = position or DataPosition()
        self.max_length = max_length
        self._plan_epoch = -1
        self._plan: list[list[int]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._ahead: tuple[tuple[int, int], Future] | None = None
        # the batch in use, the one read ahead and the one being read while the caller still holds its last
        self.sample_buffers = HostBufferPool(buffers) if buffers else None
        self.batch_buffers = HostBufferPool(buffers) if buffers else None

    def _batches(self, epoch: int) -> list[list[int]]:
        if epoch != self._plan_epoch:
            self._plan = epoch_batches(self.refs, self.batch_size, self.seed, epoch, self.world_size)
            self._plan_epoch = epoch
        return self._plan

    def _following(self, pos: DataPosition) -> DataPosition:
        nxt = DataPosition(pos.epoch, pos.cursor + self.world_size)
        if nxt.cursor >= len(self._batches(pos.epoch)):
            nxt = DataPosition(pos.epoch + 1, 0)
        return nxt

    def _load(self, epoch: int, cursor: int) -> Batch:
        members = epoch_batches(self.refs, self.batch_size, self.seed, epoch, self.world_size)[cursor + self.rank] \
            if epoch != self._plan_epoch else self._plan[cursor + self.rank]
        refs = [self.refs[i] for i in members]
        take = self.sample_buffers.take if self.sample_buffers else None
        return collate((read_sample_keys(r, SAMPLE_KEYS, take) for r in refs), self.max_length,
                       lengths=[r.tokens for r in refs],
                       buffer=self.batch_buffers.take if self.batch_buffers else None)

    def next_batch(self) -> Batch:
        pos = self.position
        self._batches(pos.epoch)
        key = (pos.epoch, pos.cursor)
        if self._ahead is not None and self._ahead[0] == key:
            batch = self._ahead[1].result()
        else:
            batch = self._load(*key)
        self.position = self._following(pos)
        if self._pool is not None:
            nk = (self.position.epoch, self.position.cursor)
            plan = self._plan if nk[0] == self._plan_epoch else None
            if plan is not None:  # an epoch boundary is read in line: the plan must be rebuilt first
                self._ahead = (nk, self._pool.submit(self._load, *nk))
            else:
                self._ahead = None
        return batch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class StreamStarved(RuntimeError):
    """The trainer waited past its deadline for a sample that never arrived (a stalled or dead producer)."""


class StreamLoader:
    """Micro-batches drawn from a ``SampleSource`` as samples arrive (streaming: the Mooncake store), shuffled
    within a window, each sample trained exactly once per epoch (``stores.ledger``).

    ``next_batch()`` fills a batch by drawing at random from the window of arrived, not yet served samples
    (topped up from ``source.scan()``; an empty window waits for the producer, up to ``starve_after_s``); the
    ids are written to the ledger as taken. ``commit(step)`` writes every batch since the last commit as
    trained, and on the last epoch releases its samples (the store removes them). A loader built on a ledger
    resumes: what the epoch already trained is never served again; what was taken but not trained is served
    first. ``corpus_size`` samples make an epoch. More than one epoch keeps every sample in the store until
    its last epoch, unless ``recapture``: then each epoch ``e`` takes only the samples of capture pass ``e``
    (``SampleRef.capture_pass``: each shard captured once per epoch, ``corpus.passes``), and a sample leaves the
    store once the epoch that used it is committed.

    A store lost mid-run (``StoreUnavailable``: its master killed) is waited for, up to ``store_down_timeout_s``
    (``source.wait_for_store``; ``on_store_wait`` told when, for the heartbeat): the batch being read is handed
    out again first, and once a new incarnation runs every sample known from the lost one is forgotten, so
    each is drawn again when its shard has captured it again. Batches trained and not yet committed stay so:
    their next commit records them (the model has them), and their ids are never drawn again in the epoch.

    With ``read_ahead`` (the trainer's default, as the offline loader's prefetch) each ``next_batch`` also chooses
    the next micro-batch, from samples already in the store only, and reads and collates it on a thread while the
    caller trains: the store's gets (the segment holder answering over TCP or RDMA) overlap the step instead of
    adding to it. The batch read ahead is neither served nor taken until it is handed out, so a trainer killed
    meanwhile serves it as if never chosen; a store lost under it hands it out again from the new store.
    """

    def __init__(self, source: SampleSource, ledger, *, batch_size: int, corpus_size: int, seed: int = 0,
                 shuffle_window: int = 64, epochs: int = 1, recapture: bool = False, max_length: int | None = None,
                 starve_after_s: float = 300.0, poll_s: float = 0.05,
                 on_wait: Callable[[float | None], None] | None = None, store_down_timeout_s: float = 120.0,
                 on_store_wait: Callable[[float | None], None] | None = None, read_ahead: bool = True):
        import random as _random
        self.source, self.ledger = source, ledger
        # told when a draw starts waiting for the producer (the wall-clock time) and when it stops (None): the
        # trainer's heartbeat says so, so its watch blames a starved trainer on the producer, not on itself
        self.on_wait = on_wait
        self.batch_size, self.corpus_size, self.epochs, self.recapture = batch_size, corpus_size, epochs, recapture
        self.shuffle_window, self.max_length = shuffle_window, max_length
        self.starve_after_s, self.poll_s = starve_after_s, poll_s
        self.store_down_timeout_s, self.on_store_wait = store_down_timeout_s, on_store_wait
        self.stores_lost = 0       # new store incarnations this loader went on with
        self.waited_s = 0.0        # seconds its draws waited for the producer (the steps' metrics: the producer's cost)
        # the fewest samples it could choose a batch from since the trainer last asked (``window_low``): under
        # ``shuffle_window`` the producer is not ahead (the batches are drawn from what just arrived)
        self._window_low: int | None = None
        self.seed = seed
        state = ledger.read()
        done = [e for e in range(epochs) if len(set(state.epoch(e).trained)) >= corpus_size]
        self.epoch = (max(done) + 1) if done else 0
        rec = state.epoch(self.epoch)
        self._served: set[str] = set(rec.trained)          # never again this epoch
        self._first: list[str] = sorted(rec.pending)       # taken, not trained: served again first
        self._rng = _random.Random(f"eagleflow-stream/{seed}/{self.epoch}/{len(self._served)}")
        self._known: dict[str, SampleRef] = {}
        self._window: list[SampleRef] = []
        self._scanned: tuple[int, SampleRef | None] = (0, None)   # the last scan's length and last ref
        self._uncommitted: list[tuple[int, list[SampleRef]]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stream-read-ahead") if read_ahead else None
        # the next micro-batch: its refs (chosen, not yet served or taken) and its read and collate
        self._ahead: tuple[list[SampleRef], Future] | None = None

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def _refill(self) -> None:
        want = self.epoch if self.recapture else 0      # the capture pass this epoch trains on
        refs = self.source.scan()
        # a scan that only extended the last one (the same ref objects first: capture appending) is read from
        # where that one ended: a draw costs the samples that arrived since, not the corpus
        n, last = self._scanned
        start = n if n and len(refs) >= n and refs[n - 1] is last else 0
        self._scanned = (len(refs), refs[-1] if refs else None)
        for r in refs[start:] if start else refs:
            if r.capture_pass == want and r.id not in self._known:
                self._known[r.id] = r
                if r.id not in self._served and r.id not in self._first:
                    self._window.append(r)

    def _draw(self) -> SampleRef:
        import time as _time
        t0 = _time.monotonic()
        ref, waited = self._draw_waiting()
        if waited:
            self.waited_s += _time.monotonic() - t0
            if self.on_wait is not None:
                self.on_wait(None)
        return ref

    def _draw_waiting(self) -> tuple[SampleRef, bool]:
        import time as _time
        t0 = _time.monotonic()
        waiting = False
        while True:
            if self._first:        # taken before a crash (or a lost store), never trained: served again, first
                ref = self._first_known()
                if ref is None:
                    self._refill()
                    ref = self._first_known()
                if ref is not None:
                    return ref, waiting
            # the window too while one of those is not in the store (yet): after a lost store it is captured again,
            # and the buffer may be full of later samples that only a draw from the window makes room for
            if len(self._window) < self.shuffle_window:
                self._refill()
            if self._window:
                # the window: the first shuffle_window arrived samples not served yet, one drawn at random
                k = self._rng.randrange(min(len(self._window), self.shuffle_window))
                return self._window.pop(k), waiting
            if _time.monotonic() - t0 > self.starve_after_s:
                raise StreamStarved(f"{self.source.store}: no new sample for {self.starve_after_s:g} s in epoch "
                                    f"{self.epoch} ({len(self._served)}/{self.corpus_size} served): the producer "
                                    "(capture) stalled or died; check its shards' watch")
            if not waiting and self.on_wait is not None:
                self.on_wait(_time.time())
            waiting = True
            _time.sleep(self.poll_s)

    def _draw_like(self, anchor: SampleRef) -> SampleRef:
        """The rest of a batch: from the window, the sample whose length is nearest ``anchor``'s (the batch's first
        sample, drawn at random): the window's length bucketing, as the offline loader sorts each group of batches
        by length, so a batch pads to about its own length (a batch padded to its longest of random lengths costs
        the trainer ~1.3x the tokens, more in attention). Samples to serve again first, and an empty window, go
        through ``_draw`` (waiting for the producer there)."""
        if not self._first:
            if len(self._window) < self.shuffle_window:
                self._refill()
            if self._window:
                n = min(len(self._window), self.shuffle_window)
                k = min(range(n), key=lambda i: abs(self._window[i].tokens - anchor.tokens))
                return self._window.pop(k)
        return self._draw()

    def _first_known(self) -> SampleRef | None:
        """The first of the samples to serve again that the store holds now (taken off the list), else None."""
        for n, i in enumerate(self._first):
            if i in self._known:
                del self._first[n]
                return self._known[i]
        return None

    def window_low(self) -> int | None:
        """The fewest samples a batch was chosen from since the last call (None: none chosen); reset."""
        low, self._window_low = self._window_low, None
        return low

    def _available(self) -> int:
        """Samples a batch can be chosen from now (the window, and those to serve again that are back)."""
        return len(self._window) + sum(1 for i in self._first if i in self._known)

    def _choose(self, refilled: bool = False) -> list[SampleRef]:
        want = min(self.batch_size, self.corpus_size - len(self._served))
        if not refilled and len(self._window) < self.shuffle_window:
            self._refill()
        avail = self._available()
        self._window_low = avail if self._window_low is None else min(self._window_low, avail)
        refs = [self._draw()]
        while len(refs) < want:
            refs.append(self._draw_like(refs[0]))
        return refs

    def _read(self, refs: list[SampleRef]) -> Batch:
        return collate((read_sample_keys(r, SAMPLE_KEYS, source=self.source) for r in refs), self.max_length,
                       lengths=[r.tokens for r in refs])

    def next_batch(self) -> tuple[Batch, list[SampleRef]]:
        if self.finished:
            raise StopIteration("every epoch is served")
        ahead, self._ahead = self._ahead, None
        refs = ahead[0] if ahead is not None else self._choose()
        self._served.update(r.id for r in refs)
        self.ledger.taken(self.epoch, [r.id for r in refs])
        try:
            batch = ahead[1].result() if ahead is not None else self._read(refs)
        except StoreUnavailable:
            self._store_lost(refs)
            return self.next_batch()
        self._uncommitted.append((self.epoch, refs))
        if len(self._served) >= self.corpus_size:
            self._next_epoch()
        self._read_next()
        return batch, refs

    def _read_next(self) -> None:
        """Choose the next micro-batch and read it on the thread, when the store holds all of it now (never waits
        for the producer here: a starved draw waits in ``next_batch``, where the heartbeat says so)."""
        if self._pool is None or self.finished:
            return
        self._refill()
        if self._available() < min(self.batch_size, self.corpus_size - len(self._served)):
            return
        refs = self._choose(refilled=True)
        self._ahead = (refs, self._pool.submit(self._read, refs))

    def _drop_ahead(self) -> None:
        """Forget the batch read ahead (its store was lost): its read is waited out, whatever it raised; its
        samples are drawn again as their shards put them into the new store (they were never served or taken)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].cancel()
            try:
                ahead[1].result()
            except Exception:    # noqa: BLE001  (the lost store's error: the caller is handling it)
                pass

    def close(self) -> None:
        """Wait out the read ahead (before the source's client closes under it) and stop its thread."""
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _store_lost(self, unread: list[SampleRef]) -> None:
        """The store went away while ``unread`` were read: wait for it (StoreUnavailable past the deadline); they
        are served again first (taken in the ledger, never trained); a new incarnation drops every ref of the
        old one (their lines are stale: the shards put them again, and ``scan`` names only the new store's)."""
        new = self.source.wait_for_store(self.store_down_timeout_s, self.on_store_wait)
        ids = [r.id for r in unread]
        self._served.difference_update(ids)
        self._first = ids + [i for i in self._first if i not in ids]
        if new:
            self._forget_lost_store()

    def _forget_lost_store(self) -> None:
        """The source took up a new store incarnation: every ref known from the lost one names a sample that is
        gone (its line is stale), so none may be drawn and opened in the new store (a missing sample there is
        ``SampleRefused``); ``scan`` names only the new store's, each drawn once its shard captured it again.
        Whichever call saw the store lost (a read, or a commit's release) must do this."""
        self.stores_lost += 1
        self._drop_ahead()
        self._known = {}
        self._window = []
        self._scanned = (0, None)

    def _release(self, ref: SampleRef) -> None:
        try:
            self.source.release(ref)
        except StoreUnavailable:
            # gone with the store; once it is back, a copy its shard put again (same key) is removed. A new
            # incarnation found here (the store died between reads: a commit saw it first) drops the lost
            # store's refs as a failed read does: else the window hands out samples the new store does not hold
            if self.source.wait_for_store(self.store_down_timeout_s, self.on_store_wait):
                self._forget_lost_store()
            self.source.release(ref)

    def _next_epoch(self) -> None:
        import random as _random
        self.epoch += 1
        self._served = set()
        self._first = []
        if self.recapture:     # the next epoch's own captures, each drawn as it arrives
            self._known = {}
            self._scanned = (0, None)
        self._window = [] if self.finished else list(self._known.values())
        self._rng = _random.Random(f"eagleflow-stream/{self.seed}/{self.epoch}/0")

    @property
    def uncommitted(self) -> list[tuple[int, list[str]]]:
        """(epoch, ids) of every batch handed out since the last commit: what a checkpoint saved now has trained on."""
        return [(epoch, [r.id for r in refs]) for epoch, refs in self._uncommitted]

    @property
    def uncommitted_bytes(self) -> int:
        """The store bytes held by samples trained on but not committed (they stay in the store until then)."""
        return sum(r.bytes for _, refs in self._uncommitted for r in refs)

    def ready(self, n: int) -> bool:
        """``n`` samples (or what the epoch has left, if fewer) can be drawn now, without waiting for the producer."""
        if self.finished:
            return True
        self._refill()
        avail = self._available() + (len(self._ahead[0]) if self._ahead is not None else 0)
        return avail >= min(n, self.corpus_size - len(self._served))

    @property
    def served(self) -> int:
        """Samples handed out in the current epoch."""
        return len(self._served)

    def commit(self, step: int) -> None:
        """The optimizer step that used every batch since the last commit is done (checkpointed)."""
        for epoch, refs in self._uncommitted:
            self.ledger.trained(epoch, [r.id for r in refs], step)
            if self.recapture or epoch == self.epochs - 1:   # the last epoch that uses these samples
                for r in refs:
                    self._release(r)
        self._uncommitted = []
