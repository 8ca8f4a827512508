"""Where a GPU node's tasks run under CeleryExecutor: the node's queue, and the pool that limits its GPU work.

A Celery worker listens on the queue that the node's config names (``node.queue``), so one slow or
unreachable node never holds the workers of another; the pool the config names (``node.pool``)
caps how many GPU tasks of that node run (or wait deferred) at once. Airflow fixes a task's queue and
pool when the DAG is parsed, so the pipeline DAG reads them from its default config
($EAGLEFLOW_CONFIG) at parse time, and the run's first task refuses a run whose frozen config names
another queue or pool than the DAG routes to (such a run would talk to one node from another's worker).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from eagleflow.airflow.project import resolve_config_path
from eagleflow.config import PipelineConfig, load_config

DEFAULT_POOL = "default_pool"
DEMO_CONFIG = "configs/local-demo.yaml"


@dataclass(frozen=True)
class NodeRouting:
    queue: str
    pool: str

    @classmethod
    def for_config(cls, cfg: PipelineConfig) -> "NodeRouting":
        from airflow.providers.common.compat.sdk import conf
        return cls(queue=cfg.node.queue or conf.get("operators", "default_queue", fallback="default"),
                   pool=cfg.node.pool or DEFAULT_POOL)


def default_config_path() -> str:
    """The config a DAG is parsed with and its Param defaults to: $EAGLEFLOW_CONFIG, else the demo's."""
    return os.environ.get("EAGLEFLOW_CONFIG") or DEMO_CONFIG


def node_routing(config_path: str | None = None) -> NodeRouting:
    """Queue and pool of the node named by ``config_path`` (default: ``default_config_path()``), at parse time."""
    return NodeRouting.for_config(load_config(resolve_config_path(config_path or default_config_path())))


@dataclass(frozen=True)
class FleetNodeRoute:
    """One node of the fleet as the DAG is built for it: its task group, queue and pool."""
    name: str
    queue: str
    pool: str
    training: bool


def fleet_routing(config_path: str | None = None) -> list[FleetNodeRoute]:
    """Every node of the fleet named by ``config_path`` (default ``default_config_path()``), at parse time;
    a config without a fleet is one training node."""
    cfg = load_config(resolve_config_path(config_path or default_config_path()))
    out = []
    for name in cfg.fleet_node_names():
        r = NodeRouting.for_config(cfg.node_view(name))
        out.append(FleetNodeRoute(name=name, queue=r.queue, pool=r.pool, training=name == cfg.node.name))
    return out


def task_node_name(task, fleet_names: list[str], task_id: str | None = None) -> str | None:
    """The fleet node a task talks to; None: the run's training node (or its only node).

    The operator's ``fleet_node`` (set per node task group when the DAG is parsed); a mapped task keeps it in
    its partial kwargs; else the task group its id names (``<node>.<task>``): a task rebuilt from the
    serialized DAG (a resumed deferral) has lost the attribute but never its id."""
    name = getattr(task, "fleet_node", None) or (getattr(task, "partial_kwargs", None) or {}).get("fleet_node")
    if name is None:
        task_id = task_id or getattr(task, "task_id", "") or ""
        group = task_id.split(".", 1)[0] if "." in task_id else None
        if group in fleet_names:
            name = group
    return name


def routing_mismatches(dag, cfg: PipelineConfig) -> list[str]:
    """Tasks of ``dag`` routed elsewhere than the run's config says (empty: the run fits the DAG)."""
    names = cfg.fleet_node_names()
    bad, grouped = [], set()
    for task in dag.tasks:
        node = task_node_name(task, names) or cfg.node.name
        if node not in names:
            bad.append(f"task {task.task_id} talks to node {node!r}, which the run's fleet lacks ({', '.join(names)})")
            continue
        grouped.add(node)
        want = NodeRouting.for_config(cfg.node_view(node))
        if task.queue != want.queue:
            bad.append(f"task {task.task_id} runs on queue {task.queue!r}, the run's node.queue is {want.queue!r}")
        if task.pool not in (DEFAULT_POOL, want.pool):
            bad.append(f"task {task.task_id} takes pool {task.pool!r}, the run's node.pool is {want.pool!r}")
    if cfg.is_fleet:
        for node in names:
            if node not in grouped:
                bad.append(f"the run's fleet has node {node!r}, for which this DAG has no tasks")
    return bad
