"""The Mooncake source's incremental manifest read (``ManifestTail``, issue 53): at every step the same entries as
``read_manifest`` of the whole file, through appends, a partial tail, a sealed cut-off line, a repeated index, and
a manifest rewritten (``compact_manifest``, atomically: another inode) or rewritten in place."""
from __future__ import annotations

import os

from eagleflow.capture.manifest import ManifestEntry, compact_manifest, read_manifest
from eagleflow.stores.mooncake.store import ManifestTail


def entry(i: int, store_id: str = "s1", tokens: int = 10) -> ManifestEntry:
    return ManifestEntry(id=f"x:{i}", index=i, file=f"key{i}", tokens=tokens, bytes=100 + i, sha256="ab" * 32,
                         store_id=store_id)


def same(tail: ManifestTail, path) -> None:
    tail.update()
    assert tail.entries == read_manifest(path).entries


def test_tail_follows_appends_partial_lines_and_rewrites(tmp_path):
    path = tmp_path / "manifest.jsonl"
    tail = ManifestTail(path)
    assert tail.update() is False and tail.entries == {}           # no manifest yet
    with open(path, "ab") as f:
        f.write(entry(0).to_line().encode() + entry(1).to_line().encode())
    same(tail, path)
    assert sorted(tail.entries) == [0, 1]
    assert tail.update() is False                                   # nothing appended: nothing changed
    line = entry(2).to_line().encode()
    with open(path, "ab") as f:
        f.write(line[:15])                                          # a line being appended: not read yet
    same(tail, path)
    assert 2 not in tail.entries
    with open(path, "ab") as f:
        f.write(line[15:])
    same(tail, path)
    assert 2 in tail.entries
    with open(path, "ab") as f:                                      # a cut-off line sealed, then more lines
        f.write(b'{"id": "x:3", "ind\n' + entry(3).to_line().encode() + entry(1, tokens=77).to_line().encode())
    same(tail, path)
    assert tail.entries[1].tokens == 77                             # a repeated index: the last line wins
    # a resume rewrites the manifest whole, without lines lost with a store (atomically: another file)
    compact_manifest(path, [entry(0, "s2"), entry(3)], fsync=False)
    same(tail, path)
    assert sorted(tail.entries) == [0, 3] and tail.entries[0].store_id == "s2"
    with open(path, "ab") as f:
        f.write(entry(4).to_line().encode())
    same(tail, path)
    # rewritten in place, as long as before or longer (same inode): its last line read is not where it was
    with open(path, "r+b") as f:
        data = b"".join(entry(i, "s3").to_line().encode() for i in (5, 6, 7, 8))
        f.write(data)
        f.truncate(len(data))
    same(tail, path)
    assert sorted(tail.entries) == [5, 6, 7, 8]
    os.unlink(path)
    assert tail.update() is True and tail.entries == {}
