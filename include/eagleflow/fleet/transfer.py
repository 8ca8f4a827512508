"""Copy a folder's files from one node to another through this process: streamed, resumable, verified.

Without shared storage a shard's files go from the node that extracted them to the training node and the
corpus the other way. The Airflow worker relays: it reads from one ``Node`` and writes to the other in
``chunk_bytes`` pieces (``Node.open_file``; over SSH that is SFTP), never holding a whole file.

Each file whose destination digest differs from the source's is written to ``DST/.partial/NAME``; a partial
left by an interrupted copy that is shorter than the source is continued from its size (the resume). The
partials are then digested on the destination node and only those equal to the source (size and SHA-256)
are renamed into place, so a file under its own name at the destination is always a verified copy. Files
in ``last`` (the manifest) move after all others: a manifest appears only once the files it lists are there.
Files at the destination that the source lacks are left alone (and logged); ``skip`` names are not copied.

Both nodes' digests are untrusted answers: every name in them is one plain path component, checked when the
answer is read, before any file is opened or created under ``.partial/`` (``eagleflow.protocol``).
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Callable

from eagleflow.nodes.base import Node, NodeError
from eagleflow.protocol import DigestAnswer

PARTIAL = ".partial"
DIGEST_TIMEOUT_S = 3600.0   # the digest reads every file once: a shard of many GB takes minutes
MAX_NAMES_CHARS = 32 << 10


class TransferError(NodeError):
    """A copied file does not equal its source at the destination; the message says which and what to do."""


@dataclass(frozen=True)
class TransferReport:
    files_copied: int
    files_kept: int       # already identical at the destination
    bytes_copied: int     # sent this call
    bytes_resumed: int    # already in partials from an earlier call, not sent again


def digest(node: Node, path: str, names: list[str] | None = None, *,
           timeout: float | None = DIGEST_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """``eagleflow.fleet.digest`` run on node: name -> {"size", "sha256"} of the files directly in path
    (with names: only those).

    The answer is untrusted (``DigestAnswer``): a name that is not one plain path component, a size that is
    no non-negative integer or a digest that is no SHA-256 hex refuses the whole answer (NodeAnswerError
    naming the node, the field and the value) before the caller opens any file under those names."""
    # over SSH the whole command is one shell argument (at most 128 KiB): many names, digest the folder
    listed = names if names and sum(len(n) + 3 for n in names) < MAX_NAMES_CHARS else None
    ans = node.run_json([node.python, "-m", "eagleflow.fleet.digest", path, *(listed or [])], DigestAnswer,
                        timeout=timeout)
    files = {k: v.model_dump() for k, v in ans.files.items()}
    if names:   # only what was asked: a name the node adds is not ours to copy or compare
        wanted = set(names)
        files = {k: v for k, v in files.items() if k in wanted}
    return files


def _stream(inp, out, chunk_bytes: int) -> int:
    n = 0
    while chunk := inp.read(chunk_bytes):
        out.write(chunk)
        n += len(chunk)
    return n


def _copy_one(src: Node, src_path: str, dst: Node, part: str, size: int, chunk_bytes: int,
              resume: bool) -> tuple[int, int]:
    """src_path into part on dst; (bytes sent, bytes resumed). With resume a shorter partial is continued."""
    if resume:
        with dst.open_file(part, "ab") as out:
            out.seek(0, 2)
            have = out.tell()
            if have == size:   # complete but not renamed: the digest decides
                return 0, have
            if have < size:
                with src.open_file(src_path, "rb") as inp:
                    inp.seek(have)
                    return _stream(inp, out, chunk_bytes), have
    # no partial, or one longer than the source (it is not a prefix of it): start over
    with dst.open_file(part, "wb") as out, src.open_file(src_path, "rb") as inp:
        return _stream(inp, out, chunk_bytes), 0


def copy_dir(src: Node, src_dir: str, dst: Node, dst_dir: str, *, last=("manifest.jsonl",),
             skip=("heartbeat.json",), chunk_bytes: int = 4 << 20, log: Callable[[str], None] | None = None,
             digest_timeout_s: float | None = DIGEST_TIMEOUT_S) -> TransferReport:
    """Copy the files directly in src_dir on src to dst_dir on dst (see the module docstring)."""
    say = log or (lambda _msg: None)
    where = f"{src.name}:{src_dir} -> {dst.name}:{dst_dir}"
    src_d = digest(src, src_dir, timeout=digest_timeout_s)
    dst_d = digest(dst, dst_dir, timeout=digest_timeout_s)
    if not src_d:
        say(f"copy {where}: the source has no files (missing folder?); nothing copied")
    extra = sorted(set(dst_d) - set(src_d))
    if extra:
        say(f"copy {where}: {len(extra)} file(s) at the destination are not in the source, left as they are: "
            f"{extra[:20]}")
    names = [n for n in sorted(src_d) if n not in skip]
    kept = [n for n in names if dst_d.get(n) == src_d[n]]
    todo = [n for n in names if n not in kept]
    later = [n for n in last if n in todo]
    phases = [[n for n in todo if n not in later], later]
    part_dir = posixpath.join(dst_dir, PARTIAL)
    if todo:
        dst.makedirs(part_dir)
    copied = sent = resumed = 0
    for phase in phases:
        if not phase:
            continue
        resumed_from: dict[str, int] = {}
        for name in phase:
            n, had = _copy_one(src, posixpath.join(src_dir, name), dst, posixpath.join(part_dir, name),
                               src_d[name]["size"], chunk_bytes, resume=True)
            sent += n
            resumed += had
            if had:
                resumed_from[name] = had
        check = digest(dst, part_dir, phase, timeout=digest_timeout_s)
        bad = [n for n in phase if check.get(n) != src_d[n]]
        redo = [n for n in bad if n in resumed_from]
        if redo:   # a resumed partial may have begun as another version of the file: once more, from scratch
            say(f"copy {where}: resumed partial(s) {redo} differ from the source; copying them again whole")
            for name in redo:
                n, _ = _copy_one(src, posixpath.join(src_dir, name), dst, posixpath.join(part_dir, name),
                                 src_d[name]["size"], chunk_bytes, resume=False)
                sent += n
                resumed -= resumed_from[name]   # those bytes were thrown away
            check.update(digest(dst, part_dir, redo, timeout=digest_timeout_s))
            bad = [n for n in phase if check.get(n) != src_d[n]]
        if bad:
            raise _mismatch(src, src_dir, dst, dst_dir, bad, src_d, check, digest_timeout_s)
        for name in phase:
            dst.rename(posixpath.join(part_dir, name), posixpath.join(dst_dir, name))
        copied += len(phase)
    report = TransferReport(files_copied=copied, files_kept=len(kept), bytes_copied=sent, bytes_resumed=resumed)
    say(f"copy {where}: {report}")
    return report


def _mismatch(src: Node, src_dir: str, dst: Node, dst_dir: str, bad: list[str], src_d: dict, got: dict,
              timeout: float | None) -> TransferError:
    """The error for copies that differ from the source: which, both digests, and whether the source moved."""
    try:
        now = digest(src, src_dir, bad, timeout=timeout)
    except NodeError as e:
        now, moved = {}, f" (the source could not be digested again: {e})"
    else:
        changed = [n for n in bad if now.get(n) != src_d[n]]
        moved = (f"; the source of {changed} changed while it was copied (does a writer still run in "
                 f"{src_dir}? let it finish first)" if changed else "")
    lines = [f"  - {n}: source {src.name}:{posixpath.join(src_dir, n)} {src_d[n]}, copy "
             f"{dst.name}:{posixpath.join(dst_dir, PARTIAL, n)} {got.get(n, 'missing')}" for n in bad]
    return TransferError(f"copying {src.name}:{src_dir} to {dst.name}:{dst_dir}: {len(bad)} file(s) differ from "
                         f"the source after the copy{moved}; nothing of them was put in place:\n" + "\n".join(lines)
                         + "\nRe-run the task: the copy resumes, and files already identical are kept")
