"""copy_dir between two LocalNodes (two folders): full copy, kept files, repair, resume, manifest last."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagleflow.fleet.transfer import PARTIAL, TransferError, copy_dir
from eagleflow.nodes.base import NodeError, NodeUnreachable
from eagleflow.nodes.local import LocalNode

CHUNK = 1024


def make_shard(d, big: int = 5 * CHUNK + 17):
    d.mkdir(parents=True)
    (d / "s0.safetensors").write_bytes(os.urandom(big))
    (d / "s1.safetensors").write_bytes(os.urandom(300))
    (d / "empty.bin").write_bytes(b"")
    (d / "manifest.jsonl").write_text('{"id": "s0"}\n{"id": "s1"}\n')
    (d / "heartbeat.json").write_text('{"t": 1}')
    (d / "sub").mkdir()
    (d / "sub" / "nested.txt").write_text("not copied")
    return d


def same_files(a, b, names):
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


COPIED = ["s0.safetensors", "s1.safetensors", "empty.bin", "manifest.jsonl"]


class _BreakingReader:
    """A source file that fails like a dropped link on its ``after``-th read."""

    def __init__(self, f, after: int):
        self._f, self._left = f, after

    def read(self, n=-1):
        self._left -= 1
        if self._left < 0:
            raise NodeUnreachable("on node flaky: link dropped (test)")
        return self._f.read(n)

    def seek(self, *a):
        return self._f.seek(*a)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class FlakyNode(LocalNode):
    """Breaks the reads of one file once; records renames (their order)."""

    def __init__(self, break_name: str | None = None, after: int = 2):
        super().__init__("flaky")
        self.break_name, self.after, self.renames = break_name, after, []

    def open_file(self, path, mode):
        f = super().open_file(path, mode)
        if self.break_name and path.endswith("/" + self.break_name) and mode == "rb":
            self.break_name = None
            return _BreakingReader(f, self.after)
        return f

    def rename(self, src, dst):
        self.renames.append(os.path.basename(dst))
        super().rename(src, dst)


def test_full_copy_then_nothing_to_do(tmp_path):
    src = make_shard(tmp_path / "a" / "shard_00000")
    dst = tmp_path / "b" / "shard_00000"
    logs = []
    rep = copy_dir(LocalNode("n2"), str(src), LocalNode("n1"), str(dst), chunk_bytes=CHUNK, log=logs.append)
    assert rep.files_copied == 4 and rep.files_kept == 0 and rep.bytes_resumed == 0
    assert rep.bytes_copied == sum((src / n).stat().st_size for n in COPIED)
    assert same_files(src, dst, COPIED)
    assert not (dst / "heartbeat.json").exists() and not (dst / "sub").exists()
    assert os.listdir(dst / PARTIAL) == []
    again = copy_dir(LocalNode("n2"), str(src), LocalNode("n1"), str(dst), chunk_bytes=CHUNK)
    assert (again.files_copied, again.files_kept, again.bytes_copied) == (0, 4, 0)
    assert any("copy n2:" in m for m in logs)


def test_a_corrupted_destination_file_is_copied_again_and_extra_files_stay(tmp_path):
    src = make_shard(tmp_path / "a")
    dst = tmp_path / "b"
    copy_dir(LocalNode(), str(src), LocalNode(), str(dst))
    data = bytearray((dst / "s0.safetensors").read_bytes())
    data[100] ^= 0xFF
    (dst / "s0.safetensors").write_bytes(bytes(data))
    (dst / "only-here.txt").write_text("mine")
    logs = []
    rep = copy_dir(LocalNode(), str(src), LocalNode(), str(dst), log=logs.append)
    assert (rep.files_copied, rep.files_kept) == (1, 3)
    assert same_files(src, dst, COPIED)
    assert (dst / "only-here.txt").read_text() == "mine"
    assert any("only-here.txt" in m and "not in the source" in m for m in logs)


def test_an_interrupted_copy_resumes_from_its_partial(tmp_path):
    src = make_shard(tmp_path / "a")
    dst = tmp_path / "b"
    flaky = FlakyNode("s0.safetensors", after=2)
    with pytest.raises(NodeUnreachable, match="link dropped"):
        copy_dir(flaky, str(src), LocalNode(), str(dst), chunk_bytes=CHUNK)
    assert (dst / PARTIAL / "s0.safetensors").stat().st_size == 2 * CHUNK   # two chunks arrived
    assert not (dst / "manifest.jsonl").exists() and not (dst / "s0.safetensors").exists()
    rep = copy_dir(flaky, str(src), LocalNode(), str(dst), chunk_bytes=CHUNK)
    assert rep.bytes_resumed == 2 * CHUNK
    assert rep.bytes_copied == sum((src / n).stat().st_size for n in COPIED) - 2 * CHUNK
    assert same_files(src, dst, COPIED)


def test_a_wrong_partial_is_copied_again_whole(tmp_path):
    src = make_shard(tmp_path / "a")
    dst = tmp_path / "b"
    (dst / PARTIAL).mkdir(parents=True)
    (dst / PARTIAL / "s0.safetensors").write_bytes(b"x" * CHUNK)     # shorter, but not a prefix of the source
    (dst / PARTIAL / "s1.safetensors").write_bytes(b"y" * 1000)      # longer than the source: starts over
    logs = []
    rep = copy_dir(LocalNode(), str(src), LocalNode(), str(dst), chunk_bytes=CHUNK, log=logs.append)
    assert rep.files_copied == 4 and rep.bytes_resumed == 0
    assert same_files(src, dst, COPIED)
    assert any("copying them again whole" in m and "s0.safetensors" in m for m in logs)


def test_the_manifest_is_renamed_into_place_last(tmp_path):
    src = make_shard(tmp_path / "a")
    dst_node = FlakyNode()
    copy_dir(LocalNode(), str(src), dst_node, str(tmp_path / "b"))
    assert dst_node.renames[-1] == "manifest.jsonl"
    assert sorted(dst_node.renames) == sorted(COPIED)


class ChangingSource(LocalNode):
    """The source file is rewritten between the digest and the copy (a writer still running)."""

    def open_file(self, path, mode):
        if mode == "rb" and path.endswith("s1.safetensors"):
            with open(path, "wb") as f:
                f.write(b"rewritten")
        return super().open_file(path, mode)


def test_a_source_that_changes_during_the_copy_fails_and_nothing_wrong_is_put_in_place(tmp_path):
    src = make_shard(tmp_path / "a")
    dst = tmp_path / "b"
    with pytest.raises(TransferError) as e:
        copy_dir(ChangingSource("n2"), str(src), LocalNode("n1"), str(dst))
    msg = str(e.value)
    assert "s1.safetensors" in msg and "n2:" in msg and "n1:" in msg and "Re-run the task" in msg
    assert "changed while it was copied" in msg and "sha256" in msg
    assert not (dst / "s1.safetensors").exists() and not (dst / "manifest.jsonl").exists()
    assert isinstance(e.value, NodeError)


def test_many_names_are_digested_as_the_whole_folder(tmp_path, monkeypatch):
    from eagleflow.fleet import transfer
    src = make_shard(tmp_path / "a")
    node, seen = LocalNode(), []
    real = node.run_json
    monkeypatch.setattr(node, "run_json", lambda argv, *a, **kw: seen.append(argv) or real(argv, *a, **kw))
    monkeypatch.setattr(transfer, "MAX_NAMES_CHARS", 20)
    assert sorted(transfer.digest(node, str(src), ["s1.safetensors", "empty.bin"])) == ["empty.bin", "s1.safetensors"]
    assert seen[-1][-1] == str(src)     # no names on the command line
    assert list(transfer.digest(node, str(src), ["empty.bin"])) == ["empty.bin"]
    assert seen[-1][-1] == "empty.bin"


def test_digest_cli(tmp_path):
    def run(*args):
        out = subprocess.run([sys.executable, "-m", "eagleflow.fleet.digest", *args], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        return json.loads(out.strip().splitlines()[-1])

    assert run(str(tmp_path / "missing")) == {"files": {}}
    src = make_shard(tmp_path / "a")
    (src / PARTIAL).mkdir()
    (src / PARTIAL / "x").write_text("partial")
    files = run(str(src))["files"]
    assert sorted(files) == sorted(COPIED + ["heartbeat.json"])
    import hashlib
    assert files["s1.safetensors"] == {"size": 300,
                                       "sha256": hashlib.sha256((src / "s1.safetensors").read_bytes()).hexdigest()}
    assert sorted(run(str(src), "manifest.jsonl", "nope")["files"]) == ["manifest.jsonl"]


def test_local_file_errors_name_node_and_path(tmp_path):
    node = LocalNode("n9")
    with pytest.raises(NodeError, match=f"on node n9: cannot open {tmp_path}/nope"):
        node.open_file(str(tmp_path / "nope"), "rb")
    with pytest.raises(ValueError, match="mode must be one of"):
        node.open_file(str(tmp_path / "x"), "r+")
    node.makedirs(str(tmp_path / "p" / "q"))
    node.makedirs(str(tmp_path / "p" / "q"))
    with pytest.raises(NodeError, match="cannot rename"):
        node.rename(str(tmp_path / "nope"), str(tmp_path / "p" / "x"))
