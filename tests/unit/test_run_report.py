"""The run report from a run directory as the pipeline leaves it (complete, and cut short by a failure)."""
from __future__ import annotations

import json
import os
import re
import time

from eagleflow.config import load_config
from eagleflow.console.run_report import REPORT_FILE, write_report
from eagleflow.engines.sglang.serve import serve_command
from eagleflow.layout import RunLayout
from eagleflow.watchdog import incidents


def _config(tmp_path):
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": "/models/Kimi K2.5",
                            "node": {"name": "gpu-node-1", "state_dir": str(tmp_path / "state")},
                            "server": {"tp": 8, "dtype": "bfloat16"}})
    return cfg, RunLayout.for_run(cfg, "manual__r1")


def _complete_run(cfg, layout, t0):
    run = layout.run_dir
    os.makedirs(f"{run}/corpus")
    json.dump({"records": 6, "tokens": 900, "masked_tokens": 400, "length": {"p50": 150, "p99": 200, "max": 210},
               "per_source": {"sharegpt": {"read": 4, "records": 4, "bad": 0, "dropped": 0, "tokens": 600,
                                           "masked_tokens": 250},
                              "tool<calls>": {"read": 3, "records": 2, "bad": 1, "dropped": 0, "tokens": 300,
                                              "masked_tokens": 150}}}, open(f"{run}/corpus/stats.json", "w"))
    for shard in (0, 1):
        d = f"{run}/hidden_states/shard_{shard:05d}"
        os.makedirs(d)
        with open(f"{d}/manifest.jsonl", "w") as m:
            for i in range(3):
                name = f"{i:08d}.safetensors"
                open(f"{d}/{name}", "wb").write(b"x")
                os.utime(f"{d}/{name}", (t0 + 10 * i + shard * 200, t0 + 10 * i + shard * 200))  # shard 1 stalled
                m.write(json.dumps({"id": f"s:{i}", "file": name, "tokens": 10, "bytes": 1}) + "\n")
        json.dump({"total": 3, "state": "complete", "started_at": t0}, open(f"{d}/heartbeat.json", "w"))
    inc, _ = incidents.open_or_join(cfg.node_state_dir(), node="gpu-node-1", cause="server_frozen",
                                    run_id="manual__r1", shard=1, summary="frozen", join_window_s=30, now=t0 + 60)
    incidents.open_or_join(cfg.node_state_dir(), node="gpu-node-1", cause="worker_dead", run_id="other_run",
                           shard=0, summary="not this run", join_window_s=30, now=t0 + 70)
    os.makedirs(f"{run}/draft/export")
    with open(f"{run}/draft/metrics.jsonl", "w") as f:
        for step in range(1, 51):
            f.write(json.dumps({"step": step, "loss": 20 / step, "acc_0": step / 60, "acc_1": step / 80,
                                "accept_length": 1 + step / 20, "loss_per_position": 60 / step}) + "\n")
    json.dump({"ok": True, "samples": 6, "shards": 2, "digest_checked": True},
              open(f"{run}/hidden_states/verified.json", "w"))
    for name in ("config.json", "model.safetensors"):
        open(f"{run}/draft/export/{name}", "w").write("{}")


def test_complete_run_report(tmp_path):
    cfg, layout = _config(tmp_path)
    t0 = time.time() - 3600
    _complete_run(cfg, layout, t0)
    gpu = {"has_gpu": True, "gpus": [{"uuid": "GPU-a", "index": 0}],
           "history": {"t": [t0 - 3000, t0 + 30, t0 + 150], "gpus": {"GPU-a": {"mem": [1, 90000, 90000],
                                                                                "util": [0, 95, 0]}}}}
    path = write_report(cfg, layout, tasks={"export_draft": "success", "train_draft": "success"}, gpu=gpu)
    assert path == tmp_path / "runs" / "manual__r1" / REPORT_FILE
    html = path.read_text()
    assert "Every task before this report succeeded." in html
    assert "tool&lt;calls&gt;" in html and "<td>sharegpt</td><td>4</td>" in html
    assert "samples stored per shard" in html and html.count("class='incident'") == 2  # marker + list item
    assert "server_frozen" in html and "worker_dead" not in html  # another run's incident is not this run's
    assert "Verified: 6 samples in 2 shard(s) against their manifests with digests." in html
    assert "GPU memory used during capture" in html and "GPU utilisation during capture" in html
    assert "training loss" in html and "acceptance length 3.275" in html and "loss per scored position" in html
    cmd = ("python3 -m sglang.launch_server --model-path &#x27;/models/Kimi K2.5&#x27; --speculative-algorithm EAGLE3 "
           f"--speculative-draft-model-path {tmp_path}/runs/manual__r1/draft/export")
    assert cmd in html and "--tp-size 8 --dtype bfloat16" in html
    assert serve_command(cfg, "/x").endswith("--tp-size 8 --dtype bfloat16")


def test_failed_run_report_says_what_is_missing(tmp_path):
    cfg, layout = _config(tmp_path)
    os.makedirs(layout.run_dir)
    html = write_report(cfg, layout, tasks={"prepare_corpus": "failed", "export_draft": "upstream_failed"},
                        gpu=None).read_text()
    assert re.search(r"Did not succeed: prepare_corpus \(failed\), export_draft \(upstream_failed\)", html)
    for missing in ("No corpus statistics", "extraction did not start", "No GPU history", "train_draft did not run",
                    "No export"):
        assert missing in html
    cpu_cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": "/m", "node": {"has_gpu": False}})
    cpu = RunLayout.for_run(cpu_cfg, "cpu")
    os.makedirs(cpu.run_dir)
    assert "The node has no GPU" in write_report(cpu_cfg, cpu).read_text()


def test_a_long_run_stays_a_small_page(tmp_path):
    from eagleflow.console.run_report import render, thin
    assert thin(list(range(10))) == list(range(10))
    picked = thin(list(range(37312)), 500)
    assert len(picked) == 500 and picked[0] == 0 and picked[-1] == 37311
    data = {"run_id": "r", "run_dir": "/r", "node": "n", "shards": {
        s: {"points": [[1000.0 + i, i + 1] for i in range(4664)], "done": 4664, "total": 4664, "state": "complete"}
        for s in range(8)}, "metrics": [{"step": i, "loss": 1.0, "accept_length": 2.0} for i in range(1, 20001)]}
    assert len(render(data)) < 400_000


def test_the_report_task_carries_a_run_report_link():
    """In Airflow 3 the worker pushes the link when the task ends; the UI shows it as the task's button."""
    from pathlib import Path

    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    from eagleflow.airflow.report_operators import RunReportLink, report_url
    dags = Path(__file__).resolve().parents[2] / "dags" / "eagle3_pipeline.py"
    dag = DagSerialization.from_dict(DagSerialization.to_dict(DagBag(dag_folder=str(dags)).dags["eagle3_pipeline"]))
    task = dag.get_task("run_report")
    assert task.extra_links == ["Run report"] and task.is_teardown
    assert "run_report" not in {t.task_id for t in dag.tasks if t.downstream_task_ids} and \
        "evaluate_draft" in task.upstream_task_ids
    key = type("Key", (), {"dag_id": "eagle3_pipeline", "run_id": "manual__2026-12-01T04:12:37+00:00"})()
    assert RunReportLink().get_link(None, ti_key=key) == report_url("eagle3_pipeline", key.run_id) == \
        "/eagleflow-gpu/report/eagle3_pipeline/manual__2026-12-01T04%3A12%3A37%2B00%3A00"
