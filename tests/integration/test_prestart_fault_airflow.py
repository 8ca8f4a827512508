"""A server stopped just before the next shard starts (issue 52 item 5), through the real path: one dag.test() run
of the real operators (the phase's server as setup, shard 0 then shard 1 under the watch, the teardown), the
real-run watch defaults and a real SMTP server. The server (a real process) is SIGSTOPped the moment shard 0's
watch has seen it complete, so shard 1's check before its start finds it in state T. That fault is handled as
one the watch finds: an incident opened on the node, one STALLED mail naming shard 1, the server restarted once,
the worker started, RECOVERED mailed when the shard stores again, the first new record within 60 s of the fault,
in the same task try; every record stored once. Both sharded phases take this path (generation, extraction)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
SMTP_CONN = "smtp_prestart_test"
REAL_WATCH = {"alert_emails": ["oncall@example.test"], "smtp_conn_id": SMTP_CONN, "poll_interval_s": 20.0,
              "stall_after_s": 15.0, "health_timeout_s": 20.0, "startup_grace_s": 120.0}

GENERATE_DAG = """
from datetime import timedelta

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.shard_operators import ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator

with DAG("generate_prestart_fault", schedule=None, catchup=False,
         default_args={"retry_delay": timedelta(seconds=1), **pipeline_failure_callbacks()},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="generate", task_id="start_generate_server")
    (WriteRunConfigOperator(task_id="write_run_config") >> start
     >> ShardOperator(phase="generate", task_id="generate_shard_0", shard=0, retries=0, deferrable=False)
     >> ShardOperator(phase="generate", task_id="generate_shard_1", shard=1, retries=0, deferrable=False)
     >> StopServerOperator(phase="generate", task_id="stop_generate_server").as_teardown(setups=start))
"""


class _StopBeforeNextShard(threading.Thread):
    """SIGSTOPs the phase's server the moment shard 0's watch has seen it complete (its look log says so), so the
    next shard's start finds it stopped; then notes when another server replaced it and when shard 1's manifest
    first grew."""

    def __init__(self, state_dir: Path, run_root: Path, role: str, shard_glob: str):
        super().__init__(daemon=True)
        self.state_dir, self.run_root, self.role, self.shard_glob = state_dir, run_root, role, shard_glob
        self.stopped_pid: int | None = None
        self.stopped_at: float | None = None
        self.replaced_at: float | None = None
        self.first_new_at: float | None = None
        self.done = threading.Event()

    def _server_pid(self) -> int | None:
        for rec in (self.state_dir / "pids").glob(f"*.{self.role}.json"):
            try:
                return int(json.loads(rec.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                return None
        return None

    def _shard0_seen_complete(self) -> bool:
        for f in (self.state_dir / "watch").glob("*_shard_00000.looks.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    if json.loads(line).get("verdict") == "complete":
                        return True
                except ValueError:
                    continue
        return False

    def records(self, shard: int) -> int:
        m = list(self.run_root.glob(f"*/{self.shard_glob}/shard_{shard:05d}/manifest.jsonl"))
        return len([x for x in m[0].read_text().splitlines() if x.strip()]) if m else 0

    def run(self):
        while not self.done.is_set():
            if self.stopped_at is None:
                if self._shard0_seen_complete() and (pid := self._server_pid()):
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped_pid, self.stopped_at = pid, time.time()
            else:
                now = self._server_pid()
                if self.replaced_at is None and now is not None and now != self.stopped_pid:
                    self.replaced_at = time.time()
                if self.records(1) > 0:
                    self.first_new_at = time.time()
                    return
            time.sleep(0.05)


def _mails(smtp: SmtpSink, word: str) -> list[tuple]:
    return [(m, t) for m, t in zip(smtp.messages, smtp.received_at) if word in m["Subject"]]


def test_a_generation_server_stopped_before_the_next_shard_is_an_incident_mailed_and_recovered(
        airflow_db, demo_assets, tmp_path, monkeypatch):
    from eagleflow.engines.hf.server import DELAY_ENV
    from eagleflow.watchdog.incidents import history
    cfgp = write_short_config(tmp_path, demo_assets,
                              corpus={"sources": [demo_assets["sources"][1]], "seed": 1, "max_length": 512},
                              generate={"enabled": True, "shards": 2, "max_new_tokens": 4, "concurrency": 1},
                              watchdog=REAL_WATCH)
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "generate_prestart_fault.py",
                          f"CONFIG = {str(cfgp)!r}\n" + GENERATE_DAG)
    monkeypatch.setenv(DELAY_ENV, "0.1")
    state_dir, run_root = tmp_path / "node-state", tmp_path / "runs"
    fault = _StopBeforeNextShard(state_dir, run_root, "generate_server", "generated")
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env(SMTP_CONN).items():
            monkeypatch.setenv(k, v)
        fault.start()
        try:
            dr = dag.test()
        finally:
            fault.done.set()
            if fault.stopped_pid:
                try:
                    os.kill(fault.stopped_pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            kill_recorded(state_dir)
    assert fault.stopped_at, "the server was never stopped: shard 0's watch never saw it complete?"
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert dr.state == "success", {t: ti.state for t, ti in tis.items()}
    # recovered in the first try (retries=0): no retry, no FAILED mail
    assert tis["generate_shard_1"].state == "success" and tis["generate_shard_1"].try_number == 1
    subjects = [m["Subject"] for m in smtp.messages]
    stalled, over = _mails(smtp, "STALLED"), _mails(smtp, "RECOVERED")
    assert len(stalled) == 1 and len(over) == 1, subjects
    assert not [s for s in subjects if "FAILED" in s or "RETRY" in s], subjects
    msg, mailed_at = stalled[0]
    assert msg["Subject"] == "[eagleflow] STALLED generate shard 1/2 on local", msg["Subject"]
    body = body_text(msg)
    assert f"generation server pid {fault.stopped_pid} is stopped (state T" in body, body
    assert "found before the shard's worker started" in body, body
    assert over[0][0]["Subject"].startswith("[eagleflow] RECOVERED generate shard 1/2 on local: records stored "
                                            "again ("), over[0][0]["Subject"]
    assert over[0][0]["In-Reply-To"] == msg["Message-ID"]
    # the incident book holds it: opened for shard 1, recovered by a server restart
    events = history(state_dir)
    opened = [e for e in events if e["event"] == "opened" and e["cause"] == "capture_server"]
    assert len(opened) == 1 and list(opened[0]["shards"]) == ["1"], events
    assert [e for e in events if e["event"] == "recovered" and e["id"] == opened[0]["id"]
            and e["recovery"]["action"] == "restarted"], events
    assert fault.replaced_at and fault.first_new_at, "no new server or no record stored after the fault"
    to_mail, to_record = mailed_at - fault.stopped_at, fault.first_new_at - fault.stopped_at
    print(f"server SIGSTOPped at +0 s (before shard 1 started); STALLED mailed at +{to_mail:.1f} s; server "
          f"replaced at +{fault.replaced_at - fault.stopped_at:.1f} s; first new record at +{to_record:.1f} s; "
          f"RECOVERED mailed at +{over[0][1] - fault.stopped_at:.1f} s")
    assert to_record <= 60, to_record
    # every record of both shards stored, each once
    for shard in (0, 1):
        path = next(run_root.iterdir()) / "generated" / f"shard_{shard:05d}"
        ids = [json.loads(x)["id"] for x in (path / "manifest.jsonl").read_text().splitlines() if x.strip()]
        assert len(ids) == len(set(ids)) > 0
        assert json.loads((path / "heartbeat.json").read_text())["state"] == "complete"


EXTRACT_DAG = """
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.shard_operators import ServerReadySensor, ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from tests.fixtures.capture_corpus import write_corpus


class WriteTestCorpus(RunOperator):
    def run(self, ctx, context):
        write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", 16, 300, seed=5)


with DAG("extract_prestart_fault", schedule=None, catchup=False,
         default_args={"retry_delay": timedelta(seconds=1), **pipeline_failure_callbacks()},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    (WriteRunConfigOperator(task_id="write_run_config") >> WriteTestCorpus(task_id="write_corpus") >> start
     >> ServerReadySensor(phase="extract", task_id="capture_server_ready", deferrable=False, poke_interval=0.3)
     >> ShardOperator(phase="extract", task_id="extract_shard_0", shard=0, retries=0, deferrable=False)
     >> ShardOperator(phase="extract", task_id="extract_shard_1", shard=1, retries=0, deferrable=False)
     >> StopServerOperator(phase="extract", task_id="stop_capture_server").as_teardown(setups=start))
"""


def test_a_capture_server_stopped_before_the_next_shard_takes_the_same_road(airflow_db, demo_assets, tmp_path,
                                                                            monkeypatch):
    import yaml

    from eagleflow.engines.hf.server import DELAY_ENV
    from tests.fixtures.capture_corpus import write_run_config
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2, request_timeout_base_s=120)
    data = yaml.safe_load(cfgp.read_text())
    data["watchdog"] = REAL_WATCH
    data.setdefault("corpus", {})["sources"] = demo_assets["sources"][:1]
    cfgp.write_text(yaml.safe_dump(data))
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "extract_prestart_fault.py",
                          f"CONFIG = {str(cfgp)!r}\n" + EXTRACT_DAG)
    monkeypatch.setenv(DELAY_ENV, "0.1")
    state_dir, run_root = tmp_path / "state", tmp_path / "runs"
    fault = _StopBeforeNextShard(state_dir, run_root, "capture_server", "hidden_states")
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env(SMTP_CONN).items():
            monkeypatch.setenv(k, v)
        fault.start()
        try:
            dr = dag.test()
        finally:
            fault.done.set()
            if fault.stopped_pid:
                try:
                    os.kill(fault.stopped_pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            kill_recorded(state_dir)
    assert fault.stopped_at, "the server was never stopped: shard 0's watch never saw it complete?"
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert dr.state == "success", {t: ti.state for t, ti in tis.items()}
    assert tis["extract_shard_1"].state == "success" and tis["extract_shard_1"].try_number == 1
    subjects = [m["Subject"] for m in smtp.messages]
    stalled, over = _mails(smtp, "STALLED"), _mails(smtp, "RECOVERED")
    assert len(stalled) == 1 and len(over) == 1, subjects
    msg, mailed_at = stalled[0]
    assert msg["Subject"] == "[eagleflow] STALLED shard 1/2 on local", msg["Subject"]
    assert f"capture server pid {fault.stopped_pid} is stopped (state T" in body_text(msg)
    assert over[0][0]["Subject"].startswith("[eagleflow] RECOVERED shard 1/2 on local: samples stored again ("), \
        over[0][0]["Subject"]
    assert fault.first_new_at
    to_mail, to_record = mailed_at - fault.stopped_at, fault.first_new_at - fault.stopped_at
    print(f"capture server SIGSTOPped at +0 s (before shard 1 started); STALLED mailed at +{to_mail:.1f} s; first "
          f"new sample at +{to_record:.1f} s; RECOVERED mailed at +{over[0][1] - fault.stopped_at:.1f} s")
    assert to_record <= 60, to_record
    for shard in (0, 1):
        manifest = next(run_root.glob(f"*/hidden_states/shard_{shard:05d}/manifest.jsonl")).read_text()
        ids = [json.loads(x)["id"] for x in manifest.splitlines() if x.strip()]
        assert len(ids) == len(set(ids)) == 8
