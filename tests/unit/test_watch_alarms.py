"""Which sentinel alarms the node still reports: raised ones whose own sentinel runs (not a later try's)."""
import json
import os
import sys
from pathlib import Path

from eagleflow.health.node_activity import _watch_alarms
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from eagleflow.watchdog.sentinel import alarm_path, sentinel_role
from eagleflow.watchdog.signals import WatchedJob
from tests.fixtures.watchdog_jobs import kill_group, watch_config


def test_a_raised_alarm_holds_only_while_the_sentinel_that_raised_it_runs(tmp_path):
    cfg = watch_config(tmp_path)
    layout = RunLayout.for_run(cfg, "r1")
    job = WatchedJob(shard=0, num_shards=4)
    sentinel = LocalNode(name="test-node").spawn_detached(
        [sys.executable, "-c", "import time; time.sleep(60)"], role=sentinel_role(job),
        pid_file=str(layout.pid_file(sentinel_role(job))), log_file=str(layout.log_file(sentinel_role(job))))
    try:
        path = Path(alarm_path(layout, job))
        os.makedirs(path.parent, exist_ok=True)
        alarm = {"state": "raised", "run_id": "r1", "role": job.role, "job": job.name, "sentinel_pid": sentinel.pid}
        path.write_text(json.dumps(alarm))
        state_dir = Path(cfg.node.state_dir)
        assert [a["job"] for a in _watch_alarms(state_dir)] == ["shard 0/4"]
        # raised by an earlier try's sentinel (killed while raised); this one found looks and never wrote it
        path.write_text(json.dumps({**alarm, "sentinel_pid": sentinel.pid + 100000}))
        assert _watch_alarms(state_dir) == []
        path.write_text(json.dumps({**alarm, "state": "cleared"}))
        assert _watch_alarms(state_dir) == []
    finally:
        kill_group(sentinel.pgid)
