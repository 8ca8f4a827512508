"""Where the deployment's project lives: the root that relative config paths are read against, the same when
the DAG is parsed (``routing``) and when a task runs (``runtime``)."""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT_ENV = "EAGLEFLOW_HOME"


def project_root() -> Path:
    """Where relative config paths live: $EAGLEFLOW_HOME, else the parent of Airflow's DAG folder."""
    home = os.environ.get(PROJECT_ROOT_ENV)
    if home:
        return Path(home).expanduser().absolute()
    from airflow.providers.common.compat.sdk import conf   # Airflow's settings, read only when needed
    return Path(conf.get("core", "dags_folder")).expanduser().absolute().parent


def resolve_config_path(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else project_root() / p
