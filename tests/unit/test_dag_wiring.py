"""The pipeline's and the reconcile DAG's wiring, edge by edge, from one DagBag parse of each file per module
(about 0.3 s each; no Airflow DB, no task run).

test_dag_integrity checks that the phases come in order (transitively) and a few trigger rules; this file holds
every direct edge of the one-node pipeline, so a gate that is bypassed (a server started straight after the
cleanup, the corpus built before the generation's teardown) or an edge added around verification fails here.
The fleet's task groups are checked by test_fleet_config (parsed with the two-node example).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from eagleflow.airflow.gpu_operators import FreeGpusOperator, GpuIdleSensor

REPO = Path(__file__).resolve().parents[2]

# task -> its direct upstream tasks, phase by phase (the one-node DAG parsed with the demo config)
PIPELINE_UPSTREAM = {
    "write_run_config": set(),
    # generation: GPU gates, the server as a setup/teardown pair, the mapped shards
    "free_gpus_before_generation": {"write_run_config"},
    "gpus_idle_before_generation": {"free_gpus_before_generation"},
    "start_generate_server": {"gpus_idle_before_generation"},
    "plan_generate_shards": {"start_generate_server"},
    "generate_responses": {"plan_generate_shards"},
    "stop_generate_server": {"generate_responses", "start_generate_server"},
    "free_gpus_after_generation": {"stop_generate_server", "start_generate_server"},
    # corpus and disk: after the generation and its GPU cleanup
    "prepare_corpus": {"generate_responses", "free_gpus_after_generation"},
    "delete_old_caches": {"prepare_corpus"},
    "check_disk": {"delete_old_caches"},
    # the run's hidden-state store (stream.storage; a no-op for disk) runs before any shard puts into it
    "start_store": {"check_disk"},
    # capture: GPU gates, the capture server as a setup/teardown pair, the mapped shards, the held-out records
    "free_gpus": {"check_disk"},
    "gpus_idle": {"free_gpus"},
    "start_capture_server": {"gpus_idle"},
    "capture_server_ready": {"start_capture_server"},
    "plan_shards": {"capture_server_ready", "start_store"},
    "extract_shard": {"plan_shards"},
    "capture_held_out": {"extract_shard"},
    "stop_capture_server": {"capture_held_out", "start_capture_server"},
    "free_gpus_after_capture": {"stop_capture_server", "start_capture_server"},
    # offline, verification gates training (on idle GPUs); streaming, training starts once the capture is ready
    # and the store runs (choose_training_start skips the path not taken); the store stopped after both; export
    "verify_hidden_states": {"extract_shard"},
    "choose_training_start": {"start_store", "plan_shards"},
    "train_from_stream": {"choose_training_start"},
    "trainer_gpus_idle": {"train_from_stream"},
    "gpus_idle_after_capture": {"verify_hidden_states", "free_gpus_after_capture", "capture_held_out",
                                "choose_training_start"},
    "train_draft": {"gpus_idle_after_capture", "trainer_gpus_idle"},
    "stop_store": {"train_draft", "verify_hidden_states"},
    "export_draft": {"train_draft"},
    # evaluation: GPU gates, its servers freed however it ends
    "free_gpus_before_evaluation": {"export_draft"},
    "gpus_idle_before_evaluation": {"free_gpus_before_evaluation"},
    "evaluate_draft": {"gpus_idle_before_evaluation"},
    "free_gpus_after_evaluation": {"evaluate_draft", "gpus_idle_before_evaluation"},
    # a person's approval when eval.approval asks for one (a no-op otherwise): it emits the promoted-draft event
    "approve_promotion": {"evaluate_draft"},
    # the report, however the run went, with the approval's answer
    "run_report": {"evaluate_draft", "approve_promotion", "write_run_config"},
}


def _parse(name: str, folder: Path = REPO / "dags"):
    from airflow.dag_processing.dagbag import DagBag
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("EAGLEFLOW_CONFIG", raising=False)   # the demo's one node, whatever this shell points at
        bag = DagBag(dag_folder=str(folder / f"{name}.py"))  # include_examples raises TypeError in 3.3.x
    assert bag.import_errors == {}
    return bag.dags[name]


@pytest.fixture(scope="module")
def pipeline():
    return _parse("eagle3_pipeline")


@pytest.fixture(scope="module")
def reconcile():
    return _parse("eagle3_shard_reconcile")


def test_every_direct_edge_of_the_one_node_pipeline(pipeline):
    actual = {t.task_id: set(t.upstream_task_ids) for t in pipeline.tasks}
    assert actual.keys() == PIPELINE_UPSTREAM.keys()
    wrong = {t: (sorted(actual[t]), sorted(up)) for t, up in PIPELINE_UPSTREAM.items() if actual[t] != up}
    assert wrong == {}, "task: (upstream in the DAG, upstream expected)"


def test_every_server_and_the_evaluation_start_right_behind_a_free_then_idle_gate(pipeline):
    for task_id, generation in (("start_generate_server", True), ("start_capture_server", False),
                                ("evaluate_draft", False)):
        (idle,) = pipeline.get_task(task_id).upstream_list
        (free,) = idle.upstream_list
        assert isinstance(idle, GpuIdleSensor) and isinstance(free, FreeGpusOperator), task_id
        assert (idle.phase == "generate") is generation and (free.phase == "generate") is generation, task_id
        assert idle.deferrable, f"{idle.task_id} would hold a worker slot while it waits"
    # training waits for idle GPUs too (the capture server's memory freed); streaming, its own GPUs only (the
    # capture server still holds the others)
    assert isinstance(pipeline.get_task("gpus_idle_after_capture"), GpuIdleSensor)
    assert pipeline.get_task("gpus_idle_after_capture").gpus == "run"
    stream_idle = pipeline.get_task("trainer_gpus_idle")
    assert isinstance(stream_idle, GpuIdleSensor) and stream_idle.gpus == "trainer" and stream_idle.deferrable


@pytest.mark.parametrize("setup, teardowns", [
    ("start_generate_server", ("stop_generate_server", "free_gpus_after_generation")),
    ("start_capture_server", ("stop_capture_server", "free_gpus_after_capture")),
    ("gpus_idle_before_evaluation", ("free_gpus_after_evaluation",)),
    ("write_run_config", ("run_report",)),
])
def test_what_a_phase_starts_is_stopped_however_the_phase_ends(pipeline, setup, teardowns):
    assert pipeline.get_task(setup).is_setup
    for task_id in teardowns:
        t = pipeline.get_task(task_id)
        assert t.is_teardown and setup in t.upstream_task_ids, task_id
        assert t.trigger_rule == "all_done_setup_success", task_id


@pytest.mark.parametrize("task_id, plan", [("extract_shard", "plan_shards"),
                                           ("generate_responses", "plan_generate_shards")])
def test_the_shards_are_mapped_over_their_plan_with_retries(pipeline, task_id, plan):
    t = pipeline.get_task(task_id)
    arg = t.expand_input.value["shard"]
    assert arg.operator.task_id == plan and arg.key == "return_value"
    assert t.partial_kwargs["retries"] == 2


def test_verification_runs_after_failed_shards_and_only_its_success_lets_training_start(pipeline):
    assert pipeline.get_task("verify_hidden_states").trigger_rule == "all_done"
    downstream_of_verify = pipeline.get_task("verify_hidden_states").get_flat_relative_ids(upstream=False)
    for t in ("gpus_idle_after_capture", "train_draft", "export_draft", "evaluate_draft"):
        assert t in downstream_of_verify, t
    for t in ("gpus_idle_after_capture", "export_draft", "evaluate_draft"):
        assert pipeline.get_task(t).trigger_rule == "all_success", t
    # nothing of the training phase hangs off the shards without passing verification
    assert not ({"train_draft", "export_draft"} & set(pipeline.get_task("extract_shard").downstream_task_ids))
    # training has two ways in, one of them skipped by choose_training_start at once: offline the verified
    # one (gpus_idle_after_capture, all_success behind verification), streaming train_from_stream; a failed or
    # upstream-failed way in stops it (none_failed), and it never runs with both skipped (min_one_success)
    train = pipeline.get_task("train_draft")
    assert train.trigger_rule == "none_failed_min_one_success"
    assert train.upstream_task_ids == {"gpus_idle_after_capture", "trainer_gpus_idle"}
    choose = pipeline.get_task("choose_training_start")
    assert choose.downstream_task_ids == {"gpus_idle_after_capture", "train_from_stream"}
    assert (choose.offline_task, choose.stream_task) == ("gpus_idle_after_capture", "train_from_stream")


def test_the_store_is_started_before_the_shards_and_stopped_however_the_run_went(pipeline):
    from eagleflow.airflow.store_operators import StartStoreOperator, StopStoreOperator
    start, stop = pipeline.get_task("start_store"), pipeline.get_task("stop_store")
    assert isinstance(start, StartStoreOperator) and isinstance(stop, StopStoreOperator)
    assert "extract_shard" in start.get_flat_relative_ids(upstream=False)
    assert "train_draft" in start.get_flat_relative_ids(upstream=False)
    assert stop.trigger_rule == "all_done" and not stop.is_teardown
    assert {"train_draft", "verify_hidden_states", "extract_shard", "start_store"} <= \
        stop.get_flat_relative_ids(upstream=True)


def test_the_run_config_is_frozen_by_the_first_task_only(pipeline):
    assert [t.task_id for t in pipeline.tasks if getattr(t, "freezes_run_config", False)] == ["write_run_config"]


def test_the_reconcile_dag_reruns_each_shard_its_scan_found_then_mails_whatever_they_did(reconcile):
    find, rerun, summary = (reconcile.get_task(t) for t in ("find_incomplete_shards", "rerun_shard", "mail_summary"))
    assert find.freezes_run_config and find.upstream_task_ids == set()
    arg = rerun.expand_input.value["target"]
    assert arg.operator.task_id == "find_incomplete_shards" and arg.key == "return_value"
    assert rerun.upstream_task_ids == {"find_incomplete_shards"}
    assert summary.upstream_task_ids == {"rerun_shard"} and summary.trigger_rule == "all_done"
    assert find.latest_runs == "{{ params.latest_runs }}"


def test_the_promoted_draft_event_comes_from_the_approval_task_alone(pipeline):
    """evaluate_draft never announces a promotion a person has still to approve; the approval form asks only
    why (none of the DAG's Params)."""
    from eagleflow.airflow.approval_operators import ApprovePromotionOperator
    from eagleflow.airflow.train_operators import PROMOTED_DRAFT_ASSET
    emits = [t.task_id for t in pipeline.tasks
             if any(getattr(o, "uri", None) == PROMOTED_DRAFT_ASSET.uri for o in t.outlets)]
    assert emits == ["approve_promotion"]
    approve = pipeline.get_task("approve_promotion")
    assert isinstance(approve, ApprovePromotionOperator) and list(approve.serialized_params) == ["reason"]
    assert approve.options == ["Approve", "Reject"] and approve.trigger_rule == "all_success"
