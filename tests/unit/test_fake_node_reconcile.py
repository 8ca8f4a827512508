"""The reconcile DAG's operators on a FakeNode: what ``eagleflow reconcile scan`` answers becomes the reruns'
input, and a claim's answer decides whether the rerun watches, skips or refuses; in milliseconds."""
from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import TaskDeferred

from eagleflow.airflow.reconcile_operators import FindIncompleteShardsOperator, RerunShardOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes import NodeAnswerError
from eagleflow.protocol import ClaimAnswer, ShardStateAnswer, ShardStates
from tests.fixtures.fake_node import FakeFleet, FakeNode, Reply, capture_log, task_context

NODE = "gpu-node-1"
RUN = "manual__2026-12-01T08_00_00_00_00"          # the run a scan found (its run dir's name)
RUN_CONFIG = f"/data/runs/{RUN}/run-config.json"


def _cfg(**extra):
    return load_config(data={"target_model": "/models/t", "run_root": "/data/runs", "capture": {"shards": 4},
                             "node": {"name": NODE, "state_dir": "/data/state"}, **extra})


@pytest.fixture
def reconcile(monkeypatch):
    """The reconcile run's context on the node, and the run it reconciles (its config on the node)."""
    node = FakeNode(NODE)
    FakeFleet().install(monkeypatch).add(node)
    cfg = _cfg(watchdog={"alert_emails": ["oncall@example.com"]})
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "scheduled__2026-12-04T13:00:00+00:00"), _node=node)
    run_cfg = _cfg(watchdog={"alert_emails": ["someone@node.example"]}, node={"name": NODE, "python": "/evil/python",
                                                                            "state_dir": "/data/state"})
    node.put(RUN_CONFIG, json.dumps(run_cfg.model_dump(mode="json")))
    return ctx, node


def _state(shard, stored, expected=25, *, needs_rerun, phase="extract", alive=False):
    return ShardStateAnswer(run_id=RUN, shard=shard, num_shards=4, expected=expected, stored=stored,
                            worker_alive=alive, run_config=RUN_CONFIG, phase=phase, needs_rerun=needs_rerun,
                            line=f"run {RUN} shard {shard}: {stored}/{expected}")


def test_the_scan_becomes_the_reruns_input(reconcile):
    ctx, node = reconcile
    node.on(("reconcile", "scan"), ShardStates(shards=[
        _state(0, 25, needs_rerun=False), _state(1, 9, needs_rerun=True), _state(2, 3, needs_rerun=False, alive=True),
        _state(0, 4, expected=10, needs_rerun=True, phase="generate")]))
    op = FindIncompleteShardsOperator(task_id="find_incomplete_shards", latest_runs="5")   # a rendered template
    context = task_context(ctx, op)
    todo = op.run(ctx, context)
    assert todo == [{"run_id": RUN, "phase": "extract", "shard": 1, "run_config": RUN_CONFIG, "stored": 9,
                     "expected": 25},
                    {"run_id": RUN, "phase": "generate", "shard": 0, "run_config": RUN_CONFIG, "stored": 4,
                     "expected": 10}]
    assert [s["shard"] for s in context["ti"].pushed["scanned"]] == [0, 1, 2, 0]
    (scan,) = node.commands(("reconcile", "scan"))
    written = "/data/state/reconcile/config.json"      # beside the node state, never a run dir of its own
    assert scan.option("--config") == written and scan.option("--latest") == "5"
    assert json.loads(node.text(written)) == ctx.cfg.model_dump(mode="json")


@pytest.mark.parametrize("field, value, why", [
    ("run_id", "../../etc", "one plain path component"),
    ("run_config", "relative/run-config.json", "must be absolute"),
    ("stored", -1, "greater than or equal to 0"),
])
def test_a_scan_answer_that_breaks_the_protocol_is_refused_naming_the_field(reconcile, field, value, why):
    ctx, node = reconcile
    shard = {**_state(1, 9, needs_rerun=True).model_dump(), field: value}
    node.on(("reconcile", "scan"), Reply(json.dumps({"shards": [shard]}) + "\n"))
    op = FindIncompleteShardsOperator(task_id="find_incomplete_shards")
    with pytest.raises(NodeAnswerError) as e:
        op.run(ctx, task_context(ctx, op))
    assert "does not fit ShardStates" in str(e.value) and field in str(e.value) and why in str(e.value)


def _target(shard=1, phase="extract", **kw):
    return {"run_id": RUN, "phase": phase, "shard": shard, "run_config": RUN_CONFIG, "stored": 9, "expected": 25,
            **kw}


def test_a_started_claim_defers_the_runs_own_watch_with_the_reconciles_control_settings(reconcile):
    ctx, node = reconcile
    node.on(("reconcile", "claim"), ClaimAnswer(action="started", reason="worker started", shard=1, run_id=RUN,
                                                worker_pid=5150))
    op = RerunShardOperator(task_id="rerun_shard", target=_target(), deferrable=True)
    with pytest.raises(TaskDeferred) as d:
        op.execute(task_context(ctx, op))
    (claim,) = node.commands(("reconcile", "claim"))
    assert claim.option("--shard") == "1" and claim.option("--phase") == "extract"
    assert claim.option("--config") == RUN_CONFIG and claim.option("--run-id") == RUN
    assert claim.argv[0] == node.python and "/evil/python" not in claim.argv   # the node's copy says nothing here
    trigger = d.value.trigger
    assert isinstance(trigger, ShardWatchTrigger) and trigger.shard == 1
    assert trigger.ref.run_config == RUN_CONFIG and trigger.ref.run_id == RUN
    assert trigger.ref.control is not None and trigger.ref.control.alert_emails == ["oncall@example.com"]
    assert trigger.serialize()[1]["run"]["control"]["watchdog.alert_emails"] == ["oncall@example.com"]   # on the wire


def test_a_generation_shard_is_watched_by_the_generation_watch_and_a_taken_over_one_says_from_where(reconcile):
    ctx, node = reconcile
    node.on(("reconcile", "claim"), ClaimAnswer(action="attached", reason="worker alive", shard=0))
    op = RerunShardOperator(task_id="take_over_generated_shard", target=_target(0, "generate", taken_from="b"),
                            deferrable=True)
    with pytest.raises(TaskDeferred) as d:
        op.execute(task_context(ctx, op))
    assert isinstance(d.value.trigger, ShardWatchTrigger) and d.value.trigger.phase == "generate"
    (claim,) = node.commands(("reconcile", "claim"))
    assert claim.option("--phase") == "generate" and claim.option("--taken-from") == "b"


def test_a_skipped_claim_ends_the_rerun_without_a_watch(reconcile):
    ctx, node = reconcile
    node.on(("reconcile", "claim"), ClaimAnswer(action="skipped", reason="complete meanwhile: 25/25", shard=1))
    op = RerunShardOperator(task_id="rerun_shard", target=_target(), deferrable=True)
    log = capture_log(op)
    assert op.execute(task_context(ctx, op)) == {**_target(), "outcome": "skipped",
                                                 "reason": "complete meanwhile: 25/25"}
    assert f"run {RUN} extract shard 1: skipped (complete meanwhile: 25/25)" in log.text("info")


@pytest.mark.parametrize("answer, named", [
    (ClaimAnswer(action="started", reason="x", shard=2), "shard 2 (field 'shard')"),
    (ClaimAnswer(action="started", reason="x", shard=1, run_id="another-run"), "run_id 'another-run' (field 'run_id')"),
])
def test_a_claim_answered_about_another_shard_or_run_watches_nothing(reconcile, answer, named):
    ctx, node = reconcile
    node.on(("reconcile", "claim"), answer)
    op = RerunShardOperator(task_id="rerun_shard", target=_target(), deferrable=True)
    with pytest.raises(NodeAnswerError) as e:
        op.execute(task_context(ctx, op))
    assert f"the claim of extract shard 1 of run {RUN} answered about {named}" in str(e.value)
    assert "nothing is watched" in str(e.value)


def test_a_run_config_that_vanished_is_named(reconcile):
    ctx, node = reconcile
    del node.files[RUN_CONFIG]
    op = RerunShardOperator(task_id="rerun_shard", target=_target(), deferrable=True)
    with pytest.raises(FileNotFoundError, match=f"run config {RUN_CONFIG} vanished from node {NODE}"):
        op.execute(task_context(ctx, op))
    assert node.commands(("reconcile", "claim")) == []
