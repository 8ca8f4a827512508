"""gpu_node_health's WATCH SILENT mail names every silent shard of the run (issue 52 item 7): one triggerer watches
every shard, so when it dies they all go silent, but each shard's sentinel raises its alarm on its own clock. In the
drill the mail named shard 0 only, though shard 1 was just as silent: its alarm came after the check. The node now
reports, with each raised alarm, the run's other running jobs nothing has looked at since that watch went silent,
and the check mails one incident per run naming them all; a shard whose watch still looks is not named."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eagleflow.health import incidents as hi
from eagleflow.health.node_activity import collect
from eagleflow.nodes import LocalNode
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
RUN = "manual__2026-12-01T04:28:35.288744+00:00"   # a real run id: dots and colons in the file names


def _spawn(state: Path, role: str):
    return LocalNode(name="n").spawn_detached(SLEEP, role=role, pid_file=str(state / "pids" / f"{RUN}.{role}.json"),
                                              log_file=str(state.parent / "logs" / f"{role}.log"))


def _looks(state: Path, role: str, *times: float) -> None:
    with open(state / "watch" / f"{RUN}.{role}.looks.jsonl", "a") as f:
        for t in times:
            f.write(json.dumps({"at": t, "by": "watch", "pid": 1, "verdict": "healthy", "summary": "ok"}) + "\n")


def _node_state(tmp_path: Path, last_look_of_shard_1: float, *, mailed: bool = False) -> tuple[Path, float]:
    """Three running extraction shards of one run, watched every second; shard 0's sentinel raised its alarm
    (silent for 61 s, it says), shard 1 was last looked at ``last_look_of_shard_1`` s after shard 0's last look,
    shard 2 1.8 s after it (its watch still looks)."""
    state = tmp_path / "state"
    (state / "watch").mkdir(parents=True)
    now = time.time()
    for shard in (0, 1, 2):
        _spawn(state, f"worker_shard_{shard:05d}")
    sentinel = _spawn(state, "sentinel_worker_shard_00000")
    time.sleep(0.1)   # every look below comes after the workers started (an earlier try's looks are not theirs)
    silent_since = time.time()
    time.sleep(2.0)   # and none lies in the future
    _looks(state, "worker_shard_00000", silent_since - 0.05, silent_since)
    # looks every half second (the watch's pace is the 1 s poll interval) up to the last one
    _looks(state, "worker_shard_00001", silent_since - 0.05,
           *[silent_since + k / 2 for k in range(1, int(last_look_of_shard_1 * 2) + 1)])
    _looks(state, "worker_shard_00002", silent_since, silent_since + 0.6, silent_since + 1.2, silent_since + 1.8)
    (state / "watch" / f"{RUN}.worker_shard_00000.alarm.json").write_text(json.dumps({
        "state": "raised", "at": now, "run_id": RUN, "role": "worker_shard_00000", "job": "shard 0/3",
        "node": "cpu-node", "poll_interval_s": 1.0, "silent_since": silent_since, "raised_at": silent_since + 61,
        "subject": f"[eagleflow] WATCH SILENT shard 0/3 of run {RUN} on cpu-node: no look for 61 s",
        "mailed": mailed, "mail_error": "" if mailed else "no mail from the node (watchdog.node_smtp empty)",
        "detail": f"Nothing has looked at shard 0/3 of run {RUN} on node cpu-node for 61 s",
        "last_look": {"at": silent_since, "by": "watch", "pid": 1}, "sentinel_pid": sentinel.pid}))
    return state, silent_since


@pytest.mark.timeout(60)
def test_the_node_reports_every_shard_as_silent_as_the_alarmed_one(tmp_path):
    state, _ = _node_state(tmp_path, last_look_of_shard_1=0.5)
    try:
        alarms = collect(state).watch_alarms
        assert [a["job"] for a in alarms] == ["shard 0/3"]
        # shard 1: no look since shard 0's went silent; shard 2: looked at a second ago (its watch lives)
        assert [(x["role"], x["job"]) for x in alarms[0]["silent_with"]] == [("worker_shard_00001", "shard 1/3")]
        findings = hi.watch_silent_findings("cpu-node", alarms)
        assert len(findings) == 1
        f = findings[0]
        assert f.subject == f"WATCH SILENT shard 0/3 and shard 1/3 of run {RUN} on cpu-node: no look for 61 s"
        assert f.key == f"cpu-node:watch_silent:{RUN}" and "shard 2/3" not in f.subject + f.detail
        assert "shard 1/3 of run" in f.detail and "mailed this already" not in f.detail
    finally:
        kill_recorded(state)


@pytest.mark.timeout(60)
def test_a_shard_looked_at_after_the_silence_began_is_not_named(tmp_path):
    state, _ = _node_state(tmp_path, last_look_of_shard_1=1.5, mailed=True)
    try:
        alarms = collect(state).watch_alarms
        assert alarms[0]["silent_with"] == []
        f = hi.watch_silent_findings("cpu-node", alarms)[0]
        assert f.subject == f"WATCH SILENT shard 0/3 of run {RUN} on cpu-node: no look for 61 s"
        assert "mailed this already" in f.detail   # the node's own mail said all there was to say
    finally:
        kill_recorded(state)


def test_a_node_that_mailed_one_of_two_silent_shards_leaves_the_mail_to_the_check():
    base = {"state": "raised", "run_id": "r1", "poll_interval_s": 1.0, "silent_since": 100.0, "raised_at": 161.0}
    alarms = [{**base, "role": "generate_shard_00001", "job": "generate shard 1/2", "mailed": True,
               "silent_with": [{"role": "generate_shard_00000", "job": "generate shard 0/2", "last_look_at": 99.5},
                               {"job": "x" * 500, "last_look_at": 1e999}]},    # a time no node can write: left out
              {**base, "role": "trainer", "job": "training", "run_id": "r2", "mailed": False, "mail_error": "refused"}]
    by_key = {f.key: f for f in hi.watch_silent_findings("n", alarms)}
    assert set(by_key) == {"n:watch_silent:r1", "n:watch_silent:r2"}
    f = by_key["n:watch_silent:r1"]
    assert f.subject == "WATCH SILENT generate shard 1/2 and generate shard 0/2 of run r1 on n: no look for 61 s"
    assert "The node mailed generate shard 1/2 only" in f.detail and "mailed this already" not in f.detail
    assert "xxx" not in f.detail


@pytest.mark.timeout(120)
def test_the_health_check_mails_one_watch_silent_incident_naming_every_silent_shard(tmp_path, monkeypatch):
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator, HealthIncidentsOpen
    state, _ = _node_state(tmp_path, last_look_of_shard_1=0.5)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "model"),
        "node": {"name": "cpu-node", "has_gpu": False, "state_dir": str(state)}, "capture": {"shards": 3},
        "watchdog": {"alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_silent_test"}}))
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    monkeypatch.setattr(op, "_airflow_health", lambda: {"error": "not read in this test", "url": "", "read_at": 0})
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="scheduled__2026-12-02T01:00:00+00:00",
                         task_id="check_gpu_nodes", map_index=-1, try_number=1)
    params = {"config_paths": [str(cfg_path)], "memory_threshold_mib": 1024, "window_s": 60,
              "unreachable_after_s": 60, "remind_after_s": 3600}
    try:
        with SmtpSink() as smtp:
            for k, v in smtp.airflow_conn_env("smtp_silent_test").items():
                monkeypatch.setenv(k, v)
            with pytest.raises(HealthIncidentsOpen):
                op.execute({"params": params, "ti": ti, "run_id": ti.run_id})
            assert len(smtp.messages) == 1, [m["Subject"] for m in smtp.messages]
            msg = smtp.messages[0]
            assert msg["Subject"] == (f"[eagleflow] WATCH SILENT shard 0/3 and shard 1/3 of run {RUN} on cpu-node: "
                                      "no look for 61 s"), msg["Subject"]
            body = body_text(msg)
            assert "shard 1/3 of run" in body and "just as silent" in body and "shard 2/3" not in body
    finally:
        kill_recorded(state)
