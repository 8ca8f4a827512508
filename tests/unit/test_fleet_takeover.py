"""A fleet's hand-over on the node (eagleflow.watchdog.reconcile): a shard is handed over only when proven free
of our workers, its worker refuses it from then on, and the taking node counts it as its own."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from eagleflow.capture.lifecycle import LocalRun, worker_role
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.watchdog import reconcile

REPO = Path(__file__).resolve().parents[2]


def node_run(tmp_path: Path, name: str) -> LocalRun:
    """The run ``r`` of a two-node fleet (a: shards 0-1, b: shards 2-3) as node ``name`` sees it, its config
    frozen on disk as the pipeline writes it."""
    whole = load_config(data={
        "target_model": "/m", "run_root": str(tmp_path / "runs-a"), "capture": {"shards": 4, "dump_dir": "/d"},
        "fleet": {"training_node": "a", "nodes": [
            {"name": "a", "state_dir": str(tmp_path / "state-a")},
            {"name": "b", "run_root": str(tmp_path / "runs-b"), "state_dir": str(tmp_path / "state-b")}]}})
    cfg = whole.node_view(name)
    layout = RunLayout.for_run(cfg, "r")
    path = Path(str(layout.run_config_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    return LocalRun(cfg=load_config(path), layout=layout, config_path=str(path))


def test_a_free_shard_is_handed_over_once_and_its_worker_refuses_it(tmp_path):
    b = node_run(tmp_path, "b")
    answer = reconcile.hand_over(b, [2, 3], "a")
    assert answer == {"handed_over": [2, 3], "kept": {}, "node": "b"}
    assert reconcile.handed_over_to(b.layout, 2)["to"] == "a"
    assert reconcile.hand_over(b, [2], "a")["handed_over"] == [2]             # a retried task: the same answer
    assert reconcile.hand_over(b, [2], "c")["kept"] == {"2": "already handed over to a"}
    # the worker on b, started as the pipeline starts it, takes its lock, sees the mark and extracts nothing
    res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", b.config_path,
                          "--run-id", "r", "--shard", "2"], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "include")})
    assert res.returncode == 5, res.stderr
    assert "shard 2 of run r was handed over to fleet node a" in res.stderr
    assert not Path(str(b.layout.shard_dir(2))).exists()


def test_a_shard_whose_worker_lock_is_held_stays_with_its_node(tmp_path):
    b = node_run(tmp_path, "b")
    lock = str(b.layout.lock_file(worker_role(3)))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from eagleflow.nodes.locks import hold_for_life; hold_for_life(sys.argv[2], 'worker of shard 3');"
        "print('held', flush=True); time.sleep(120)"), str(REPO / "include"), lock],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        answer = reconcile.hand_over(b, [2, 3], "a")
        assert answer["handed_over"] == [2]
        assert "its worker lock is held" in answer["kept"]["3"] and f"pid {holder.pid}" in answer["kept"]["3"]
        assert reconcile.handed_over_to(b.layout, 3) is None
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert reconcile.hand_over(b, [3], "a")["handed_over"] == [3]   # its holder gone: free, and handed over


def test_the_taking_node_counts_a_handed_over_shard_as_its_own(tmp_path):
    a = node_run(tmp_path, "a")
    assert reconcile.own_shards(a, "extract") == [0, 1]
    assert reconcile.claim(a, 2, log=lambda m: None)["action"] == "skipped"   # b's, not handed over
    reconcile.record_taken_over(a, 2, "b")
    assert reconcile.taken_over(a) == {2: "b"}
    assert reconcile.own_shards(a, "extract") == [0, 1, 2]
    (Path(str(a.layout.run_dir)) / reconcile.TAKEOVER_FILE).write_text("{not json")
    try:
        reconcile.own_shards(a, "extract")
    except ValueError as e:
        assert reconcile.TAKEOVER_FILE in str(e) and "take_over_shards" in str(e)
    else:
        raise AssertionError("a corrupt takeover record was read as empty")
