"""The run's hidden-state store in Airflow (issue 53): the store tasks, the choice of when training starts, and
verification of a streaming run, each on a stand-in for the run's context and node (no Airflow DB, no node)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

from eagleflow.airflow.alerts import ConsequentialFailure
from eagleflow.airflow.store_operators import ChooseTrainingStartOperator, StartStoreOperator, StopStoreOperator
from eagleflow.airflow.verify_operators import VerifyHiddenStatesOperator


class FakeNode:
    name = "local"

    def __init__(self, answers=None, files=None):
        self.answers = list(answers or [])
        self.files = dict(files or {})
        self.calls: list[list[str]] = []

    def run_json(self, argv, model, **kw):
        self.calls.append(argv)
        return model.model_validate(self.answers.pop(0))

    def read_text(self, path, missing_ok=True):
        self.calls.append(["cat", path])
        value = self.files.get(path)
        return value.pop(0) if isinstance(value, list) else value


class NoNode:
    name = "local"

    def __getattr__(self, item):
        raise AssertionError(f"the node was asked ({item}) for a store with no server")


def _ctx(storage: str, node, tmp_path):
    return SimpleNamespace(cfg=SimpleNamespace(stream=SimpleNamespace(storage=storage), is_fleet=False), node=node,
                           layout=SimpleNamespace(run_id="r1", stream_verified_file=tmp_path / "stream_verified.json"),
                           eagleflow_argv=lambda *a: ["eagleflow", *a, "--config", "c.json", "--run-id", "r1"])


@pytest.mark.parametrize("storage, chosen", [("disk", "gpus_idle_after_capture"), ("mooncake", "train_from_stream")])
def test_training_starts_beside_the_shards_only_when_the_run_streams(tmp_path, storage, chosen):
    op = ChooseTrainingStartOperator(task_id="choose_training_start", stream_task="train_from_stream",
                                     offline_task="gpus_idle_after_capture")
    assert op.run(_ctx(storage, NoNode(), tmp_path), {}) == chosen


def test_the_disk_store_starts_and_stops_nothing_without_asking_the_node(tmp_path):
    ctx = _ctx("disk", NoNode(), tmp_path)
    assert StartStoreOperator(task_id="start_store").run(ctx, {}) == {"store": "disk", "started": False}
    assert StopStoreOperator(task_id="stop_store").run(ctx, {}) == {"store": "disk", "stopped": []}


def test_a_streaming_store_is_started_and_stopped_through_the_node_cli(tmp_path):
    node = FakeNode(answers=[{"store": "mooncake", "endpoint_file": "/r/store_endpoint.json", "rpc_port": 5},
                             {"store": "mooncake", "stopped": [{"pid": 7, "outcome": "terminated"},
                                                               {"pid": 8, "outcome": "terminated"}]}])
    ctx = _ctx("mooncake", node, tmp_path)
    started = StartStoreOperator(task_id="start_store").run(ctx, {})
    assert started["rpc_port"] == 5 and node.calls[0][1:3] == ["store", "start"]
    stopped = StopStoreOperator(task_id="stop_store").run(ctx, {})
    assert [r["pid"] for r in stopped["stopped"]] == [7, 8] and node.calls[1][1:3] == ["store", "stop"]


def test_a_store_that_does_not_stop_fails_the_task_naming_its_process(tmp_path):
    node = FakeNode(answers=[{"store": "mooncake", "stopped": [{"pid": 9, "pid_file": "/s/m.json",
                                                                "outcome": "survived"}]}])
    with pytest.raises(AirflowFailException, match="pid 9: survived"):
        StopStoreOperator(task_id="stop_store").run(_ctx("mooncake", node, tmp_path), {})
    assert StopStoreOperator(task_id="stop_store").trigger_rule == "all_done"


def _verify(states):
    op = VerifyHiddenStatesOperator(task_id="verify_hidden_states", poll_interval_s=0.01)
    ti = SimpleNamespace(get_task_states=lambda **kw: {"run": {"train_draft": states.pop(0) if states else None}})
    return op, {"ti": ti, "dag_run": SimpleNamespace(dag_id="d", run_id="run")}


def test_streaming_verification_waits_for_the_trainers_record_and_passes_it_green(tmp_path):
    rec = {"ok": True, "epochs": 1, "samples": 24, "trained_per_epoch": {"0": 24}, "summary": "green"}
    path = str(tmp_path / "stream_verified.json")
    node = FakeNode(files={path: [None, None, json.dumps(rec)]})
    op, context = _verify(["running", None])
    ctx = _ctx("mooncake", node, tmp_path)
    for _ in range(2):   # rescheduled while training runs: no worker slot held
        with pytest.raises(AirflowRescheduleException):
            op.run(ctx, context)
    summary = op.run(ctx, context)
    assert "24 sample(s) x 1 epoch(s)" in summary and "exactly once" in summary
    assert all(c[0] == "cat" for c in node.calls), "no capture verify on a streaming run: there are no files"


def test_streaming_verification_fails_on_a_record_that_is_not_green(tmp_path):
    path = str(tmp_path / "stream_verified.json")
    node = FakeNode(files={path: json.dumps({"ok": False, "summary": "epoch 0: 1 trained twice or more (s3)"})})
    op, context = _verify([])
    with pytest.raises(AirflowFailException, match="trained twice or more"):
        op.run(_ctx("mooncake", node, tmp_path), context)


def test_streaming_verification_gives_up_without_a_second_alert_when_training_failed(tmp_path):
    op, context = _verify(["up_for_retry", "failed"])
    with pytest.raises(AirflowRescheduleException):   # a retry may still write it
        op.run(_ctx("mooncake", FakeNode(), tmp_path), context)
    with pytest.raises(ConsequentialFailure, match="train_draft ended failed"):
        op.run(_ctx("mooncake", FakeNode(), tmp_path), context)
