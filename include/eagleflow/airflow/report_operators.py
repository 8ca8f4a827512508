"""The run report as the pipeline's last task: `eagleflow report` on the node, linked from the run.

``RunReportOperator`` hands the node what only Airflow knows (every task's
state in this run, the node's GPU history from the health checks), has the
node write ``<run_dir>/report.html``, logs where it is, and keeps a copy in
XCom so the console serves it: the task's "Run report" extra link opens
``/eagleflow-gpu/report/<dag_id>/<run_id>`` (behind Airflow's login). In the
DAG it is a teardown of write_run_config: it runs however the run went, and as
a teardown it never decides the run's outcome (the other leaves do).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.status_variables import variable_status_store
from eagleflow.console.run_report import REPORT_FILE

REPORT_XCOM_KEY = "report_html"
REPORT_TASK_ID = "run_report"  # the pipeline's task; the console serves this task's XCom and no other's
# A report is tens of KB; the metadata DB is not the place for a node's arbitrarily large file.
REPORT_MAX_BYTES = 8 * 1024 * 1024
CONSOLE_PREFIX = "/eagleflow-gpu"


def report_url(dag_id: str, run_id: str) -> str:
    return f"{CONSOLE_PREFIX}/report/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


class RunReportLink(BaseOperatorLink):
    name = "Run report"

    def get_link(self, operator, *, ti_key) -> str:
        return report_url(ti_key.dag_id, ti_key.run_id)


@dataclass
class ReportAnswer:
    path: str
    bytes: int


class RunReportOperator(RunOperator):
    ui_color = "#e0f7fa"
    operator_extra_links = (RunReportLink(),)

    def _task_states(self, context) -> dict[str, str]:
        ti = context["ti"]
        try:
            states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id, {})
        except Exception as e:  # the report is still worth writing without the states
            self.log.warning("task states of run %s not available for the report: %s", ti.run_id, e)
            return {}
        return {k: v for k, v in sorted(states.items()) if k != ti.task_id}

    def _gpu_history(self, ctx: RunContext) -> dict | None:
        try:
            return variable_status_store().load(ctx.cfg.node.name) or None
        except Exception as e:
            self.log.warning("GPU history of node %s not available for the report: %s", ctx.cfg.node.name, e)
            return None

    def run(self, ctx: RunContext, context):
        extras = {"tasks": self._task_states(context), "gpu": self._gpu_history(ctx)}
        ans = ctx.node.run_json(ctx.eagleflow_argv("report", "--extras", "-"), ReportAnswer,
                                input=json.dumps(extras), timeout=600)
        # the run directory's own report, whatever path the node's answer names: the node does not choose
        # which of its files reaches Airflow's DB and the console
        path = str(ctx.layout.run_dir / REPORT_FILE)
        if ans.path != path:
            self.log.warning("node %s answered report path %r; the run's report is %s, and only that file is "
                             "kept", ctx.node.name, ans.path, path)
        html = ctx.node.read_text(path)
        if html is not None and len(html.encode()) > REPORT_MAX_BYTES:
            self.log.warning("run report %s on node %s is %d bytes, over %d: not kept in XCom (read it on the "
                             "node)", path, ctx.node.name, len(html.encode()), REPORT_MAX_BYTES)
            html = None
        if html is not None:
            context["ti"].xcom_push(key=REPORT_XCOM_KEY, value=html)
        url = report_url(context["ti"].dag_id, context["ti"].run_id)
        self.log.info("run report: %s on node %s (%d bytes); in Airflow: %s (this task's 'Run report' link)",
                      path, ctx.node.name, ans.bytes, url)
        return {"report": path, "url": url}
