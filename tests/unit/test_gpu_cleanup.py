"""Stopping recorded processes with real children: TERM, grace, KILL; foreign ones only with force."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from eagleflow.gpu.cleanup import free_recorded_processes
from eagleflow.gpu.process_info import describe_pid
from eagleflow.gpu.snapshot import GpuProcess
from eagleflow.nodes import LocalNode, process_record
from eagleflow.nodes.proc import ProcState, read_start_ticks
from tests.fixtures.waiting import wait_until
from tests.fixtures.processes import IGNORE_TERM, alive


def spawn_recorded(state, role, code):
    node = LocalNode()
    return node.spawn_detached([sys.executable, "-c", code], role=role,
                               pid_file=str(state / "pids" / f"run1.{role}.json"), log_file=str(state / f"{role}.log"))


def wait_log(path, text, timeout=10):
    wait_until(lambda: path.exists() and text in path.read_text(), timeout, what=f"{path} saying {text!r}")


@pytest.mark.timeout(60)
def test_recorded_stopped_foreign_and_stale_survive(tmp_path):
    state = tmp_path / "state"
    obedient = spawn_recorded(state, "capture_server", "import time; time.sleep(600)")
    stubborn = spawn_recorded(state, "trainer", IGNORE_TERM)
    wait_log(state / "trainer.log", "ready")  # SIGTERM ignored only once the handler is set
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # a record whose PID now belongs to another process: start time differs -> never signalled
    (state / "pids" / "old.worker_shard_00000.json").write_text(json.dumps(
        {"pid": reused.pid, "pgid": reused.pid, "start_ticks": read_start_ticks(reused.pid) - 1, "role": "worker_shard_00000",
         "argv": ["old"]}))
    try:
        lines = []
        rep = free_recorded_processes(state, run_id="run1", grace_s=1.0,
                                      gpu_processes=[GpuProcess(foreign.pid, "python3", 500, user="bob")],
                                      log=lines.append)
        by_pid = {o.pid: o for o in rep.outcomes}
        assert by_pid[obedient.pid].outcome == "terminated"
        assert by_pid[stubborn.pid].outcome == "killed"
        assert by_pid[foreign.pid].outcome == "left_running" and by_pid[foreign.pid].foreign
        assert by_pid[reused.pid].outcome == "stale_record"
        assert not alive(obedient.pid) and not alive(stubborn.pid)
        assert foreign.poll() is None and reused.poll() is None
        assert list((state / "pids").glob("*.json")) == []
        assert any("force" in line and str(foreign.pid) in line for line in lines)

        rep = free_recorded_processes(state, run_id="run1", grace_s=1.0, force=True,
                                      gpu_processes=[GpuProcess(foreign.pid, "python3", 500, user="bob")], log=lines.append)
        assert [(o.pid, o.outcome) for o in rep.outcomes] == [(foreign.pid, "terminated")]
        assert foreign.wait(timeout=5) is not None
        assert any(line.startswith("FORCED") and "bob" in line for line in lines)
    finally:
        for p in (foreign, reused):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(30)
def test_d_state_process_is_reported_with_wchan_not_waited_on(monkeypatch, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # a D-state process ignores SIGKILL; stand in for one: signals do nothing and /proc says D
        monkeypatch.setattr(process_record, "_kill", lambda pid, sig: None)
        monkeypatch.setattr(process_record, "read_proc_state",
                            lambda pid: ProcState(pid, "python3", "D", 0, (pid,), "nfs_wait"))
        t0 = time.monotonic()
        rep = free_recorded_processes(tmp_path, run_id="run1", grace_s=0.2, kill_wait_s=0.3, force=True,
                                      gpu_processes=[GpuProcess(child.pid, "python3", 10)], log=lambda m: None)
        (o,) = rep.outcomes
        assert o.outcome == "unkillable" and o.wchan == "nfs_wait" and "nfs_wait" in o.describe()
        assert rep.unkillable == [o] and time.monotonic() - t0 < 5
    finally:
        child.kill()
        child.wait()


def test_proc_facts_with_odd_comm_and_d_thread(tmp_path):
    """comm may hold spaces and ')'; one thread in D makes the process D; wchan is read."""
    pid = 4242
    d = tmp_path / str(pid)
    (d / "task" / "4242").mkdir(parents=True)
    (d / "task" / "4243").mkdir(parents=True)
    stat = f"{pid} (my (odd) name) S 1 4240 4240 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 2 0 123456 0 0\n"
    (d / "stat").write_text(stat)
    (d / "task" / "4242" / "stat").write_text(stat)
    (d / "task" / "4243" / "stat").write_text(stat.replace(") S ", ") D "))
    (d / "wchan").write_text("nvidia_uvm_wait")
    info = describe_pid(pid, proc_root=str(tmp_path))
    assert info["comm"] == "my (odd) name" and info["state"] == "D" and info["pgid"] == 4240
    assert info["wchan"] == "nvidia_uvm_wait"
    assert describe_pid(99999999)["user"] is None
    assert os.getpid()  # the real /proc path works for ourselves
    assert describe_pid(os.getpid())["state"] in ("R", "S")
