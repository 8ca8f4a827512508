"""Recovery before a retry: a frozen capture server is restarted exactly once even when two shards ask at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.airflow.runtime import RunContext
from eagleflow.phases.extract.lifecycle import (server_info, start_capture_server, stop_capture_server,
                                         wait_capture_server_ready)
from eagleflow.local_run import LocalRun
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes.proc import read_proc_state
from eagleflow.phase_jobs import server_healthy
from eagleflow.watchdog.recovery import read_restarts, recover_before_retry
from tests.fixtures.capture_corpus import write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_two_shards_recover_one_frozen_server_with_one_restart(demo_assets, tmp_path):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2)
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, "rec")
    ctx = RunContext(cfg=cfg, layout=layout)
    ctx.write_run_config()
    run = LocalRun(cfg=cfg, layout=layout, config_path=ctx.run_config_path)
    pid_file = str(layout.pid_file("capture_server"))
    try:
        start_capture_server(run)
        wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
        assert recover_before_retry(ctx, 0, print)["action"] == "none"  # healthy: nothing to do
        old = run.node.process_status(pid_file).record
        os.kill(old.pid, signal.SIGSTOP)  # frozen: alive, not answering

        procs = [subprocess.Popen(ctx.eagleflow_argv("recover", "--shard", str(s), "--json"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in (0, 1)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        actions = sorted(r["action"] for r in results)
        assert actions == ["none", "restarted"], results
        incidents = read_restarts(run)
        assert len(incidents) == 1 and incidents[0]["old_pid"] == old.pid
        new = run.node.process_status(pid_file).record
        assert new.pid == incidents[0]["new_pid"] != old.pid
        st = read_proc_state(old.pid)
        assert st is None or st.state == "Z"  # the frozen server is gone
        assert server_healthy(server_info(run)["url"], 10)
        restarted = next(r for r in results if r["action"] == "restarted")
        # a stopped server is provably stuck: restarted without waiting for a health timeout first
        assert "is stopped (state T: SIGSTOP'd)" in restarted["summary"], restarted
    finally:
        rec = run.node.process_status(pid_file).record
        if rec:
            try:
                os.killpg(rec.pgid, signal.SIGCONT)
            except OSError:
                pass
        stop_capture_server(run, grace_s=3)
