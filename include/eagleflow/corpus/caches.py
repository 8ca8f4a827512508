"""Delete the old hidden-state caches listed in the config, and nothing else.

Runs on the node (``eagleflow corpus delete-caches``). A path is deleted only
when ``disk.delete_old_caches`` is true and its real location (symlinks
resolved) lies strictly inside the real ``disk.cache_root``, compared by identity
(``eagleflow.deletion_roots``: the root is not ``/``, a home folder or above
``run_root``; a cache is none of those nor ``run_root``). Both are checked for
every path before anything is deleted, and again just before each deletion.
Every deletion is logged with its path and the bytes it freed.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Callable

from eagleflow.config import PipelineConfig
from eagleflow.deletion_roots import deletion_root_problem, deletion_target_problem


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


def checked_cache_path(path: str, cache_root: str | None, run_root: str | None = None) -> str:
    """The real path to delete; raises when the root may not hold deletions or the path is not strictly inside
    it (by real path and identity), or is a protected folder (``eagleflow.deletion_roots``)."""
    if not cache_root:
        raise CacheDeletionRefused(f"refusing to delete {path}: disk.cache_root is not set; set it to the folder "
                                   "that holds the old caches (nothing outside it is ever deleted)")
    problem = deletion_root_problem(cache_root, run_root)
    if problem:
        raise CacheDeletionRefused(f"refusing to delete anything: disk.cache_root = {cache_root!r}: {problem}; set "
                                   "it to a folder that holds only hidden-state caches, e.g. /data/eagleflow/caches")
    problem = deletion_target_problem(path, cache_root, run_root)
    if problem:
        real = os.path.realpath(path)
        shown = real if real != os.path.abspath(path) else path
        raise CacheDeletionRefused(f"refusing to delete {path} (really {shown}): {problem}; remove it from "
                                   "disk.old_caches or fix disk.cache_root")
    return os.path.realpath(path)


def delete_old_caches(cfg: PipelineConfig, *, log: Callable[[str], None] = print) -> CacheDeletion:
    paths = [str(cfg.resolve(p)) for p in cfg.disk.old_caches]
    root = str(cfg.resolve(cfg.disk.cache_root)) if cfg.disk.cache_root else None
    run_root = str(cfg.resolve(cfg.run_root))
    # Check every path first: one bad entry means nothing is deleted.
    checked = [(p, checked_cache_path(p, root, run_root)) for p in paths]
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
        # again, right before deleting: the root or the path may have been swapped (a link to /) since
        if checked_cache_path(listed, root, run_root) != real:
            raise CacheDeletionRefused(f"refusing to delete {listed}: it now resolves to "
                                       f"{os.path.realpath(listed)}, not {real} as checked; nothing more is deleted")
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
