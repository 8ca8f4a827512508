"""Airflow's health as its API server reports it: parsed, shown in the GPU view, turned into incidents;
a sentinel's raised alarm read from the node as long as its sentinel runs."""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

from eagleflow.console import gpu_page
from eagleflow.health import airflow_health
from eagleflow.health import incidents as hi
from eagleflow.health.node_activity import NodeActivity, collect
from eagleflow.nodes import LocalNode
from tests.fixtures.watchdog_jobs import kill_group, wait_gone

NOW = 1_800_000_000.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


# the shape of airflow.api.common.airflow_health.get_airflow_health (Airflow 3.3), as /api/v2/monitor/health serves it
DOC = {"metadatabase": {"status": "healthy"},
       "scheduler": {"status": "healthy", "latest_scheduler_heartbeat": _iso(NOW - 3)},
       "triggerer": {"status": "unhealthy", "latest_triggerer_heartbeat": _iso(NOW - 420)},
       "dag_processor": {"status": None, "latest_dag_processor_heartbeat": None},
       "read_at": NOW}


def test_parts_name_each_status_and_heartbeat():
    parts = {p["part"]: p for p in airflow_health.parts(DOC)}
    assert parts["scheduler"]["healthy"] and parts["scheduler"]["heartbeat_at"] == NOW - 3
    assert parts["triggerer"]["status"] == "unhealthy" and not parts["triggerer"]["healthy"]
    assert parts["dag_processor"]["status"] == "never started"
    assert [p["part"] for p in airflow_health.gone(DOC)] == ["triggerer", "dag_processor"]
    older = {k: v for k, v in DOC.items() if k != "dag_processor"}   # an API server without that entry
    assert [p["part"] for p in airflow_health.gone(older)] == ["triggerer"]


def test_gpu_view_shows_the_parts_and_a_silent_endpoint():
    html = gpu_page.render_panel([], dag={"is_paused": False}, now=NOW, airflow=DOC)
    assert "data-part='triggerer' data-status='unhealthy'" in html and "class='part gone'" in html
    assert "data-part='scheduler' data-status='healthy'" in html and "7 min ago" in html
    down = gpu_page.render_panel([], dag={"is_paused": False}, now=NOW,
                                 airflow={"error": "URLError: refused", "read_at": NOW})
    assert "class='airflow down'" in down and "refused" in down
    assert "health not read yet" in gpu_page.render_panel([], dag=None, now=NOW)


def test_a_part_gone_opens_one_incident_and_resolves_when_healthy():
    findings = hi.airflow_findings(DOC)
    assert [f.key for f in findings] == ["airflow:triggerer", "airflow:dag_processor"]
    trig = findings[0]
    assert trig.subject == "Airflow triggerer is unhealthy" and "7 min before this check" in trig.detail
    assert "nothing looks at them" in trig.detail
    book, due = hi.step({}, findings, observed={"airflow"}, now=NOW, remind_after_s=1800)
    assert sorted(d.kind for d in due) == ["opened", "opened"]
    book, due = hi.step(book, findings, observed={"airflow"}, now=NOW + 60, remind_after_s=1800)
    assert due == []
    healthy = {**DOC, "triggerer": {"status": "healthy"}, "dag_processor": {"status": "healthy"}}
    book, due = hi.step(book, hi.airflow_findings(healthy), observed={"airflow"}, now=NOW + 120, remind_after_s=1800)
    assert sorted(d.kind for d in due) == ["resolved", "resolved"]
    # the endpoint not read (no "airflow" observed): an open incident stays open, unmailed
    book2, _ = hi.step({}, findings, observed={"airflow"}, now=NOW, remind_after_s=1800)
    book2, due = hi.step(book2, [], observed=set(), now=NOW + 60, remind_after_s=1800)
    assert due == [] and all(r["state"] == "open" for r in book2.values())


def test_node_activity_reads_a_raised_alarm_only_while_its_sentinel_runs(tmp_path):
    state = tmp_path / "state"
    (state / "watch").mkdir(parents=True)
    (state / "pids").mkdir()
    alarm = {"state": "raised", "run_id": "r1", "role": "worker_shard_00002", "job": "shard 2/4",
             "subject": "[eagleflow] WATCH SILENT shard 2/4 of run r1 on n: no look for 61 s", "mailed": True,
             "last_look": {"at": time.time() - 61, "by": "watch"}}
    (state / "watch" / "r1.worker_shard_00002.alarm.json").write_text(json.dumps(alarm))
    (state / "watch" / "r1.worker_shard_00003.alarm.json").write_text(json.dumps({**alarm, "state": "cleared"}))
    (state / "watch" / "r1.worker_shard_00004.alarm.json").write_text("{not json")
    assert collect(state).watch_alarms == []          # no sentinel recorded: a stale record, not an alarm
    sentinel = LocalNode(name="n").spawn_detached([sys.executable, "-c", "import time; time.sleep(60)"],
                                                   role="sentinel_worker_shard_00002",
                                                   pid_file=str(state / "pids" / "r1.sentinel_worker_shard_00002.json"),
                                                   log_file=str(tmp_path / "logs" / "s.log"))
    try:
        assert collect(state).watch_alarms == []      # raised by another sentinel than the one running
        (state / "watch" / "r1.worker_shard_00002.alarm.json").write_text(json.dumps({**alarm,
                                                                                  "sentinel_pid": sentinel.pid}))
        act = collect(state)
        assert [a["role"] for a in act.watch_alarms] == ["worker_shard_00002"]
        assert any("r1.worker_shard_00004.alarm.json" in s for s in act.skipped)
        again = NodeActivity.from_dict(json.loads(json.dumps(act.to_dict())))
        assert again.watch_alarms == act.watch_alarms
        f = hi.watch_silent_findings("n", again.watch_alarms)[0]
        assert f.subject == "WATCH SILENT shard 2/4 of run r1 on n: no look for 61 s"   # the mail adds the tag
        assert f.scope == "watch:n" and "mailed this already" in f.detail
    finally:
        kill_group(sentinel.pgid)
        wait_gone(sentinel.pid)
