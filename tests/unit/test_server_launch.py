"""The launch steps every capture engine shares (serving/launch.py): the child started in our process
group, healthy, a self-check dump verified under the run's key, then the info file; a child that dies while
loading leaves no info file and exit 4. The child here is our own hf capture server (the same /health_generate
and /generate, the same dump format and key), so every step runs for real without a GPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.capture_corpus import write_run_config

pytestmark = [pytest.mark.slow]

LAUNCHER = """
import json, sys
from eagleflow.serving.launch import prepare_dumps, run_capture_server
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
cfg = load_config(sys.argv[1]); layout = RunLayout.for_run(cfg, "launch")
dumps, key = prepare_dumps(cfg, layout)
argv = json.loads(sys.argv[2])
sys.exit(run_capture_server(argv, dict(__import__("os").environ), engine="stub", url=sys.argv[3], ready_timeout_s=90,
                            dump_dir=dumps, dump_key=key, missing_dump_hint="no hook", appear_within_s=5.0,
                            info_file=sys.argv[4], info={"backend": "stub", "model": "m"}))
"""


def _launch(cfgp: Path, child: list[str], url: str, info: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(cfgp), json.dumps(child), url, str(info)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.timeout(240)
def test_a_healthy_child_passes_the_self_check_then_its_info_is_written_and_a_term_stops_both(tmp_path, demo_assets):
    from eagleflow.airflow.deploy.standalone import free_port
    port = free_port()
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], port=port)
    child = [sys.executable, "-m", "eagleflow.cli", "capture", "serve", "--backend", "hf", "--config", str(cfgp),
             "--run-id", "launch"]
    info = tmp_path / "info.json"
    launcher = _launch(cfgp, child, f"http://127.0.0.1:{port}", info)
    try:
        deadline = time.monotonic() + 200
        while not info.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert info.exists(), launcher.communicate(timeout=30)
        written = json.loads(info.read_text())
        assert written["url"] == f"http://127.0.0.1:{port}" and written["backend"] == "stub"
        assert written["dump_dir"] and not list(Path(written["dump_dir"]).glob("selfcheck*"))   # checked, removed
        pid = written["pid"]
        os.kill(pid, 0)                                           # the recorded pid is the live child
        assert os.getpgid(pid) == os.getpgid(launcher.pid)        # in the launcher's group: a group signal stops both
        launcher.send_signal(signal.SIGTERM)                      # forwarded to the child
        launcher.wait(timeout=60)
        with pytest.raises(ProcessLookupError):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.timeout(120)
def test_a_child_that_dies_while_loading_is_exit_4_with_its_code_and_no_info(tmp_path, demo_assets):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"])
    info = tmp_path / "info.json"
    launcher = _launch(cfgp, [sys.executable, "-c", "import sys; sys.exit(3)"], "http://127.0.0.1:9", info)
    out, err = launcher.communicate(timeout=100)
    assert launcher.returncode == 4, err
    assert "eagleflow capture serve (stub): stub exited with code 3 while loading" in err
    assert not info.exists()


@pytest.mark.timeout(240)
def test_a_healthy_child_that_writes_no_dump_fails_the_self_check_and_is_stopped(tmp_path, demo_assets):
    """Our hf server in serving mode answers /health_generate and /generate but captures nothing: the launch
    must refuse it (exit 4, naming the missing dump and the engine's hint) and stop it, never write its info."""
    import yaml

    from eagleflow.airflow.deploy.standalone import free_port
    port = free_port()
    cfgp = write_run_config(tmp_path, demo_assets["target_model"])
    data = yaml.safe_load(cfgp.read_text())
    data.setdefault("generate", {})["port"] = port
    cfgp.write_text(yaml.safe_dump(data))
    child = [sys.executable, "-m", "eagleflow.cli", "generate", "serve", "--config", str(cfgp), "--run-id", "launch"]
    info = tmp_path / "info.json"
    launcher = _launch(cfgp, child, f"http://127.0.0.1:{port}", info)
    try:
        out, err = launcher.communicate(timeout=200)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 4, err
    assert "stub answered the self-check request" in err and "but no dump is at" in err and "no hook" in err, err
    assert not info.exists()
    with pytest.raises(ProcessLookupError):   # the child was stopped with the launch (its whole group)
        os.killpg(launcher.pid, 0)
