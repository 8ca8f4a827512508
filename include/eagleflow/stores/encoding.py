"""How one sample's hidden states become bytes: the safetensors encoding every store keeps (disk and Mooncake).

Keys: ``input_ids`` int64 [L], ``loss_mask`` uint8 [L], ``aux_hidden_states`` [L, 3H] and ``hidden_states``
[L, H] in the target's dtype; metadata (strings): id, index, aux_layers (JSON list), model, store_dtype.

``store_dtype: fp8_e4m3`` is a property of the encoding, not of a store: the two hidden-state tensors are
stored as F8_E4M3 with one float32 scale per token and captured layer (``<key>_scale`` [L, 3] and [L, 1]:
absmax / 448), plus metadata ``scaling``, ``orig_dtype`` and ``quant_error`` (eagleflow.capture.storage
explains the figures). A disk store writes the encoded parts to a file, a Mooncake store puts their bytes
under a key: the bytes, and so the sha256 in the shard's manifest, are the same either way.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from eagleflow.safetensors_format import RawTensor, as_raw, file_parts

STORE_DTYPES = ("auto", "fp8_e4m3")
QUANTISED_KEYS = ("aux_hidden_states", "hidden_states")
SCALE_SUFFIX = "_scale"
FP8_MAX = 448.0             # largest finite float8_e4m3fn
FP8_SCALING = "per-token-per-layer absmax/448, float32 scales"
_QUANT_ROWS = 1024          # rows quantised at a time: bounds the float32 temporaries (8k x 21504 would be 700 MB)


@dataclass(frozen=True)
class EncodedSample:
    """One sample as the bytes a store keeps: ``parts`` (the header, then each tensor's bytes, never copied
    into one buffer) of ``size`` bytes in all."""
    index: int
    sample_id: str
    tokens: int
    store_dtype: str
    parts: tuple
    size: int

    def sha256(self) -> str:
        h = hashlib.sha256()
        for part in self.parts:
            h.update(part)
        return h.hexdigest()

    def to_bytes(self) -> bytes:
        return b"".join(bytes(p) if not isinstance(p, bytes) else p for p in self.parts)


def encode_sample(*, index: int, sample_id: str, input_ids, loss_mask, aux_hidden_states, hidden_states,
                  aux_layers: list[int], model: str, store_dtype: str = "auto") -> EncodedSample:
    """One sample's safetensors bytes. Tensors come as RawTensor (a dump's bytes, moved unchanged: no torch
    needed) or torch tensors; ``loss_mask`` may be a list of 0/1. Only ``store_dtype: fp8_e4m3`` imports torch."""
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"capture.store_dtype = {store_dtype!r}; expected one of {', '.join(STORE_DTYPES)}")
    mask = RawTensor.of_bytes(loss_mask) if isinstance(loss_mask, (list, tuple)) else as_raw(loss_mask).as_uint8()
    tensors = {"input_ids": as_raw(input_ids).as_int64(), "loss_mask": mask,
               "aux_hidden_states": as_raw(aux_hidden_states), "hidden_states": as_raw(hidden_states)}
    n = tensors["input_ids"].rows
    for name in ("loss_mask", "aux_hidden_states", "hidden_states"):
        if tensors[name].rows != n:
            raise ValueError(f"sample {sample_id} (index {index}): {name} has {tensors[name].rows} rows but "
                             f"input_ids has {n}; the dump does not belong to this sample")
    meta = {"id": sample_id, "index": str(index), "aux_layers": json.dumps(list(aux_layers)), "model": model,
            "store_dtype": store_dtype}
    if store_dtype == "fp8_e4m3":
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
    return EncodedSample(index=index, sample_id=sample_id, tokens=n, store_dtype=store_dtype, parts=tuple(parts),
                         size=sum(len(p) for p in parts))


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
                             "hidden states: check server.dtype, or store with capture.store_dtype: auto)")
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
