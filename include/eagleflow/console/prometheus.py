"""The status documents in Prometheus' text format, GPU readings under dcgm-exporter's names.

An existing Grafana built on dcgm-exporter works unchanged: ``DCGM_FI_DEV_FB_USED``
and ``DCGM_FI_DEV_FB_FREE`` (MiB), ``DCGM_FI_DEV_GPU_UTIL`` (%),
``DCGM_FI_DEV_POWER_USAGE`` (W), ``DCGM_FI_DEV_GPU_TEMP`` (°C), labelled like
dcgm-exporter (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``).
A reading the driver did not give, or one from a node that could not be read
this time, is left out: an absent series is "unknown", a 0 would be a lie.
eagleflow's own series start with ``eagleflow_``.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, cast

from eagleflow.health.node_activity import eta_of_training
from eagleflow.health.status_doc import GpuEntry, StatusDoc, is_held_idle

Labels = dict[str, object]   # a series' labels: name -> value, written with str() (a None value is left out)

_DCGM = (("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda g: g.get("memory_used_mib")),
         ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).",
          lambda g: None if g.get("memory_used_mib") is None or g.get("memory_total_mib") is None
          else g["memory_total_mib"] - g["memory_used_mib"]),
         ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda g: g.get("utilization_pct")),
         ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda g: g.get("power_w")),
         ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda g: g.get("temperature_c")))


def _esc(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**kv: Any) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items() if v is not None) + "}"


def _num(v: float | int) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


class _Out:
    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, help_: str, kind: str, labels: Labels, value: float | int | None) -> None:
        if value is None:
            return
        fam = self.families.setdefault(name, (help_, kind, []))
        fam[2].append(f"{name}{_labels(**labels)} {_num(value)}")

    def text(self) -> str:
        out = []
        for name, (help_, kind, samples) in self.families.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(out) + "\n"


def _gpu_labels(doc: StatusDoc, g: GpuEntry) -> Labels:
    return {"gpu": g.get("index"), "UUID": g["uuid"], "device": f"nvidia{g.get('index')}",
            "modelName": g.get("name"), "Hostname": doc["node"]}


def render(docs: Iterable[dict[str, Any]], now: float | None = None,
           incidents: Iterable[dict[str, Any]] = ()) -> str:
    """``docs``: the status documents as ``StatusStore.all`` reads them back (each a ``StatusDoc``);
    ``incidents``: gpu_node_health's open ones (eagleflow.console.gpu_page.open_incidents)."""
    now = time.time() if now is None else now
    out = _Out()
    for inc in incidents:
        out.add("eagleflow_health_incident_open_seconds", "How long a gpu_node_health incident has been open.",
                "gauge", {"Hostname": inc.get("node"), "kind": inc.get("kind"), "incident": inc.get("id")},
                round(now - float(inc["opened_at"]), 1) if inc.get("opened_at") is not None else None)
    for doc in cast(Iterable[StatusDoc], docs):
        node = doc["node"]
        up = doc.get("error") is None
        out.add("eagleflow_node_up", "1 when gpu_node_health read the node at its last check, 0 when it could not.",
                "gauge", {"Hostname": node}, 1 if up else 0)
        out.add("eagleflow_node_last_seen_timestamp_seconds", "When the node was last read (unix time).", "gauge",
                {"Hostname": node}, doc.get("last_seen"))
        out.add("eagleflow_health_check_timestamp_seconds", "When gpu_node_health last checked the node.", "gauge",
                {"Hostname": node}, doc.get("checked_at"))
        verdicts = {a.get("kind") for a in doc.get("alerts") or []}
        verdict = "unreachable" if not up else ",".join(sorted(k for k in verdicts if k)) or "healthy"
        out.add("eagleflow_node_health_verdict", "gpu_node_health's verdict on the node at its last check (1 = this one).",
                "gauge", {"Hostname": node, "verdict": verdict}, 1)
        if up:
            for g in doc.get("gpus") or []:
                labels = _gpu_labels(doc, g)
                for name, help_, read in _DCGM:
                    out.add(name, help_, "gauge", labels, read(g))
                since = (doc.get("held_since") or {}).get(g["uuid"])
                if since is not None and is_held_idle(g, int(doc.get("held_threshold_mib") or 1024)):
                    out.add("eagleflow_gpu_held_idle_seconds", "How long the GPU has held memory at 0 % utilisation.",
                            "gauge", labels, round(now - float(since), 1))
                ours = sum(1 for p in g.get("processes") or [] if p.get("ours"))
                out.add("eagleflow_gpu_processes", "Compute processes on the GPU, eagleflow's and others'.", "gauge",
                        {**labels, "owner": "eagleflow"}, ours)
                out.add("eagleflow_gpu_processes", "Compute processes on the GPU, eagleflow's and others'.", "gauge",
                        {**labels, "owner": "other"}, len(g.get("processes") or []) - ours)
        act = doc.get("activity")
        for run_id, shards in ((act.get("shards") if act else None) or {}).items():
            for s in shards:
                labels = {"Hostname": node, "run_id": run_id, "shard": s["shard"]}
                out.add("eagleflow_shard_samples_done", "Samples stored by the shard's worker (resumed ones included).",
                        "gauge", labels, s.get("done"))
                out.add("eagleflow_shard_samples_total", "Samples assigned to the shard.", "gauge", labels,
                        s.get("total"))
                out.add("eagleflow_shard_state", "The shard worker's state from its heartbeat (1 = this one).",
                        "gauge", {**labels, "state": s.get("state")}, 1)
                out.add("eagleflow_shard_last_progress_timestamp_seconds", "When the shard last stored a sample.",
                        "gauge", labels, s.get("last_progress_at") or None)
        for run_id, t in ((act.get("training") if act else None) or {}).items():
            labels = {"Hostname": node, "run_id": run_id}
            out.add("eagleflow_train_step", "The trainer's last completed step.", "gauge", labels, t.get("step"))
            out.add("eagleflow_train_steps_total", "Steps the trainer runs (train.max_steps).", "gauge", labels,
                    t.get("total"))
            out.add("eagleflow_train_loss", "The trainer's loss at its last step.", "gauge", labels, t.get("loss"))
            out.add("eagleflow_train_acc_0", "The trainer's first-position accuracy at its last step.", "gauge",
                    labels, t.get("acc_0"))
            out.add("eagleflow_train_eta_seconds", "Seconds to the trainer's last step at its rate so far.", "gauge",
                    labels, eta_of_training(t))
        counts: dict[tuple[str, str], int] = {}
        for inc in (act.get("incidents") if act else None) or []:
            key = (str(inc.get("cause")), str(inc.get("outcome")))
            counts[key] = counts.get(key, 0) + 1
        for (cause, outcome), n in sorted(counts.items()):
            out.add("eagleflow_watchdog_incidents", "Watchdog incidents of the last 7 days by cause and outcome.",
                    "gauge", {"Hostname": node, "cause": cause, "outcome": outcome}, n)
    return out.text()
