"""eagleflow.durable.atomic_write / atomic_replace: the one atomic write (temp beside, fsync, rename, fsync dir)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest

from eagleflow.durable import DEFAULT_MODE, atomic_replace, atomic_write


def test_replaces_whole_and_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "f.json"
    atomic_write(p, "old")
    atomic_write(p, b"new bytes")
    assert p.read_bytes() == b"new bytes" and sorted(os.listdir(p.parent)) == ["f.json"]
    assert stat.S_IMODE(p.stat().st_mode) == DEFAULT_MODE   # like open(): readable by others, not mkstemp's 0600


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_replace(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_concurrent_writers_never_share_a_temp_file(tmp_path):
    p = tmp_path / "hb.json"
    errors = []

    def write(i):
        try:
            for _ in range(50):
                atomic_write(p, f"writer {i} " * 100)
        except Exception as e:  # a fixed temp name makes a rename fail or mixes two writers' bytes
            errors.append(e)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    text = p.read_text()
    assert text in {f"writer {i} " * 100 for i in range(4)} and os.listdir(tmp_path) == ["hb.json"]


def test_module_writes_stdin_atomically_for_remote_nodes(tmp_path):
    p = tmp_path / "d" / "x.txt"
    subprocess.run([sys.executable, "-m", "eagleflow.durable", str(p)], input=b"from stdin", check=True, timeout=30)
    assert p.read_bytes() == b"from stdin"


def test_a_directory_is_published_whole_or_not_at_all(tmp_path):
    from eagleflow.durable import atomic_dir
    out = tmp_path / "export"
    with atomic_dir(out) as d:
        (d / "model.safetensors").write_bytes(b"v1")
        (d / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as d:
            (d / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("killed mid-export")
    assert (out / "model.safetensors").read_bytes() == b"v1" and os.listdir(tmp_path) == ["export"]
    with atomic_dir(out) as d:
        (d / "model.safetensors").write_bytes(b"v2")
    assert (out / "model.safetensors").read_bytes() == b"v2" and os.listdir(tmp_path) == ["export"]
    assert not (out / "config.json").exists()  # replaced whole, not merged
