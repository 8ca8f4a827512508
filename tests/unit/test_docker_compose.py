"""docker-compose.yaml mirrors the scale-out deployment that tests/integration/test_fleet_celery.py runs.

Both come from eagleflow.airflow.deploy.scaleout: the same parts with the same `airflow` commands, the same
CeleryExecutor/Postgres/Redis settings, a worker bound to the queue the example GPU node's config names
and that node's pool created at init. Checked by `docker compose config` / `docker-compose config`
where a client exists (no engine needed; .ci/run installs Debian's docker-compose), and always parsed.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from eagleflow.airflow.deploy.scaleout import GpuNodeRoute, celery_env, components, init_commands
from eagleflow.config import load_config

pytestmark = pytest.mark.slow  # runs docker-compose config in a subprocess

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"


# what a filled-in .env holds (the file itself names only the variables: docker-compose.yaml holds no secret)
SECRETS = {"AIRFLOW_JWT_SECRET": "x" * 32, "POSTGRES_PASSWORD": "pg" * 16, "REDIS_PASSWORD": "rd" * 16}


def _doc() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolated(value: str) -> str:
    """``${VAR:?why}`` / ``${VAR:-default}`` / ``${VAR}`` as compose fills them from SECRETS."""
    def one(m: re.Match) -> str:
        name, op, rest = m.group(1), m.group(2), m.group(3)
        return SECRETS.get(name) or (rest if op == ":-" else "")
    return re.sub(r"\$\{(\w+)(?:(:[?-])([^}]*))?\}", one, value)


def _example_nodes() -> list[GpuNodeRoute]:
    """Every node of the fleet the deployment's config names (a pool per node, its GPU slots in size)."""
    env = _doc()["x-airflow-common"]["environment"]
    assert env["EAGLEFLOW_HOME"] == "/opt/eagleflow"
    cfg = load_config(REPO / env["EAGLEFLOW_CONFIG"])  # relative: against EAGLEFLOW_HOME, the repo in the image
    assert len(cfg.fleet.nodes) >= 2, "the deployment shows a fleet of at least two GPU nodes"
    out = []
    for n in cfg.fleet.nodes:
        assert n.queue and n.pool, f"fleet node {n.name} must name its queue and pool"
        out.append(GpuNodeRoute(queue=n.queue, pool=n.pool, pool_slots=n.gpu_slots))
    return out


def test_compose_runs_exactly_the_scaleout_parts():
    doc = _doc()
    services = doc["services"]
    parts = components(_example_nodes())
    assert set(services) == {"postgres", "redis", "airflow-init", *parts}
    for name, args in parts.items():
        command = services[name]["command"]
        assert (shlex.split(command) if isinstance(command, str) else command) == args, name
    init = services["airflow-init"]["command"][0]
    assert [shlex.split(step) for step in init.split("&&")] == [["airflow", *c] for c in init_commands(_example_nodes())]


def test_compose_settings_are_the_scaleout_settings():
    env = _doc()["x-airflow-common"]["environment"]
    pg, rd = SECRETS["POSTGRES_PASSWORD"], SECRETS["REDIS_PASSWORD"]
    want = celery_env(sql_alchemy_conn=f"postgresql+psycopg2://airflow:{pg}@postgres/airflow",
                      broker_url=f"redis://:{rd}@redis:6379/0",
                      result_backend=f"db+postgresql+psycopg2://airflow:{pg}@postgres/airflow",
                      execution_api_url="http://airflow-apiserver:8080/execution/")
    assert {k: _interpolated(str(env.get(k))) for k in want} == want
    assert "AIRFLOW__API_AUTH__JWT_SECRET" in env   # every part must sign and check the same task tokens
    services = _doc()["services"]
    assert services["postgres"]["image"].startswith("postgres:") and services["redis"]["image"].startswith("redis:")


def test_compose_mounts_exist():
    common = _doc()["x-airflow-common"]
    mounts = {m.split(":")[1] for m in common["volumes"] if isinstance(m, str)}
    assert {"/opt/eagleflow/dags", "/opt/eagleflow/plugins", "/opt/eagleflow/include",
            "/opt/eagleflow/configs"} <= mounts
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


@pytest.mark.skipif(_compose_cmd() is None and not os.environ.get("CI"),
                    reason="no docker compose client on this machine (CI installs docker-compose)")
def test_docker_compose_config_validates(tmp_path):
    cmd = _compose_cmd()
    assert cmd is not None, "no docker compose client: apt-get install docker-compose (.ci/run does)"
    # an empty env file: a developer's own .env beside the compose file must not fill in what is asked here
    no_env_file = tmp_path / "empty.env"
    no_env_file.write_text("")
    env = dict(os.environ, **SECRETS)
    res = subprocess.run([*cmd, "--env-file", str(no_env_file), "-f", str(COMPOSE), "config"], capture_output=True,
                         text=True, cwd=REPO, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    resolved = yaml.safe_load(res.stdout)
    nodes = _example_nodes()
    assert set(resolved["services"]) >= set(components(nodes))
    for node in nodes:
        worker = resolved["services"][f"airflow-worker-{node.queue}"]
        assert worker["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    # without the shared secret the deployment is refused, not started with a guessable one
    for secret in SECRETS:
        bare = {k: v for k, v in env.items() if k != secret}
        res = subprocess.run([*cmd, "--env-file", str(no_env_file), "-f", str(COMPOSE), "config", "--quiet"],
                             capture_output=True, text=True, cwd=REPO, timeout=60, env=bare)
        assert res.returncode != 0 and secret in res.stderr, (secret, res.stderr)
