"""Recovery's GPU wait through eagleflow.gpu's real smi probe (a fake nvidia-smi on PATH)."""
from __future__ import annotations

import sys

import pytest

from eagleflow.capture.lifecycle import LocalRun
from eagleflow.layout import RunLayout
from eagleflow.watchdog.recovery import _free_and_verify_gpus
from tests.fixtures.gpu_scenarios import fake_smi_env, gpu, write_scenario
from tests.fixtures.watchdog_jobs import watch_config


def _run(tmp_path, monkeypatch, used_mib: int) -> LocalRun:
    cfg = watch_config(tmp_path)
    cfg = cfg.model_copy(update={"node": cfg.node.model_copy(update={"has_gpu": True}),
                                 "gpu": cfg.gpu.model_copy(update={"probe": "smi", "idle_timeout_s": 1.0,
                                                                   "poll_interval_s": 0.2})})
    scenario = write_scenario(tmp_path / "smi.json", {"driver": True, "gpus": [gpu(i, used_mib) for i in range(2)]})
    for k, v in fake_smi_env(scenario, sys.executable).items():
        monkeypatch.setenv(k, v)
    return LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, "r"), config_path=str(tmp_path / "c.json"))


@pytest.mark.timeout(60)
def test_gpus_at_baseline_pass_and_held_gpus_fail_with_the_reason(tmp_path, monkeypatch):
    assert _free_and_verify_gpus(_run(tmp_path, monkeypatch, 1), print) == "idle (GPU 0, GPU 1)"
    with pytest.raises(RuntimeError, match="GPUs not idle 1 s after stopping the capture server"):
        _free_and_verify_gpus(_run(tmp_path, monkeypatch, 90_000), print)
    cpu = watch_config(tmp_path)
    assert _free_and_verify_gpus(LocalRun(cfg=cpu, layout=RunLayout.for_run(cpu, "r"), config_path="x"), print) \
        == "not applicable (node.has_gpu is false)"
