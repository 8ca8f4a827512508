"""Two small durability steps every atomic writer here needs (temp, fsync, rename)."""
from __future__ import annotations

import os


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
