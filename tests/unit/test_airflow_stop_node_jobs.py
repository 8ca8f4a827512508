"""`make airflow-stop` and the node jobs its runs detached on this machine (issue 52, item 8).

A stand-in for the supervisor's group, launched as ``standalone.start`` launches it (its own session, the proof
token, the deployment's marker), runs what a task does on a local node: it detaches run A's trainer and sentinel
through ``LocalNode.spawn_detached``. They leave the group (their own sessions) but inherit its environment.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from eagleflow.airflow.deploy import standalone
from eagleflow.nodes import LocalNode
from eagleflow.nodes.proc import read_start_ticks
from eagleflow.nodes.process_record import StartProof
from tests.fixtures.processes import alive, kill_recorded
from tests.fixtures.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

TASK = """
import sys, time
from eagleflow.nodes import LocalNode
state = sys.argv[1]
for role in ("trainer", "sentinel_trainer"):
    LocalNode().spawn_detached([sys.executable, "-c", "import time; time.sleep(600)", role], role=role,
                               pid_file=f"{state}/pids/run_A.{role}.json", log_file=f"{state}/{role}.log")
print("detached", flush=True)
time.sleep(600)
"""


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    monkeypatch.delenv(standalone.DEPLOYMENT_ENV, raising=False)
    home, state = tmp_path / "home", tmp_path / "state"
    home.mkdir()
    dep = secrets.token_hex(16)
    with StartProof() as proof:
        sup = subprocess.Popen([sys.executable, "-c", TASK, str(state)], stdout=subprocess.PIPE, text=True,
                               env={**proof.env(os.environ), standalone.DEPLOYMENT_ENV: dep},
                               pass_fds=proof.pass_fds, start_new_session=True)
    (home / "standalone.json").write_text(json.dumps({
        "pid": sup.pid, "pgid": sup.pid, "start_ticks": read_start_ticks(sup.pid), "token": proof.token,
        "deployment": dep, "port": 0}))
    assert sup.stdout is not None and sup.stdout.readline().strip() == "detached"
    jobs = {r: json.loads((state / "pids" / f"run_A.{r}.json").read_text()) for r in ("trainer", "sentinel_trainer")}
    # a job on the same machine and state dir that this deployment did not start (a person's CLI run)
    other = LocalNode().spawn_detached([sys.executable, "-c", "import time; time.sleep(600)"], role="trainer",
                                       pid_file=str(state / "pids" / "run_B.trainer.json"),
                                       log_file=str(state / "b.log"))
    try:
        yield home, state, sup, jobs, other
    finally:
        if sup.poll() is None:
            sup.kill()
        sup.wait()
        kill_recorded(state)


def test_airflow_stop_stops_the_node_jobs_its_runs_detached(deployment):
    home, state, sup, jobs, other = deployment
    assert all(alive(j["pid"]) for j in jobs.values())
    lines: list[str] = []
    assert standalone.stop(home, grace_s=5, node_job_grace_s=2, log=lines.append) is True
    assert sup.wait(timeout=10) is not None
    wait_until(lambda: not any(alive(j["pid"]) for j in jobs.values()), 10, what="run A's node jobs stopped")
    assert alive(other.pid), "a job this deployment did not start was stopped"
    stopped = [ln for ln in lines if ln.startswith("node job of run run_A stopped")]
    assert len(stopped) == 2 and "sentinel_trainer pid" in stopped[0] and ": terminated" in stopped[1], lines
    assert sorted(p.name for p in (state / "pids").glob("*.json")) == ["run_B.trainer.json"]
    assert any("nodes reached over SSH are not stopped from here" in ln for ln in lines)
    assert not (home / "standalone.json").exists()


def test_airflow_stop_keep_node_jobs_lists_each_with_its_stop(deployment):
    home, state, sup, jobs, other = deployment
    lines: list[str] = []
    assert standalone.stop(home, grace_s=5, keep_node_jobs=True, log=lines.append) is True
    assert sup.wait(timeout=10) is not None
    time.sleep(0.3)
    assert all(alive(j["pid"]) for j in jobs.values()) and alive(other.pid)
    kept = [ln for ln in lines if ln.startswith("node job left running: run run_A")]
    assert len(kept) == 2 and "run_B" not in "".join(lines)
    # the line is the hand-over: the command it names stops that job through the one stop
    cmd = kept[1].split("stop it with ", 1)[1].split()
    assert cmd[-2:] == ["--pid-file", jobs["trainer"]["pid_file"]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert json.loads(res.stdout)["outcome"] == "terminated" and not alive(jobs["trainer"]["pid"])


def test_a_marked_process_without_its_own_record_is_listed_never_signalled(tmp_path, monkeypatch):
    """The marker only finds a record; the record's token, the one the process carries, proves it ours."""
    from eagleflow.nodes.process_record import RECORD_ENV, TOKEN_ENV
    monkeypatch.delenv(standalone.DEPLOYMENT_ENV, raising=False)
    dep, sleep = secrets.token_hex(16), [sys.executable, "-c", "import time; time.sleep(600)"]
    pids = tmp_path / "pids"
    pids.mkdir()
    forged = pids / "run_X.trainer.json"
    marked = {**os.environ, standalone.DEPLOYMENT_ENV: dep, TOKEN_ENV: secrets.token_hex(16)}
    before = subprocess.Popen(sleep, env=marked)                          # started before records were named
    pointing = subprocess.Popen(sleep, env={**marked, RECORD_ENV: str(forged)})   # names a record not its own
    try:
        forged.write_text(json.dumps({"pid": pointing.pid, "pgid": pointing.pid, "role": "trainer",
                                      "start_ticks": read_start_ticks(pointing.pid), "token": secrets.token_hex(16)}))
        os.chmod(forged, 0o600)
        lines: list[str] = []
        jobs = standalone.stop_node_jobs(dep, grace_s=1, log=lines.append)
        assert jobs.stopped == [] and jobs.kept == []
        assert len(jobs.unrecorded) == 2, jobs.unrecorded
        assert any(f"pid {before.pid} " in u and "no record named" in u for u in jobs.unrecorded)
        assert any(f"pid {pointing.pid} " in u and "holds another token" in u for u in jobs.unrecorded)
        assert before.poll() is None and pointing.poll() is None and forged.exists()
        assert sum("no record found" in ln for ln in lines) == 2
    finally:
        for p in (before, pointing):
            p.kill()
            p.wait()
