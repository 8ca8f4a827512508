"""The way a user triggers the pipeline: airflow standalone, the REST API with a conf
(what the UI's trigger form sends), the scheduler running it to success."""
from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from eagleflow.airflow.deploy import standalone
from tests.fixtures.pipeline_config import write_short_config


def _call(url, method="GET", body=None, token=None):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trigger_pipeline_through_rest_api(tmp_path, demo_assets):
    home = tmp_path / "airflow_home"
    port = standalone.free_port()
    cfg_path = write_short_config(tmp_path, demo_assets)
    try:
        info = standalone.start(home, port, wait_s=300)
        assert info["password"], "standalone did not generate an admin password"
        assert os.stat(home / "standalone.json").st_mode & 0o077 == 0, "standalone.json (the password) is not 0600"
        base = f"http://127.0.0.1:{port}"
        token = _call(f"{base}/auth/token", "POST", {"username": "admin", "password": info["password"]})["access_token"]
        deadline = time.time() + 180
        while True:  # the dag-processor needs a moment to parse dags/
            try:
                _call(f"{base}/api/v2/dags/eagle3_pipeline", token=token)
                break
            except urllib.error.HTTPError as e:
                if e.code != 404 or time.time() > deadline:
                    raise
                time.sleep(2)
        _call(f"{base}/api/v2/dags/eagle3_pipeline", "PATCH", {"is_paused": False}, token)
        run = _call(f"{base}/api/v2/dags/eagle3_pipeline/dagRuns", "POST",
                    {"logical_date": None, "conf": {"config_path": str(cfg_path), "shards": 2}}, token)
        run_id = run["dag_run_id"]
        deadline = time.time() + 600
        state = None
        while time.time() < deadline:
            state = _call(f"{base}/api/v2/dags/eagle3_pipeline/dagRuns/{run_id}", token=token)["state"]
            if state in ("success", "failed"):
                break
            time.sleep(3)
        tis = _call(f"{base}/api/v2/dags/eagle3_pipeline/dagRuns/{run_id}/taskInstances", token=token)
        summary = {(t["task_id"], t.get("map_index")): t["state"] for t in tis["task_instances"]}
        assert state == "success", f"run {run_id} ended {state}: {summary}"
        assert summary[("extract_shard", 0)] == "success" and summary[("extract_shard", 1)] == "success"
    finally:
        stopped = standalone.stop(home, grace_s=20)
    assert stopped
    assert not standalone._group_alive(info["pgid"]), "processes of the standalone group survived the stop"
