"""The whole eagle3_pipeline on the node host: another network stack, reached only over the veth link and its sshd.

Every node command of every phase (corpus, disk budget, GPU free and idle
gates against the fake nvidia-smi, the detached capture server and workers,
the shard watch, verify, the held-out capture, training, export, evaluation)
runs inside the node's namespace, through SSHNode with the node's host key
pinned, under Airflow's ``dag.test()``. This is the single-node whole run of
``make test`` (the browser test runs one on this machine from the UI's form).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.gpu_scenarios import gpu, write_scenario
from tests.fixtures.node_host import node_host_fixture, record_spawns  # noqa: F401  (fixture)
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import run_pipeline
from tests.fixtures.processes import alive


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_runs_green_on_the_node_host(tmp_path, airflow_db, demo_assets, node_host_fixture, monkeypatch):  # noqa: F811
    host = node_host_fixture
    write_scenario(host.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(i, 3) for i in range(8)], "processes": []})
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST", host.airflow_conn())
    cfg_path = write_short_config(
        tmp_path, demo_assets,
        node={"name": "gpu-node-ns", "conn_id": "node_host", "python": sys.executable, "has_gpu": True},
        gpu={"probe": "smi", "poll_interval_s": 0.5, "idle_timeout_s": 30})
    # note which detached jobs ran inside the node's namespace (their PIDs are listed by `ip netns pids`)
    seen_in_ns = record_spawns(monkeypatch, {"node": host})["node"]
    dr, states = run_pipeline(cfg_path, "node-host")
    assert dr.state == "success", states

    run_dir = tmp_path / "runs" / "node-host"
    stats = json.loads((run_dir / "corpus" / "stats.json").read_text())
    assert stats["records"] > 0
    entries = [json.loads(line) for p in (run_dir / "hidden_states").glob("shard_*/manifest.jsonl")
               for line in p.read_text().splitlines() if line.strip()]
    assert len(entries) == stats["records"] == len({e["id"] for e in entries})
    assert len(sorted((run_dir / "hidden_states").glob("shard_*/*.safetensors"))) == len(entries)
    export = run_dir / "draft" / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert (run_dir / "draft" / "curves.png").is_file()
    # the held-out records were never captured into the training store (so never trained on); the first
    # train.held_out_samples of them were captured apart, and the trainer scored itself on them
    import pyarrow.parquet as pq
    held = set(pq.read_table(str(run_dir / "corpus" / "eval.parquet"))["id"].to_pylist())
    assert held and len(held) == stats["eval_records"]
    assert not held & {e["id"] for e in entries}
    held_store = [json.loads(line)["id"] for line in (run_dir / "hidden_states_held_out" / "shard_00000" /
                                                      "manifest.jsonl").read_text().splitlines() if line.strip()]
    assert held_store and set(held_store) <= held and len(held_store) == min(64, len(held))
    assert states[("capture_held_out", -1)] == "success"
    metrics = [json.loads(line) for line in (run_dir / "draft" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["eval_samples"] == len(held_store) and metrics[-1]["eval_accept_length"] >= 1.0
    # the evaluation ran on the node: the draft speculated on the held-out prompts, losslessly
    assert states[("free_gpus_after_evaluation", -1)] == "success"
    ev = json.loads((run_dir / "eval.json").read_text())
    assert states[("evaluate_draft", -1)] == "success" and ev["passed"] and ev["results"][0]["config"] == "3/1/4"
    assert ev["results"][0]["prompts"] == min(2, len(held)) and ev["results"][0]["draft"]["lossless"]
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
