"""A streaming run of eagle3_pipeline under Airflow's dag.test() (issue 53): the ``storage`` Param set to mooncake
on a config that says disk; the run's Mooncake master and segment holder (the wheel's, on 127.0.0.1) started by
start_store and stopped by stop_store; train_draft reached through choose_training_start and train_from_stream
(gpus_idle_after_capture skipped), drawing from the store; verify_hidden_states passing on the trainer's
stream_verified.json; no hidden-state file on disk; the draft exported.

dag.test() runs one task at a time (a deferred task's trigger runs in line), so here the shards finish before
train_draft starts whatever the DAG allows: the buffer holds the whole corpus. That training overlaps the
shards needs a scheduler running tasks side by side: tests/integration/test_stream_scheduler.py proves it."""
from __future__ import annotations

import json

import pytest

from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import pipeline_dag
from tests.fixtures.processes import alive

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _streamed_dag_run(tmp_path, demo_assets, monkeypatch, **stream):
    """The pipeline DAG's streaming run under dag.test(), checked as every streaming run must end: green, trained
    from the store, exactly once, verified after training, no hidden state on disk, the draft exported. Its task
    instances and run folder."""
    monkeypatch.delenv("EAGLEFLOW_CONFIG", raising=False)   # the demo's one node, as the DAG is parsed
    cfgp = write_short_config(tmp_path, demo_assets, stream={"storage": "disk", "buffer_gib": 0.0625,
                                                             "put_timeout_s": 120, **stream},
                              train={"max_steps": 4, "batch_size": 4, "checkpoint_every": 2, "log_every": 1})
    dag = pipeline_dag().partial_subset(task_ids=["export_draft", "stop_store"], include_upstream=True)
    dr = dag.test(run_conf={"config_path": str(cfgp), "run_name": "streamed", "storage": "mooncake"})
    tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
    states = {k: ti.state for k, ti in tis.items()}
    run_dir = tmp_path / "runs" / "streamed"
    log = run_dir / "logs" / "trainer.log"
    assert dr.state == "success", (states, log.read_text()[-3000:] if log.exists() else "no trainer log")

    # the Param reached the frozen config: the run streamed although its file says disk
    frozen = json.loads((run_dir / "run-config.json").read_text())
    assert frozen["stream"]["storage"] == "mooncake"
    # training went the streaming way: not behind the GPU gate that waits for verification
    assert states[("choose_training_start", -1)] == states[("train_from_stream", -1)] == "success"
    assert states[("gpus_idle_after_capture", -1)] == "skipped"
    assert states[("trainer_gpus_idle", -1)] == "success"     # the trainer's GPU gate: a CPU node logs and passes
    assert states[("train_draft", -1)] == states[("export_draft", -1)] == "success"
    assert "streaming from the Mooncake store" in log.read_text()
    # verification read the trainer's exactly-once record, after the trainer wrote it
    rec = json.loads((run_dir / "hidden_states" / "stream_verified.json").read_text())
    assert rec["ok"] and rec["kind"] == "stream" and rec["samples"] > 0
    assert all(n == rec["samples"] for n in rec["trained_per_epoch"].values())
    assert tis[("verify_hidden_states", -1)].end_date >= tis[("train_draft", -1)].end_date
    # no hidden state on disk: the shards' manifests only (the held-out records are on disk, apart)
    shards = sorted((run_dir / "hidden_states").glob("shard_*"))
    assert shards and not list((run_dir / "hidden_states").rglob("*.safetensors"))
    assert sum(len(p.read_text().splitlines()) for p in (run_dir / "hidden_states").glob("shard_*/manifest.jsonl")) \
        == rec["samples"]
    export = run_dir / "draft" / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").stat().st_size > 0
    return tis, run_dir


def test_a_streaming_run_through_the_pipeline_dag(tmp_path, airflow_db, demo_assets, monkeypatch):
    tis, run_dir = _streamed_dag_run(tmp_path, demo_assets, monkeypatch)
    # the store was started by the run and stopped at its end: its processes gone, the endpoint removed
    starts = [ti.xcom_pull(task_ids="start_store") for ti in [tis[("start_store", -1)]]]
    assert starts[0]["started"] and starts[0]["master_pid_file"]
    stopped = tis[("stop_store", -1)].xcom_pull(task_ids="stop_store")["stopped"]
    assert len(stopped) == 3 and all(r["outcome"] in ("terminated", "killed") for r in stopped), stopped
    assert not [r["pid"] for r in stopped if alive(r["pid"])]
    assert not (run_dir / "store_endpoint.json").exists()


def test_a_streaming_run_on_an_existing_master_through_the_pipeline_dag(tmp_path, airflow_db, demo_assets,
                                                                       monkeypatch):
    """``stream.master`` names a master the operator runs (the test's own): the run starts only its segment holder
    against it, streams through it, and at its end removes its keys and its segment holder, never signalling the
    master, which still answers."""
    from eagleflow.stores.mooncake.master import MooncakeEndpoint, reachable
    from eagleflow.stores.mooncake.store import MooncakeClient
    from tests.fixtures.mooncake_master import existing_master
    with existing_master(tmp_path) as master:
        tis, run_dir = _streamed_dag_run(tmp_path, demo_assets, monkeypatch, **master.stream_settings())
        start = tis[("start_store", -1)].xcom_pull(task_ids="start_store")
        assert start["started"] and start["master_started"] is False and not start["master_pid_file"], start
        stopped = {r["role"]: r for r in tis[("stop_store", -1)].xcom_pull(task_ids="stop_store")["stopped"]}
        assert stopped["mooncake-master"]["outcome"] == "left_running" and stopped["mooncake-master"]["pid"] is None
        assert stopped["mooncake-keys"]["outcome"] == "removed", stopped
        assert stopped["mooncake-segment"]["outcome"] in ("terminated", "killed"), stopped
        assert "mooncake-metadata" not in stopped      # the master serves its own metadata: none was started
        assert not alive(stopped["mooncake-segment"]["pid"])
        assert master.proc.poll() is None and reachable("127.0.0.1", master.rpc)   # never signalled
        # it still serves clients, and none of the run's samples is left in it
        keys = [json.loads(line)["file"] for m in sorted((run_dir / "hidden_states").glob("shard_*/manifest.jsonl"))
                for line in m.read_text().splitlines() if line.strip()]
        client = MooncakeClient(MooncakeEndpoint("127.0.0.1", master.rpc, master.meta, master.mets, 0))
        try:
            assert keys and all(client.get(k, tries=1) == b"" for k in keys[:5])
        finally:
            client.close()
        assert not (run_dir / "store_endpoint.json").exists()


def test_an_offline_run_still_trains_only_after_verification(tmp_path, airflow_db, demo_assets, monkeypatch):
    """The same DAG with the Param at disk on a config that says mooncake: the branch takes the verified way,
    the store tasks do nothing, the hidden states are files."""
    monkeypatch.delenv("EAGLEFLOW_CONFIG", raising=False)
    cfgp = write_short_config(tmp_path, demo_assets, stream={"storage": "mooncake"},
                              train={"max_steps": 4, "batch_size": 4, "checkpoint_every": 2, "log_every": 1})
    dag = pipeline_dag().partial_subset(task_ids=["export_draft", "stop_store"], include_upstream=True)
    dr = dag.test(run_conf={"config_path": str(cfgp), "run_name": "offline", "storage": "disk"})
    tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
    states = {k: ti.state for k, ti in tis.items()}
    assert dr.state == "success", states
    run_dir = tmp_path / "runs" / "offline"
    assert json.loads((run_dir / "run-config.json").read_text())["stream"]["storage"] == "disk"
    assert states[("train_from_stream", -1)] == states[("trainer_gpus_idle", -1)] == "skipped"
    assert states[("gpus_idle_after_capture", -1)] == states[("train_draft", -1)] == "success"
    assert tis[("train_draft", -1)].start_date >= tis[("verify_hidden_states", -1)].end_date
    assert tis[("start_store", -1)].xcom_pull(task_ids="start_store") == {"store": "disk", "started": False}
    assert tis[("stop_store", -1)].xcom_pull(task_ids="stop_store") == {"store": "disk", "stopped": []}
    assert list((run_dir / "hidden_states").rglob("*.safetensors"))
    assert not (run_dir / "hidden_states" / "stream_verified.json").exists()
    assert (run_dir / "draft" / "export" / "model.safetensors").stat().st_size > 0
