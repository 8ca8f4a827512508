"""The scale-out deployment file: checked by `docker compose config` where the client
exists (no engine needed), and always parsed and checked for its services and mounts."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"


def _services(doc: dict) -> dict:
    return doc["services"]


def test_compose_services_and_mounts():
    doc = yaml.safe_load(COMPOSE.read_text())
    services = _services(doc)
    for name in ("postgres", "redis", "airflow-init", "airflow-apiserver", "airflow-scheduler",
                 "airflow-dag-processor", "airflow-triggerer", "airflow-worker-default", "airflow-worker-gpu-node-1"):
        assert name in services, f"docker-compose.yaml lacks service {name}"
    common = doc["x-airflow-common"]
    assert common["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert "redis://" in common["environment"]["AIRFLOW__CELERY__BROKER_URL"]
    assert "postgresql" in common["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    mounts = {m.split(":")[1] for m in common["volumes"] if isinstance(m, str)}
    assert {"/opt/eagleflow/dags", "/opt/eagleflow/plugins", "/opt/eagleflow/include"} <= mounts
    assert "--queues gpu-node-1" in services["airflow-worker-gpu-node-1"]["command"]
    for m in common["volumes"]:
        src = m.split(":")[0]
        if src.startswith("./") and not src.startswith("./.ssh"):
            assert (REPO / src).exists(), f"mounted path {src} does not exist in the repo"


def _compose_cmd() -> list[str] | None:
    """`docker compose` (plugin) or `docker-compose` (Debian's package, installed by .ci/run)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose_cmd() is None, reason="no docker compose client on this machine")
def test_docker_compose_config_validates():
    res = subprocess.run([*_compose_cmd(), "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
