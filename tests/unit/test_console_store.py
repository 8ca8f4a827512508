"""The GPU view shows a streaming run's store (issue 53): the node's activity command reads it through the stores
registry (``Store.server_health`` of the run's frozen ``stream``), the page draws one line per run: its master
and segment holder running, or which is down, and how much of ``stream.buffer_gib`` it holds."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from eagleflow.console.gpu_page import render_panel
from eagleflow.health.node_activity import NodeActivity, read_node_activity
from eagleflow.health.status_store import StatusStore
from eagleflow.nodes.local import LocalNode
from tests.fixtures.processes import kill_recorded

MIB = 1 << 20
DAG = {"is_paused": False, "interval_s": 60}


def doc(stores: dict) -> dict:
    """A CPU node's status document whose activity holds ``stores`` (as gpu_node_health writes it)."""
    act = {"processes": [], "shards": {}, "incidents": [], "read_at": time.time(), "skipped": [],
           "watch_alarms": [], "training": {}, "stores": stores}
    return {"node": "local", "has_gpu": False, "gpus": [], "last_seen": time.time(), "activity": act}


def store_span(page: str, run_id: str) -> re.Match:
    run = re.search(rf"<div class='run' data-run='{run_id}'>(.*?)</div>", page)
    assert run, page
    span = re.search(r"<span class='store (\w+)' data-allocated='(\d*)' data-buffer='(\d+)'>(.*?)</span>",
                     run.group(1))
    assert span, run.group(1)
    return span


def test_the_store_line_from_a_status_document():
    page = render_panel([doc({
        "running": {"label": "Mooncake store (master 127.0.0.1:4000)", "ok": True, "answering": True,
                    "detail": "master 127.0.0.1:4000 answering", "allocated_bytes": 3 * MIB, "buffer_bytes": 4 * MIB},
        "dead": {"label": "Mooncake store (master 127.0.0.1:4001)", "ok": False, "answering": False,
                 "detail": "its mooncake-master is not running (exited; record /s/pids/dead.mooncake-master.json)",
                 "allocated_bytes": None, "buffer_bytes": 4 * MIB},
        "late": {"label": "Mooncake store (master 127.0.0.1:4002)", "ok": True, "answering": False,
                 "detail": "master 127.0.0.1:4002 not answering on its port", "allocated_bytes": None,
                 "buffer_bytes": 2 * MIB},
    })], dag=DAG, now=time.time())
    ok = store_span(page, "running")
    assert ok.group(1, 2, 3) == ("ok", str(3 * MIB), str(4 * MIB))
    assert ok.group(4) == ("store: Mooncake store (master 127.0.0.1:4000), master and segment running; holds 3.0 "
                           "MiB of its 4.0 MiB buffer (75 %)")
    down = store_span(page, "dead")
    assert down.group(1, 2) == ("down", "")
    assert "DOWN: its mooncake-master is not running (exited; record /s/pids/dead.mooncake-master.json)" \
        in down.group(4) and "buffer 4.0 MiB" in down.group(4) and "holds" not in down.group(4)
    late = store_span(page, "late")
    assert late.group(1) == "late" and "its master not answering" in late.group(4)
    # a run with only its store (no shard, no trainer yet) is not said to have no shard started
    assert "no shard started yet" not in page


def test_a_node_answer_with_a_bad_store_entry_leaves_it_out():
    act = NodeActivity.from_dict({"stores": {"r1": {"ok": "yes", "label": 3}, "r2": {
        "ok": True, "label": "Mooncake store", "detail": "", "allocated_bytes": float("nan"), "buffer_bytes": 10}}})
    assert "r1" not in act.stores and any("run r1 store" in s for s in act.skipped)
    assert act.stores["r2"].allocated_bytes is None and act.stores["r2"].buffer_bytes == 10


def _streaming_run(tmp_path, storage: str = "mooncake", buffer_gib: float = 0.0625):
    """A run directory with a frozen streaming config and a live process of the run (a sleeper as its trainer)."""
    state, run = tmp_path / "state", tmp_path / "runs" / "r1"
    (run / "logs").mkdir(parents=True)
    (run / "run-config.json").write_text(json.dumps({"stream": {"storage": storage, "buffer_gib": buffer_gib}}))
    node = LocalNode("local")
    node.spawn_detached([sys.executable, "-c", "import time; time.sleep(120)"], role="trainer",
                        pid_file=str(state / "pids" / "r1.trainer.json"), log_file=str(run / "logs" / "trainer.log"))
    return node, state, run


def test_the_node_reads_a_live_store_through_the_registry(tmp_path):
    """The real master and segment holder from the wheel, on loopback: the line says both run, and what it holds
    is the master's own figure; once the master is killed by its record, the line says it is down."""
    pytest.importorskip("mooncake.store", reason="the stream extra is not installed")
    from eagleflow.stores.mooncake.master import metrics, start_store, stop_store
    node, state, run = _streaming_run(tmp_path)
    ep = None
    try:
        ep = start_store(state_dir=state, run_id="r1", segment_bytes=64 * MIB, endpoint_file=run / "store_endpoint.json")
        act = read_node_activity(node, str(state))
        st = act.stores["r1"]
        assert st.ok and st.answering and st.buffer_bytes == 64 * MIB and st.label == ep.label, st
        assert st.allocated_bytes == int(metrics(ep)["master_allocated_bytes"])
        kv = StatusStore(tmp_path / "kv")
        kv.save("local", [], None, [], has_gpu=False, activity=act, config_path="c.yaml")
        line = store_span(render_panel(kv.all(), dag=DAG, now=time.time()), "r1")
        assert line.group(1) == "ok" and "master and segment running; holds" in line.group(4)
        assert "of its 64.0 MiB buffer" in line.group(4)
        # the store processes log under the state dir: they never pass for the run's directory
        assert act.training == {} and act.shards == {"r1": []}

        stop_store(ep, grace_s=2.0)
        st = read_node_activity(node, str(state)).stores["r1"]
        assert not st.ok and "mooncake-segment is not running" in st.detail, st
    finally:
        if ep is not None:
            stop_store(ep, grace_s=2.0)
        kill_recorded(state)


def test_an_offline_run_and_a_stopped_store_show_no_store_line(tmp_path):
    node, state, run = _streaming_run(tmp_path, storage="disk")
    try:
        assert read_node_activity(node, str(state)).stores == {}       # disk: no server to show
        (run / "run-config.json").write_text(json.dumps({"stream": {"storage": "mooncake", "buffer_gib": 1}}))
        # streaming, but its store not started yet (or stopped by the run): no endpoint, no store process
        assert read_node_activity(node, str(state)).stores == {}
        (run / "store_endpoint.json").write_text("{}")                  # an endpoint left that names nothing
        st = read_node_activity(node, str(state)).stores["r1"]
        assert not st.ok and st.buffer_bytes == 1 << 30 and "unreadable" in st.detail, st
    finally:
        kill_recorded(state)
