"""Every DAG imports cleanly and carries what an operator of the UI needs."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # parses every DAG through Airflow's DagBag

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag
    return DagBag(dag_folder=str(REPO / "dags"))  # include_examples raises TypeError in 3.3.x


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {"eagle3_pipeline"} <= set(dagbag.dags)


def test_every_dag_has_owner_retries_tags_docs(dagbag):
    for dag_id, dag in dagbag.dags.items():
        assert dag.tags, f"{dag_id} has no tags"
        assert dag.doc_md and len(dag.doc_md) > 40, f"{dag_id} has no docs"
        for task in dag.tasks:
            assert task.owner and task.owner != "airflow", f"{dag_id}.{task.task_id} has no owner"
            assert task.retries is not None and task.retries >= 1 or task.task_id.startswith(("write_", "plan_")), \
                f"{dag_id}.{task.task_id} has no retries"


def test_pipeline_params_render_a_trigger_form(dagbag):
    dag = dagbag.dags["eagle3_pipeline"]
    params = dag.params
    for name in ("config_path", "capture_backend", "shards", "force_free_gpus", "delete_old_caches",
                 "max_train_steps", "alert_emails", "run_name"):
        p = params.get_param(name)
        assert p.schema.get("title") and p.description, f"Param {name} lacks title/description"
    assert params.get_param("capture_backend").schema["enum"] == [None, "hf", "sglang", "vllm"]
    assert params.get_param("shards").schema["minimum"] == 1


def test_pipeline_phase_order(dagbag):
    dag = dagbag.dags["eagle3_pipeline"]
    order = ["write_run_config", "prepare_corpus", "check_disk", "free_gpus", "gpus_idle", "start_capture_server",
             "capture_server_ready", "extract_shard", "verify_hidden_states",
             "gpus_idle_after_capture", "train_draft", "export_draft", "free_gpus_before_evaluation",
             "gpus_idle_before_evaluation", "evaluate_draft"]
    for a, b in zip(order, order[1:]):
        assert b in dag.get_task(a).get_flat_relative_ids(upstream=False), f"{a} must come before {b}"
    stop = dag.get_task("stop_capture_server")
    # the held-out records are captured after the shards, while the server is up; training waits for them
    assert dag.get_task("capture_held_out").upstream_task_ids == {"extract_shard"}
    assert stop.is_teardown and "capture_held_out" in stop.upstream_task_ids
    assert "capture_held_out" in dag.get_task("gpus_idle_after_capture").upstream_task_ids
    # GPU cleanup after capture is a teardown of the server's start: it runs whatever the shards did...
    free_after = dag.get_task("free_gpus_after_capture")
    assert free_after.is_teardown and "stop_capture_server" in free_after.upstream_task_ids
    # ...and training waits for verification as well, which runs after failed shards (all_done) to report them
    assert {"free_gpus_after_capture", "verify_hidden_states"} <= dag.get_task("gpus_idle_after_capture").upstream_task_ids
    assert dag.get_task("verify_hidden_states").trigger_rule == "all_done"
    # the evaluation's servers are freed however it ends, without deciding the run's outcome (a teardown)
    eval_free = dag.get_task("free_gpus_after_evaluation")
    assert eval_free.is_teardown and eval_free.upstream_task_ids == {"evaluate_draft", "gpus_idle_before_evaluation"}
    for t in ("gpus_idle_after_capture", "export_draft", "evaluate_draft"):
        assert dag.get_task(t).trigger_rule == "all_success", t
    # training: offline through gpus_idle_after_capture (all_success), streaming through train_from_stream; the
    # way not taken is skipped by choose_training_start, a failed one stops it (test_dag_wiring)
    assert dag.get_task("train_draft").trigger_rule == "none_failed_min_one_success"


def test_params_override_config(tmp_path, monkeypatch):
    from eagleflow.airflow.runtime import RunContext
    monkeypatch.setenv("EAGLEFLOW_ALERT_DOMAINS", "example.com")   # the demo config names no recipients
    cfg_file = REPO / "configs" / "local-demo.yaml"
    ctx = RunContext.from_params({"config_path": str(cfg_file), "shards": 5, "capture_backend": None,
                                  "max_train_steps": 7, "alert_emails": ["a@example.com"]}, "manual__x")
    assert ctx.cfg.capture.shards == 5 and ctx.cfg.train.max_steps == 7
    assert ctx.cfg.capture.backend == "hf"  # None keeps the file's value
    assert ctx.cfg.watchdog.alert_emails == ["a@example.com"]
    assert Path(ctx.cfg.target_model).is_absolute() and ctx.layout.run_id == "manual__x"


def test_false_boolean_param_keeps_config_value(tmp_path):
    import yaml
    from eagleflow.airflow.runtime import RunContext
    cfg = yaml.safe_load((REPO / "configs" / "local-demo.yaml").read_text())
    cfg["gpu"] = {"force_free": True}
    for s in cfg["corpus"]["sources"]:
        s["path"] = str((REPO / "configs" / s["path"]).resolve())
    cfg["target_model"] = str((REPO / "configs" / cfg["target_model"]).resolve())
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ctx = RunContext.from_params({"config_path": str(p), "force_free_gpus": False}, "r")
    assert ctx.cfg.gpu.force_free is True
