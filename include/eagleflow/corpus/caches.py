"""Delete the old hidden-state caches listed in the config, and nothing else.

Runs on the node (``eagleflow corpus delete-caches``). A path is deleted only
when ``disk.delete_old_caches`` is true and its real location (symlinks
resolved) lies strictly inside the real ``disk.cache_root``. Every deletion is
logged with its path and the bytes it freed.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Callable

from eagleflow.config import PipelineConfig


class CacheDeletionRefused(ValueError):
    """A listed cache lies outside disk.cache_root (or no root is set); nothing was deleted."""


@dataclass
class CacheDeletion:
    enabled: bool
    deleted: dict[str, int] = field(default_factory=dict)      # path -> bytes freed
    missing: list[str] = field(default_factory=list)
    would_delete: dict[str, int] = field(default_factory=dict)  # when not enabled

    @property
    def freed_bytes(self) -> int:
        return sum(self.deleted.values())


def allocated_bytes(path: str) -> int:
    """Bytes the path occupies on disk (blocks, not apparent size), without following symlinks."""
    st = os.lstat(path)
    total = st.st_blocks * 512
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def checked_cache_path(path: str, cache_root: str | None) -> str:
    """The real path to delete; raises when it is not strictly inside the real cache root."""
    if not cache_root:
        raise CacheDeletionRefused(f"refusing to delete {path}: disk.cache_root is not set; set it to the folder "
                                   "that holds the old caches (nothing outside it is ever deleted)")
    root = os.path.realpath(cache_root)
    real = os.path.realpath(path)
    if real == root or os.path.commonpath([root, real]) != root:
        shown = real if real != os.path.abspath(path) else path
        raise CacheDeletionRefused(f"refusing to delete {path} (really {shown}): it is not inside "
                                   f"disk.cache_root {root}; remove it from disk.old_caches or fix the root")
    return real


def delete_old_caches(cfg: PipelineConfig, *, log: Callable[[str], None] = print) -> CacheDeletion:
    paths = [str(cfg.resolve(p)) for p in cfg.disk.old_caches]
    root = str(cfg.resolve(cfg.disk.cache_root)) if cfg.disk.cache_root else None
    # Check every path first: one bad entry means nothing is deleted.
    checked = [(p, checked_cache_path(p, root)) for p in paths]
    result = CacheDeletion(enabled=cfg.disk.delete_old_caches)
    for listed, real in checked:
        if not os.path.lexists(real):
            result.missing.append(listed)
            log(f"delete-caches: {listed}: not present, nothing to delete")
            continue
        size = allocated_bytes(real)
        if not result.enabled:
            result.would_delete[listed] = size
            continue
        if os.path.isdir(real) and not os.path.islink(real):
            shutil.rmtree(real)  # removes symlinks inside without following them
        else:
            os.unlink(real)
        if listed != real and os.path.islink(listed):
            os.unlink(listed)  # the listed name was a link into the root: remove it too
        result.deleted[listed] = size
        log(f"delete-caches: deleted {real} ({size} bytes freed)")
    if not result.enabled:
        total = sum(result.would_delete.values())
        log(f"delete-caches: disk.delete_old_caches is off (DAG Param delete_old_caches): nothing deleted; "
            f"{len(result.would_delete)} cache(s) of {total} bytes could be freed: "
            + (", ".join(f"{p} ({s} bytes)" for p, s in result.would_delete.items()) or "none"))
    else:
        log(f"delete-caches: {len(result.deleted)} cache(s) deleted, {result.freed_bytes} bytes freed")
    return result
