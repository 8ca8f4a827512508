"""evaluate_draft under Airflow (dag.test()): a promoted draft emits the promoted-draft Asset event carrying the
draft's path and the acceptance table; a draft the gate refuses fails the run and emits nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures.corpus import write_config
from tests.fixtures.dag_bundle import load_bundle_dag

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DAG_FILE = """
from datetime import datetime

from airflow.sdk import DAG, Param, task

from eagleflow.airflow.corpus_operators import PrepareCorpusOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from eagleflow.airflow.train_operators import EvaluateDraftOperator


@task
def random_export(**context):
    from eagleflow.airflow.runtime import RunContext
    from pathlib import Path
    from tests.integration.test_evaluate_cli import write_random_export
    ctx = RunContext.from_airflow(context)
    return str(write_random_export(Path(str(ctx.layout.draft_dir)) / "export", ctx.cfg.target_model))


with DAG("evaluate_asset_test", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    write = WriteRunConfigOperator(task_id="write_run_config")
    prepare = PrepareCorpusOperator(task_id="prepare_corpus")
    evaluate = EvaluateDraftOperator(task_id="evaluate_draft")
    write >> prepare >> random_export() >> evaluate
"""


def _config(tmp_path: Path, demo_assets, name: str, min_accept: float) -> Path:
    p = write_config(tmp_path, demo_assets["target_model"], demo_assets["sources"], name=name,
                     corpus={"max_length": 256, "eval_fraction": 0.05, "eval_min_records": 2})
    data = yaml.safe_load(p.read_text())
    data["node"]["state_dir"] = str(tmp_path / "state")
    data["eval"] = {"max_prompts": 1, "max_new_tokens": 8, "configs": [{"steps": 3, "draft_tokens": 4}],
                    "min_accept_length": min_accept}
    p.write_text(yaml.safe_dump(data))
    return p


def _events():
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session

    from eagleflow.airflow.train_operators import PROMOTED_DRAFT_ASSET
    with create_session() as session:
        return [e.extra for e in session.query(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                .filter(AssetModel.uri == PROMOTED_DRAFT_ASSET.uri).all()]


def test_a_promoted_draft_emits_the_asset_event_a_refused_one_does_not(airflow_db, tmp_path, demo_assets,
                                                                       monkeypatch):
    passing = _config(tmp_path, demo_assets, "pass.yaml", 1.0)
    refusing = _config(tmp_path, demo_assets, "refuse.yaml", 3.0)
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "evaluate_asset_test.py",
                          f"CONFIG = {str(passing)!r}\n" + DAG_FILE)
    from eagleflow.airflow.train_operators import PROMOTED_DRAFT_ASSET
    assert [o.uri for o in dag.get_task("evaluate_draft").outlets] == [PROMOTED_DRAFT_ASSET.uri]
    before = len(_events())

    dr = dag.test()
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success", states
    run_dir = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir() and not p.name.startswith("."))
    [extra] = _events()[before:]
    assert extra["draft"] == str(run_dir / "draft" / "export") and extra["run_id"] == run_dir.name
    assert extra["eval_file"] == str(run_dir / "eval.json") and extra["node"] == "local"
    [row] = extra["table"]
    assert row["config"] == "3/1/4" and row["prompt_set"] == "held_out" and row["prompts"] == 1
    assert extra["accept_length"] == {"3/1/4": row["accept_length"]} and row["accept_length"] >= 1.0
    assert json.loads((tmp_path / "runs" / "promoted.json").read_text())["draft"] == extra["draft"]

    # the same random draft against a minimum it cannot reach: the run fails, no event
    dr = dag.test(run_conf={"config_path": str(refusing)})
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == "failed" and states["evaluate_draft"] == "failed", states
    assert len(_events()) == before + 1
