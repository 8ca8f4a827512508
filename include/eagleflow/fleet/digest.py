"""Size and SHA-256 of the regular files directly in a folder, as one JSON line (run on a node).

``python -m eagleflow.fleet.digest DIR [NAME ...]`` prints ``{"files": {name: {"size": int, "sha256": hex}}}``
for the files in DIR (not sub-folders such as ``.partial/``; with NAMEs only those, the ones that exist).
A missing DIR prints ``{"files": {}}``. Files are read in 4 MiB chunks; nothing heavy is imported, so a
node answers in the time its disk takes to read the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

CHUNK = 4 << 20


def file_digest(path: str) -> dict:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def digest_dir(path: str, names: list[str] | None = None) -> dict[str, dict]:
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    wanted = set(names) if names else None
    return {e.name: file_digest(e.path) for e in sorted(entries, key=lambda e: e.name)
            if e.is_file(follow_symlinks=False) and (wanted is None or e.name in wanted)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m eagleflow.fleet.digest DIR [NAME ...]", file=sys.stderr)
        return 2
    print(json.dumps({"files": digest_dir(args[0], args[1:])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
