"""The GPU status page: the latest snapshot of each node, as HTML and JSON.

Served by the Airflow API server under /eagleflow-gpu (``fastapi_apps``). It
reads only what gpu_node_health stored (StatusStore): GPU readings, process
IDs, users and program names. It never opens a connection, never shows hosts,
logins, key paths or command-line arguments, and escapes every value.
Airflow serves plugin apps WITHOUT authentication: put it behind the same
proxy as the UI, or set EAGLEFLOW_GPU_PAGE_TOKEN to require
``Authorization: Bearer <token>``.
"""
from __future__ import annotations

import html
import os
import secrets
import time
from typing import Any

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import HTMLResponse

from eagleflow.gpu.health import StatusStore, public_process_name

try:  # the plugin registry only exists inside Airflow; the app itself is plain FastAPI
    from airflow.plugins_manager import AirflowPlugin
except ImportError:  # pragma: no cover
    AirflowPlugin = object  # type: ignore[assignment,misc]

URL_PREFIX = "/eagleflow-gpu"

_GPU_KEYS = ("index", "uuid", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "temperature_c",
             "power_w", "ecc_uncorrected", "taken_at")


def public_view(doc: dict[str, Any]) -> dict[str, Any]:
    """Only the fields meant for the page: an allow-list, so new fields never leak by default."""
    gpus = []
    for g in doc.get("gpus") or []:
        gpu = {k: g.get(k) for k in _GPU_KEYS}
        gpu["processes"] = [{"pid": p.get("pid"), "name": public_process_name(str(p.get("name") or "?")),
                             "used_mib": p.get("used_mib"), "user": p.get("user"), "state": p.get("state")}
                            for p in g.get("processes") or []]
        gpus.append(gpu)
    return {"node": doc.get("node"), "taken_at": doc.get("taken_at"), "gpus": gpus,
            "alerts": [str(a.get("message", "")) for a in doc.get("alerts") or []],
            "error": "GPUs could not be read (see the gpu_node_health task log)" if doc.get("error") else None}


def _cell(v: Any, unit: str = "") -> str:
    return "n/a" if v is None else html.escape(f"{v}{unit}")


def render_html(nodes: list[dict[str, Any]]) -> str:
    rows = []
    for n in nodes:
        age = "" if not n.get("taken_at") else f" ({time.time() - float(n['taken_at']):.0f} s ago)"
        rows.append(f"<h2>node {html.escape(str(n['node']))}{age}</h2>")
        if n["error"]:
            rows.append(f"<p class='err'>{html.escape(n['error'])}</p>")
        for a in n["alerts"]:
            rows.append(f"<p class='alert'>{html.escape(a)}</p>")
        rows.append("<table><tr><th>GPU</th><th>UUID</th><th>name</th><th>memory MiB</th><th>util</th>"
                    "<th>temp</th><th>power</th><th>ECC</th><th>processes</th></tr>")
        for g in n["gpus"]:
            procs = "<br>".join(f"{_cell(p['pid'])} {_cell(p['user'])} {_cell(p['name'])} {_cell(p['used_mib'], ' MiB')}"
                                for p in g["processes"]) or "none"
            rows.append(f"<tr><td>{_cell(g['index'])}</td><td>{_cell(g['uuid'])}</td><td>{_cell(g['name'])}</td>"
                        f"<td>{_cell(g['memory_used_mib'])} / {_cell(g['memory_total_mib'])}</td>"
                        f"<td>{_cell(g['utilization_pct'], ' %')}</td><td>{_cell(g['temperature_c'], ' C')}</td>"
                        f"<td>{_cell(g['power_w'], ' W')}</td><td>{_cell(g['ecc_uncorrected'])}</td>"
                        f"<td>{procs}</td></tr>")
        rows.append("</table>")
    body = "\n".join(rows) or "<p>No snapshot yet: the gpu_node_health DAG writes one every few minutes.</p>"
    return ("<!doctype html><html><head><meta charset='utf-8'><title>eagleflow GPUs</title><style>"
            "body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:collapse}"
            ".alert,.err{color:#b00}</style></head><body><h1>eagleflow: GPU nodes</h1>" + body + "</body></html>")


def create_app(status_dir: str | None = None) -> FastAPI:
    app = FastAPI(title="eagleflow GPU status", docs_url=None, redoc_url=None, openapi_url=None)

    def authorize(authorization: str | None) -> None:
        token = os.environ.get("EAGLEFLOW_GPU_PAGE_TOKEN")
        if token and not (authorization and secrets.compare_digest(authorization, f"Bearer {token}")):
            raise HTTPException(status_code=401, detail="this page needs Authorization: Bearer <token>")

    def nodes() -> list[dict[str, Any]]:
        return [public_view(d) for d in StatusStore(status_dir).all()]

    @app.get("/", response_class=HTMLResponse)
    def page(authorization: str | None = Header(default=None)) -> str:
        authorize(authorization)
        return render_html(nodes())

    @app.get("/api/status")
    def status(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        authorize(authorization)
        return {"nodes": nodes()}

    return app


class EagleflowGpuPlugin(AirflowPlugin):
    name = "eagleflow_gpu"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "eagleflow GPU status"}]
    external_views = [{"name": "GPU nodes", "href": URL_PREFIX + "/", "destination": "nav", "category": "browse",
                       "url_route": "eagleflow-gpu"}]
