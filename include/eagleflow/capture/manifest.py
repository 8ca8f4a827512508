"""A shard's manifest: append-only JSONL, one line per stored sample, written after its rename.

    {"id": "sharegpt:12", "index": 57, "file": "00000057.safetensors", "tokens": 123,
     "bytes": 45678, "sha256": "<hex>", "mtime_ns": 1764560000123456789, "store_dtype": "fp8_e4m3"}

A crash mid-append leaves a trailing partial line: readers ignore it, and the
next append starts on a fresh line so the partial bytes never merge with a
good record. A resume rewrites the manifest whole (``compact_manifest``) when
it holds damaged, repeated or stale lines, so a redone sample leaves one clean
line. ``mtime_ns`` (the file's after its rename) lets a resume hash only the
files changed since they were recorded (older lines lack it: hashed once).
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagleflow import bounded_json
from eagleflow.durable import atomic_write, open_owned

from .storage import file_sha256


@dataclass(slots=True)
class ManifestEntry:
    id: str
    index: int
    file: str
    tokens: int
    bytes: int
    sha256: str
    mtime_ns: int | None = None
    store_dtype: str | None = None     # capture.store_dtype the file was written with; None (older lines) = auto
    store_id: str | None = None        # a streaming store's incarnation the sample was put into (None: disk)

    def to_line(self) -> str:
        d = asdict(self)
        for k in ("mtime_ns", "store_dtype", "store_id"):
            if d[k] is None:
                del d[k]
        return json.dumps(d, separators=(",", ":")) + "\n"


@dataclass
class ManifestScan:
    entries: dict[int, ManifestEntry]   # by sample index; a repeated index keeps the last line
    partial_tail: bool                  # the file ended in an incomplete line
    bad_lines: list[int]                # 1-based line numbers that were not valid records
    duplicates: list[int]               # indexes recorded more than once
    duplicate_ids: list[str] = field(default_factory=list)   # sample ids recorded under two indexes

    @property
    def clean(self) -> bool:
        return not (self.partial_tail or self.bad_lines or self.duplicates or self.duplicate_ids)


def read_manifest(path: str | os.PathLike) -> ManifestScan:
    # Tens of thousands of small objects: the cyclic GC would rescan them all, repeatedly, for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _read_manifest(path)
    finally:
        if was_enabled:
            gc.enable()


def _read_manifest(path: str | os.PathLike) -> ManifestScan:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return ManifestScan({}, False, [], [])
    return parse_manifest_bytes(data, str(path))


def parse_manifest_bytes(data: bytes, path: str) -> ManifestScan:
    """``read_manifest`` of a manifest's bytes (or of the complete lines appended since an earlier read: a
    reader that keeps its offset merges their ``entries`` over the earlier ones, the last line winning)."""
    entries: dict[int, ManifestEntry] = {}
    dups: list[int] = []
    bad: list[int] = []
    partial = False
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        partial = True          # no newline at the end: a crash mid-append
    lines = lines[:-1]
    numbered = None
    if all(x.strip() for x in lines):
        try:
            # Fast path (37k lines in tens of ms): the whole file as one JSON array, one record per line.
            records = bounded_json.loads(b"[" + b",".join(lines) + b"]", source=str(path), max_bytes=len(data) + 2)
            if len(records) == len(lines):
                numbered = list(enumerate(records, start=1))
        except ValueError:
            pass
    if numbered is None:        # a bad or blank line somewhere: parse line by line to find it
        numbered = []
        for n, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                numbered.append((n, bounded_json.loads(raw, source=f"{path} line {n}", max_bytes=len(raw))))
            except ValueError:
                bad.append(n)
    for n, d in numbered:
        try:
            mt = d.get("mtime_ns")
            e = ManifestEntry(id=str(d["id"]), index=int(d["index"]), file=str(d["file"]),
                              tokens=int(d["tokens"]), bytes=int(d["bytes"]), sha256=str(d["sha256"]),
                              mtime_ns=None if mt is None else int(mt),
                              store_dtype=None if d.get("store_dtype") is None else str(d["store_dtype"]),
                              store_id=None if d.get("store_id") is None else str(d["store_id"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            bad.append(n)
            continue
        if e.index in entries:
            dups.append(e.index)
        entries[e.index] = e
    # one id under two indexes: the same sample stored twice (a sample id names one corpus record)
    first: dict[str, int] = {}
    dup_ids: list[str] = []
    for idx, e in entries.items():
        if first.setdefault(e.id, idx) != idx:
            dup_ids.append(e.id)
    return ManifestScan(entries, partial, bad, dups, dup_ids)


class ManifestWriter:
    """Appends entries with one unbuffered write each; repairs a partial tail first.

    Group commit: a line reaches the OS at once (a killed process loses
    nothing), but is fsynced at most every ``fsync_every_s`` and at close.
    That is safe because the line is written after its sample file was
    fsynced and renamed: a machine crash can only lose recent lines, whose
    samples are then redone (their files overwritten), never a line pointing
    at a file that is not on disk. One fsync per sample would double the
    journal commits of the storage path.
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = True, fsync_every_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.fsync_every_s = fsync_every_s
        self._last_fsync = time.monotonic()
        # appended to, never replaced: not through a link planted at its name (durable.open_owned)
        fd = open_owned(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644, narrow=True)
        self._f = os.fdopen(fd, "ab")
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            self._f.write(b"\n")   # seal the partial line so it stays a bad line, not a merged one
            self._flush()

    def _flush(self, force: bool = True) -> None:
        self._f.flush()
        now = time.monotonic()
        if self.fsync and (force or now - self._last_fsync >= self.fsync_every_s):
            os.fsync(self._f.fileno())
            self._last_fsync = now

    def append(self, entry: ManifestEntry) -> None:
        self._f.write(entry.to_line().encode())
        self._flush(force=False)

    def close(self) -> None:
        if not self._f.closed:
            self._flush(force=True)
            self._f.close()

    def __enter__(self) -> "ManifestWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ResumeCheck:
    done: set[int]                  # indexes whose stored file is intact
    broken: list[tuple[ManifestEntry, str]]   # entries to redo, with why
    hashed: int                     # files whose content was hashed (changed since recorded, or never stamped)
    refreshed: dict[int, ManifestEntry]       # intact entries given their file's current mtime_ns


def completed_indexes(shard_dir: str | os.PathLike, scan: ManifestScan) -> ResumeCheck:
    """Which recorded samples are intact: size always; content (sha256) for files changed since recorded.

    A file whose mtime still equals the one stamped at its rename has not been written since its
    sha256 was taken, so a stat is enough; any other file (a same-size byte flip bumps its mtime,
    an old line has no stamp) is hashed. The 37,312-entry scan stays a stat per file.
    """
    done: set[int] = set()
    broken: list[tuple[ManifestEntry, str]] = []
    refreshed: dict[int, ManifestEntry] = {}
    hashed = 0
    d = Path(shard_dir)
    for idx, e in scan.entries.items():
        p = d / e.file
        try:
            st = os.stat(p)
        except FileNotFoundError:
            broken.append((e, "file missing"))
            continue
        if st.st_size != e.bytes:
            broken.append((e, f"size {st.st_size} bytes, manifest says {e.bytes}"))
            continue
        if e.mtime_ns is None or st.st_mtime_ns != e.mtime_ns:
            hashed += 1
            if file_sha256(p) != e.sha256:
                broken.append((e, "sha256 differs from the manifest (content changed after it was stored)"))
                continue
            refreshed[idx] = ManifestEntry(e.id, e.index, e.file, e.tokens, e.bytes, e.sha256, st.st_mtime_ns,
                                           e.store_dtype)
        done.add(idx)
    return ResumeCheck(done, broken, hashed, refreshed)


def compact_manifest(path: str | os.PathLike, keep: list[ManifestEntry], fsync: bool = True) -> None:
    """Rewrite the manifest whole (atomically) with exactly ``keep``, one line each, by index."""
    data = "".join(e.to_line() for e in sorted(keep, key=lambda e: e.index)).encode()
    atomic_write(path, data, fsync=fsync)
