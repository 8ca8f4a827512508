"""What the node tells the console in one command: our live processes, shard progress, incidents; and
how the metrics and the status document use it (real pid records from a real detached process)."""
from __future__ import annotations

import sys
import time

import pytest

from eagleflow.console import prometheus
from eagleflow.health.node_activity import read_node_activity
from eagleflow.health.status_store import StatusStore
from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes.local import LocalNode
from eagleflow.watchdog import incidents
from tests.fixtures.processes import kill_recorded


@pytest.fixture
def node_state(tmp_path):
    state, run = tmp_path / "state", tmp_path / "runs" / "manual__r1"
    node = LocalNode("gpu-node-1")
    rec = node.spawn_detached([sys.executable, "-c", "import time; time.sleep(120)"], role="worker_shard_00002",
                              pid_file=str(state / "pids" / "manual__r1.worker_shard_00002.json"),
                              log_file=str(run / "logs" / "worker_shard_00002.log"))
    (run / "hidden_states" / "shard_00002").mkdir(parents=True)
    hb = Heartbeat(job="extract shard 2/4", pid=rec.pid, state="running", done=37, total=90,
                   last_progress_at=time.time() - 5)
    hb.write(run / "hidden_states" / "shard_00002" / "heartbeat.json")
    inc, opened = incidents.open_or_join(state, node="gpu-node-1", cause="server_frozen", run_id="manual__r1",
                                         shard=2, summary="server stopped answering", join_window_s=30)
    assert opened
    incidents.open_or_join(state, node="gpu-node-1", cause="worker_dead", run_id="manual__r1", shard=1,
                           summary="worker killed", join_window_s=30)
    incidents.record_recovery(state, inc, {"action": "restarted", "ok": True})
    try:
        yield node, state, rec
    finally:
        kill_recorded(state)


def test_one_command_tells_ours_progress_and_incidents(node_state):
    node, state, rec = node_state
    act = read_node_activity(node, str(state))
    (p,) = act.processes
    assert (p.pid, p.run_id, p.role, p.shard, p.task) == (rec.pid, "manual__r1", "worker_shard_00002", 2,
                                                          "extract_shard[2]")
    assert act.job_pids() == {rec.pid}
    (s,) = act.shards["manual__r1"]
    assert (s.shard, s.done, s.total, s.state) == (2, 37, 90, "running")
    by_cause = {i["cause"]: i for i in act.incidents}
    assert by_cause["server_frozen"]["outcome"] == "recovered" and by_cause["worker_dead"]["outcome"] == "open"
    assert act.owner_of(rec.pid, None) is p and act.owner_of(999999, 4) is None


def test_status_document_and_metrics_from_the_activity(node_state, tmp_path):
    node, state, rec = node_state
    act = read_node_activity(node, str(state))
    store = StatusStore(tmp_path / "kv")
    gpu = GpuSnapshot(index=0, uuid="GPU-a", name="H100", memory_used_mib=30000, memory_total_mib=81559,
                      utilization_pct=None, processes=(GpuProcess(rec.pid, "python3 -m eagleflow.cli capture run",
                                                                  29000, user="eagle", pgid=rec.pgid),
                                                       GpuProcess(77, "ollama serve --secret x", 900, user="bob")))
    doc = store.save("gpu-node-1", [gpu], {}, [], activity=act, interval_s=60)
    ours, theirs = doc["gpus"][0]["processes"]
    assert ours["ours"] and ours["task"] == "extract_shard[2]" and ours["program"] == "python3"
    assert not theirs["ours"] and theirs["program"] == "ollama" and "secret" not in str(doc)
    assert doc["held_since"] == {}  # utilisation unknown is not 0 %
    from eagleflow.console.gpu_page import render_panel
    panel = render_panel(store.all(), dag={"is_paused": False})
    assert "run manual__r1: <span class='shard running'>shard 2: 37/90</span>" in panel
    assert "open incident gpu-node-1-worker_dead-" in panel and "server_frozen" not in panel  # recovered: closed
    text = prometheus.render(store.all())
    assert 'eagleflow_shard_samples_done{Hostname="gpu-node-1",run_id="manual__r1",shard="2"} 37' in text
    assert 'eagleflow_shard_samples_total{Hostname="gpu-node-1",run_id="manual__r1",shard="2"} 90' in text
    assert 'eagleflow_shard_state{Hostname="gpu-node-1",run_id="manual__r1",shard="2",state="running"} 1' in text
    assert 'eagleflow_watchdog_incidents{Hostname="gpu-node-1",cause="server_frozen",outcome="recovered"} 1' in text
    assert 'eagleflow_watchdog_incidents{Hostname="gpu-node-1",cause="worker_dead",outcome="open"} 1' in text
    assert "DCGM_FI_DEV_GPU_UTIL" not in text  # the only GPU's utilisation is unknown: no series, not 0
    assert 'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",device="nvidia0",modelName="H100",Hostname="gpu-node-1"} 30000' in text
    assert 'eagleflow_gpu_processes{gpu="0",UUID="GPU-a",device="nvidia0",modelName="H100",Hostname="gpu-node-1",owner="other"} 1' in text


def test_history_is_bounded_and_held_since_survives_checks(tmp_path):
    store = StatusStore(tmp_path)
    held = [GpuSnapshot(index=0, uuid="GPU-a", name="H100", memory_used_mib=90000, memory_total_mib=97887,
                        utilization_pct=0)]
    for k in range(100):
        doc = store.save("n", held, {}, [], now=1000.0 + 60 * k, retention_s=1800, interval_s=60)
    assert len(doc["history"]["t"]) == 31 and doc["history"]["t"][0] == 1000.0 + 60 * 69
    assert doc["held_since"] == {"GPU-a": 1000.0}
    busy = [GpuSnapshot(index=0, uuid="GPU-a", name="H100", memory_used_mib=90000, memory_total_mib=97887,
                        utilization_pct=40)]
    assert store.save("n", busy, {}, [], now=8000.0, retention_s=1800)["held_since"] == {}
    down = store.save("n", error="timed out after 30 s", now=8060.0, retention_s=1800)
    assert down["error"] == "timed out" and down["last_seen"] == 8000.0 and down["unreachable_since"] == 8060.0
    assert store.save("n", error="timed out", now=8120.0)["unreachable_since"] == 8060.0
    assert store.forget_unchecked(keep=set(), forget_after_s=3600, now=8120.0 + 3601) == ["n"]
    assert store.all() == []


def test_bad_retention_setting_is_named(monkeypatch):
    from eagleflow.health.status_store import history_retention_s
    monkeypatch.setenv("EAGLEFLOW_GPU_HISTORY_MIN", "0")
    with pytest.raises(ValueError, match="EAGLEFLOW_GPU_HISTORY_MIN='0'"):
        history_retention_s()
