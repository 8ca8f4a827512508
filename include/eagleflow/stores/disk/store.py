"""The disk store: today's offline storage, behind the store contract.

The sink writes each sample as ``<index:08d>.safetensors`` in its shard's folder (temp, fsync, rename:
``eagleflow.capture.storage.SampleWriter``) and then appends its manifest line
(``eagleflow.capture.manifest.ManifestWriter``): the on-disk format is unchanged. The source scans the
manifests (``scan_samples``: each file checked for size, and for sha256 when asked, against its line; only
the shards ``capture verify`` passed when given its record) and opens the files; ``release`` keeps them.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Literal

from eagleflow.capture.manifest import ManifestEntry, ManifestWriter, read_manifest
from eagleflow.capture.storage import SampleWriter, file_sha256, sample_file_name
from eagleflow.stores import StoreSettings
from eagleflow.stores.contract import BadSampleError, PutReceipt, SampleRef
from eagleflow.stores.encoding import EncodedSample

if TYPE_CHECKING:
    from eagleflow.capture.verify import VerificationRecord

STORE = "disk"


class DiskSink:
    """One shard's folder: each sample's file, then its manifest line (group-committed, see ManifestWriter)."""
    store = STORE

    def __init__(self, shard_dir: str | os.PathLike, *, store_dtype: str = "auto", fsync: bool = True):
        self.shard_dir = Path(shard_dir)
        self.writer = SampleWriter(self.shard_dir, fsync=fsync, store_dtype=store_dtype)
        self.manifest = ManifestWriter(self.shard_dir / "manifest.jsonl", fsync=fsync)
        self._lock = threading.Lock()
        self.on_wait: Callable[[float | None], None] | None = None   # never called: a disk has no buffer to wait on

    def put(self, sample: EncodedSample) -> PutReceipt:
        stored = self.writer.write_encoded(sample)
        mtime_ns = os.stat(stored.path).st_mtime_ns   # lets a resume skip hashing an unchanged file
        with self._lock:
            self.manifest.append(ManifestEntry(id=sample.sample_id, index=sample.index,
                                               file=sample_file_name(sample.index), tokens=sample.tokens,
                                               bytes=stored.bytes, sha256=stored.sha256, mtime_ns=mtime_ns,
                                               store_dtype=stored.store_dtype))
        return PutReceipt(sample.index, sample.sample_id, str(stored.path), stored.bytes, stored.sha256,
                          stored.store_dtype)

    def close(self) -> None:
        self.manifest.close()

    def __enter__(self) -> "DiskSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DiskSource:
    """The run's stored files, as their manifests record them."""
    store = STORE
    streaming = False

    def __init__(self, root: str | os.PathLike, *, on_bad: Literal["raise", "skip"] = "raise",
                 verify_sha256: bool = False, log: Callable[[str], None] = print,
                 verified: "VerificationRecord | None" = None):
        self.root = Path(root)
        self.on_bad: Literal["raise", "skip"] = on_bad
        self.verify_sha256 = verify_sha256
        self.log = log
        self.verified = verified

    def scan(self) -> list[SampleRef]:
        return scan_samples(self.root, on_bad=self.on_bad, verify_sha256=self.verify_sha256, log=self.log,
                            verified=self.verified)

    def open(self, ref: SampleRef) -> BinaryIO:
        return open(ref.path, "rb", buffering=0)

    def release(self, ref: SampleRef) -> None:
        pass     # offline: the files stay until the run's data is deleted

    def wait_for_store(self, timeout_s: float, on_wait=None) -> bool:
        return False     # files have no server to come back: never a new incarnation

    def close(self) -> None:
        pass


def open_sink(settings: StoreSettings, shard: int) -> DiskSink:
    return DiskSink(Path(settings.root) / f"shard_{shard:05d}", store_dtype=settings.store_dtype,
                    fsync=settings.fsync)


def open_source(settings: StoreSettings, **options) -> DiskSource:
    return DiskSource(settings.root, **options)


class MixedStoreError(ValueError):
    """Shards of one run stored with different capture.store_dtype: one draft trains on one format."""


def scan_samples(hidden_states_dir: str | os.PathLike[str], *, on_bad: Literal["raise", "skip"] = "raise",
                 verify_sha256: bool = False, log: Callable[[str], None] = print,
                 verified: "VerificationRecord | None" = None) -> list[SampleRef]:
    """Every sample the manifests record, checked against its file; ordered by sample index."""
    root = Path(hidden_states_dir)
    shard_dirs = sorted(p for p in root.glob("shard_*") if p.is_dir()) if root.is_dir() else []
    if verified is not None:
        shard_dirs = [p for p in shard_dirs if p.name in verified.shards]
    if not shard_dirs:
        raise FileNotFoundError(f"no shard directories (shard_NNNNN) under {root}; run the extraction first "
                                "(`eagleflow extract`) or point run_root/--run-id at the run that has them")
    refs: list[SampleRef] = []
    bad: list[str] = []
    for d in shard_dirs:
        shard = int(d.name.split("_", 1)[1])
        manifest = d / "manifest.jsonl"
        if not manifest.is_file():
            raise FileNotFoundError(f"{manifest} does not exist: shard {shard} has no record of stored samples; "
                                    "re-run its extraction")
        scan = read_manifest(manifest)
        if scan.bad_lines:
            log(f"{manifest}: ignoring unreadable line(s) {scan.bad_lines[:10]}")
        for idx in sorted(scan.entries):
            e = scan.entries[idx]
            path = d / e.file
            problem = _check_file(path, e.bytes, e.sha256 if verify_sha256 else None,
                                  verified.newest_mtime_ns if verified is not None else None)
            if problem:
                bad.append(f"{path}: {problem}")
                continue
            refs.append(SampleRef(shard=shard, index=e.index, id=e.id, path=str(path), tokens=e.tokens,
                                  bytes=e.bytes, sha256=e.sha256, store_dtype=e.store_dtype or "auto"))
    if bad:
        head = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        if on_bad == "raise":
            raise BadSampleError(f"{len(bad)} stored sample(s) do not match their manifest: {head}. "
                                 "Re-run extraction for those shards (it resumes from the manifest), or set "
                                 "train.on_bad_sample: skip to train without them")
        log(f"skipping {len(bad)} stored sample(s) that do not match their manifest: {head}")
    if not refs:
        raise FileNotFoundError(f"the manifests under {root} record no usable sample; nothing to train on")
    by_dtype: dict[str, dict[int, int]] = {}
    for r in refs:
        per_shard = by_dtype.setdefault(r.store_dtype, {})
        per_shard[r.shard] = per_shard.get(r.shard, 0) + 1
    if len(by_dtype) > 1:
        parts = "; ".join(f"{dt}: " + ", ".join(f"shard_{s:05d} ({n} samples)" for s, n in sorted(sh.items()))
                          for dt, sh in sorted(by_dtype.items()))
        raise MixedStoreError(f"refusing to train: the hidden states under {root} mix store dtypes ({parts}); "
                              "re-capture the odd shard(s) with the run's capture.store_dtype (delete the shard "
                              "dir and re-run its extraction) so every shard has one format")
    refs.sort(key=lambda r: r.index)
    return refs


def _check_file(path: Path, size: int, sha256: str | None, verified_mtime_ns: int | None = None) -> str | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "file is missing"
    actual = st.st_size
    if actual != size:
        return f"size {actual} bytes, manifest says {size}"
    if verified_mtime_ns is not None and st.st_mtime_ns > verified_mtime_ns:
        return "written after `capture verify` passed (not verified)"
    if sha256 is not None and file_sha256(path) != sha256:
        return "sha256 differs from the manifest"
    return None


