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
from typing import Any, TypedDict, cast

from eagleflow.gpu.snapshot import GpuFields, GpuSnapshot

from .node_activity import ActivityDoc, NodeActivity
from .rules import GpuHealth

GPU_FIELDS = ("index", "uuid", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "temperature_c",
              "power_w", "ecc_uncorrected")
MAX_POINTS = 1500  # a hard cap whatever retention and interval say: one document stays small


class GpuProcessDoc(TypedDict):
    """One compute process on a GPU, as the page may show it: the program's name only, and ours or not."""
    pid: int
    program: str
    user: str | None
    state: str | None
    used_mib: int | None
    ours: bool
    run_id: str | None
    role: str | None
    task: str | None
    shard: int | None


class GpuEntry(GpuFields):
    """One GPU of a status document's ``gpus``: the GPU_FIELDS of its snapshot, then its processes."""
    processes: list[GpuProcessDoc]


class GpuSeries(TypedDict):
    """One GPU's history, a value per ``History.t`` (None: not read then, never drawn as 0)."""
    mem: list[int | None]
    util: list[int | None]


class History(TypedDict):
    """The document's last ``retention_s`` of readings: the times, and each GPU's series by UUID."""
    t: list[float]
    gpus: dict[str, GpuSeries]


class AlertRef(TypedDict):
    """An alert of the last check, as the document keeps it (rules.HealthAlert's kind, uuid, index)."""
    kind: Any
    uuid: Any
    index: Any


class StatusDoc(TypedDict, total=False):
    """One node's status document. ``next_status`` writes every key; total=False because a document read back
    may be ``{}`` (none stored yet, or unreadable) and readers take each key with ``.get``."""
    node: str
    has_gpu: bool
    checked_at: float
    interval_s: float | None
    retention_s: float
    config_path: str | None
    held_threshold_mib: int
    state: dict[str, GpuHealth]          # rules.assess's state, by UUID
    alerts: list[AlertRef]
    history: History
    error: str | None                    # error_kind of why the node could not be read this time; None: read
    last_seen: float | None
    gpus: list[GpuEntry]
    held_since: dict[str, float]         # UUID -> since when it holds memory at 0 %
    activity: ActivityDoc | None         # NodeActivity.to_dict()
    unreachable_since: float | None


def program_name(name: str | None) -> str:
    """Only the program, never its arguments: command lines carry tokens, paths and user data."""
    first = (name or "?").strip().split(" ")[0]
    return os.path.basename(first) or "?"


def public_processes(snap: GpuSnapshot, activity: NodeActivity | None) -> list[GpuProcessDoc]:
    out: list[GpuProcessDoc] = []
    for p in snap.processes:
        owner = activity.owner_of(p.pid, p.pgid) if activity is not None else None
        out.append({"pid": p.pid, "program": program_name(p.name), "user": p.user, "state": p.state,
                    "used_mib": p.used_mib, "ours": owner is not None,
                    "run_id": owner.run_id if owner else None, "role": owner.role if owner else None,
                    "task": owner.task if owner else None, "shard": owner.shard if owner else None})
    return out


def is_held_idle(g: GpuEntry, threshold_mib: int) -> bool:
    """Memory above the threshold at a utilisation known to be 0 (an unknown reading is not 0)."""
    used, util = g.get("memory_used_mib"), g.get("utilization_pct")
    return used is not None and util is not None and used > threshold_mib and util == 0


def _trim_history(hist: History, cutoff: float) -> History:
    ts = list(hist.get("t") or [])
    keep = next((i for i, t in enumerate(ts) if t >= cutoff), len(ts))
    keep = max(keep, len(ts) - MAX_POINTS)
    stored = cast(dict[str, dict[str, list[int | None]]], hist.get("gpus") or {})   # each series as read back
    return {"t": ts[keep:], "gpus": {u: cast(GpuSeries, {k: list(v)[keep:] for k, v in series.items()})
                                     for u, series in stored.items()}}


def _append_history(hist: History, now: float, gpus: list[GpuEntry]) -> History:
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


def next_status(prev: StatusDoc, *, node: str, now: float, has_gpu: bool = True,
                snaps: list[GpuSnapshot] | None = None, activity: NodeActivity | None = None,
                state: dict[str, GpuHealth] | None = None, alerts: list[dict[str, Any]] | None = None,
                error: str | None = None, interval_s: float | None = None, retention_s: float = 3600.0,
                held_threshold_mib: int = 1024, config_path: str | None = None) -> StatusDoc:
    """The document after one check of ``node``; ``error`` set = the node could not be read this time."""
    doc: StatusDoc = {
        "node": node, "has_gpu": has_gpu, "checked_at": now, "interval_s": interval_s, "retention_s": retention_s,
        "config_path": config_path, "held_threshold_mib": held_threshold_mib,
        "state": state if state is not None else prev.get("state", {}),
        "alerts": [AlertRef(kind=a.get("kind"), uuid=a.get("uuid"), index=a.get("index")) for a in alerts or []],
        "history": _trim_history(prev.get("history") or History(t=[], gpus={}), now - retention_s),
    }
    if error is not None:  # keep what we knew, say since when we know nothing
        doc.update({"error": error_kind(error), "last_seen": prev.get("last_seen"), "gpus": prev.get("gpus") or [],
                    "held_since": prev.get("held_since") or {}, "activity": prev.get("activity"),
                    "unreachable_since": prev.get("unreachable_since") or now})
        return doc
    gpus: list[GpuEntry] = []
    for s in snaps or []:   # GPU_FIELDS in their order, then the processes
        gpus.append(GpuEntry(index=s.index, uuid=s.uuid, name=s.name, memory_used_mib=s.memory_used_mib,
                             memory_total_mib=s.memory_total_mib, utilization_pct=s.utilization_pct,
                             temperature_c=s.temperature_c, power_w=s.power_w, ecc_uncorrected=s.ecc_uncorrected,
                             processes=public_processes(s, activity)))
    prev_held = prev.get("held_since") or {}
    held = {g["uuid"]: prev_held.get(g["uuid"], now) for g in gpus if is_held_idle(g, held_threshold_mib)}
    doc.update({"error": None, "last_seen": now, "gpus": gpus, "held_since": held, "unreachable_since": None,
                "activity": activity.to_dict() if activity is not None else None})
    if has_gpu:
        doc["history"] = _append_history(doc["history"], now, gpus)
    return doc
