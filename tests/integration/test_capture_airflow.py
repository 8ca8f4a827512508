"""The capture phase under Airflow: operators, the readiness trigger and the whole sequence under dag.test()."""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.dag_bundle import load_bundle_dag

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _config(tmp_path: Path, demo_assets) -> Path:
    p = write_run_config(tmp_path, demo_assets["target_model"], shards=2)
    data = yaml.safe_load(p.read_text())
    data["watchdog"] = {"poll_interval_s": 1, "stall_after_s": 20, "startup_grace_s": 30, "health_timeout_s": 10}
    p.write_text(yaml.safe_dump(data))
    return p


def test_ready_trigger_round_trips_and_reports_a_dead_server(tmp_path, demo_assets):
    import asyncio

    from eagleflow.airflow.server_triggers import ServerReadyTrigger
    from eagleflow.airflow.runtime import RunContext

    ctx = RunContext.from_params({"config_path": str(_config(tmp_path, demo_assets))}, "trig")
    ctx.write_run_config()  # the trigger reads the run's frozen config on the node
    trig = ServerReadyTrigger(run=ctx.serialize(), end_at=time.time() + 5, poll_interval_s=0.1, phase="extract")
    path, kwargs = trig.serialize()
    assert path == "eagleflow.airflow.server_triggers.ServerReadyTrigger"
    rebuilt = ServerReadyTrigger(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)

    async def first():
        async for ev in rebuilt.run():
            return ev.payload
    ev = asyncio.run(first())
    assert ev["status"] == "dead" and "capture server is not running" in ev["detail"]


def test_rerun_of_extract_shard_attaches_to_the_live_worker(tmp_path, demo_assets, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    from eagleflow.airflow.shard_operators import ShardOperator
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.phases.extract.lifecycle import stop_worker, worker_role

    ctx = RunContext.from_params({"config_path": str(_config(tmp_path, demo_assets))}, "rerun")
    ctx.write_run_config()
    write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", 8, 300)
    # a server that takes the connection and never answers: the worker waits on its first sample (a refused
    # connection, as on a closed port, fails the worker at once, and then nothing is left to attach to)
    silent = socket.create_server(("127.0.0.1", 0))
    Path(ctx.layout.server_info_file).write_text(json.dumps({"url": f"http://127.0.0.1:{silent.getsockname()[1]}"}))
    # the dump key a started server leaves: without it the worker exits at once (it trusts no dump)
    from eagleflow.serving.dump_protocol import load_dump_key
    load_dump_key(ctx.layout.dump_key_file, create=True)
    # keep the worker alive: it waits on the server before its first sample
    monkeypatch.setenv("EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME", "pause:60")
    # the server's record, as the setup leaves it: a shard's start with no live server recorded is a fault
    # (an incident, a restart: eagleflow.airflow.shard_start), not what this test is about
    server_pid_file = str(ctx.layout.pid_file("capture_server"))
    ctx.node.spawn_detached([sys.executable, "-c", "import time; time.sleep(120)"], role="capture_server",
                            pid_file=server_pid_file, log_file=str(ctx.layout.log_file("capture_server")))
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=0)
    pids = []
    try:
        for _ in range(2):
            with pytest.raises(TaskDeferred) as d:
                op.run(ctx, {"ti": None})
            assert d.value.trigger.serialize()[1]["shard"] == 0
            pids.append(ctx.node.live_record(str(ctx.layout.pid_file(worker_role(0)))).pid)
    finally:
        stop_worker(ctx, 0, grace_s=5)
        ctx.node.stop_recorded(server_pid_file, grace_s=5)
        silent.close()
    assert pids[0] == pids[1]


DAG_FILE = """
from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG, Param, task

from eagleflow.airflow.shard_operators import (PlanShardsOperator, ServerReadySensor, ShardOperator,
                                               StartServerOperator, StopServerOperator)
from eagleflow.airflow.verify_operators import VerifyHiddenStatesOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator


@task
def make_corpus(**context):
    from eagleflow.airflow.runtime import RunContext
    from tests.fixtures.capture_corpus import write_corpus
    ctx = RunContext.from_airflow(context)
    write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", 10, 300)
    return str(ctx.layout.run_dir)


with DAG("capture_sequence_test", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    write = WriteRunConfigOperator(task_id="write_run_config")
    corpus = make_corpus()
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    ready = ServerReadySensor(phase="extract", task_id="capture_server_ready", deferrable=True, poke_interval=0.5)
    shards = PlanShardsOperator(phase="extract", task_id="plan_shards")
    extract = ShardOperator.partial(phase="extract", task_id="extract_shard").expand(shard=shards.output)
    stop = StopServerOperator(phase="extract", task_id="stop_capture_server", grace_s=10)
    verify = VerifyHiddenStatesOperator(task_id="verify_hidden_states")
    write >> corpus >> start >> ready >> shards >> extract >> stop.as_teardown(setups=start)
    extract >> verify
"""


def test_capture_sequence_under_dag_test(airflow_db, tmp_path, demo_assets, monkeypatch):
    cfgp = _config(tmp_path, demo_assets)
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "capture_sequence_test.py",
                          f"CONFIG = {str(cfgp)!r}\n" + DAG_FILE)

    dr = dag.test()
    states = {ti.task_id + (f"[{ti.map_index}]" if ti.map_index >= 0 else ""): ti.state
              for ti in dr.get_task_instances()}
    assert dr.state == "success", states
    assert states["extract_shard[0]"] == states["extract_shard[1]"] == "success"
    assert states["verify_hidden_states"] == states["stop_capture_server"] == "success"
    run_dir = next(p for p in (tmp_path / "runs").iterdir() if not p.name.startswith("."))
    for shard in (0, 1):
        lines = (run_dir / "hidden_states" / f"shard_{shard:05d}" / "manifest.jsonl").read_text().splitlines()
        assert len(lines) == 5
    assert not list((tmp_path / "state" / "pids").glob("*.capture_server.json")), "teardown removes the record"
    assert not [p for p in (tmp_path / "dumps").iterdir() if not p.name.startswith(".")]
