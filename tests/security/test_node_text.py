"""What a node writes or answers is untrusted input (issue 38, items 5 and 6).

5. `"opened_at": 1e999` in a node's incidents.jsonl passed `history()` (it is a number) and took the GPU view down
   for every node (OverflowError in `gpu_page.ago`: /eagleflow-gpu/ and /panel answered 500). Times from nodes
   are now finite and before 2100, checked where the line is read (the node's book) and where the control plane
   parses the node's answer; a bad line or entry is left out and named (file and line, or the answer's entry),
   and the page renders whatever a stored document holds.
6. An incident id from the node's answer went into `Message-ID`: with `\\r\\n\\r\\n` the mail carried the node's
   text in its body, with `\\r\\nBcc:` the alert was not sent at all. CR/LF in node.name made the sentinel's
   `node_mail` raise instead of returning its reason. Now ids are plain tokens checked at parse, every header value
   goes through one helper, node.name with a line break is refused by the config, and node_mail returns its reason.
"""
from __future__ import annotations

import json
import re
import stat
import time
from types import SimpleNamespace

import pytest
import yaml

from tests.fixtures.smtp import SmtpSink

NOW = time.time()


def _line(**kw) -> str:
    return json.dumps({"event": "opened", "node": "n", "cause": "stall", "opened_at": NOW, "shards": {}, **kw})


# ----------------------------------------------------------------------------------------------- item 5: times
def test_an_infinite_time_in_the_nodes_incident_book_is_a_named_line_left_out(tmp_path):
    """The real node-side command gpu_node_health runs (`python -m eagleflow.health.node_activity`)."""
    from eagleflow.health.node_activity import read_node_activity
    from eagleflow.nodes import LocalNode
    book = tmp_path / "state" / "incidents" / "incidents.jsonl"
    book.parent.mkdir(parents=True)
    book.write_text("\n".join([_line(id="n-stall-good"),
                               _line(id="n-stall-inf").replace(f"{NOW}", "1e999"),
                               _line(id="n-stall-far", opened_at=1e12),
                               json.dumps({"event": "recovered", "id": "n-stall-good", "at": float("nan")}),
                               _line(id="n-stall-x\r\nBcc: thief@evil.example"),
                               _line(id="n-stall-last").replace(f"{NOW}", "1e999")]) + "\n")
    act = read_node_activity(LocalNode(name="n"), str(tmp_path / "state"))
    assert [i["id"] for i in act.incidents] == ["n-stall-good"] and act.incidents[0]["outcome"] == "open"
    named = "\n".join(act.skipped)
    for n in (2, 3, 4, 5, 6):     # the last line too: it is whole JSON, not an append in progress
        assert f"{book} line {n}:" in named, named
    assert "opened_at inf is not a time" in named and "at nan is not a time" in named


def _hostile_node(tmp_path, answer: dict):
    """A node whose `python` prints the answer a hostile node would (a real process, the real parse)."""
    from eagleflow.nodes import LocalNode
    (tmp_path / "answer.json").write_text(json.dumps(answer))   # Infinity: what json writes for 1e999
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'answer.json'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return LocalNode(name="gpu-node-hostile", python=str(fake)), fake


ANSWER = {"processes": [{"pid": 7, "pgid": 7, "run_id": "r", "role": "trainer", "started_at": float("inf")}],
          "shards": {"r": [{"shard": 0, "done": 1, "total": 2, "state": "running", "last_progress_at": 1e999,
                            "written_at": NOW}]},
          "incidents": [{"id": "gpu-node-hostile-stall-1", "cause": "stall", "opened_at": float("inf"),
                         "outcome": "open"},
                        {"id": "x\r\n\r\nnode text in the body", "cause": "stall", "opened_at": NOW,
                         "outcome": "open"},
                        {"id": "gpu-node-hostile-stall-2", "cause": "stall", "opened_at": NOW, "outcome": "open"}],
          "read_at": NOW, "skipped": [], "watch_alarms": []}


def test_the_control_plane_parse_leaves_out_what_a_node_may_not_answer(tmp_path):
    from eagleflow.health.node_activity import read_node_activity
    node, _ = _hostile_node(tmp_path, ANSWER)
    act = read_node_activity(node, str(tmp_path / "state"))
    assert [i["id"] for i in act.incidents] == ["gpu-node-hostile-stall-2"]
    assert act.processes == [] and act.shards == {"r": []}
    named = "\n".join(act.skipped)
    assert "incident gpu-node-hostile-stall-1: its opened_at inf" in named
    assert "node answer: incident 2: incident id" in named
    assert all("\r" not in s and "\n" not in s for s in act.skipped)   # one log line each, the id escaped
    assert "process 7: its started_at inf" in named and "run r shard 0: its last_progress_at inf" in named


@pytest.mark.timeout(120)
def test_the_gpu_view_renders_after_a_node_answers_1e999(tmp_path, monkeypatch):
    """The real operator reads the hostile node into the real status store; the view's panel and page render
    (before: OverflowError, a 500 for every node); a document stored before the fix renders too."""
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator
    from eagleflow.console import gpu_page
    from eagleflow.health.status_store import StatusStore
    node, fake = _hostile_node(tmp_path, ANSWER)
    cfg = tmp_path / "hostile.yaml"
    cfg.write_text(yaml.safe_dump({"run_root": str(tmp_path / "runs"), "target_model": "unused", "node": {
        "name": "gpu-node-hostile", "has_gpu": False, "python": str(fake), "state_dir": str(tmp_path / "state")}}))
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="r", task_id="check_gpu_nodes", map_index=-1, try_number=1)
    params = {"config_paths": [str(cfg)], "memory_threshold_mib": 1024, "window_s": 60, "unreachable_after_s": 60,
              "remind_after_s": 60}
    assert op.execute({"params": params, "ti": ti, "run_id": "r"}) == {"nodes_checked": 0, "incidents_open": 0}
    store = StatusStore(tmp_path / "status")
    html = gpu_page.render_panel(store.all(), dag={"is_paused": False}, incidents=store.incidents(),
                                 airflow={"error": "not read", "read_at": NOW})
    assert "open incident gpu-node-hostile-stall-2" in html and "gpu-node-hostile-stall-1" not in html
    assert "node text in the body" not in html
    # a document written before this check existed (or by anything else): the page still renders every node
    old = dict(store.all()[0])
    old["activity"] = {**(old.get("activity") or {}), "incidents": [
        {"id": "old", "cause": "stall", "opened_at": float("inf"), "outcome": "open"},
        {"id": "older", "cause": "stall", "opened_at": "soon", "outcome": "open"}]}
    old["last_seen"] = float("nan")
    other = {**old, "node": "gpu-node-ok", "activity": {}, "last_seen": NOW}
    html = gpu_page.render_panel([old, other], dag={"is_paused": False}, now=NOW, airflow=None)
    assert "open incident old: stall (opened <span>at an unknown time</span>)" in html and "gpu-node-ok" in html
    assert gpu_page.page_shell(html).count("gpu-node-ok") >= 1


# ---------------------------------------------------------------------------------------- item 6: headers
def test_an_incident_id_unfit_for_a_header_is_refused_where_the_answer_is_parsed():
    from eagleflow.watchdog.protocol import Recovering
    base = {"status": "stalled", "verdict": "stalled", "diagnosis": "d", "subject": "[eagleflow] STALLED"}
    for bad in ("x\r\n\r\nnode text in the body", "x\r\nBcc: thief@evil.example", "a" * 161, "", None, 7):
        with pytest.raises(ValueError, match="is not an incident id"):
            Recovering.from_dict({**base, "incident": {"incident": bad, "opened": True}})
    ok = Recovering.from_dict({**base, "incident": {"incident": "local-capture_server-20261201T070000-abc123",
                                                    "opened": True}})
    assert ok.incident.incident == "local-capture_server-20261201T070000-abc123"


def test_the_node_side_incident_id_is_a_plain_token_whatever_the_node_name(tmp_path):
    from eagleflow.watchdog.incidents import INCIDENT_ID, open_or_join
    inc, opened = open_or_join(tmp_path, node="gpu node 1 (rack 4)", cause="capture_server", run_id="r", shard=0,
                               summary="s", join_window_s=60)
    assert opened and INCIDENT_ID.fullmatch(inc["id"]) and inc["id"].startswith("gpu_node_1__rack_4_-capture_server-")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad_id", ["x\r\n\r\nnode text in the body", "x\r\nBcc: thief@evil.example"])
def test_a_mail_kept_with_a_raw_node_id_is_sent_with_safe_headers_to_its_recipients_only(bad_id, monkeypatch):
    """A watch's pending mail keeps its event as plain values (from before the parse check, or forged): the real
    notifier still writes no node text into a header, and the alert reaches its recipients, and only them."""
    from eagleflow.airflow.alerts import Recipients, send_mail, stall_mail
    event = {"subject": "[eagleflow] STALLED shard 0 of run r on gpu-node-1", "diagnosis": "frozen server",
             "incident": {"incident": bad_id, "incident_shards": ["0"], "shards": {"0": "1/2"}}, "cause": "stall"}
    ti = SimpleNamespace(dag_id="eagle3_pipeline", run_id="r", task_id="extract_shard", map_index=0, try_number=1)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_hdr").items():
            monkeypatch.setenv(k, v)
        send_mail({"ti": ti}, stall_mail({"ti": ti}, event, Recipients(("oncall@example.test",), "smtp_hdr", "")))
        msg = smtp.wait_for(timeout_s=20)
    assert smtp.recipients == [["oncall@example.test"]] and msg["Bcc"] is None
    assert re.fullmatch(r"<eagleflow-incident-h[0-9a-f]{32}@eagleflow>", msg["Message-ID"])
    assert msg.is_multipart() and msg["Subject"] == event["subject"]
    from eagleflow.airflow.alerts import incident_thread
    assert incident_thread(bad_id) == msg["Message-ID"]     # its later mails still thread onto it


def test_node_name_with_a_line_break_is_refused_by_the_config():
    from eagleflow.config import ConfigError, load_config
    for name in ("gpu-node-1\r\nBcc: thief@evil.example", "gpu\nnode", "gpu\x00node"):
        with pytest.raises(ConfigError, match=r"node\.name: .*line break or another control character") as e:
            load_config(data={"target_model": "m", "run_root": "/tmp/r", "node": {"name": name}})
        assert "thief" not in str(e.value) and "gpu-node-1" in str(e.value)   # the fix named, not the value
    assert load_config(data={"target_model": "m", "run_root": "/tmp/r", "node": {"name": "gpu node 1"}})


def test_node_mail_sends_one_line_headers_and_returns_its_reason_instead_of_raising(tmp_path):
    from eagleflow.config import load_config
    from eagleflow.watchdog.sentinel import node_mail
    with SmtpSink() as smtp:
        cfg = load_config(data={"target_model": "m", "run_root": str(tmp_path), "watchdog": {
            "node_smtp": f"127.0.0.1:{smtp.port}", "alert_emails": ["oncall@example.test"]}})
        subject = "[eagleflow] WATCH SILENT shard 0 of run r on gpu\r\nBcc: thief@evil.example"
        assert node_mail(cfg, subject, "nothing looks at the job") == ""
        msg = smtp.wait_for(timeout_s=20)
        assert smtp.recipients == [["oncall@example.test"]] and msg["Bcc"] is None
        assert msg["Subject"].strip() == "[eagleflow] WATCH SILENT shard 0 of run r on gpu Bcc: thief@evil.example"
        cfg.watchdog.node_mail_from = "sentinel@node\r\nBcc: thief@evil.example"   # a mail that cannot be built
        why = node_mail(cfg, "s", "b")
        assert why.startswith(f"mail through 127.0.0.1:{smtp.port} (watchdog.node_smtp) failed: ") and len(smtp.messages) == 1


def test_the_watch_refuses_a_node_answered_incident_id_and_fails_the_task_with_the_stall(tmp_path):
    """The shard watch's real `_recover` asks a (hostile) node to open the incident: an id unfit for a header is
    refused there, so no Recovering event (no mail with it) comes out; the stall itself stands."""
    from eagleflow.airflow.shard_watch import ShardWatchTrigger
    from eagleflow.watchdog.protocol import JobVerdict, Recovering
    stall = JobVerdict(status="stalled", verdict="stalled", diagnosis="frozen", subject="[eagleflow] STALLED shard 0",
                       cause="capture_server")
    diag = SimpleNamespace(cause="capture_server", summary="no sample stored for 40 s")
    trigger = ShardWatchTrigger.__new__(ShardWatchTrigger)
    trigger.shard, trigger.recoveries_left, trigger.phase = 0, 1, "extract"
    for answer, expect in (({"incident": "x\r\n\r\nnode text in the body", "opened": True}, JobVerdict),
                           ({"incident": "gpu-node-1-capture_server-20261201T070000-abc123", "opened": True},
                            Recovering)):
        node, _ = _hostile_node(tmp_path, answer)
        ctx = SimpleNamespace(node=node, eagleflow_argv=node.eagleflow_argv)
        out = trigger._recover(ctx, diag, stall)
        assert type(out) is expect, out
    assert out.incident.incident == "gpu-node-1-capture_server-20261201T070000-abc123"
