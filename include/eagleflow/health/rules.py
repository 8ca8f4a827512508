"""Node health between runs: memory held at 0 % with nobody of ours on it, and rising ECC counts.

This is the seeds' incident seen from outside any run: ~90 GB per GPU held at
0 % utilisation for hours. ``assess`` is pure: it takes this reading, the
state kept from the previous ones (since when each GPU has looked like that,
the last ECC count) and which processes belong to a registered eagleflow job,
and returns alerts plus the new state. ``eagleflow.health.status_store``
keeps that state and the node's status document (the GPU view reads it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, TypedDict

from eagleflow.gpu.snapshot import GpuSnapshot


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


def registered_on(snap: GpuSnapshot, job_pids: AbstractSet[int], any_job_alive: bool) -> bool:
    """A registered eagleflow job holds this GPU: one of its processes is ours (pid or process group).

    With no process visible (PID namespaces), any live registered job on the node counts: better a
    missed alert here than paging someone about our own run, which the stall watchdog covers.
    """
    if not snap.processes:
        return any_job_alive
    return any(p.pid in job_pids or (p.pgid is not None and p.pgid in job_pids) for p in snap.processes)


class GpuHealth(TypedDict):
    """What the health check remembers of one GPU until the next check (a status document's ``state``, by UUID):
    since when it has held memory at 0 % with no job of ours, its last uncorrected ECC count."""
    held_idle_since: float | None
    ecc_uncorrected: int | None


def assess(node: str, snaps: list[GpuSnapshot], state: dict[str, GpuHealth], *, now: float, rules: HealthRules,
           job_pids: AbstractSet[int] = frozenset(),
           any_job_alive: bool = False) -> tuple[list[HealthAlert], dict[str, GpuHealth]]:
    alerts: list[HealthAlert] = []
    new_state: dict[str, GpuHealth] = {}
    for s in snaps:
        prev = state.get(s.uuid) or GpuHealth(held_idle_since=None, ecc_uncorrected=None)
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

