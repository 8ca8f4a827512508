"""One node's status document: what the GPU view, the metrics and the run report read.

Built by ``next_status`` from the previous document and one health check, so
the document carries its own bounded history (the last ``retention_s`` of
memory and utilisation per GPU, for the sparklines), since when each GPU has
held memory at 0 % (``held_since``), when the node was last read, and which
processes are ours. Only an allow-list of fields goes in: program names (never
arguments), users, PIDs, our run/role/shard; an unreachable node's error is
reduced to its kind, because SSH errors carry hosts, logins and key paths.
"""
from __future__ import annotations

import os
from typing import Any

from eagleflow.gpu.snapshot import GpuSnapshot

from .node_activity import NodeActivity

GPU_FIELDS = ("index", "uuid", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "temperature_c",
              "power_w", "ecc_uncorrected")
MAX_POINTS = 1500  # a hard cap whatever retention and interval say: one document stays small


def program_name(name: str | None) -> str:
    """Only the program, never its arguments: command lines carry tokens, paths and user data."""
    first = (name or "?").strip().split(" ")[0]
    return os.path.basename(first) or "?"


def public_processes(snap: GpuSnapshot, activity: NodeActivity | None) -> list[dict[str, Any]]:
    out = []
    for p in snap.processes:
        owner = activity.owner_of(p.pid, p.pgid) if activity is not None else None
        out.append({"pid": p.pid, "program": program_name(p.name), "user": p.user, "state": p.state,
                    "used_mib": p.used_mib, "ours": owner is not None,
                    "run_id": owner.run_id if owner else None, "role": owner.role if owner else None,
                    "task": owner.task if owner else None, "shard": owner.shard if owner else None})
    return out


def is_held_idle(g: dict[str, Any], threshold_mib: int) -> bool:
    """Memory above the threshold at a utilisation known to be 0 (an unknown reading is not 0)."""
    used, util = g.get("memory_used_mib"), g.get("utilization_pct")
    return used is not None and util is not None and used > threshold_mib and util == 0


def _trim_history(hist: dict[str, Any], cutoff: float) -> dict[str, Any]:
    ts = list(hist.get("t") or [])
    keep = next((i for i, t in enumerate(ts) if t >= cutoff), len(ts))
    keep = max(keep, len(ts) - MAX_POINTS)
    return {"t": ts[keep:], "gpus": {u: {k: list(v)[keep:] for k, v in series.items()}
                                     for u, series in (hist.get("gpus") or {}).items()}}


def _append_history(hist: dict[str, Any], now: float, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(hist["t"])
    hist["t"].append(now)
    seen = set()
    for g in gpus:
        series = hist["gpus"].setdefault(g["uuid"], {"mem": [None] * n, "util": [None] * n})
        series["mem"].append(g.get("memory_used_mib"))
        series["util"].append(g.get("utilization_pct"))
        seen.add(g["uuid"])
    for uuid, series in hist["gpus"].items():  # a GPU missing from this reading: unknown, not 0
        if uuid not in seen:
            series["mem"].append(None)
            series["util"].append(None)
    hist["gpus"] = {u: s for u, s in hist["gpus"].items() if any(v is not None for v in s["mem"] + s["util"])}
    return hist


def error_kind(error: str) -> str:
    """What a person may see of a node error on a page: its kind, not its text (hosts, logins, key paths)."""
    low = error.lower()
    for needle, kind in (("timed out", "timed out"), ("timeout", "timed out"), ("authentication", "SSH login refused"),
                         ("connection refused", "connection refused"), ("no route", "unreachable"),
                         ("unable to connect", "cannot connect"), ("cannot reach", "cannot connect"),
                         ("driver", "GPU driver not answering"), ("nvidia-smi", "nvidia-smi failed")):
        if needle in low:
            return kind
    return "could not be read"


def next_status(prev: dict[str, Any], *, node: str, now: float, has_gpu: bool = True,
                snaps: list[GpuSnapshot] | None = None, activity: NodeActivity | None = None,
                state: dict[str, Any] | None = None, alerts: list[dict[str, Any]] | None = None,
                error: str | None = None, interval_s: float | None = None, retention_s: float = 3600.0,
                held_threshold_mib: int = 1024, config_path: str | None = None) -> dict[str, Any]:
    """The document after one check of ``node``; ``error`` set = the node could not be read this time."""
    doc: dict[str, Any] = {
        "node": node, "has_gpu": has_gpu, "checked_at": now, "interval_s": interval_s, "retention_s": retention_s,
        "config_path": config_path, "held_threshold_mib": held_threshold_mib,
        "state": state if state is not None else prev.get("state", {}),
        "alerts": [{k: a.get(k) for k in ("kind", "uuid", "index")} for a in alerts or []],
        "history": _trim_history(prev.get("history") or {}, now - retention_s),
    }
    if error is not None:  # keep what we knew, say since when we know nothing
        doc.update(error=error_kind(error), last_seen=prev.get("last_seen"), gpus=prev.get("gpus") or [],
                   held_since=prev.get("held_since") or {}, activity=prev.get("activity"),
                   unreachable_since=prev.get("unreachable_since") or now)
        return doc
    gpus = []
    for s in snaps or []:
        g = {k: getattr(s, k) for k in GPU_FIELDS}
        g["processes"] = public_processes(s, activity)
        gpus.append(g)
    prev_held = prev.get("held_since") or {}
    held = {g["uuid"]: prev_held.get(g["uuid"], now) for g in gpus if is_held_idle(g, held_threshold_mib)}
    doc.update(error=None, last_seen=now, gpus=gpus, held_since=held, unreachable_since=None,
               activity=activity.to_dict() if activity is not None else None)
    if has_gpu:
        doc["history"] = _append_history(doc["history"], now, gpus)
    return doc
