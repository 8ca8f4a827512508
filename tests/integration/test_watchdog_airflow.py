"""The seeds' failure under Airflow: the capture server freezes mid-shard (SIGSTOP) while the worker lives on.

One dag.test() run of the real operators (start server, ready, extract shard
under ShardWatchTrigger, teardown), a real SMTP server (aiosmtpd) and the
alert callbacks of the pipeline:
- the watch finds the stall within the detection bound with a diagnosis naming the stopped
  server (no health check wasted on a server in state T) and the stale progress;
- the incident's one alert arrives at once with that subject, the diagnosis, the GPU table line
  and a log link built from Airflow's configured [api] base_url;
- the same task try recovers (no Airflow retry): the server is restarted once (one restart in the
  incident), the worker resumes, and the shard completes with exactly its samples, none twice;
- a second mail, in the same thread, says the incident is over once a new sample is stored.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
N = 24
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 4.0, "health_timeout_s": 1.0, "startup_grace_s": 60.0,
         "gpu_window_s": 4.0, "d_state_after_s": 4.0, "alert_emails": ["oncall@example.test"],
         "smtp_conn_id": "smtp_watchdog_test", "airflow_base_url": "http://airflow.test:8080"}


class _Freezer(threading.Thread):
    """SIGSTOPs the recorded capture server once shard 0 has stored ``after`` samples."""

    def __init__(self, state_dir: Path, run_root: Path, after: int = 3):
        super().__init__(daemon=True)
        self.state_dir, self.run_root, self.after = state_dir, run_root, after
        self.stopped_pid: int | None = None
        self.stopped_at: float | None = None
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            manifests = list(self.run_root.glob("*/hidden_states/shard_00000/manifest.jsonl"))
            servers = list((self.state_dir / "pids").glob("*.capture_server.json"))
            if manifests and servers and len(manifests[0].read_text().splitlines()) >= self.after:
                pid = json.loads(servers[0].read_text())["pid"]
                os.kill(pid, signal.SIGSTOP)
                self.stopped_pid, self.stopped_at = pid, time.time()
                return
            time.sleep(0.05)


DAG_FILE = """
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
        write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", N, 300, seed=5)


with DAG("watchdog_seeds_stall", schedule=None, catchup=False,
         default_args={"retry_delay": timedelta(seconds=1), **pipeline_failure_callbacks()},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    extract = ShardOperator(phase="extract", task_id="extract_shard", shard=0, retries=1)
    (WriteRunConfigOperator(task_id="write_run_config") >> WriteTestCorpus(task_id="write_corpus") >> start
     >> ServerReadySensor(phase="extract", task_id="capture_server_ready", deferrable=False, poke_interval=0.3)
     >> extract >> StopServerOperator(phase="extract", task_id="stop_capture_server").as_teardown(setups=start))
"""


def _load_dag(tmp_path: Path, cfgp: Path, monkeypatch):
    return load_bundle_dag(monkeypatch, tmp_path / "dags", "watchdog_seeds_stall.py",
                           f"CONFIG = {str(cfgp)!r}\nN = {N}\n" + DAG_FILE)


def test_frozen_server_is_caught_mailed_recovered_and_the_shard_completes_exactly(
        airflow_db, demo_assets, tmp_path, monkeypatch):
    from eagleflow.engines.hf.server import DELAY_ENV

    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2, request_timeout_base_s=120)
    data = yaml.safe_load(cfgp.read_text())
    data["watchdog"] = WATCH
    data.setdefault("corpus", {})["sources"] = demo_assets["sources"][:1]  # the run config's input check wants one
    cfgp.write_text(yaml.safe_dump(data))
    state_dir, run_root = tmp_path / "state", tmp_path / "runs"
    dag = _load_dag(tmp_path, cfgp, monkeypatch)

    monkeypatch.setenv(DELAY_ENV, "0.3")   # about 0.3 s per sample: a stall lands mid-shard
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.org:8443/")
    freezer = _Freezer(state_dir, run_root)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env(WATCH["smtp_conn_id"]).items():
            monkeypatch.setenv(k, v)
        freezer.start()
        try:
            dr = dag.test()
        finally:
            freezer.done.set()
            kill_recorded(state_dir)

    assert freezer.stopped_pid, "the server was never frozen: the shard finished before 3 samples?"
    run_dir = next(run_root.iterdir())
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    # recovered in the same try: no Airflow retry delay on the stall path
    assert tis["extract_shard"].state == "success" and tis["extract_shard"].try_number == 1

    # the incident's one alert, sent the moment the watch found the stall (before the restart)
    stall_mails = [(m, t) for m, t in zip(smtp.messages, smtp.received_at) if "STALLED" in m["Subject"]]
    assert len(stall_mails) == 1, [m["Subject"] for m in smtp.messages]
    msg, received = stall_mails[0]
    assert msg["Subject"] == "[eagleflow] STALLED shard 0/2 on local"
    body = body_text(msg)
    assert f"server pid {freezer.stopped_pid} is stopped (state T" in body
    assert "no sample completed for" in body and "health_generate" not in body  # no check of a stopped server
    assert "The watchdog is recovering it now, in the same task try" in body
    assert "stored samples per shard (from the manifests): shard 0: " in body
    assert "GPUs: not applicable: node.has_gpu is false" in body
    assert "https://airflow.example.org:8443/dags/watchdog_seeds_stall/runs/" in body and "localhost" not in body
    from eagleflow.config import load_config
    bound = load_config(cfgp).watchdog.detection_bound_s
    # progress stopped at or before the SIGSTOP; the mail follows the watch's event by one SMTP round trip
    assert received - freezer.stopped_at <= bound + 3.0, (received - freezer.stopped_at, bound)
    print("received alert email:", f"Subject: {msg['Subject']}", f"To: {msg['To']}", body, sep="\n")

    # and one more when it is over: the first sample stored after the recovery, in the same mail thread
    over = [(m, t) for m, t in zip(smtp.messages, smtp.received_at) if "RECOVERED" in m["Subject"]]
    assert len(over) == 1 and len(smtp.messages) == 2, [m["Subject"] for m in smtp.messages]
    (done_msg, done_at), = over
    assert done_msg["Subject"].startswith("[eagleflow] RECOVERED shard 0/2 on local: samples stored again (")
    assert done_msg["In-Reply-To"] == msg["Message-ID"] and msg["Message-ID"].startswith("<eagleflow-incident-local-")
    assert "This closes: [eagleflow] STALLED shard 0/2 on local" in body_text(done_msg)
    assert done_at - received <= 60, done_at - received   # recovered (first new sample) within 60 s
    print(f"stall mail -> recovered mail: {done_at - received:.1f} s; {done_msg['Subject']}")

    # the watch restarted the frozen server exactly once, within one incident
    incidents = [json.loads(x) for x in
                 (state_dir / "locks" / f"{run_dir.name}.capture_server.restarts.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and incidents[0]["old_pid"] == freezer.stopped_pid
    assert incidents[0]["new_pid"] != freezer.stopped_pid and incidents[0]["incident"].startswith("local-capture_server-")

    # exactly the shard's samples, each once, and no partial file
    shard_dir = run_dir / "hidden_states" / "shard_00000"
    entries = [json.loads(x) for x in (shard_dir / "manifest.jsonl").read_text().splitlines() if x.strip()]
    expected = [i for i in range(N) if i % 2 == 0]
    assert sorted(e["index"] for e in entries) == expected
    assert sorted(p.name for p in shard_dir.glob("*.safetensors")) == [f"{i:08d}.safetensors" for i in expected]
    assert not list(shard_dir.glob(".tmp-*"))
