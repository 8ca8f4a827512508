"""Node health between runs: memory held at 0 % with nobody of ours on it, and rising ECC counts.

This is the seeds' incident seen from outside any run: ~90 GB per GPU held at
0 % utilisation for hours. ``assess`` is pure: it takes this reading, the
state kept from the previous ones (since when each GPU has looked like that,
the last ECC count) and which processes belong to a registered eagleflow job,
and returns alerts plus the new state. ``StatusStore`` keeps that state and
the latest snapshots per node on the control plane (the status page reads it).
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagleflow.durable import atomic_write

from .snapshot import GpuSnapshot


@dataclass(frozen=True)
class HealthAlert:
    node: str
    uuid: str
    index: int
    kind: str          # "memory_held_idle" | "ecc_rising"
    message: str


@dataclass(frozen=True)
class HealthRules:
    memory_threshold_mib: int = 1024
    window_s: float = 600.0


def registered_on(snap: GpuSnapshot, job_pids: set[int], any_job_alive: bool) -> bool:
    """A registered eagleflow job holds this GPU: one of its processes is ours (pid or process group).

    With no process visible (PID namespaces), any live registered job on the node counts: better a
    missed alert here than paging someone about our own run, which the stall watchdog covers.
    """
    if not snap.processes:
        return any_job_alive
    return any(p.pid in job_pids or (p.pgid is not None and p.pgid in job_pids) for p in snap.processes)


def assess(node: str, snaps: list[GpuSnapshot], state: dict[str, Any], *, now: float, rules: HealthRules,
           job_pids: set[int] = frozenset(), any_job_alive: bool = False) -> tuple[list[HealthAlert], dict[str, Any]]:
    alerts: list[HealthAlert] = []
    new_state: dict[str, Any] = {}
    for s in snaps:
        prev = state.get(s.uuid, {})
        held_idle = (s.memory_used_mib is not None and s.memory_used_mib > rules.memory_threshold_mib
                     and s.utilization_pct == 0 and not registered_on(s, job_pids, any_job_alive))
        since = None
        if held_idle:
            since = prev.get("held_idle_since")
            since = now if since is None else since
        if since is not None and now - since >= rules.window_s:
            procs = "; ".join(p.describe() for p in s.processes) or "no process listed (another container?)"
            alerts.append(HealthAlert(node, s.uuid, s.index, "memory_held_idle",
                                      f"node {node} {s.label}: {s.memory_used_mib} MiB held at 0 % utilisation for "
                                      f"{now - since:.0f} s (alert after {rules.window_s:.0f} s) and no eagleflow job "
                                      f"is registered on it; processes: {procs}"))
        last_ecc = prev.get("ecc_uncorrected")
        if s.ecc_uncorrected is not None and last_ecc is not None and s.ecc_uncorrected > last_ecc:
            alerts.append(HealthAlert(node, s.uuid, s.index, "ecc_rising",
                                      f"node {node} {s.label}: uncorrected ECC errors rose from {last_ecc} to "
                                      f"{s.ecc_uncorrected}; drain the GPU and check it (nvidia-smi -q -d ECC)"))
        new_state[s.uuid] = {"held_idle_since": since,
                             "ecc_uncorrected": s.ecc_uncorrected if s.ecc_uncorrected is not None else last_ecc}
    return alerts, new_state


def registered_jobs(node, state_dir: str) -> tuple[set[int], bool]:
    """PIDs and process groups of live eagleflow jobs recorded on the node, and whether any is alive."""
    from eagleflow.nodes.process_record import RecordList
    listed = node.run_json([node.python, "-m", "eagleflow.nodes.process_record", "list", "--pids-dir",
                            f"{state_dir}/pids"], RecordList, timeout=60)
    recs = [st.record for st in listed.records if st.alive and st.record is not None]
    return {r.pid for r in recs} | {r.pgid for r in recs}, bool(recs)


def _safe_name(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"


def public_process_name(name: str) -> str:
    """Only the program, never its arguments: command lines carry tokens, paths and user data."""
    first = (name or "?").strip().split(" ")[0]
    return os.path.basename(first) or "?"


def default_status_dir() -> Path:
    explicit = os.environ.get("EAGLEFLOW_GPU_STATUS_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("AIRFLOW_HOME") or "~/airflow").expanduser() / "eagleflow" / "gpu-status"


class StatusStore:
    """One JSON file per node: latest snapshots (process names reduced to the program), alerts, rule state."""

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder) if folder else default_status_dir()

    def path(self, node: str) -> Path:
        return self.folder / f"{_safe_name(node)}.json"

    def load(self, node: str) -> dict[str, Any]:
        try:
            return json.loads(self.path(node).read_text())
        except (OSError, ValueError):
            return {}

    def save(self, node: str, snaps: list[GpuSnapshot], state: dict[str, Any], alerts: list[HealthAlert],
             error: str | None = None) -> Path:
        gpus = []
        for s in snaps:
            d = s.to_dict()
            d["processes"] = [{"pid": p["pid"], "name": public_process_name(p["name"]), "used_mib": p["used_mib"],
                               "user": p["user"], "state": p["state"]} for p in d["processes"]]
            gpus.append(d)
        doc = {"node": node, "taken_at": time.time(), "gpus": gpus, "state": state,
               "alerts": [asdict(a) for a in alerts], "error": error}
        return atomic_write(self.path(node), json.dumps(doc, indent=1))

    def all(self) -> list[dict[str, Any]]:
        if not self.folder.is_dir():
            return []
        out = []
        for p in sorted(self.folder.glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out
