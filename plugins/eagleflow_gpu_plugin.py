"""eagleflow's Airflow plugin: the operator's console (GPU nodes view, Prometheus metrics).

The app (eagleflow.airflow.console_app) is mounted by the API server under
/eagleflow-gpu and checks Airflow's own login and DAG permissions on every
request; the menu entry (Browse -> GPU nodes) shows it in an iframe, which
sends the UI's session cookie. The run_report task's "Run report" extra link
opens /eagleflow-gpu/report/<dag_id>/<run_id>.
"""
from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from eagleflow.airflow.console_app import create_app
from eagleflow.airflow.report_operators import RunReportLink

URL_PREFIX = "/eagleflow-gpu"


class EagleflowGpuPlugin(AirflowPlugin):
    name = "eagleflow_gpu"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "eagleflow GPU nodes"}]
    external_views = [{"name": "GPU nodes", "href": URL_PREFIX + "/", "destination": "nav", "category": "browse",
                       "url_route": "eagleflow-gpu"}]
    operator_extra_links = [RunReportLink()]  # the run_report task's "Run report" button
