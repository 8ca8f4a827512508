"""Process records: signals only to what is proven ours (issue 11 item 7), exact names, the one stop."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.gpu.cleanup import free_recorded_processes
from eagleflow.nodes import LocalNode, Node, ProcessRecord
from eagleflow.nodes import process_record as pr
from eagleflow.nodes.proc import read_start_ticks
from tests.fixtures.processes import alive
from tests.fixtures.waiting import holds_within

pytestmark = pytest.mark.timeout(60)


def _wait(cond, timeout=10.0):
    return holds_within(cond, timeout)


@pytest.fixture
def foreign_group():
    """`setsid bash -c 'sleep 600 &'`: bash leads a new group and exits; its sleep stays in that group.

    Yields (group id = the dead bash's PID, the sleep's PID). The test stops the sleep itself, by PID.
    """
    out = subprocess.run(["setsid", "bash", "-c", "sleep 600 >/dev/null 2>&1 & echo $$ $!"], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    pgid, sleep_pid = (int(x) for x in out.stdout.split())
    assert alive(sleep_pid) and not alive(pgid)   # bash (the group's leader) has exited and was reaped
    assert os.getpgid(sleep_pid) == pgid and pgid != sleep_pid
    try:
        yield pgid, sleep_pid
    finally:
        if alive(sleep_pid):
            os.kill(sleep_pid, signal.SIGKILL)


def _stale_record(tmp_path: Path, pgid: int, run_id: str = "old", role: str = "worker_shard_00001") -> Path:
    """What a crashed run left: its leader (pid = pgid) is long gone; the group id is now someone else's."""
    path = tmp_path / "pids" / f"{run_id}.{role}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pgid, "pgid": pgid, "start_ticks": 4242, "role": role,
                                "argv": ["eagleflow", "capture", "run"], "token": secrets.token_hex(16)}))
    return path


def test_stale_record_whose_group_id_now_holds_a_foreign_sleep_signals_nothing(tmp_path, foreign_group):
    pgid, sleep_pid = foreign_group
    path = _stale_record(tmp_path, pgid)
    lines: list[str] = []
    rep = free_recorded_processes(tmp_path, run_id="old", grace_s=0.5, kill_wait_s=0.5, log=lines.append)
    (out,) = rep.outcomes
    assert out.outcome == "stale_record" and out.left_alone == [sleep_pid]
    assert f"process group {pgid}" in out.detail and "not signalled" in out.detail
    time.sleep(0.3)
    st = open(f"/proc/{sleep_pid}/stat").read().rsplit(")", 1)[1].split()[0]
    assert alive(sleep_pid) and st == "S", "the foreign sleep got a signal"
    assert not path.exists(), "a stale record is reported and dropped (it can never name our process again)"


def test_stale_record_through_the_node_command_signals_nothing(tmp_path, foreign_group):
    """The command a remote node runs (Node's own process_status/stop_recorded: a new interpreter, one JSON line)."""
    pgid, sleep_pid = foreign_group
    path = _stale_record(tmp_path, pgid)
    node = LocalNode()
    st = Node.process_status(node, str(path))
    assert st.recorded and not st.alive and st.members == 0 and st.record.pgid == pgid
    res = Node.stop_recorded(node, str(path), grace_s=0.5, kill_wait_s=0.5)
    assert res.outcome == "stale_record" and res.left_alone == [sleep_pid]
    assert alive(sleep_pid)
    assert Node.process_status(node, str(path)).recorded is False


def test_pid_reused_by_another_process_is_stale_and_left_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        path = tmp_path / "pids" / "r.trainer.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"pid": other.pid, "pgid": other.pid, "role": "trainer",
                                    "start_ticks": read_start_ticks(other.pid) - 1}))
        res = pr.stop_file(path, grace_s=0.5)
        assert res.outcome == "stale_record" and "start time" in res.detail
        assert other.poll() is None
        # a record without a start time proves nothing either
        path.write_text(json.dumps({"pid": other.pid, "pgid": other.pid, "role": "trainer"}))
        assert pr.stop_file(path, grace_s=0.5).outcome == "stale_record" and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_leader_gone_members_carrying_the_token_are_stopped_one_by_one(tmp_path):
    node = LocalNode()
    rec = node.spawn_detached(["bash", "-c", "sleep 600 & sleep 600 & wait"], role="trainer",
                              pid_file=str(tmp_path / "pids" / "r.trainer.json"), log_file=str(tmp_path / "t.log"))
    assert _wait(lambda: len(pr.group_pids(rec.pgid)) == 3)
    children = [p for p in pr.group_pids(rec.pgid) if p != rec.pid]
    os.kill(rec.pid, signal.SIGKILL)                 # the leader dies; its children stay in the group
    assert _wait(lambda: not pr.leader_is_ours(rec))
    assert sorted(pr.members(rec)) == sorted(children), "members are ours by the token they inherited"
    res = pr.stop_file(rec.pid_file, grace_s=2)
    assert res.outcome == "terminated" and not any(alive(p) for p in children)
    assert not Path(rec.pid_file).exists()


def test_stop_terms_a_live_group_and_wakes_a_stopped_one(tmp_path):
    node = LocalNode()
    rec = node.spawn_detached([sys.executable, "-c", "import time; time.sleep(600)"], role="capture_server",
                              pid_file=str(tmp_path / "pids" / "r.capture_server.json"),
                              log_file=str(tmp_path / "s.log"))
    os.killpg(rec.pgid, signal.SIGSTOP)   # a stopped process keeps TERM pending unless it is continued
    st = node.process_status(rec.pid_file)
    assert st.alive and st.members == 1 and st.record == rec and isinstance(st.record, ProcessRecord)
    t0 = time.monotonic()
    res = node.stop_recorded(rec.pid_file, grace_s=10)
    assert res.outcome == "terminated" and time.monotonic() - t0 < 8
    assert node.process_status(rec.pid_file).recorded is False
    assert node.stop_recorded(rec.pid_file).outcome == "not_recorded"


_LEADER_ENDS_FIRST = """
import ctypes, signal, threading, time, os
term = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: term.set())
def teardown():   # what a big server's last thread does after its leader's thread has ended: free memory
    term.wait()
    time.sleep(1.5)
    os._exit(0)
threading.Thread(target=teardown).start()
while not term.is_set():
    time.sleep(0.02)
ctypes.CDLL(None).pthread_exit(None)   # the leader thread ends first: /proc shows the leader Z
"""


def test_stop_waits_for_the_threads_of_a_zombie_leader_that_still_hold_the_job_lock(tmp_path):
    """A server's leader thread ends first on TERM (/proc: Z) while a sibling thread still tears the process down,
    holding its descriptors, the job's life lock among them: stop must not say "terminated" before that, or the
    restart right after (the generation drill's pre-start recovery) is refused by the lock (JobAlreadyRunning)."""
    from eagleflow.nodes.locks import JobLockHeld, lock_exclusive
    node = LocalNode()
    lock = tmp_path / "locks" / "r.generate_server.lock"
    rec = node.spawn_detached([sys.executable, "-c", _LEADER_ENDS_FIRST], role="generate_server",
                              pid_file=str(tmp_path / "pids" / "r.generate_server.json"),
                              log_file=str(tmp_path / "s.log"), lock_file=str(lock))
    with pytest.raises(JobLockHeld):
        os.close(lock_exclusive(lock, "probe"))
    res = node.stop_recorded(rec.pid_file, grace_s=10)
    assert res.outcome == "terminated", res.detail
    os.close(lock_exclusive(lock, "the restart"))   # free the moment stop returns


def test_children_without_the_token_are_still_stopped_when_the_leader_exits_first(tmp_path):
    """airflow standalone exits on SIGINT before its children, whose /proc environ a proc title has overwritten:
    what was proven ours at the first look (the whole group of a live leader) stays ours while it runs."""
    token = secrets.token_hex(16)
    leader = subprocess.Popen(["bash", "-c", "env -i HOME=/ bash -c 'trap \"\" TERM; sleep 600; true' & trap 'exit 0' TERM; wait"],
                              start_new_session=True, env={**os.environ, pr.TOKEN_ENV: token})
    try:
        assert _wait(lambda: len(pr.group_pids(leader.pid)) >= 3)       # leader, the env-less bash, its sleep
        rec = ProcessRecord(pid=leader.pid, pgid=leader.pid, start_ticks=read_start_ticks(leader.pid),
                            role="airflow_standalone", token=token)
        children = [p for p in pr.group_pids(leader.pid) if p != leader.pid]
        assert not any(pr._carries_token(p, token) for p in children)    # nothing in their environ proves them ours
        res = pr.stop(rec, grace_s=0.5, kill_wait_s=5, remove_record=False)
        leader.wait(timeout=10)
        assert res.outcome == "killed", res.detail     # TERM ended the leader only; KILL the rest
        assert _wait(lambda: not pr.group_pids(leader.pid)), "children of the group survived the stop"
    finally:
        for p in pr.group_pids(leader.pid):
            os.kill(p, signal.SIGKILL)
        if leader.poll() is None:
            leader.kill()


def test_a_leader_that_sets_a_proc_title_is_still_ours(tmp_path):
    """Airflow's api-server and Celery workers set a process title, which blanks /proc/<pid>/environ unless
    SPT_NOENV is set: detach sets it, so the token stays there and their own records still stop them (they used
    to be 'not ours' and outlived every test that started them). See tests/security for a title that ignores it."""
    node = LocalNode()
    code = "import setproctitle, time; setproctitle.setproctitle('airflow api_server -- test'); time.sleep(300)"
    rec = node.spawn_detached([sys.executable, "-c", code], role="api_server",
                              pid_file=str(tmp_path / "pids" / "r.api_server.json"), log_file=str(tmp_path / "log"))
    try:
        assert _wait(lambda: open(f"/proc/{rec.pid}/cmdline", "rb").read().startswith(b"airflow api_server"))
        assert f"{pr.TOKEN_ENV}={rec.token}".encode() in open(f"/proc/{rec.pid}/environ", "rb").read().split(b"\0")
        res = pr.stop(pr.load_record(rec.pid_file), grace_s=5, kill_wait_s=5)
        assert res.outcome == "terminated", res.detail
        assert _wait(lambda: not alive(rec.pid))
    finally:
        if alive(rec.pid):
            os.kill(rec.pid, signal.SIGKILL)


def test_d_state_member_is_reported_with_its_wchan(monkeypatch, tmp_path):
    token = secrets.token_hex(16)   # in its environment from exec, as detach starts every job
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                             env={**os.environ, pr.TOKEN_ENV: token})
    try:
        # Popen returns once exec has begun; the kernel sets the new image's environ a moment later (until then
        # /proc/<pid>/environ reads empty, which proves nothing): wait for it, as any stop of a job long started
        deadline = time.monotonic() + 10
        while not pr._carries_token(child.pid, token):
            assert time.monotonic() < deadline, "the child's environ never showed its token"
            time.sleep(0.01)
        rec = ProcessRecord(pid=child.pid, pgid=child.pid, start_ticks=read_start_ticks(child.pid), role="trainer",
                            token=token)
        # a D-state process ignores SIGKILL; stand in for one: signals do nothing and /proc says D
        monkeypatch.setattr(pr, "_send", lambda rec, sig, ours: None)
        monkeypatch.setattr(pr, "read_proc_state", lambda pid: SimpleNamespace(in_d_state=True, wchan="nfs_wait"))
        t0 = time.monotonic()
        res = pr.stop(rec, grace_s=0.2, kill_wait_s=0.3)
        assert res.outcome == "unkillable" and res.wchan == "nfs_wait" and "nfs_wait" in res.describe()
        assert time.monotonic() - t0 < 5
    finally:
        child.kill()
        child.wait()


def test_records_of_a_run_are_found_by_exact_name(tmp_path):
    d = tmp_path / "pids"
    d.mkdir()
    for run_id in ("exp", "exp.s2", "exp2", "exp.worker_shard_00001"):
        for role in ("worker_shard_00001", "capture_server"):
            (d / f"{run_id}.{role}.json").write_text(json.dumps({"pid": 99999, "pgid": 99999, "role": role}))
    found = sorted(Path(r.pid_file).name for r in pr.records_in(d, "exp"))
    assert found == ["exp.capture_server.json", "exp.worker_shard_00001.json"]
    workers = pr.records_in(d, "exp", role_pattern=r"worker_shard_\d{5}")
    assert [r.role for r in workers] == ["worker_shard_00001"]
    assert len(pr.records_in(d)) == 8


def test_airflow_standalone_stop_with_a_stale_state_file_signals_nothing(tmp_path, foreign_group):
    """`make airflow-stop` long after: standalone.json's group id now names a foreign `sleep`."""
    from eagleflow.airflow.deploy import standalone
    pgid, sleep_pid = foreign_group
    (tmp_path / "standalone.json").write_text(json.dumps({"pid": pgid, "pgid": pgid, "start_ticks": 4242,
                                                          "token": secrets.token_hex(16), "port": 8080}))
    assert standalone.stop(tmp_path, grace_s=1) is False
    time.sleep(0.3)
    assert alive(sleep_pid) and not (tmp_path / "standalone.json").exists()
