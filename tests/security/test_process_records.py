"""Issue 26 item 3: a forged or untrusted pid record never gets a process signalled (real processes, real commands).

The break: pid, group and start time are public (/proc/<pid>/stat), so a record holding only those of someone's
`setsid sleep 300` made `process_record stop` answer "terminated". Now the leader's own environment must carry
the record's token, and the record file must be ours, not writable by others, and no symlink.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
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
from tests.fixtures.waiting import wait_until

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
    (out,) = free_recorded_processes(tmp_path, run_id="r", grace_s=0.5, kill_wait_s=0.5, log=lines.append).outcomes
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


# ----------------------------------------------------------------------------- issue 38 item 2: a blank environ proves nothing
# A process title (setproctitle: Celery's pool workers, Airflow's parts) or `env -i` leaves /proc/<pid>/environ with no
# VAR=value at all. Such a process used to count as ours when this user owned it: a stale record whose group id now
# named a same-user group got its setproctitle'd child killed by `gpu free`, and a forged record killed
# `env -i setsid sleep 302`. Now only the record's token proves anything (environ or the descriptor detach hands out).
TITLE = "celery worker: ForkPoolWorker-1 " * 3
SET_TITLE = f"import setproctitle, time; setproctitle.setproctitle({TITLE!r}); time.sleep(300)"


def _env_without_noenv() -> dict[str, str]:
    """This test's environment minus SPT_NOENV: a process eagleflow did not start, whose title blanks its environ."""
    return {k: v for k, v in os.environ.items() if k != "SPT_NOENV"}


def _blank(pid: int) -> bool:
    try:
        return b"=" not in open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return False


def _wait_blank(pids) -> None:
    wait_until(lambda: all(_blank(p) for p in pids), 20, what=f"blank /proc/<pid>/environ of {list(pids)}")


def _kill_all(pids) -> None:
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)


@pytest.fixture
def same_user_group_with_blank_children():
    """`setsid bash -c '...'`: bash leads a new group of this user and exits; left in that group are an
    `env -i sleep` and a python that set a process title (both with a blank environ). Yields (pgid, [pids])."""
    script = (f"env -i sleep 300 >/dev/null 2>&1 & a=$!; {sys.executable} -c {shlex.quote(SET_TITLE)} >/dev/null 2>&1 & "
              "echo $$ $a $!")
    out = subprocess.run(["setsid", "bash", "-c", script], capture_output=True, text=True, timeout=30,
                         stdin=subprocess.DEVNULL, env=_env_without_noenv())
    pgid, *kids = (int(x) for x in out.stdout.split())
    try:
        wait_until(lambda: not alive(pgid), 10, what=f"the group's leader bash {pgid} gone")
        _wait_blank(kids)
        assert all(os.getpgid(p) == pgid for p in kids)
        yield pgid, kids
    finally:
        _kill_all(kids)


def _stale(pids_dir: Path, pgid: int, role: str = "worker_shard_00001") -> Path:
    """What a crashed run left (or a reboot): its leader pid = pgid is long gone, the group id is now someone else's."""
    pids_dir.mkdir(parents=True, exist_ok=True)
    path = pids_dir / f"old.{role}.json"
    path.write_text(json.dumps({"pid": pgid, "pgid": pgid, "start_ticks": 4242, "role": role,
                                "argv": ["eagleflow", "capture", "run"], "token": secrets.token_hex(16)}))
    os.chmod(path, 0o600)
    return path


def _untouched(pids) -> None:
    time.sleep(0.3)
    for p in pids:
        assert alive(p) and _state(p) == "S", f"pid {p} got a signal"


def test_gpu_free_with_a_stale_record_over_a_group_of_blank_environs_signals_nothing(
        tmp_path, same_user_group_with_blank_children):
    pgid, kids = same_user_group_with_blank_children
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run_root": str(tmp_path / "runs"), "target_model": "m",
                                   "node": {"name": "box", "has_gpu": False}}))
    path = _stale(tmp_path / "runs" / ".node-state" / "pids", pgid)
    out = subprocess.run([sys.executable, "-m", "eagleflow.cli", "gpu", "free", "--config", str(cfg), "--json"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    (res,) = json.loads(out.stdout.strip().splitlines()[-1])["outcomes"]
    assert res["outcome"] == "stale_record" and sorted(res["left_alone"]) == sorted(kids), res
    assert f"process group {pgid}" in res["detail"] and "not signalled" in res["detail"]
    assert "blank environ, which proves nothing" in res["detail"]
    _untouched(kids)
    assert not path.exists(), "a stale record is reported and dropped"


def test_process_record_stop_and_status_of_a_stale_record_over_blank_environs_signal_nothing(
        tmp_path, same_user_group_with_blank_children):
    pgid, kids = same_user_group_with_blank_children
    path = _stale(tmp_path / "pids", pgid)
    node = LocalNode()
    st = Node.process_status(node, str(path))     # the node command: a new interpreter, one JSON line
    assert st.recorded and not st.alive and st.members == 0
    res = Node.stop_recorded(node, str(path), grace_s=0.5, kill_wait_s=0.5)
    assert res.outcome == "stale_record" and sorted(res.left_alone) == sorted(kids), res
    _untouched(kids)


@pytest.fixture(params=["env-i", "setproctitle"])
def blank_victim(request):
    """`env -i setsid sleep 302`, or a `setsid` python that set a process title: a group leader of this user whose
    /proc/<pid>/environ holds no VAR=value; not started by eagleflow. Killed by its PID at the end."""
    argv = (["env", "-i", "setsid", "sleep", "302"] if request.param == "env-i"
            else ["setsid", sys.executable, "-c", SET_TITLE])
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=_env_without_noenv())
    try:
        wait_until(lambda: os.getpgid(p.pid) == p.pid, 10, what="setsid made it a group leader")
        _wait_blank([p.pid])
        yield p
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_forged_record_of_a_blank_environ_leader_is_not_ours(tmp_path, blank_victim):
    path = _forge(tmp_path / "pids", blank_victim, secrets.token_hex(16))    # its real pid, group and start time
    node = LocalNode()
    st = Node.process_status(node, str(path))
    assert st.recorded and not st.alive and st.members == 0 and "token mismatch" in st.detail
    for res in (Node.stop_recorded(node, str(path), grace_s=0.5, kill_wait_s=0.5),   # node command, then in-process
                node.stop_recorded(str(path), grace_s=0.5, kill_wait_s=0.5)):
        assert res.outcome == "not_ours", res
        assert "token mismatch" in res.detail and "no VAR=value" in res.detail and "proves nothing" in res.detail
    _untouched([blank_victim.pid])
    assert path.exists(), "a forged record is kept for a person to look at"


def test_gpu_free_leaves_a_blank_environ_leader_named_by_a_forged_record(tmp_path, blank_victim):
    from eagleflow.gpu.cleanup import free_recorded_processes
    _forge(tmp_path / "pids", blank_victim, secrets.token_hex(16))
    (out,) = free_recorded_processes(tmp_path, run_id="r", grace_s=0.5, kill_wait_s=0.5, log=lambda _: None).outcomes
    assert out.outcome == "not_ours", out
    _untouched([blank_victim.pid])


# What we really start stays stoppable, whatever its title does to its environ.
def _spawn(tmp_path: Path, argv: list[str], role: str):
    return LocalNode().spawn_detached(argv, role=role, pid_file=str(tmp_path / "pids" / f"r.{role}.json"),
                                      log_file=str(tmp_path / f"{role}.log"))


def test_our_leader_that_blanks_its_environ_anyway_is_proven_by_its_descriptor_and_stopped(tmp_path):
    """A title setter that ignores SPT_NOENV (here: python's setproctitle exec'd without it, as redis-server's own
    title does): the descriptor detach handed it still proves it ours."""
    rec = _spawn(tmp_path, ["env", "-u", "SPT_NOENV", sys.executable, "-c", SET_TITLE], "api_server")
    try:
        _wait_blank([rec.pid])
        st = LocalNode().process_status(rec.pid_file)
        assert st.alive and st.members == 1, st.detail
        res = Node.stop_recorded(LocalNode(), rec.pid_file, grace_s=5, kill_wait_s=5)     # the node command
        assert res.outcome == "terminated", res.detail
        assert wait_until(lambda: not alive(rec.pid), 10, what="the api_server gone")
    finally:
        _kill_all([rec.pid])


def test_our_setproctitle_children_outliving_their_leader_keep_the_token_and_are_stopped(tmp_path):
    """sglang's schedulers, Celery's pool: children that set a title and may outlive the leader. They do not
    inherit the descriptor (Popen closes it), but SPT_NOENV from detach keeps the token in their environ."""
    code = ("import subprocess, sys; "
            f"c = subprocess.Popen([sys.executable, '-c', {SET_TITLE!r}]); print(c.pid, flush=True)")
    rec = _spawn(tmp_path, [sys.executable, "-c", code], "capture_server")
    log = tmp_path / "capture_server.log"
    child = int(wait_until(lambda: log.read_text().strip(), 20, what="the child's pid in the log"))
    try:
        wait_until(lambda: not alive(rec.pid), 20, what="the leader gone")
        wait_until(lambda: TITLE.split()[0].encode() in open(f"/proc/{child}/cmdline", "rb").read(), 20,
                   what="the child's title set")
        assert f"EAGLEFLOW_PROC_TOKEN={rec.token}".encode() in open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        res = LocalNode().stop_recorded(rec.pid_file, grace_s=5, kill_wait_s=5)
        assert res.outcome == "terminated" and res.left_alone == [], res.detail
        assert wait_until(lambda: not alive(child), 10, what="the child gone")
    finally:
        _kill_all([child])


def test_our_forked_child_with_an_empty_environ_outliving_its_leader_is_stopped(tmp_path):
    """`env -i` in a job we started: the child inherits detach's descriptor, which proves it ours by PID."""
    rec = _spawn(tmp_path, ["bash", "-c", "env -i sleep 300 & echo $!; wait"], "trainer")
    log = tmp_path / "trainer.log"
    child = int(wait_until(lambda: log.read_text().strip(), 20, what="the child's pid in the log"))
    try:
        _wait_blank([child])
        os.kill(rec.pid, signal.SIGKILL)                      # the leader dies first
        wait_until(lambda: not alive(rec.pid), 10, what="the leader gone")
        res = LocalNode().stop_recorded(rec.pid_file, grace_s=5, kill_wait_s=5)
        assert res.outcome == "terminated" and res.left_alone == [], res.detail
        assert wait_until(lambda: not alive(child), 10, what="the env -i sleep gone")
    finally:
        _kill_all([child])


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_our_redis_server_whose_title_blanks_its_environ_is_stopped(tmp_path):
    """redis-server writes its title over its environ whatever SPT_NOENV says (the tests' Celery deployment
    starts one): the inherited descriptor proves it ours."""
    rec = _spawn(tmp_path, ["redis-server", "--port", "0", "--unixsocket", str(tmp_path / "r.sock"), "--save", "",
                            "--appendonly", "no"], "redis")
    try:
        _wait_blank([rec.pid])
        res = LocalNode().stop_recorded(rec.pid_file, grace_s=5, kill_wait_s=5)
        assert res.outcome == "terminated", res.detail
    finally:
        _kill_all([rec.pid])
