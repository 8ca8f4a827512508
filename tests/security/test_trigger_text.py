"""Issue 52 item 3: the trigger form's free text never reaches the on-call mailbox in its own words.

`target_model` set to a phishing sentence failed the node's input check, and the FAILED mail carried the
sentence verbatim (the task's exception message: the preflight names each field with its value). Now a path
from the trigger holds only letters, digits and . _ - + / ~ (the form's pattern, and the run's first task
again whatever the form let in), refused naming the Param, not its value; and every mail of a run replaces
the text of its conf that no Param constrains (and any key that is no Param) by the Param's name.

Through the real DAGs under dag.test() (Airflow's Param validation, the real WriteRunConfigOperator and the
node's preflight, the pipeline's failure callback: the real notifier and mail builder) and a real SMTP server
(aiosmtpd). The DAG below is the pipeline's first task in a DAG whose Params are plain (no pattern), as a DAG
parsed with other settings than the worker's would be: what the worker itself refuses.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import pipeline_dag
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
PHISH = "URGENT: your account is locked, visit http://evil.example/reset"
SMTP_CONN = "smtp_trigger_text"

SMALL_DAG = '''
import sys
sys.path.insert(0, {repo!r})
from airflow.sdk import DAG, Param
from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator

with DAG("security_trigger_text", schedule=None, catchup=False, default_args=pipeline_failure_callbacks(),
         params={{"config_path": Param({cfg!r}, type="string"), "run_name": Param(None, type=["null", "string"]),
                  "target_model": Param(None, type=["null", "string"])}}) as dag:
    WriteRunConfigOperator(task_id="write_run_config", retries=0)
'''


@pytest.fixture
def deployment(tmp_path, monkeypatch, demo_assets):
    """A deployment whose config folder is <tmp>/configs, mailing oncall@example.test through a real SMTP server."""
    configs = tmp_path / "configs"
    configs.mkdir()
    cfg = write_short_config(configs, demo_assets,
                             watchdog={"alert_emails": ["oncall@example.test"], "smtp_conn_id": SMTP_CONN})
    monkeypatch.setenv("EAGLEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("EAGLEFLOW_CONFIG_DIRS", str(configs))
    monkeypatch.setenv("EAGLEFLOW_CONFIG", str(cfg))
    for var in ("EAGLEFLOW_HEALTH_CONFIGS", "EAGLEFLOW_NODE_CONN_IDS", "EAGLEFLOW_ALLOW_FORCE_FREE",
                "EAGLEFLOW_ALERT_DOMAINS"):
        monkeypatch.delenv(var, raising=False)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env(SMTP_CONN).items():
            monkeypatch.setenv(k, v)
        yield {"config": cfg, "smtp": smtp, "tmp": tmp_path}


def _small_dag(deployment, monkeypatch):
    return load_bundle_dag(monkeypatch, deployment["tmp"] / "bundle", "security_trigger_text.py",
                           SMALL_DAG.format(repo=str(REPO), cfg=str(deployment["config"])), keep_dags_folder=True)


def _failed_mail(dag, conf: dict, smtp: SmtpSink) -> tuple[str, str]:
    """Run ``dag`` with ``conf``: its first task fails; the FAILED mail's subject and every part of its body."""
    dr = dag.test(run_conf=conf)
    assert dr.state == "failed"
    msg = smtp.wait_for(lambda m: "FAILED task write_run_config" in m["Subject"], timeout_s=60)
    assert smtp.recipients[-1] == ["oncall@example.test"]   # the deployment's recipients
    parts = "\n".join(p.get_content() for p in msg.walk() if p.get_content_maintype() == "text")
    return msg["Subject"], body_text(msg) + "\n" + parts


def _no_trace_of(text: str, mail: str) -> None:
    for piece in (text, "evil.example", "account is locked", "URGENT"):
        assert piece not in mail, f"{piece!r} reached the mail:\n{mail}"


def test_the_form_refuses_a_target_model_that_is_no_path_before_the_run_starts(deployment, airflow_db):
    from airflow.sdk.definitions.param import ParamValidationError
    dag = pipeline_dag()
    assert dag.params.get_param("target_model").schema["pattern"]
    with pytest.raises(ParamValidationError, match="target_model"):
        dag.test(run_conf={"config_path": "configs/pipeline.yaml", "target_model": PHISH})
    assert deployment["smtp"].messages == []


def test_a_phishing_target_model_the_form_let_in_is_refused_and_the_mail_names_the_field(deployment, airflow_db,
                                                                                        monkeypatch):
    subject, mail = _failed_mail(_small_dag(deployment, monkeypatch), {"target_model": PHISH, "run_name": "phish"},
                                 deployment["smtp"])
    _no_trace_of(PHISH, subject + mail)
    assert "DAG Param target_model is refused" in mail and "value is not shown" in mail
    assert "trigger again" in mail


def test_a_path_that_fails_the_nodes_input_check_is_named_by_its_field_in_the_mail(deployment, airflow_db,
                                                                                  monkeypatch):
    """A plain path (the pattern lets it in) naming no model folder: the preflight names the field with its
    value, and the mail shows the field in its place."""
    lure = "URGENT-your-account-is-locked/visit-evil.example/reset"
    subject, mail = _failed_mail(_small_dag(deployment, monkeypatch), {"target_model": lure, "run_name": "lure"},
                                 deployment["smtp"])
    _no_trace_of(lure, subject + mail)
    assert "target_model = " in mail and "[DAG Param target_model, not shown]" in mail
    assert "does not exist on the node" in mail    # what is wrong is still said


def test_a_conf_key_that_is_no_param_is_not_mailed_either(deployment, airflow_db, monkeypatch):
    subject, mail = _failed_mail(_small_dag(deployment, monkeypatch), {PHISH: 1, "run_name": "key"},
                                 deployment["smtp"])
    _no_trace_of(PHISH, subject + mail)
    assert "unknown key(s) in the run's conf: '[a key of the run's conf, not shown]'" in mail


def test_the_trigger_text_is_replaced_as_written_and_as_a_message_quotes_it():
    """A value with quotes or a line break shows in an exception message as repr or JSON quotes it: those forms
    are replaced too."""
    import json

    from eagleflow.airflow.alerts import without_trigger_text
    text = "it's \"locked\"\nvisit evil.example"
    texts = {text: "[DAG Param target_model, not shown]"}
    for shown in (text, repr(text), json.dumps(text)):
        out = without_trigger_text(f"target_model = {shown}: does not exist", texts)
        assert "evil" not in out and "[DAG Param target_model, not shown]" in out, out
