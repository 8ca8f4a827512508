"""gpu_node_health under dag.test() writes each node's status into Airflow's metadata DB, and the console
(as the API server runs it) reads it from there: the stalled node's held GPUs, the CPU-only node, the
unreachable node with its last-seen time."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.fixtures.console_nodes import HELD, STALLED_CMD, write_console_nodes

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _health_dag(tmp_path, monkeypatch):
    """The DAG as it parses, with the three console nodes' environment; (dag, nodes)."""
    nodes = write_console_nodes(tmp_path)
    for k, v in nodes["env"].items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location("gpu_node_health_console_test", REPO / "dags" / "gpu_node_health.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dag, nodes


@pytest.mark.timeout(400)
def test_health_checks_land_in_the_metadata_db_and_the_view(airflow_db, monkeypatch, tmp_path):
    dag, nodes = _health_dag(tmp_path, monkeypatch)
    assert dag.is_paused_upon_creation is False
    conf = {"config_paths": nodes["configs"], "memory_threshold_mib": 1024, "window_s": 3600,
            "unreachable_after_s": 180, "remind_after_s": 1800}
    dr = dag.test(run_conf=conf)
    # nothing has lasted long enough to open an incident (held < 1 h, unreachable < 180 s): the check is green
    assert dr.state == "success"

    from eagleflow.airflow.status_variables import variable_status_store
    docs = {d["node"]: d for d in variable_status_store(in_task=False).all()}  # straight from the DB
    assert set(docs) >= {"gpu-node-stalled", "cpu-box", "gpu-node-gone"}
    stalled = docs["gpu-node-stalled"]
    assert len(stalled["gpus"]) == 8 and len(stalled["history"]["t"]) == 1
    assert sorted(stalled["held_since"]) == sorted(f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in HELD)
    assert docs["cpu-box"]["has_gpu"] is False and docs["cpu-box"]["last_seen"]
    # the kind of error only (the SSH message names host, login and port)
    assert docs["gpu-node-gone"]["error"] in ("connection refused", "cannot connect")
    assert docs["gpu-node-gone"]["last_seen"] is None and "127.0.0.1" not in str(docs["gpu-node-gone"])
    assert STALLED_CMD.split()[2] not in str(docs)  # no command line stored

    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from eagleflow.airflow.console_app import create_app
    am = create_auth_manager()
    am.init()
    token = am.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    c = TestClient(create_app())  # the API server's way: Variables from the DB, the DAG's state from DagModel
    html = c.get("/panel", cookies={"_token": token}).text
    held = re.findall(r"<tr class='gpu held' data-uuid='GPU-0000000(\d)", html)
    assert [int(i) for i in held] == list(HELD)
    assert "CPU-only node" in html and f"unreachable ({docs['gpu-node-gone']['error']})" in html
    assert "sglang" not in html and "kimi" not in html
    metrics = c.get("/metrics", headers={"Authorization": f"Bearer {token}"}).text
    assert metrics.count("DCGM_FI_DEV_FB_USED{") >= 8 and 'eagleflow_node_up{Hostname="gpu-node-gone"} 0' in metrics


@pytest.mark.timeout(300)
def test_a_zero_window_is_refused_by_name_not_read_as_the_default(airflow_db, monkeypatch, tmp_path):
    """Through Airflow's own Param validation: the run never starts with window_s 0."""
    dag, nodes = _health_dag(tmp_path, monkeypatch)
    with pytest.raises(Exception, match="window_s") as e:
        dag.test(run_conf={"config_paths": nodes["configs"], "window_s": 0})
    assert "minimum" in str(e.value) or "less than" in str(e.value)
