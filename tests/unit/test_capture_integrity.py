"""Manifest damage and duplicates found by verify, repaired by a resume's compaction; content checks at resume;
the verification record training requires."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from eagleflow.capture.manifest import (ManifestEntry, ManifestWriter, compact_manifest, completed_indexes,
                                        read_manifest)
from eagleflow.capture.storage import SampleWriter
from eagleflow.capture.verify import (RECORD_FILE, NotVerifiedError, require_verified, verify_hidden_states,
                                      verify_shard)


def _store(writer: SampleWriter, index: int, L: int = 5, H: int = 4):
    g = torch.Generator().manual_seed(index)
    return writer.write(index=index, sample_id=f"s:{index}", input_ids=torch.arange(L),
                        loss_mask=torch.ones(L, dtype=torch.uint8),
                        aux_hidden_states=torch.randn(L, 3 * H, generator=g), hidden_states=torch.randn(L, H, generator=g),
                        aux_layers=[1, 3, 4], model="tiny")


def _shard(d, indexes=(0, 2, 4)) -> list[ManifestEntry]:
    w = SampleWriter(d, fsync=False)
    entries = []
    with ManifestWriter(d / "manifest.jsonl", fsync=False) as m:
        for i in indexes:
            st = _store(w, i)
            e = ManifestEntry(f"s:{i}", i, st.path.name, 5, st.bytes, st.sha256, os.stat(st.path).st_mtime_ns)
            m.append(e)
            entries.append(e)
    return entries


def test_verify_reports_duplicates_damaged_and_cut_off_lines(tmp_path):
    entries = _shard(tmp_path)
    assert verify_shard(tmp_path, 0, [0, 2, 4]).ok
    with open(tmp_path / "manifest.jsonl", "a") as f:
        f.write(entries[0].to_line())                                   # the same index twice
        f.write(ManifestEntry("s:2", 9, "x", 1, 1, "0").to_line())      # one id under two indexes
        f.write("garbage\n")
        f.write('{"id": "s:4", "ind')                                   # cut off mid-append
    rep = verify_shard(tmp_path, 0, [0, 2, 4])
    assert not rep.ok
    assert rep.duplicates == ["index 0", "id s:2"] and rep.bad_lines == [6] and rep.partial_tail
    line = rep.line()
    assert "2 duplicates: index 0, id s:2" in line and "1 damaged manifest line(s): 6" in line
    assert "cut-off line" in line and line.endswith("<- FAILED")


def test_resume_hashes_only_changed_files_and_compaction_leaves_one_clean_line_each(tmp_path):
    entries = _shard(tmp_path)
    check = completed_indexes(tmp_path, read_manifest(tmp_path / "manifest.jsonl"))
    assert check.done == {0, 2, 4} and check.hashed == 0 and not check.broken
    p = tmp_path / entries[1].file
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    time.sleep(0.01)
    p.write_bytes(bytes(raw))                                           # same size, new content
    q = tmp_path / entries[2].file
    q.write_bytes(q.read_bytes())                                       # rewritten, same content
    with open(tmp_path / "manifest.jsonl", "a") as f:
        f.write(entries[0].to_line() + "junk\n")
    scan = read_manifest(tmp_path / "manifest.jsonl")
    check = completed_indexes(tmp_path, scan)
    assert check.done == {0, 4} and check.hashed == 2
    assert [(e.index, why.split(" (")[0]) for e, why in check.broken] == [(2, "sha256 differs from the manifest")]
    assert check.refreshed[4].mtime_ns == os.stat(q).st_mtime_ns       # stamped again: the next resume won't hash it
    compact_manifest(tmp_path / "manifest.jsonl", [check.refreshed.get(i, scan.entries[i]) for i in sorted(check.done)])
    again = read_manifest(tmp_path / "manifest.jsonl")
    assert again.clean and sorted(again.entries) == [0, 4]
    assert len((tmp_path / "manifest.jsonl").read_text().splitlines()) == 2
    assert completed_indexes(tmp_path, again).hashed == 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_lines_without_a_stamp_are_hashed(tmp_path):
    entries = _shard(tmp_path)
    (tmp_path / "manifest.jsonl").write_text("".join(
        ManifestEntry(e.id, e.index, e.file, e.tokens, e.bytes, e.sha256).to_line() for e in entries))
    check = completed_indexes(tmp_path, read_manifest(tmp_path / "manifest.jsonl"))
    assert check.done == {0, 2, 4} and check.hashed == 3 and len(check.refreshed) == 3


def test_verification_record_is_what_training_requires(tmp_path):
    for s in (0, 1):
        _shard(tmp_path / f"shard_{s:05d}", indexes=range(s, 6, 2))
    with pytest.raises(NotVerifiedError, match="have not passed verification"):
        require_verified(tmp_path)
    res = verify_hidden_states(tmp_path, {0: [0, 2, 4], 1: [1, 3, 5]})
    assert res.ok and res.summary() == "OK: 6/6 samples verified in 2 shard(s)"
    rec = require_verified(tmp_path)
    assert rec.shards == ["shard_00000", "shard_00001"] and rec.samples == 6
    with open(tmp_path / "shard_00001" / "manifest.jsonl", "a") as f:
        f.write("junk\n")
    with pytest.raises(NotVerifiedError, match="shard_00001/manifest.jsonl changed after verification"):
        require_verified(tmp_path)
    failed = verify_hidden_states(tmp_path, {0: [0, 2, 4], 1: [1, 3, 5, 7]})
    assert not failed.ok and not (tmp_path / RECORD_FILE).exists()
    assert failed.summary().startswith("FAILED: 6/7 samples verified; 1 not; failed shard(s) 1: shard 1: 3/4 stored")
    assert json.loads(json.dumps(failed.to_json()))["ok"] is False
    no_digest = verify_hidden_states(tmp_path, {0: [0, 2, 4]}, check_digest=False)
    assert no_digest.ok
    with pytest.raises(NotVerifiedError, match="digest_checked=False"):
        require_verified(tmp_path)


def test_a_shard_dir_that_cannot_be_read_fails_verification_by_name(tmp_path):
    _shard(tmp_path / "shard_00000", indexes=[0, 2])
    (tmp_path / "shard_00001").write_text("a file where the shard's directory should be\n")
    res = verify_hidden_states(tmp_path, {0: [0, 2], 1: [1, 3]})
    assert not res.ok and not (tmp_path / RECORD_FILE).exists()
    assert "failed shard(s) 1: shard 1: 0/2 stored; 2 missing: 1, 3" in res.summary()
    assert "shard_00001/manifest.jsonl cannot be read (Not a directory)" in res.summary()
