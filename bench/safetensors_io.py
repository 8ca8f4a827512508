"""Our torch-free safetensors paths against safetensors' own raw API, on one real-size sample (issue 39: keep
the hand-written reader/writer only if the library's is not as good).

Write: ``file_parts`` (header + tensor views, never joined) written with the sha256 computed in a thread while
the bytes go to disk (what ``capture.storage`` does), vs ``safetensors.serialize_file`` and then a sha256 pass
over the written file (the library writes the file itself, so the digest needs a second pass). Both fsync.
Read: ``read_raw`` (one buffer, the tensors as views of it) vs ``safetensors.deserialize`` of the file's bytes
(a bytes object per tensor). Alternated, medians of ``--rounds``; page cache dropped before each read
(``posix_fadvise``), so both read from disk.

    .venv/bin/python bench/safetensors_io.py [--tokens 8192] [--hidden 7168] [--rounds 5]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "include"))

from eagleflow.safetensors_format import DTYPES, RawTensor, file_parts, read_raw  # noqa: E402


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ours_write(path: Path, tensors: dict[str, RawTensor], meta: dict[str, str]) -> str:
    parts = file_parts(tensors, meta)
    h = hashlib.sha256()
    t = threading.Thread(target=lambda: [h.update(p) for p in parts])
    t.start()
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    t.join()
    return h.hexdigest()


def library_write(path: Path, tensors: dict[str, RawTensor], meta: dict[str, str]) -> str:
    """safetensors 0.8's raw API: a TensorSpec per tensor points at its bytes (dtype by torch's name)."""
    import ctypes

    import safetensors
    keep = {k: (ctypes.c_char * v.nbytes).from_buffer(v.data) for k, v in tensors.items()}   # buffers pinned
    spec = {k: safetensors.TensorSpec(dtype=DTYPES[v.dtype][1], shape=list(v.shape), data_ptr=ctypes.addressof(keep[k]),
                                      data_len=v.nbytes) for k, v in tensors.items()}
    safetensors.serialize_file(spec, str(path), metadata=meta)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def library_read(path: Path) -> dict:
    import safetensors
    return dict(safetensors.deserialize(path.read_bytes()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    n, h = a.tokens, a.hidden
    rnd = os.urandom
    tensors = {"input_ids": RawTensor("I64", (n,), memoryview(bytearray(rnd(8 * n)))),
               "loss_mask": RawTensor("U8", (n,), memoryview(bytearray(n))),
               "aux_hidden_states": RawTensor("BF16", (n, 3 * h), memoryview(bytearray(rnd(2 * 3 * h * n)))),
               "hidden_states": RawTensor("BF16", (n, h), memoryview(bytearray(rnd(2 * h * n))))}
    meta = {"id": "bench", "index": "0"}
    times: dict[str, list[float]] = {k: [] for k in ("ours write", "library write", "ours read", "library read")}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as d:
        ours, lib = Path(d) / "ours.safetensors", Path(d) / "lib.safetensors"
        for r in range(a.rounds):
            order = [("ours", ours_write, ours), ("library", library_write, lib)]
            for name, fn, path in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                digest = fn(path, tensors, meta)
                times[f"{name} write"].append(time.perf_counter() - t0)
                assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
            for name, fn, path in [("ours", read_raw, ours), ("library", library_read, lib)][::1 if r % 2 else -1]:
                _drop(path)
                t0 = time.perf_counter()
                fn(path)
                times[f"{name} read"].append(time.perf_counter() - t0)
        size = ours.stat().st_size
    print(f"one sample: {n} tokens x H {h}, bf16, {size / 2**20:.0f} MiB; median of {a.rounds} rounds, alternated")
    for k, v in times.items():
        print(f"  {k:14s} {statistics.median(v):7.3f} s  ({size / 2**20 / statistics.median(v):6.0f} MiB/s)")
    for op in ("write", "read"):
        print(f"  {op}: library / ours = {statistics.median(times[f'library {op}']) / statistics.median(times[f'ours {op}']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
