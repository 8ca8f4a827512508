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


def test_appended_says_what_only_extends_and_none_when_a_line_was_replaced(tmp_path):
    """What the source's scan extends its list by (``appended``): the new indexes in order, else None (rebuild)."""
    path = tmp_path / "manifest.jsonl"
    tail = ManifestTail(path)
    with open(path, "ab") as f:
        f.write(entry(1).to_line().encode() + entry(0).to_line().encode())
    assert tail.update() and [e.index for e in tail.appended] == [0, 1]
    assert not tail.update() and tail.appended == []
    with open(path, "ab") as f:
        f.write(entry(2).to_line().encode())
    assert tail.update() and [e.index for e in tail.appended] == [2]
    with open(path, "ab") as f:                                      # a redone index: its old line replaced
        f.write(entry(1, tokens=77).to_line().encode() + entry(3).to_line().encode())
    assert tail.update() and tail.appended is None
    compact_manifest(path, [entry(0, "s2")], fsync=False)           # read whole again
    assert tail.update() and tail.appended is None and sorted(tail.entries) == [0]
    os.unlink(path)
    assert tail.update() and tail.appended is None


def test_the_sources_scan_extends_its_last_list_and_rebuilds_on_a_replaced_line(tmp_path):
    """MooncakeSource.scan while capture appends returns the refs it returned before (the same objects) and the new
    ones after them: the loader reads only that tail. A redone line or a new incarnation rebuilds the list, the
    last line of an index winning, only the incarnation's lines."""
    from eagleflow.stores import StoreSettings
    from eagleflow.stores.mooncake.master import MooncakeEndpoint
    from eagleflow.stores.mooncake.store import MooncakeSource

    class NoClient:          # scan never asks the store: the manifests say what was put
        label = "test store"

        def close(self) -> None:
            pass
    root = tmp_path / "hs"
    for s in (0, 1):
        (root / f"shard_{s:05d}").mkdir(parents=True)
    ep_file = tmp_path / "endpoint.json"
    ep_file.write_text(MooncakeEndpoint("127.0.0.1", 1, 2, 3, 1 << 20, store_id="s1").to_json())
    src = MooncakeSource(StoreSettings(run_id="r", root=str(root), fsync=False, buffer_bytes=1 << 30,
                                       endpoint_file=str(ep_file)), client=NoClient())   # type: ignore[arg-type]

    def append(shard: int, *entries: ManifestEntry) -> None:
        with open(root / f"shard_{shard:05d}" / "manifest.jsonl", "ab") as f:
            f.write(b"".join(e.to_line().encode() for e in entries))
    append(0, entry(0), entry(1))
    first = src.scan()
    assert [(r.shard, r.index) for r in first] == [(0, 0), (0, 1)]
    append(1, entry(10))
    append(0, entry(2), entry(3, store_id="old"))                    # another incarnation's line: never a ref
    second = src.scan()
    assert second[:2] == first and all(a is b for a, b in zip(second, first))
    assert sorted((r.shard, r.index) for r in second[2:]) == [(0, 2), (1, 10)]
    append(0, entry(1, tokens=77))                                   # redone: the list is rebuilt
    third = src.scan()
    assert [(r.shard, r.index) for r in third] == [(0, 0), (0, 1), (0, 2), (1, 10)]
    assert third[1].tokens == 77 and third[0] is not first[0]
    src.ep = MooncakeEndpoint("127.0.0.1", 1, 2, 3, 1 << 20, store_id="old")   # a new incarnation: its lines only
    assert [(r.shard, r.index) for r in src.scan()] == [(0, 3)]
