"""The corpus operators under Airflow: a small DAG of the pipeline's first four tasks, run with dag.test(),
and their wiring in eagle3_pipeline."""
from __future__ import annotations

import json

import pytest

from tests.fixtures.corpus import write_config
from tests.fixtures.pipeline_run import pipeline_dag


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corpus_tasks_in_a_dag(tmp_path, demo_assets, airflow_db):
    from airflow.utils.state import DagRunState, TaskInstanceState

    from eagleflow.airflow.corpus_operators import CORPUS_ASSET

    cache_root = tmp_path / "caches"
    (cache_root / "old_capture").mkdir(parents=True)
    (cache_root / "old_capture" / "00000001.safetensors").write_bytes(b"\0" * 40_000)
    cfg = write_config(tmp_path, demo_assets["target_model"], demo_assets["sources"], corpus={"max_length": 256},
                       disk={"cache_root": str(cache_root), "old_caches": [str(cache_root / "old_capture")]})

    # eagle3_pipeline's own first four tasks, as wired there (the later phases belong to other issues)
    dag = pipeline_dag().partial_subset(task_ids=["write_run_config", "prepare_corpus", "delete_old_caches", "check_disk"],
                                  include_downstream=False, include_upstream=False)
    # run_report is write_run_config's teardown: a subset holding the setup holds its teardown too
    assert set(dag.task_dict) == {"write_run_config", "prepare_corpus", "delete_old_caches", "check_disk",
                                  "run_report"}

    # in the pipeline prepare_corpus follows write_run_config through the generation tasks, which the subset
    # leaves out: restate that order, since a later task never resolves the config itself (it reads the frozen one)
    if not dag.task_dict["prepare_corpus"].upstream_task_ids:
        dag.task_dict["write_run_config"] >> dag.task_dict["prepare_corpus"]
    dr = dag.test(run_conf={"config_path": str(cfg), "delete_old_caches": True})
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == DagRunState.SUCCESS, states
    assert set(states.values()) == {TaskInstanceState.SUCCESS}

    run_dir = next((tmp_path / "runs").iterdir())
    stats = json.loads((run_dir / "corpus" / "stats.json").read_text())
    assert stats["records"] == 72 and (run_dir / "corpus" / "corpus.parquet").is_file()
    assert not (cache_root / "old_capture").exists()  # the Param turned deletion on

    xcoms = {ti.task_id: ti.xcom_pull(task_ids=ti.task_id) for ti in dr.get_task_instances()}
    assert xcoms["prepare_corpus"]["records"] == 72
    assert xcoms["delete_old_caches"]["freed_bytes"] >= 40_000
    assert xcoms["check_disk"]["ok"] is True and xcoms["check_disk"]["needed_bytes"] > 0

    # the corpus Asset got an event carrying the run's numbers
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    with create_session() as session:
        events = (session.query(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                  .filter(AssetModel.uri == CORPUS_ASSET.uri).all())
        assert any(e.extra.get("records") == 72 and e.extra.get("run_dir") == str(run_dir) for e in events)


def test_pipeline_wiring():
    from eagleflow.airflow.corpus_operators import CORPUS_ASSET

    dag = pipeline_dag()
    prepare, delete, check = (dag.get_task(t) for t in ("prepare_corpus", "delete_old_caches", "check_disk"))
    assert [o.uri for o in prepare.outlets] == [CORPUS_ASSET.uri]
    # delete_old_caches succeeds as a logged no-op when off, so check_disk's default rule holds
    assert delete.task_id in check.upstream_task_ids and check.trigger_rule == "all_success"
    assert prepare.task_id in delete.upstream_task_ids
    assert dag.params["delete_old_caches"] is False
