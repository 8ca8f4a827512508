"""Files eagleflow appends to (a shard's manifest, training metrics) are opened through durable.open_owned:
a link planted at the name is refused, so an append can never land in another file of the user's."""
from __future__ import annotations

import json
import os

import pytest

from eagleflow.capture.manifest import ManifestEntry, ManifestWriter, read_manifest
from eagleflow.durable import UnsafeFile
from eagleflow.train.curves import append_metrics, read_metrics


def _entry(i: int) -> ManifestEntry:
    return ManifestEntry(id=f"s:{i}", index=i, file=f"{i:08d}.safetensors", tokens=5, bytes=9, sha256="0" * 64)


def test_a_manifest_link_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA...\n")
    link = tmp_path / "shard" / "manifest.jsonl"
    link.parent.mkdir()
    link.symlink_to(victim)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        ManifestWriter(link)
    assert victim.read_text() == "ssh-ed25519 AAAA...\n"


def test_a_manifest_appends_seals_a_partial_tail_and_narrows_a_wide_mode(tmp_path):
    path = tmp_path / "manifest.jsonl"
    path.write_text(_entry(0).to_line() + '{"id": "s:1", "ind')   # a crash mid-append
    os.chmod(path, 0o666)
    with ManifestWriter(path, fsync=False) as m:
        m.append(_entry(2))
    assert os.stat(path).st_mode & 0o022 == 0
    lines = path.read_text().splitlines()
    assert lines[0] == _entry(0).to_line().strip() and lines[1] == '{"id": "s:1", "ind'
    assert json.loads(lines[2])["id"] == "s:2"
    assert sorted(read_manifest(path).entries) == [0, 2]


def test_a_metrics_link_is_refused_and_metrics_append(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("mine\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UnsafeFile):
        append_metrics(link, {"step": 1, "loss": 2.0})
    assert victim.read_text() == "mine\n"
    link.unlink()
    append_metrics(link, {"step": 1, "loss": 2.0})
    append_metrics(link, {"step": 2, "loss": 1.5})
    assert [r["step"] for r in read_metrics(link)] == [1, 2]
