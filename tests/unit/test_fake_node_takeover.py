"""TakeOverShardsOperator on fake nodes: which shards the training node takes over, from the typed answers of
``eagleflow reconcile states`` (training node) and ``reconcile hand-over`` (the other node), in milliseconds.

The fleet: training node a (shards 0-1), b (2-3), c (4-5). Every answer is the protocol's own model
(``eagleflow.protocol``), so a changed model changes what the fake prints.
"""
from __future__ import annotations

import pytest

from eagleflow.airflow.fleet_operators import TakeOverShardsOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.config import load_config
from eagleflow.fleet.assign import shards_of
from eagleflow.layout import RunLayout
from eagleflow.nodes import NodeUnreachable
from eagleflow.protocol import HandOverAnswer, ShardStateAnswer, ShardStates
from tests.fixtures.fake_node import FakeFleet, FakeNode, Reply, capture_log, task_context

RUN_ID = "manual__2026-12-04T11:00:00+00:00"


def _cfg(take_over: bool = True):
    return load_config(data={
        "target_model": "/models/t", "run_root": "/data/runs-a", "capture": {"shards": 6},
        "fleet": {"training_node": "a", "take_over": take_over, "nodes": [
            {"name": "a", "state_dir": "/data/state-a", "conn_id": "node_a"},
            {"name": "b", "run_root": "/data/runs-b", "state_dir": "/data/state-b", "conn_id": "node_b"},
            {"name": "c", "run_root": "/data/runs-c", "state_dir": "/data/state-c", "conn_id": "node_c"}]}})


@pytest.fixture
def fleet(monkeypatch):
    cfg = _cfg()
    assert [shards_of(cfg, n) for n in "abc"] == [[0, 1], [2, 3], [4, 5]]   # what the answers below assume
    fake = FakeFleet().install(monkeypatch)
    nodes = {n: fake.add(FakeNode(n, conn_id=f"node_{n}")) for n in "abc"}
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID))
    return ctx, nodes


def _state(shard: int, stored: int, expected: int = 10, *, finished: bool = True) -> ShardStateAnswer:
    return ShardStateAnswer(run_id=RUN_ID, shard=shard, num_shards=6, expected=expected, stored=stored,
                            worker_alive=False, run_config=f"/data/runs-a/{RUN_ID}/run-config.json",
                            finished=finished)


def _states_by_shards(stored: dict[int, int]):
    """The training node's `reconcile states`: the shards it is asked about (--shards), with these counts."""
    def answer(call):
        return ShardStates(shards=[_state(s, stored[s]) for s in map(int, call.option("--shards").split(","))])
    return answer


def _run(ctx) -> tuple[list[dict], str]:
    """What the operator returns (the mapped reruns' input) and the warnings it logged."""
    op = TakeOverShardsOperator(task_id="take_over_shards")
    log = capture_log(op)
    return op.run(ctx, task_context(ctx, op)), log.text("warning")


def test_a_node_that_hands_over_gives_its_incomplete_shards_to_the_training_node(fleet):
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 4, 3: 10, 4: 10, 5: 10}))
    nodes["b"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[2], kept={}, node="b"))
    todo, warned = _run(ctx)
    assert warned == ""
    assert todo == [{"run_id": ctx.layout.run_id, "phase": "extract", "shard": 2, "run_config": ctx.run_config_path,
                     "stored": 4, "expected": 10, "taken_from": "b"}]
    # asked b only about the missing shard, for the training node, with b's own frozen config
    (ask,) = nodes["b"].commands(("reconcile", "hand-over"))
    assert ask.option("--shards") == "2" and ask.option("--to") == "a" and ask.option("--phase") == "extract"
    assert ask.option("--config") == f"/data/runs-b/{ctx.layout.run_id}/run-config.b.json"   # b's own view
    assert ask.option("--run-id") == ctx.layout.run_id
    assert nodes["c"].commands(("reconcile", "hand-over")) == []      # c's shards are all on a
    assert [c.option("--shards") for c in nodes["a"].commands(("reconcile", "states"))] == ["2,3", "4,5"]


def test_an_unreachable_node_keeps_its_shards_and_the_others_go_on(fleet):
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 0, 3: 0, 4: 3, 5: 10}))
    nodes["b"].go_down("[Errno 113] No route to host")
    nodes["c"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[4], kept={}, node="c"))
    todo, warned = _run(ctx)
    assert [(t["shard"], t["taken_from"], t["stored"]) for t in todo] == [(4, "c", 3)]
    assert len(nodes["b"].commands(("reconcile", "hand-over"))) == 1     # asked once, not answered
    assert "node b could not prove its extract shards [2, 3] free of our workers" in warned
    assert "No route to host" in warned


def test_shards_a_node_was_not_asked_about_are_ignored(fleet):
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 1, 3: 10, 4: 10, 5: 10}))
    # b answers about shard 2 (asked), 3 (complete here: not asked) and 4 (c's shard)
    nodes["b"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[2, 3, 4], kept={"5": "lock held"},
                                                             node="b"))
    todo, warned = _run(ctx)
    assert [t["shard"] for t in todo] == [2]
    assert "with shard(s) [3, 4, 5] it was not asked about: those are ignored" in warned


def test_an_answer_in_another_nodes_name_is_no_proof(fleet):
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 1, 3: 1, 4: 10, 5: 10}))
    nodes["b"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[2, 3], kept={}, node="c"))
    todo, warned = _run(ctx)
    assert todo == []
    assert "node b answered the hand-over of extract shards [2, 3] as node 'c': refused" in warned


def test_a_kept_shard_waits_for_its_node(fleet):
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 1, 3: 1, 4: 10, 5: 10}))
    nodes["b"].on(("reconcile", "hand-over"),
                  HandOverAnswer(handed_over=[3], kept={"2": "its worker lock is held by pid 777"}, node="b"))
    todo, warned = _run(ctx)
    assert [t["shard"] for t in todo] == [3]
    assert "node b keeps extract shard 2: its worker lock is held by pid 777" in warned


def test_a_states_answer_about_other_shards_makes_that_nodes_shards_wait(fleet):
    ctx, nodes = fleet
    wrong = ShardStates(shards=[_state(2, 0), _state(7, 0)])          # asked 2,3
    nodes["a"].on(("reconcile", "states"), wrong, _states_by_shards({4: 0, 5: 10}))
    nodes["c"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[4], kept={}, node="c"))
    todo, warned = _run(ctx)
    assert [t["taken_from"] for t in todo] == ["c"]
    assert nodes["b"].calls == []                                     # never asked to hand anything over
    assert "answered the states of extract shards [2, 7] for extract shards [2, 3]: refused" in warned


def test_with_take_over_off_nobody_is_asked_to_hand_over(monkeypatch):
    cfg = _cfg(take_over=False)
    fake = FakeFleet().install(monkeypatch)
    a = fake.add(FakeNode("a"))
    for n in "bc":
        fake.add(FakeNode(n))
    a.on(("reconcile", "states"), _states_by_shards({2: 0, 3: 0, 4: 0, 5: 0}))
    todo, warned = _run(RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID)))
    assert todo == []
    assert "node b left extract shards [2, 3] incomplete here; fleet.take_over is off" in warned
    assert all(fake.nodes[n].calls == [] for n in "bc")


def test_a_shard_with_every_sample_but_no_final_heartbeat_is_still_missing(fleet):
    ctx, nodes = fleet

    def states(call):
        asked = map(int, call.option("--shards").split(","))
        return ShardStates(shards=[_state(s, 10, finished=(s != 3)) for s in asked])
    nodes["a"].on(("reconcile", "states"), states)
    nodes["b"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[3], kept={}, node="b"))
    todo, _ = _run(ctx)
    assert [(t["shard"], t["stored"], t["expected"]) for t in todo] == [(3, 10, 10)]
    assert nodes["b"].commands(("reconcile", "hand-over"))[0].option("--shards") == "3"


def test_a_malformed_hand_over_answer_keeps_the_shards(fleet):
    """An answer that does not fit HandOverAnswer (a shard name that is not a number) proves nothing."""
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 1, 3: 10, 4: 10, 5: 10}))
    nodes["b"].on(("reconcile", "hand-over"), Reply('{"handed_over": [2], "kept": {"../2": "x"}, "node": "b"}\n'))
    todo, warned = _run(ctx)
    assert todo == []
    assert "does not fit HandOverAnswer" in warned


def test_an_unreachable_training_node_fails_the_task_for_a_retry(fleet):
    ctx, nodes = fleet
    nodes["a"].go_down()
    with pytest.raises(NodeUnreachable, match="node a: SSH to node_a failed"):
        _run(ctx)


# -- CollectShardsOperator: node b's shards copied to the training node a (streamed, resumed, verified) -------

def _collect(ctx_b):
    from eagleflow.airflow.fleet_operators import CollectShardsOperator
    op = CollectShardsOperator(task_id="b.collect_shards", prepare_task_id="b.prepare_node")   # as the DAG names it
    log = capture_log(op)
    ready = {("b.prepare_node", "return_value"): {"node": "b", "shared": False, "shards": [2, 3]}}
    return op.run(ctx_b, task_context(ctx_b, op, xcoms=ready)), log


def test_collect_copies_a_shard_resuming_a_partial_and_moves_the_manifest_last(fleet):
    ctx, nodes = fleet
    b_ctx, a, b = ctx.for_node("b"), nodes["a"], nodes["b"]
    src, dst = str(b_ctx.layout.shard_dir(2)), str(ctx.layout.shard_dir(2))
    samples = {f"s{i:05d}.safetensors": bytes([i]) * (1000 + i) for i in range(3)}
    for name, data in samples.items():
        b.put(f"{src}/{name}", data)
    b.put(f"{src}/manifest.jsonl", "".join(f'{{"id": "{n}"}}\n' for n in samples))
    b.put(f"{src}/heartbeat.json", '{"state": "running"}')
    a.put(f"{dst}/.partial/s00001.safetensors", samples["s00001.safetensors"][:400])   # an interrupted copy
    a.put(f"{dst}/.partial/s00002.safetensors", samples["s00002.safetensors"])         # copied, not yet renamed
    from eagleflow.fleet.takeover import hand_over_mark
    b.put(str(hand_over_mark(b_ctx.layout, 3)), '{"to": "a", "at": 1796000000.0}')   # shard 3 is a's now
    out, log = _collect(b_ctx)
    assert out == {"node": "b", "copied": {2: 4}}
    for name, data in {**samples, "manifest.jsonl": b.files[f"{src}/manifest.jsonl"]}.items():
        assert a.files[f"{dst}/{name}"] == data, name
    assert f"{dst}/heartbeat.json" not in a.files                    # the node's heartbeat stays there
    assert not [f for f in a.files if "/.partial/" in f]              # every verified partial renamed into place
    assert [c.argv[2].rsplit("/", 1)[1] for c in a.commands("rename")][-1] == "manifest.jsonl"
    manifest = b.files[f"{src}/manifest.jsonl"]
    sent = len(samples["s00000.safetensors"]) + len(samples["s00001.safetensors"]) - 400 + len(manifest)
    resumed = 400 + len(samples["s00002.safetensors"])              # only what the partials lacked was sent
    assert f"files_copied=4, files_kept=0, bytes_copied={sent}, bytes_resumed={resumed})" in log.text("info")
    assert "handed it over to a; not copied" in log.text("warning")
    assert not [c for c in b.commands("eagleflow.fleet.digest") if "shard_00003" in c.argv[3]]


def test_collect_to_an_unreachable_training_node_fails_naming_each_shard_for_a_retry(fleet):
    ctx, nodes = fleet
    nodes["a"].go_down("[Errno 113] No route to host")
    with pytest.raises(RuntimeError) as e:
        _collect(ctx.for_node("b"))
    msg = str(e.value)
    assert msg.startswith("node b: 2 shard(s) not collected on the training node (a retry resumes what was copied)")
    for shard in (2, 3):   # one failed copy does not stop the others
        assert f"extract shard {shard}: node a: SSH to node_a failed: [Errno 113] No route to host" in msg


def test_collect_from_an_unreachable_node_fails_the_task_as_unreachable(fleet):
    ctx, nodes = fleet
    nodes["b"].go_down()
    with pytest.raises(NodeUnreachable, match="node b: SSH to node_b failed"):
        _collect(ctx.for_node("b"))
    assert nodes["a"].calls == []


def test_collect_refuses_a_digest_answer_with_a_name_that_is_a_path(fleet):
    ctx, nodes = fleet
    b_ctx = ctx.for_node("b")
    nodes["b"].on("eagleflow.fleet.digest", Reply('{"files": {"../../etc/passwd": {"size": 1, "sha256": "'
                                                  + "0" * 64 + '"}}}\n'))
    with pytest.raises(RuntimeError, match="one plain path component"):
        _collect(b_ctx)
    assert nodes["a"].commands("open_file") == [] and nodes["b"].commands("open_file") == []


@pytest.mark.parametrize("depth", [3000, 100000])
def test_a_hand_over_answer_nested_thousands_deep_refuses_that_node_only(fleet, depth):
    """Issue 52, item 1: an answer nested ~3,000 deep made json.loads raise RecursionError, which escaped
    parse_answer as no NodeError and failed the takeover whole; now it is that node's refused answer and the
    honest node's shards are still taken over."""
    ctx, nodes = fleet
    nodes["a"].on(("reconcile", "states"), _states_by_shards({2: 1, 3: 1, 4: 0, 5: 10}))
    nodes["b"].on(("reconcile", "hand-over"), Reply("[" * depth + "]" * depth + "\n"))
    nodes["c"].on(("reconcile", "hand-over"), HandOverAnswer(handed_over=[4], kept={}, node="c"))
    todo, warned = _run(ctx)
    assert [(t["taken_from"], t["shard"]) for t in todo] == [("c", 4)]
    assert "node b could not prove its extract shards [2, 3] free of our workers" in warned
    assert "on node b: the answer of `" in warned and f"JSON nested {depth} levels deep" in warned
