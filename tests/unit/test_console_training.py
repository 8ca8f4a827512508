"""The GPU view, the metrics and the watch line while a run trains (issue 50): step, loss, acc_0 and ETA, read from
a real trainer's heartbeat and checked against its own metrics.jsonl.

The trainer runs for real on the tiny demo target over synthetic stored hidden states (as tests/unit/test_train.py)
and stops part-way, so its heartbeat says "running" as it does mid-run; a detached process recorded as the run's
trainer makes the node's activity command find the run, as the real detached trainer's record does.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from tests.fixtures.processes import kill_recorded
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states

pytestmark = pytest.mark.slow   # trains a draft for a few steps on the CPU


@pytest.fixture(scope="module")
def trained_part_way(tmp_path_factory, demo_assets):
    from eagleflow.train.trainer import train
    tmp = tmp_path_factory.mktemp("training")
    cfg = load_config(data={"run_root": str(tmp / "runs"), "target_model": demo_assets["target_model"],
                            "train": {"device": "cpu", "max_steps": 16, "batch_size": 8, "lr": 3e-3,
                                      "warmup_steps": 4, "ttt_length": 3, "draft_vocab_size": 64,
                                      "checkpoint_every": 1000, "log_every": 1000},
                            "capture": {"heartbeat_interval_s": 0.5}})
    layout = RunLayout.for_run(cfg, "manual__train1")
    write_synthetic_hidden_states(layout.hidden_states_dir, demo_assets["target_model"], samples=32)
    result = train(cfg, layout, stop_after_step=6, log=lambda _m: None)
    assert result.step == 6 and not result.completed
    return tmp, layout


@pytest.fixture
def node_with_trainer(trained_part_way):
    from eagleflow.nodes.local import LocalNode
    tmp, layout = trained_part_way
    state = tmp / "state"
    node = LocalNode("gpu-node-1")
    node.spawn_detached([sys.executable, "-c", "import time; time.sleep(120)"], role="trainer",
                        pid_file=str(state / "pids" / "manual__train1.trainer.json"),
                        log_file=str(Path(layout.run_dir) / "logs" / "trainer.log"))
    try:
        yield node, state, layout
    finally:
        kill_recorded(state)


def _last_metrics(layout) -> dict:
    from eagleflow.train.curves import read_metrics
    return read_metrics(Path(layout.draft_dir) / "metrics.jsonl")[-1]


def test_the_gpu_view_and_metrics_show_the_training_step_loss_acc_and_eta(node_with_trainer, tmp_path):
    from eagleflow.console import prometheus
    from eagleflow.console.gpu_page import render_panel
    from eagleflow.health.node_activity import read_node_activity
    from eagleflow.health.status_store import StatusStore
    node, state, layout = node_with_trainer
    row = _last_metrics(layout)
    assert row["step"] == 6

    act = read_node_activity(node, str(state))
    t = act.training["manual__train1"]
    assert (t.step, t.total, t.state) == (6, 16, "running")
    assert t.loss == pytest.approx(row["loss"]) and t.acc_0 == pytest.approx(row["acc_0"])
    assert t.rate > 0 and t.eta_s is not None and t.eta_s > 0

    store = StatusStore(tmp_path / "kv")
    store.save("gpu-node-1", [], None, [], has_gpu=False, activity=act, config_path="c.yaml")
    docs = store.all()
    html = render_panel(docs, dag={"is_paused": False, "interval_s": 60}, now=time.time())
    line = re.search(r"<span class='training running'[^>]*>(.*?)</span></span>", html)
    assert line, html
    text = line.group(1)
    assert f"step 6/16 (38 %), loss {row['loss']:.3f}, acc_0 {row['acc_0']:.3f}" in text, text
    assert "steps/s" in text and "ETA " in text and "last step" in text
    assert "data-run='manual__train1'" in html and "no shard started yet" not in html

    metrics = prometheus.render(docs)
    assert 'eagleflow_train_step{Hostname="gpu-node-1",run_id="manual__train1"} 6' in metrics
    assert 'eagleflow_train_steps_total{Hostname="gpu-node-1",run_id="manual__train1"} 16' in metrics
    assert "eagleflow_train_loss{" in metrics and "eagleflow_train_eta_seconds{" in metrics


def test_the_training_watch_line_gives_loss_and_eta(trained_part_way):
    from eagleflow.config import load_config as load
    from eagleflow.heartbeat import Heartbeat
    from eagleflow.watchdog.policy import decide
    from eagleflow.watchdog.signals import GpuSignal, HealthSignal, Observation, ProcessSignal, WatchedJob
    _, layout = trained_part_way
    hb = Heartbeat.read(layout.train_heartbeat_file)
    assert hb is not None and hb.state == "running"
    row = _last_metrics(layout)
    now = hb.last_progress_at + 1
    obs = Observation(job=WatchedJob(shard=None), node="gpu-node-1", now=now, heartbeat=hb, heartbeat_error=None,
                      worker=ProcessSignal(role="trainer", recorded=True, pid=hb.pid, alive=True, state="S",
                                           started_at=hb.started_at),
                      server=None, health=HealthSignal(), gpu=GpuSignal(applicable=False, readings=[]),
                      free_bytes=10**12, done_since_last_look=2, last_look_at=now - 15, log_tail=[])
    d = decide(obs, load(data={"target_model": "/m", "node": {"name": "gpu-node-1"}}))
    assert d.verdict == "healthy", d.summary
    assert "6/16 steps done" in d.summary and "ETA " in d.summary
    assert f"loss {row['loss']:.3f}, acc_0 {row['acc_0']:.3f}" in d.summary, d.summary
    assert f"loss {row['loss']:.3f}" in hb.progress_line() and "ETA " in hb.progress_line()
