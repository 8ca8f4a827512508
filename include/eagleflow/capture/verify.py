"""`eagleflow capture verify`: every stored file against its shard's manifest.

Reports, per shard: missing (in the corpus' shard but not stored), extra
(a sample file with no manifest entry), truncated (size differs from the
record), mismatched (sha256 differs), damaged manifest lines (bad or cut
off), duplicates (two lines for one index, or one sample id under two
indexes). Any of them fails the shard.

A run that passes gets a verification record (``verified.json`` in its
hidden-states dir) holding each manifest's sha256 and the newest verified
file's mtime; a run that fails loses it. Training reads it
(``require_verified``) and refuses data that never passed, or whose manifests
or files changed since.

The sha256 covers every stored byte whatever the store dtype (fp8 payloads,
their scales and the metadata). Each shard's line names its store dtype(s);
``quantisation_stats`` (``capture verify --stats``) reads the quantisation error
the writer measured into a sample of fp8 files.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagleflow import bounded_json
from eagleflow.durable import atomic_write, discard_temp

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
    partial_tail: bool = False
    duplicates: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    store_dtypes: dict[str, int] = field(default_factory=dict)   # capture.store_dtype -> samples recorded
    newest_mtime_ns: int = 0
    unreadable: str = ""        # the shard dir or its manifest cannot be read at all

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.truncated or self.mismatched or self.bad_lines
                    or self.partial_tail or self.duplicates or self.unreadable)

    def line(self) -> str:
        def few(xs):
            return ", ".join(str(x) for x in xs[:5]) + (f" (+{len(xs) - 5})" if len(xs) > 5 else "")
        parts = [f"shard {self.shard}: {self.stored}/{self.expected} stored"
                 + (f" ({', '.join(f'{n} {dt}' for dt, n in sorted(self.store_dtypes.items()))})"
                    if self.store_dtypes else "")]
        for name in ("missing", "extra", "truncated", "mismatched", "bad_lines", "duplicates", "temp_files"):
            xs = getattr(self, name)
            if xs:
                label = "damaged manifest line(s)" if name == "bad_lines" else name.replace('_', ' ')
                parts.append(f"{len(xs)} {label}: {few(xs)}")
        if self.partial_tail:
            parts.append("manifest ends in a cut-off line")
        if self.unreadable:
            parts.append(self.unreadable)
        return "; ".join(parts) + ("" if self.ok else "  <- FAILED")


def verify_shard(shard_dir: str | os.PathLike, shard: int, expected: list[int], check_digest: bool = True) -> ShardReport:
    d = Path(shard_dir)
    rep = ShardReport(shard=shard, expected=len(expected))
    try:
        scan = read_manifest(d / "manifest.jsonl")
    except OSError as e:   # e.g. the shard's dir is a file, or unreadable: nothing of it counts as stored
        rep.missing = sorted(expected)
        rep.unreadable = f"{d / 'manifest.jsonl'} cannot be read ({e.strerror or e})"
        return rep
    rep.bad_lines = list(scan.bad_lines)
    rep.partial_tail = scan.partial_tail
    rep.duplicates = ([f"index {i}" for i in sorted(set(scan.duplicates))]
                      + [f"id {sid}" for sid in sorted(set(scan.duplicate_ids))])
    on_disk = {p.name for p in d.glob(f"*{SAMPLE_SUFFIX}") if not p.name.startswith(TMP_PREFIX)} if d.is_dir() else set()
    rep.temp_files = sorted(p.name for p in d.glob(f"{TMP_PREFIX}*")) if d.is_dir() else []
    recorded: set[str] = set()
    for idx in sorted(expected):
        entry = scan.entries.get(idx)
        if entry is None:
            rep.missing.append(idx)
            continue
        recorded.add(entry.file)
        sd = entry.store_dtype or "auto"
        rep.store_dtypes[sd] = rep.store_dtypes.get(sd, 0) + 1
        p = d / entry.file
        if entry.file != sample_file_name(idx) or entry.file not in on_disk:
            rep.missing.append(idx)
            continue
        st = p.stat()
        size = st.st_size
        rep.newest_mtime_ns = max(rep.newest_mtime_ns, st.st_mtime_ns)
        if size != entry.bytes:
            rep.truncated.append(entry.file)
            continue
        if check_digest and file_sha256(p) != entry.sha256:
            rep.mismatched.append(entry.file)
            continue
        rep.stored += 1
    wanted = set(expected)
    extra_entries = [e.file for i, e in scan.entries.items() if i not in wanted]
    rep.extra = sorted((on_disk - recorded) | set(extra_entries))
    return rep


def quantisation_stats(hidden_states_dir: str | os.PathLike, sample: int = 32) -> dict:
    """Per stored tensor, the quantisation error of up to ``sample`` files spread over the run's manifests.

    fp8 files carry the per-row relative L2 error their writer measured (metadata ``quant_error``);
    files in the target's dtype are exact. Returns {"files", "store_dtypes", "tensors": {key: {"max_rel",
    "mean_rel", "files"}}}: max over the files' maxima, mean over their means.
    """
    from safetensors import safe_open

    root = Path(hidden_states_dir)
    paths = []
    for m in sorted(root.glob("shard_*/manifest.jsonl")):
        paths += [m.parent / e.file for _, e in sorted(read_manifest(m).entries.items())]
    step = max(1, len(paths) // max(sample, 1))
    picked = paths[::step][:sample]
    dtypes: dict[str, int] = {}
    tensors: dict[str, dict] = {}
    for p in picked:
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:   # safetensors has its own error types; verify reports the file itself
            raise ValueError(f"{p}: not a readable safetensors file ({e}); run `eagleflow capture verify`") from None
        sd = meta.get("store_dtype", "auto")
        dtypes[sd] = dtypes.get(sd, 0) + 1
        errors = json.loads(meta["quant_error"]) if "quant_error" in meta else {
            k: {"max_rel": 0.0, "mean_rel": 0.0} for k in ("aux_hidden_states", "hidden_states")}
        for k, err in errors.items():
            t = tensors.setdefault(k, {"max_rel": 0.0, "sum_mean": 0.0, "files": 0})
            t["max_rel"] = max(t["max_rel"], float(err["max_rel"]))
            t["sum_mean"] += float(err["mean_rel"])
            t["files"] += 1
    return {"files": len(picked), "of": len(paths), "store_dtypes": dtypes,
            "tensors": {k: {"max_rel": t["max_rel"], "mean_rel": t["sum_mean"] / t["files"], "files": t["files"]}
                        for k, t in sorted(tensors.items())}}


def stats_lines(stats: dict) -> list[str]:
    dts = ", ".join(f"{n} {dt}" for dt, n in sorted(stats["store_dtypes"].items())) or "none"
    out = [f"quantisation error over {stats['files']} of {stats['of']} stored file(s) ({dts}); per-row relative "
           "L2 error ||stored - captured|| / ||captured|| (0 = stored exactly in the target's dtype):"]
    out += [f"  {k:20s} max {t['max_rel']:.3e}  mean {t['mean_rel']:.3e}" for k, t in stats["tensors"].items()]
    return out


RECORD_FILE = "verified.json"


class NotVerifiedError(RuntimeError):
    """Stored hidden states that `eagleflow capture verify` has not passed (or that changed since)."""


@dataclass
class VerificationResult:
    ok: bool
    reports: list[ShardReport]
    record_file: str | None      # written when ok

    @property
    def expected(self) -> int:
        return sum(r.expected for r in self.reports)

    @property
    def stored(self) -> int:
        return sum(r.stored for r in self.reports)

    def summary(self) -> str:
        """One line a person reads in an alert: how many, which shards, what is wrong with each."""
        if self.ok:
            return f"OK: {self.stored}/{self.expected} samples verified in {len(self.reports)} shard(s)"
        failed = [r for r in self.reports if not r.ok]
        return (f"FAILED: {self.stored}/{self.expected} samples verified; {self.expected - self.stored} not; "
                f"failed shard(s) {', '.join(str(r.shard) for r in failed)}: "
                + " | ".join(r.line().replace("  <- FAILED", "") for r in failed))

    def to_json(self) -> dict:
        return {"ok": self.ok, "expected": self.expected, "stored": self.stored, "summary": self.summary(),
                "shards": [asdict(r) for r in self.reports]}


def _manifest_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:   # missing or unreadable: verify_shard reports it
        return None


def verify_hidden_states(hidden_states_dir: str | os.PathLike, expected: dict[int, list[int]],
                         check_digest: bool = True) -> VerificationResult:
    """Verify every shard (shard -> the sample indexes it must hold); record a pass, erase a stale one."""
    root = Path(hidden_states_dir)
    record = root / RECORD_FILE
    discard_temp(record)    # verification in progress or failed: training must not trust an older pass
    # manifests are hashed before the files are checked: a line appended meanwhile changes the digest
    digests = {s: _manifest_digest(root / f"shard_{s:05d}" / "manifest.jsonl") for s in expected}
    reports = [verify_shard(root / f"shard_{s:05d}", s, idx, check_digest=check_digest)
               for s, idx in sorted(expected.items())]
    ok = all(r.ok for r in reports)
    if not ok:
        return VerificationResult(False, reports, None)
    unexpected = sorted(p.name for p in root.glob("shard_*") if p.is_dir()
                        and p.name not in {f"shard_{s:05d}" for s in expected})
    data = {"ok": True, "verified_at": time.time(), "digest_checked": check_digest,
            "samples": sum(r.stored for r in reports), "shards": len(reports),
            "manifests": {f"shard_{s:05d}": digests[s] for s in expected},
            "ignored_dirs": unexpected,
            "newest_mtime_ns": max((r.newest_mtime_ns for r in reports), default=0)}
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(record, json.dumps(data, indent=1))
    return VerificationResult(True, reports, str(record))


@dataclass(frozen=True)
class VerificationRecord:
    shards: list[str]         # shard dir names that passed
    newest_mtime_ns: int      # no verified file was written later than this
    samples: int


def require_verified(hidden_states_dir: str | os.PathLike, verify_hint: str = "`eagleflow capture verify`"
                     ) -> VerificationRecord:
    """The pass record of these hidden states, or NotVerifiedError saying why they cannot be trained on."""
    root = Path(hidden_states_dir)
    record = root / RECORD_FILE
    fix = f"run {verify_hint} on this run and fix what it reports (a shard re-run resumes and repairs)"
    try:
        data = bounded_json.read(record, max_bytes=bounded_json.MAX_ANSWER_BYTES)   # JsonRefused beyond the bounds
    except FileNotFoundError:
        raise NotVerifiedError(f"refusing to train: the hidden states under {root} have not passed verification "
                               f"(no {RECORD_FILE}: never verified, or the last verification failed); {fix}") from None
    except ValueError as e:
        raise NotVerifiedError(f"refusing to train: {record} is not readable JSON ({e}); {fix}") from None
    if not data.get("ok") or not data.get("digest_checked"):
        raise NotVerifiedError(f"refusing to train: {record} does not record a full pass with sha256 checks "
                               f"(ok={data.get('ok')}, digest_checked={data.get('digest_checked')}); {fix}")
    manifests = data.get("manifests") or {}
    for name, digest in sorted(manifests.items()):
        now = _manifest_digest(root / name / "manifest.jsonl")
        if now != digest:
            raise NotVerifiedError(f"refusing to train: {root / name / 'manifest.jsonl'} changed after verification "
                                   f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(data.get('verified_at', 0)))}"
                                   f"; {fix}")
    present = sorted(p.name for p in root.glob("shard_*") if p.is_dir())
    extra = [n for n in present if n not in manifests and n not in data.get("ignored_dirs", [])]
    if extra:
        raise NotVerifiedError(f"refusing to train: shard dir(s) {', '.join(extra)} under {root} appeared after "
                               f"verification; {fix}")
    return VerificationRecord(shards=sorted(manifests), newest_mtime_ns=int(data.get("newest_mtime_ns", 0)),
                              samples=int(data.get("samples", 0)))
