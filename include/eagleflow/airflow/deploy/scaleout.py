"""The scale-out deployment in one place: CeleryExecutor, PostgreSQL metadata DB, Redis broker.

Its parts are the Airflow commands below, one process (or container) each: scheduler, DAG
processor, API server (which also serves the workers' execution API), triggerer, a Celery worker
for the default queue and one Celery worker per GPU node, bound to the queue that node's config
names (``node.queue``); each node's GPU work is capped by its pool (``node.pool``), created at init.
docker-compose.yaml runs exactly these (tests/unit/test_docker_compose.py compares them) and
tests/integration/test_celery_scaleout.py runs them on this machine against a real PostgreSQL
and Redis.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagleflow.airflow.deploy.home import TRIGGERER_SETTINGS

DEFAULT_QUEUE = "default"


@dataclass(frozen=True)
class GpuNodeRoute:
    """A GPU node's worker queue and pool, as its config names them, and the pool's size."""
    queue: str
    pool: str
    pool_slots: int = 1

    def pool_args(self) -> list[str]:
        """`airflow` arguments that create the pool; deferred waits count, so a watch holds its slot."""
        return ["pools", "set", self.pool, str(self.pool_slots), f"GPU work on the node of queue {self.queue}",
                "--include-deferred"]


def components(nodes: list[GpuNodeRoute]) -> dict[str, list[str]]:
    """Service name -> `airflow` arguments of each long-running part."""
    parts = {
        "airflow-scheduler": ["scheduler"],
        "airflow-dag-processor": ["dag-processor"],
        "airflow-apiserver": ["api-server"],
        "airflow-triggerer": ["triggerer"],
        "airflow-worker-default": ["celery", "worker", "--queues", DEFAULT_QUEUE],
    }
    for node in nodes:
        parts[f"airflow-worker-{node.queue}"] = ["celery", "worker", "--queues", node.queue]
    return parts


def init_commands(nodes: list[GpuNodeRoute]) -> list[list[str]]:
    """What runs once before the parts start: the DB schema, then a pool per GPU node."""
    return [["db", "migrate"], *[n.pool_args() for n in nodes]]


def celery_env(*, sql_alchemy_conn: str, broker_url: str, result_backend: str, execution_api_url: str) -> dict[str, str]:
    """The settings every part shares (the rest is the usual Airflow home)."""
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql_alchemy_conn,
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": result_backend,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": execution_api_url,
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        # a restarted triggerer container takes the dead one's triggers (every watch) within a minute
        **TRIGGERER_SETTINGS,
    }
