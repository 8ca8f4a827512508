"""How many times a streaming run captures each shard: once for all its epochs, or once per epoch.

A streaming store holds at most ``stream.buffer_gib``. Several epochs can train on one capture only when the
whole corpus stays in the store until its last epoch, so only when it fits the buffer; otherwise each shard is
captured again for each epoch (a pass per epoch, each sample's key removed after its use in that epoch), which
costs a capture pass of GPU time per later epoch. Capture and trainer must agree before the first sample is
put (pass 0's samples leave the store after epoch 0 or after the last), so both ask ``capture_plan`` of the frozen
run config and the corpus prepared: the samples' bytes are known only as they arrive, so the rule is an estimate
(``budget.estimate``'s, exact for the tensors) and keeps the one capture only when it is sure.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout
from eagleflow.stores import run_store_settings, store_for

from .budget import BudgetError, bytes_per_token, safetensors_header_bytes, target_shape
from .prepare import STATS_FILE

# keep the one capture only while the estimate is under this share of the buffer: the estimate counts a
# mean-length sample's header, and the store's own allocation may round a sample up
FIT_SHARE = 0.9


@dataclass(frozen=True)
class CapturePlan:
    epochs: int
    passes: int                  # 1: every epoch trains on the one capture; == epochs: each on its own
    corpus_bytes: int | None     # the corpus's stored bytes as estimated; None: not known (then re-captured)
    buffer_bytes: int
    why: str

    @property
    def recapture(self) -> bool:
        return self.passes > 1

    def capture_pass(self, epoch: int) -> int:
        """The pass whose samples ``epoch`` trains on."""
        return epoch if self.recapture else 0

    def last_epoch(self, capture_pass: int) -> int:
        """The epoch after whose training a sample of ``capture_pass`` leaves the store."""
        return capture_pass if self.recapture else self.epochs - 1


def stream_epochs(cfg: PipelineConfig, corpus_size: int) -> int:
    """A streaming run's epochs: ``train.max_steps`` rounded to whole epochs of the corpus, at least one."""
    tc = cfg.train
    per_epoch = math.ceil(corpus_size / tc.batch_size)            # micro-batches per epoch
    return max(1, round(tc.max_steps * tc.grad_accum / per_epoch))


def corpus_stored_bytes(cfg: PipelineConfig, layout: RunLayout) -> int:
    """The estimated bytes of every corpus sample as stored (tensors exactly, a mean-length header each);
    BudgetError naming the file when the corpus statistics or the target's config cannot be read."""
    stats_path = Path(str(layout.corpus_dir)) / STATS_FILE
    config_path = Path(str(cfg.resolve(cfg.target_model))) / "config.json"
    try:
        stats = json.loads(stats_path.read_text())
        records, tokens = int(stats["records"]), int(stats["tokens"])
        shape = target_shape(config_path.read_text(), str(config_path), cfg.server.dtype)
        aux = cfg.capture.aux_layers or shape.default_aux_layers()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BudgetError(f"cannot estimate the corpus's stored bytes ({stats_path}, {config_path}): "
                          f"{type(e).__name__}: {e}") from None
    mean_len = max(1, round(tokens / records)) if records else 0
    header = safetensors_header_bytes(mean_len, shape, aux, str(cfg.resolve(cfg.target_model)),
                                      "s" * 24, max(records - 1, 0), cfg.capture.store_dtype)
    return tokens * bytes_per_token(shape, cfg.capture.store_dtype) + records * header


def capture_plan(cfg: PipelineConfig, layout: RunLayout) -> CapturePlan:
    """The run's epochs and capture passes (see the module's docstring); the corpus prepared must exist."""
    import pyarrow.parquet as pq  # lazy: pyarrow takes 0.19 s to import (as the worker's shard_indexes)

    corpus = Path(str(layout.corpus_dir)) / "corpus.parquet"
    epochs = stream_epochs(cfg, pq.ParquetFile(corpus).metadata.num_rows)
    settings = run_store_settings(cfg, layout)
    room = settings.buffer_bytes - settings.headroom_bytes
    if not store_for(cfg.stream.storage).streaming or epochs == 1:
        return CapturePlan(epochs, 1, None, room, "one epoch, or a store that keeps every sample")
    try:
        need = corpus_stored_bytes(cfg, layout)
    except BudgetError as e:
        return CapturePlan(epochs, epochs, None, room, f"re-captured per epoch: {e}")
    if need <= FIT_SHARE * room:
        return CapturePlan(epochs, 1, need, room, f"the corpus (~{need} bytes) fits the buffer ({room} bytes)")
    return CapturePlan(epochs, epochs, need, room, f"the corpus (~{need} bytes) does not fit {FIT_SHARE:g} x "
                       f"the buffer ({room} bytes): each shard is captured again for each epoch")
