"""The scale-out deployment, run for real on this machine: CeleryExecutor on PostgreSQL and Redis.

The same parts as docker-compose.yaml (eagleflow.airflow.deploy.scaleout): scheduler, DAG processor, API server,
triggerer, a Celery worker on the default queue and one bound to the GPU node's queue, each its own
process group; a real PostgreSQL and Redis from the Debian packages on 127.0.0.1 and free ports.
The demo pipeline is triggered through the REST API; every one of its tasks must be routed to the queue
the node's config names and run on that node's worker (each worker reports its own hostname), and the
node's pool (one slot, deferred waits included) must have run the two extraction shards one at a time.
"""
from __future__ import annotations


import pytest

from eagleflow.airflow.deploy.scaleout import GpuNodeRoute
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.scaleout import celery_deployment, when

pytestmark = [pytest.mark.slow]

NODE = GpuNodeRoute(queue="gpu-node-test", pool="gpu-node-test", pool_slots=1)


@pytest.mark.timeout(1500)
def test_demo_pipeline_runs_on_celery_with_the_nodes_worker_and_pool(tmp_path, demo_assets):
    cfg = write_short_config(tmp_path, demo_assets,
                             node={"name": "test-node", "queue": NODE.queue, "pool": NODE.pool})
    with celery_deployment(tmp_path, [NODE], cfg) as deploy:
        run_id = deploy.trigger("eagle3_pipeline", {"config_path": str(cfg), "run_name": "celery"})
        state = deploy.wait("eagle3_pipeline", run_id, timeout_s=1200)
        tis = deploy.task_instances("eagle3_pipeline", run_id)
        summary = {(t["task_id"], t["map_index"]): (t["state"], t["queue"], t["hostname"], t["pool"]) for t in tis}
        assert state == "success", f"{summary}\n" + deploy.tails()

    node_worker = f"airflow-worker-{NODE.queue}"
    for t in tis:  # every task of the run went to the node's queue and ran on the node's worker
        assert t["queue"] == NODE.queue, summary
        assert t["hostname"] == node_worker, summary
    pooled = {t["task_id"] for t in tis if t["pool"] == NODE.pool}
    assert {"extract_shard", "train_draft", "start_capture_server", "gpus_idle"} <= pooled, summary
    shards = sorted((t for t in tis if t["task_id"] == "extract_shard"), key=lambda t: when(t["start_date"]))
    assert len(shards) == 2
    # one pool slot, deferred waits included: the second shard started only after the first ended
    assert when(shards[1]["start_date"]) >= when(shards[0]["end_date"]) - 1, shards
    run_dir = tmp_path / "runs" / "celery"
    assert sorted(run_dir.glob("hidden_states/shard_*/manifest.jsonl"))
    assert (run_dir / "draft" / "export" / "config.json").is_file()
