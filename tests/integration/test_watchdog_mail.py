"""The watch's mails say what happened and never decide the task's fate (issue 27 items 2 and 6).

The real hf capture server is SIGKILLed mid-shard; the real extraction ShardOperator (non-deferrable: the
watch runs in this process) finds it, mails, restarts the server in the same try and watches the shard
to its end. Mails go to a real SMTP server (aiosmtpd).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.engines.hf.server import DELAY_ENV
from eagleflow.phases.extract.lifecycle import start_capture_server, wait_capture_server_ready
from eagleflow.watchdog.recovery import read_restarts
from tests.fixtures.smtp import SmtpSink
from tests.integration.test_watchdog_failures import N, _manifest, _run, _server_pid, started  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 4.0, "health_timeout_s": 2.0, "startup_grace_s": 60.0,
         "gpu_window_s": 4.0, "d_state_after_s": 4.0, "alert_emails": ["oncall@example.test"],
         "smtp_conn_id": "smtp_watch_mail"}


def _context(run) -> dict:
    ti = SimpleNamespace(dag_id="eagle3_pipeline", run_id=run.layout.run_id, task_id="extract_shard", map_index=0,
                         try_number=1, max_tries=2)
    return {"ti": ti, "params": {"config_path": run.config_path}, "run_id": run.layout.run_id}


def _kill_server_mid_shard(run, after: int) -> dict:
    """SIGKILLs the recorded capture server once the shard stored ``after`` samples (in a thread)."""
    out: dict = {}

    def kill():
        deadline = time.monotonic() + 120
        while len(_manifest(run, 0)) < after and time.monotonic() < deadline:
            time.sleep(0.05)
        out["pid"] = _server_pid(run)
        os.kill(out["pid"], signal.SIGKILL)
        out["at"] = time.time()
    t = threading.Thread(target=kill, daemon=True)
    t.start()
    out["thread"] = t
    return out


def _extract(run, smtp: SmtpSink, monkeypatch) -> dict:
    from eagleflow.airflow.shard_operators import ShardOperator
    for k, v in smtp.airflow_conn_env(WATCH["smtp_conn_id"]).items():
        monkeypatch.setenv(k, v)
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=0, deferrable=False)
    return op.run(RunContext(cfg=run.cfg, layout=run.layout), _context(run))


@pytest.fixture
def shard_run(demo_assets, tmp_path, started, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.4")
    run = _run(tmp_path, demo_assets, "mail", watch=WATCH, shards=1, in_flight=1)
    started.append(run)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
    return run


def _assert_exact(run) -> None:
    got = [e["index"] for e in _manifest(run, 0)]
    assert sorted(got) == list(range(N)) and len(got) == len(set(got)), "every sample stored exactly once"


def test_a_killed_server_the_watch_restarts_mails_stalled_then_recovered_never_failed(shard_run, monkeypatch):
    run = shard_run
    with SmtpSink() as smtp:
        kill = _kill_server_mid_shard(run, after=3)
        result = _extract(run, smtp, monkeypatch)   # returns only when the shard is complete
        kill["thread"].join(5)
        smtp.wait_for(lambda m: "RECOVERED" in m["Subject"])
        time.sleep(1)
        subjects = [m["Subject"] for m in smtp.messages]
    assert result["shard"] == 0 and kill.get("pid")
    restarts = read_restarts(run)
    assert len(restarts) == 1 and restarts[0]["old_pid"] == kill["pid"], restarts
    assert len(subjects) == 2, subjects
    stalled, recovered = subjects
    # the verdict on the shard was "failed" or "dead" (its request died with the server), the task did not fail
    assert stalled.startswith("[eagleflow] STALLED shard 0/1 on local (") and "capture server)" in stalled, stalled
    assert recovered.startswith("[eagleflow] RECOVERED shard 0/1 on local: samples stored again"), recovered
    assert not any("FAILED" in s or "DEAD" in s for s in subjects), subjects
    _assert_exact(run)


def test_a_mail_server_refusing_data_does_not_fail_the_recovery_and_the_mail_arrives_once_later(
        shard_run, monkeypatch):
    run = shard_run
    server_pid = _server_pid(run)
    with SmtpSink() as smtp:
        smtp.refusing.set()   # the mail server's outage starts before the stall

        def server_back():
            # the mail server takes mail again once the watch has restarted the capture server
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                if smtp.refused and read_restarts(run):
                    smtp.refusing.clear()
                    return
                time.sleep(0.1)
        back = threading.Thread(target=server_back, daemon=True)
        back.start()
        kill = _kill_server_mid_shard(run, after=3)
        result = _extract(run, smtp, monkeypatch)   # the recovery goes on: no SMTPDataError fails the try
        kill["thread"].join(5)
        back.join(5)
        smtp.wait_for(lambda m: "RECOVERED" in m["Subject"], timeout_s=30)
        time.sleep(1)
        subjects = [m["Subject"] for m in smtp.messages]
        refused = list(smtp.refused)
    assert result["shard"] == 0 and kill["pid"] == server_pid
    assert refused and not smtp.refusing.is_set(), "the outage hit the stall mail, then ended"
    restarts = read_restarts(run)
    assert len(restarts) == 1 and restarts[0]["old_pid"] == server_pid, restarts
    # the incident's own mails, once each and in order, after the server took mail again; few refused tries
    assert len(subjects) == 2, subjects
    assert subjects[0].startswith("[eagleflow] STALLED shard 0/1 on local ("), subjects
    assert subjects[1].startswith("[eagleflow] RECOVERED shard 0/1 on local"), subjects
    assert len(refused) <= 6, f"{len(refused)} refused DATA: a flood, not a backed-off retry"
    _assert_exact(run)
