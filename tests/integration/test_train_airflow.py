"""Draft training under Airflow: TrainDraftOperator starts the detached trainer on the node and defers to
the watchdog's TrainWatchTrigger; ExportDraftOperator writes the SGLang draft directory; under dag.test()."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures.dag_bundle import load_bundle_dag

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DAG_FILE = """
from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG, Param, task

from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from eagleflow.airflow.train_operators import ExportDraftOperator, TrainDraftOperator


@task
def make_hidden_states(**context):
    from eagleflow.airflow.runtime import RunContext
    from tests.fixtures.train_hidden_states import write_synthetic_hidden_states
    ctx = RunContext.from_airflow(context)
    write_synthetic_hidden_states(ctx.layout.hidden_states_dir, ctx.cfg.target_model, samples=32)
    return str(ctx.layout.run_dir)


with DAG("train_sequence_test", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    write = WriteRunConfigOperator(task_id="write_run_config")
    hs = make_hidden_states()
    train = TrainDraftOperator(task_id="train_draft", poll_interval_s=0.5)
    export = ExportDraftOperator(task_id="export_draft")
    write >> hs >> train >> export
"""


def _source(tmp_path: Path) -> Path:
    p = tmp_path / "source.jsonl"
    p.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                               {"from": "gpt", "value": "hello"}]}) + "\n")
    return p


def _config(tmp_path: Path, target: str) -> Path:
    data = {
        "run_root": str(tmp_path / "runs"),
        "target_model": target,
        "node": {"name": "local", "has_gpu": False, "state_dir": str(tmp_path / "state")},
        "capture": {"heartbeat_interval_s": 0.5},
        # the hidden states are synthetic; the pre-flight still wants a real source on the node
        "corpus": {"sources": [{"name": "fixture", "path": str(_source(tmp_path))}]},
        "watchdog": {"poll_interval_s": 1, "stall_after_s": 30, "startup_grace_s": 90, "health_timeout_s": 5},
        "train": {"device": "cpu", "max_steps": 30, "batch_size": 4, "lr": 3e-3, "warmup_steps": 3,
                  "ttt_length": 3, "draft_vocab_size": 64, "checkpoint_every": 10, "log_every": 10},
    }
    p = tmp_path / "train-test.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_train_and_export_under_dag_test(airflow_db, tmp_path, demo_assets, monkeypatch):
    cfgp = _config(tmp_path, demo_assets["target_model"])
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "train_sequence_test.py",
                          f"CONFIG = {str(cfgp)!r}\n" + DAG_FILE)

    dr = dag.test()
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    run_dir = next(p for p in (tmp_path / "runs").iterdir() if not p.name.startswith("."))
    log = run_dir / "logs" / "trainer.log"
    assert dr.state == "success", (states, log.read_text()[-3000:] if log.exists() else "no trainer log")
    hb = json.loads((run_dir / "draft" / "heartbeat.json").read_text())
    assert hb["state"] == "complete" and hb["done"] == 30 and hb["unit"] == "steps"
    rec = json.loads(next((tmp_path / "state" / "pids").glob("*.trainer.json")).read_text())
    assert rec["role"] == "trainer" and "train" in rec["argv"]
    rows = [json.loads(x) for x in (run_dir / "draft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert (run_dir / "draft" / "curves.png").stat().st_size > 1000
    export = run_dir / "draft" / "export"
    conf = json.loads((export / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 64
    assert (export / "model.safetensors").stat().st_size > 0


def test_execute_complete_turns_events_into_success_or_a_retryable_stall(tmp_path):
    from eagleflow.airflow.train_operators import TrainDraftOperator
    from eagleflow.watchdog.diagnosis import StallDetected

    op = TrainDraftOperator(task_id="train_draft")
    assert op.execute_complete({}, {"status": "complete", "summary": "train: 30/30 steps"})["status"] == "complete"
    with pytest.raises(StallDetected) as e:
        op.execute_complete({}, {"status": "stalled", "verdict": "stalled", "subject": "[eagleflow] STALLED training",
                                 "diagnosis": "no step for 95 s"})
    assert e.value.subject == "[eagleflow] STALLED training" and "95 s" in e.value.diagnosis
    assert not isinstance(e.value, __import__("airflow.sdk.exceptions", fromlist=["x"]).AirflowFailException)


@pytest.mark.timeout(120)
def test_retry_keeps_a_progressing_or_slow_trainer_and_restarts_a_stalled_one(tmp_path, demo_assets):
    import sys
    import time

    from eagleflow.airflow.runtime import RunContext
    from eagleflow.airflow.train_operators import TrainDraftOperator
    from eagleflow.heartbeat import Heartbeat
    from eagleflow.train.job import stop_trainer

    ctx = RunContext.from_params({"config_path": str(_config(tmp_path, demo_assets["target_model"]))}, "retry")
    ctx.write_run_config()   # the retry's look is `eagleflow watch --train` on the node, over the frozen config
    pid_file = str(ctx.layout.pid_file("trainer"))
    # a stand-in trainer we started ourselves, recorded like the real one
    proc = ctx.node.spawn_detached([sys.executable, "-c", "import time; time.sleep(120)"], role="trainer",
                                   pid_file=pid_file, log_file=str(ctx.layout.log_file("trainer")))
    op = TrainDraftOperator(task_id="train_draft")
    try:
        now = time.time()
        fresh = Heartbeat(job="train", pid=proc.pid, state="running", time=now, started_at=now - 5,
                          last_progress_at=now - 1, unit="steps", total=30, done=4)
        fresh.write(str(ctx.layout.train_heartbeat_file))
        op._restart_if_unhealthy(ctx)
        assert ctx.node.live_record(pid_file).pid == proc.pid, "a progressing trainer is attached to, not killed"
        from tests.fixtures.watchdog_jobs import backdate_record
        backdate_record(ctx.layout, "trainer", 500)   # started long ago: its start is no recent progress
        # no step for 400 s, but its heartbeat is still written and nothing says it is stuck: slow, kept
        slow = Heartbeat(job="train", pid=proc.pid, state="running", time=now, started_at=now - 500,
                         last_progress_at=now - 400, unit="steps", total=30, done=4)
        slow.write(str(ctx.layout.train_heartbeat_file))
        op._restart_if_unhealthy(ctx)
        assert ctx.node.live_record(pid_file).pid == proc.pid, "a slow trainer with no evidence is not killed"
        # alive, but its heartbeat not rewritten for 400 s: the watch's evidence of a frozen trainer
        stale = Heartbeat(job="train", pid=proc.pid, state="running", time=now - 400, started_at=now - 500,
                          last_progress_at=now - 400, unit="steps", total=30, done=4)
        Path(ctx.layout.train_heartbeat_file).write_text(stale.to_json())   # as written 400 s ago (write() stamps now)
        op._restart_if_unhealthy(ctx)
        assert ctx.node.live_record(pid_file) is None, "a stalled trainer is stopped before the retry restarts it"
    finally:
        stop_trainer(ctx, grace_s=2)
