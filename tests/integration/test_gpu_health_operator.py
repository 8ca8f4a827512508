"""gpu_node_health's operator against the fake node over SSH: the seeds' incident is caught, our own job is not."""
from __future__ import annotations

import sys
import time
from datetime import timedelta

import pytest

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes.ssh import SSHNode
from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)
from tests.integration.gpu_run_config import write_gpu_config

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(120)
def test_health_alerts_on_held_idle_memory_not_on_our_job(sshd, monkeypatch, tmp_path):  # noqa: F811
    from eagleflow.airflow.gpu_operators import GpuNodeHealthOperator, GpuNodeUnhealthy
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    scenario = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    cfg_path = write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test", run_root=tmp_path / "runs")
    params = {"config_paths": [str(cfg_path)], "memory_threshold_mib": 1024, "window_s": 1}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    try:
        write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0), gpu(1, 1)],
                                  "processes": [proc(4242, 0, 89990, "python3 -m sglang.launch_server")]})
        assert op.execute({"params": params}) == {"nodes_checked": 1}  # first sighting starts the window
        time.sleep(1.2)
        with pytest.raises(GpuNodeUnhealthy) as e:
            op.execute({"params": params})
        assert "GPU 0 (GPU-00000000-1111-2222-3333-444455556666): 90000 MiB held at 0 % utilisation" in str(e.value)
        assert "pid 4242" in str(e.value)

        # the same picture, but the process belongs to a job eagleflow recorded: the watchdog's business
        cfg = load_config(cfg_path)
        layout = RunLayout.for_run(cfg, "health")
        with SSHNode("gpu_node_test", python=sys.executable) as node:
            job = node.spawn_detached([sys.executable, "-c", "import time; time.sleep(600)"], role="capture_server",
                                      pid_file=str(layout.pid_file("capture_server")),
                                      log_file=str(layout.log_file("capture_server")))
            try:
                write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0)],
                                          "processes": [proc(job.pid, 0, 89990, "python3", live=True)]})
                op.execute({"params": params})
                time.sleep(1.2)
                assert op.execute({"params": params}) == {"nodes_checked": 1}
            finally:
                node.stop_recorded(job.pid_file, grace_s=2)
    finally:
        write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})


def test_health_dag_parses_with_its_schedule(monkeypatch):
    import importlib.util
    from pathlib import Path
    monkeypatch.setenv("EAGLEFLOW_GPU_HEALTH_EVERY_MIN", "2")
    path = Path(__file__).resolve().parents[2] / "dags" / "gpu_node_health.py"
    spec = importlib.util.spec_from_file_location("gpu_node_health_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.dag.schedule == timedelta(minutes=2)
    assert "on_failure_callback" in mod.dag.default_args
    assert [t.task_id for t in mod.dag.tasks] == ["check_gpu_nodes"]
