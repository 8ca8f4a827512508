"""FreeGpusOperator over SSH with real processes: ours stopped, a foreign one only with force."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eagleflow.airflow.runtime import RunContext
from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario
from tests.fixtures.processes import IGNORE_TERM, alive
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)
from tests.integration.gpu_run_config import write_gpu_config

pytestmark = [pytest.mark.slow]

@pytest.mark.timeout(120)
def test_free_gpus_operator(sshd, monkeypatch, tmp_path):  # noqa: F811
    from eagleflow.airflow.gpu_operators import FreeGpusOperator
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    monkeypatch.setenv("EAGLEFLOW_ALLOW_FORCE_FREE", "1")  # this deployment lets the Param force-free (below)
    cfg_path = write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test", run_root=tmp_path / "runs")
    params = {"config_path": str(cfg_path)}
    ctx = RunContext.from_params(params, "free_test")
    # two processes the pipeline started on the node (recorded), one of them ignoring SIGTERM
    server = ctx.node.spawn_detached([sys.executable, "-c", "import time; time.sleep(600)"], role="capture_server",
                                     pid_file=str(ctx.layout.pid_file("capture_server")),
                                     log_file=str(ctx.layout.log_file("capture_server")))
    trainer = ctx.node.spawn_detached([sys.executable, "-c", IGNORE_TERM], role="trainer",
                                      pid_file=str(ctx.layout.pid_file("trainer")),
                                      log_file=str(ctx.layout.log_file("trainer")))
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        for _ in range(100):  # the trainer ignores SIGTERM only once its handler is installed
            if "ready" in (ctx.node.read_text(str(ctx.layout.log_file("trainer"))) or ""):
                break
            time.sleep(0.05)
        write_scenario(sshd.env["FAKE_NVIDIA_SMI_SCENARIO"], {
            "gpus": [gpu(0, 1), gpu(1, 1)],
            "processes": [proc(server.pid, 0, 40000, "python3 -m eagleflow.capture.server", live=True),
                          proc(trainer.pid, 1, 30000, "torchrun", live=True),
                          proc(foreign.pid, 1, 500, "someone else's notebook", live=True)]})

        op = FreeGpusOperator(task_id="free_gpus")
        report = op.execute({"params": params, "run_id": "free_test"})
        outcomes = {o["pid"]: o["outcome"] for o in report["outcomes"]}
        assert outcomes[server.pid] == "terminated" and outcomes[trainer.pid] == "killed"
        assert outcomes[foreign.pid] == "left_running"
        assert not alive(server.pid) and not alive(trainer.pid) and foreign.poll() is None
        assert ctx.node.read_text(str(ctx.layout.pid_file("trainer"))) is None  # record removed

        # with force the foreign process on a selected GPU goes too, then the GPUs read idle
        op = FreeGpusOperator(task_id="free_gpus_forced")
        report = op.execute({"params": {**params, "force_free_gpus": True}, "run_id": "free_test"})
        assert [(o["pid"], o["outcome"], o["foreign"]) for o in report["outcomes"]] == [(foreign.pid, "terminated", True)]
        assert foreign.wait(timeout=5) is not None
    finally:
        ctx.close()
        for pid in (server.pid, trainer.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if foreign.poll() is None:
            foreign.kill()
            foreign.wait()
        write_scenario(sshd.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(0)], "processes": []})
