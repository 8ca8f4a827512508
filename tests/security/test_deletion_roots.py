"""disk.cache_root by identity (issue 38, item 3): `/` spelled `//`, `/proc/self/root`, `/proc/1/root` or a link,
a home folder spelled `//home`, and a link to a folder above run_root are refused when the config is loaded and
when `eagleflow corpus delete-caches` runs, and a root swapped for a link to `/` after the load is refused at
deletion time.

Safety of this file: every path listed in disk.old_caches lies in tmp_path (the "victim"), so even a broken
check can delete nothing but a test file; the bad roots are only ever roots, never deletion targets.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def _victim(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "blob.bin").write_bytes(b"k" * 4096)
    return folder


def _delete_caches(tmp_path: Path, cache_root: str, old_caches: list[str], run_root: Path, home: Path):
    """The real CLI on a frozen run config, as the node runs it; HOME is the test's own home folder."""
    frozen = tmp_path / "run-config.json"
    frozen.write_text(json.dumps({"target_model": "/m", "run_root": str(run_root), "disk": {
        "cache_root": cache_root, "old_caches": old_caches, "delete_old_caches": True}}))
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", "corpus", "delete-caches", "--config", str(frozen),
                           "--run-id", "r"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(home)})


@pytest.fixture
def place(tmp_path, monkeypatch):
    """run_root, a home folder of this test ($HOME), and links to `/`, to the home and to the runs' parent."""
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    run_root = tmp_path / "data" / "runs"
    run_root.mkdir(parents=True)
    os.symlink("/", tmp_path / "slash")
    os.symlink(home, tmp_path / "home_link")
    os.symlink(tmp_path / "data", tmp_path / "data_link")
    monkeypatch.setenv("HOME", str(home))
    return {"home": home, "run_root": run_root, "tmp": tmp_path}


# (cache_root as written, the old cache as listed (a victim in tmp_path reachable under that root), why)
CASES = {
    "double slash": ("//", lambda p: str(_victim(p["tmp"] / "victim")), "file system's root"),
    "proc self root": ("/proc/self/root", lambda p: str(_victim(p["tmp"] / "victim")), "file system's root"),
    "link to slash": ("{tmp}/slash", lambda p: str(_victim(p["tmp"] / "victim")), "file system's root"),
    "home as //home": ("/{home}", lambda p: str(_victim(p["home"] / "old")), "home folder"),
    "link to a home": ("{tmp}/home_link", lambda p: str(_victim(p["home"] / "old")), "home folder"),
    "link above the runs": ("{tmp}/data_link", lambda p: str(_victim(p["run_root"] / "keep")), "above run_root"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_root_that_is_slash_a_home_or_above_the_runs_by_identity_is_refused(case, place):
    from eagleflow.config import ConfigError, load_config
    spelled, victim_of, why = CASES[case]
    cache_root = spelled.format(tmp=place["tmp"], home=place["home"])
    victim = victim_of(place)
    cfg = place["tmp"] / "c.yaml"
    cfg.write_text(yaml.safe_dump({"target_model": "/m", "run_root": str(place["run_root"]),
                                   "disk": {"cache_root": cache_root, "old_caches": [victim]}}))
    with pytest.raises(ConfigError, match=why) as e:
        load_config(cfg)
    assert f"disk.cache_root = {cache_root!r}" in str(e.value) and str(cfg) in str(e.value)
    assert "hidden-state caches" in str(e.value)     # what to do
    res = _delete_caches(place["tmp"], cache_root, [victim], place["run_root"], place["home"])
    assert res.returncode != 0 and "disk.cache_root" in res.stderr and why in res.stderr, res.stderr[-2000:]
    assert (Path(victim) / "blob.bin").exists(), "a cache under a refused root was deleted"


def test_proc_1_root_is_refused_whether_or_not_it_can_be_read(place):
    """Another process's root: `/` when readable, "cannot be resolved" when not; never a deletion root."""
    from eagleflow.config import ConfigError, load_config
    victim = str(_victim(place["tmp"] / "victim"))
    with pytest.raises(ConfigError, match="file system's root|cannot be resolved") as e:
        load_config(data={"target_model": "/m", "run_root": str(place["run_root"]),
                          "disk": {"cache_root": "/proc/1/root", "old_caches": [victim]}})
    assert "disk.cache_root = '/proc/1/root'" in str(e.value)
    res = _delete_caches(place["tmp"], "/proc/1/root", [victim], place["run_root"], place["home"])
    assert res.returncode != 0 and "disk.cache_root" in res.stderr, res.stderr[-2000:]
    assert (Path(victim) / "blob.bin").exists()


def test_a_root_swapped_for_a_link_to_slash_after_the_load_is_refused_at_deletion(place):
    from eagleflow.config import load_config
    from eagleflow.corpus.caches import CacheDeletionRefused, delete_old_caches
    later = place["tmp"] / "later"
    victim = _victim(place["tmp"] / "victim")
    cfg = load_config(data={"target_model": "/m", "run_root": str(place["run_root"]), "disk": {
        "cache_root": str(later), "old_caches": [f"{later}{victim}"], "delete_old_caches": True}})
    os.symlink("/", later)      # after validation: the root now resolves to /
    with pytest.raises(CacheDeletionRefused, match=r"disk.cache_root = .*later'.*file system's root"):
        delete_old_caches(cfg, log=lambda m: None)
    assert (victim / "blob.bin").exists()


def test_an_old_cache_that_is_a_home_or_the_run_root_is_refused(place):
    """cache_root may be run_root itself (the shipped configs), but then run_root and homes are still never
    deleted: a listed cache that is a link to them is refused by name."""
    from eagleflow.config import load_config
    from eagleflow.corpus.caches import CacheDeletionRefused, delete_old_caches
    caches = place["tmp"] / "caches"
    caches.mkdir()
    os.symlink(place["run_root"], caches / "runs_link")
    (place["run_root"] / "r0").mkdir()
    for listed, why in ((str(caches / "runs_link"), "not inside disk.cache_root"),
                        (str(place["run_root"]), "not inside disk.cache_root")):
        for root in (caches, place["run_root"]):
            cfg = load_config(data={"target_model": "/m", "run_root": str(place["run_root"]), "disk": {
                "cache_root": str(root), "old_caches": [listed], "delete_old_caches": True}})
            with pytest.raises(CacheDeletionRefused, match=why):
                delete_old_caches(cfg, log=lambda m: None)
    assert (place["run_root"] / "r0").is_dir()


def test_positive_control_deletes_only_inside_tmp(place):
    """A cache root beside the runs, and the runs' own folder as the root (the shipped configs): a listed old
    cache inside it is deleted through the real CLI; its neighbours stay."""
    for root in (place["tmp"] / "caches", place["run_root"]):
        old = _victim(root / "old-run")
        keep = _victim(root / "keep")
        res = _delete_caches(place["tmp"], str(root), [str(old)], place["run_root"], place["home"])
        assert res.returncode == 0, res.stderr[-2000:]
        assert json.loads(res.stdout.splitlines()[-1])["freed_bytes"] >= 4096
        assert not old.exists() and (keep / "blob.bin").exists() and place["run_root"].is_dir()
