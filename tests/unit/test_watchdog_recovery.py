"""Recovery's GPU wait through eagleflow.gpu's real smi probe (a fake nvidia-smi on PATH)."""
from __future__ import annotations

import sys

import pytest

from eagleflow.local_run import LocalRun
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


def test_one_recovery_budget_and_one_node_call_for_every_cause(tmp_path, monkeypatch):
    """A retry's recovery and a watch's (per cause) are one node command under one budget from the config."""
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.watchdog.recovery import (RECOVERY_COMMAND_SLACK_S, RecoveryResult, recover_after_stall,
                                             recover_before_retry, recovery_budget_s)
    cfg = watch_config(tmp_path)
    budget = recovery_budget_s(cfg)
    # the lock wait for another shard's restart, then this one's: GPUs freed, the model loaded, 120 s
    assert budget == 2 * (cfg.server.ready_timeout_s + cfg.gpu.idle_timeout_s + 120)
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "r"))
    calls = []

    def run_json(argv, model, timeout, answer_codes, log):
        calls.append((list(argv), timeout, answer_codes))
        return model(ok=True, action="none", summary="nothing to restart")
    monkeypatch.setattr(ctx.node, "run_json", run_json)
    assert recover_before_retry(ctx, 1, print)["summary"] == "nothing to restart"
    recover_after_stall(ctx, 1, {"cause": "worker", "incident": {"incident": "i-1"},
                                 "diagnosis": "STALLED shard 1/2\nGPU table"}, print)
    (retry, t1, codes1), (stall, t2, codes2) = calls
    assert t1 == t2 == budget + RECOVERY_COMMAND_SLACK_S and codes1 == codes2 == (0, 1)
    retry, stall = retry[retry.index("recover"):], stall[stall.index("recover"):]
    assert retry[:4] == ["recover", "--shard", "1", "--json"] and "--cause" not in retry
    assert stall[:10] == ["recover", "--shard", "1", "--json", "--cause", "worker", "--incident", "i-1",
                          "--summary", "STALLED shard 1/2"]

    def refused(argv, model, timeout, answer_codes, log):
        return model(ok=False, action="failed", summary="recovery for shard 1 failed: GPUs not idle")
    monkeypatch.setattr(ctx.node, "run_json", refused)
    with pytest.raises(RuntimeError, match="GPUs not idle"):
        recover_after_stall(ctx, 1, {"cause": "capture_server", "incident": {"incident": "i-2"}}, print)
    assert RecoveryResult(ok=True, action="none", summary="s", extra=1).model_dump()["extra"] == 1
