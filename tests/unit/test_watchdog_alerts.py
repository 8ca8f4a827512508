"""Alert emails through the SMTP provider's notifier to a real aiosmtpd server."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from eagleflow.airflow.alerts import PipelineAlertNotifier, pipeline_failure_callbacks
from eagleflow.watchdog.diagnosis import StallDetected
from tests.fixtures.smtp import SmtpSink, body_text


def _context(tmp_path, emails, exc):
    cfg = {"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "m"),
           "node": {"name": "gpu-node-1", "has_gpu": False},
           "watchdog": {"alert_emails": emails, "smtp_conn_id": "smtp_test",
                        "airflow_base_url": "http://airflow.example:8080"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ti = SimpleNamespace(dag_id="eagle3_pipeline", run_id="manual__2026-11-29T14:00:00+00:00",
                         task_id="extract_shard", map_index=3, try_number=1, max_tries=2)
    return {"params": {"config_path": str(path)}, "run_id": ti.run_id, "ti": ti, "exception": exc}


@pytest.mark.timeout(60)
def test_stall_mail_has_the_subject_diagnosis_gpu_table_and_log_link(tmp_path, monkeypatch):
    diagnosis = ("STALLED shard 3/8 on gpu-node-1: no sample completed for 612 s (18,402/37,312 done, last at "
                 "14:02:11); server /health_generate timed out after 20 s\n\nGPUs:\n    0  90.1 GB / 95.6 GB  0 %")
    exc = StallDetected("[eagleflow] STALLED shard 3/8 on gpu-node-1", diagnosis)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_test").items():
            monkeypatch.setenv(k, v)
        PipelineAlertNotifier("retry")(_context(tmp_path, ["oncall@example.test", "ml@example.test"], exc))
        msg = smtp.wait_for()
    assert msg["Subject"] == "[eagleflow] STALLED shard 3/8 on gpu-node-1"
    assert sorted(smtp.recipients[0]) == ["ml@example.test", "oncall@example.test"]
    body = body_text(msg)
    assert "no sample completed for 612 s (18,402/37,312 done, last at 14:02:11)" in body
    assert "90.1 GB / 95.6 GB" in body
    assert ("http://airflow.example:8080/dags/eagle3_pipeline/runs/manual__2026-11-29T14%3A00%3A00%2B00%3A00"
            "/tasks/extract_shard/mapped/3?try_number=1") in body
    assert "Airflow retries it" in body


@pytest.mark.timeout(60)
def test_other_failures_are_mailed_and_no_recipients_sends_nothing(tmp_path, monkeypatch, caplog):
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_test").items():
            monkeypatch.setenv(k, v)
        cb = pipeline_failure_callbacks()
        assert set(cb) == {"on_failure_callback", "on_retry_callback"}
        cb["on_failure_callback"](_context(tmp_path, ["a@example.test"], RuntimeError("disk check failed")))
        msg = smtp.wait_for()
        assert msg["Subject"] == "[eagleflow] FAILED task extract_shard[3] of eagle3_pipeline"
        assert "RuntimeError: disk check failed" in body_text(msg) and "final failure" in body_text(msg)
        caplog.set_level("INFO")
        cb["on_retry_callback"](_context(tmp_path, [], RuntimeError("x")))
        assert "no recipients configured" in caplog.text
        assert len(smtp.messages) == 1
