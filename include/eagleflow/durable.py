"""Atomic, durable file writes: the one way this project replaces a file (temp, fsync, rename, fsync dir).

``atomic_replace(path)`` yields a temp path beside ``path`` (same directory,
so the rename is atomic; a unique name, so concurrent writers never share a
temp file) for writers that need a path (safetensors, parquet, matplotlib) or
stream their own bytes; ``atomic_write(path, data)`` is the common case;
``atomic_dir(path)`` publishes a whole directory the same way.
Temp names start with ``.tmp-`` so the cleaners of partial files find them.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

TEMP_PREFIX = ".tmp-"

# mkstemp creates 0600; a replaced file gets the mode a plain open() would give it (readers may be other users)
_UMASK = os.umask(0o022)
os.umask(_UMASK)
DEFAULT_MODE = 0o666 & ~_UMASK


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path (a directory, so that a rename inside it survives a crash)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard_temp(path: str | os.PathLike) -> None:
    """Remove a temp file after a failed write; already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def atomic_replace(path: str | os.PathLike, *, fsync: bool = True, mode: int | None = None) -> Iterator[Path]:
    """Yield a fresh temp path in ``path``'s directory; when the block ends without error, publish it.

    Publishing: fsync the temp file, rename it over ``path``, fsync the
    directory (``fsync=False`` skips both, for data a crash may lose, e.g.
    dumps in /dev/shm). On any error the temp file is removed and ``path``
    is left as it was: readers see the old file or the new one, never a mix.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f"{TEMP_PREFIX}{final.name}.")
    os.close(fd)
    try:
        os.chmod(tmp, DEFAULT_MODE if mode is None else mode)
        yield Path(tmp)
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        discard_temp(tmp)
        raise
    if fsync:
        fsync_path(final.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = True) -> Path:
    """Replace ``path`` with ``data`` (str is written as UTF-8) atomically; returns the path."""
    with atomic_replace(path, fsync=fsync) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``path``; when the block ends without error, publish it whole.

    Publishing: fsync every file in it and the directory itself, move an
    existing ``path`` aside, rename the temp directory to ``path``, fsync the
    parent, then delete the old one. On error the temp directory is removed
    and ``path`` is left as it was.
    """
    import shutil
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{TEMP_PREFIX}{final.name}."))
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)
        yield tmp
        if fsync:
            for f in tmp.rglob("*"):
                if f.is_file():
                    fsync_path(f)
            fsync_path(tmp)
        # a temp name too: a crash between the two renames leaves it where temp cleaners look
        old = final.with_name(f"{TEMP_PREFIX}{final.name}.old-{tmp.name.rsplit('.', 1)[-1]}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync:
        fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m eagleflow.durable PATH``: stdin to PATH atomically (how a Node writes a file remotely)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m eagleflow.durable PATH  (writes stdin to PATH atomically)", file=sys.stderr)
        return 2
    atomic_write(args[0], sys.stdin.buffer.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
