"""Issue 26, breaks 2 and 5: what a person who may trigger a DAG can make it read, where it runs, what it kills.

Through the real DAGs under dag.test() (Airflow's Param validation, the real WriteRunConfigOperator and
GpuNodeHealthOperator): a config_path outside the deployment's config folders, with '..' or through a
symbolic link is refused, naming the path, never printing the file; a file that is not a config names
its unknown keys without their values; a node connection the deployment does not list and force-freeing
the deployment does not allow are refused.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import pipeline_dag

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
SECRET = "S3cretPassw0rd"

# The pipeline's own first task in a DAG whose Params are plain (no form enum): what the worker itself refuses
# when a conf reaches it unchecked (a DAG parsed with other settings than the worker's).
SMALL_DAG = '''
import sys
sys.path.insert(0, {repo!r})
from airflow.sdk import DAG, Param
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator

with DAG("security_trigger_params", schedule=None, catchup=False,
         params={{"config_path": Param({cfg!r}, type="string"), "run_name": Param(None, type=["null", "string"]),
                  "node_conn_id": Param(None, type=["null", "string"]),
                  "force_free_gpus": Param(False, type="boolean"),
                  "alert_emails": Param(None, type=["null", "array"], items={{"type": "string"}})}}) as dag:
    WriteRunConfigOperator(task_id="write_run_config", retries=0)
'''


@pytest.fixture
def deployment(tmp_path, monkeypatch, demo_assets):
    """A deployment whose only config folder is <tmp>/configs (one valid config there); a secret beside it."""
    configs = tmp_path / "configs"
    configs.mkdir()
    cfg = write_short_config(configs, demo_assets)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.json"
    secret.write_text(json.dumps({"admin": SECRET}))
    monkeypatch.setenv("EAGLEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("EAGLEFLOW_CONFIG_DIRS", str(configs))
    monkeypatch.setenv("EAGLEFLOW_CONFIG", str(cfg))   # the deployment's own config (the DAG parses with it)
    for var in ("EAGLEFLOW_HEALTH_CONFIGS", "EAGLEFLOW_NODE_CONN_IDS", "EAGLEFLOW_ALLOW_FORCE_FREE",
                "EAGLEFLOW_ALERT_DOMAINS"):
        monkeypatch.delenv(var, raising=False)
    return {"configs": configs, "config": cfg, "secret": secret}


def _refused(dag, conf: dict, capfd) -> str:
    """Run ``dag`` with ``conf``: its first task fails at once, nothing runs after it; its log text."""
    dr = dag.test(run_conf=conf)
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert dr.state == "failed"
    assert tis["write_run_config"].state == "failed" and tis["write_run_config"].try_number == 1
    assert all(ti.state != "success" for k, ti in tis.items() if k != "write_run_config"), \
        {k: ti.state for k, ti in tis.items()}
    out = capfd.readouterr()
    return out.out + out.err


def _small_dag(tmp_path, monkeypatch, cfg: Path):
    return load_bundle_dag(monkeypatch, tmp_path / "bundle", "security_trigger_params.py",
                           SMALL_DAG.format(repo=str(REPO), cfg=str(cfg)), keep_dags_folder=True)


# ------------------------------------------------------------------------------- break 2: config_path
def test_an_absolute_config_path_outside_the_config_folders_is_refused_unread(deployment, airflow_db, capfd):
    log = _refused(pipeline_dag(), {"config_path": str(deployment["secret"]), "run_name": "abs"}, capfd)
    assert f"config_path = {str(deployment['secret'])!r}" in log and "outside the allowed config folders" in log
    assert "EAGLEFLOW_CONFIG_DIRS" in log
    assert SECRET not in log


def test_dot_dot_and_a_symbolic_link_out_are_refused(deployment, airflow_db, capfd, tmp_path):
    dag = pipeline_dag()
    log = _refused(dag, {"config_path": "configs/../outside/secret.json", "run_name": "dotdot"}, capfd)
    assert "'..' is not allowed" in log and SECRET not in log
    link = deployment["configs"] / "innocent.yaml"
    link.symlink_to(deployment["secret"])
    log = _refused(dag, {"config_path": "configs/innocent.yaml", "run_name": "link"}, capfd)
    assert "symbolic link" in log and str(deployment["secret"]) in log and SECRET not in log


def test_a_file_that_is_no_config_names_its_keys_not_their_values(deployment, airflow_db, capfd):
    """Even inside the config folder (someone dropped a credentials file there): keys, never values."""
    (deployment["configs"] / "creds.yaml").write_text(json.dumps({"admin": SECRET, "target_model": "/m"}))
    (deployment["configs"] / "broken.yaml").write_text(f"target_model: /m\npassword: {SECRET}: x\n")
    dag = pipeline_dag()
    log = _refused(dag, {"config_path": "configs/creds.yaml", "run_name": "creds"}, capfd)
    assert "admin: unknown field" in log and SECRET not in log
    log = _refused(dag, {"config_path": "configs/broken.yaml", "run_name": "broken"}, capfd)
    assert "not valid YAML at line 2" in log and SECRET not in log


def test_the_health_check_refuses_a_config_path_outside_and_stores_no_content(deployment, airflow_db, capfd,
                                                                            monkeypatch):
    monkeypatch.setenv("EAGLEFLOW_GPU_HEALTH_EVERY_MIN", "1")
    spec = importlib.util.spec_from_file_location("gpu_node_health_security", REPO / "dags" / "gpu_node_health.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dr = mod.dag.test(run_conf={"config_paths": [str(deployment["secret"])]})
    # a refused trigger path is the task's error, naming it: never an incident (nor a mail) whose words the
    # trigger chose (issue 38 item 4)
    assert dr.state == "failed"
    log = capfd.readouterr().out
    assert str(deployment["secret"]) in log and "outside the allowed config folders" in log, log[-3000:]
    from eagleflow.airflow.status_variables import variable_status_store
    book = variable_status_store(in_task=False).incidents()
    assert not [r for r in book.values() if str(deployment["secret"]) in json.dumps(r)], book
    assert SECRET not in json.dumps(book) and SECRET not in log


# ------------------------------------------------------------------------------- break 5: the node, force-free
def test_a_node_connection_the_deployment_does_not_list_is_refused(deployment, airflow_db, capfd, tmp_path,
                                                                   monkeypatch):
    from airflow.sdk.definitions.param import ParamValidationError
    monkeypatch.setenv("EAGLEFLOW_NODE_CONN_IDS", "gpu_node_a,gpu_node_b")
    dag = pipeline_dag()   # the form offers only the listed connections
    assert dag.params.get_param("node_conn_id").schema["enum"] == [None, "gpu_node_a", "gpu_node_b"]
    with pytest.raises(ParamValidationError, match="node_conn_id"):
        dag.test(run_conf={"config_path": "configs/pipeline.yaml", "node_conn_id": "someone_elses_host"})
    # and the worker refuses it too, whatever the form let through
    small = _small_dag(tmp_path, monkeypatch, deployment["config"])
    log = _refused(small, {"node_conn_id": "someone_elses_host", "run_name": "conn"}, capfd)
    assert "node_conn_id = 'someone_elses_host' is refused" in log and "'gpu_node_a', 'gpu_node_b'" in log
    assert "EAGLEFLOW_NODE_CONN_IDS" in log
    assert not (tmp_path / "configs" / "runs" / "conn").exists()


def test_force_free_from_the_form_is_refused_unless_the_deployment_allows_it(deployment, airflow_db, capfd,
                                                                            tmp_path, monkeypatch):
    log = _refused(pipeline_dag(), {"config_path": "configs/pipeline.yaml", "force_free_gpus": True,
                                     "run_name": "force"}, capfd)
    assert "force_free_gpus = true is refused" in log and "EAGLEFLOW_ALLOW_FORCE_FREE" in log
    assert not (Path(yaml.safe_load(deployment["config"].read_text())["run_root"]) / "force").exists()

    monkeypatch.setenv("EAGLEFLOW_ALLOW_FORCE_FREE", "1")   # the deployment's own choice
    small = _small_dag(tmp_path, monkeypatch, deployment["config"])
    dr = small.test(run_conf={"force_free_gpus": True, "run_name": "forced"})
    assert dr.state == "success"
    run_dir = Path(yaml.safe_load(deployment["config"].read_text())["run_root"]) / "forced"
    assert json.loads((run_dir / "run-config.json").read_text())["gpu"]["force_free"] is True


def test_alert_recipients_outside_the_deployments_domains_are_refused(deployment, airflow_db, capfd, tmp_path,
                                                                      monkeypatch):
    """A run's mails carry its diagnosis: the form may not route them to any address it likes."""
    monkeypatch.setenv("EAGLEFLOW_ALERT_DOMAINS", "ml.example.com")
    small = _small_dag(tmp_path, monkeypatch, deployment["config"])
    log = _refused(small, {"alert_emails": ["someone@elsewhere.net"], "run_name": "mail"}, capfd)
    assert "'someone@elsewhere.net' is refused" in log and "ml.example.com" in log and "EAGLEFLOW_ALERT_DOMAINS" in log
    run_root = Path(yaml.safe_load(deployment["config"].read_text())["run_root"])
    assert not (run_root / "mail").exists()
    dr = small.test(run_conf={"alert_emails": ["oncall@ml.example.com"], "run_name": "mail-ok"})
    assert dr.state == "success"
    frozen = json.loads((run_root / "mail-ok" / "run-config.json").read_text())
    assert frozen["watchdog"]["alert_emails"] == ["oncall@ml.example.com"]


def test_the_demo_config_still_passes(deployment, monkeypatch):
    """configs/ of the project stays allowed by default (no EAGLEFLOW_CONFIG_DIRS set)."""
    from eagleflow.airflow.runtime import checked_config_path
    monkeypatch.delenv("EAGLEFLOW_CONFIG_DIRS")
    monkeypatch.setenv("EAGLEFLOW_HOME", str(REPO))
    assert checked_config_path("configs/local-demo.yaml", "f") == REPO / "configs" / "local-demo.yaml"
    assert checked_config_path(str(REPO / "configs" / "local-demo.yaml"), "f").is_file()
    with pytest.raises(Exception, match="outside the allowed config folders"):
        checked_config_path(os.devnull, "f")
