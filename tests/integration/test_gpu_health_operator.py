"""gpu_node_health's operator against the fake node over SSH: the seeds' incident is caught, our own job is not."""
from __future__ import annotations

import re
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import yaml

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes.ssh import SSHNode
from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario
from tests.fixtures.smtp import SmtpSink, body_text
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)
from tests.integration.gpu_run_config import write_gpu_config

pytestmark = [pytest.mark.slow]


PARAMS = {"memory_threshold_mib": 1024, "window_s": 1, "unreachable_after_s": 60, "remind_after_s": 3}
REMIND_AFTER_S = 12


def _context(params):
    ti = SimpleNamespace(dag_id="gpu_node_health", run_id="scheduled__2026-12-01T07:00:00+00:00",
                         task_id="check_gpu_nodes", map_index=-1, try_number=1)
    return {"params": params, "ti": ti, "run_id": ti.run_id}


@pytest.mark.timeout(180)
def test_one_incident_one_mail_a_backed_off_reminder_and_a_resolved_mail(sshd, monkeypatch, tmp_path):  # noqa: F811
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator, HealthIncidentsOpen
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.corp.example")
    scenario = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    cfg_path = write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test", run_root=tmp_path / "runs")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["watchdog"] = {"alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_test"}
    cfg_path.write_text(yaml.safe_dump(cfg))
    # each check also reads Airflow's health at the (unresolvable) base URL: ~1.5 s a check at load 10, so the
    # three checks before the reminder need more than the module's 3 s (a reminder came inside them at stop 48)
    params = {"config_paths": [str(cfg_path)], **PARAMS, "remind_after_s": REMIND_AFTER_S}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_test").items():
            monkeypatch.setenv(k, v)
        try:
            write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0), gpu(1, 1)],
                                      "processes": [proc(4242, 0, 89990, "python3 -m sglang.launch_server "
                                                                         "--model-path /models/kimi-k2.5")]})
            assert op.execute(_context(params)) == {"nodes_checked": 1, "incidents_open": 0}  # the window starts
            time.sleep(1.2)
            for _ in range(3):   # three checks, one incident, one mail
                with pytest.raises(HealthIncidentsOpen) as e:
                    op.execute(_context(params))
                assert "fake-gpu-node: 1 GPU holds 88 GiB at 0 % for" in str(e.value)
            opened = smtp.wait_for()
            assert len(smtp.messages) == 1
            assert re.fullmatch(r"\[eagleflow\] fake-gpu-node: 1 GPU holds 88 GiB at 0 % for \d s", opened["Subject"])
            parts = {p.get_content_type(): p.get_content() for p in opened.iter_parts()}
            assert set(parts) == {"text/plain", "text/html"}
            for body in parts.values():
                assert "GPU 0 (GPU-00000000-1111-2222-3333-444455556666): 90000 MiB of" in body
                assert "pid 4242 `python3`" in body and "sglang" not in body and "/models/" not in body
                assert "https://airflow.corp.example/plugin/eagleflow-gpu" in body
                assert "https://airflow.corp.example/dags/gpu_node_health/runs/" in body
            thread = opened["Message-ID"]
            assert thread.startswith("<eagleflow-incident-")

            time.sleep(REMIND_AFTER_S + 0.2)   # past remind_after_s: one reminder, then the next only after twice as long
            for _ in range(2):
                with pytest.raises(HealthIncidentsOpen):
                    op.execute(_context(params))
            reminder = smtp.wait_for(lambda m: "reminder" in m["Subject"])
            assert len(smtp.messages) == 2 and reminder["In-Reply-To"] == thread
            assert f"(still open, reminder 1; next in {2 * REMIND_AFTER_S:.0f} s)" in reminder["Subject"]

            write_scenario(scenario, {"gpus": [gpu(0), gpu(1)], "processes": []})
            assert op.execute(_context(params)) == {"nodes_checked": 1, "incidents_open": 0}
            resolved = smtp.wait_for(lambda m: m["Subject"].startswith("[eagleflow] resolved"))
            assert resolved["Subject"].startswith(
                "[eagleflow] resolved: fake-gpu-node: GPU memory held at 0 % with no eagleflow job (open ")
            assert resolved["In-Reply-To"] == thread
            op.execute(_context(params))
            assert len(smtp.messages) == 3
        finally:
            write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})


@pytest.mark.timeout(120)
def test_health_alerts_on_held_idle_memory_not_on_our_job(sshd, monkeypatch, tmp_path):  # noqa: F811
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator, HealthIncidentsOpen
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    scenario = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    cfg_path = write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test", run_root=tmp_path / "runs")
    params = {"config_paths": [str(cfg_path)], **PARAMS}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    try:
        write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0), gpu(1, 1)],
                                  "processes": [proc(4242, 0, 89990, "python3 -m sglang.launch_server")]})
        assert op.execute(_context(params))["nodes_checked"] == 1  # first sighting starts the window
        time.sleep(1.2)
        with pytest.raises(HealthIncidentsOpen):   # no recipients configured: logged, the task still red
            op.execute(_context(params))
        write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})
        assert op.execute(_context(params))["incidents_open"] == 0

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
                op.execute(_context(params))
                time.sleep(1.2)
                assert op.execute(_context(params)) == {"nodes_checked": 1, "incidents_open": 0}
            finally:
                node.stop_recorded(job.pid_file, grace_s=2)
    finally:
        write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})


@pytest.mark.parametrize("field,value", [("window_s", 0), ("memory_threshold_mib", -1), ("remind_after_s", None)])
def test_zero_negative_or_missing_settings_are_refused_by_name(field, value, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator
    params = {"config_paths": [], **PARAMS, field: value}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    with pytest.raises(AirflowFailException, match=f"gpu_node_health Params: {field}={value!r} is not allowed: "
                                                   "it must be a number > 0"):
        op.execute(_context(params))
    assert not (tmp_path / "status").exists()   # refused before anything was read or written


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


def _local_cpu_config(tmp_path, smtp_conn_id):
    path = tmp_path / "cpu-box.yaml"
    path.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target_model": "unused",
        "node": {"name": "cpu-box", "has_gpu": False, "python": sys.executable, "state_dir": str(tmp_path / "state")},
        "watchdog": {"alert_emails": ["oncall@example.test"], "smtp_conn_id": smtp_conn_id}}))
    return path


@pytest.mark.timeout(120)
def test_a_broken_config_is_one_incident_mailed_to_the_other_configs_recipients(monkeypatch, tmp_path):
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator, HealthIncidentsOpen
    broken = tmp_path / "gpu-node-7.yaml"
    broken.write_text("node: {name: gpu-node-7, has_gpu: yes\n")   # unclosed mapping
    params = {"config_paths": [str(_local_cpu_config(tmp_path, "smtp_test")), str(broken)], **PARAMS}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_test").items():
            monkeypatch.setenv(k, v)
        for _ in range(2):
            with pytest.raises(HealthIncidentsOpen, match=f"node config {broken} cannot be read"):
                op.execute(_context(params))
        mail = smtp.wait_for()
        assert mail["Subject"] == f"[eagleflow] node config {broken} cannot be read" and len(smtp.messages) == 1
        assert smtp.recipients[0] == ["oncall@example.test"] and str(broken) in body_text(mail)
        broken.write_text(yaml.safe_dump({"run_root": str(tmp_path / "runs7"), "target_model": "unused",
                                          "node": {"name": "gpu-node-7", "has_gpu": False}}))
        assert op.execute(_context(params))["incidents_open"] == 0
        assert smtp.wait_for(lambda m: m["Subject"].startswith("[eagleflow] resolved: node config"))
        assert len(smtp.messages) == 2


@pytest.mark.timeout(120)
def test_an_smtp_outage_fails_the_check_loudly_naming_the_connection(monkeypatch, tmp_path):
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator
    dead = SmtpSink()   # a free port nobody listens on
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_DEAD", dead.airflow_conn_env("smtp_dead")["AIRFLOW_CONN_SMTP_DEAD"])
    broken = tmp_path / "broken.yaml"   # a config that exists but cannot be read: an incident to mail
    broken.write_text("node: {name: gpu-node-7\n")
    params = {"config_paths": [str(_local_cpu_config(tmp_path, "smtp_dead")), str(broken)], **PARAMS}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    with pytest.raises(RuntimeError, match=r"could not send:\n- opened mail of incident [0-9a-f]{12} \(node config "
                                           r".*broken.yaml cannot be read\).*ConnectionRefused(?s:.*)watchdog.smtp_conn_id"):
        op.execute(_context(params))


@pytest.mark.timeout(180)
def test_a_fleet_config_has_every_node_checked_and_named(sshd, monkeypatch, tmp_path):  # noqa: F811
    """One fleet config, two nodes: the training node here (no GPU) and gpu-node-2 over SSH holding the seeds'
    idle 88 GiB. Both reach the GPU view under their own names, and the incident and its mail name gpu-node-2."""
    from eagleflow.airflow.health_operators import GpuNodeHealthOperator, HealthIncidentsOpen
    from eagleflow.health.status_store import StatusStore
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    scenario = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    cfg = yaml.safe_load(write_gpu_config(tmp_path / "cfg.yaml", conn_id="gpu_node_test",
                                          run_root=tmp_path / "runs").read_text())
    del cfg["node"]
    cfg["fleet"] = {"training_node": "gpu-node-1", "nodes": [
        {"name": "gpu-node-1", "has_gpu": False, "python": sys.executable, "state_dir": str(tmp_path / "state-1")},
        {"name": "gpu-node-2", "conn_id": "gpu_node_test", "python": sys.executable, "has_gpu": True,
         "state_dir": str(tmp_path / "state-2")}]}
    cfg["watchdog"] = {"alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_fleet"}
    cfg_path = tmp_path / "fleet.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    params = {"config_paths": [str(cfg_path)], **PARAMS}
    op = GpuNodeHealthOperator(task_id="check_gpu_nodes", status_dir=str(tmp_path / "status"))
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_fleet").items():
            monkeypatch.setenv(k, v)
        try:
            write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0), gpu(1, 1)],
                                      "processes": [proc(4242, 0, 89990, "python3 -m sglang.launch_server")]})
            assert op.execute(_context(params)) == {"nodes_checked": 1, "incidents_open": 0}   # gpu-node-2's GPUs
            docs = {d["node"]: d for d in StatusStore(str(tmp_path / "status")).all()}
            assert set(docs) == {"gpu-node-1", "gpu-node-2"}, docs
            assert docs["gpu-node-1"]["has_gpu"] is False and docs["gpu-node-2"]["has_gpu"] is True
            assert [g["memory_used_mib"] for g in docs["gpu-node-2"]["gpus"]] == [90000, 1]
            time.sleep(1.2)
            with pytest.raises(HealthIncidentsOpen, match="gpu-node-2: 1 GPU holds 88 GiB at 0 %"):
                op.execute(_context(params))
            mail = smtp.wait_for()
            assert mail["Subject"].startswith("[eagleflow] gpu-node-2: 1 GPU holds 88 GiB at 0 % for ")
            assert "gpu-node-1" not in mail["Subject"] and len(smtp.messages) == 1
        finally:
            write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})
