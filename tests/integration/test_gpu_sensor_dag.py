"""GpuIdleSensor under dag.test() against the fake GPU node over a real sshd.

Two dag.test() runs: one where the gate passes (idle at once; deferred and
freed mid-wait; poke mode and freed mid-wait) and one where a foreign process
holds memory and the gate fails listing it. dag.test() needs its DAG in a DAG
bundle, so each test writes a small DAG file into its own bundle folder.
"""
from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)
from tests.integration.gpu_run_config import write_gpu_config

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

DAG_HEAD = '''
import sys, time
sys.path.insert(0, {repo!r})
from airflow.sdk import DAG, Param, task
from eagleflow.airflow.gpu_operators import GpuIdleSensor
from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario

SCENARIO = {scenario!r}
with DAG({dag_id!r}, schedule=None, catchup=False, params={{"config_path": Param({cfg!r}, type="string")}}) as dag:
'''

PASSING_BODY = '''
    IDLE = {"gpus": [gpu(0, 1), gpu(1, 3)], "processes": []}

    @task
    def occupy(seconds: float) -> float:
        """GPU 1 busy with a process that goes away `seconds` from now (the fake switches state)."""
        free_at = time.time() + seconds
        write_scenario(SCENARIO, {"gpus": [gpu(0, 1), gpu(1, 90000)],
                                  "processes": [proc(4242, 1, 89990, "python3 old_job.py")],
                                  "switch_at": free_at, "after": IDLE})
        return free_at

    first = GpuIdleSensor(task_id="idle_at_once", deferrable=True)
    busy_1 = occupy.override(task_id="occupy_1")(3.0)
    deferred = GpuIdleSensor(task_id="freed_while_deferred", deferrable=True)
    busy_2 = occupy.override(task_id="occupy_2")(3.0)
    poked = GpuIdleSensor(task_id="freed_while_poking", mode="poke")
    first >> busy_1 >> deferred >> busy_2 >> poked
'''

FAILING_BODY = '''
    @task
    def take_over_shards() -> list:
        return []   # no shard taken over: no server starts

    # the gates that guard nothing (no shard taken over; generate.enabled off) pass; the capture gate fails
    (take_over_shards()
     >> GpuIdleSensor(task_id="gpus_idle_before_takeover", deferrable=True, retries=0, guards="take_over_shards")
     >> GpuIdleSensor(task_id="gpus_idle_before_generation", deferrable=True, retries=0, phase="generate")
     >> GpuIdleSensor(task_id="gpus_idle", deferrable=True, retries=0))
'''


def load_dag(monkeypatch, folder: Path, dag_id: str, body: str, cfg: Path, scenario: str):
    source = DAG_HEAD.format(repo=str(REPO), scenario=scenario, dag_id=dag_id, cfg=str(cfg)) + body
    return load_bundle_dag(monkeypatch, folder, f"{dag_id}.py", source, keep_dags_folder=True)


@pytest.mark.timeout(300)
def test_gate_passes_when_idle_and_when_freed_mid_wait(airflow_db, sshd, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    scenario = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    cfg = write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test", run_root=tmp_path / "runs",
                           idle_timeout_s=60)
    write_scenario(scenario, {"gpus": [gpu(0, 1), gpu(1, 3)], "processes": []})
    dag = load_dag(monkeypatch, tmp_path / "bundle", "gpu_gate_passes", PASSING_BODY, cfg, scenario)
    dr = dag.test()
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert dr.state == "success", {k: v.state for k, v in tis.items()}
    for sensor, busy in (("freed_while_deferred", "occupy_1"), ("freed_while_poking", "occupy_2")):
        free_at = datetime.fromtimestamp(tis[busy].xcom_pull(task_ids=busy), timezone.utc)
        assert tis[sensor].end_date >= free_at, f"{sensor} passed while GPU 1 was still busy"


@pytest.mark.timeout(300)
def test_gate_fails_listing_the_foreign_process(airflow_db, sshd, monkeypatch, tmp_path, capfd):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    scenario = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    cfg = write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test", run_root=tmp_path / "runs",
                           idle_timeout_s=2)
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_scenario(scenario, {
            "gpus": [gpu(0, 1), gpu(1, 1)],
            "processes": [proc(foreign.pid, 1, 89990, "python3 -m vllm.entrypoints, tp=1", live=True)]})
        dag = load_dag(monkeypatch, tmp_path / "bundle", "gpu_gate_fails", FAILING_BODY, cfg, scenario)
        dr = dag.test()
        assert dr.state == "failed"
        states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
        assert states == {"take_over_shards": "success", "gpus_idle_before_takeover": "success",
                          "gpus_idle_before_generation": "success", "gpus_idle": "failed"}, states
        assert foreign.poll() is None  # a gate never kills
        out, err = capfd.readouterr()  # dag.test() logs the task's failure through structlog to stdout
        text = out + err
        assert "GPUs not idle before the gate's timeout" in text
        assert f"pid {foreign.pid} (" in text and "python3 -m vllm.entrypoints, tp=1" in text
        assert "GPU 1 (GPU-00000001-1111-2222-3333-444455556666): 89991 MiB used" in text
    finally:
        foreign.kill()
        foreign.wait()
        write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})
