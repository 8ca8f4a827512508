"""`eagleflow capture verify`: every stored file against its shard's manifest.

Reports, per shard: missing (in the corpus' shard but not stored), extra
(a sample file with no manifest entry), truncated (size differs from the
record), mismatched (sha256 differs), bad manifest lines.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .manifest import read_manifest
from .storage import SAMPLE_SUFFIX, TMP_PREFIX, file_sha256, sample_file_name


@dataclass
class ShardReport:
    shard: int
    expected: int
    stored: int = 0
    missing: list[int] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.truncated or self.mismatched or self.bad_lines)

    def line(self) -> str:
        def few(xs):
            return ", ".join(str(x) for x in xs[:5]) + (f" (+{len(xs) - 5})" if len(xs) > 5 else "")
        parts = [f"shard {self.shard}: {self.stored}/{self.expected} stored"]
        for name in ("missing", "extra", "truncated", "mismatched", "bad_lines", "temp_files"):
            xs = getattr(self, name)
            if xs:
                parts.append(f"{len(xs)} {name.replace('_', ' ')}: {few(xs)}")
        return "; ".join(parts) + ("" if self.ok else "  <- FAILED")


def verify_shard(shard_dir: str | os.PathLike, shard: int, expected: list[int], check_digest: bool = True) -> ShardReport:
    d = Path(shard_dir)
    rep = ShardReport(shard=shard, expected=len(expected))
    scan = read_manifest(d / "manifest.jsonl")
    rep.bad_lines = list(scan.bad_lines)
    on_disk = {p.name for p in d.glob(f"*{SAMPLE_SUFFIX}") if not p.name.startswith(TMP_PREFIX)} if d.is_dir() else set()
    rep.temp_files = sorted(p.name for p in d.glob(f"{TMP_PREFIX}*")) if d.is_dir() else []
    recorded = set()
    for idx in sorted(expected):
        e = scan.entries.get(idx)
        if e is None:
            rep.missing.append(idx)
            continue
        recorded.add(e.file)
        p = d / e.file
        if e.file != sample_file_name(idx) or e.file not in on_disk:
            rep.missing.append(idx)
            continue
        size = p.stat().st_size
        if size != e.bytes:
            rep.truncated.append(e.file)
            continue
        if check_digest and file_sha256(p) != e.sha256:
            rep.mismatched.append(e.file)
            continue
        rep.stored += 1
    wanted = set(expected)
    extra_entries = [e.file for i, e in scan.entries.items() if i not in wanted]
    rep.extra = sorted((on_disk - recorded) | set(extra_entries))
    return rep
