"""Issue 26 item 6 (node side): each bad input is named and located, and nothing a node or client sends is
read without bound. Real paths: `prepare_corpus`, the node-activity command, the hf server, SSH over a real sshd.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.health.node_activity import read_node_activity
from eagleflow.corpus.prepare import BadRecordsError, prepare_corpus
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from eagleflow.watchdog import incidents as watchdog_incidents
from tests.fixtures.corpus import fixture_path, write_config
from tests.fixtures.processes import alive

pytestmark = pytest.mark.timeout(300)
DEEP = 100_000


def _deep_source(tmp_path: Path) -> Path:
    good = Path(fixture_path("good_sharegpt.jsonl")).read_text().splitlines()[:2]
    src = tmp_path / "deep.jsonl"
    src.write_text("\n".join([good[0], "[" * DEEP + "]" * DEEP, good[1]]) + "\n")
    return src


def test_a_100000_deep_json_array_is_a_located_bad_record(tmp_path, demo_assets):
    src = _deep_source(tmp_path)
    sources = [{"name": "deep", "path": str(src)}]
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], sources, corpus={"max_bad_records": 0}))
    with pytest.raises(BadRecordsError) as e:            # was: RecursionError out of normalisation
        prepare_corpus(cfg, RunLayout.for_run(cfg, "strict"), log=lambda _: None)
    listed = [ln for ln in str(e.value).splitlines() if ln.startswith("  - ")]
    assert len(listed) == 1 and f"{src} line 2: field (line) = " in listed[0] and "nested too deeply" in listed[0]
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], sources, corpus={"max_bad_records": 1},
                                   name="lenient.yaml"))
    lay = RunLayout.for_run(cfg, "lenient")
    stats = prepare_corpus(cfg, lay, log=lambda _: None)
    assert stats["records"] == 2
    (bad,) = [json.loads(x) for x in (Path(lay.corpus_dir) / "bad_records.jsonl").read_text().splitlines()]
    assert (bad["file"], bad["where"], bad["field"], bad["kind"]) == (str(src), "line 2", "(line)", "malformed_json")


def test_a_deep_json_source_document_is_refused_naming_the_file(tmp_path, demo_assets):
    from eagleflow.corpus.sources import SourceError
    src = tmp_path / "deep.json"
    src.write_text("[" * DEEP + "]" * DEEP)
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], [{"name": "deep", "path": str(src)}]))
    with pytest.raises(SourceError, match=f"source {src}: nested too deeply"):
        prepare_corpus(cfg, RunLayout.for_run(cfg, "r"), log=lambda _: None)


def _event(**kw) -> str:
    # a time a node may write: finite and before 2100 (1e999 or 1e12 are refused lines, issue 38)
    return json.dumps({"event": "opened", "node": "n", "cause": "stall", "opened_at": time.time(), **kw})


def test_malformed_incident_and_heartbeat_lines_are_skipped_and_named_not_a_dead_node(tmp_path):
    """The real node-side command (`python -m eagleflow.health.node_activity`) that gpu_node_health runs."""
    state = tmp_path / "state"
    book = state / "incidents" / "incidents.jsonl"
    book.parent.mkdir(parents=True)
    book.write_text("\n".join([_event(id="i1", shards={"0": {"run_id": "r"}}),
                               '{"event": "opened", "id": ',           # torn line in the middle
                               "[1, 2]",                               # JSON, but not an event
                               _event(id="i2", shards=["0"]),          # shards not an object
                               "[" * DEEP + "]" * DEEP,                # too deep to read
                               _event(id="i3"),
                               json.dumps({"event": "resolved", "id": ["i3"]}),   # an id that is not a string
                               _event(id="i4", shards={"0": {"run_id": 5}, "1": {"run_id": "r"}}),  # mixed run ids
                               '{"event": "opened"']) + "\n")          # last line: an append in progress
    run = tmp_path / "runs" / "r"
    node = LocalNode()
    rec = node.spawn_detached([sys.executable, "-c", "import time; time.sleep(300)"], role="worker_shard_00000",
                              pid_file=str(state / "pids" / "r.worker_shard_00000.json"),
                              log_file=str(run / "logs" / "worker_shard_00000.log"))
    try:
        for shard, text in ((0, "[1]"), (1, json.dumps({"done": "many"})), (2, json.dumps({"done": 3, "total": 9}))):
            hb = run / "hidden_states" / f"shard_{shard:05d}" / "heartbeat.json"
            hb.parent.mkdir(parents=True)
            hb.write_text(text)
        act = read_node_activity(node, str(state))        # was: the command crashed, the node "unreadable"
        assert [i["id"] for i in act.incidents] == ["i1", "i3", "i4"]
        assert act.incidents[2]["run_ids"] == ["r"] and act.incidents[1]["outcome"] == "open"
        assert [(s.shard, s.done, s.total) for s in act.shards["r"]] == [(2, 3, 9)]
        lines = "\n".join(act.skipped)
        for n in (2, 3, 4, 5, 7):
            assert f"{book} line {n}:" in lines, lines
        assert f"{book} line 9" not in lines, "the line being appended is not a finding"
        assert "shard_00000/heartbeat.json: not a heartbeat" in lines and "shard 1 left out" in lines
        assert [p.pid for p in act.processes] == [rec.pid]
        skipped: list[str] = []
        assert [e["id"] for e in watchdog_incidents.history(state, skipped) if e["event"] == "opened"] == \
            ["i1", "i3", "i4"]      # one reader: the watchdog and the console see the same book
        assert [s.split(" line ")[1].split(":")[0] for s in skipped] == ["2", "3", "4", "5", "7"]
    finally:
        os.kill(rec.pid, signal.SIGKILL)


def test_the_hf_server_refuses_a_request_body_over_its_limit(demo_assets, tmp_path):
    from eagleflow.engines.hf import server as hf_server
    from eagleflow.serving.client import health_generate
    model = hf_server.CaptureModel(demo_assets["target_model"], model_name="tiny")
    srv = hf_server.CaptureServer(("127.0.0.1", 0), model, str(tmp_path / "dumps"))
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        c = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
        c.putrequest("POST", "/generate")
        c.putheader("Content-Length", str(hf_server.MAX_BODY_BYTES + 1))   # announced, never sent: not read
        c.putheader("Content-Type", "application/json")
        c.endheaders()
        c.send(b'{"input_ids": [1, 2')
        r = c.getresponse()
        body = json.loads(r.read())
        assert r.status == 413 and str(hf_server.MAX_BODY_BYTES) in body["error"]
        assert "MAX_BODY_BYTES" in body["error"]
        c.close()
        health_generate(srv.url, timeout_s=30)            # the server is still serving
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow
def test_ssh_node_run_output_is_bounded(tmp_path_factory, monkeypatch):
    from eagleflow.nodes import ssh
    from tests.fixtures.sshd import start_sshd
    monkeypatch.setattr(ssh, "MAX_OUTPUT_BYTES", 1 << 20)   # 1 MiB here, so the test streams only a few
    with start_sshd(tmp_path_factory.mktemp("sshd-bound") / "server") as server:
        monkeypatch.setenv("AIRFLOW_CONN_SSH_BOUND_TEST", server.airflow_conn())
        with ssh.SSHNode("ssh_bound_test", python=sys.executable) as node:
            with pytest.raises(ssh.NodeOutputTooLarge, match=r"more than 1048576 bytes on stdout .*MAX_OUTPUT_BYTES"):
                node.run(["head", "-c", str(8 << 20), "/dev/zero"], timeout=30)
            with pytest.raises(ssh.NodeOutputTooLarge, match="on stderr"):
                node.run(["sh", "-c", f"head -c {8 << 20} /dev/zero >&2"], timeout=30)
            assert node.run(["echo", "still usable"], timeout=10).stdout == "still usable\n"

        async def from_a_trigger():   # the shard watch's node: the same bound
            import asyncio
            from eagleflow.nodes.ssh_async import AsyncSSHNode
            anode = AsyncSSHNode("ssh_bound_test", name="bound")
            try:
                with pytest.raises(ssh.NodeOutputTooLarge, match="more than 1048576 bytes on stdout"):
                    await anode.run(["head", "-c", str(8 << 20), "/dev/zero"], timeout=30)
                res = await asyncio.wait_for(anode.run(["sh", "-c", "cat; echo err >&2"], input="in\n",
                                                       timeout=20), 60)
                return res.stdout, res.stderr
            finally:
                anode.close()
        import asyncio
        assert asyncio.run(from_a_trigger()) == ("in\n", "err\n")
