"""Issue 26, break 1: a report forged in XCom must not run script on Airflow's origin.

Through the real path: Airflow's API server with the eagleflow plugin, a DAG run of eagle3_pipeline
created with Airflow's REST API, and XComs written with that same REST API (what anyone allowed to
write XComs on the DAG can do). A `report_html` under another task id is not served; the one under
run_report is served sandboxed (no script runs: checked in a real Chromium when it is installed),
never sniffed.
"""
from __future__ import annotations

import pytest

from tests.fixtures.api_server import start_api_server, stop_api_server
from tests.fixtures.browser import chromium  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DAG = "eagle3_pipeline"
SCRIPT = "<script>document.title = 'pwned'; fetch('/api/v2/connections')</script>"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = start_api_server(tmp_path_factory.mktemp("airflow-api"))
    try:
        yield server
    finally:
        stop_api_server(server.proc)


@pytest.fixture(scope="module")
def token(api) -> str:
    return api.token()


def _run(api, token, run_id: str) -> None:
    status, _, body = api.call(f"/api/v2/dags/{DAG}/dagRuns", "POST",
                               {"logical_date": None, "dag_run_id": run_id, "conf": {}}, token)
    assert status == 200, body


def _forge(api, token, run_id: str, task_id: str, html: str) -> None:
    status, _, body = api.call(f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries", "POST",
                               {"key": "report_html", "value": html}, token)
    assert status == 201, body   # Airflow's REST API lets any XCom writer of the DAG do this


def test_a_report_forged_under_another_task_is_not_served(api, token):
    _run(api, token, "forged_other_task")
    _forge(api, token, "forged_other_task", "write_run_config", "<h1>forged</h1>" + SCRIPT)
    status, headers, body = api.call(f"/eagleflow-gpu/report/{DAG}/forged_other_task", token=token, raw=True)
    assert status == 404 and "<h1>" not in body and "<script" not in body, (status, body)
    assert "run_report task" in body


def test_the_served_report_is_sandboxed_and_not_sniffed(api, token):
    _run(api, token, "forged_report_task")
    _forge(api, token, "forged_report_task", "run_report", "<h1>report</h1>" + SCRIPT)
    status, headers, body = api.call(f"/eagleflow-gpu/report/{DAG}/forged_report_task", token=token, raw=True)
    assert status == 200 and "<h1>report</h1>" in body
    csp = [d.strip() for d in headers["content-security-policy"].split(";")]
    assert "sandbox" in csp  # no allow-scripts, no allow-same-origin: an opaque origin without script
    assert "default-src 'none'" in csp and not any("script-src" in d for d in csp)
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["content-type"].startswith("text/html")


def test_the_report_still_needs_a_login(api):
    status, _, _ = api.call(f"/eagleflow-gpu/report/{DAG}/forged_report_task", raw=True)
    assert status == 401


def test_no_script_of_a_forged_report_runs_in_a_browser(api, token, chromium):  # noqa: F811
    """The forged run_report XCom opened as an admin would open the run's 'Run report' link."""
    _run(api, token, "forged_in_browser")
    _forge(api, token, "forged_in_browser", "run_report",
           "<!doctype html><html><head><title>report</title></head><body><h1 style='color:#2a7a2a'>report</h1>"
           + SCRIPT + "</body></html>")
    chromium.get(api.base + "/api/v2/version")   # the origin first, then its cookie, as after Airflow's login
    chromium.add_cookie({"name": "_token", "value": token, "path": "/"})
    chromium.get(f"{api.base}/eagleflow-gpu/report/{DAG}/forged_in_browser")
    assert chromium.find_element("tag name", "h1").text == "report"   # the page renders, inline style too
    assert chromium.title == "report", "the forged report's script ran"
    assert chromium.execute_script("return window.origin") == "null"  # sandboxed: not Airflow's origin
