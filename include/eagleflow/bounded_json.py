"""The one way eagleflow parses JSON it did not just make itself: within a size and a depth bound.

Node answers, files read back (pid records, locks, heartbeats, server info files, ``promoted.json``, status
documents, the incident book) may be written by someone hostile or broken. ``json.loads`` of text nested a few
thousand deep raises ``RecursionError``, which is no ``ValueError``: it escapes every ``except ValueError``
that refuses a wrong answer, and fails whatever asked as a whole (one hostile node would stop a fleet's
takeover). Here the depth is measured first, cheaply (the brackets outside strings, counted in C), and the
size capped, so anything beyond the bounds is ``JsonRefused``: a ``ValueError`` naming the source (the node
and command, or the file), caught where a malformed answer already is.

Standard library only: it runs on the nodes too.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any

from eagleflow.durable import read_owned

# Deepest legitimate document we write is well under 10 levels; 64 leaves room and stays far below the
# interpreter's recursion limit (1000) even in a deep call stack (Airflow's task runner, pydantic).
MAX_DEPTH = 64
MAX_ANSWER_BYTES = 64 << 20   # a node answer (a digest of a large shard is a few MB); the hf server's body cap
MAX_FILE_BYTES = 1 << 20      # a small file of ours read back (records, info files, marks, promoted.json)

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRING_B = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NOT_BRACKET_B = re.compile(rb"[^\[\]{}]+")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


class JsonRefused(ValueError):
    """JSON beyond the size or depth bound; ``source`` names where it came from (node and command, or file)."""

    def __init__(self, source: str, message: str):
        super().__init__(f"{source}: {message}")
        self.source = source


def depth(text: str | bytes) -> int:
    """How deep the arrays and objects of ``text`` nest (brackets inside strings do not count).

    Cheap: most documents hold fewer brackets than the bound and are answered from one count; otherwise the
    strings are cut out and the running depth taken over the brackets left, all in C loops.
    """
    if isinstance(text, str):
        brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    else:
        brackets = _NOT_BRACKET_B.sub(b"", _STRING_B.sub(b"", bytes(text)))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _open_brackets(text: str | bytes) -> int:
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")


def check(text: str | bytes, *, source: str, max_bytes: int = MAX_ANSWER_BYTES, max_depth: int = MAX_DEPTH) -> None:
    """JsonRefused when ``text`` is longer than ``max_bytes`` or nests deeper than ``max_depth``."""
    if len(text) > max_bytes:   # characters of a str: never more than its bytes
        raise JsonRefused(source, f"{len(text)} bytes of JSON, more than the {max_bytes} allowed; refused unread")
    if _open_brackets(text) > max_depth:
        d = depth(text)
        if d > max_depth:
            raise JsonRefused(source, f"JSON nested {d} levels deep, deeper than the {max_depth} allowed; refused "
                                      "unparsed (no answer or file of eagleflow nests that deep)")


def loads(text: str | bytes, *, source: str, max_bytes: int = MAX_ANSWER_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` within the bounds: JsonRefused beyond them, ``json.JSONDecodeError`` (a ValueError) for
    text that is not JSON."""
    check(text, source=source, max_bytes=max_bytes, max_depth=max_depth)
    try:
        return json.loads(text)
    except RecursionError:   # belt and braces: the depth check above already refuses anything this deep
        raise JsonRefused(source, "JSON nested too deeply to parse; refused") from None


def read(path: str | os.PathLike, *, max_bytes: int = MAX_FILE_BYTES, max_depth: int = MAX_DEPTH,
         owned: bool = False) -> Any:
    """The JSON document in the file at ``path``, read whole only within ``max_bytes``.

    ``owned``: the file must be one of our own (``durable.read_owned``: a regular file of this user that
    nobody else may write, opened without following a link; ``durable.UnsafeFile`` otherwise), because
    what it says is acted on (a server's URL, a process to signal). OSError when it cannot be read.
    """
    name = os.fspath(path)
    if owned:
        try:
            data = read_owned(name, limit=max_bytes)
        except ValueError:   # read_owned's only ValueError: larger than the limit
            raise JsonRefused(name, f"larger than the {max_bytes} bytes allowed; refused unread") from None
    else:
        with open(name, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise JsonRefused(name, f"larger than the {max_bytes} bytes allowed; refused unread")
    return loads(data, source=name, max_bytes=max_bytes, max_depth=max_depth)
