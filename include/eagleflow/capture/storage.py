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
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from eagleflow.durable import TEMP_PREFIX, atomic_replace
from eagleflow.safetensors_format import RawTensor, as_raw, file_parts

SAMPLE_SUFFIX = ".safetensors"
TMP_PREFIX = TEMP_PREFIX  # eagleflow.durable names its temp files .tmp-<name>.<random>
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
STORE_DTYPES = ("auto", "fp8_e4m3")
QUANTISED_KEYS = ("aux_hidden_states", "hidden_states")
SCALE_SUFFIX = "_scale"
FP8_MAX = 448.0             # largest finite float8_e4m3fn
FP8_SCALING = "per-token-per-layer absmax/448, float32 scales"
_QUANT_ROWS = 1024          # rows quantised at a time: bounds the float32 temporaries (8k x 21504 would be 700 MB)

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
        mask = RawTensor.of_bytes(loss_mask) if isinstance(loss_mask, (list, tuple)) else as_raw(loss_mask).as_uint8()
        tensors = {"input_ids": as_raw(input_ids).as_int64(), "loss_mask": mask,
                   "aux_hidden_states": as_raw(aux_hidden_states), "hidden_states": as_raw(hidden_states)}
        n = tensors["input_ids"].rows
        for name in ("loss_mask", "aux_hidden_states", "hidden_states"):
            if tensors[name].rows != n:
                raise ValueError(f"sample {sample_id} (index {index}): {name} has {tensors[name].rows} rows but "
                                 f"input_ids has {n}; the dump does not belong to this sample")
        meta = {"id": sample_id, "index": str(index), "aux_layers": json.dumps(list(aux_layers)), "model": model,
                "store_dtype": self.store_dtype}
        if self.store_dtype == "fp8_e4m3":
            errors = {}
            meta["orig_dtype"] = tensors["hidden_states"].torch_name.replace("torch.", "")
            for key, layers in (("aux_hidden_states", len(aux_layers)), ("hidden_states", 1)):
                try:
                    q, scale, errors[key] = quantise_fp8(tensors[key].to_torch(), layers)
                except ValueError as e:
                    raise ValueError(f"sample {sample_id} (index {index}): {key}: {e}") from None
                tensors[key] = RawTensor.from_torch(q)
                tensors[key + SCALE_SUFFIX] = RawTensor.from_torch(scale)
            meta["scaling"] = FP8_SCALING
            # fixed-width figures: the header's length (and so the disk budget's estimate) stays exact
            meta["quant_error"] = json.dumps({k: {m: f"{v:.3e}" for m, v in e.items()} for k, e in errors.items()},
                                             separators=(",", ":"))
        parts = file_parts(tensors, meta)
        size = sum(len(p) for p in parts)
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
        return StoredSample(path=final, bytes=size, sha256=digest, store_dtype=self.store_dtype)


def quantise_fp8(x, layers: int):
    """(float8_e4m3fn [L, W], float32 scales [L, layers], {"max_rel", "mean_rel"}) of x [L, W].

    Each token's block of W / layers columns (one captured layer) gets scale absmax / 448; an all-zero
    block gets scale 0 and stores zeros. The error figures are per-block relative L2 errors
    (||dequant - x|| / ||x||; 0 for a zero block), measured here because nothing can measure them later.
    """
    import torch

    n, width = int(x.shape[0]), int(x.shape[1])
    if layers < 1 or width % layers:
        raise ValueError(f"{width} columns do not split into {layers} captured layer(s)")
    h = width // layers
    q = torch.empty(n, width, dtype=torch.float8_e4m3fn)
    scales = torch.empty(n, layers, dtype=torch.float32)
    worst, total = 0.0, 0.0
    for r0 in range(0, n, _QUANT_ROWS):
        # copy=True: a float32 input would otherwise be this very tensor, and is scaled in place below
        xf = x[r0:r0 + _QUANT_ROWS].to("cpu", torch.float32, copy=True).reshape(-1, layers, h)
        amax = xf.abs().amax(dim=-1)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError("holds inf or NaN; fp8 storage cannot scale it (the target produced non-finite "
                             "hidden states: check capture.dtype, or store with capture.store_dtype: auto)")
        scale = amax / FP8_MAX     # 0 for a zero block: it stores zeros and de-quantises to zeros
        # a non-zero block under 448 x float32's smallest subnormal keeps that subnormal as its scale, not 0
        scale = torch.where((amax > 0) & (scale == 0), torch.full_like(scale, 2.0 ** -149), scale)
        inv = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                          torch.zeros_like(amax))
        # A block under 448 / float32 max (|x| < 1.3e-36) would scale by inf (0 x inf = NaN), and a subnormal
        # scale is not amax / 448 any more: such blocks are divided by their stored scale in float64, and
        # their error is measured on what de-quantising gives back.
        tiny = (amax > 0) & (scale < torch.finfo(torch.float32).tiny)
        exact = None
        if bool(tiny.any()):
            exact = xf[tiny].double()
            xf[tiny] = (exact / scale[tiny].double().unsqueeze(-1)).float()
            inv = torch.where(tiny, torch.ones_like(inv), inv)
        xs = xf.mul_(inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        qq = xs.to(torch.float8_e4m3fn)
        # relative error in the scaled domain: the scale cancels, so the float32 copy of x is not kept
        ref = xs.norm(dim=-1)
        err = xs.sub_(qq.float()).norm(dim=-1)
        rel = torch.where(ref > 0, err / torch.where(ref > 0, ref, torch.ones_like(ref)), torch.zeros_like(ref))
        if exact is not None:   # what de-quantising with the stored (subnormal) scale really gives back
            back = (qq[tiny].float() * scale[tiny].unsqueeze(-1)).double()   # as dequantise_fp8 computes it
            rel[tiny] = ((back - exact).norm(dim=-1) / exact.norm(dim=-1)).float()
        if not bool(torch.isfinite(rel).all()):   # never a NaN on disk behind a clean error figure
            raise ValueError("fp8 quantisation produced a non-finite value; store with capture.store_dtype: auto")
        worst = max(worst, float(rel.max())) if rel.numel() else worst
        total += float(rel.sum())
        q[r0:r0 + _QUANT_ROWS] = qq.reshape(-1, width)
        scales[r0:r0 + _QUANT_ROWS] = scale
    blocks = n * layers
    return q, scales, {"max_rel": worst, "mean_rel": total / blocks if blocks else 0.0}


def dequantise_fp8(q, scale, dtype=None):
    """x [..., W] from float8 q [..., W] and scales [..., layers], on q's device (float32, or ``dtype``)."""
    import torch

    layers = int(scale.shape[-1])
    shape = q.shape
    x = q.to(torch.float32).reshape(*shape[:-1], layers, shape[-1] // layers) * scale.to(torch.float32).unsqueeze(-1)
    x = x.reshape(shape)
    return x if dtype is None else x.to(dtype)


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
