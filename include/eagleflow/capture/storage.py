"""The stored hidden states: one safetensors file per sample, written temp -> fsync -> rename.

Keys: ``input_ids`` int64 [L], ``loss_mask`` uint8 [L], ``aux_hidden_states``
[L, 3H] and ``hidden_states`` [L, H] in the target's dtype. Metadata (strings):
id, index, aux_layers (JSON list), model. A reader never sees a partial file:
only a complete, fsynced temp file is renamed to ``<index:08d>.safetensors``.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from eagleflow.durable import TEMP_PREFIX, atomic_replace

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


class SampleWriter:
    """Writes final-format sample files into one shard directory."""

    def __init__(self, shard_dir: str | os.PathLike, fsync: bool = True):
        self.shard_dir = Path(shard_dir)
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.stored = 0

    def write(self, *, index: int, sample_id: str, input_ids, loss_mask, aux_hidden_states, hidden_states,
              aux_layers: list[int], model: str) -> StoredSample:
        import torch

        n = int(input_ids.shape[0])
        for name, t in (("loss_mask", loss_mask), ("aux_hidden_states", aux_hidden_states),
                        ("hidden_states", hidden_states)):
            if int(t.shape[0]) != n:
                raise ValueError(f"sample {sample_id} (index {index}): {name} has {int(t.shape[0])} rows but "
                                 f"input_ids has {n}; the dump does not belong to this sample")
        tensors = {
            "input_ids": input_ids.to(torch.int64).contiguous(),
            "loss_mask": loss_mask.to(torch.uint8).contiguous(),
            "aux_hidden_states": aux_hidden_states.contiguous(),
            "hidden_states": hidden_states.contiguous(),
        }
        meta = {"id": sample_id, "index": str(index), "aux_layers": json.dumps(list(aux_layers)), "model": model}
        parts = safetensors_parts(tensors, meta)
        size = sum(len(p) for p in parts)
        # Hash while the bytes go to disk: hashlib and write/fsync both release the GIL.
        hasher = hashlib.sha256()
        hashing = threading.Thread(target=lambda: [hasher.update(p) for p in parts], name="sample-sha256")
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
        return StoredSample(path=final, bytes=size, sha256=digest)


_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def safetensors_parts(tensors: dict, metadata: dict[str, str]) -> list:
    """A safetensors file as [header, tensor bytes...] without copying the tensors into one buffer.

    Same layout as ``safetensors.torch.save``: u64 little-endian header length,
    JSON header (padded with spaces to 8 bytes), then the tensors back to back
    in key order. Readers (``safe_open``) check it; the tests read every file back.
    """
    import torch

    header: dict = {"__metadata__": dict(metadata)}
    views = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[str(t.dtype).replace("torch.", "")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        views.append(memoryview(raw).cast("B") if nbytes else b"")
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)
    return [len(hjson).to_bytes(8, "little") + hjson, *views]


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


def read_sample(path: str | os.PathLike) -> tuple[dict, dict]:
    """(tensors, metadata) of a stored sample."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
