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
    for trig in (ServerReadyTrigger(run=run, end_at=1.8e9, deferred_at=1.7e9),
                 GpuIdleTrigger(run=run, end_at=1.8e9, deferred_at=1.7e9),
                 ShardWatchTrigger(run=run, shard=2), TrainWatchTrigger(run=run)):
        _, kwargs = trig.serialize()
        assert kwargs["run"] == run
        # the watch's own counter (recoveries_left) is state, not config; phase names the shard's kind
        # ... deferred_at: when a gate deferred (its event held a moment: defer_settle)
        assert set(kwargs) <= {"run", "shard", "end_at", "poll_interval_s", "recoveries_left", "phase",
                               "deferred_at"}, kwargs
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


# What a deployment of this build stores for a watch (RunContext.serialize): the hints and the control-plane
# settings under the config fields' own names, plain values only.
STORED = {"conn_id": "gpu_node", "run_config": "/data/runs/r1/run-config.json", "run_id": "r1",
          "control": {"node.python": "/opt/venv/bin/python", "watchdog.alert_emails": ["ops@example.com"],
                      "watchdog.smtp_conn_id": "smtp_default", "watchdog.airflow_base_url": "http://af:8080"},
          "watch": {"node.name": "gpu-a", "capture.shards": 8, "generate.shards": 3,
                    "watchdog.stall_after_s": 15.0, "watchdog.poll_interval_s": 20.0}}


def test_a_stored_payload_is_read_into_typed_models_and_written_back_the_same():
    from eagleflow.airflow.runtime import ControlPlane, RunRef, WatchHints
    from eagleflow.airflow.shard_watch import ShardWatchTrigger, TrainWatchTrigger
    from eagleflow.phases import GENERATE
    ref = RunRef.from_dict(STORED)
    assert isinstance(ref.control, ControlPlane) and isinstance(ref.watch, WatchHints)
    assert ref.watch.node_name == "gpu-a" and ref.watch.capture_shards == 8 and ref.watch.stall_after_s == 15.0
    assert ref.control.alert_emails == ["ops@example.com"] and ref.control.python == "/opt/venv/bin/python"
    assert ref.to_dict() == STORED and json.loads(json.dumps(ref.to_dict())) == STORED
    for trig in (ShardWatchTrigger(run=STORED, shard=2), TrainWatchTrigger(run=STORED)):
        assert trig.serialize()[1]["run"] == STORED
    # the job's name before the run's config is read: the count is the hint of the shard's own phase
    assert ShardWatchTrigger(run=STORED, shard=2)._job_name() == "shard 2/8"
    assert ShardWatchTrigger(run=STORED, shard=1, phase=GENERATE)._job_name() == "generate shard 1/3"
    assert ShardWatchTrigger(run=STORED, shard=2)._early_bound_s() == 15.0 + 2 * 20.0


def test_a_payload_from_before_hints_or_with_some_of_them_reads_as_unknown():
    from eagleflow.airflow.runtime import RunRef
    from eagleflow.airflow.shard_watch import EARLY_UNREACHABLE_S, ShardWatchTrigger
    bare = {k: STORED[k] for k in ("conn_id", "run_config", "run_id")}
    ref = RunRef.from_dict(bare)
    assert ref.control is None and ref.watch is None and ref.hints.node_name is None
    assert ShardWatchTrigger(run=bare, shard=2)._job_name() == "shard 2"
    assert ShardWatchTrigger(run=bare, shard=2)._early_bound_s() == EARLY_UNREACHABLE_S
    # some hints, and a key this build does not know: the known ones read, written back as given
    partial = {**bare, "watch": {"node.name": "gpu-a", "capture.shards": 4, "somebody.else": 1},
               "control": {"watchdog.alert_emails": []}}
    again = RunRef.from_dict(partial)
    assert again.watch is not None and again.watch.generate_shards is None and again.hints.capture_shards == 4
    assert again.to_dict() == {**bare, "watch": {"node.name": "gpu-a", "capture.shards": 4},
                               "control": {"watchdog.alert_emails": []}}


@pytest.mark.parametrize("part,bad", [("watch", {"capture.shards": "many"}),
                                      ("control", {"watchdog.alert_emails": "ops@example.com, x@evil.example"})])
def test_a_hint_or_setting_that_does_not_fit_is_refused_naming_it(part, bad):
    from eagleflow.airflow.runtime import RunRef
    from eagleflow.config import ConfigError
    with pytest.raises(ConfigError) as e:
        RunRef.from_dict({**STORED, part: bad})
    assert f"payload's {part!r}" in str(e.value) and next(iter(bad)) in str(e.value)
    assert "clear the task so it defers anew" in str(e.value)


def test_the_payload_control_plane_is_laid_over_the_node_copy_by_attribute():
    from eagleflow.airflow.runtime import RunContext, RunRef, WatchHints
    from eagleflow.config import load_config
    node_copy = load_config(data={"target_model": "/m", "run_root": "/runs",
                                  "watchdog": {"alert_emails": ["node@edited.example"]},
                                  "capture": {"shards": 2}})
    ctx = RunContext.from_frozen_text(RunRef.from_dict(STORED), json.dumps(node_copy.model_dump(mode="json")), "n")
    assert ctx.cfg.watchdog.alert_emails == ["ops@example.com"] and ctx.cfg.node.python == "/opt/venv/bin/python"
    assert ctx.cfg.watchdog.airflow_base_url == "http://af:8080" and ctx.cfg.node.conn_id == "gpu_node"
    assert ctx.cfg.capture.shards == 2     # hints are never laid over the run's config
    assert WatchHints.of(ctx.cfg).to_dict()["capture.shards"] == 2
