"""The safetensors file format as raw bytes: read and write it without torch.

An extraction worker moves hidden states from a dump to the store unchanged (``capture.store_dtype:
auto``): it never computes on them, so it has no need of torch, whose import was most of a worker's
start (bench/fleet.py: the overhead per shard fell from 3.5 s to 0.5 s on one node). The one header
check lives here too, so the trainer's reader (``eagleflow.train.data``) refuses what this one refuses.

Layout (as ``safetensors.torch.save`` writes it and ``safe_open`` checks it): u64 little-endian
header length, a JSON header (``__metadata__``: str -> str; per tensor ``dtype``, ``shape``,
``data_offsets`` relative to the end of the header), then the tensor bytes, little-endian, C order.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

MAX_HEADER = 100 << 20    # safetensors' own limit

# safetensors dtype code -> (bytes per element, torch's name of it: what the dump MAC has always hashed)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"), "F32": (4, "float32"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"), "I64": (8, "int64"), "I32": (4, "int32"),
    "I16": (2, "int16"), "I8": (1, "int8"), "U8": (1, "uint8"), "BOOL": (1, "bool")}
CODE_OF_TORCH_NAME = {name: code for code, (_size, name) in DTYPES.items()}
_NUMPY = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?", "F64": "<f8", "F32": "<f4",
          "F16": "<f2"}   # numpy has no bfloat16 nor float8


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str               # safetensors code
    shape: tuple[int, ...]
    start: int               # offsets from the end of the header
    end: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    entries: dict[str, HeaderEntry]   # in header order
    data_start: int                   # 8 + header length: where tensor bytes begin


def read_header(f, file_size: int) -> Header:
    """The checked header of the open binary file ``f``; ValueError naming what safetensors would refuse
    (bad length or JSON, unknown dtype, offsets that do not hold the shape or run past the file)."""
    f.seek(0)
    first = f.read(8)
    n = int.from_bytes(first, "little") if len(first) == 8 else -1
    if not 0 < n <= min(MAX_HEADER, file_size - 8):
        raise ValueError(f"header length {n} does not fit a {file_size}-byte file")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not a map of strings")
    entries = {}
    for name, entry in header.items():
        try:
            code, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{name}: entry {entry!r} lacks dtype, shape or two data_offsets") from None
        if code not in DTYPES:
            raise ValueError(f"{name}: dtype {code!r} is not one of {', '.join(DTYPES)}")
        if not all(type(d) is int and d >= 0 for d in shape) or not all(type(x) is int for x in (start, end)):
            raise ValueError(f"{name}: shape {list(shape)} or offsets {start}..{end} are not non-negative integers")
        nbytes = math.prod(shape) * DTYPES[code][0]
        if end - start != nbytes or start < 0 or 8 + n + end > file_size:
            raise ValueError(f"{name}: offsets {start}..{end} do not hold shape {list(shape)} {code} in the "
                             f"{file_size}-byte file")
        entries[name] = HeaderEntry(name, code, shape, start, end)
    return Header(metadata=dict(meta), entries=entries, data_start=8 + n)


@dataclass(frozen=True)
class RawTensor:
    """One tensor as its safetensors dtype code, shape and bytes (little-endian, C order)."""
    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def torch_name(self) -> str:
        """``torch.bfloat16`` and so on: the name ``str(tensor.dtype)`` gives."""
        return "torch." + DTYPES[self.dtype][1]

    def tolist(self) -> list:
        """The values, flattened (what input ids are compared as); numpy's dtypes only (not BF16, F8)."""
        import numpy as np
        if self.dtype not in _NUMPY:
            raise TypeError(f"tolist() reads {', '.join(_NUMPY)} tensors; this one is {self.dtype}")
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).tolist()

    def as_int64(self) -> "RawTensor":
        return self._as("I64")

    def as_uint8(self) -> "RawTensor":
        return self._as("U8")

    def _as(self, code: str) -> "RawTensor":
        if self.dtype == code:
            return self
        import numpy as np
        values = np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).astype(_NUMPY[code])
        return RawTensor(code, self.shape, values.data.cast("B"))

    def to_torch(self):
        """A torch tensor over these bytes (shared, not copied, when they are writable)."""
        import torch
        dtype = getattr(torch, DTYPES[self.dtype][1])
        if not self.nbytes:
            return torch.empty(self.shape, dtype=dtype)
        data = self.data if not self.data.readonly else bytearray(self.data)
        return torch.frombuffer(data, dtype=dtype).reshape(self.shape)

    @classmethod
    def from_torch(cls, t) -> "RawTensor":
        """The bytes of a torch tensor (moved to the CPU, made contiguous); they keep the tensor alive."""
        import torch
        t = t.detach().to("cpu").contiguous()
        code = CODE_OF_TORCH_NAME[str(t.dtype).replace("torch.", "")]
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
        return cls(code, tuple(int(d) for d in t.shape), data)

    @classmethod
    def of_bytes(cls, values) -> "RawTensor":
        """A 1-D uint8 tensor of small non-negative integers (a loss mask): ValueError for a value over 255."""
        data = bytes(int(v) for v in values)
        return cls("U8", (len(data),), memoryview(data))


def as_raw(t) -> RawTensor:
    """A RawTensor as it is; a torch tensor's bytes."""
    return t if isinstance(t, RawTensor) else RawTensor.from_torch(t)


def read_raw(path: str | os.PathLike, keys=None) -> tuple[dict[str, str], dict[str, RawTensor]]:
    """(metadata, tensors) of a safetensors file, all of its tensors or the named ones, as views into one
    writable buffer read in one pass. ValueError for a bad header, OSError for a file cut short."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        h = read_header(f, size)
        buf = bytearray(size - h.data_start)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            k = f.readinto(view[got:])
            if not k:
                raise OSError(f"file ends after {h.data_start + got} of {size} bytes")
            got += k
    wanted = h.entries if keys is None else {k: h.entries[k] for k in keys if k in h.entries}
    return h.metadata, {k: RawTensor(e.dtype, e.shape, view[e.start:e.end]) for k, e in wanted.items()}


def file_parts(tensors: dict[str, RawTensor], metadata: dict[str, str]) -> list:
    """A safetensors file as [header, tensor bytes...], the tensors in key order and never copied into one
    buffer. ``safe_open`` reads it (the tests read every stored file back through it)."""
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)
    return [len(hjson).to_bytes(8, "little") + hjson, *(t.data for t in tensors.values())]
