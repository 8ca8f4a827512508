"""A run's mails link to the pages that explain them (issue 50), as gpu_node_health's do: the GPU view and the run
report besides the task log. Sent through the notifier to a real aiosmtpd server."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from tests.fixtures.smtp import SmtpSink, body_text

BASE = "https://airflow.corp.example/ml"
RUN_ID = "manual__2026-11-29T14:00:00+00:00"


@pytest.fixture
def smtp(monkeypatch):
    with SmtpSink() as sink:
        for k, v in sink.airflow_conn_env("smtp_test").items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AIRFLOW__API__BASE_URL", BASE + "/")
        yield sink


def _pipeline_like():
    """A DAG with the pipeline's run_report task (so its runs have a report) and a shard task."""
    from airflow.sdk import DAG

    from eagleflow.airflow.shard_operators import ShardOperator
    from eagleflow.airflow.report_operators import REPORT_TASK_ID, RunReportOperator
    with DAG("links_pipeline", schedule=None) as dag:
        shard = ShardOperator(phase="extract", task_id="extract_shard", shard=0)
        shard >> RunReportOperator(task_id=REPORT_TASK_ID)
    return dag, shard


def _context(tmp_path, dag, task):
    cfg = {"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "m"),
           "node": {"name": "gpu-node-1", "has_gpu": False},
           "watchdog": {"alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_test"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ti = SimpleNamespace(dag_id=dag.dag_id, run_id=RUN_ID, task_id="extract_shard", map_index=-1, try_number=1,
                         max_tries=2)
    return {"params": {"config_path": str(path)}, "run_id": RUN_ID, "ti": ti, "dag": dag, "task": task}


def _gpu_view_link_of_a_health_mail() -> str:
    from eagleflow.airflow.alerts import Recipients
    from eagleflow.airflow.health_operators import incident_mail
    d = SimpleNamespace(kind="opened", subject="s", detail="d",
                        incident={"id": "i1", "kind": "held", "opened_at": 0.0, "reminders": 0})
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="r", task_id="check_gpu_nodes", map_index=-1,
                         try_number=1)
    mail = incident_mail(d, Recipients(("a@example.test",), "smtp_test", BASE), {"ti": ti}, 60)
    return dict(mail.links)["GPU view"]


@pytest.mark.timeout(60)
def test_the_stall_mail_links_the_gpu_view_and_the_run_report(tmp_path, smtp):
    from eagleflow.airflow.alerts import mail_or_keep
    dag, shard = _pipeline_like()
    stall = {"status": "recovering", "verdict": "stalled", "cause": "capture_server",
             "subject": "[eagleflow] STALLED shard 0/2 on gpu-node-1", "job": "shard 0/2",
             "diagnosis": "STALLED shard 0/2 on gpu-node-1: no sample completed for 612 s",
             "incident": {"incident": "gpu-node-1-capture_server-1", "opened": True, "shards": {"0": "5/10"}}}
    assert mail_or_keep(_context(tmp_path, dag, shard), [], "stall", stall) == []
    msg = smtp.wait_for(lambda m: "STALLED" in m["Subject"])
    text = body_text(msg)
    gpu_view = _gpu_view_link_of_a_health_mail()
    assert gpu_view == f"{BASE}/plugin/eagleflow-gpu"           # the same page the health mails open
    report = f"{BASE}/eagleflow-gpu/report/links_pipeline/manual__2026-11-29T14%3A00%3A00%2B00%3A00"
    html = {p.get_content_type(): p.get_content() for p in msg.iter_parts()}["text/html"]
    for link in (gpu_view, report, f"{BASE}/dags/links_pipeline/runs/"):
        assert link in text, (link, text)
        assert f"href=\"{link}" in html, (link, html)
    assert "GPU view" in text and "Run report (written when the run ends)" in text and "Task log" in text


@pytest.mark.timeout(60)
def test_a_task_failure_mail_links_the_pages_too_and_the_report_only_where_the_dag_writes_one(tmp_path, smtp):
    from airflow.sdk import DAG

    from eagleflow.airflow.alerts import EagleflowNotifier
    from eagleflow.airflow.shard_operators import ShardOperator
    dag, shard = _pipeline_like()
    EagleflowNotifier("failure")({**_context(tmp_path, dag, shard), "exception": RuntimeError("disk check failed")})
    text = body_text(smtp.wait_for(lambda m: "FAILED" in m["Subject"]))
    assert f"{BASE}/plugin/eagleflow-gpu" in text and f"{BASE}/eagleflow-gpu/report/links_pipeline/" in text
    with DAG("no_report", schedule=None) as other:
        task = ShardOperator(phase="extract", task_id="extract_shard", shard=0)
    ctx = {**_context(tmp_path, other, task), "exception": RuntimeError("again")}
    EagleflowNotifier("failure")(ctx)
    text = body_text(smtp.wait_for(lambda m: "FAILED" in m["Subject"] and "no_report" in m["Subject"]))
    assert f"{BASE}/plugin/eagleflow-gpu" in text and "/report/" not in text
