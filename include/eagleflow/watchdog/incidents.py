"""One incident per node and cause: eight shards stalled by one frozen server are one incident, one mail.

Each shard's watch that finds a stall calls ``open_or_join`` on the node (under a
node lock). The first opens the incident and is the one that mails; the others
join it while its recovery runs and for ``join_window_s`` after it ended (they
detect the same cause within one look of each other), so they add their shard
to it and mail nothing. A cause seen again after that window, or by a shard
already in the incident, is a new incident.

Files, under ``<state_dir>/incidents/``: ``<node>.<cause>.json`` (the current
incident of that key) and ``incidents.jsonl`` (every incident, appended when it
is opened and when its recovery ends).
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, TypedDict

from eagleflow import bounded_json
from eagleflow.durable import atomic_write, open_owned
from eagleflow.nodes.locks import NodeLock


# An incident id is what a node answers and what goes into a mail's Message-ID: a plain token, bounded
# ("<node>-<cause>-<UTC time>-<hex>", the node name made safe). Anything else from a node is refused at parse.
INCIDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,159}")
# A time a node writes (opened_at, at): seconds since the epoch, finite, before 2100; 1e999 is no time.
MAX_NODE_TIME = 4_102_444_800.0


def incident_id(value: Any) -> str:
    """``value`` when it is an incident id (a plain token of letters, digits, '_', '.', '-', at most 160);
    else ValueError saying why, showing the value escaped and cut."""
    if isinstance(value, str) and INCIDENT_ID.fullmatch(value):
        return value
    raise ValueError(f"incident id {str(value)[:80]!r} is not an incident id (letters, digits, '_', '.', '-', "
                     "at most 160, as the node's incident book writes them)")


def node_time(value: Any, what: str) -> float | None:
    """A time from a node's file or answer: None when absent, else finite seconds in [0, 2100); ValueError if not."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"its {what} is not a time in seconds (a {type(value).__name__})")
    if not 0 <= value < MAX_NODE_TIME:   # False for inf and nan too
        raise ValueError(f"its {what} {str(value)[:40]} is not a time between 1970 and 2100")
    return float(value)


def _safe_token(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:limit]


def incidents_dir(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / "incidents"


def _key_file(state_dir: str | os.PathLike, node: str, cause: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{node}.{cause}")
    return incidents_dir(state_dir) / f"{safe}.json"


def _lock(state_dir: str | os.PathLike) -> NodeLock:
    return NodeLock(incidents_dir(state_dir) / "incidents.lock", purpose="watchdog incident book")


def _append_log(state_dir: str | os.PathLike, entry: dict) -> None:
    # the book is appended to, never replaced: not through a link planted at its name (durable.open_owned)
    fd = open_owned(incidents_dir(state_dir) / "incidents.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644,
                    narrow=True)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _read(path: Path) -> dict | None:
    try:
        return bounded_json.read(path)
    except (OSError, ValueError):
        return None


def open_or_join(state_dir: str | os.PathLike, *, node: str, cause: str, run_id: str, shard: int | None,
                 summary: str, join_window_s: float, now: float | None = None) -> tuple[dict[str, Any], bool]:
    """(incident, opened): the open incident of (node, cause) with this shard added, or a new one."""
    now = time.time() if now is None else now
    incidents_dir(state_dir).mkdir(parents=True, exist_ok=True)
    path = _key_file(state_dir, node, cause)
    with _lock(state_dir):
        cur = _read(path)
        joinable = cur is not None and (cur.get("ended_at") is None and now - cur["opened_at"] < 3600
                                        or cur.get("ended_at") is not None and now - cur["ended_at"] <= join_window_s)
        shard_key = "trainer" if shard is None else str(shard)
        # a shard already in the incident stalling again is a new fault, not the same one seen twice
        if cur is not None and joinable and shard_key not in cur["shards"]:
            cur["shards"].setdefault(shard_key, {"at": now, "run_id": run_id, "summary": summary[:2000]})
            atomic_write(path, json.dumps(cur))
            return cur, False
        inc = {"id": incident_id(f"{_safe_token(node, 64)}-{_safe_token(cause, 40)}-"
                                 f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:6]}"),
               "node": node, "cause": cause, "opened_at": now, "ended_at": None, "recovery": None,
               "shards": {shard_key: {"at": now, "run_id": run_id, "summary": summary[:2000]}}}
        atomic_write(path, json.dumps(inc))
        _append_log(state_dir, {"event": "opened", **inc})
        return inc, True


class Recovery(TypedDict):
    """What an incident records of its recovery (``record_recovery``)."""
    ok: bool
    action: str          # restarted, worker, none ...
    summary: str
    recovered_at: float
    shard: int


def record_recovery(state_dir: str | os.PathLike, incident: dict, recovery: Recovery) -> dict:
    """Mark the incident's recovery (restart, worker restarted, or failed) and end it; returns it as stored."""
    path = _key_file(state_dir, incident["node"], incident["cause"])
    with _lock(state_dir):
        cur = _read(path) or dict(incident)
        if cur.get("id") != incident["id"]:
            return cur
        if recovery.get("action") == "restarted" or cur.get("recovery") is None:
            cur["recovery"] = recovery
        cur["ended_at"] = time.time()
        atomic_write(path, json.dumps(cur))
        _append_log(state_dir, {"event": "recovered" if recovery.get("ok") else "recovery failed",
                                "id": cur["id"], "at": cur["ended_at"], "shard_count": len(cur["shards"]),
                                "recovery": recovery})
        return cur


def current(state_dir: str | os.PathLike, node: str, cause: str) -> dict | None:
    return _read(_key_file(state_dir, node, cause))


def history(state_dir: str | os.PathLike, skipped: list[str] | None = None) -> list[dict]:
    """Every event of the book; a malformed line is left out (named in ``skipped``), never the whole book."""
    path = incidents_dir(state_dir) / "incidents.jsonl"
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            e = bounded_json.loads(line, source=f"incident book line {n}")
            if not isinstance(e, dict) or not isinstance(e.get("id"), str):
                raise ValueError("not an incident event (a JSON object with event and id)")
            incident_id(e["id"])
            if not isinstance(e.get("shards") or {}, dict):
                raise ValueError("its shards are not an object")
            for k in ("opened_at", "at", "ended_at"):
                node_time(e.get(k), k)
            out.append(e)
        except (ValueError, RecursionError) as err:
            # only a last line that is not JSON yet may be an append in progress; anything else is named
            in_progress = n == len(lines) and isinstance(err, json.JSONDecodeError)
            if skipped is not None and not in_progress:
                skipped.append(f"{path} line {n}: {str(err)[:200]}; left out")
    return out
