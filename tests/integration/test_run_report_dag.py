"""The run_report task under dag.test(): a run that fails early still gets its report, and stays failed."""
from __future__ import annotations

from urllib.parse import quote

import pytest

from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import run_pipeline

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(600)
def test_failed_run_gets_a_report_and_stays_failed(tmp_path, airflow_db, demo_assets):
    from fastapi.testclient import TestClient

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{not json\n')
    cfg_path = write_short_config(tmp_path, demo_assets, corpus={"sources": [{"name": "bad", "path": str(bad)}]})
    dr, _ = run_pipeline(cfg_path, "failing")
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == "failed", states
    assert states["prepare_corpus"] == "failed" and states["run_report"] == "success", states

    report_ti = next(ti for ti in dr.get_task_instances() if ti.task_id == "run_report")
    assert report_ti.xcom_pull(task_ids="run_report", key="_link_RunReportLink") == \
        f"/eagleflow-gpu/report/eagle3_pipeline/{quote(dr.run_id, safe='')}"  # the task's "Run report" button
    html = (tmp_path / "runs" / "failing" / "report.html").read_text()
    assert "Did not succeed: " in html and "prepare_corpus (failed)" in html
    assert "No corpus statistics" in html and "No export" in html

    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from eagleflow.airflow.console_app import create_app
    am = create_auth_manager()
    am.init()
    token = am.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    c = TestClient(create_app())
    url = f"/report/eagle3_pipeline/{dr.run_id}"
    assert c.get(url).status_code == 401
    served = c.get(url, cookies={"_token": token})
    assert served.status_code == 200 and served.text == html
    assert c.get("/report/eagle3_pipeline/no-such-run", cookies={"_token": token}).status_code == 404
