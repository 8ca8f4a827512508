"""The GPU status page (plugins/eagleflow_gpu_plugin.py) through FastAPI's TestClient."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eagleflow.gpu.health import HealthAlert, StatusStore
from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "eagleflow_gpu_plugin.py"


@pytest.fixture
def plugin():
    spec = importlib.util.spec_from_file_location("eagleflow_gpu_plugin_under_test", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def status_dir(tmp_path):
    store = StatusStore(tmp_path)
    gpu = GpuSnapshot(index=3, uuid="GPU-3", name="<script>alert(1)</script>", memory_used_mib=90000,
                      memory_total_mib=97887, utilization_pct=0, ecc_uncorrected=None,
                      processes=(GpuProcess(4242, "/opt/venv/bin/python3 -m sglang --api-key sk-SECRET-TOKEN "
                                                  "--model /home/alice/private", 89990, user="alice", state="D"),))
    store.save("gpu-node-1", [gpu], {}, [HealthAlert("gpu-node-1", "GPU-3", 3, "memory_held_idle",
                                                     "node gpu-node-1 GPU 3: 90000 MiB held at 0 %")])
    # a node that could not be read: the error text may carry connection details
    store.save("gpu-node-2", [], {}, [], error="SSH authentication failed for train@10.1.2.3:22 key /home/me/.ssh/id")
    return tmp_path


def test_html_and_json_show_the_latest_snapshots(plugin, status_dir):
    client = TestClient(plugin.create_app(str(status_dir)))
    data = client.get("/api/status").json()
    n1 = next(n for n in data["nodes"] if n["node"] == "gpu-node-1")
    (g,) = n1["gpus"]
    assert g["memory_used_mib"] == 90000 and g["ecc_uncorrected"] is None
    assert g["processes"] == [{"pid": 4242, "name": "python3", "used_mib": 89990, "user": "alice", "state": "D"}]
    assert n1["alerts"] == ["node gpu-node-1 GPU 3: 90000 MiB held at 0 %"]
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "node gpu-node-1" in page.text and "90000 / 97887" in page.text and "4242 alice python3" in page.text


def test_nothing_sensitive_leaks_and_values_are_escaped(plugin, status_dir):
    client = TestClient(plugin.create_app(str(status_dir)))
    for body in (client.get("/").text, client.get("/api/status").text):
        for secret in ("sk-SECRET-TOKEN", "/home/alice/private", "--api-key", "10.1.2.3", "train@", ".ssh/id"):
            assert secret not in body
    assert "<script>alert(1)</script>" not in client.get("/").text
    assert "&lt;script&gt;" in client.get("/").text
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404


def test_optional_token(plugin, status_dir, monkeypatch):
    monkeypatch.setenv("EAGLEFLOW_GPU_PAGE_TOKEN", "t0ken")
    client = TestClient(plugin.create_app(str(status_dir)))
    assert client.get("/api/status").status_code == 401
    assert client.get("/api/status", headers={"Authorization": "Bearer t0ken"}).status_code == 200


def test_empty_store_says_how_to_fill_it(plugin, tmp_path):
    assert "gpu_node_health" in TestClient(plugin.create_app(str(tmp_path / "none"))).get("/").text


def test_airflow_loads_the_plugin():
    from airflow import plugins_manager
    plugins, errors = plugins_manager._get_plugins()
    assert not {k: v for k, v in errors.items() if "eagleflow_gpu" in k}
    apps, _ = plugins_manager.get_fastapi_plugins()
    assert any(a.get("url_prefix") == "/eagleflow-gpu" for a in apps)
