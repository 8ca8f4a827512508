"""Test-wide setup: a private Airflow home (SQLite) per test session, and shared fixtures.

Airflow reads its settings when first imported, so the environment is set here,
at import time, before any test module imports airflow.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_home = os.environ.get("EAGLEFLOW_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix="eagleflow-airflow-")
os.environ["AIRFLOW_HOME"] = _home
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_home}/airflow.db"
os.environ.setdefault("AIRFLOW__CORE__PARALLELISM", "4")
# as in every eagleflow deployment (home.py, docker-compose.yaml): long waits defer to the triggerer
os.environ.setdefault("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "True")
os.environ.setdefault("EAGLEFLOW_HOME", str(REPO))  # relative config paths resolve against the checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the venv's bin first: Airflow starts its parts as `airflow` from PATH
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture(scope="session", autouse=True)
def config_dirs_for_tests(tmp_path_factory):
    """Tests write their configs under the session's temp folder and name them in DAG Params: allow that
    folder besides configs/, as a deployment would allow its own (EAGLEFLOW_CONFIG_DIRS). The security tests
    narrow it again to show what is refused."""
    dirs = os.pathsep.join([str(REPO / "configs"), str(tmp_path_factory.getbasetemp())])
    old = os.environ.get("EAGLEFLOW_CONFIG_DIRS")
    os.environ["EAGLEFLOW_CONFIG_DIRS"] = dirs
    yield dirs
    if old is None:
        os.environ.pop("EAGLEFLOW_CONFIG_DIRS", None)
    else:
        os.environ["EAGLEFLOW_CONFIG_DIRS"] = old


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """A migrated SQLite metadata DB in this session's Airflow home (needed by dag.test())."""
    marker = Path(_home) / ".migrated"
    if not marker.exists():
        subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], check=True,
                       capture_output=True, env=os.environ.copy(), timeout=300)
        marker.touch()
    return _home


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> dict:
    """Tiny tokenizer, tiny random Llama and three small sources, built locally once per session.

    The target keeps its random weights here (the demo fits it to its rules): tests that
    check learning build their own learnable data."""
    from eagleflow.demo_assets import ensure_demo_assets
    cache = Path(os.environ.get("EAGLEFLOW_TEST_ASSETS") or REPO / ".cache" / "test-assets")
    cache.mkdir(parents=True, exist_ok=True)
    # pytest-xdist's workers share this cache: the first builds it, the others wait on the lock and read it
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_demo_assets(cache, n_per_source=24, fit_target=False)
