"""The operator's console as a FastAPI app, served by Airflow's API server (plugins/eagleflow_gpu_plugin.py).

Every route is behind Airflow's own authentication and authorisation: the
caller is resolved exactly as Airflow's core API does it
(``airflow.api_fastapi.core_api.security.get_user``: a bearer token, else the
UI's ``_token`` cookie, which the browser sends to this iframe'd page), then the
auth manager must allow reading the gpu_node_health DAG, whose checks are what
this app shows. A browser without a session is sent to Airflow's login page and
back; an API caller gets 401/403.

Routes: ``/`` the page (refreshes itself), ``/panel`` its body, ``/api/status``
JSON, ``/metrics`` Prometheus text (dcgm-exporter names), ``/report/<dag_id>/<run_id>``
a run's report (the run_report task's copy in XCom; needs read access to that DAG's XComs). Whoever may
write XComs can still post one under that task id: the sandboxing Content-Security-Policy it is served
under is what keeps a forged report from running script (the real one needs none).
"""
from __future__ import annotations

import time
from typing import Any, Callable, cast

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from eagleflow.console import gpu_page, prometheus
from eagleflow.health.airflow_health import AirflowHealth
from eagleflow.airflow.status_variables import variable_status_store
from eagleflow.health.status_store import StatusStore
from eagleflow.settings import env_positive

HEALTH_DAG_ID = gpu_page.HEALTH_DAG_ID
_PUBLIC_KEYS = ("node", "has_gpu", "checked_at", "last_seen", "unreachable_since", "error", "interval_s",
                "retention_s", "held_threshold_mib", "held_since", "gpus", "history", "activity", "alerts")
_bearer = HTTPBearer(auto_error=False)
# The report is static HTML (a <style> block, inline style attributes, inline SVG): it needs no script, so it is
# served sandboxed (no script, an opaque origin without Airflow's cookies or /api/v2) and never sniffed as
# another type: a report someone forged in XCom (Airflow's REST API can write XComs) cannot act as its reader.
REPORT_CSP = ("sandbox; default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'self'")
REPORT_HEADERS = {"Content-Security-Policy": REPORT_CSP, "X-Content-Type-Options": "nosniff",
                  "Referrer-Policy": "no-referrer"}


async def authorized_user(request: Request, bearer: HTTPAuthorizationCredentials | None = Depends(_bearer)):
    """Airflow's user for this request, allowed to read gpu_node_health; else HTTPException 401/403."""
    from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
    user = await get_user(request, None, bearer)
    requires_access_dag("GET", param_dag_id=HEALTH_DAG_ID)(request, user)
    return user


def health_dag_state() -> gpu_page.HealthDagState | None:
    """gpu_node_health as Airflow knows it (paused?), None when it is not loaded."""
    from sqlalchemy import select

    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    with create_session() as session:
        row = session.execute(select(DagModel.is_paused, DagModel.is_stale)
                              .where(DagModel.dag_id == HEALTH_DAG_ID)).first()
    if row is None or row.is_stale:
        return None
    return {"is_paused": bool(row.is_paused)}


def live_airflow_health() -> AirflowHealth:
    """What this API server's /api/v2/monitor/health answers, read in-process (the same function serves it);
    {"error": ...} when the metadata DB cannot be read."""
    try:
        from airflow.api.common.airflow_health import get_airflow_health
        return cast(AirflowHealth, {**get_airflow_health(), "read_at": time.time()})
    except Exception as e:  # noqa: BLE001 - the page must still render the nodes
        return {"error": f"{type(e).__name__}: {e}", "read_at": time.time()}


def refresh_s() -> float:
    return env_positive("EAGLEFLOW_GPU_VIEW_REFRESH_S", 15, unit="seconds")


def create_app(store: StatusStore | None = None,
               dag_state: Callable[[], gpu_page.HealthDagState | None] = health_dag_state,
               airflow_health: Callable[[], AirflowHealth] = live_airflow_health) -> FastAPI:
    app = FastAPI(title="eagleflow console", docs_url=None, redoc_url=None, openapi_url=None)
    refresh = refresh_s()  # a bad setting fails the plugin's load, with the variable named

    def the_store() -> StatusStore:
        if store is not None:
            return store
        return variable_status_store(in_task=False)

    def docs() -> list[dict[str, Any]]:
        return the_store().all()

    def panel() -> str:
        return gpu_page.render_panel(docs(), dag=dag_state(), incidents=the_store().incidents(),
                                     airflow=airflow_health())

    @app.get("/", response_class=HTMLResponse)
    async def page(request: Request, bearer: HTTPAuthorizationCredentials | None = Depends(_bearer)):
        try:
            await authorized_user(request, bearer)
        except HTTPException as e:
            if e.status_code == 401:
                from airflow.api_fastapi.app import get_auth_manager
                return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), status_code=303)
            return HTMLResponse("<p>Your Airflow user may not read the gpu_node_health DAG, whose checks this "
                                "page shows. Ask an Airflow admin for read access to it.</p>", status_code=e.status_code)
        # the panel's absolute URL under wherever the API server mounted this app
        return gpu_page.page_shell(panel(), refresh_s=refresh, panel_url=request.scope.get("root_path", "") + "/panel")

    @app.get("/panel", response_class=HTMLResponse, dependencies=[Depends(authorized_user)])
    def panel_route() -> str:
        return panel()

    @app.get("/api/status", dependencies=[Depends(authorized_user)])
    def status() -> dict[str, Any]:
        d, dag, now = docs(), dag_state(), time.time()
        return {"now": now, "health_dag": dag, "warnings": gpu_page.health_warnings(d, dag, now),
                "incidents": gpu_page.open_incidents(the_store().incidents()), "airflow": airflow_health(),
                "nodes": [{k: doc.get(k) for k in _PUBLIC_KEYS} for doc in d]}

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(authorized_user)])
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus.render(docs(), incidents=gpu_page.open_incidents(the_store().incidents())),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/report/{dag_id}/{run_id}", response_class=HTMLResponse)
    async def report(dag_id: str, run_id: str, request: Request,
                     bearer: HTTPAuthorizationCredentials | None = Depends(_bearer)):
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
        user = await get_user(request, None, bearer)
        requires_access_dag("GET", DagAccessEntity.XCOM)(request, user)  # dag_id from the path
        # lazy: airflow: the operators' module loads airflow.sdk, which this app (in the API server) never needs
        from eagleflow.airflow.report_operators import REPORT_TASK_ID
        html = stored_report(dag_id, run_id)
        if html is None:
            raise HTTPException(404, f"no report for run {run_id} of {dag_id} yet: its {REPORT_TASK_ID} task writes "
                                     "it when the run's other tasks are done")
        return HTMLResponse(html, headers=REPORT_HEADERS)

    return app


def stored_report(dag_id: str, run_id: str) -> str | None:
    """The newest report the run's run_report task pushed to XCom (only that task's: any task, or anyone
    allowed to write XComs on the DAG, can push a value under the same key)."""
    import json

    from sqlalchemy import select

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from eagleflow.airflow.report_operators import REPORT_TASK_ID, REPORT_XCOM_KEY  # lazy: airflow (airflow.sdk)
    with create_session() as session:
        value = session.scalars(select(XComModel.value).where(
            XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == REPORT_TASK_ID,
            XComModel.map_index == -1, XComModel.key == REPORT_XCOM_KEY)
            .order_by(XComModel.timestamp.desc()).limit(1)).first()
    if value is None:
        return None
    if isinstance(value, str) and not value.lstrip().startswith("<"):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return value if isinstance(value, str) else None
