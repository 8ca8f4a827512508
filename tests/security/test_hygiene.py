"""Issue 38, item 8 (hygiene): compose without secrets, run names that are no option, config values not echoed.

- docker-compose.yaml held `POSTGRES_PASSWORD: airflow` (and in both DSNs), Redis had no password, the API was
  published on every interface, and neither `.env` nor the `./.ssh` key folder it mounts were git-ignored.
- A run named `-rf` was accepted, then read as an option by the node's commands (`--run-id -rf`).
- A wrongly typed known key in a YAML under configs/ had its value echoed in the error.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagleflow.config import ConfigError, load_config
from eagleflow.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
SECRETS = ("AIRFLOW_JWT_SECRET", "POSTGRES_PASSWORD", "REDIS_PASSWORD")
_REQUIRED = re.compile(r"\$\{(\w+):\?[^}]*\}")


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def test_compose_holds_no_password_and_asks_for_each_one():
    text = COMPOSE.read_text()
    doc = yaml.safe_load(text)
    env = doc["x-airflow-common"]["environment"]
    pg = doc["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert _REQUIRED.fullmatch(pg) and _REQUIRED.fullmatch(pg).group(1) == "POSTGRES_PASSWORD"
    for key in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__RESULT_BACKEND"):
        assert "airflow:${POSTGRES_PASSWORD:?" in env[key], (key, env[key])
    assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://:${REDIS_PASSWORD:?")
    redis = doc["services"]["redis"]
    assert redis["command"][:2] == ["redis-server", "--requirepass"]
    assert _REQUIRED.fullmatch(redis["command"][2]).group(1) == "REDIS_PASSWORD"
    # no user:password@ with a literal password anywhere
    assert not re.search(r"://[^:/@\s]*:(?!\$\{)[^@\s]+@", text)
    assert doc["services"]["airflow-apiserver"]["ports"] == ["${AIRFLOW_BIND:-127.0.0.1}:8080:8080"]


def test_the_env_example_documents_every_required_variable_and_holds_no_secret():
    asked = set(_REQUIRED.findall(COMPOSE.read_text()))
    assert set(SECRETS) <= asked
    example = _example()
    assert asked <= set(example), f"not in .env.example: {sorted(asked - set(example))}"
    for name in asked:
        assert example[name] == "", f".env.example: {name} must be left empty (a placeholder), not a value"
    assert example["AIRFLOW_BIND"] == "127.0.0.1"


@pytest.mark.parametrize("path", [".env", ".ssh/id_ed25519", ".ssh/known_hosts"])
def test_the_env_file_and_the_ssh_key_folder_are_git_ignored(path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    res = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=REPO, timeout=30)
    assert res.returncode == 0, f"{path} is not ignored by .gitignore"
    res = subprocess.run(["git", "check-ignore", "--no-index", "-q", ".env.example"], cwd=REPO, timeout=30)
    assert res.returncode == 1, ".env.example is the committed template: it must not be ignored"


@pytest.mark.skipif(_compose_cmd() is None and not os.environ.get("CI"),
                    reason="no docker compose client on this machine (CI installs docker-compose)")
def test_docker_compose_refuses_each_missing_secret_and_publishes_the_api_on_loopback(tmp_path):
    cmd = _compose_cmd()
    assert cmd is not None, "no docker compose client: apt-get install docker-compose (.ci/run does)"
    base = {k: v for k, v in os.environ.items() if k not in SECRETS and k != "AIRFLOW_BIND"}

    def config(env_file: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*cmd, "--env-file", str(env_file), "-f", str(COMPOSE), "config"], capture_output=True,
                              text=True, cwd=REPO, timeout=60, env=base)

    # .env.example copied as it is: refused, naming what to set
    as_shipped = tmp_path / "as-shipped.env"
    shutil.copy(ENV_EXAMPLE, as_shipped)
    res = config(as_shipped)
    assert res.returncode != 0 and re.search("|".join(SECRETS), res.stderr), res.stderr
    filled = {**_example(), **{name: f"{name.lower()}-0123456789abcdef" for name in SECRETS}}
    for missing in SECRETS:
        env_file = tmp_path / f"without-{missing}.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in filled.items() if k != missing))
        res = config(env_file)
        assert res.returncode != 0 and missing in res.stderr, (missing, res.stderr)
    env_file = tmp_path / "filled.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in filled.items()))
    res = config(env_file)
    assert res.returncode == 0, res.stderr
    resolved = yaml.safe_load(res.stdout)
    worker = resolved["services"]["airflow-worker-default"]["environment"]
    assert worker["AIRFLOW__CELERY__BROKER_URL"] == f"redis://:{filled['REDIS_PASSWORD']}@redis:6379/0"
    assert f"airflow:{filled['POSTGRES_PASSWORD']}@postgres" in worker["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert resolved["services"]["redis"]["command"][-1] == filled["REDIS_PASSWORD"]
    ports = resolved["services"]["airflow-apiserver"]["ports"]
    published = [p if isinstance(p, str) else f"{p.get('host_ip')}:{p.get('published')}:{p.get('target')}"
                 for p in ports]
    assert all(p.startswith("127.0.0.1:") for p in published), published


# --- run names ----------------------------------------------------------------------------------------------

def _config(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    src = tmp_path / "a.jsonl"
    src.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}\n')
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"run_root": str(tmp_path / "runs"), "target_model": str(model),
                                    "node": {"name": "local", "has_gpu": False},
                                    "corpus": {"sources": [{"name": "a", "path": str(src)}]}}))
    return path


@pytest.mark.parametrize("name", ["-rf", "--help", "-"])
def test_a_run_name_starting_with_a_dash_is_refused_naming_field_and_value(tmp_path, name):
    cfgp = _config(tmp_path)
    with pytest.raises(ConfigError, match=rf"run id = {re.escape(repr(name))}: a run name may not start with '-'"):
        RunLayout.for_run(load_config(cfgp), name)
    # the real CLI, the name given as --run-id=NAME (the one way argparse takes it): refused, nothing made
    res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "corpus", "prepare", "--config", str(cfgp),
                          f"--run-id={name}"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stderr
    assert f"--run-id = {name!r}: a run name may not start with '-'" in res.stderr, res.stderr
    assert not (tmp_path / "runs" / name).exists()


def test_names_with_a_dash_inside_still_work(tmp_path):
    cfg = load_config(_config(tmp_path))
    assert RunLayout.for_run(cfg, "exp-01").run_id == "exp-01"


# --- config values are never echoed -------------------------------------------------------------------------

def test_a_wrongly_typed_known_key_is_named_with_its_expected_type_never_its_value(tmp_path):
    secret = "hunter2-Sup3rSecret"
    cfgp = tmp_path / "configs" / "node.yaml"
    cfgp.parent.mkdir()
    # a password pasted into the wrong key, a section given as text, a literal out of its choices
    cfgp.write_text(yaml.safe_dump({"target_model": "/m", "capture": {"port": secret, "backend": secret + "-b"},
                                    "watchdog": secret + "-w", "gpu": {"force_free": [secret]}}))
    with pytest.raises(ConfigError) as e:
        load_config(cfgp)
    msg = str(e.value)
    assert secret not in msg, msg
    assert str(cfgp) in msg
    assert re.search(r"capture\.port: Input should be a valid integer.*\(got a value of type str, not shown\)", msg)
    assert re.search(r"capture\.backend: Input should be 'hf' or 'sglang'", msg)
    assert re.search(r"watchdog: Input should be (a valid dictionary|an object)", msg), msg
    assert re.search(r"gpu\.force_free: Input should be a valid boolean.*type list", msg), msg
