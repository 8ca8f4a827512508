"""GpuIdleSensor and GpuIdleTrigger on a FakeNode: idle, held by a foreign process, unreachable; in milliseconds.

The sensor's real code reads the run's frozen config from XCom, opens the node (the fake, through
``node_from_config``), runs the real GPU probe's command (``eagleflow.gpu.node_report``) and judges the
answer with the real idle policy; only the node's answer is made up.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from eagleflow.airflow.gpu_operators import GpuGateError, GpuIdleSensor, GpusNotIdle
from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
from eagleflow.airflow.runtime import RunContext
from eagleflow.config import load_config
from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot
from eagleflow.layout import RunLayout
from eagleflow.nodes import NodeUnreachable
from eagleflow.airflow import defer_settle
from tests.fixtures.fake_node import FakeFleet, FakeNode, task_context

RUN_ID = "manual__2026-12-04T10:00:00+00:00"


def _gpu(index: int, used: int, *processes: GpuProcess) -> GpuSnapshot:
    return GpuSnapshot(index=index, uuid=f"GPU-{index:08d}-aaaa-bbbb-cccc-000000000000", name="NVIDIA H200",
                       memory_used_mib=used, memory_total_mib=143_771, utilization_pct=0, processes=processes,
                       source="nvml")


IDLE = [_gpu(0, 1), _gpu(1, 1)]
FOREIGN = GpuProcess(pid=31337, name="python train_other.py", used_mib=92_262, user="mallory", state="S")
HELD = [_gpu(0, 1), _gpu(1, 92_270, FOREIGN)]


@pytest.fixture
def gate(monkeypatch, request):
    probe = getattr(request, "param", "nvml")
    cfg = load_config(data={"target_model": "/models/t", "run_root": "/data/runs",
                            "node": {"name": "gpu-node-1", "has_gpu": True, "conn_id": "gpu_node"},
                            "gpu": {"probe": probe, "idle_timeout_s": 600}})
    node = FakeNode("gpu-node-1", conn_id="gpu_node")
    FakeFleet().install(monkeypatch).add(node)
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID), _node=node)
    ctx.write_run_config()   # as write_run_config does: the trigger reads it on the node
    # one look before deferring, no hold after (the settle window has its own tests below)
    monkeypatch.setattr(defer_settle, "DEFER_SETTLE_S", 0.0)
    return ctx, node


def _sensor(**kw) -> GpuIdleSensor:
    return GpuIdleSensor(task_id="gpus_idle", deferrable=False, **kw)


@pytest.mark.parametrize("gate", ["nvml", "smi"], indirect=True)
def test_idle_gpus_pass_the_poke_through_either_probe(gate):
    ctx, node = gate
    node.gpus = IDLE
    sensor = _sensor()
    assert sensor.poke(task_context(ctx, sensor)) is True
    probe = [c for c in node.calls if c.key == ("eagleflow.gpu.node_report",)]
    assert len(probe) == 1 and probe[0].argv[:3] == (node.python, "-m", "eagleflow.gpu.node_report")
    assert probe[0].option("--probe") == ctx.cfg.gpu.probe


@pytest.mark.parametrize("gate", ["nvml", "smi"], indirect=True)
def test_a_foreign_process_keeps_the_gate_closed_then_fails_it_naming_pid_user_command_memory(gate):
    ctx, node = gate
    node.gpus = HELD
    sensor = _sensor()
    context = task_context(ctx, sensor)
    assert sensor.poke(context) is False                    # before the deadline: wait on
    sensor.gate_timeout_s = 0.0                             # the deadline passed
    with pytest.raises(GpusNotIdle) as e:
        sensor.poke(context)
    msg = str(e.value)
    assert "node gpu-node-1: 1 of 2 selected GPU(s) not idle" in msg
    assert "GPU 1 (GPU-00000001" in msg and "92270 MiB used > 16 MiB" in msg
    assert "pid 31337 (mallory, `python train_other.py`, 92262 MiB, state S)" in msg
    assert "GPU 0 " not in msg                              # the idle one is not blamed


def test_the_poke_holds_one_node_across_pokes_and_gives_it_back_when_rescheduled(gate):
    ctx, node = gate
    node.gpus = HELD
    sensor = _sensor()
    context = task_context(ctx, sensor)
    for _ in range(3):
        assert sensor.poke(context) is False
    assert len(node.commands("eagleflow.gpu.node_report")) == 3 and node.closes == 0
    node.gpus = IDLE
    assert sensor.poke(context) is True


def test_an_unreachable_node_is_a_retryable_gate_error_naming_the_node(gate):
    ctx, node = gate
    node.go_down("[Errno 113] No route to host")
    sensor = _sensor()
    with pytest.raises(GpuGateError) as e:        # not AirflowFailException: the task's retries retry it
        sensor.poke(task_context(ctx, sensor))
    assert "node gpu-node-1: SSH to gpu_node failed: [Errno 113] No route to host" in str(e.value)
    assert not isinstance(e.value, AirflowFailException)


def test_a_node_without_a_driver_fails_the_task_at_once(gate):
    ctx, node = gate
    node.gpus = None                           # NVML does not load: a CPU node configured as a GPU node
    sensor = _sensor()
    with pytest.raises(AirflowFailException) as e:
        sensor.poke(task_context(ctx, sensor))
    assert "NVML cannot be loaded" in str(e.value) and "node.has_gpu: true" in str(e.value)


def test_execute_passes_idle_gpus_without_deferring_and_defers_held_ones_with_the_deadline(gate):
    ctx, node = gate
    node.gpus = IDLE
    sensor = GpuIdleSensor(task_id="gpus_idle", deferrable=True, gate_timeout_s=120)
    assert sensor.execute(task_context(ctx, sensor)) is None
    node.gpus = HELD
    before = time.time()
    with pytest.raises(TaskDeferred) as d:
        sensor.execute(task_context(ctx, sensor))
    trigger = d.value.trigger
    assert isinstance(trigger, GpuIdleTrigger)
    assert trigger.run_ref.run_config == ctx.run_config_path and trigger.run_ref.conn_id == "gpu_node"
    assert before + 120 <= trigger.end_at <= time.time() + 120
    assert d.value.timeout.total_seconds() == 120 + 300


def _first_event(trigger) -> dict:
    async def first():
        async for ev in trigger.run():
            return ev.payload
    return asyncio.run(first())


def test_the_trigger_yields_idle_once_the_foreign_process_is_gone(gate):
    ctx, node = gate
    seen = []

    def report(call):      # held twice, then the process has ended
        seen.append(call)
        return {"probe": "nvml", "gpus": [s.to_dict() for s in (HELD if len(seen) <= 2 else IDLE)]}
    node.on("eagleflow.gpu.node_report", report)
    ev = _first_event(GpuIdleTrigger(run=ctx.serialize(), end_at=time.time() + 30, poll_interval_s=0.001))
    assert ev == {"status": "idle", "message": "node gpu-node-1: all 2 selected GPU(s) idle"}
    assert len(seen) == 3


def test_the_trigger_says_not_idle_at_its_deadline_with_the_holder(gate):
    ctx, node = gate
    node.gpus = HELD
    ev = _first_event(GpuIdleTrigger(run=ctx.serialize(), end_at=time.time() + 0.01, poll_interval_s=0.05))
    assert ev["status"] == "not_idle" and "pid 31337 (mallory" in ev["message"]
    with pytest.raises(GpusNotIdle, match="pid 31337"):
        _sensor().execute_complete({}, ev)


def test_the_trigger_gives_up_on_a_node_that_stays_unreachable_and_the_sensor_retries(gate):
    ctx, node = gate
    node.gpus = IDLE
    down = NodeUnreachable("node gpu-node-1: SSH to gpu_node failed: timed out")
    node.on("eagleflow.gpu.node_report", *[down] * 5)
    trigger = GpuIdleTrigger(run=ctx.serialize(), end_at=time.time() + 30, poll_interval_s=0.0001)
    ev = _first_event(trigger)
    assert ev["status"] == "error"
    assert ev["message"] == ("GPU reading failed 5 time(s) in a row; last: node gpu-node-1: SSH to gpu_node "
                             "failed: timed out")
    with pytest.raises(GpuGateError, match="failed 5 time"):
        _sensor().execute_complete({}, ev)


def test_a_gate_that_guards_nothing_this_run_passes_without_asking_the_node(gate):
    ctx, node = gate
    node.gpus = HELD                                        # it would fail if it looked
    takeover = GpuIdleSensor(task_id="gpus_idle_before_takeover", guards="take_over_shards", deferrable=True)
    assert takeover.execute(task_context(ctx, takeover, xcoms={("take_over_shards", "return_value"): []})) is None
    generation = GpuIdleSensor(task_id="gpus_idle_before_generation", phase="generate", deferrable=True)
    assert not ctx.cfg.generate.enabled
    assert generation.execute(task_context(ctx, generation)) is None
    assert node.commands("eagleflow.gpu.node_report") == []
    # a takeover with shards to take does look, and waits for the holder
    with pytest.raises(TaskDeferred):
        takeover.execute(task_context(ctx, takeover, xcoms={("take_over_shards", "return_value"): [{"shard": 2}]}))
    assert len(node.commands("eagleflow.gpu.node_report")) == 1


def test_a_gate_looks_for_the_settle_window_before_deferring_and_its_trigger_holds_an_early_event(gate, monkeypatch):
    """defer_settle (apache/airflow#72716): GPUs freed within the window pass without a deferral; a deferral says
    when, and its trigger's event waits until the window after it, while a trigger not from a deferral does not."""
    ctx, node = gate
    monkeypatch.setattr(defer_settle, "DEFER_SETTLE_S", 0.6)
    seen: list = []

    def report(call):      # held at the first look, idle from the second
        seen.append(call)
        return {"probe": "nvml", "gpus": [s.to_dict() for s in (HELD if len(seen) == 1 else IDLE)]}
    node.on("eagleflow.gpu.node_report", report)
    sensor = GpuIdleSensor(task_id="gpus_idle", deferrable=True, gate_timeout_s=120, poke_interval=0.1)
    assert sensor.execute(task_context(ctx, sensor)) is None and len(seen) == 2      # no deferral
    node.on("eagleflow.gpu.node_report", lambda call: {"probe": "nvml", "gpus": [s.to_dict() for s in HELD]})
    t0 = time.time()
    with pytest.raises(TaskDeferred) as d:
        sensor.execute(task_context(ctx, sensor))
    assert 0.5 <= time.time() - t0 < 5               # it looked for the window first
    trigger = d.value.trigger
    assert t0 + 0.5 <= trigger.deferred_at <= time.time()
    assert GpuIdleTrigger(**trigger.serialize()[1]).deferred_at == trigger.deferred_at   # as the triggerer rebuilds it
    node.on("eagleflow.gpu.node_report", lambda call: {"probe": "nvml", "gpus": [s.to_dict() for s in IDLE]})
    t1 = time.time()
    assert _first_event(trigger)["status"] == "idle"
    assert time.time() >= trigger.deferred_at + 0.6 and time.time() - t1 >= 0.3      # held to the window
    t2 = time.time()
    assert _first_event(GpuIdleTrigger(run=ctx.serialize(), end_at=time.time() + 30))["status"] == "idle"
    assert time.time() - t2 < 0.5                    # not from a deferral: not held

