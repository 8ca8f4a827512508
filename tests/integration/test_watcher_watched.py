"""Who watches the watcher, for real (issue 27 item 3).

`make airflow`'s supervisor (eagleflow.airflow.deploy.standalone) runs the scheduler, DAG processor, API
server and triggerer; a shard extracts under a deferred ShardWatchTrigger. The test SIGKILLs the
triggerer mid-extraction (it started this Airflow, so it may): the shard's sentinel on the node mails
WATCH SILENT within three poll intervals of the last look through a real SMTP server, naming the job
and the last look; the supervisor restarts the triggerer (new pid) after stopping the old one's
orphaned log server (the port holder), Airflow's health endpoint says the triggerer is healthy again,
the watch looks again (WATCH BACK) and the shard completes with every sample stored once.

gpu_node_health turns a part gone (as /api/v2/monitor/health reports it) and a sentinel's raised alarm
into incidents, mailed once and resolved when they are gone.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eagleflow.airflow.deploy import standalone
from tests.fixtures.capture_corpus import write_run_config
from tests.fixtures.processes import alive, kill_recorded
from eagleflow.config import load_config
from eagleflow.watchdog.sentinel import look_cost_s, look_interval_s
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
N = 150   # at 2 samples/s the shard still runs when the triggerer's trigger moves (~35 s after the kill)
POLL_S = 1.0
WATCH = {"poll_interval_s": POLL_S, "stall_after_s": 6.0, "health_timeout_s": 1.0, "startup_grace_s": 60.0,
         "alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_watcher_test"}

DAG_FILE = """
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.shard_operators import ServerReadySensor, ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from tests.fixtures.capture_corpus import write_corpus


class WriteTestCorpus(RunOperator):
    def run(self, ctx, context):
        write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", N, 300, seed=5)


with DAG("watcher_watched", schedule=None, catchup=False, default_args={"retry_delay": timedelta(seconds=1)},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    (WriteRunConfigOperator(task_id="write_run_config") >> WriteTestCorpus(task_id="write_corpus") >> start
     >> ServerReadySensor(phase="extract", task_id="capture_server_ready", deferrable=False, poke_interval=0.3)
     >> ShardOperator(phase="extract", task_id="extract_shard", shard=0)
     >> StopServerOperator(phase="extract", task_id="stop_capture_server").as_teardown(setups=start))
"""


def _call(url, method="GET", body=None, token=None):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _wait(pred, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _parts(home: Path) -> dict:
    try:
        return json.loads(standalone.parts_file(home).read_text())["parts"]
    except (OSError, ValueError, KeyError):
        return {}


def _looks(state_dir: Path) -> list[dict]:
    out = []
    for f in (state_dir / "watch").glob("*.worker_shard_00000.looks.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(900)
def test_killed_triggerer_is_noticed_by_the_sentinel_and_restarted_by_the_supervisor(tmp_path, demo_assets):
    from eagleflow.engines.hf.server import DELAY_ENV
    from eagleflow.health.airflow_health import fetch, parts

    home = tmp_path / "airflow_home"
    port = standalone.free_port()
    trigger_log_port = standalone.free_port()
    dags = tmp_path / "dags"
    dags.mkdir()
    state_dir, run_root = tmp_path / "state", tmp_path / "runs"
    with SmtpSink() as smtp:
        cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=1, request_timeout_base_s=120)
        data = yaml.safe_load(cfgp.read_text())
        data["watchdog"] = {**WATCH, "node_smtp": f"127.0.0.1:{smtp.port}"}
        data.setdefault("corpus", {})["sources"] = demo_assets["sources"][:1]
        cfgp.write_text(yaml.safe_dump(data))
        (dags / "watcher_watched.py").write_text(f"CONFIG = {str(cfgp)!r}\nN = {N}\n" + DAG_FILE)
        extra = {"AIRFLOW__CORE__DAGS_FOLDER": str(dags), "PYTHONPATH": str(REPO),
                 "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
                 # a dead triggerer's triggers go to the next one after this many seconds without its heartbeat:
                 # Airflow's default, far past the sentinel's bound (at 10 s the restarted triggerer took the
                 # trigger over 5 s after the last look, before the 6 s bound, and rightly no alarm was raised)
                 "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "30",
                 DELAY_ENV: "0.4", **smtp.airflow_conn_env(WATCH["smtp_conn_id"])}
        try:
            info = standalone.start(home, port, wait_s=300, extra_env=extra)
            base = f"http://127.0.0.1:{port}"
            token = _call(f"{base}/auth/token", "POST", {"username": "admin", "password": info["password"]})[
                "access_token"]

            def dag_loaded():
                try:
                    return _call(f"{base}/api/v2/dags/watcher_watched", token=token)
                except urllib.error.HTTPError as e:
                    if e.code != 404:
                        raise
                    return None
            _wait(dag_loaded, 180, "the DAG processor parsed the test DAG", every_s=2)
            _call(f"{base}/api/v2/dags/watcher_watched", "PATCH", {"is_paused": False}, token)
            run_id = _call(f"{base}/api/v2/dags/watcher_watched/dagRuns", "POST",
                           {"logical_date": None, "conf": {}}, token)["dag_run_id"]

            # the shard extracts under the triggerer's watch: looks land in the node's look log
            _wait(lambda: len([x for x in _looks(state_dir) if x.get("by") == "watch"]) >= 3, 300,
                  "three looks of the deferred watch")
            old = _parts(home)["triggerer"]
            _wait(lambda: _parts(home)["triggerer"].get("log_server_pid"), 30, "the triggerer's log server recorded")
            old = _parts(home)["triggerer"]
            assert _port_open(trigger_log_port)
            os.kill(old["pid"], signal.SIGKILL)
            killed_at = time.time()
            last_before = max(x["at"] for x in _looks(state_dir) if x["at"] <= killed_at)

            # each look is one `eagleflow watch` process: on this loaded machine they land further apart than
            # the 1 s poll, and the sentinel judges by that pace (never by less than the poll interval)
            interval = look_interval_s(_looks(state_dir), POLL_S)
            silent = smtp.wait_for(lambda m: "WATCH SILENT" in m["Subject"], timeout_s=3 * interval + 30)
            mailed_at = smtp.received_at[smtp.messages.index(silent)]
            assert mailed_at > killed_at, "WATCH SILENT before the triggerer was killed: a false alarm"
            assert silent["Subject"].startswith("[eagleflow] WATCH SILENT shard 0/1 of run ")
            text = silent.get_content()
            assert "last look at" in text and "by watch" in text
            # three intervals after the last look, plus the sentinel's check period and the mail itself
            bound = max(3 * interval, interval + look_cost_s(load_config(str(cfgp))))
            assert 3 * POLL_S <= mailed_at - last_before <= bound + 0.25 + 3.0, (mailed_at - last_before, bound)
            print(f"WATCH SILENT mailed {mailed_at - killed_at:.1f} s after the kill, "
                  f"{mailed_at - last_before:.1f} s after the last look (interval {interval:.1f} s)")

            # the supervisor: a new triggerer, the old one's log server (its port) stopped, the port served again
            new = _wait(lambda: (p := _parts(home)["triggerer"]) and p["pid"] != old["pid"] and p["restarts"] >= 1
                        and p, 60, "the triggerer restarted")
            assert not alive(old["log_server_pid"]), "the dead triggerer's log server still holds its port"
            _wait(lambda: _parts(home)["triggerer"].get("log_server_pid"), 60, "the new triggerer's log server")
            _wait(lambda: _port_open(trigger_log_port), 30, "the trigger log port served by the new log server")
            assert alive(new["pid"])
            health = _wait(lambda: (h := fetch(base)) and {p["part"]: p for p in parts(h)}["triggerer"]["healthy"]
                           and h, 90, "Airflow's health endpoint: triggerer healthy")
            assert all(p["healthy"] for p in parts(health) if p["status"] != "not reported"), health

            def run_state():
                return _call(f"{base}/api/v2/dags/watcher_watched/dagRuns/{run_id}", token=token)["state"]
            state = _wait(lambda: (s := run_state()) in ("success", "failed") and s, 400, "the run finished",
                          every_s=2)
            assert state == "success"
            # the new triggerer watched the shard again: looks after the kill, and the silence is over
            assert [x for x in _looks(state_dir) if x["at"] > killed_at + 1 and x.get("by") == "watch"]
            alarm = json.loads(next((state_dir / "watch").glob("*.worker_shard_00000.alarm.json")).read_text())
            assert alarm["state"] in ("cleared", "ended"), alarm
            if alarm["state"] == "cleared":
                assert [m for m in smtp.messages if "WATCH BACK" in m["Subject"]]
            assert len([m for m in smtp.messages if "WATCH SILENT" in m["Subject"]]) == 1
            manifest = next(run_root.glob("*/hidden_states/shard_00000/manifest.jsonl")).read_text().splitlines()
            ids = [json.loads(line)["id"] for line in manifest if line.strip()]
            assert len(ids) == N and len(set(ids)) == N
        finally:
            standalone.stop(home)
            kill_recorded(state_dir)


# --------------------------------------------------------------------------- gpu_node_health
class _Health(BaseHTTPRequestHandler):
    """Airflow's health endpoint as it answers: ``doc`` gives the answer at the time it is asked (the parts'
    heartbeats are that old when they are read, however late under load the check reads them)."""
    doc: Callable[[], dict] = dict

    def do_GET(self):
        body = json.dumps(type(self).doc()).encode()
        self.send_response(200 if self.path == "/api/v2/monitor/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _health(triggerer: str, beat_ago_s: float = 2.0) -> Callable[[], dict]:
    return lambda: _health_now(triggerer, beat_ago_s)


def _health_now(triggerer: str, beat_ago_s: float) -> dict:
    from datetime import datetime, timezone
    iso = datetime.fromtimestamp(time.time() - beat_ago_s, timezone.utc).isoformat()
    return {"metadatabase": {"status": "healthy"},
            "scheduler": {"status": "healthy", "latest_scheduler_heartbeat": iso},
            "triggerer": {"status": triggerer, "latest_triggerer_heartbeat": iso},
            "dag_processor": {"status": "healthy", "latest_dag_processor_heartbeat": iso}}


def _context(params):
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="scheduled__2026-12-02T01:00:00+00:00",
                         task_id="check_gpu_nodes", map_index=-1, try_number=1)
    return {"params": params, "ti": ti, "run_id": ti.run_id}


@pytest.mark.timeout(180)
def test_gpu_node_health_opens_incidents_for_a_part_gone_and_a_silent_watch(tmp_path, monkeypatch):
    from eagleflow.airflow.health_operators import AIRFLOW_HEALTH_KEY, GpuNodeHealthOperator, HealthIncidentsOpen
    from eagleflow.health.status_store import StatusStore
    from eagleflow.layout import RunLayout
    from eagleflow.nodes import LocalNode
    from eagleflow.watchdog.sentinel import alarm_path, sentinel_role
    from eagleflow.watchdog.signals import WatchedJob

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "model"),
        "node": {"name": "cpu-node", "has_gpu": False, "state_dir": str(tmp_path / "state")},
        "capture": {"shards": 1},
        "watchdog": {"alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_health_test"}}))
    from eagleflow.config import load_config
    layout = RunLayout.for_run(load_config(str(cfg_path)), "r7")
    job = WatchedJob(shard=0, num_shards=1)
    # a live "sentinel" (a recorded process of ours) whose alarm is raised and was not mailed by the node
    sentinel = LocalNode(name="cpu-node").spawn_detached(
        [sys.executable, "-c", "import time; time.sleep(120)"], role=sentinel_role(job),
        pid_file=str(layout.pid_file(sentinel_role(job))), log_file=str(layout.log_file(sentinel_role(job))))
    os.makedirs(os.path.dirname(alarm_path(layout, job)), exist_ok=True)
    Path(alarm_path(layout, job)).write_text(json.dumps({
        "state": "raised", "run_id": "r7", "role": job.role, "job": job.name, "node": "cpu-node",
        "subject": "[eagleflow] WATCH SILENT shard 0/1 of run r7 on cpu-node: no look for 61 s",
        "detail": "Nothing has looked at shard 0/1 of run r7", "mailed": False,
        "mail_error": "no mail from the node (watchdog.node_smtp or watchdog.alert_emails empty)",
        "last_look": {"at": time.time() - 61, "by": "watch", "pid": 99}, "sentinel_pid": sentinel.pid}))

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("EAGLEFLOW_AIRFLOW_HEALTH_URL", f"http://127.0.0.1:{server.server_address[1]}")
    params = {"config_paths": [str(cfg_path)], "memory_threshold_mib": 1024, "window_s": 60,
              "unreachable_after_s": 60, "remind_after_s": 3600}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    try:
        with SmtpSink() as smtp:
            for k, v in smtp.airflow_conn_env("smtp_health_test").items():
                monkeypatch.setenv(k, v)
            _Health.doc = _health("unhealthy", beat_ago_s=95)
            with pytest.raises(HealthIncidentsOpen) as e:
                op.execute(_context(params))
            assert "Airflow triggerer is unhealthy" in str(e.value) and "WATCH SILENT shard 0/1 of run r7" in str(e.value)
            subjects = sorted(m["Subject"] for m in smtp.messages)
            assert len(subjects) == 2, subjects
            assert "[eagleflow] Airflow triggerer is unhealthy" in subjects
            trig = next(m for m in smtp.messages if "triggerer" in m["Subject"])
            assert "its last heartbeat was 95 s before this check" in body_text(trig)
            stored = StatusStore(tmp_path / "status").load_extra(AIRFLOW_HEALTH_KEY)
            assert stored["triggerer"]["status"] == "unhealthy"

            with pytest.raises(HealthIncidentsOpen):   # the same findings: no second mail
                op.execute(_context(params))
            assert len(smtp.messages) == 2

            _Health.doc = _health("healthy")            # the triggerer is back, the sentinel gone
            os.kill(sentinel.pid, signal.SIGKILL)
            _wait(lambda: not alive(sentinel.pid), 10, "the stand-in sentinel gone")
            assert op.execute(_context(params)) == {"nodes_checked": 0, "incidents_open": 0}
            resolved = [m["Subject"] for m in smtp.messages[2:]]
            assert len(resolved) == 2 and all("resolved" in s for s in resolved), resolved
    finally:
        server.shutdown()
        kill_recorded(tmp_path / "state")
