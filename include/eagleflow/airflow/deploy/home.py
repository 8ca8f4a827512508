"""The checkout's own Airflow home: SQLite, examples off, dags/ and plugins/ of the repo.

Used by `make demo`, `make airflow` and the end-to-end tests, so all three run
Airflow the same way. Settings go through AIRFLOW__* environment variables
(they win over airflow.cfg), so nothing depends on a generated config file.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]

# A killed triggerer's watches: the supervisor (or compose's restart policy) starts a new triggerer within seconds,
# but Airflow hands it the dead one's triggers only once that one's last heartbeat is older than
# [triggerer] triggerer_health_check_threshold (Trigger.assign_unassigned, run at every loop of the new
# triggerer). Airflow's 5 s heartbeat and 30 s threshold left the watch blind for 111.6 s in the issue 52 drill
# (load 14-68 on 2 cores: the threshold, then a slow start). A heartbeat every 3 s, judged stale after 15 s (five
# missed beats), hands them over 12-15 s after the kill, so every watch looks again within
# WATCH_RESUME_BOUND_S of it: the threshold, the new triggerer's start (well inside the rest under load) and
# one look. The same threshold makes /api/v2/monitor/health and `airflow jobs check` call a triggerer unhealthy
# (gpu_node_health's incident) after 15 s without a beat. docker-compose.yaml sets the same (scaleout.celery_env).
TRIGGERER_SETTINGS = {
    "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "3",
    "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
}
WATCH_RESUME_BOUND_S = 60.0


def airflow_env(home: str | Path | None = None, *, parallelism: int = 4, extra: dict[str, str] | None = None) -> dict[str, str]:
    home = Path(home or os.environ.get("AIRFLOW_HOME") or REPO / "airflow_home").absolute()
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": str(parallelism),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        # sensors and watches wait in the triggerer, not in a worker slot (operators' deferrable default)
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        "EAGLEFLOW_HOME": str(REPO),  # relative config paths (Param config_path) resolve against the checkout
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # `airflow standalone` starts its parts as `airflow` from PATH
        "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
    })
    env.setdefault("EAGLEFLOW_CONFIG", str(REPO / "configs" / "local-demo.yaml"))
    for k, v in TRIGGERER_SETTINGS.items():   # a restarted triggerer resumes every watch within a minute
        env.setdefault(k, v)
    env.update(extra or {})
    if not home.exists():  # Airflow keeps its DB (connections, XComs) and the generated admin password here
        home.mkdir(parents=True, mode=0o700)
    return env


def airflow_bin() -> str:
    return str(Path(sys.executable).parent / "airflow")


def ensure_db(env: dict[str, str]) -> None:
    """`airflow db migrate` once per home (it takes ~17 s; the marker skips it after)."""
    marker = Path(env["AIRFLOW_HOME"]) / ".eagleflow-db-migrated"
    if marker.exists():
        return
    res = subprocess.run([airflow_bin(), "db", "migrate"], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed in {env['AIRFLOW_HOME']}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    marker.touch()
