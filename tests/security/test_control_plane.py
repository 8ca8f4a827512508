"""Issue 26, break 6 (the control plane's part): what the node's copy of a run's config may not decide.

A node (or anyone who can write in its run directory) can edit run-config.json. The control plane reads
that file in its triggers, but what it executes, whom it mails, through which SMTP connection and which
links it sends stay the frozen config's (the payload the task gave its trigger). And no config may make
``/``, a home folder or a folder above the runs the root that deletions are confined to.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.pipeline_config import write_short_config

pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.slow
def test_a_node_edited_run_config_does_not_choose_what_the_trigger_runs_or_mails(tmp_path, demo_assets):
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.airflow.shard_watch import ShardWatchTrigger

    ctx = RunContext.from_params({"config_path": str(write_short_config(tmp_path, demo_assets,
                                                                        watchdog={"alert_emails": ["ops@example.test"]}))},
                                 "edited")
    ctx.write_run_config()                           # what write_run_config leaves on the node
    payload = ctx.serialize()                         # what the task hands its trigger (from the frozen XCom)
    marker = tmp_path / "ran-the-nodes-python"
    evil = tmp_path / "evil-python"
    evil.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    evil.chmod(0o755)
    on_node = Path(ctx.run_config_path)
    data = json.loads(on_node.read_text())
    data["node"]["python"] = str(evil)
    data["watchdog"].update(alert_emails=["attacker@example.test"], smtp_conn_id="someone_elses_smtp",
                            airflow_base_url="http://phish.example.test")
    on_node.write_text(json.dumps(data))             # the node rewrites its copy mid-run

    trig = ShardWatchTrigger(run=json.loads(json.dumps(payload)), shard=0)   # as the triggerer rebuilds it
    seen = asyncio.run(trig._read_context())
    assert seen.cfg.node.python == ctx.cfg.node.python and seen.node.python != str(evil)
    assert seen.cfg.watchdog.alert_emails == ["ops@example.test"]
    assert seen.cfg.watchdog.smtp_conn_id == ctx.cfg.watchdog.smtp_conn_id != "someone_elses_smtp"
    assert seen.cfg.watchdog.airflow_base_url == ctx.cfg.watchdog.airflow_base_url

    async def first_look():   # the trigger's first poll runs `<node.python> -m eagleflow.cli watch ...` here
        async for ev in trig.run():
            return ev.payload
    try:
        asyncio.run(asyncio.wait_for(first_look(), 60))
    except asyncio.TimeoutError:
        pass
    assert not marker.exists(), "the trigger executed the python the node's run-config.json named"


def test_the_payload_carries_the_frozen_control_plane_settings(tmp_path, demo_assets):
    from eagleflow.airflow.runtime import CONTROL_PLANE_FIELDS, RunContext, RunRef
    ctx = RunContext.from_params({"config_path": str(write_short_config(tmp_path, demo_assets))}, "r")
    ref = RunRef.from_dict(ctx.serialize())
    assert ref.control is not None and set(ref.control.to_dict()) == set(CONTROL_PLANE_FIELDS)
    assert ref.control.python == ctx.cfg.node.python
    # anything else a payload might claim is not taken from it
    forged = {**ctx.serialize(), "control": {"node.python": "/bin/true", "server.dump_dir": "/"},
              "watch": {"capture.shards": 2, "node.python": "/bin/true"}}
    control, watch = RunRef.from_dict(forged).control, RunRef.from_dict(forged).watch
    assert control is not None and control.to_dict() == {"node.python": "/bin/true"}
    assert watch is not None and watch.to_dict() == {"capture.shards": 2}     # hints are only hints


@pytest.mark.parametrize("cache_root,why", [("/", "file system's root"), ("~", "home folder"),
                                            ("{home_parent}", "holds the home folder"),
                                            ("{above_runs}", "lies above run_root")])
def test_a_deletion_root_that_is_slash_a_home_or_above_the_runs_is_refused(cache_root, why, tmp_path):
    from eagleflow.config import ConfigError, load_config
    run_root = tmp_path / "data" / "runs"
    import pwd
    deep = sorted(Path(e.pw_dir) for e in pwd.getpwall() if len(Path(e.pw_dir).parts) > 2)   # e.g. /home/alice
    if "{home_parent}" in cache_root and not deep:
        pytest.skip("no user on this machine has a home folder below a folder of its own")
    cache_root = cache_root.format(home_parent=str(deep[0].parent) if deep else "", above_runs=str(tmp_path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"target_model": "/m", "run_root": str(run_root),
                                   "disk": {"cache_root": cache_root, "old_caches": []}}))
    with pytest.raises(ConfigError, match=why) as e:
        load_config(cfg)
    assert "disk.cache_root" in str(e.value) and str(cfg) in str(e.value)
    # the same on the node, where `eagleflow corpus delete-caches` loads the frozen JSON: nothing is deleted
    keep = run_root / "old" / "blob"
    keep.parent.mkdir(parents=True)
    keep.write_bytes(b"1")
    frozen = tmp_path / "run-config.json"
    frozen.write_text(json.dumps({"target_model": "/m", "run_root": str(run_root), "disk": {
        "cache_root": cache_root, "old_caches": [str(keep.parent)], "delete_old_caches": True}}))
    res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "corpus", "delete-caches", "--config", str(frozen),
                          "--run-id", "r"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "disk.cache_root" in res.stderr and why in res.stderr, \
        (res.returncode, res.stderr[-2000:])
    assert keep.exists()


def test_a_cache_root_beside_or_at_the_runs_is_still_fine(tmp_path):
    from eagleflow.config import load_config
    for root in (tmp_path / "data" / "caches", tmp_path / "data" / "runs"):
        cfg = load_config(data={"target_model": "/m", "run_root": str(tmp_path / "data" / "runs"),
                                "disk": {"cache_root": str(root)}})
        assert cfg.disk.cache_root == str(root)
