"""The whole eagle3_pipeline, every phase for real, under dag.test() with a short config."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.pipeline_config import write_short_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_runs_green_under_dag_test(tmp_path, airflow_db, demo_assets):
    from airflow.dag_processing.dagbag import DagBag

    cfg_path = write_short_config(tmp_path, demo_assets)
    dag = DagBag(dag_folder=str(REPO / "dags" / "eagle3_pipeline.py")).dags["eagle3_pipeline"]
    dr = dag.test(run_conf={"config_path": str(cfg_path), "run_name": "dagtest"})
    states = {(ti.task_id, ti.map_index): ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success", states

    run_dir = tmp_path / "runs" / "dagtest"
    stats = json.loads((run_dir / "corpus" / "stats.json").read_text())
    assert stats["records"] > 0
    stored = sorted((run_dir / "hidden_states").glob("shard_*/*.safetensors"))
    manifests = [l for p in (run_dir / "hidden_states").glob("shard_*/manifest.jsonl")
                 for l in p.read_text().splitlines() if l.strip()]
    assert len(stored) == len(manifests) == stats["records"]
    export = run_dir / "draft" / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert (run_dir / "draft" / "curves.png").is_file()
    # the held-out records were never captured into the training store (so never trained on); the first
    # train.held_out_samples of them were captured apart, and the trainer scored itself on them
    import pyarrow.parquet as pq
    held = set(pq.read_table(str(run_dir / "corpus" / "eval.parquet"))["id"].to_pylist())
    assert held and len(held) == stats["eval_records"]
    assert not held & {json.loads(l)["id"] for l in manifests}
    held_store = [json.loads(l)["id"] for l in (run_dir / "hidden_states_held_out" / "shard_00000" /
                                               "manifest.jsonl").read_text().splitlines() if l.strip()]
    assert held_store and set(held_store) <= held and len(held_store) == min(64, len(held))
    assert states[("capture_held_out", -1)] == "success"
    metrics = [json.loads(l) for l in (run_dir / "draft" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["eval_samples"] == len(held_store) and metrics[-1]["eval_accept_length"] >= 1.0
    assert states[("free_gpus_after_evaluation", -1)] == "success"
    ev = json.loads((run_dir / "eval.json").read_text())
    assert states[("evaluate_draft", -1)] == "success" and ev["passed"] and ev["results"][0]["config"] == "3/1/4"
    assert ev["results"][0]["prompts"] == min(2, len(held)) and ev["results"][0]["draft"]["lossless"]
