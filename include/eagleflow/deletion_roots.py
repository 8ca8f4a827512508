"""Where deletions may happen, decided by identity, not by how a path is spelled.

``disk.cache_root`` is the only folder deletions may happen under (``eagleflow corpus
delete-caches``), so it must not be ``/``, a home folder, a folder holding one, or a folder
above ``run_root``. A name says little: ``//``, ``/proc/self/root``, ``/proc/1/root``, a
symbolic link to ``/`` and a bind mount all name the file system's root. So every folder is
compared by the real path (``os.path.realpath``) and, where it exists, by its identity
(``st_dev``, ``st_ino``); a path that cannot be resolved (a ``/proc/<pid>/root`` of another
user answers "permission denied") is refused. The checks run when the config is loaded and
again just before anything is deleted, since a folder can be created or swapped in between.
"""
from __future__ import annotations

import os
import pwd
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """A folder as the file system knows it: its real path and, when it exists, (st_dev, st_ino)."""
    real: str
    ident: tuple[int, int] | None

    @classmethod
    def of(cls, path: str | os.PathLike) -> "Place":
        """Raises OSError when the path cannot be resolved or looked at (not when it does not exist)."""
        real = os.path.realpath(os.fspath(path))
        try:
            st = os.stat(real)
        except (FileNotFoundError, NotADirectoryError):
            return cls(real, None)
        return cls(real, (st.st_dev, st.st_ino))

    def same(self, other: "Place") -> bool:
        return self.real == other.real or (self.ident is not None and self.ident == other.ident)

    def above(self, other: "Place") -> bool:
        """Whether ``other`` lies strictly inside this folder: one of other's real ancestors is this one."""
        return any(self.same(a) for a in other.ancestors())

    def ancestors(self) -> list["Place"]:
        out: list[Place] = []
        cur = self.real
        while True:
            parent = os.path.dirname(cur)
            if parent == cur:
                return out
            try:
                out.append(Place.of(parent))
            except OSError:
                out.append(Place(parent, None))
            cur = parent


def home_folders() -> list[str]:
    """Every user's home folder (the password database) and this process's $HOME."""
    homes = [os.path.expanduser("~"), os.environ.get("HOME", "")]
    try:
        homes += [e.pw_dir for e in pwd.getpwall()]
    except OSError:
        pass
    return sorted({h for h in homes if h})


def _unresolved(e: OSError) -> str:
    return (f"it cannot be resolved to a real folder ({e.strerror or e}); name the folder itself, "
            "not a link or a /proc path")


def _shown(path: str, place: Place) -> str:
    return f" ({path} is really {place.real})" if os.path.normpath(path) != place.real else ""


def protected_problem(place: Place, path: str, run_root: str | None, *, run_root_itself: bool) -> str | None:
    """Why ``place`` must never be deleted or hold what is deleted: ``/``, a home folder or a folder holding one,
    a folder above ``run_root`` (and ``run_root`` itself unless ``run_root_itself``); None when it is none."""
    really = _shown(path, place)
    if place.same(Place.of("/")):
        return f"it is the file system's root{really}"
    for home in home_folders():
        try:
            h = Place.of(home)
        except OSError:
            continue
        if h.real == "/":
            continue   # a system account whose home is "/": the root is refused above
        if place.same(h):
            return f"it is the home folder {home}{really}"
        if place.above(h):
            return f"it holds the home folder {home}{really}"
    if run_root:
        try:
            run = Place.of(run_root)
        except OSError as e:
            return f"run_root {run_root} {_unresolved(e)}"
        if place.above(run):
            return f"it lies above run_root {run_root} (the runs themselves would be deletable){really}"
        if not run_root_itself and place.same(run):
            return f"it is run_root {run_root} itself{really}"
    return None


def deletion_root_problem(cache_root: str, run_root: str | None) -> str | None:
    """Why ``cache_root`` cannot be the root deletions are confined to; None when it can.

    ``run_root`` itself may be the cache root (the shipped configs delete old runs' caches there): each
    deletion is then refused for ``run_root`` and above (``deletion_target_problem``).
    """
    try:
        root = Place.of(cache_root)
    except OSError as e:
        return _unresolved(e)
    return protected_problem(root, cache_root, run_root, run_root_itself=True)


def deletion_target_problem(path: str, cache_root: str, run_root: str | None) -> str | None:
    """Why ``path`` may not be deleted under ``cache_root``: not strictly inside it (by real path and identity),
    or protected (see ``protected_problem``). None when it may."""
    try:
        target, root = Place.of(path), Place.of(cache_root)
    except OSError as e:
        return _unresolved(e)
    if target.same(root):
        return f"it is not inside disk.cache_root {root.real} (it is that folder itself)"
    if not root.above(target):
        return f"it is not inside disk.cache_root {root.real}"
    return protected_problem(target, path, run_root, run_root_itself=False)
