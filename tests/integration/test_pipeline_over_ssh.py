"""The whole eagle3_pipeline against a node reached over a real sshd, with GPUs.

The node is this machine behind a private sshd on 127.0.0.1 whose sessions find
the fake nvidia-smi first on PATH (8 idle H100s): every node command of every
phase (corpus, disk budget, GPU free and idle gates, the detached capture
server and workers, the watchdog's one-shot watch, training, export) goes
through SSHNode, quoted, with the host key pinned.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.gpu_scenarios import gpu, write_scenario
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_runs_green_over_ssh_with_gpu_gates(tmp_path, airflow_db, demo_assets, sshd, monkeypatch):  # noqa: F811
    from airflow.dag_processing.dagbag import DagBag

    write_scenario(sshd.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(i, 3) for i in range(8)], "processes": []})
    monkeypatch.setenv("AIRFLOW_CONN_PIPELINE_NODE", sshd.airflow_conn())
    cfg_path = write_short_config(
        tmp_path, demo_assets,
        node={"name": "ssh-node", "conn_id": "pipeline_node", "python": sys.executable, "has_gpu": True},
        gpu={"probe": "smi", "poll_interval_s": 0.5, "idle_timeout_s": 30})
    dag = DagBag(dag_folder=str(REPO / "dags" / "eagle3_pipeline.py")).dags["eagle3_pipeline"]
    dr = dag.test(run_conf={"config_path": str(cfg_path), "run_name": "over-ssh"})
    states = {(ti.task_id, ti.map_index): ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success", states

    run_dir = tmp_path / "runs" / "over-ssh"
    stats = json.loads((run_dir / "corpus" / "stats.json").read_text())
    entries = [json.loads(line) for p in (run_dir / "hidden_states").glob("shard_*/manifest.jsonl")
               for line in p.read_text().splitlines() if line.strip()]
    assert len(entries) == stats["records"] == len({e["id"] for e in entries})
    assert (run_dir / "draft" / "export" / "model.safetensors").is_file()
    # every detached process was started over SSH and recorded; none is left running
    records = list((tmp_path / "node-state" / "pids").glob("*.json"))
    for rec in records:
        pid = json.loads(rec.read_text())["pid"]
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3], \
            f"{rec.name}: pid {pid} still running after the pipeline"
    sshd_log = sshd.log.read_text()
    assert "Accepted publickey" in sshd_log
