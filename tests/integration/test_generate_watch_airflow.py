"""A frozen generation server under Airflow: /generate hangs while /health_generate still answers (sglang issue
4191's shape). One dag.test() run of the real operators (serving-mode server setup, generate_responses shard
under the extraction's watch, teardown), the real-run watch defaults and a real SMTP server: the stall is found
within the detection bound (<= 60 s) and mailed naming the generation shard, then recovered in the watch as an
extraction shard's is (the server restarted once, the worker resumed from its manifest, RECOVERED mailed), in
the same task try with no retry left: the run is green and every record is stored once."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
SMTP_CONN = "smtp_generate_test"

DAG_FILE = """
from datetime import timedelta

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.shard_operators import ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator

with DAG("generate_frozen_server", schedule=None, catchup=False,
         default_args={"retry_delay": timedelta(seconds=1), **pipeline_failure_callbacks()},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="generate", task_id="start_generate_server")
    (WriteRunConfigOperator(task_id="write_run_config") >> start
     >> ShardOperator(phase="generate", task_id="generate_responses", shard=0, retries=0, deferrable=False)
     >> StopServerOperator(phase="generate", task_id="stop_generate_server").as_teardown(setups=start))
"""


class _Hanger(threading.Thread):
    """Creates the server's hang file once shard 0 has finished ``after`` records, removes it once the recovery
    has put another server in its place (a fresh server does not inherit the old one's hang), and notes when the
    shard's manifest grows again."""

    def __init__(self, run_root: Path, pids_dir: Path, hang_file: Path, after: int = 3):
        super().__init__(daemon=True)
        self.run_root, self.pids_dir, self.hang_file, self.after = run_root, pids_dir, hang_file, after
        self.hung_at: float | None = None
        self.replaced_at: float | None = None
        self.first_new_at: float | None = None
        self.done = threading.Event()

    def _server_pid(self) -> int | None:
        for rec in self.pids_dir.glob("*.generate_server.json"):
            try:
                return json.loads(rec.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                return None
        return None

    def _records(self) -> int:
        m = list(self.run_root.glob("*/generated/shard_00000/manifest.jsonl"))
        return len([x for x in m[0].read_text().splitlines() if x.strip()]) if m else 0

    def run(self):
        frozen = seen = None
        while not self.done.is_set():
            if self.hung_at is None:
                if self._records() >= self.after:
                    frozen = self._server_pid()
                    self.hang_file.touch()
                    self.hung_at = time.time()
            elif self.replaced_at is None:
                now = self._server_pid()
                if now is not None and now != frozen:
                    seen = self._records()
                    self.hang_file.unlink(missing_ok=True)
                    self.replaced_at = time.time()
            elif self._records() > seen:
                self.first_new_at = time.time()
                return
            time.sleep(0.05)


def test_a_frozen_generation_server_is_caught_mailed_and_recovered_in_the_watch(airflow_db, demo_assets, tmp_path,
                                                                                monkeypatch):
    from eagleflow.engines.hf.server import DELAY_ENV, HANG_FILE_ENV
    from eagleflow.config import load_config
    src = demo_assets["sources"][1]
    # real-run watch defaults (poll 20 s, stall after 15 s, health timeout 20 s), only the mail settings set
    cfgp = write_short_config(tmp_path, demo_assets, corpus={"sources": [src], "seed": 1, "max_length": 512},
                              generate={"enabled": True, "shards": 1, "max_new_tokens": 4, "concurrency": 1},
                              watchdog={"alert_emails": ["oncall@example.test"], "smtp_conn_id": SMTP_CONN,
                                        "poll_interval_s": 20.0, "stall_after_s": 15.0, "startup_grace_s": 120.0})
    bound = load_config(cfgp).watchdog.detection_bound_s
    assert bound <= 60
    dag = load_bundle_dag(monkeypatch, tmp_path / "dags", "generate_frozen_server.py",
                          f"CONFIG = {str(cfgp)!r}\n" + DAG_FILE)
    hang = tmp_path / "hang"
    monkeypatch.setenv(HANG_FILE_ENV, str(hang))
    monkeypatch.setenv(DELAY_ENV, "0.1")
    run_root = tmp_path / "runs"
    hanger = _Hanger(run_root, tmp_path / "node-state" / "pids", hang)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env(SMTP_CONN).items():
            monkeypatch.setenv(k, v)
        hanger.start()
        try:
            dr = dag.test()
        finally:
            hanger.done.set()
            hang.unlink(missing_ok=True)
            kill_recorded(tmp_path / "node-state")
    assert hanger.hung_at, "the server was never frozen: the shard finished before 3 records?"
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert dr.state == "success", {t: ti.state for t, ti in tis.items()}
    # recovered in the watch: the first try, no retry (retries=0)
    assert tis["generate_responses"].state == "success" and tis["generate_responses"].try_number == 1
    assert tis["stop_generate_server"].state == "success"
    assert hanger.replaced_at, "the frozen generation server was never replaced"
    subjects = [m["Subject"] for m in smtp.messages]
    mails = [(m, t) for m, t in zip(smtp.messages, smtp.received_at) if "STALLED" in m["Subject"]]
    assert len(mails) == 1, subjects
    msg, received = mails[0]
    assert msg["Subject"] == "[eagleflow] STALLED generate shard 0/1 on local", msg["Subject"]
    body = body_text(msg)
    assert "health_generate" in body, body   # the server still answers health: the watch says so
    assert received - hanger.hung_at <= bound + 5.0, (received - hanger.hung_at, bound)
    over = [(m, t) for m, t in zip(smtp.messages, smtp.received_at) if "RECOVERED" in m["Subject"]]
    assert len(over) == 1, subjects
    assert over[0][0]["Subject"].startswith("[eagleflow] RECOVERED generate shard 0/1 on local: records stored "
                                            "again ("), over[0][0]["Subject"]
    assert not [s for s in subjects if "FAILED" in s or "DEAD" in s], subjects
    # every record of the shard stored, each once; the first new one soon after the server was replaced
    shard = next(run_root.iterdir()) / "generated" / "shard_00000"
    lines = [x for x in (shard / "manifest.jsonl").read_text().splitlines() if x.strip()]
    ids = [json.loads(x)["id"] for x in lines]
    assert len(ids) == len(set(ids)) > 3
    assert hanger.first_new_at, "no record stored after the server was replaced"
    print(f"frozen at +0 s; STALLED mailed at +{received - hanger.hung_at:.1f} s; server replaced at "
          f"+{hanger.replaced_at - hanger.hung_at:.1f} s; first new record at +{hanger.first_new_at - hanger.hung_at:.1f}"
          f" s; RECOVERED mailed at +{over[0][1] - hanger.hung_at:.1f} s")
    assert hanger.first_new_at - received <= 60, (hanger.first_new_at - received)   # recovered within 60 s
    hb = json.loads((shard / "heartbeat.json").read_text())
    assert hb["state"] == "complete", hb
