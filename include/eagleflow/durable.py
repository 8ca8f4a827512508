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
import errno
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


class UnsafeFile(OSError):
    """A file eagleflow trusts (pid record, lock, log, key) is a symlink, not ours, or writable by others."""


def open_owned(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o600, *,
               narrow: bool = False) -> int:
    """Open one of our own files without following a symlink; the descriptor, or UnsafeFile naming the problem.

    The one secure open (records, locks, logs, keys): ``O_NOFOLLOW`` (a link planted at the path is refused,
    even a dangling one with ``O_CREAT``), ``O_NONBLOCK`` while checking (a FIFO planted there cannot hang
    us), then ``fstat`` of what was opened: a regular file owned by this user that neither group nor others
    may write. Anyone who could write it could forge what it says. ``narrow``: for a file whose content is
    never proof of anything (a log, a lock, an append-only book), one of ours that group or others may
    write (e.g. made under umask 002) is narrowed to not writable by them instead of refused.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, f"{path} is a symbolic link; eagleflow does not follow links for its "
                                          "own files (pid records, locks, logs, keys): remove the link") from None
        raise
    try:
        st = os.fstat(fd)
        if narrow and st.st_mode & 0o022 and st.st_uid == os.geteuid():
            os.fchmod(fd, (st.st_mode & 0o7777) & ~0o022)
            st = os.fstat(fd)
        problem = unsafe_stat(st)
        if problem:
            raise UnsafeFile(errno.EPERM, f"{path} {problem}; refusing to trust it: remove it (or fix its owner "
                                          "and mode) and retry")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unsafe_stat(st: os.stat_result) -> str | None:
    """Why a file with this stat cannot be trusted as ours (not regular, someone else's, group/world-writable)."""
    import stat as _stat
    if not _stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


class UnsafeFolder(UnsafeFile):
    """A folder eagleflow keeps its state in (a run dir, the state dir, pids/, locks/, logs/) is a link, not a
    folder, another user's, or in a parent anyone may rename it in; the message names it, its owner and mode."""


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owned_dir(path: str | os.PathLike, root: str | os.PathLike | None = None, mode: int = 0o755) -> Path:
    """Make or prove ``path`` a folder of ours, and every folder from ``root`` (default: ``path`` itself) down to it.

    The run's folders (``run_dir``, ``state_dir`` and those under them) hold what proves a job ours (pid
    records, job locks, logs, server info files): whoever may rename or replace an entry in one of them can
    unlink a worker's lock and record and get a second worker started on its shard. So each folder, from the
    root down, is made with ``mode`` when missing, then opened without following a link and checked with
    ``fstat``: another user's folder (one made first in a shared run_root) is refused (UnsafeFolder naming the
    folder, its owner, its mode and what to do); one of ours that group or others may write (made under umask
    002) is narrowed to not writable by them. Above the root is the operator's choice (a shared run_root), with
    one rule: a parent anyone may write without the sticky bit would let anyone rename the root away.
    """
    import stat as _stat
    path = Path(os.path.abspath(path))
    top = path if root is None else Path(os.path.abspath(root))
    if path != top and top not in path.parents:
        raise ValueError(f"{path} is not under {top}")
    above = top.parent
    above.mkdir(parents=True, exist_ok=True)
    st = os.stat(above)
    if st.st_mode & 0o002 and not st.st_mode & _stat.S_ISVTX:
        raise UnsafeFolder(errno.EPERM, f"{above} (the folder {top} is made in) may be written by anyone and has no "
                                        f"sticky bit (mode {_stat.S_IMODE(st.st_mode):o}, owner {_owner(st.st_uid)}): "
                                        f"any user could rename {top} away and put a folder of theirs in its place. "
                                        f"Set the sticky bit (chmod +t {above}), as /tmp has, or use a folder of "
                                        "your own")
    for d in [top, *[p for p in reversed(path.parents) if top in p.parents], *([path] if path != top else [])]:
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            what = ("is a symbolic link" if os.path.islink(d)
                    else "is not a folder" if e.errno == errno.ENOTDIR else f"cannot be opened ({e.strerror})")
            raise UnsafeFolder(errno.EPERM, f"{d} {what}; eagleflow keeps a run's records, locks and logs only in "
                                            "folders of its own user: remove it and retry") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise UnsafeFolder(errno.EPERM, f"folder {d} is owned by {_owner(st.st_uid)}, not by this user "
                                                f"({_owner(os.geteuid())}), mode {_stat.S_IMODE(st.st_mode):o}: "
                                                "someone else made it first and could remove or replace the locks, "
                                                "pid records and logs kept in it. Have it removed (by its owner or "
                                                "root), or set run_root / node.state_dir to a folder of your own")
            if st.st_mode & 0o022:
                os.fchmod(fd, _stat.S_IMODE(st.st_mode) & ~0o022)
        finally:
            os.close(fd)
    return path


def read_owned(path: str | os.PathLike, limit: int = 1 << 20) -> bytes:
    """The bytes of one of our own files (``open_owned``), at most ``limit`` of them (ValueError beyond)."""
    fd = open_owned(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{os.fspath(path)} is larger than {limit} bytes; not one of eagleflow's small files")
    return data


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


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = True, mode: int | None = None) -> Path:
    """Replace ``path`` with ``data`` (str is written as UTF-8) atomically; returns the path."""
    with atomic_replace(path, fsync=fsync, mode=mode) as tmp:
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


EXIT_ABSENT = 3   # ``--read-owned``: no file at the path


def main(argv: list[str] | None = None) -> int:
    """``python -m eagleflow.durable PATH``: stdin to PATH atomically (how a Node writes a file remotely).

    ``python -m eagleflow.durable --read-owned LIMIT PATH``: one of our own small files to stdout, read the way
    pid records are (``read_owned``; how ``Node.read_owned_text`` reads one remotely): exit 3 when absent, 2
    (the reason on stderr) when it is not ours, a link, writable by others or larger than LIMIT bytes.
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--read-owned" and args[1].isdigit():
        try:
            data = read_owned(args[2], limit=int(args[1]))
        except FileNotFoundError:
            print(f"{args[2]}: No such file or directory", file=sys.stderr)
            return EXIT_ABSENT
        except (OSError, ValueError) as e:
            print(f"{args[2]}: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
            return 2
        sys.stdout.buffer.write(data)
        return 0
    if len(args) != 1:
        print("usage: python -m eagleflow.durable PATH  (writes stdin to PATH atomically)", file=sys.stderr)
        return 2
    atomic_write(args[0], sys.stdin.buffer.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
