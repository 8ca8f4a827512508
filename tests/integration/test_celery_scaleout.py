"""The scale-out deployment, run for real on this machine: CeleryExecutor on PostgreSQL and Redis.

The same parts as docker-compose.yaml (eagleflow.airflow.deploy.scaleout): scheduler, DAG processor, API server,
triggerer, a Celery worker on the default queue and one bound to the GPU node's queue, each its own
process group; a real PostgreSQL and Redis from the Debian packages on 127.0.0.1 and free ports.
The demo pipeline is triggered through the REST API; every one of its tasks must be routed to the queue
the node's config names and run on that node's worker (each worker reports its own hostname), and the
node's pool (one slot, deferred waits included) must have run the two extraction shards one at a time.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from eagleflow.airflow.deploy.home import airflow_bin, airflow_env
from eagleflow.airflow.deploy.scaleout import GpuNodeRoute, celery_env, components, init_commands
from eagleflow.airflow.deploy.standalone import admin_password, free_port
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.scaleout import (INSTALL_HINT, missing_servers, start_postgres, start_recorded, start_redis,
                                    stop_recorded)

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NODE = GpuNodeRoute(queue="gpu-node-test", pool="gpu-node-test", pool_slots=1)


def _call(url, method="GET", body=None, token=None):
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _when(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(1500)
def test_demo_pipeline_runs_on_celery_with_the_nodes_worker_and_pool(tmp_path, demo_assets):
    missing = missing_servers()
    if missing:
        pytest.fail(f"the scale-out test needs {', '.join(missing)}: {INSTALL_HINT}")
    started: list = []  # process records of the Airflow parts
    pg = redis = None
    try:
        pg = start_postgres()
        redis = start_redis(tmp_path / "redis")
        cfg = write_short_config(tmp_path, demo_assets,
                                 node={"name": "test-node", "queue": NODE.queue, "pool": NODE.pool})
        api_port = free_port()
        env = airflow_env(tmp_path / "airflow_home", parallelism=8)
        env.update(celery_env(sql_alchemy_conn=pg.url, broker_url=redis.url,
                              result_backend="db+" + pg.url,  # db+postgresql+psycopg2: SQLAlchemy 2.1 defaults to psycopg 3
                              execution_api_url=f"http://127.0.0.1:{api_port}/execution/"))
        env.update({
            "EAGLEFLOW_CONFIG": str(cfg),       # the DAG routes its tasks by this config's node at parse time
            "AIRFLOW__API__PORT": str(api_port), "AIRFLOW__API__HOST": "127.0.0.1", "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{api_port}",
            "AIRFLOW__API_AUTH__JWT_SECRET": "eagleflow-scaleout-test-" + "s" * 48,  # >= 64 bytes for HS512
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",
            "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # each worker says who it is: both run on this one machine
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.fixtures.scaleout.worker_hostname",
            "EAGLEFLOW_TEST_WORKER_NAME": "control-plane",
            "PYTHONPATH": os.pathsep.join([str(REPO / "include"), str(REPO)]),  # this checkout first
        })
        for args in init_commands([NODE]):
            res = subprocess.run([airflow_bin(), *args], env=env, capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, f"airflow {' '.join(args)}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        for name, args in components([NODE]).items():
            penv = dict(env, AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(free_port()))
            if "worker" in args:
                penv["EAGLEFLOW_TEST_WORKER_NAME"] = name
                args = [*args, "--concurrency", "4", "--celery-hostname", f"{name}@%h"]
            started.append(start_recorded([airflow_bin(), *args], role=name, log=tmp_path / f"{name}.log", env=penv))

        base = f"http://127.0.0.1:{api_port}"
        token = None
        deadline = time.time() + 300
        while token is None:
            assert time.time() < deadline, "the API server did not come up: " + _tails(started)
            try:
                password = admin_password(Path(env["AIRFLOW_HOME"])) or "admin"
                token = _call(f"{base}/auth/token", "POST", {"username": "admin", "password": password})["access_token"]
                _call(f"{base}/api/v2/dags/eagle3_pipeline", token=token)  # parsed by the DAG processor yet?
            except OSError:
                token = None
                time.sleep(3)
        _call(f"{base}/api/v2/dags/eagle3_pipeline", "PATCH", {"is_paused": False}, token)
        run = _call(f"{base}/api/v2/dags/eagle3_pipeline/dagRuns", "POST",
                    {"logical_date": None, "conf": {"config_path": str(cfg), "run_name": "celery"}}, token)
        run_id = run["dag_run_id"]
        deadline = time.time() + 1200
        state = "queued"
        while state not in ("success", "failed"):
            assert time.time() < deadline, f"run still {state} after 20 min: " + _tails(started)
            time.sleep(5)
            state = _call(f"{base}/api/v2/dags/eagle3_pipeline/dagRuns/{run_id}", token=token)["state"]
        tis = _call(f"{base}/api/v2/dags/eagle3_pipeline/dagRuns/{run_id}/taskInstances?limit=100",
                    token=token)["task_instances"]
        summary = {(t["task_id"], t["map_index"]): (t["state"], t["queue"], t["hostname"], t["pool"]) for t in tis}
        assert state == "success", f"{summary}\n" + _tails(started)

        node_worker = f"airflow-worker-{NODE.queue}"
        for t in tis:  # every task of the run went to the node's queue and ran on the node's worker
            assert t["queue"] == NODE.queue, summary
            assert t["hostname"] == node_worker, summary
        pooled = {t["task_id"] for t in tis if t["pool"] == NODE.pool}
        assert {"extract_shard", "train_draft", "start_capture_server", "gpus_idle"} <= pooled, summary
        shards = sorted((t for t in tis if t["task_id"] == "extract_shard"), key=lambda t: _when(t["start_date"]))
        assert len(shards) == 2
        # one pool slot, deferred waits included: the second shard started only after the first ended
        assert _when(shards[1]["start_date"]) >= _when(shards[0]["end_date"]) - 1, shards
        run_dir = tmp_path / "runs" / "celery"
        assert sorted(run_dir.glob("hidden_states/shard_*/manifest.jsonl"))
        assert (run_dir / "draft" / "export" / "config.json").is_file()
    finally:
        for rec in reversed(started):
            stop_recorded(rec)
        for server in (redis, pg):
            if server is not None:
                server.stop()


def _tails(started) -> str:
    return "\n".join(f"--- {rec.role}:\n{Path(rec.log_file).read_text(errors='replace')[-1500:]}" for rec in started
                     if Path(rec.log_file).exists())
