"""gpu_node_health's trigger paths (issue 38, item 4): whoever may trigger the DAG named a config_paths entry that
does not exist and got a `config` incident mailed at once to every recipient, its subject carrying the path text
verbatim ("ACTION REQUIRED: ... re-authenticate at https://evil.example"), open until retention. Now a missing or
refused entry is a task error naming it: no incident, no mail (neither the incident's nor the failure callback's),
and the other configs' nodes are still checked. A config the deployment names itself that is missing is the check
failing (its own words, the DAG's failure mail), never an incident either.

Through the real operator (as tests/integration/test_gpu_health_operator.py runs it), the real SMTP notifier and
callback mail builder, and a real SMTP server (aiosmtpd).
"""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.fixtures.smtp import SmtpSink

PARAMS = {"memory_threshold_mib": 1024, "window_s": 1, "unreachable_after_s": 60, "remind_after_s": 3}
LURE = "configs/ACTION REQUIRED: your GPU quota expires, re-authenticate at https://evil.example.yaml"


def _health_task(status_dir):
    """The real DAG file's check task (so the failure callback sees its DAG), storing status under status_dir."""
    path = Path(__file__).resolve().parents[2] / "dags" / "gpu_node_health.py"
    spec = importlib.util.spec_from_file_location("gpu_node_health_trigger_paths_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    op = mod.dag.get_task("check_gpu_nodes")
    op.status_dir = str(status_dir)
    return op


def _context(params, op):
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="manual__2026-12-01T07:00:00+00:00",
                         task_id="check_gpu_nodes", map_index=-1, try_number=1, max_tries=1)
    return {"params": params, "ti": ti, "run_id": ti.run_id, "task": op}


def _cpu_config(tmp_path, conn_id):
    path = tmp_path / "cpu-box.yaml"
    path.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target_model": "unused",
        "node": {"name": "cpu-box", "has_gpu": False, "python": sys.executable, "state_dir": str(tmp_path / "state")},
        "watchdog": {"alert_emails": ["oncall@example.test"], "smtp_conn_id": conn_id}}))
    return path


def _no_mail_for_a_while(smtp: SmtpSink, seconds: float = 1.5) -> None:
    time.sleep(seconds)
    assert smtp.messages == [], [m["Subject"] for m in smtp.messages]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", [LURE, "/etc/passwd", "configs/../../../../etc/hostname"])
def test_a_missing_or_refused_trigger_path_is_a_task_error_never_an_incident_or_a_mail(entry, monkeypatch, tmp_path):
    from eagleflow.airflow.alerts import EagleflowNotifier, task_mail
    from eagleflow.health.status_store import StatusStore
    monkeypatch.delenv("EAGLEFLOW_HEALTH_CONFIGS", raising=False)
    monkeypatch.delenv("EAGLEFLOW_CONFIG", raising=False)
    params = {"config_paths": [str(_cpu_config(tmp_path, "smtp_trig")), entry], **PARAMS}
    op = _health_task(tmp_path / "status")
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_trig").items():
            monkeypatch.setenv(k, v)
        for _ in range(2):   # every check of that run: the same error, never a mail
            with pytest.raises(Exception) as e:
                op.execute(_context(params, op))
        _no_mail_for_a_while(smtp)
        store = StatusStore(tmp_path / "status")
        assert store.incidents() == {}, "a trigger's path opened an incident"
        from eagleflow.airflow.alerts import NotMailed
        from eagleflow.airflow.health_operators import HealthConfigPathRefused
        assert isinstance(e.value, HealthConfigPathRefused) and isinstance(e.value, NotMailed)
        assert repr(entry) in str(e.value) and "config_paths" in str(e.value)
        assert "Trigger gpu_node_health again" in str(e.value)   # what to do
        assert [d["node"] for d in store.all()] == ["cpu-box"]   # the other config's node was still checked
        # the DAG's failure callback (the real notifier and its mail builder) mails nothing for it either
        ctx = {**_context(params, op), "exception": e.value}
        assert task_mail(ctx, "failure") is None
        EagleflowNotifier("failure")(ctx)
        _no_mail_for_a_while(smtp, 1.0)


@pytest.mark.timeout(120)
def test_a_missing_config_the_deployment_names_is_the_check_failing_not_an_incident(monkeypatch, tmp_path):
    """The scheduled check's own list ($EAGLEFLOW_HEALTH_CONFIGS): a file gone is a task error naming it and the
    variable to fix, mailed as the check failing (the deployment's own words), never a `config` incident."""
    from eagleflow.airflow.alerts import task_mail
    from eagleflow.health.status_store import StatusStore
    good = _cpu_config(tmp_path, "smtp_dep")
    gone = tmp_path / "gpu-node-9.yaml"
    monkeypatch.setenv("EAGLEFLOW_HEALTH_CONFIGS", f"{good}:{gone}")
    params = {"config_paths": [str(good), str(gone)], **PARAMS}
    op = _health_task(tmp_path / "status")
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_dep").items():
            monkeypatch.setenv(k, v)
        with pytest.raises(Exception) as e:
            op.execute(_context(params, op))
        _no_mail_for_a_while(smtp)
        assert StatusStore(tmp_path / "status").incidents() == {}
    from eagleflow.airflow.health_operators import HealthConfigMissing
    assert isinstance(e.value, HealthConfigMissing)
    assert str(gone) in str(e.value) and "$EAGLEFLOW_HEALTH_CONFIGS" in str(e.value)
    mail = task_mail({**_context(params, op), "exception": e.value}, "failure")
    assert mail is not None and mail.subject == "[eagleflow] FAILED task check_gpu_nodes of gpu_node_health"
    assert mail.recipients.to == ("oncall@example.test",) and str(gone) in mail.evidence


@pytest.mark.timeout(120)
def test_an_existing_config_that_cannot_be_read_is_still_an_incident(monkeypatch, tmp_path):
    """The line drawn: a deployment's config file that exists but is broken is a finding on that node (one
    incident, one mail, resolved when fixed: tests/integration/test_gpu_health_operator.py), not a task error."""
    from eagleflow.airflow.health_operators import HealthIncidentsOpen
    broken = tmp_path / "gpu-node-7.yaml"
    broken.write_text("node: {name: gpu-node-7, has_gpu: yes\n")
    params = {"config_paths": [str(_cpu_config(tmp_path, "smtp_b")), str(broken)], **PARAMS}
    op = _health_task(tmp_path / "status")
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_b").items():
            monkeypatch.setenv(k, v)
        with pytest.raises(HealthIncidentsOpen, match="gpu-node-7.yaml cannot be read"):
            op.execute(_context(params, op))
        assert smtp.wait_for()["Subject"] == f"[eagleflow] node config {broken} cannot be read"
