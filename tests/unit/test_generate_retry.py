"""Retries of generation shards: one hung server is restarted once for all shards, a retry never runs its worker
ahead of a loading server, and two concurrent starts of one shard's worker give one worker."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.phases.generate import lifecycle as generate
from eagleflow.nodes import LocalNode

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


class _Layout:
    run_id = "r"

    def __init__(self, root: Path):
        self.root = root
        self.generate_server_info_file = root / "generate_server.json"
        self.locks_dir = root / "locks"
        self.generated_dir = root / "generated"
        self.owned_roots = (root,)

    def pid_file(self, role):
        return self.root / "pids" / f"r.{role}.json"

    def lock_file(self, role):
        return self.root / "locks" / f"r.{role}.lock"

    def restart_lock_file(self, role):
        return self.root / "locks" / f"r.{role}.restart.lock"

    def log_file(self, role):
        return self.root / "logs" / f"r.{role}.log"

    def generate_shard_dir(self, s):
        return self.root / "generated" / f"shard_{s:05d}"


def _ctx(tmp_path, argv=SLEEP, **cfg):
    layout = _Layout(tmp_path)
    for s in (0, 1):
        layout.generate_shard_dir(s).mkdir(parents=True, exist_ok=True)
    conf = SimpleNamespace(capture=SimpleNamespace(backend="hf"),
                           server=SimpleNamespace(ready_timeout_s=cfg.get("ready_timeout_s", 2.0)),
                           generate=SimpleNamespace(enabled=True, shards=2, backend=None),
                           watchdog=SimpleNamespace(health_timeout_s=1.0, recoveries_in_watch=3),
                           node=SimpleNamespace(name="t"), is_fleet=False)
    return SimpleNamespace(node=LocalNode(name="t"), layout=layout, cfg=conf, eagleflow_argv=lambda *a: argv,
                           trigger_ref=lambda: {"conn_id": None, "run_config": str(root_config(tmp_path)),
                                                "run_id": "r"})


def root_config(tmp_path):
    return tmp_path / "run-config.json"


def _stop_all(ctx):
    for pid_file in sorted((ctx.layout.root / "pids").glob("*.json")):
        ctx.node.stop_recorded(str(pid_file), grace_s=2)


STALL = {"status": "stalled", "cause": "capture_server", "subject": "STALLED generate shard"}


@pytest.mark.timeout(60)
def test_two_shards_stalled_on_one_server_restart_it_once_and_the_second_keeps_the_fresh_one(tmp_path):
    ctx = _ctx(tmp_path)
    server_pid = str(ctx.layout.pid_file(generate.SERVER_ROLE))
    try:
        hung, _ = generate.start_generate_server(ctx)
        assert generate.record_server_stall(ctx, 0, STALL)
        assert generate.record_server_stall(ctx, 1, STALL)
        said = []
        assert generate.stop_after_server_stall(ctx, 0, grace_s=2, log=said.append)   # shard 0's retry
        fresh = ctx.node.live_record(server_pid)
        assert fresh is not None and fresh.pid != hung.pid and "STALLED generate shard" in said[0]
        said.clear()
        assert not generate.stop_after_server_stall(ctx, 1, grace_s=2, log=said.append)   # shard 1's retry
        kept = ctx.node.live_record(server_pid)
        assert kept is not None and kept.pid == fresh.pid, "shard 1's retry stopped the fresh server"
        assert any("no longer the recorded one" in m for m in said)
        for s in (0, 1):
            assert not (ctx.layout.generate_shard_dir(s) / generate.SERVER_STALL).exists()
    finally:
        _stop_all(ctx)


@pytest.mark.timeout(60)
def test_a_stall_recorded_when_no_server_ran_leaves_the_one_running_now(tmp_path):
    ctx = _ctx(tmp_path)
    try:
        assert generate.record_server_stall(ctx, 0, STALL)     # the server was already gone
        now, _ = generate.start_generate_server(ctx)
        assert not generate.stop_after_server_stall(ctx, 0, grace_s=2)
        assert ctx.node.live_record(str(ctx.layout.pid_file(generate.SERVER_ROLE))).pid == now.pid
    finally:
        _stop_all(ctx)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server,expected", [
    (SLEEP, "AirflowFailException"),     # still loading when the wait ran out: a person looks
    ([sys.executable, "-c", "import time; time.sleep(1)"], "AirflowException"),   # died while waited for: retry
])
def test_a_retry_waits_for_a_loading_server_before_its_worker_and_a_death_is_retryable(tmp_path, server, expected):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
    from eagleflow.airflow.shard_operators import ShardOperator
    ctx = _ctx(tmp_path, argv=server, ready_timeout_s=3.0)
    try:
        generate.start_generate_server(ctx)     # alive, no generate_server.json yet: loading
        op = ShardOperator(phase="generate", task_id="generate_responses", shard=0, deferrable=True)
        with pytest.raises(AirflowException) as e:
            op.run(ctx, {})
        assert type(e.value).__name__ == expected
        assert isinstance(e.value, AirflowFailException) == (expected == "AirflowFailException")
        # the worker never started ahead of the server
        assert ctx.node.live_record(str(ctx.layout.pid_file(generate.worker_role(0)))) is None
        assert not ctx.layout.pid_file(generate.worker_role(0)).exists()
    finally:
        _stop_all(ctx)


@pytest.mark.timeout(60)
def test_a_worker_start_that_lost_the_race_attaches_to_the_winner(tmp_path):
    ctx = _ctx(tmp_path)
    try:
        first, attached = generate.start_or_attach_generate_worker(ctx, 0)
        assert not attached
        real = ctx.node.live_record
        seen = []

        def raced(pid_file):   # the second start looked before the first had recorded its worker
            if not seen and pid_file.endswith(f"{generate.worker_role(0)}.json"):
                seen.append(pid_file)
                return None
            return real(pid_file)
        ctx.node.live_record = raced
        said = []
        second, attached2 = generate.start_or_attach_generate_worker(ctx, 0, log=said.append)
        ctx.node.live_record = real
        assert seen and (second.pid, attached2) == (first.pid, True)
        assert real(str(ctx.layout.pid_file(generate.worker_role(0)))).pid == first.pid
    finally:
        time.sleep(0.2)
        _stop_all(ctx)


@pytest.mark.timeout(60)
def test_a_reconcile_rerun_that_stalled_on_the_generation_server_restarts_it_on_its_retry(tmp_path):
    from eagleflow.airflow.reconcile_operators import RerunShardOperator
    from eagleflow.watchdog.diagnosis import StallDetected
    claim = [sys.executable, "-c", "print('{\"action\": \"skipped\", \"reason\": \"test: claim not run\"}')"]
    ctx = _ctx(tmp_path)
    ctx.eagleflow_argv = lambda *a: claim if "claim" in a else SLEEP
    ctx.close = lambda: None
    op = RerunShardOperator(task_id="rerun_shard", target={"run_id": "r", "phase": "generate", "shard": 1,
                                                           "run_config": "unused"}, deferrable=True)
    op._run_context = lambda context: ctx
    server_pid = str(ctx.layout.pid_file(generate.SERVER_ROLE))
    try:
        hung, _ = generate.start_generate_server(ctx)
        with pytest.raises(StallDetected):
            op.execute_complete({}, STALL)
        assert (ctx.layout.generate_shard_dir(1) / generate.SERVER_STALL).exists()
        out = op.execute({"ti": SimpleNamespace(try_number=2)})
        assert out["outcome"] == "skipped"
        fresh = ctx.node.live_record(server_pid)
        assert fresh is not None and fresh.pid != hung.pid
        assert not (ctx.layout.generate_shard_dir(1) / generate.SERVER_STALL).exists()
    finally:
        _stop_all(ctx)


@pytest.mark.timeout(60)
def test_a_sigstopped_server_is_stuck_not_loading_and_a_shard_opens_an_incident_for_it(tmp_path):
    """The drill that turned a run red: a shard that started while its generation server was SIGSTOP'd took it
    for one still loading and waited out ready_timeout_s; the next drill (issue 52 item 5) found the shard's try
    restarting it silently, no incident, no mail. Now the look says "stuck" from the /proc state, the wait raises
    at once, and the shard's try neither waits nor restarts it by itself: it opens the incident on the node and
    hands the watch a ``recovering`` event (mailed STALLED, recovered by ``recover_in_watch``, RECOVERED mailed:
    tests/integration/test_prestart_fault_airflow.py runs that whole road)."""
    import json
    import os
    import signal

    from eagleflow.airflow.shard_operators import ShardOperator
    from eagleflow.phase_jobs import ServerStuck
    ctx = _ctx(tmp_path, ready_timeout_s=30.0)
    opened = {"incident": "t-capture_server-20261201T000000-abcdef", "opened": True, "cause": "capture_server",
              "incident_shards": ["0"], "shards": {"0": "0", "1": "0"}, "summary": "incident opened"}
    asked = []

    def argv(*a):
        asked.append(a)
        return [sys.executable, "-c", f"print({json.dumps(json.dumps(opened))})"] if a[:1] == ("recover",) else SLEEP
    ctx.eagleflow_argv = argv
    server_pid = str(ctx.layout.pid_file(generate.SERVER_ROLE))
    try:
        frozen, _ = generate.start_generate_server(ctx)
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while ctx.node.process_status(server_pid).state != "T" and time.time() < deadline:
            time.sleep(0.05)
        state, _, detail = generate.check_ready(ctx)
        assert state == "stuck" and f"pid {frozen.pid} is stopped (state T" in detail, (state, detail)
        t0 = time.monotonic()
        with pytest.raises(ServerStuck):
            generate.wait_generate_server_ready(ctx)
        assert time.monotonic() - t0 < 5, "the wait took a stopped server for a loading one"

        started = []
        op = ShardOperator(phase="generate", task_id="generate_responses", shard=0, deferrable=True)
        op._watch = lambda ctx_, context, start: started.append(start) or "watched"
        t0 = time.monotonic()
        assert op.run(ctx, {}) == "watched"
        assert time.monotonic() - t0 < 20
        event = started[0]
        assert event["status"] == "recovering" and event["cause"] == "capture_server", event
        assert event["subject"] == "[eagleflow] STALLED generate shard 0/2 on t", event
        assert f"generation server pid {frozen.pid} is stopped (state T" in event["diagnosis"], event
        assert event["incident"]["incident"] == opened["incident"] and event["incident"]["opened"]
        assert event["recoveries_left"] == 3 and event["done"] == 0
        assert ("recover", "--shard", "0", "--json", "--cause", "capture_server", "--incident-only") == \
            asked[-1][:7], asked
        # nothing restarted behind the incident's back: the recovery (on the node) does that, once per incident
        kept = ctx.node.live_record(server_pid)
        assert kept is not None and kept.pid == frozen.pid
        assert ctx.node.live_record(str(ctx.layout.pid_file(generate.worker_role(0)))) is None
        assert not (ctx.layout.generate_shard_dir(0) / generate.SERVER_STALL).exists()
    finally:
        try:
            os.kill(frozen.pid, signal.SIGCONT)
        except (ProcessLookupError, NameError):
            pass
        _stop_all(ctx)
