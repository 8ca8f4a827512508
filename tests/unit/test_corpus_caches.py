"""Old cache deletion: only when enabled, only inside the real cache root, logged with bytes freed."""
from __future__ import annotations

import os

import pytest

from eagleflow.config import load_config
from eagleflow.corpus.caches import CacheDeletionRefused, delete_old_caches


def _cfg(tmp_path, old, enabled=True, root="root"):
    return load_config(data={"target_model": "m", "run_root": str(tmp_path / "runs"),
                             "disk": {"cache_root": str(tmp_path / root) if root else None, "old_caches": old,
                                      "delete_old_caches": enabled}})


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "old1" / "sub").mkdir(parents=True)
    (root / "old1" / "sub" / "a.bin").write_bytes(b"x" * 50_000)
    (root / "old2.bin").write_bytes(b"y" * 10_000)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"k" * 1000)
    # a link inside a cache that points outside: deleting the cache must not follow it
    os.symlink(outside, root / "old1" / "link_out")
    return root, outside


def test_deletes_listed_caches_and_logs_bytes(tmp_path, tree):
    root, outside = tree
    logs: list[str] = []
    res = delete_old_caches(_cfg(tmp_path, [str(root / "old1"), str(root / "old2.bin"), str(root / "never")]),
                            log=logs.append)
    assert not (root / "old1").exists() and not (root / "old2.bin").exists()
    assert (outside / "keep.bin").read_bytes() == b"k" * 1000
    assert res.deleted[str(root / "old1")] >= 50_000 and res.deleted[str(root / "old2.bin")] >= 10_000
    assert res.missing == [str(root / "never")]
    assert any(f"deleted {root / 'old1'} ({res.deleted[str(root / 'old1')]} bytes freed)" in x for x in logs)
    assert logs[-1] == f"delete-caches: 2 cache(s) deleted, {res.freed_bytes} bytes freed"


def test_off_by_default_deletes_nothing(tmp_path, tree):
    root, _ = tree
    logs: list[str] = []
    res = delete_old_caches(_cfg(tmp_path, [str(root / "old1")], enabled=False), log=logs.append)
    assert (root / "old1" / "sub" / "a.bin").exists()
    assert res.deleted == {} and res.would_delete[str(root / "old1")] >= 50_000
    assert "is off" in logs[-1] and "nothing deleted" in logs[-1]


@pytest.mark.parametrize("make_path", [
    lambda tmp, root, out: str(out),                          # plainly outside
    lambda tmp, root, out: str(root / ".." / "precious"),     # .. escaping
    lambda tmp, root, out: str(root),                         # the root itself
])
def test_refuses_paths_outside_the_root(tmp_path, tree, make_path):
    root, outside = tree
    path = make_path(tmp_path, root, outside)
    with pytest.raises(CacheDeletionRefused, match="not inside disk.cache_root"):
        delete_old_caches(_cfg(tmp_path, [str(root / "old2.bin"), path]))
    assert (outside / "keep.bin").exists() and (root / "old2.bin").exists()  # nothing deleted at all


def test_refuses_a_symlink_escaping_the_root(tmp_path, tree):
    root, outside = tree
    os.symlink(outside, root / "looks_inside")
    with pytest.raises(CacheDeletionRefused, match=f"really {outside}"):
        delete_old_caches(_cfg(tmp_path, [str(root / "looks_inside")]))
    assert (outside / "keep.bin").exists()


def test_refuses_without_a_cache_root(tmp_path, tree):
    root, _ = tree
    with pytest.raises(CacheDeletionRefused, match="disk.cache_root is not set"):
        delete_old_caches(_cfg(tmp_path, [str(root / "old1")], root=None))
    assert (root / "old1").exists()


def test_root_given_through_a_symlink_is_resolved(tmp_path, tree):
    root, _ = tree
    os.symlink(root, tmp_path / "root_link")
    res = delete_old_caches(_cfg(tmp_path, [str(root / "old2.bin")], root="root_link"))
    assert list(res.deleted) == [str(root / "old2.bin")] and not (root / "old2.bin").exists()
