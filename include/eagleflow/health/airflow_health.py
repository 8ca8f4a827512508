"""Airflow's own parts as its API server reports them: ``GET /api/v2/monitor/health``.

Airflow 3.3 answers (``airflow.api.common.airflow_health.get_airflow_health``)::

    {"metadatabase": {"status": "healthy"},
     "scheduler": {"status": "healthy" | "unhealthy", "latest_scheduler_heartbeat": ISO-8601 | null},
     "triggerer": {"status": "healthy" | "unhealthy" | null, "latest_triggerer_heartbeat": ...},
     "dag_processor": {"status": ..., "latest_dag_processor_heartbeat": ...}}

A part is healthy when its newest job's heartbeat is recent (Airflow's own
``is_alive``); ``null`` means no such job ever ran. The triggerer is the watch of
every deferred shard, so a triggerer that is not healthy is a part gone, as is
the scheduler, the DAG processor or the metadata DB. gpu_node_health reads the
endpoint each check and opens an incident per part gone; the GPU view shows
the parts (eagleflow.console.gpu_page). Standard library only (no Airflow import: a plain HTTP read).
"""
from __future__ import annotations

import json
import urllib.request
from datetime import datetime
from typing import Any, Mapping, TypedDict, cast

HEALTH_PATH = "/api/v2/monitor/health"
# (part, its heartbeat field, what it does for eagleflow: said in the incident)
PARTS = (("metadatabase", None, "Airflow's metadata DB: every part reads and writes it"),
         ("scheduler", "latest_scheduler_heartbeat", "schedules the tasks; without it no task starts or retries"),
         ("triggerer", "latest_triggerer_heartbeat", "runs the deferred watches of the shards and the trainer; "
                                                     "without it nothing looks at them (their sentinels mail)"),
         ("dag_processor", "latest_dag_processor_heartbeat", "parses the DAG files; without it DAG changes and "
                                                             "new DAGs are not seen"))


class AirflowPart(TypedDict, total=False):
    """A part in the answer: its status and (all but the DB) its newest job's heartbeat, ISO-8601 or null."""
    status: str | None
    latest_scheduler_heartbeat: str | None
    latest_triggerer_heartbeat: str | None
    latest_dag_processor_heartbeat: str | None


class AirflowHealth(TypedDict, total=False):
    """The endpoint's answer (an older API server names no dag_processor) as gpu_node_health keeps it: with
    ``read_at`` (when) and ``url``; ``error`` instead of the parts when it did not answer."""
    metadatabase: AirflowPart
    scheduler: AirflowPart
    triggerer: AirflowPart
    dag_processor: AirflowPart
    read_at: float
    url: str
    error: str


def fetch(base_url: str, timeout_s: float = 10.0) -> AirflowHealth:
    """The endpoint's answer (no sign-in: Airflow serves it to anyone); OSError or ValueError when it has none."""
    with urllib.request.urlopen(base_url.rstrip("/") + HEALTH_PATH, timeout=timeout_s) as r:
        doc = json.loads(r.read().decode("utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{base_url}{HEALTH_PATH} answered a JSON {type(doc).__name__}, not an object")
    return cast(AirflowHealth, doc)   # its parts are read with isinstance checks (parts)


def _ts(iso: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(iso)).timestamp() if iso else None
    except ValueError:
        return None


def parts(doc: AirflowHealth) -> list[dict[str, Any]]:
    """Each part: name, status ("healthy", "unhealthy", "never started", "not reported"), heartbeat_at, role."""
    out = []
    by_name: Mapping[str, object] = doc   # a part named by a variable; what the server sent is checked below
    for name, hb_field, role in PARTS:
        d = by_name.get(name)
        if not isinstance(d, dict):
            status = "not reported"   # an older API server has no dag_processor entry
            hb = None
        else:
            status = d.get("status") or "never started"
            hb = _ts(d.get(hb_field)) if hb_field else None
        out.append({"part": name, "status": str(status), "heartbeat_at": hb, "role": role,
                    "healthy": status == "healthy"})
    return out


def gone(doc: AirflowHealth) -> list[dict[str, Any]]:
    """The parts Airflow itself reports as not healthy (a part the endpoint does not name is not judged)."""
    return [p for p in parts(doc) if not p["healthy"] and p["status"] != "not reported"]

