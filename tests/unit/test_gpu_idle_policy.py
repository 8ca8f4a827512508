"""IdlePolicy: memory at baseline + margin and no compute process; utilisation is not a test."""
from __future__ import annotations

import json

import pytest

from eagleflow.gpu.idle_policy import IdlePolicy, SelectionError, baseline_document, parse_baselines, select_gpus
from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot


def snap(index, used, procs=(), util=0, uuid=None):
    return GpuSnapshot(index=index, uuid=uuid or f"GPU-{index}", name="NVIDIA H200", memory_used_mib=used,
                       memory_total_mib=143771, utilization_pct=util, processes=tuple(procs), source="smi")


def test_default_threshold_16_mib():
    pol = IdlePolicy()
    assert pol.judge(snap(0, 0)).idle and pol.judge(snap(0, 16)).idle
    v = pol.judge(snap(0, 17))
    assert not v.idle and "17 MiB used > 16 MiB" in v.reasons[0]


def test_a_process_makes_it_busy_even_at_low_memory_and_util_is_ignored():
    pol = IdlePolicy()
    v = pol.judge(snap(0, 3, [GpuProcess(4242, "python3", 2, user="bob")]))
    assert not v.idle and "1 compute process" in v.reasons[0]
    assert pol.judge(snap(1, 1, util=100)).idle  # a hung kernel reads 100 %; memory+processes decide


def test_per_uuid_baseline_from_file():
    doc = baseline_document([snap(0, 3), snap(1, 250, uuid="GPU-display")], "n1")
    pol = IdlePolicy(16, parse_baselines(json.dumps(doc)))
    assert pol.judge(snap(1, 260, uuid="GPU-display")).idle          # Xorg's 250 MiB is its baseline
    assert not pol.judge(snap(1, 270, uuid="GPU-display")).idle
    assert pol.judge(snap(0, 19)).idle and not pol.judge(snap(0, 20)).idle
    assert pol.allowed_mib("GPU-unknown") == 16


def test_baseline_refuses_while_processes_run():
    with pytest.raises(ValueError, match="free the GPUs first"):
        baseline_document([snap(0, 900, [GpuProcess(7, "x", 900)])], "n1")
    with pytest.raises(ValueError, match="record it again"):
        parse_baselines("{\"nope\": 1}", where="f.json")


def test_unknown_memory_decided_by_processes():
    pol = IdlePolicy()
    assert pol.judge(snap(0, None)).idle
    assert not pol.judge(snap(0, None, [GpuProcess(1, "x", None)])).idle


def test_report_message_lists_each_busy_gpu_and_process():
    pol = IdlePolicy()
    rep = pol.evaluate([snap(0, 1), snap(3, 90000, [GpuProcess(4242, "python3 -m sglang", 89990, user="alice",
                                                                state="D", wchan="nv_wait")])], [], "gpu-node-1")
    assert not rep.all_idle
    msg = rep.message()
    assert "1 of 2" in msg and "GPU 3 (GPU-3): 90000 MiB used" in msg
    assert "pid 4242 (alice, `python3 -m sglang`, 89990 MiB, state D in nv_wait)" in msg
    assert "GPU 0" not in msg


def test_select_by_uuid_or_index_and_unknown_is_an_error():
    snaps = [snap(0, 1), snap(1, 1), snap(2, 1)]
    assert [s.index for s in select_gpus(snaps, ["GPU-2", "0"])] == [2, 0]
    with pytest.raises(SelectionError, match="gpu.select names 'GPU-9'"):
        select_gpus(snaps, ["GPU-9"], "n1")
