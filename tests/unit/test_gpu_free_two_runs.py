"""Two runs on one node: the GPU gate of one never stops the other's live job (issue 52, item 8).

Real processes started through the node's detach (records in the node's shared state dir), `eagleflow gpu free`
as the control plane runs it (a node command, its answer read through ``Node.run_json``), and the GPU gate
(FreeGpusOperator) against the fake nvidia-smi.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.config import load_config
from eagleflow.gpu.cleanup import CleanupReport, free_recorded_processes
from eagleflow.gpu.snapshot import GpuProcess
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from tests.fixtures.gpu_scenarios import FIXTURES, gpu, proc, write_scenario
from tests.fixtures.processes import alive, kill_recorded

pytestmark = pytest.mark.timeout(120)

SLEEP = "import time; time.sleep(600)"


def _config(tmp_path, *, has_gpu: bool):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target_model": "m", "node": {"name": "box", "has_gpu": has_gpu},
        "gpu": {"probe": "smi", "poll_interval_s": 0.2, "idle_timeout_s": 3, "kill_grace_s": 1.0}}))
    return path


def _spawn(cfg_path, run_id: str, role: str, code: str = SLEEP):
    lay = RunLayout.for_run(load_config(str(cfg_path)), run_id)
    return LocalNode().spawn_detached([sys.executable, "-c", code, role], role=role, pid_file=str(lay.pid_file(role)),
                                      log_file=str(lay.log_file(role)))


def _gpu_free(cfg_path, run_id: str, *extra: str) -> CleanupReport:
    """`eagleflow gpu free` on the node, its answer parsed as FreeGpusOperator parses it."""
    node = LocalNode()
    return node.run_json(node.eagleflow_argv("gpu", "free", "--config", str(cfg_path), "--run-id", run_id,
                                             "--on-node", "--json", *extra), CleanupReport, timeout=120)


@pytest.fixture
def two_runs(tmp_path):
    """Run A trains (a trainer and its sentinel, recorded); run C finished long ago (its job's record is left)."""
    cfg = _config(tmp_path, has_gpu=False)
    trainer = _spawn(cfg, "run_A", "trainer")
    sentinel = _spawn(cfg, "run_A", "sentinel_trainer")
    done = _spawn(cfg, "run_C", "trainer", "pass")
    for _ in range(200):
        if not alive(done.pid):
            break
        time.sleep(0.05)
    state = Path(RunLayout.for_run(load_config(str(cfg)), "x").state_dir)
    try:
        yield cfg, trainer, sentinel, done, state
    finally:
        kill_recorded(state)


def test_gpu_free_of_another_run_leaves_the_live_jobs_and_names_them(two_runs):
    cfg, trainer, sentinel, done, state = two_runs
    report = _gpu_free(cfg, "run_B")
    assert report.run_id == "run_B"
    named = {j.pid: j for j in report.other_runs}
    assert set(named) == {trainer.pid, sentinel.pid}
    job = named[trainer.pid]
    assert (job.run_id, job.role) == ("run_A", "trainer")
    assert job.command == trainer.command and "time.sleep(600)" in job.command
    assert job.record == trainer.pid_file and job.on_selected_gpus is None   # a CPU node: no GPU reading
    assert "run run_A: trainer pid" in job.describe()
    assert alive(trainer.pid) and alive(sentinel.pid), "run B stopped run A's live job"
    assert (state / "pids" / "run_A.trainer.json").exists() and (state / "pids" / "run_A.sentinel_trainer.json").exists()
    # run C is finished on this node (nothing of it runs): its record is cleaned, nothing signalled
    cleaned = [o for o in report.outcomes if o.run_id == "run_C"]
    assert [(o.pid, o.outcome) for o in cleaned] == [(done.pid, "already_gone")]
    assert not (state / "pids" / "run_C.trainer.json").exists()
    assert not [o for o in report.outcomes if o.pid in (trainer.pid, sentinel.pid)]


def test_gpu_free_of_the_same_run_stops_its_jobs(two_runs):
    cfg, trainer, sentinel, _, state = two_runs
    report = _gpu_free(cfg, "run_A")
    assert report.other_runs == []
    assert {o.pid: o.outcome for o in report.outcomes if o.run_id == "run_A"} == {
        trainer.pid: "terminated", sentinel.pid: "terminated"}
    assert not alive(trainer.pid) and not alive(sentinel.pid)
    assert sorted(p.name for p in (state / "pids").glob("*.json")) == []


def test_a_streaming_runs_store_and_its_trainer_beside_the_capture_outlive_its_gpu_gates(tmp_path):
    """Issue 53: the run's Mooncake master and segment holder are stopped by `store stop` only, never by a GPU
    gate; the extraction's gates (--keep-trainer) leave the trainer that trains beside the capture; the rest of
    the run's processes are stopped as before."""
    cfg = _config(tmp_path, has_gpu=False)
    data = yaml.safe_load(cfg.read_text())
    data["stream"] = {"storage": "mooncake"}
    cfg.write_text(yaml.safe_dump(data))
    procs = {role: _spawn(cfg, "run_S", role) for role in
             ("mooncake-master", "mooncake-segment", "trainer", "sentinel_trainer", "capture_server")}
    state = Path(RunLayout.for_run(load_config(str(cfg)), "x").state_dir)
    try:
        report = _gpu_free(cfg, "run_S", "--keep-trainer")
        assert {o.pid: o.outcome for o in report.outcomes} == {procs["capture_server"].pid: "terminated"}
        assert all(alive(procs[r].pid) for r in ("mooncake-master", "mooncake-segment", "trainer",
                                                 "sentinel_trainer"))
        report = _gpu_free(cfg, "run_S")   # a later gate (the evaluation's): a trainer left over is stopped
        assert {o.pid: o.outcome for o in report.outcomes} == {procs["trainer"].pid: "terminated",
                                                               procs["sentinel_trainer"].pid: "terminated"}
        assert alive(procs["mooncake-master"].pid) and alive(procs["mooncake-segment"].pid)
    finally:
        kill_recorded(state)


def test_forced_gpu_free_stops_another_runs_job_on_the_selected_gpus_only(two_runs):
    """The trainer holds a selected GPU: force stops it. The sentinel holds none: left, even with force."""
    cfg, trainer, sentinel, _, state = two_runs
    on_gpu = [GpuProcess(trainer.pid, "python3", 30000, user="alice")]
    lines: list[str] = []
    rep = free_recorded_processes(state, run_id="run_B", grace_s=1.0, gpu_processes=on_gpu, log=lines.append)
    assert alive(trainer.pid) and alive(sentinel.pid)
    assert {j.pid: (j.on_selected_gpus, j.gpu_mib) for j in rep.other_runs} == {
        trainer.pid: (True, 30000), sentinel.pid: (False, None)}
    assert [j.run_id for j in rep.other_runs_in_the_way] == ["run_A"]
    assert any("set gpu.force_free" in ln and str(trainer.pid) in ln for ln in lines)
    assert not rep.left_running, "another run's job is not a foreign process"

    rep = free_recorded_processes(state, run_id="run_B", grace_s=1.0, force=True, gpu_processes=on_gpu,
                                  log=lines.append)
    (forced,) = [o for o in rep.outcomes if o.pid == trainer.pid]
    assert (forced.outcome, forced.run_id, forced.gpu_mib) == ("terminated", "run_A", 30000)
    assert not alive(trainer.pid) and alive(sentinel.pid)
    assert [(j.pid, j.on_selected_gpus) for j in rep.other_runs] == [(sentinel.pid, False)]
    assert any(ln.startswith("FORCED: run run_A's trainer") for ln in lines)
    # through the node command, forced, on a node whose GPUs are not read: nothing of run A is stopped
    report = _gpu_free(cfg, "run_B", "--force")
    assert [j.pid for j in report.other_runs] == [sentinel.pid] and alive(sentinel.pid)


# --------------------------------------------------------------------------- the GPU gate (FreeGpusOperator)
@pytest.fixture
def gpu_node(tmp_path, monkeypatch):
    """This machine as a GPU node (the fake nvidia-smi); run A's trainer on GPU 0, its sentinel beside it."""
    sc = write_scenario(tmp_path / "scenario.json", {"gpus": [gpu(0, 1)], "processes": []})
    monkeypatch.setenv("PATH", f"{FIXTURES / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", str(sc))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_PYTHON", sys.executable)
    monkeypatch.setenv("EAGLEFLOW_ALLOW_FORCE_FREE", "1")
    cfg = _config(tmp_path, has_gpu=True)
    state = Path(RunLayout.for_run(load_config(str(cfg)), "x").state_dir)
    try:
        yield cfg, sc, state
    finally:
        kill_recorded(state)


def _free_gpus(cfg, run_id: str, **params):
    from eagleflow.airflow.gpu_operators import FreeGpusOperator
    return FreeGpusOperator(task_id="free_gpus").execute({"params": {"config_path": str(cfg), **params},
                                                          "run_id": run_id})


def test_gpu_gate_refuses_naming_the_other_run_then_force_stops_it(gpu_node):
    from eagleflow.airflow.gpu_operators import GpusHeldByAnotherRun, GpusNotIdle
    cfg, sc, state = gpu_node
    trainer = _spawn(cfg, "run_A", "trainer")
    sentinel = _spawn(cfg, "run_A", "sentinel_trainer")
    write_scenario(sc, {"gpus": [gpu(0, 1)], "processes": [proc(trainer.pid, 0, 30000, "torchrun", live=True)]})
    t0 = time.monotonic()
    with pytest.raises(GpusHeldByAnotherRun) as e:
        _free_gpus(cfg, "run_B")
    assert time.monotonic() - t0 >= 3.0, "the gate refused without waiting gpu.idle_timeout_s"
    msg = str(e.value)
    assert isinstance(e.value, GpusNotIdle)   # retryable: the retry waits again
    assert f"run run_A: trainer pid {trainer.pid}" in msg and "time.sleep(600)" in msg
    assert "which run run_B does not stop" in msg and "force_free_gpus" in msg
    assert f"--pid-file RECORD, for each of {trainer.pid_file}" in msg
    assert f"sentinel_trainer pid {sentinel.pid}" not in msg, "a job off the selected GPUs is not in the way"
    assert alive(trainer.pid) and alive(sentinel.pid)

    report = _free_gpus(cfg, "run_B", force_free_gpus=True)
    assert [(o["pid"], o["outcome"], o["run_id"]) for o in report["outcomes"]] == [(trainer.pid, "terminated", "run_A")]
    assert not alive(trainer.pid) and alive(sentinel.pid)
    assert [(j["pid"], j["on_selected_gpus"]) for j in report["other_runs"]] == [(sentinel.pid, False)]


def test_gpu_gate_waits_for_the_other_runs_job_to_end(gpu_node, monkeypatch, tmp_path):
    from eagleflow.airflow.gpu_operators import FreeGpusOperator
    cfg, sc, state = gpu_node
    ends = tmp_path / "training-ends"   # run A's trainer ends once the gate has begun to wait for it
    trainer = _spawn(cfg, "run_A", "trainer", f"import os, time\nwhile not os.path.exists({str(ends)!r}): "
                                              "time.sleep(0.05)\ntime.sleep(0.5)")
    write_scenario(sc, {"gpus": [gpu(0, 1)], "processes": [proc(trainer.pid, 0, 30000, "torchrun", live=True)]})
    wait = FreeGpusOperator._wait_for_other_runs

    def waiting(self, ctx, report):
        ends.touch()
        return wait(self, ctx, report)
    monkeypatch.setattr(FreeGpusOperator, "_wait_for_other_runs", waiting)
    report = _free_gpus(cfg, "run_B")
    assert ends.exists(), "the gate did not wait for the other run's job"
    assert [j["pid"] for j in report["other_runs"]] == [trainer.pid]
    assert not alive(trainer.pid)
    # run A's record is its own to clean: run B never removed it
    assert json.loads((state / "pids" / "run_A.trainer.json").read_text())["pid"] == trainer.pid
