"""Alert emails through the SMTP provider's notifier to a real aiosmtpd server: one mail path for all."""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import yaml

from eagleflow.airflow.alerts import (EagleflowNotifier, Mail, Recipients, pipeline_failure_callbacks, send_mail)
from eagleflow.watchdog.diagnosis import StallDetected
from tests.fixtures.smtp import SmtpSink, body_text


def _context(tmp_path, emails, exc, task=None):
    cfg = {"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "m"),
           "node": {"name": "gpu-node-1", "has_gpu": False},
           "watchdog": {"alert_emails": emails, "smtp_conn_id": "smtp_test",
                        "airflow_base_url": "http://airflow.example:8080"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ti = SimpleNamespace(dag_id="eagle3_pipeline", run_id="manual__2026-11-29T14:00:00+00:00",
                         task_id="extract_shard", map_index=3, try_number=1, max_tries=2)
    ctx = {"params": {"config_path": str(path)}, "run_id": ti.run_id, "ti": ti, "exception": exc}
    if task is not None:
        ctx["task"] = task
    return ctx


def _in_dag(make):
    """Operators as Airflow runs them: inside a DAG (here one with no config-freezing task)."""
    from airflow.sdk import DAG
    with DAG("alerts_test", schedule=None):
        return make()


def _parts(msg):
    return {p.get_content_type(): p.get_content() for p in msg.iter_parts()}


@pytest.fixture
def smtp(monkeypatch):
    with SmtpSink() as sink:
        for k, v in sink.airflow_conn_env("smtp_test").items():
            monkeypatch.setenv(k, v)
        yield sink


@pytest.mark.timeout(60)
def test_stall_mail_has_both_parts_the_diagnosis_and_the_tasks_own_retry_text(tmp_path, smtp):
    from eagleflow.airflow.shard_operators import ShardOperator
    diagnosis = ("STALLED shard 3/8 on gpu-node-1: no sample completed for 612 s (18,402/37,312 done, last at "
                 "14:02:11); server /health_generate timed out after 20 s\n\nGPUs:\n    0  90.1 GB / 95.6 GB  0 %")
    exc = StallDetected("[eagleflow] STALLED shard 3/8 on gpu-node-1", diagnosis)
    task = _in_dag(lambda: ShardOperator(phase="extract", task_id="extract_shard", shard=3, retry_delay=timedelta(seconds=90)))
    EagleflowNotifier("retry")(_context(tmp_path, ["oncall@example.test", "ml@example.test"], exc, task))
    msg = smtp.wait_for()
    assert msg["Subject"] == "[eagleflow] STALLED shard 3/8 on gpu-node-1"
    assert sorted(smtp.recipients[0]) == ["ml@example.test", "oncall@example.test"]
    assert msg.get_content_type() == "multipart/alternative"
    parts = _parts(msg)
    assert list(parts) == ["text/plain", "text/html"]   # plainest first (RFC 2046)
    link = ("http://airflow.example:8080/dags/eagle3_pipeline/runs/manual__2026-11-29T14%3A00%3A00%2B00%3A00"
            "/tasks/extract_shard/mapped/3?try_number=1")
    for body in parts.values():
        assert "no sample completed for 612 s (18,402/37,312 done, last at 14:02:11)" in body
        assert "90.1 GB / 95.6 GB" in body
        assert link in body or link.replace("&", "&amp;") in body
        assert "Airflow retries it in 90 s (try 1 failed of 3)" in body
        assert "resumes the shard from its manifest" in body   # the extraction descriptor's retry_advice (ShardOperator's)
    assert "<pre>" in parts["text/html"] and "<" not in parts["text/plain"].replace("<eagleflow", "")


@pytest.mark.timeout(60)
def test_retry_text_belongs_to_the_task_that_failed(tmp_path, smtp):
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator
    task = _in_dag(lambda: GpuNodeHealthOperator(task_id="check_gpu_nodes", retry_delay=timedelta(seconds=30)))
    EagleflowNotifier("retry")(_context(tmp_path, ["a@example.test"], RuntimeError("variable API down"), task))
    EagleflowNotifier("failure")(_context(tmp_path, ["a@example.test"], RuntimeError("variable API down"), task))
    retry, final = smtp.wait_for(lambda m: "RETRYING" in m["Subject"]), smtp.wait_for(lambda m: "FAILED" in m["Subject"])
    for m in (retry, final):
        assert "capture server" not in body_text(m) and "manifest" not in body_text(m)
    assert "Airflow retries it in 30 s" in body_text(retry)
    assert "health check itself failing" in body_text(final) and "final failure" in body_text(final)


@pytest.mark.timeout(60)
def test_links_start_at_airflows_configured_base_url(tmp_path, smtp, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.corp.example/ml/")
    EagleflowNotifier("failure")(_context(tmp_path, ["a@example.test"], RuntimeError("disk check failed")))
    body = _parts(smtp.wait_for())["text/plain"]
    assert "https://airflow.corp.example/ml/dags/eagle3_pipeline/runs/" in body
    assert "airflow.example:8080" not in body and "localhost" not in body


@pytest.mark.timeout(60)
def test_other_failures_are_mailed_and_no_recipients_sends_nothing(tmp_path, smtp, caplog):
    cb = pipeline_failure_callbacks()
    assert set(cb) == {"on_failure_callback", "on_retry_callback"}
    assert set(pipeline_failure_callbacks(retry_mail=False)) == {"on_failure_callback"}
    cb["on_failure_callback"](_context(tmp_path, ["a@example.test"], RuntimeError("disk check failed")))
    msg = smtp.wait_for()
    assert msg["Subject"] == "[eagleflow] FAILED task extract_shard[3] of eagle3_pipeline"
    assert "RuntimeError: disk check failed" in body_text(msg) and "final failure" in body_text(msg)
    caplog.set_level("INFO")
    cb["on_retry_callback"](_context(tmp_path, [], RuntimeError("x")))
    assert "no recipients configured" in caplog.text
    assert len(smtp.messages) == 1


@pytest.mark.timeout(60)
def test_template_fields_are_templates_rendered_per_mail_and_kept(tmp_path, smtp):
    """A DAG's own subject template wraps ours; the notifier can be used again (rendering works on a copy)."""
    n = EagleflowNotifier("failure", subject="[prod] {{ mail.subject }} ({{ ti.task_id }})")
    assert "text_content" in n.template_fields
    for word in ("first", "second"):
        n(_context(tmp_path, ["a@example.test"], RuntimeError(word)))
    subjects = [m["Subject"] for m in smtp.messages]
    assert subjects == ["[prod] [eagleflow] FAILED task extract_shard[3] of eagle3_pipeline (extract_shard)"] * 2
    assert "RuntimeError: first" in body_text(smtp.messages[0]) and "RuntimeError: second" in body_text(smtp.messages[1])
    assert n.subject.startswith("[prod] {{")


@pytest.mark.timeout(60)
def test_send_mail_carries_thread_headers_and_escapes_html(tmp_path, smtp):
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="scheduled__x", task_id="check_gpu_nodes", map_index=-1,
                         try_number=1)
    r = Recipients(("a@example.test",), "smtp_test", "http://af.example")
    send_mail({"ti": ti, "run_id": ti.run_id}, Mail(r, "gpu-node-1: <4> GPUs", "pid 1 `python3` & co",
                                                    headers={"Message-ID": "<eagleflow-incident-abc@x>"}))
    msg = smtp.wait_for()
    assert msg["Message-ID"] == "<eagleflow-incident-abc@x>"
    parts = _parts(msg)
    assert "&lt;4&gt; GPUs" in parts["text/html"] and "pid 1 `python3` &amp; co" in parts["text/html"]
    assert "gpu-node-1: <4> GPUs" in parts["text/plain"] and "pid 1 `python3` & co" in parts["text/plain"]


@pytest.mark.timeout(90)
def test_a_watch_mail_the_server_refuses_is_kept_backed_off_and_sent_once_in_order(tmp_path, smtp, monkeypatch):
    """SMTP refusing DATA (SMTPDataError) or no SMTP server at all (connection refused): the mail is kept, not
    raised; tried again only when due, the next one waits behind it; once the server takes mail, each goes once."""
    import json
    import time

    from eagleflow.airflow.alerts import MAIL_RETRY_FIRST_S, mail_or_keep, send_pending
    from eagleflow.watchdog.protocol import IncidentClose
    from tests.fixtures.smtp import free_port

    ctx = _context(tmp_path, ["oncall@example.test"], None)
    stall = {"status": "recovering", "verdict": "failed", "cause": "capture_server",
             "subject": "[eagleflow] FAILED shard 3/8 on gpu-node-1", "diagnosis": "FAILED shard 3/8 on gpu-node-1: x",
             "incident": {"incident": "gpu-node-1-capture_server-1", "opened": True, "shards": {"3": "5/10"}},
             "pending_mails": [{"not": "kept"}], "close_incidents": []}
    smtp.refusing.set()
    t0 = time.time()
    pending = mail_or_keep(ctx, [], "stall", stall)
    assert len(pending) == 1 and pending[0].tries == 1 and "SMTPDataError" in pending[0].error, pending
    assert pending[0].next_at >= t0 + MAIL_RETRY_FIRST_S and "pending_mails" not in pending[0].event
    refused = len(smtp.refused)
    assert refused >= 1

    # the incident ends while its first mail is still waiting: the end waits behind it, nothing is tried now
    over = {"status": "resumed", "job": "shard 3/8", "node": "gpu-node-1", "done": 6, "total": 10,
            "observed_at": t0 + 30, "summary": "HEALTHY shard 3/8"}
    close = IncidentClose(kind="stall", id="gpu-node-1-capture_server-1", subject="s", since=t0, done=5)
    pending = mail_or_keep(ctx, pending, "over", over, close)
    assert [p.kind for p in pending] == ["stall", "over"] and len(smtp.refused) == refused, "no flood"

    # due, and now no SMTP server at all (connection refused): kept again, backed off twice as long
    dead = {"conn_type": "smtp", "host": "127.0.0.1", "port": free_port(),
            "extra": {"disable_ssl": True, "disable_tls": True, "from_email": "e@example.test", "timeout": 5,
                      "retry_limit": 0}}
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_TEST", json.dumps(dead))
    due = pending[0].next_at
    pending = send_pending(ctx, pending, now=due)
    assert [p.kind for p in pending] == ["stall", "over"] and pending[0].tries == 2, pending
    assert pending[0].next_at == pytest.approx(due + 2 * MAIL_RETRY_FIRST_S)

    # the server is back: both go, once each, in order
    for k, v in smtp.airflow_conn_env("smtp_test").items():
        monkeypatch.setenv(k, v)
    smtp.refusing.clear()
    assert send_pending(ctx, pending, now=pending[0].next_at) == []
    subjects = [m["Subject"] for m in smtp.messages]
    assert subjects == ["[eagleflow] STALLED shard 3/8 on gpu-node-1 (failed: capture server)",
                        "[eagleflow] RECOVERED shard 3/8 on gpu-node-1: samples stored again (6/10), 30 s after the "
                        "stall was detected"], subjects


def test_a_stall_subject_names_the_server_of_the_shards_phase():
    """The server cause is one token for every phase; the subject names the phase's own server (the stall
    bench's generation cases once mailed "(failed: capture server)" for a killed generation server)."""
    from eagleflow.airflow.alerts import stall_subject
    gen = {"subject": "[eagleflow] FAILED generate shard 0/2 on n1", "verdict": "failed", "cause": "capture_server",
           "job": "generate shard 0/2"}
    assert stall_subject(gen) == "[eagleflow] STALLED generate shard 0/2 on n1 (failed: generation server)"
    ext = {**gen, "subject": "[eagleflow] DEAD shard 3/8 on n1", "verdict": "dead", "job": "shard 3/8"}
    assert stall_subject(ext) == "[eagleflow] STALLED shard 3/8 on n1 (dead: capture server)"
    assert stall_subject({**ext, "cause": "worker"}) == "[eagleflow] STALLED shard 3/8 on n1 (dead: worker)"
