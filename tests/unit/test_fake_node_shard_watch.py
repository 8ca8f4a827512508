"""ShardWatchTrigger on a FakeNode: each event the watch yields (complete, stalled, recovering, unreachable, resumed,
mail due, failed) from the node's typed answers, in milliseconds; and the extraction ShardOperator's start, attach,
hand-over skip and in-slot watch.

The trigger's real loop runs: it reads the run's frozen config on the node, sends ``eagleflow watch --shard I
--json`` each look and parses the ``StallDiagnosis`` it prints (``to_json()``, exit code by verdict). The
watchdog's thresholds are shrunk (poll 10 ms, stall_after 50 ms) so the unreachable bound is 70 ms.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred

from eagleflow.airflow.shard_operators import ShardOperator, StopServerOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger, _end_outage, unreachable_bound_s
from eagleflow.config import load_config
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.nodes import NodeUnreachable
from eagleflow.watchdog.diagnosis import VERDICT_EXIT_CODE, StallDetected, StallDiagnosis
from tests.fixtures.fake_node import FakeFleet, FakeNode, Reply, capture_log, reply, task_context

RUN_ID = "manual__2026-12-04T12:00:00+00:00"
NODE = "gpu-node-1"


@pytest.fixture
def run(monkeypatch):
    cfg = load_config(data={"target_model": "/models/t", "run_root": "/data/runs",
                            "node": {"name": NODE, "state_dir": "/data/state"}, "capture": {"shards": 4},
                            "watchdog": {"poll_interval_s": 0.01, "stall_after_s": 0.05, "health_timeout_s": 1}})
    node = FakeNode(NODE)          # no conn_id: the trigger reaches it through node_from_config, as LocalNode
    FakeFleet().install(monkeypatch).add(node)
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID), _node=node)
    ctx.write_run_config()
    yield ctx, node
    _end_outage(NODE)              # the one-mail-per-outage book is process-wide


def diag(verdict: str, done: int = 9, *, cause: str = "", total: int = 25) -> Reply:
    """What `eagleflow watch --shard 3 --json` prints for ``verdict``, with its exit code."""
    d = StallDiagnosis(verdict=verdict, job="shard 3/4", node=NODE, observed_at=time.time(),
                       headline=f"{done}/{total} samples done ({verdict})", evidence=[f"evidence of {verdict}"],
                       done=done, total=total, cause=cause)
    return reply(d, exit_code=VERDICT_EXIT_CODE[verdict])


def first_event(trigger, timeout_s: float = 5.0) -> dict:
    async def first():
        agen = trigger.run()
        try:
            return (await asyncio.wait_for(agen.__anext__(), timeout_s)).payload
        finally:
            await agen.aclose()
    return asyncio.run(first())


def test_a_complete_shard_yields_complete_from_one_look(run):
    ctx, node = run
    node.on("watch", diag("complete", 25))
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3))
    assert ev["status"] == "complete" and ev["summary"].startswith("COMPLETE shard 3/4 on gpu-node-1: 25/25")
    (look,) = node.commands("watch")
    assert look.argv[3:] == ("watch", "--shard", "3", "--phase", "extract", "--json", "--config", ctx.run_config_path,
                             "--run-id", ctx.layout.run_id)
    assert look.timeout == 1 + 60                      # the health timeout plus the command's own


def test_healthy_and_slow_looks_keep_watching_until_the_stall(run):
    ctx, node = run
    node.on("watch", diag("healthy", 5), diag("slow", 6), diag("stalled", 6, cause="worker"))
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, pending_mails=[], close_incidents=[]))
    assert len(node.commands("watch")) == 3
    assert ev["status"] == "stalled" and ev["cause"] == "worker" and ev["done"] == 6
    assert ev["subject"] == "[eagleflow] STALLED shard 3/4 on gpu-node-1"
    assert "evidence of stalled" in ev["diagnosis"]
    assert node.commands("recover") == []               # no recoveries left: the task fails, Airflow retries


def test_a_recoverable_stall_opens_the_incident_on_the_node_and_yields_recovering(run):
    ctx, node = run
    node.on("watch", diag("stalled", 9, cause="capture_server"))
    node.on("recover", {"incident": "gpu-node-1-capture_server-1796000000", "opened": True,
                        "cause": "capture_server", "incident_shards": ["3"], "shards": {"3": "9/25"},
                        "summary": "incident opened by shard 3"})
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, recoveries_left=2))
    assert ev["status"] == "recovering" and ev["recoveries_left"] == 2
    assert ev["incident"]["incident"] == "gpu-node-1-capture_server-1796000000" and ev["incident"]["opened"]
    (rec,) = node.commands("recover")
    assert rec.option("--shard") == "3" and rec.option("--cause") == "capture_server" and "--incident-only" in rec.argv
    assert rec.option("--summary").startswith("STALLED shard 3/4 on gpu-node-1")


def test_an_incident_id_unfit_for_a_mail_header_is_refused_and_the_stall_fails_the_task(run):
    ctx, node = run
    node.on("watch", diag("stalled", 9, cause="worker"))
    node.on("recover", {"incident": "x\r\nBcc: all@example.com", "opened": True})
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, recoveries_left=1))
    assert ev["status"] == "stalled" and "incident" not in ev


def test_an_unreachable_node_is_reported_once_per_outage_after_the_bound(run):
    ctx, node = run
    node.on("watch", diag("healthy", 5), NodeUnreachable(f"node {NODE}: SSH to {NODE} failed: timed out"))
    bound = unreachable_bound_s(0.05, 0.01)
    started = time.time()
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3))
    assert ev["status"] == "unreachable" and ev["mail"] is True
    assert ev["subject"] == "[eagleflow] UNREACHABLE shard 3/4 on gpu-node-1"
    assert "SSH to gpu-node-1 failed: timed out" in ev["diagnosis"] and "nothing is restarted" in ev["diagnosis"]
    assert started <= ev["since"] <= started + 1 and ev["last_contact"] is not None
    assert time.time() - ev["since"] >= bound
    # a second shard of the same node in the same outage: its own event, but no second mail
    again = first_event(ShardWatchTrigger(ctx.serialize(), 2))
    assert again["status"] == "unreachable" and again["mail"] is False


def test_a_node_that_goes_down_mid_watch_is_unreachable_not_a_failed_job(run):
    ctx, node = run

    def answer_then_drop(call):
        node.go_down("Connection reset by peer")
        return diag("healthy", 7)
    node.on("watch", answer_then_drop)
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, recoveries_left=1))
    assert ev["status"] == "unreachable" and ev["recoveries_left"] == 1
    assert ev["last_contact"] is not None and "Connection reset by peer" in ev["diagnosis"]
    assert node.commands("recover") == []      # nothing is restarted on a node that does not answer


def test_a_watch_of_a_reported_outage_stays_silent_and_resumes_when_the_node_answers(run):
    ctx, node = run
    down = NodeUnreachable(f"node {NODE}: SSH to {NODE} failed: [Errno 113] No route to host")
    node.on("watch", down, down, down, down, down, diag("healthy", 11))
    outage = {"kind": "outage", "id": "outage-1796000000.000", "subject": "[eagleflow] UNREACHABLE shard 3/4",
              "since": time.time() - 600, "done": 0}
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, unreachable_since=time.time() - 600,
                                       close_incidents=[outage]))
    assert len(node.commands("watch")) == 6             # five silent misses, then the answer
    assert ev["status"] == "resumed" and ev["closed"] == [outage] and ev["still_open"] == []
    assert ev["done"] == 11 and ev["node"] == NODE


def test_a_stall_is_over_only_once_a_sample_was_stored_since(run):
    ctx, node = run
    node.on("watch", diag("healthy", 9), diag("healthy", 9), diag("healthy", 10))
    stall = {"kind": "stall", "id": "gpu-node-1-worker-1", "subject": "[eagleflow] STALLED shard 3/4",
             "since": time.time() - 30, "done": 9}
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, close_incidents=[stall]))
    assert len(node.commands("watch")) == 3
    assert ev["status"] == "resumed" and ev["closed"] == [stall] and ev["done"] == 10


def test_a_due_mail_comes_before_any_look(run):
    ctx, node = run
    mail = {"kind": "stall", "event": {"subject": "[eagleflow] STALLED shard 3/4"}, "next_at": time.time() - 1}
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3, pending_mails=[mail], recoveries_left=1))
    assert ev["status"] == "mail_due" and ev["recoveries_left"] == 1
    assert ev["pending_mails"] == [{**mail, "close": None, "tries": 0, "error": ""}]   # typed, then plain again
    assert node.commands("watch") == []


def test_a_watch_command_that_keeps_failing_on_a_reachable_node_fails_the_task(run):
    ctx, node = run
    node.on("watch", Reply(stderr="eagleflow: error: config refused\n", exit_code=2))
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3))
    assert ev["status"] == "failed" and ev["verdict"] == "unreachable"
    assert "the watch command has failed for" in ev["diagnosis"] and "config refused" in ev["diagnosis"]
    assert len(node.commands("watch")) >= 2            # looked again until the bound, then gave up


def test_a_malformed_watch_answer_is_a_failing_command_not_a_verdict(run):
    ctx, node = run
    node.on("watch", Reply('{"verdict": "exploded"}\n', exit_code=0))
    ev = first_event(ShardWatchTrigger(ctx.serialize(), 3))
    assert ev["status"] == "failed" and ev["verdict"] == "unreachable"


# -- ShardOperator (extraction): start, attach, hand-over, the watch in the worker slot ----------------------

def test_the_first_try_starts_the_worker_and_its_sentinel_locked_then_defers_the_watch(run):
    ctx, node = run
    node.add_process(str(ctx.layout.pid_file("capture_server")), "capture_server")   # the setup started it
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=3, deferrable=True)
    with pytest.raises(TaskDeferred) as d:
        op.run(ctx, task_context(ctx, op))
    worker, sentinel = node.spawned
    assert worker.role == "worker_shard_00003" and worker.argv[3:9] == ("capture", "run", "--shard", "3", "--of", "4")
    assert sentinel.role == "sentinel_worker_shard_00003"         # the watch's own watcher, beside it
    for rec in (worker, sentinel):   # each start is exclusive: detach takes the role's lock
        (detach,) = [c for c in node.commands("eagleflow.nodes.detach") if c.option("--role") == rec.role]
        assert detach.option("--lock") == str(ctx.layout.lock_file(rec.role))
        assert detach.option("--pid-file") == str(ctx.layout.pid_file(rec.role))
    trigger = d.value.trigger
    assert isinstance(trigger, ShardWatchTrigger) and trigger.shard == 3
    assert trigger.recoveries_left == ctx.cfg.watchdog.recoveries_in_watch


def test_a_rerun_attaches_to_the_live_worker_and_its_sentinel_instead_of_starting_seconds(run):
    ctx, node = run
    live = node.add_process(str(ctx.layout.pid_file("worker_shard_00003")), "worker_shard_00003")
    node.add_process(str(ctx.layout.pid_file("capture_server")), "capture_server")
    sentinel = "sentinel_worker_shard_00003"
    node.add_process(str(ctx.layout.pid_file(sentinel)), sentinel, lock_file=str(ctx.layout.lock_file(sentinel)))
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=3, deferrable=True)
    log = capture_log(op)
    with pytest.raises(TaskDeferred):
        op.run(ctx, task_context(ctx, op))
    assert node.spawned == []                  # the sentinel's start was refused by its lock: it follows the worker
    assert [c.option("--role") for c in node.commands("eagleflow.nodes.detach")] == [sentinel]
    assert f"worker pid {live.pid} is still running" in log.text("info")


def test_a_shard_its_node_handed_over_skips_naming_the_taker(monkeypatch):
    cfg = load_config(data={"target_model": "/m", "run_root": "/data/runs-a", "capture": {"shards": 4},
                            "fleet": {"training_node": "a", "nodes": [
                                {"name": "a", "state_dir": "/data/state-a"},
                                {"name": "b", "run_root": "/data/runs-b", "state_dir": "/data/state-b"}]}})
    b = FakeFleet().install(monkeypatch).add(FakeNode("b"))
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID)).for_node("b")
    from eagleflow.fleet.takeover import hand_over_mark
    b.put(str(hand_over_mark(ctx.layout, 2)), '{"to": "a", "at": 1796000000.0}')
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=2, deferrable=True)
    with pytest.raises(AirflowSkipException, match="node b handed it over to a, which works on it"):
        op.run(ctx, task_context(ctx, op))
    assert b.spawned == []


def test_without_deferral_the_same_watch_runs_in_the_slot_to_complete_or_to_the_failure(run):
    ctx, node = run
    node.add_process(str(ctx.layout.pid_file("worker_shard_00003")), "worker_shard_00003")
    node.add_process(str(ctx.layout.pid_file("capture_server")), "capture_server")
    node.on("watch", diag("healthy", 20), diag("complete", 25))
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=3, deferrable=False)
    out = op.run(ctx, task_context(ctx, op))
    assert out["shard"] == 3 and out["summary"].startswith("COMPLETE shard 3/4")
    node.on("watch", diag("dead", 20, cause="worker"))
    ctx.cfg.watchdog.recoveries_in_watch = 0
    with pytest.raises(StallDetected) as e:
        op.run(ctx, task_context(ctx, op))
    assert e.value.subject == "[eagleflow] DEAD shard 3/4 on gpu-node-1"


def test_an_unreachable_node_fails_the_start_for_a_retry(run):
    ctx, node = run
    node.go_down()
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=3, deferrable=True)
    with pytest.raises(NodeUnreachable):
        op.run(ctx, task_context(ctx, op))
    assert node.spawned == []


def test_the_capture_teardown_stops_this_runs_live_workers_and_server_and_nothing_of_another_run(run):
    ctx, node = run
    pid = ctx.layout.pid_file
    mine = node.add_process(str(pid("worker_shard_00001")), "worker_shard_00001")
    node.add_process(str(pid("worker_shard_00002")), "worker_shard_00002", alive=False)
    server = node.add_process(str(pid("capture_server")), "capture_server")
    # another run whose id starts with this one's, and this run's sentinel: not workers of this run
    other = node.add_process(f"{ctx.layout.pids_dir}/{ctx.layout.run_id}.retry.worker_shard_00001.json",
                             "worker_shard_00001")
    sentinel = node.add_process(str(pid("sentinel_worker_shard_00001")), "sentinel_worker_shard_00001")
    node.put(str(ctx.layout.server_info_file), '{"url": "http://127.0.0.1:30000"}')
    node.on("eagleflow.serving.dump_protocol", {"removed": 3})
    op = StopServerOperator(phase="extract", task_id="stop_capture_server", grace_s=7)
    log = capture_log(op)
    out = op.run(ctx, task_context(ctx, op))
    assert out == {"server": "terminated", "detail": f"capture_server pid {server.pid} terminated",
                   "dumps_removed": 3}
    stopped = [c.option("--pid-file") for c in node.commands(("process_record", "stop"))]
    assert stopped == [str(pid("worker_shard_00001")), str(pid("worker_shard_00002")), str(pid("capture_server"))]
    assert all(c.option("--grace") == "7" for c in node.commands(("process_record", "stop")))
    assert not node.processes[mine.pid_file].alive and not node.processes[server.pid_file].alive
    assert node.processes[other.pid_file].alive and node.processes[sentinel.pid_file].alive
    assert node.text(str(ctx.layout.server_info_file)) is None
    (dumps,) = node.commands("eagleflow.serving.dump_protocol")
    assert dumps.argv[3] == "remove-dumps" and dumps.option("--run-id") == ctx.layout.run_id
    assert "stopped a still-running extraction worker (worker_shard_00001)" in log.text("warning")
    assert "worker_shard_00002" not in log.text("warning")   # already gone: nothing to say


@pytest.mark.parametrize("server_state,said", [("T", "is stopped (state T"), (None, "is not running")])
def test_a_server_stopped_or_gone_before_the_start_is_an_incident_recovered_through_the_watch(run, server_state,
                                                                                                said):
    """Issue 52 item 5: the shard's check before its start finds its capture server SIGSTOP'd (or gone): not a
    silent restart, but the watch's own road: the incident opened on the node, the stall mailed, the recovery
    (the server restarted once per incident, the worker started there), then the watch that mails its end."""
    ctx, node = run
    if server_state:
        node.add_process(str(ctx.layout.pid_file("capture_server")), "capture_server", state=server_state)
    node.put(str(ctx.layout.heartbeat_file(3)), Heartbeat(job="extract shard 3/4", pid=5, state="failed", done=7,
                                                                total=25).to_json())
    node.on("wc", Reply(stdout=f"9 {ctx.layout.shard_dir(3)}/manifest.jsonl\n"))
    node.on("tail", Reply(stdout="capture server listening\n"))
    node.on("recover", {"incident": "gpu-node-1-capture_server-1796000000", "opened": True,
                        "cause": "capture_server", "incident_shards": ["3"], "shards": {"3": "9/25"},
                        "summary": "incident opened by shard 3"},
            {"ok": True, "action": "restarted", "summary": "capture server restarted; worker restarted as pid 7"})
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=3, deferrable=True)
    log = capture_log(op)
    with pytest.raises(TaskDeferred) as d:
        op.run(ctx, task_context(ctx, op))
    assert node.spawned == []          # nothing started here: the recovery on the node restarts what it names
    opened, recovered = node.commands("recover")
    assert "--incident-only" in opened.argv and opened.option("--cause") == "capture_server"
    assert opened.option("--summary").startswith("STALLED shard 3/4 on gpu-node-1: found before the shard's worker "
                                                 "started (9/25 samples done)") and said in opened.option("--summary")
    assert recovered.option("--incident") == "gpu-node-1-capture_server-1796000000"
    trigger = d.value.trigger
    # the watch after the recovery mails RECOVERED once more than the 9 stored at the fault are stored
    (close,) = trigger.close_incidents
    assert close.kind == "stall" and close.done == 9 and close.id == "gpu-node-1-capture_server-1796000000"
    assert close.subject == "[eagleflow] STALLED shard 3/4 on gpu-node-1"
    assert trigger.recoveries_left == ctx.cfg.watchdog.recoveries_in_watch - 1
    assert "before the shard started" in log.text("warning")
    assert node.commands("tail")[0].argv[-1] == str(ctx.layout.log_file("capture_server"))   # its log in the mail


def test_a_finished_shard_whose_server_is_gone_starts_without_an_incident(run):
    """Its task cleared after the teardown stopped the server: nothing of the shard needs the server."""
    ctx, node = run
    node.put(str(ctx.layout.heartbeat_file(3)), Heartbeat(job="extract shard 3/4", pid=5, state="complete", done=25,
                                                          total=25).to_json())
    op = ShardOperator(phase="extract", task_id="extract_shard", shard=3, deferrable=True)
    with pytest.raises(TaskDeferred):
        op.run(ctx, task_context(ctx, op))
    assert node.commands("recover") == [] and [p.role for p in node.spawned][0] == "worker_shard_00003"
