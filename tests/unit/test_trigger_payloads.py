"""Trigger payloads are small and stable: a payload stored by the previous release still deserialises.

tests/fixtures/trigger_payloads/v0.1.0.json holds what eagleflow 0.1.0's triggers returned from
serialize() (the whole resolved PipelineConfig inside): a triggerer upgraded mid-run must rebuild
those triggers, and they must then find the run through its frozen run-config.json.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import time
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trigger_payloads" / "v0.1.0.json"


def _load(classpath: str):
    module, name = classpath.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _payloads():
    doc = json.loads(FIXTURE.read_text())
    return [(label, p) for label, items in doc["payloads"].items() for p in items]


@pytest.mark.parametrize("label,payload", _payloads(), ids=lambda v: v if isinstance(v, str) else
                         v["classpath"].rsplit(".", 1)[1])
def test_a_previous_release_payload_deserialises_into_the_small_shape(label, payload):
    from eagleflow.config import safe_run_id
    legacy = payload["kwargs"]
    assert "config" in legacy["run"]  # really the old shape: the whole config
    trig = _load(payload["classpath"])(**legacy)
    classpath, kwargs = trig.serialize()
    assert classpath == payload["classpath"]
    config = legacy["run"]["config"]
    assert kwargs["run"] == {"conn_id": config["node"]["conn_id"], "run_id": legacy["run"]["run_id"],
                             "run_config": f"{config['run_root']}/{safe_run_id(legacy['run']['run_id'])}/run-config.json"}
    assert not any(isinstance(v, dict) for v in kwargs["run"].values())  # no config blob any more
    assert _load(classpath)(**kwargs).serialize() == (classpath, kwargs)  # and the new shape round-trips
    if "timeout_s" in legacy:  # 0.1.0's relative timeout becomes an absolute wall-clock deadline
        assert abs(kwargs["end_at"] - (time.time() + legacy["timeout_s"])) < 5


def test_new_payloads_carry_only_what_finds_the_run(tmp_path):
    from eagleflow.airflow.capture_triggers import CaptureServerReadyTrigger
    from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
    from eagleflow.airflow.shard_watch import ShardWatchTrigger, TrainWatchTrigger
    run = {"conn_id": "gpu_node", "run_config": "/data/runs/r1/run-config.json", "run_id": "r1"}
    for trig in (CaptureServerReadyTrigger(run=run, end_at=1.8e9), GpuIdleTrigger(run=run, end_at=1.8e9),
                 ShardWatchTrigger(run=run, shard=2), TrainWatchTrigger(run=run)):
        _, kwargs = trig.serialize()
        assert kwargs["run"] == run
        # the watch's own counter (recoveries_left) is state, not config; phase names the shard's kind
        assert set(kwargs) <= {"run", "shard", "end_at", "poll_interval_s", "recoveries_left", "phase"}, kwargs
        assert len(json.dumps(kwargs)) < 300


@pytest.mark.timeout(60)
def test_a_previous_release_trigger_runs_against_the_runs_frozen_config(tmp_path, demo_assets):
    """The 0.1.0 CaptureServerReadyTrigger of a run rebuilt after an upgrade: it reads run-config.json on
    the node (not its stale inline config) and reports the server that is not running."""
    from eagleflow.airflow.capture_triggers import CaptureServerReadyTrigger
    from eagleflow.airflow.runtime import RunContext
    from tests.fixtures.pipeline_config import write_short_config

    ctx = RunContext.from_params({"config_path": str(write_short_config(tmp_path, demo_assets))}, "legacy")
    ctx.write_run_config()
    legacy = next(p for label, p in _payloads() if label == "local" and p["classpath"].endswith("ReadyTrigger"))
    kwargs = json.loads(json.dumps(legacy["kwargs"]))
    kwargs["run"]["config"]["run_root"] = ctx.cfg.run_root        # this machine's run instead of the stored one
    kwargs["run"]["config"]["capture"]["no_such_field_any_more"] = 1  # a field a later release dropped
    kwargs["run"]["run_id"] = "legacy"
    trig = CaptureServerReadyTrigger(**kwargs)

    async def first():
        async for ev in trig.run():
            return ev.payload
    ev = asyncio.run(first())
    assert ev["status"] == "dead" and "capture server is not running" in ev["detail"], ev


@pytest.mark.timeout(60)
def test_a_trigger_whose_run_config_is_gone_says_so(tmp_path):
    from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
    trig = GpuIdleTrigger(run={"conn_id": None, "run_config": str(tmp_path / "r" / "run-config.json"),
                               "run_id": "r"}, end_at=time.time() + 30)

    async def first():
        async for ev in trig.run():
            return ev.payload
    ev = asyncio.run(first())
    assert ev["status"] == "error" and "run-config.json not found" in ev["message"]
    assert "write_run_config" in ev["message"]
