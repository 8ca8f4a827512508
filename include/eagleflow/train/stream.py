"""The trainer's side of a streaming run (``stream.storage`` names a streaming store: Mooncake).

``StreamRun`` holds what the trainer needs beyond the offline path: the store's ``SampleSource``, the corpus
prepared (its sample ids: the epoch every sample must be trained on exactly once; its ids and loss masks:
the draft vocabulary, counted before the samples are all captured), the epochs and steps the run trains, the
ledger, and the exactly-once check written when it ends.

Epochs: ``train.max_steps`` rounded to whole epochs (at least one): a streaming run is green only when every
sample of each epoch was trained on exactly once, so it never stops inside an epoch. The last micro-batch of
an epoch holds what is left of it.

Commits: a checkpoint records the ids of every batch since the last commit (``StreamLoader.uncommitted``);
once it is durable the loader writes them to the ledger as trained. A trainer killed between the two finds
them in its checkpoint and writes them then (``reconcile``), before the loader reads the ledger; a trainer
killed before the checkpoint has them as taken, not trained: served again. A checkpoint is also taken early
at a step's end when the next step's samples have not all arrived, or the samples held uncommitted reach half
of ``stream.buffer_gib``: they stay in the store until their commit, and capture waits for room, so without it
a small buffer would stall both sides. (A producer slower than the trainer thus means a checkpoint per step.)
The buffer must hold one step's samples (``train.batch_size`` x ``train.grad_accum``) and one more.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eagleflow.corpus.passes import capture_plan
from eagleflow.stores import Store, run_store_settings
from eagleflow.stores.ledger import EpochLedger, LedgerError, check_exactly_once, read_ledger

from .data import DataPosition, StreamLoader, StreamStarved, read_aux_layers
from eagleflow.durable import atomic_write

CORPUS_FILE = "corpus.parquet"


class StreamRun:
    def __init__(self, cfg, layout, store: Store, log: Callable[[str], None] = print):
        self.cfg, self.layout, self.store, self.log = cfg, layout, store, log
        self.on_wait: Callable[[float | None], None] | None = None   # StreamLoader's (the trainer's heartbeat)
        self.on_store_wait: Callable[[float | None], None] | None = None
        self.settings = run_store_settings(cfg, layout)
        self.corpus_file = Path(str(layout.corpus_dir)) / CORPUS_FILE
        if not self.corpus_file.is_file():
            raise FileNotFoundError(f"no corpus at {self.corpus_file}: a streaming run trains on the corpus prepared "
                                    "(`eagleflow corpus prepare`) as capture stores it")
        import pyarrow.parquet as pq
        ids = [str(i) for i in pq.read_table(self.corpus_file, columns=["id"]).column("id").to_pylist()]
        self.corpus_ids = set(ids)
        if len(self.corpus_ids) != len(ids):
            raise ValueError(f"{self.corpus_file} repeats sample ids ({len(ids) - len(self.corpus_ids)}): a ledger "
                             "cannot tell them apart; prepare the corpus again")
        self.ledger_file = Path(str(layout.stream_ledger_file))
        self.record_file = Path(str(layout.stream_verified_file))
        tc = cfg.train
        per_epoch = math.ceil(len(ids) / tc.batch_size)            # micro-batches per epoch
        # the epochs, and whether each re-captures its own samples: the capture workers ask the same plan
        self.plan = capture_plan(cfg, layout)
        self.epochs = self.plan.epochs
        self.total_steps = math.ceil(self.epochs * per_epoch / tc.grad_accum)
        self.source = store.open_source(self.settings, log=log)
        self.loader: StreamLoader | None = None

    @property
    def corpus_size(self) -> int:
        return len(self.corpus_ids)

    def describe(self) -> str:
        tc = self.cfg.train
        return (f"streaming from the {self.store.label} ({self.corpus_size} samples in the corpus, shuffle window "
                f"{self.cfg.stream.shuffle_window}): {self.epochs} epoch(s) = {self.total_steps} steps "
                f"(train.max_steps {tc.max_steps} rounded to whole epochs"
                + (f"; {self.plan.why}" if self.plan.recapture else "") + f"), ledger {self.ledger_file}")

    def loss_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each target id is at a loss position over the corpus prepared (what ``count_loss_tokens``
        counts over the stored samples: the worker stores the corpus's ids, checked against the dump, and its
        loss mask)."""
        import pyarrow.parquet as pq
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        pf = pq.ParquetFile(self.corpus_file)
        for batch in pf.iter_batches(batch_size=4096, columns=["input_ids", "loss_mask"]):
            for ids, mask in zip(batch.column("input_ids").to_pylist(), batch.column("loss_mask").to_pylist()):
                t = torch.tensor([i for i, m in zip(ids, mask) if m], dtype=torch.int64)
                if t.numel() and int(t.max()) >= vocab_size:
                    raise ValueError(f"{self.corpus_file}: token id {int(t.max())} is outside the target "
                                     f"vocabulary ({vocab_size}); the corpus was tokenised for another model")
                counts += torch.bincount(t, minlength=vocab_size)
        self.log(f"counted loss-position tokens over the {self.corpus_size} records of {self.corpus_file}")
        return counts

    def aux_layers(self, timeout_s: float | None = None) -> list[int]:
        """The captured layers, from the first sample the store holds (waits for capture's first sample, up to
        ``stream.starve_after_s``)."""
        timeout_s = self.cfg.stream.starve_after_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        while True:
            refs = self.source.scan()
            if refs:
                return read_aux_layers(refs[0], self.source)
            if time.monotonic() - t0 > timeout_s:
                raise StreamStarved(f"{self.store.name}: no sample at all for {timeout_s:g} s: the producer "
                                    "(capture) has not started, stalled or died; check its shards' watch")
            time.sleep(0.1)

    def reconcile(self, checkpoint_state: dict[str, Any] | None) -> int:
        return reconcile_ledger(self.ledger_file, checkpoint_state, self.epochs, self.source, fsync=self.settings.fsync,
                                log=self.log, recapture=self.plan.recapture)

    def open_loader(self, checkpoint_state: dict[str, Any] | None) -> StreamLoader:
        self.reconcile(checkpoint_state)
        tc = self.cfg.train
        ledger = EpochLedger(self.ledger_file, fsync=self.settings.fsync)
        ledger.plan(self.epochs)    # a lost store's samples trained in the last epoch are not captured again
        self.loader = StreamLoader(self.source, ledger,
                                   batch_size=tc.batch_size, corpus_size=self.corpus_size, seed=tc.seed,
                                   shuffle_window=self.cfg.stream.shuffle_window, epochs=self.epochs,
                                   recapture=self.plan.recapture,
                                   max_length=None, on_wait=self.on_wait,
                                   store_down_timeout_s=self.cfg.stream.store_down_timeout_s,
                                   starve_after_s=self.cfg.stream.starve_after_s,
                                   on_store_wait=self.on_store_wait)
        return self.loader

    def position(self) -> DataPosition:
        """Where the loader is (epoch, samples served in it): for the checkpoint's record; resume reads the ledger."""
        assert self.loader is not None
        return DataPosition(self.loader.epoch, self.loader.served)

    def commit(self, step: int) -> None:
        """The checkpoint of ``step`` is durable: its batches are trained (the ledger) and, after their last epoch,
        out of the store."""
        assert self.loader is not None
        self.loader.commit(step)

    def must_commit(self, step_samples: int) -> bool:
        """Checkpoint now (at a step's end): samples trained on are uncommitted, and the next step's
        ``step_samples`` have not all arrived (capture may be waiting for the room they hold: without a commit
        both sides would wait), or they hold half the buffer."""
        if self.loader is None or not self.loader.uncommitted:
            return False
        return (self.loader.uncommitted_bytes * 2 >= self.settings.buffer_bytes
                or not self.loader.ready(step_samples))

    def checkpoint_state(self) -> dict[str, Any]:
        assert self.loader is not None
        return {"uncommitted": self.loader.uncommitted, "epochs": self.epochs, "total_steps": self.total_steps,
                "corpus_size": self.corpus_size, "ledger": str(self.ledger_file)}

    def verify(self) -> dict[str, Any]:
        """The exactly-once check over the ledger, written to the run's stream verification record; LedgerError
        (after writing it) when any sample was trained twice, never, or is not in the corpus."""
        if self.loader is not None and self.loader.stores_lost:
            # a shard that re-captured a sample after the store was lost, once its commit had released the key
            # already, left that copy behind: the last epoch is done with it
            n = release_trained(self.ledger_file, self.epochs, self.source, self.plan.recapture)
            self.log(f"the store was lost {self.loader.stores_lost} time(s) and went on; {n} re-captured sample(s) "
                     "already trained released at the end")
        state = read_ledger(self.ledger_file)
        check = check_exactly_once(state, self.corpus_ids, self.epochs)
        record = {"ok": check.ok, "kind": "stream", "store": self.store.name, "checked_at": time.time(),
                  "epochs": self.epochs, "samples": self.corpus_size, "summary": check.summary(),
                  "ledger": str(self.ledger_file), "ledger_bad_lines": state.bad_lines,
                  "trained_per_epoch": {str(e): sum(state.epoch(e).trained.values()) for e in range(self.epochs)},
                  "duplicates": {str(e): v for e, v in check.duplicates.items()},
                  "missing": {str(e): v for e, v in check.missing.items()},
                  "unknown": {str(e): v for e, v in check.unknown.items()}}
        self.record_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.record_file, json.dumps(record, indent=1))
        if not check.ok:
            raise LedgerError(f"{self.ledger_file}: not green: {check.summary()} (record {self.record_file})")
        self.log(f"exactly once: {check.summary()} ({self.corpus_size} samples x {self.epochs} epoch(s)); "
                 f"recorded in {self.record_file}")
        return record

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()       # its read ahead first: it uses the source's client
            self.loader.ledger.close()
        self.source.close()


def release_trained(ledger_file: str | Path, epochs: int, source: Any, recapture: bool = False) -> int:
    """Release every sample the store holds that the ledger has trained in the last epoch that uses it (the run's
    last; with ``recapture``, its capture pass's own epoch); how many."""
    state = read_ledger(ledger_file)
    done = 0
    for ref in source.scan():
        if ref.id in state.epoch(ref.capture_pass if recapture else epochs - 1).trained:
            source.release(ref)
            done += 1
    return done


def reconcile_ledger(ledger_file: str | Path, checkpoint_state: dict[str, Any] | None, epochs: int, source: Any,
                     fsync: bool = True, log: Callable[[str], None] = print, recapture: bool = False) -> int:
    """Write as trained the batches a durable checkpoint holds (``state["stream"]["uncommitted"]``) and the
    ledger does not (a trainer killed between the checkpoint and its commit), and release from ``source`` every
    sample the ledger has trained in its last epoch, as the commit would have. Returns how many ids it wrote.
    Run before a loader reads the ledger: what it wrote is never served again in that epoch."""
    checkpoint_state = checkpoint_state or {}
    pending = (checkpoint_state.get("stream") or {}).get("uncommitted") or []
    step = int(checkpoint_state.get("step", 0))
    state = read_ledger(ledger_file)
    wrote = 0
    ledger = EpochLedger(ledger_file, fsync=fsync)
    try:
        for epoch, ids in pending:
            epoch, ids = int(epoch), [str(i) for i in ids]
            missing = [i for i in ids if i not in state.epoch(epoch).trained]
            if not missing:
                continue
            ledger.trained(epoch, missing, step)
            wrote += len(missing)
    finally:
        ledger.close()
    # every sample its last epoch trained leaves the store, including those a trainer killed between its
    # ledger's commit and the releases that follow it had left there (a remove of a gone key is a no-op)
    release_trained(ledger_file, epochs, source, recapture)
    if wrote:
        log(f"the checkpoint at step {step} had trained on {wrote} sample(s) its ledger did not record as trained "
            "(killed between the two): recorded now")
    return wrote
