"""Trigger payloads are small: what finds the run (connection, run-config.json, run id), an absolute deadline,
the watch's hints and its own state; nothing else.

tests/fixtures/trigger_payloads/v0.1.0.json holds what the pre-release build's triggers returned from
serialize() (the whole resolved PipelineConfig inside): such a payload is refused by name, not rebuilt.
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
def test_a_payload_of_another_build_is_refused_naming_what_it_lacks(label, payload):
    """Payloads of the pre-release build (the whole config inside, relative timeouts) are not rebuilt: the
    package is still at 0.1.0, so there is no release to stay compatible with. A triggerer that finds one
    refuses it naming the missing field and what to do, never a trigger half-built from an old config."""
    from eagleflow.config import ConfigError
    legacy = payload["kwargs"]
    assert "config" in legacy["run"]  # really the old shape: the whole config
    with pytest.raises((ConfigError, TypeError)) as e:
        _load(payload["classpath"])(**legacy)
    if isinstance(e.value, ConfigError):
        assert "lacks 'run_config'" in str(e.value) and "clear the task so it defers anew" in str(e.value)


def test_new_payloads_carry_only_what_finds_the_run(tmp_path):
    from eagleflow.airflow.server_triggers import ServerReadyTrigger
    from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
    from eagleflow.airflow.shard_watch import ShardWatchTrigger, TrainWatchTrigger
    run = {"conn_id": "gpu_node", "run_config": "/data/runs/r1/run-config.json", "run_id": "r1"}
    for trig in (ServerReadyTrigger(run=run, end_at=1.8e9), GpuIdleTrigger(run=run, end_at=1.8e9),
                 ShardWatchTrigger(run=run, shard=2), TrainWatchTrigger(run=run)):
        _, kwargs = trig.serialize()
        assert kwargs["run"] == run
        # the watch's own counter (recoveries_left) is state, not config; phase names the shard's kind
        assert set(kwargs) <= {"run", "shard", "end_at", "poll_interval_s", "recoveries_left", "phase"}, kwargs
        assert len(json.dumps(kwargs)) < 300


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
