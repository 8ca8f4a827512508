"""The run's config is resolved once, by its first task, and frozen: editing the YAML mid-run changes nothing.

A small DAG under dag.test(): the real WriteRunConfigOperator freezes the config (a relative config_path
resolved against $EAGLEFLOW_HOME, not the worker's cwd, with a Param override), a task then rewrites the
YAML, and the later tasks (the real PlanShardsOperator, a task reading RunContext.from_airflow, and a
trigger's RunRef) still see the frozen values.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.pipeline_config import write_short_config

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

DAG_FILE = '''
import sys
sys.path.insert(0, {repo!r})
import yaml
from airflow.sdk import DAG, Param, task
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from eagleflow.airflow.shard_operators import PlanShardsOperator
from eagleflow.airflow.runtime import RunContext

with DAG("frozen_run_config", schedule=None, catchup=False,
         params={{"config_path": Param({rel!r}, type="string"), "shards": Param(None, type=["null", "integer"]),
                  "run_name": Param(None, type=["null", "string"])}}) as dag:
    first = WriteRunConfigOperator(task_id="write_run_config")

    @task
    def edit_yaml():
        """Someone edits the YAML while the run goes on."""
        data = yaml.safe_load(open({abs_cfg!r}))
        data["capture"]["shards"] = 7
        data["run_root"] = "/nonexistent/elsewhere"
        open({abs_cfg!r}, "w").write(yaml.safe_dump(data))

    @task
    def read_back(**context):
        ctx = RunContext.from_airflow(context)
        again = RunContext.from_serialized(ctx.serialize())   # what a trigger rebuilds from its payload
        return {{"shards": ctx.cfg.capture.shards, "run_dir": str(ctx.layout.run_dir),
                 "trigger_shards": again.cfg.capture.shards, "trigger_run_dir": str(again.layout.run_dir),
                 "payload": ctx.serialize()}}

    first >> edit_yaml() >> [PlanShardsOperator(phase="extract", task_id="plan_shards"), read_back()]
'''


@pytest.mark.timeout(300)
def test_later_tasks_read_the_frozen_config_not_the_edited_yaml(airflow_db, demo_assets, monkeypatch, tmp_path):
    home = tmp_path / "project"
    (home / "cfgs").mkdir(parents=True)
    cfg_path = write_short_config(home / "cfgs", demo_assets)   # run_root etc. absolute inside
    monkeypatch.setenv("EAGLEFLOW_HOME", str(home))
    rel = str(cfg_path.relative_to(home))
    dag = load_bundle_dag(monkeypatch, tmp_path / "bundle", "frozen_run_config.py",
                          DAG_FILE.format(repo=str(REPO), rel=rel, abs_cfg=str(cfg_path)), keep_dags_folder=True)
    run_root = yaml.safe_load(cfg_path.read_text())["run_root"]

    dr = dag.test(run_conf={"config_path": rel, "shards": 3, "run_name": "frozen"})
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert dr.state == "success", {k: v.state for k, v in tis.items()}
    assert yaml.safe_load(cfg_path.read_text())["capture"]["shards"] == 7       # the YAML was edited mid-run
    assert tis["plan_shards"].xcom_pull(task_ids="plan_shards") == [0, 1, 2]  # ...but the run kept its 3 shards
    seen = tis["read_back"].xcom_pull(task_ids="read_back")
    run_dir = str(Path(run_root) / "frozen")
    assert seen["shards"] == seen["trigger_shards"] == 3
    assert seen["run_dir"] == seen["trigger_run_dir"] == run_dir
    frozen_file = Path(run_dir) / "run-config.json"
    assert json.loads(frozen_file.read_text())["capture"]["shards"] == 3
    # a trigger carries only how to find the run again, the frozen control-plane settings and the watch's
    # hints, the frozen run's too (3 shards, not the edited YAML's 7)
    from eagleflow.airflow.runtime import CONTROL_PLANE_FIELDS, WATCH_HINT_FIELDS
    control, hints = seen["payload"].pop("control"), seen["payload"].pop("watch")
    assert seen["payload"] == {"conn_id": None, "run_config": str(frozen_file), "run_id": "frozen"}
    assert set(control) == set(CONTROL_PLANE_FIELDS)
    assert set(hints) == set(WATCH_HINT_FIELDS) and hints["capture.shards"] == 3


def test_a_relative_config_path_never_depends_on_the_cwd(demo_assets, monkeypatch, tmp_path):
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.config import ConfigError

    home = tmp_path / "project"
    (home / "cfgs").mkdir(parents=True)
    cfg_path = write_short_config(home / "cfgs", demo_assets)
    rel = str(cfg_path.relative_to(home))
    monkeypatch.chdir(home)                      # the cwd would find it...
    monkeypatch.setenv("EAGLEFLOW_HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match=r"resolved against the project root .*elsewhere.*EAGLEFLOW_HOME"):
        RunContext.from_params({"config_path": rel}, "r")
    monkeypatch.chdir(tmp_path)                  # ...and the project root does, from any cwd
    monkeypatch.setenv("EAGLEFLOW_HOME", str(home))
    assert RunContext.from_params({"config_path": rel}, "r").cfg.capture.shards >= 1
