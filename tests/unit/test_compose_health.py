"""docker-compose.yaml: every long-running part has a health check and a restart policy (issue 27 item 3).

Compose is not run here; the file is parsed (PyYAML) and each service checked: what its health check runs
must fit the part (the scheduler's own health server, `airflow jobs check` of the part's job type, a Celery
ping of this worker), and a part that exits is restarted.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yaml"
ONE_SHOT = {"airflow-init"}   # migrates and creates the pools, then exits: nothing to keep healthy


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _check_cmd(svc: dict) -> list[str]:
    test = svc["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), test
    return test[1:] if test[0] == "CMD" else shlex.split(test[1].replace("$$", "$"))


def test_every_long_running_part_has_a_health_check_and_restarts():
    services = _services()
    assert set(services) - ONE_SHOT, "no services parsed"
    for name, svc in services.items():
        if name in ONE_SHOT:
            assert svc.get("restart") == "no", f"{name}: a one-shot must not be restarted in a loop"
            continue
        hc = svc.get("healthcheck")
        assert hc and hc.get("test"), f"{name}: no healthcheck"
        assert hc.get("interval") and int(hc.get("retries", 0)) >= 1, f"{name}: healthcheck needs interval/retries"
        assert _check_cmd(svc), f"{name}: empty health check command"
        assert svc.get("restart") in ("always", "unless-stopped"), f"{name}: restart is {svc.get('restart')!r}"


def test_each_airflow_part_is_checked_for_what_it_is():
    services = _services()
    env = yaml.safe_load(COMPOSE.read_text())["x-airflow-common"]["environment"]
    job_types = {"airflow-triggerer": "TriggererJob", "airflow-dag-processor": "DagProcessorJob"}
    for name, job_type in job_types.items():
        assert _check_cmd(services[name])[:3] == ["airflow", "jobs", "check"], name
        cmd = _check_cmd(services[name])
        assert cmd[cmd.index("--job-type") + 1] == job_type and "--local" in cmd, name
    # the scheduler's own health server answers only when it is switched on
    assert str(env["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"]).lower() == "true"
    assert _check_cmd(services["airflow-scheduler"]) == ["curl", "--fail", "http://localhost:8974/health"]
    assert "/api/v2/" in _check_cmd(services["airflow-apiserver"])[-1]
    for name, svc in services.items():
        if name.startswith("airflow-worker-"):
            cmd = _check_cmd(svc)
            assert cmd[:4] == ["celery", "--app", "airflow.providers.celery.executors.celery_executor.app",
                               "inspect"] and "ping" in cmd and "celery@${HOSTNAME}" in cmd, (name, cmd)
    # gpu_node_health reads Airflow's health where the workers reach the API server
    assert env["EAGLEFLOW_AIRFLOW_HEALTH_URL"] == "http://airflow-apiserver:8080"
    assert services["airflow-apiserver"]["command"] == "api-server"
