"""A streaming trainer beside the capture server (issue 53): the config refuses a trainer on the server's GPUs,
and the trainer_gpus_idle gate judges the trainer's GPUs only, read through the real smi probe from the fake
nvidia-smi (tests/fixtures/fake_nvidia_smi.py) on this machine.

The server's GPUs are server.tp of the run's GPU list from sglang's --base-gpu-id (server.extra_server_args);
the trainer's the first train.nproc_per_node (LOCAL_RANK); the list is gpu.select, or every GPU by index.
"""
from __future__ import annotations

import sys

import pytest

from eagleflow.airflow.gpu_operators import GpuIdleSensor, GpusNotIdle
from eagleflow.airflow.runtime import RunContext
from eagleflow.config import ConfigError, load_config, server_flag_int
from eagleflow.layout import RunLayout
from eagleflow.nodes.local import LocalNode
from tests.fixtures.fake_node import capture_log, task_context
from tests.fixtures.gpu_scenarios import fake_smi_env, gpu, proc, write_scenario

RUN_ID = "manual__2026-12-06T12:00:00+00:00"


def _data(tmp_path, *, storage="mooncake", has_gpu=True, **sections) -> dict:
    data = {"target_model": "/models/t", "run_root": str(tmp_path / "runs"),
            "node": {"name": "gpu-node-1", "has_gpu": has_gpu},
            "capture": {"backend": "sglang" if has_gpu else "hf"}, "stream": {"storage": storage},
            "gpu": {"probe": "smi", "idle_timeout_s": 600, "poll_interval_s": 0.1}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return data


BESIDE = {"server": {"tp": 2, "extra_server_args": ["--base-gpu-id", "1"]}}   # server on 1-2, trainer on 0


# ---- the config check ----

def test_a_streaming_trainer_on_the_servers_gpu_is_refused_naming_both_fields_their_values_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(data=_data(tmp_path, server={"tp": 2}))
    msg = str(e.value)
    assert "stream.storage 'mooncake' trains while the capture server still holds its GPUs" in msg
    assert "capture server's GPU(s) [0, 1] (capture.backend 'sglang', server.tp = 2, --base-gpu-id in " \
           "server.extra_server_args: unset, 0)" in msg
    assert "the trainer's [0] (train.device 'auto', train.nproc_per_node = 1)" in msg
    assert "share position(s) [0] (GPU(s) 0)" in msg
    assert "['--base-gpu-id', '1']" in msg and "train.device cpu" in msg and "stream.storage disk" in msg


def test_an_hf_server_on_cuda_counts_too_and_names_server_device(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(data=_data(tmp_path, capture={"backend": "hf"}, server={"device": "cuda"}))
    assert "(capture.backend 'hf', server.device 'cuda')" in str(e.value)


@pytest.mark.parametrize("case", [
    {"stream": {"storage": "disk"}},                                  # offline: the server's GPUs freed first
    {"train": {"device": "cpu"}},                                     # the trainer takes no GPU
    {"capture": {"backend": "hf"}},                                   # hf on the CPU (server.device cpu)
    BESIDE,                                                           # disjoint: server 1-2, trainer 0
    {"server": {"extra_server_args": ["--base-gpu-id=1"]}},
])
def test_configs_whose_trainer_and_server_do_not_share_a_gpu_load(tmp_path, case):
    load_config(data=_data(tmp_path, **case))


def test_a_cpu_node_has_nothing_to_check(tmp_path):
    cfg = load_config(data=_data(tmp_path, has_gpu=False, server={"device": "cuda"}))
    assert cfg.server_gpu_slots() == [] and cfg.train_gpu_slots() == []


def test_gpus_past_the_end_of_gpu_select_are_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(data=_data(tmp_path, gpu={"select": ["GPU-a", "GPU-b"]}, **BESIDE))
    assert "position(s) [2] are past the end of gpu.select" in str(e.value)


def test_the_slots_name_gpus_through_gpu_select_in_its_order(tmp_path):
    cfg = load_config(data=_data(tmp_path, gpu={"select": ["5", "GPU-x", "2"]}, **BESIDE))
    assert cfg.server_gpu_slots() == [1, 2] and cfg.train_gpu_slots() == [0]
    assert cfg.gpu_at(cfg.server_gpu_slots()) == ["GPU-x", "2"] and cfg.gpu_at(cfg.train_gpu_slots()) == ["5"]


def test_server_flag_int_reads_argparse_spellings_last_one_wins():
    assert server_flag_int(["--base-gpu-id", "2"], "base-gpu-id") == 2
    assert server_flag_int(["--base_gpu_id=3", "--gpu-id-step 2"], "base-gpu-id") == 3
    assert server_flag_int(["--gpu-id-step 2"], "gpu-id-step") == 2
    assert server_flag_int(["--base-gpu-id", "1", "--base-gpu-id=4"], "base-gpu-id") == 4
    assert server_flag_int(["--mem-fraction-static", "0.8"], "base-gpu-id") is None


# ---- the gate, through the real smi probe on the fake nvidia-smi ----

SERVER_PROCS = [proc(7001, 1, 70_000, "python3 -m sglang.launch_server"),
                proc(7002, 2, 70_000, "python3 -m sglang.launch_server")]


def _gate(tmp_path, monkeypatch, gpus: list[dict], procs: list[dict], **sections):
    scenario = write_scenario(tmp_path / "smi.json", {"driver": True, "gpus": gpus, "processes": procs})
    for k, v in fake_smi_env(scenario, sys.executable).items():
        monkeypatch.setenv(k, v)
    cfg = load_config(data=_data(tmp_path, **(sections or BESIDE)))
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID), _node=LocalNode())
    sensor = GpuIdleSensor(task_id="trainer_gpus_idle", deferrable=False, gpus="trainer")
    return ctx, sensor, task_context(ctx, sensor)


def test_the_servers_gpus_busy_and_the_trainers_idle_pass(tmp_path, monkeypatch):
    ctx, sensor, context = _gate(tmp_path, monkeypatch, [gpu(0, 1), gpu(1, 70_400), gpu(2, 70_400)], SERVER_PROCS)
    assert sensor.poke(context) is True
    # the run's whole selection (the offline gate's) is not idle: the server holds 1 and 2
    offline = GpuIdleSensor(task_id="gpus_idle_after_capture", deferrable=False)
    assert offline.poke(task_context(ctx, offline)) is False


def test_a_held_trainer_gpu_is_refused_naming_it_and_what_holds_it(tmp_path, monkeypatch):
    other = proc(4242, 0, 9_000, "python3 other_job.py")
    ctx, sensor, context = _gate(tmp_path, monkeypatch, [gpu(0, 9_010), gpu(1, 70_400), gpu(2, 70_400)],
                                 [other, *SERVER_PROCS])
    assert sensor.poke(context) is False                      # before the deadline: wait on
    sensor.gate_timeout_s = 0.0
    with pytest.raises(GpusNotIdle) as e:
        sensor.poke(context)
    msg = str(e.value)
    assert "1 of 1 selected GPU(s) not idle" in msg
    assert "GPU 0 (GPU-00000000" in msg and "pid 4242" in msg and "python3 other_job.py" in msg
    assert "GPU 1 " not in msg and "GPU 2 " not in msg and "7001" not in msg   # the server's are not judged


def test_memory_above_the_baseline_without_a_process_keeps_it_closed(tmp_path, monkeypatch):
    ctx, sensor, context = _gate(tmp_path, monkeypatch, [gpu(0, 600), gpu(1, 70_400), gpu(2, 70_400)], SERVER_PROCS)
    assert sensor.poke(context) is False
    sensor.gate_timeout_s = 0.0
    with pytest.raises(GpusNotIdle, match=r"GPU 0 .*600 MiB used > 16 MiB"):
        sensor.poke(context)


def test_a_cpu_trainer_or_a_cpu_node_passes_without_reading_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", str(tmp_path / "absent.json"))   # a read would fail
    for data in (_data(tmp_path, train={"device": "cpu"}, **BESIDE), _data(tmp_path, has_gpu=False)):
        cfg = load_config(data=data)
        ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID), _node=LocalNode())
        sensor = GpuIdleSensor(task_id="trainer_gpus_idle", deferrable=False, gpus="trainer")
        log = capture_log(sensor)
        context = task_context(ctx, sensor)
        assert sensor.execute(context) is None
        assert any("nothing to check" in line for _, line in log.lines), log.lines


def test_an_unknown_selection_is_refused():
    with pytest.raises(ValueError, match="'run' .* or 'trainer'"):
        GpuIdleSensor(task_id="x", gpus="server")


def test_the_deferred_gate_hands_the_trainers_gpus_to_its_trigger(tmp_path, monkeypatch):
    import asyncio

    from airflow.sdk.exceptions import TaskDeferred

    from eagleflow.airflow import defer_settle
    from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
    monkeypatch.setattr(defer_settle, "DEFER_SETTLE_S", 0.0)   # one look, no hold: test_fake_node_gpu_gate tests those
    other = proc(4242, 0, 9_000, "python3 other_job.py")
    ctx, _, _ = _gate(tmp_path, monkeypatch, [gpu(0, 9_010), gpu(1, 70_400), gpu(2, 70_400)], [other, *SERVER_PROCS])
    ctx.write_run_config()                    # the trigger reads the run's frozen config on the node
    sensor = GpuIdleSensor(task_id="trainer_gpus_idle", deferrable=True, gpus="trainer")
    with pytest.raises(TaskDeferred) as e:
        sensor.execute(task_context(ctx, sensor))
    classpath, kwargs = e.value.trigger.serialize()
    assert kwargs["select"] == ["0"]
    trigger = GpuIdleTrigger(**kwargs)        # as the triggerer rebuilds it
    write_scenario(tmp_path / "smi.json", {"driver": True, "processes": SERVER_PROCS,
                                           "gpus": [gpu(0, 1), gpu(1, 70_400), gpu(2, 70_400)]})

    async def first():
        async for ev in trigger.run():
            return ev.payload
    ev = asyncio.run(first())
    assert ev["status"] == "idle" and "all 1 selected GPU(s) idle" in ev["message"], ev
