"""A fleet's hand-over and takeover records, on the nodes' disks (run by ``eagleflow reconcile`` there).

- The owning node's hand-over mark, beside the shard's job lock: present = the shard went to another node and is
  never worked on here again; its worker checks it once it holds the lock (``refuse_if_handed_over``).
- The taking node's ``takeover.json`` in its run dir: per phase, shard -> the node it came from, so a later
  scan and claim there count the shard as its own.
Proving a shard free of our workers before marking it is ``watchdog.reconcile.hand_over``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from eagleflow import bounded_json
from eagleflow.durable import atomic_write, read_owned
from eagleflow.layout import RunLayout
from eagleflow.nodes.locks import NodeLock
from eagleflow.phases import EXTRACT, kind_of

TAKEOVER_FILE = "takeover.json"
EXIT_HANDED_OVER = 5   # `capture run` / `generate run`: the shard was handed over to another fleet node


def hand_over_mark(layout: RunLayout, shard: int, phase: str = EXTRACT) -> Path:
    """Beside the shard's job lock on its owning node: present = handed over, never worked on here again."""
    return Path(str(layout.lock_file(kind_of(phase).worker_role(shard)))).with_suffix(".handed-over")


def handed_over_to(layout: RunLayout, shard: int, phase: str = EXTRACT) -> dict | None:
    """The hand-over mark of ``shard`` ({"to", "at"}), or None while the shard is this node's."""
    try:
        return mark_of(read_owned(hand_over_mark(layout, shard, phase), limit=1 << 16))
    except FileNotFoundError:
        return None
    except OSError:
        return mark_of(None)


def mark_of(text: str | bytes | None) -> dict:
    """A hand-over mark's text as {"to", "at"}; one we cannot read still means: not this node's any more."""
    try:
        doc = bounded_json.loads(text, source="hand-over mark") if text is not None else None
    except ValueError:
        doc = None
    return doc if isinstance(doc, dict) else {"to": "(unreadable mark)", "at": None}


def refuse_if_handed_over(layout: RunLayout, shard: int, phase: str, prog: str) -> int | None:
    """For a worker holding its shard's job lock (the lock a hand-over takes to leave its mark, so the mark is
    either here now or never comes): EXIT_HANDED_OVER, said on stderr, if the shard went to another node."""
    mark = handed_over_to(layout, shard, phase)
    if mark is None:
        return None
    print(f"{prog}: {kind_of(phase).label} {shard} of run {layout.run_id} was handed over to fleet node "
          f"{mark.get('to')}; it is worked on there, not here", file=sys.stderr, flush=True)
    return EXIT_HANDED_OVER


def _takeover_record(run_dir) -> dict:
    path = Path(str(run_dir)) / TAKEOVER_FILE
    try:
        doc = bounded_json.read(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable takeover record ({e}); it lists the shards other nodes handed "
                         "over to this one: restore it or remove it and clear the take_over_shards task") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: the takeover record is not a JSON object: restore it or remove it and clear "
                         "the take_over_shards task")
    return doc


def taken_over_in(run_dir, phase: str = EXTRACT) -> dict[int, str]:
    """Shards of ``phase`` handed over to the node whose run dir this is: shard -> the node it came from."""
    return {int(k): str(v) for k, v in _takeover_record(run_dir).get(kind_of(phase).takeover_key,
                                                                     {}).items()}


def taken_over(run, phase: str = EXTRACT) -> dict[int, str]:
    """Shards of ``phase`` handed over to this node in this run: shard -> the node it came from."""
    return taken_over_in(run.layout.run_dir, phase)


def record_taken_over(run, shard: int, from_node: str, phase: str = EXTRACT) -> None:
    path = Path(str(run.layout.run_dir)) / TAKEOVER_FILE
    key = kind_of(phase).takeover_key
    with NodeLock(Path(str(run.layout.locks_dir)) / f"{run.layout.run_id}.takeover.lock",
                  purpose=f"takeover record of run {run.layout.run_id}"):
        doc = _takeover_record(run.layout.run_dir)
        shards = {**taken_over(run, phase), shard: from_node}
        doc[key] = {str(k): v for k, v in sorted(shards.items())}
        atomic_write(path, json.dumps(doc))
