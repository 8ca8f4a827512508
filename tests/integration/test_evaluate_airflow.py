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


APPROVAL_DAG_FILE = """
from datetime import datetime

from airflow.sdk import DAG, Param, task

from eagleflow.airflow.approval_operators import ApprovePromotionOperator
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


with DAG("evaluate_approval_test", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    write = WriteRunConfigOperator(task_id="write_run_config")
    prepare = PrepareCorpusOperator(task_id="prepare_corpus")
    evaluate = EvaluateDraftOperator(task_id="evaluate_draft", outlets=[])
    approve = ApprovePromotionOperator(task_id="approve_promotion")
    write >> prepare >> random_export() >> evaluate >> approve
"""


class _User:
    """Who answers: what Airflow's auth manager hands the HITL route (get_id, get_name)."""

    def __init__(self, name: str):
        self.name = name

    def get_id(self) -> str:
        return self.name

    def get_name(self) -> str:
        return self.name


def answer_when_asked(dag_id: str, option: str, user: str, reason: str, seen: dict, timeout_s: float = 400):
    """A person answering under Required Actions: once approve_promotion waits (awaiting_input), its request is
    answered through Airflow's own HITL route (PATCH .../hitlDetails, the handler the UI calls), which records
    the answer and resumes the task. ``seen`` gets the request's subject and body."""
    import time

    from airflow.api_fastapi.core_api.datamodels.hitl import UpdateHITLDetailPayload
    from airflow.api_fastapi.core_api.routes.public.hitl import update_hitl_detail
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy.orm import joinedload

    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline:
            with create_session() as session:
                ti = session.query(TaskInstance).options(joinedload(TaskInstance.hitl_detail)).filter(
                    TaskInstance.dag_id == dag_id, TaskInstance.task_id == "approve_promotion",
                    TaskInstance.state == TaskInstanceState.AWAITING_INPUT).first()
                if ti is not None:
                    seen.update(subject=ti.hitl_detail.subject, body=ti.hitl_detail.body,
                                options=list(ti.hitl_detail.options), defaults=ti.hitl_detail.defaults,
                                params=dict(ti.hitl_detail.params or {}), run_id=ti.run_id)
                    update_hitl_detail(dag_id=dag_id, dag_run_id=ti.run_id, task_id="approve_promotion",
                                       update_hitl_detail_payload=UpdateHITLDetailPayload(
                                           chosen_options=[option], params_input={"reason": reason}),
                                       user=_User(user), session=session)
                    return
            time.sleep(1)
        seen["error"] = "approve_promotion never waited for an answer"
    except Exception as e:   # said in the test's failure, not lost in this thread
        import traceback
        seen["error"] = f"{e!r}\n{traceback.format_exc()}"
    # dag.test() waits for a parked task as long as it is parked: end it, so the run ends and the test says why
    with create_session() as session:
        for ti in session.query(TaskInstance).filter(TaskInstance.dag_id == dag_id,
                                                     TaskInstance.state == TaskInstanceState.AWAITING_INPUT):
            ti.state = TaskInstanceState.FAILED


def _answering(dag_id: str, option: str, user: str, reason: str) -> tuple:
    import threading
    seen: dict = {}
    t = threading.Thread(target=answer_when_asked, args=(dag_id, option, user, reason, seen), daemon=True)
    t.start()
    return t, seen


def _run_dirs(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and not p.name.startswith(".")]


def test_a_person_approves_one_draft_and_rejects_the_next(airflow_db, tmp_path, demo_assets, monkeypatch):
    """eval.approval always: the first draft waits under Required Actions and is promoted once approved (the
    event emitted then); the next one, rejected, is not: promoted.json still names the first, no event, the
    approval task skipped, eval.json says who rejected it and why."""
    cfg = _config(tmp_path, demo_assets, "approve.yaml", 1.0)
    data = yaml.safe_load(cfg.read_text())
    data["eval"]["approval"] = "always"
    cfg.write_text(yaml.safe_dump(data))
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "evaluate_approval_test.py",
                          f"CONFIG = {str(cfg)!r}\n" + APPROVAL_DAG_FILE)
    promoted = tmp_path / "runs" / "promoted.json"
    before = len(_events())

    thread, seen = _answering("evaluate_approval_test", "Approve", "alice", "beats nothing in service")
    dr = dag.test()
    thread.join(10)
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success" and states["approve_promotion"] == "success", (states, seen)
    [first] = _run_dirs(tmp_path)
    assert seen["options"] == ["Approve", "Reject"] and seen["defaults"] == ["Reject"]   # a timeout keeps
    assert list(seen["params"]) == ["reason"] and seen["subject"] == f"Promote the draft of run {first.name}?"
    assert "| 3/1/4 | held\\_out (decides the gate) | 1 |" in seen["body"] and "**In service**: none" in seen["body"]
    assert json.loads(promoted.read_text())["draft"] == str(first / "draft" / "export")
    [extra] = _events()[before:]
    assert extra["draft"] == str(first / "draft" / "export") and extra["approval"]["by"] == "alice"
    ev = json.loads((first / "eval.json").read_text())["approval"]
    assert (ev["state"], ev["decision"], ev["by"], ev["why"]) == ("approved", "approve", "alice",
                                                                  "beats nothing in service")

    in_service = promoted.read_text()
    thread, seen = _answering("evaluate_approval_test", "Reject", "bob", "MT-Bench looks worse to me")
    dr = dag.test()
    thread.join(10)
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success" and states["approve_promotion"] == "skipped", (states, seen)
    [second] = set(_run_dirs(tmp_path)) - {first}
    assert f"**In service**: `{first / 'draft' / 'export'}`" in seen["body"]   # against the draft in service
    assert promoted.read_text() == in_service and len(_events()) == before + 1
    ev = json.loads((second / "eval.json").read_text())
    assert ev["approval"]["state"] == "rejected" and ev["approval"]["by"] == "bob"
    assert ev["approval"]["why"] == "MT-Bench looks worse to me" and ev.get("promoted") is None
