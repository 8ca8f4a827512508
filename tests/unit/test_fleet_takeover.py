"""A fleet's hand-over on the node (eagleflow.watchdog.reconcile): a shard is handed over only when proven free
of our workers, its worker refuses it from then on, and the taking node counts it as its own."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from eagleflow.phases.extract.lifecycle import worker_role
from eagleflow.local_run import LocalRun
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.fleet import takeover
from eagleflow.watchdog import reconcile

REPO = Path(__file__).resolve().parents[2]


SOURCE = REPO / "tests" / "fixtures" / "corpus" / "good_sharegpt.jsonl"


def node_run(tmp_path: Path, name: str) -> LocalRun:
    """The run ``r`` of a two-node fleet (a: extraction shards 0-1, generation shard 0; b: extraction shards 2-3,
    generation shard 1) as node ``name`` sees it, its config frozen on disk as the pipeline writes it."""
    whole = load_config(data={
        "target_model": "/m", "run_root": str(tmp_path / "runs-a"), "capture": {"shards": 4},
        "server": {"dump_dir": "/d"},
        "corpus": {"sources": [{"name": "chat", "path": str(SOURCE)}]},
        "generate": {"enabled": True, "shards": 2},
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
    assert takeover.handed_over_to(b.layout, 2)["to"] == "a"
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
        assert takeover.handed_over_to(b.layout, 3) is None
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert reconcile.hand_over(b, [3], "a")["handed_over"] == [3]   # its holder gone: free, and handed over


def test_the_taking_node_counts_a_handed_over_shard_as_its_own(tmp_path):
    a = node_run(tmp_path, "a")
    assert reconcile.own_shards(a, "extract") == [0, 1]
    assert reconcile.claim(a, 2, log=lambda m: None)["action"] == "skipped"   # b's, not handed over
    takeover.record_taken_over(a, 2, "b")
    assert takeover.taken_over(a) == {2: "b"}
    assert reconcile.own_shards(a, "extract") == [0, 1, 2]
    (Path(str(a.layout.run_dir)) / takeover.TAKEOVER_FILE).write_text("{not json")
    try:
        reconcile.own_shards(a, "extract")
    except ValueError as e:
        assert takeover.TAKEOVER_FILE in str(e) and "take_over_shards" in str(e)
    else:
        raise AssertionError("a corrupt takeover record was read as empty")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "include")})


def test_a_free_generation_shard_is_handed_over_and_its_generation_worker_refuses_it(tmp_path):
    """The same hand-over for the generation phase: its own lock and mark (an extraction shard of the same
    number stays b's), and b's generation worker, started as the pipeline starts it, refuses the shard."""
    b = node_run(tmp_path, "b")
    states = json.loads(cli("reconcile", "states", "--config", b.config_path, "--run-id", "r", "--phase",
                            "generate", "--shards", "1").stdout)["shards"]
    assert [(st["shard"], st["stored"], st["finished"]) for st in states] == [(1, 0, False)]
    assert states[0]["expected"] > 0   # counted from the source, as b's worker would read it
    res = cli("reconcile", "hand-over", "--config", b.config_path, "--run-id", "r", "--phase", "generate",
              "--shards", "1", "--to", "a")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"handed_over": [1], "kept": {}, "node": "b"}
    mark = tmp_path / "state-b" / "locks" / "r.generate_shard_00001.handed-over"
    assert json.loads(mark.read_text())["to"] == "a"
    assert takeover.handed_over_to(b.layout, 1, "generate")["to"] == "a"
    assert takeover.handed_over_to(b.layout, 1) is None              # extraction shard 1: another shard
    res = cli("generate", "run", "--config", b.config_path, "--run-id", "r", "--shard", "1", "--url",
              "http://127.0.0.1:9")
    assert res.returncode == takeover.EXIT_HANDED_OVER, res.stderr
    assert "generate shard 1 of run r was handed over to fleet node a" in res.stderr
    assert not Path(str(b.layout.generate_shard_dir(1))).exists()
    # a shard outside the phase is named, not looked at
    res = cli("reconcile", "hand-over", "--config", b.config_path, "--run-id", "r", "--phase", "generate",
              "--shards", "1,2", "--to", "a")
    assert res.returncode == 2 and "--shards [2] outside 0..1 (generate.shards = 2" in res.stderr, res.stderr


def test_the_taking_node_counts_a_handed_over_generation_shard_as_its_own_and_apart(tmp_path):
    a = node_run(tmp_path, "a")
    assert reconcile.own_shards(a, "generate") == [0]
    assert reconcile.claim(a, 1, log=lambda m: None, phase="generate")["action"] == "skipped"   # b's
    takeover.record_taken_over(a, 2, "b")
    takeover.record_taken_over(a, 1, "b", "generate")
    assert takeover.taken_over(a, "generate") == {1: "b"} and takeover.taken_over(a) == {2: "b"}
    assert reconcile.own_shards(a, "generate") == [0, 1] and reconcile.own_shards(a, "extract") == [0, 1, 2]
    # the record as written: extraction under "shards", as before generation shards could move
    assert json.loads((Path(str(a.layout.run_dir)) / takeover.TAKEOVER_FILE).read_text()) == \
        {"shards": {"2": "b"}, "generate_shards": {"1": "b"}}
    try:
        reconcile.claim(a, 0, log=lambda m: None, phase="generate", taken_from="c")
    except ValueError as e:
        assert "--taken-from 'c'" in str(e) and "a, b" in str(e)
    else:
        raise AssertionError("a claim taken from a node outside the fleet was accepted")


def test_a_node_never_collects_a_shard_it_handed_over(tmp_path):
    """Off shared storage, a node's collect task (cleared and run again after a takeover) copies its other
    shards to the training node, but never one it handed over: its partial copy would overwrite the shard the
    training node completed."""
    from types import SimpleNamespace

    from eagleflow.airflow.fleet_operators import CollectShardsOperator
    from eagleflow.airflow.runtime import RunContext
    a, b = node_run(tmp_path, "a"), node_run(tmp_path, "b")
    for run, text in ((b, "b: 1 of 6 records"), (a, "a: 6 of 6 records")):
        for shard_dir in (Path(str(run.layout.generate_shard_dir(1))), Path(str(run.layout.shard_dir(2)))):
            shard_dir.mkdir(parents=True)
            (shard_dir / "manifest.jsonl").write_text(text + "\n")
    reconcile.hand_over(b, [1], "a", phase="generate")
    ctx = RunContext(cfg=b.cfg, layout=b.layout)
    for phase, key, shard in (("generate", "generate_shards", 1), ("extract", "shards", 2)):
        op = CollectShardsOperator(task_id=f"collect_{phase}", phase=phase)
        ready = {"node": "b", "shared": False, key: [shard]}
        out = op.run(ctx, {"ti": SimpleNamespace(xcom_pull=lambda task_ids: ready)})
        assert out == {"node": "b", "copied": {} if phase == "generate" else {shard: 1}}, out
    # the handed-over generation shard kept the training node's manifest; extraction shard 2 (not handed over)
    # was copied as before
    assert (Path(str(a.layout.generate_shard_dir(1))) / "manifest.jsonl").read_text() == "a: 6 of 6 records\n"
    assert (Path(str(a.layout.shard_dir(2))) / "manifest.jsonl").read_text() == "b: 1 of 6 records\n"


def test_a_shard_task_of_a_node_that_handed_the_shard_over_skips_naming_the_taker(tmp_path):
    """b's group cleared after its hand-over: its shard tasks skip before any server or worker starts."""
    import pytest
    from airflow.sdk.exceptions import AirflowSkipException

    from eagleflow.airflow.shard_operators import ShardOperator
    from eagleflow.airflow.runtime import RunContext
    b = node_run(tmp_path, "b")
    reconcile.hand_over(b, [2], "a")
    reconcile.hand_over(b, [1], "a", phase="generate")
    ctx = RunContext(cfg=b.cfg, layout=b.layout)
    for op, what in ((ShardOperator(phase="extract", task_id="extract_shard", shard=2), "extract shard 2"),
                     (ShardOperator(phase="generate", task_id="generate_responses", shard=1), "generate shard 1")):
        with pytest.raises(AirflowSkipException, match=f"{what} of run r: node b handed it over to a"):
            op.run(ctx, {})
    assert not Path(str(b.layout.pids_dir)).exists() or not list(Path(str(b.layout.pids_dir)).iterdir())  # none started
