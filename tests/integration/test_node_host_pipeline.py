"""The whole eagle3_pipeline on the node host: another network stack, reached only over the veth link and its sshd.

Every node command of every phase (corpus, disk budget, GPU free and idle
gates against the fake nvidia-smi, the detached capture server and workers,
the shard watch, verify, training, export) runs inside the node's namespace,
through SSHNode with the node's host key pinned, under Airflow's ``dag.test()``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.gpu_scenarios import gpu, write_scenario
from tests.fixtures.node_host import node_host_fixture, record_spawns  # noqa: F401  (fixture)
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.processes import alive

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_runs_green_on_the_node_host(tmp_path, airflow_db, demo_assets, node_host_fixture, monkeypatch):  # noqa: F811
    from airflow.dag_processing.dagbag import DagBag

    host = node_host_fixture
    write_scenario(host.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(i, 3) for i in range(8)], "processes": []})
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST", host.airflow_conn())
    cfg_path = write_short_config(
        tmp_path, demo_assets,
        node={"name": "gpu-node-ns", "conn_id": "node_host", "python": sys.executable, "has_gpu": True},
        gpu={"probe": "smi", "poll_interval_s": 0.5, "idle_timeout_s": 30})
    # note which detached jobs ran inside the node's namespace (their PIDs are listed by `ip netns pids`)
    seen_in_ns = record_spawns(monkeypatch, {"node": host})["node"]
    dag = DagBag(dag_folder=str(REPO / "dags" / "eagle3_pipeline.py")).dags["eagle3_pipeline"]
    dr = dag.test(run_conf={"config_path": str(cfg_path), "run_name": "node-host"})
    states = {(ti.task_id, ti.map_index): ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success", states

    run_dir = tmp_path / "runs" / "node-host"
    stats = json.loads((run_dir / "corpus" / "stats.json").read_text())
    entries = [json.loads(line) for p in (run_dir / "hidden_states").glob("shard_*/manifest.jsonl")
               for line in p.read_text().splitlines() if line.strip()]
    assert len(entries) == stats["records"] == len({e["id"] for e in entries})
    assert (run_dir / "draft" / "export" / "model.safetensors").is_file()
    # the capture server, the shard workers and the trainer were processes of the node's namespace
    assert {"capture_server", "trainer"} <= seen_in_ns and \
        {r for r in seen_in_ns if r.startswith("worker_shard_")}, seen_in_ns
    # every detached process was stopped; nothing but sshd is left on the node
    for rec in (tmp_path / "node-state" / "pids").glob("*.json"):
        pid = json.loads(rec.read_text())["pid"]
        assert not alive(pid), f"{rec.name}: pid {pid} still running after the pipeline"
    left = [p for p in host.pids() if alive(p) and Path(f"/proc/{p}/comm").read_text().strip() != "sshd"]
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
    # the control plane reached the node from its end of the link, by key, with the host key checked
    assert f"Accepted publickey for {host.user} from {host.host_ip}" in host.log.read_text()
