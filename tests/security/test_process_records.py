"""Issue 26 item 3: a forged or untrusted pid record never gets a process signalled (real processes, real commands).

The break: pid, group and start time are public (/proc/<pid>/stat), so a record holding only those of someone's
`setsid sleep 300` made `process_record stop` answer "terminated". Now the leader's own environment must carry
the record's token, and the record file must be ours, not writable by others, and no symlink.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.durable import UnsafeFile
from eagleflow.nodes import LocalNode, Node
from eagleflow.nodes.base import NodeCommandFailed
from eagleflow.nodes.proc import read_start_ticks
from eagleflow.nodes.locks import NodeLock
from tests.fixtures.processes import alive

pytestmark = pytest.mark.timeout(120)


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def victim():
    """`setsid sleep 300`, started by this test (a process eagleflow did not start); killed by its PID at the end."""
    p = subprocess.Popen(["setsid", "sleep", "300"], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while os.getpgid(p.pid) != p.pid:   # setsid has made it a group leader
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield p
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def _forge(pids_dir: Path, victim: subprocess.Popen, token: str | None, name: str = "r.capture_server") -> Path:
    pids_dir.mkdir(parents=True, exist_ok=True)
    path = pids_dir / f"{name}.json"
    doc = {"pid": victim.pid, "pgid": victim.pid, "start_ticks": read_start_ticks(victim.pid),
           "role": name.split(".", 1)[1], "argv": ["sleep", "300"]}
    if token is not None:
        doc["token"] = token
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)   # a record file in every other respect ours: only the token can tell
    return path


@pytest.mark.parametrize("token", [None, "guessed"], ids=["no-token", "wrong-token"])
def test_forged_record_of_a_setsid_sleep_is_refused_by_process_record_stop(tmp_path, victim, token):
    path = _forge(tmp_path / "pids", victim, secrets.token_hex(16) if token else None)
    node = LocalNode()
    st = Node.process_status(node, str(path))          # the node command: a new interpreter, one JSON line
    assert st.recorded and not st.alive and st.members == 0 and "token mismatch" in st.detail
    res = Node.stop_recorded(node, str(path), grace_s=0.5, kill_wait_s=0.5)
    assert res.outcome == "not_ours", res
    assert f"not ours: pid {victim.pid}" in res.detail and "token mismatch" in res.detail
    time.sleep(0.3)
    assert victim.poll() is None and _state(victim.pid) == "S", "the foreign sleep got a signal"
    assert path.exists(), "a forged record is kept for a person to look at"


def test_gpu_free_refuses_a_forged_record_and_leaves_the_sleep_alive(tmp_path, victim):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run_root": str(tmp_path / "runs"), "target_model": "m",
                                   "node": {"name": "box", "has_gpu": False}}))
    path = _forge(tmp_path / "runs" / ".node-state" / "pids", victim, secrets.token_hex(16))
    out = subprocess.run([sys.executable, "-m", "eagleflow.cli", "gpu", "free", "--config", str(cfg), "--json"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    (res,) = json.loads(out.stdout.strip().splitlines()[-1])["outcomes"]
    assert res["outcome"] == "not_ours" and "token mismatch" in res["detail"] and res["record"] == str(path)
    assert "not ours" in out.stderr
    time.sleep(0.3)
    assert victim.poll() is None and _state(victim.pid) == "S"


@pytest.fixture
def ours(tmp_path):
    """A real job eagleflow started (detach): its record is genuine; the test spoils the file, not the job."""
    node = LocalNode()
    rec = node.spawn_detached([sys.executable, "-c", "import time; time.sleep(300)"], role="trainer",
                              pid_file=str(tmp_path / "pids" / "r.trainer.json"), log_file=str(tmp_path / "t.log"))
    try:
        yield node, rec
    finally:
        if alive(rec.pid):
            os.kill(rec.pid, signal.SIGKILL)


def test_detach_writes_the_record_0600_with_the_token_in_the_leaders_environment(ours):
    node, rec = ours
    assert os.stat(rec.pid_file).st_mode & 0o777 == 0o600
    env = open(f"/proc/{rec.pid}/environ", "rb").read().split(b"\0")
    assert f"EAGLEFLOW_PROC_TOKEN={rec.token}".encode() in env
    assert Node.process_status(node, rec.pid_file).alive


def _spoil_and_check(node, rec, spoil, what: str) -> None:
    spoil()
    for res in (Node.stop_recorded(node, rec.pid_file, grace_s=0.5, kill_wait_s=0.5),
                node.stop_recorded(rec.pid_file, grace_s=0.5, kill_wait_s=0.5)):   # node command, then in-process
        assert res.outcome == "refused" and what in res.detail and "nothing signalled" in res.detail, res
    st = Node.process_status(node, rec.pid_file)
    assert not st.recorded and st.detail.startswith("refused:") and what in st.detail
    time.sleep(0.2)
    assert alive(rec.pid)


def test_group_writable_record_is_refused(ours):
    node, rec = ours
    _spoil_and_check(node, rec, lambda: os.chmod(rec.pid_file, 0o620), "writable by group or others (mode 620)")
    os.chmod(rec.pid_file, 0o600)          # the same record, ours again: now it stops its job
    assert node.stop_recorded(rec.pid_file, grace_s=5).outcome == "terminated" and not alive(rec.pid)


def test_symlinked_record_is_refused(ours, tmp_path):
    node, rec = ours
    real = tmp_path / "elsewhere.json"

    def spoil():
        os.replace(rec.pid_file, real)
        os.symlink(real, rec.pid_file)
    _spoil_and_check(node, rec, spoil, "is a symbolic link")


def test_record_owned_by_another_user_is_refused(ours):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a file to another uid")
    node, rec = ours
    _spoil_and_check(node, rec, lambda: os.chown(rec.pid_file, 65534, 65534), "owned by uid 65534")


def test_gpu_free_reports_a_refused_record_and_signals_nothing(ours, tmp_path):
    from eagleflow.gpu.cleanup import free_recorded_processes
    node, rec = ours
    os.chmod(rec.pid_file, 0o666)
    lines: list[str] = []
    (out,) = free_recorded_processes(tmp_path, grace_s=0.5, kill_wait_s=0.5, log=lines.append).outcomes
    assert out.outcome == "refused" and out.record == rec.pid_file and "mode 666" in out.detail
    assert alive(rec.pid) and any("nothing signalled" in ln for ln in lines)


def test_log_and_lock_symlinks_are_not_followed(tmp_path):
    node = LocalNode()
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / "logs").mkdir()
    os.symlink(target, tmp_path / "logs" / "job.log")
    with pytest.raises(NodeCommandFailed, match="is a symbolic link"):
        node.spawn_detached(["true"], role="job", pid_file=str(tmp_path / "pids" / "r.job.json"),
                            log_file=str(tmp_path / "logs" / "job.log"))
    os.symlink(target, tmp_path / "job.lock")
    with pytest.raises(NodeCommandFailed, match="is a symbolic link"):
        node.spawn_detached(["true"], role="job", pid_file=str(tmp_path / "pids" / "r.job.json"),
                            log_file=str(tmp_path / "ok.log"), lock_file=str(tmp_path / "job.lock"))
    os.symlink(tmp_path / "missing", tmp_path / "dangling.lock")   # O_CREAT would have created the target
    with pytest.raises(UnsafeFile, match="is a symbolic link"):
        NodeLock(tmp_path / "dangling.lock", purpose="test").acquire(timeout_s=0)
    assert target.read_text() == "keep me\n" and not (tmp_path / "missing").exists()
    assert not (tmp_path / "pids" / "r.job.json").exists(), "nothing was started"


def test_a_group_writable_log_or_lock_of_ours_is_narrowed_not_refused(tmp_path):
    """Made under umask 002 by an older run: still ours, so narrowed to 0644 and used (their content proves
    nothing); a record is never narrowed (test_group_writable_record_is_refused)."""
    (tmp_path / "logs").mkdir()
    for name in ("logs/job.log", "job.lock"):
        (tmp_path / name).write_text("")
        os.chmod(tmp_path / name, 0o664)
    node = LocalNode()
    rec = node.spawn_detached(["true"], role="job", pid_file=str(tmp_path / "pids" / "r.job.json"),
                              log_file=str(tmp_path / "logs" / "job.log"), lock_file=str(tmp_path / "job.lock"))
    assert rec.pid > 0
    for name in ("logs/job.log", "job.lock"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o644
    os.chmod(tmp_path / "job.lock", 0o666)
    if os.geteuid() == 0:
        os.chown(tmp_path / "job.lock", 65534, 65534)   # someone else's: refused, never narrowed
        with pytest.raises(UnsafeFile, match="owned by uid 65534"):
            NodeLock(tmp_path / "job.lock", purpose="test").acquire(timeout_s=0)
