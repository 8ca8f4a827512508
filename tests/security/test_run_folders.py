"""Issue 52, item 2: the run's folders are proven ours, and server info files are read as pid records are.

The break: in a shared, world-writable run_root another user made ``state/locks``, ``state/pids`` and
``state/logs`` first; they were used as they were (``makedirs(exist_ok=True)``), so that user could unlink a
running worker's lock and record and have the next start launch a second worker on the same shard. The
capture and generation servers' info files were read with a plain ``open()``, and the generation worker takes
its server URL from them. Now each of the run's folders (run dir, state dir and those under them) is made
with a safe mode or proven ours (``durable.owned_dir``: not a link, this user's, not writable by others; ours
but group-writable is narrowed), else refused naming the folder, its owner, its mode and what to do; info files
go through ``durable.read_owned``. Real paths: detach over a LocalNode (the pipeline's exclusive start), the
``eagleflow generate run`` and ``capture run`` workers' CLI, the control plane's readiness look.

Another user is real where this machine allows it (root: ``setpriv`` as uid 65534, or ``os.chown``); a
world-writable parent without the sticky bit and a planted link need no second user.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.durable import UnsafeFile, UnsafeFolder, owned_dir
from eagleflow.layout import RunLayout
from eagleflow.local_run import LocalRun
from eagleflow.nodes import LocalNode, Node, NodeCommandFailed, NodeFileRefused
from eagleflow.phase_jobs import check_server_ready, server_url_in, start_exclusive
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 65534
pytestmark = pytest.mark.timeout(180)


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a folder or file to another uid")


def as_other_user_mkdir(path: Path, mode: str = "0777") -> None:
    """``path`` made by another Unix user (uid 65534): its own ``mkdir`` (setpriv) where its parent lets it in,
    else made here and handed over (``os.chown``), as when a folder was once open to everyone."""
    needs_root()
    if shutil.which("setpriv") and path.parent.stat().st_mode & 0o1002 == 0o1002:
        res = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                              "mkdir", "-m", mode, str(path)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
    else:
        path.mkdir()
        os.chown(path, OTHER_UID, OTHER_UID)
        os.chmod(path, int(mode, 8))
    assert path.stat().st_uid == OTHER_UID


@pytest.fixture
def shared(tmp_path):
    """A shared run root as on a multi-user machine: world-writable with the sticky bit, like /tmp (in /tmp
    itself, so that another user can reach it)."""
    root = Path(tempfile.mkdtemp(prefix="eagleflow-shared-", dir="/tmp"))
    os.chmod(root, 0o1777)
    source = tmp_path / "source.jsonl"
    source.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "hello"}]}) + "\n")
    cfg = load_config(data={"target_model": "/m", "run_root": str(root / "runs"),
                            "node": {"name": "gpu-node-3", "has_gpu": False, "state_dir": str(root / "state")},
                            "corpus": {"sources": [{"name": "chat", "path": str(source)}]},
                            "generate": {"enabled": True, "shards": 2}})
    (root / "runs").mkdir()
    os.chmod(root / "runs", 0o1777)
    layout = RunLayout.for_run(cfg, "r")
    config_path = tmp_path / "run-config.json"
    config_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    yield LocalRun(cfg=cfg, layout=layout, config_path=str(config_path), _node=LocalNode("gpu-node-3"))
    shutil.rmtree(root, ignore_errors=True)


def _start(run: LocalRun, role: str = "generate_shard_00000"):
    """The pipeline's one exclusive start of a job (phase_jobs.start_exclusive: detach with its lock)."""
    return start_exclusive(run, role, [sys.executable, "-c", "import time; time.sleep(60)"])


def _stop(run: LocalRun, role: str = "generate_shard_00000") -> None:
    run.node.stop_recorded(str(run.layout.pid_file(role)), grace_s=2, kill_wait_s=2)


@pytest.mark.parametrize("folder", ["", "locks", "pids"])
def test_a_state_folder_another_user_made_first_is_refused_before_anything_starts(shared, folder):
    state = Path(str(shared.layout.state_dir))
    theirs = state / folder if folder else state
    if folder:
        state.mkdir(mode=0o777)      # once open to everyone (made under umask 0): another user made its folder
        os.chmod(state, 0o777)
    as_other_user_mkdir(theirs)
    with pytest.raises(NodeCommandFailed) as e:
        _start(shared)
    msg = str(e.value)
    assert f"folder {theirs} is owned by uid {OTHER_UID}" in msg and "mode 777" in msg, msg
    assert "someone else made it first" in msg and "set run_root / node.state_dir to a folder of your own" in msg
    assert e.value.exit_code == 2 and "not started" in msg
    assert os.listdir(theirs) == [], "nothing was written into the other user's folder"
    assert not os.path.exists(str(shared.layout.pid_file("generate_shard_00000")))


def test_a_state_dir_another_user_made_first_is_refused_even_with_our_folders_in_it(shared):
    state = Path(str(shared.layout.state_dir))
    as_other_user_mkdir(state, "0755")
    for sub in ("locks", "pids"):   # made by root (us) inside their folder: still theirs to rename
        (state / sub).mkdir()
    with pytest.raises(NodeCommandFailed, match=rf"folder {state} is owned by uid {OTHER_UID}.*mode 755"):
        _start(shared)


def test_the_run_log_folder_another_user_made_first_is_refused(shared):
    logs = Path(str(shared.layout.logs_dir))
    logs.parent.mkdir()
    as_other_user_mkdir(logs)
    with pytest.raises(NodeCommandFailed, match=rf"folder {logs} is owned by uid {OTHER_UID}"):
        _start(shared)


def test_a_symlinked_state_folder_is_refused(shared, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = Path(str(shared.layout.state_dir))
    state.mkdir()
    os.symlink(elsewhere, state / "pids")
    with pytest.raises(NodeCommandFailed, match=rf"{state / 'pids'} is a symbolic link"):
        _start(shared)
    assert os.listdir(elsewhere) == []


def test_a_run_root_anyone_may_write_without_the_sticky_bit_is_refused(shared):
    os.chmod(Path(str(shared.layout.run_dir)).parent, 0o777)
    with pytest.raises(NodeCommandFailed, match=r"may be written by anyone and has no sticky bit \(mode 777.*chmod \+t"):
        _start(shared)


def test_our_folders_are_made_safe_and_ours_made_group_writable_are_narrowed(shared):
    state = Path(str(shared.layout.state_dir))
    (state / "locks").mkdir(parents=True)
    os.chmod(state / "locks", 0o777)                  # ours, made under a loose umask
    rec, started = _start(shared)
    try:
        assert started
        for d in (Path(str(shared.layout.run_dir)), state, state / "pids", state / "locks",
                  Path(str(shared.layout.logs_dir))):
            st = d.stat()
            assert st.st_uid == os.geteuid() and not st.st_mode & 0o022, (d, oct(st.st_mode))
    finally:
        _stop(shared)


def test_owned_dir_names_the_folder_its_owner_its_mode_and_what_to_do(tmp_path):
    needs_root()
    (tmp_path / "run").mkdir()
    os.chown(tmp_path / "run", OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFolder) as e:
        owned_dir(tmp_path / "run" / "logs", root=tmp_path / "run")
    assert isinstance(e.value, UnsafeFile)
    assert f"folder {tmp_path / 'run'} is owned by uid {OTHER_UID}" in str(e.value)
    assert "mode 755" in str(e.value) and "Have it removed" in str(e.value)
    assert not (tmp_path / "run" / "logs").exists()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "include")})


def test_the_generation_worker_refuses_a_locks_folder_another_user_made(shared):
    locks = Path(str(shared.layout.locks_dir))
    locks.parent.mkdir()
    as_other_user_mkdir(locks)
    res = cli("generate", "run", "--config", shared.config_path, "--run-id", "r", "--shard", "0")
    assert res.returncode == 2, res.stderr
    assert f"folder {locks} is owned by uid {OTHER_UID}" in res.stderr and os.listdir(locks) == []


# -- server info files: read the way pid records are -----------------------------------------------------------

def _info(run: LocalRun, url: str = "http://127.0.0.1:9") -> Path:
    path = Path(str(run.layout.generate_server_info_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"backend": "hf", "mode": "generate", "url": url, "pid": 1}))
    os.chmod(path, 0o644)
    return path


def _spoil(path: Path, how: str, tmp_path: Path) -> str:
    """The info file made untrustworthy ``how``; what the refusal says."""
    if how == "another user's":
        needs_root()
        os.chown(path, OTHER_UID, OTHER_UID)
        return f"owned by uid {OTHER_UID}"
    if how == "group-writable":
        os.chmod(path, 0o664)
        return "writable by group or others (mode 664)"
    real = tmp_path / "planted.json"
    os.replace(path, real)
    os.symlink(real, path)
    return "is a symbolic link"


@pytest.mark.parametrize("how", ["another user's", "group-writable", "a symlink"])
def test_the_generation_worker_takes_no_url_from_an_info_file_that_is_not_ours(shared, tmp_path, how):
    path = _info(shared, "http://127.0.0.1:9/attacker")
    says = _spoil(path, how, tmp_path)
    res = cli("generate", "run", "--config", shared.config_path, "--run-id", "r", "--shard", "0")
    assert res.returncode != 0, res.stderr
    assert f"no generation server recorded at {path}" in res.stderr and says in res.stderr, res.stderr
    with pytest.raises(UnsafeFile, match=says.replace("(", r"\(").replace(")", r"\)")):
        server_url_in(str(path))


def test_an_info_file_of_ours_still_names_the_server(shared):
    path = _info(shared)
    assert server_url_in(str(path)) == "http://127.0.0.1:9"
    assert Node.read_owned_text(shared.node, str(path)) == path.read_text()   # the remote command, run here
    assert Node.read_owned_text(shared.node, str(path) + ".absent") is None


@pytest.mark.parametrize("how", ["another user's", "group-writable", "a symlink"])
def test_the_control_planes_readiness_look_refuses_an_info_file_that_is_not_ours(shared, tmp_path, how):
    rec, _ = _start(shared, "generate_server")
    try:
        path = _info(shared)
        says = _spoil(path, how, tmp_path)
        state, info, detail = check_server_ready(shared, "generate_server", str(path), "generate",
                                                 "generation server", 1.0)
        assert (state, info) == ("loading", None) and f"{path} refused" in detail and says in detail, detail
        for read in (shared.node.read_owned_text, lambda p: Node.read_owned_text(shared.node, p)):
            with pytest.raises(NodeFileRefused, match=f"on node gpu-node-3: .*{says[:20]}"):
                read(str(path))
    finally:
        _stop(shared, "generate_server")


def test_server_info_files_are_written_not_group_writable_whatever_the_umask(tmp_path):
    from eagleflow.engines.hf.server import write_info_file
    old = os.umask(0o002)
    try:
        write_info_file(str(tmp_path / "capture_server.json"), {"url": "http://127.0.0.1:1"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "capture_server.json").stat().st_mode) == 0o644
    assert server_url_in(str(tmp_path / "capture_server.json")) == "http://127.0.0.1:1"


@pytest.mark.slow
def test_over_ssh_info_files_are_read_as_ours_and_detach_refuses_another_users_folder(shared, tmp_path, sshd,
                                                                                      monkeypatch):  # noqa: F811
    """The same two checks through SSHNode over a real sshd: the remote `python -m eagleflow.durable
    --read-owned` and the remote detach with --owned-root."""
    from eagleflow.nodes.ssh import SSHNode
    monkeypatch.setenv("AIRFLOW_CONN_RUN_FOLDERS_TEST", sshd.airflow_conn())
    path = _info(shared)
    with SSHNode("run_folders_test", name="gpu-node-3", python=sys.executable) as node:
        assert node.read_owned_text(str(path)) == path.read_text()
        assert node.read_owned_text(str(path) + ".absent") is None
        os.chmod(path, 0o664)
        with pytest.raises(NodeFileRefused, match=r"on node gpu-node-3: .*writable by group or others \(mode 664\)"):
            node.read_owned_text(str(path))
        ssh_run = LocalRun(cfg=shared.cfg, layout=shared.layout, config_path=shared.config_path, _node=node)
        locks = Path(str(shared.layout.locks_dir))
        locks.parent.mkdir()
        as_other_user_mkdir(locks)
        with pytest.raises(NodeCommandFailed, match=rf"folder {locks} is owned by uid {OTHER_UID}"):
            _start(ssh_run)
        assert os.listdir(locks) == []
