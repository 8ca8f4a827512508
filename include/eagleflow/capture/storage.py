"""The stored hidden states: one safetensors file per sample, written temp -> fsync -> rename.

Keys: ``input_ids`` int64 [L], ``loss_mask`` uint8 [L], ``aux_hidden_states``
[L, 3H] and ``hidden_states`` [L, H] in the target's dtype. Metadata (strings):
id, index, aux_layers (JSON list), model, store_dtype. A reader never sees a
partial file: only a complete, fsynced temp file is renamed to
``<index:08d>.safetensors``.

``store_dtype: fp8_e4m3`` stores the two hidden-state tensors as F8_E4M3 with
one float32 scale per token and captured layer (``<key>_scale`` [L, 3] and
[L, 1]: absmax / 448, so every row uses the format's whole range and an
outlier token costs only its own row). At H = 7168 that is 4 x (7168 + 4) + 9
= 28,697 bytes a token against bf16's 57,353: 0.5004. Metadata adds
``scaling``, ``orig_dtype`` (what the reader de-quantises to) and
``quant_error`` (JSON: per tensor, max and mean of the per-row relative L2
error measured while writing; ``capture verify --stats`` prints it). Finer
blocks (128 columns) measured no better on rows with outlier channels, because
e4m3 keeps ~6 % relative precision across 2^14 of range below each row's
absmax: docs/benchmarks.md has the figures.
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from eagleflow.durable import TEMP_PREFIX, atomic_replace
# the sample encoding (and its FP8 option) is every store's, not the disk's: re-exported here for its old readers
from eagleflow.stores.encoding import (FP8_MAX, FP8_SCALING, QUANTISED_KEYS, SCALE_SUFFIX, STORE_DTYPES,  # noqa: F401
                                       EncodedSample, dequantise_fp8, encode_sample, quantise_fp8)

SAMPLE_SUFFIX = ".safetensors"
TMP_PREFIX = TEMP_PREFIX  # eagleflow.durable names its temp files .tmp-<name>.<random>
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")

# Test-only fault injection: when set to "kill" or "pause:<seconds>", the writer
# SIGKILLs itself (or sleeps) after the temp file is fsynced and before the rename.
FAULT_ENV = "EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME"
FAULT_AFTER_ENV = "EAGLEFLOW_CAPTURE_FAULT_AFTER_N"   # fire only once this many samples were stored


def sample_file_name(index: int) -> str:
    return f"{index:08d}{SAMPLE_SUFFIX}"


@dataclass(frozen=True)
class StoredSample:
    path: Path
    bytes: int
    sha256: str
    store_dtype: str = "auto"


class SampleWriter:
    """Writes final-format sample files into one shard directory."""

    def __init__(self, shard_dir: str | os.PathLike, fsync: bool = True, store_dtype: str = "auto"):
        if store_dtype not in STORE_DTYPES:
            raise ValueError(f"capture.store_dtype = {store_dtype!r}; expected one of {', '.join(STORE_DTYPES)}")
        self.shard_dir = Path(shard_dir)
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.store_dtype = store_dtype
        self.stored = 0

    def write(self, *, index: int, sample_id: str, input_ids, loss_mask, aux_hidden_states, hidden_states,
              aux_layers: list[int], model: str) -> StoredSample:
        """Store one sample. Tensors come as RawTensor (a dump's bytes, moved unchanged: no torch needed) or
        torch tensors; ``loss_mask`` may be a list of 0/1. Only ``store_dtype: fp8_e4m3`` imports torch."""
        enc = encode_sample(index=index, sample_id=sample_id, input_ids=input_ids, loss_mask=loss_mask,
                            aux_hidden_states=aux_hidden_states, hidden_states=hidden_states,
                            aux_layers=aux_layers, model=model, store_dtype=self.store_dtype)
        return self.write_encoded(enc)

    def write_encoded(self, enc: EncodedSample) -> StoredSample:
        """Store one encoded sample (``eagleflow.stores.encoding``) as ``<index>.safetensors``."""
        parts, size, index = enc.parts, enc.size, enc.index
        # Hash while the bytes go to disk: hashlib and write/fsync both release the GIL.
        hasher = hashlib.sha256()

        def hash_parts() -> None:
            for part in parts:
                hasher.update(part)
        hashing = threading.Thread(target=hash_parts, name="sample-sha256")
        hashing.start()
        final = self.shard_dir / sample_file_name(index)
        with atomic_replace(final, fsync=self.fsync) as tmp:
            try:
                with open(tmp, "wb") as f:
                    for part in parts:
                        f.write(part)
            finally:
                hashing.join()
            digest = hasher.hexdigest()
            _maybe_fault(self.stored)
        self.stored += 1
        return StoredSample(path=final, bytes=size, sha256=digest, store_dtype=enc.store_dtype)


def _maybe_fault(stored_so_far: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or stored_so_far < int(os.environ.get(FAULT_AFTER_ENV, "0")):
        return
    import signal
    import time
    if spec == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.startswith("pause:"):
        time.sleep(float(spec.split(":", 1)[1]))


def remove_temp_files(shard_dir: str | os.PathLike) -> list[Path]:
    """Temp files left by a killed writer: never valid, always safe to delete."""
    removed = []
    d = Path(shard_dir)
    if d.is_dir():
        for p in d.glob(f"{TMP_PREFIX}*"):
            try:
                p.unlink()
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_sample(path: str | os.PathLike, raw: bool = False) -> tuple[dict, dict]:
    """(tensors, metadata) of a stored sample; an fp8 one de-quantised to its ``orig_dtype`` unless ``raw``."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    if not raw and meta.get("store_dtype") == "fp8_e4m3":
        import torch
        dtype = getattr(torch, meta.get("orig_dtype", "float32"))
        for key in QUANTISED_KEYS:
            tensors[key] = dequantise_fp8(tensors[key], tensors.pop(key + SCALE_SUFFIX), dtype)
    return tensors, meta
