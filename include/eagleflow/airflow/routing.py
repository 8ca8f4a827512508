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
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

from airflow.sdk import TaskGroup

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
    """One node as the DAG is built for it: its queue and pool, and what its place in the fleet makes of its
    tasks. The DAG's node wiring reads these, never the fleet's size or the config."""
    name: str
    queue: str
    pool: str
    training: bool
    grouped: bool = False   # one of several nodes: its tasks form a task group named after it

    @property
    def prefix(self) -> str:
        """Its tasks' id prefix: the group's name and a dot, or nothing for a fleet of one."""
        return f"{self.name}." if self.grouped else ""

    @property
    def fleet_node(self) -> str | None:
        """What its operators are told (``fleet_node``): its name in a fleet, None alone (the run's node)."""
        return self.name if self.grouped else None

    @property
    def ships_to_training(self) -> bool:
        """Another node than the training one: it receives the corpus and its shards are collected to the
        training node (whatever it left incomplete, the training node takes over)."""
        return self.grouped and not self.training

    def task_group(self) -> Any:
        """Its tasks' task group (its queue and ``fleet_node`` as the group's default_args), or a no-op context."""
        if not self.grouped:
            return nullcontext()
        # TaskGroup's attrs converter hides default_args' type from mypy ("_T")
        return TaskGroup(self.name, default_args={"queue": self.queue, "fleet_node": self.name})  # type: ignore[arg-type]


@dataclass(frozen=True)
class FleetRoutes:
    """Every node of the run's fleet as the DAG is built for it (one declared source, from the config)."""
    nodes: tuple[FleetNodeRoute, ...]

    @property
    def training(self) -> FleetNodeRoute:
        return next(n for n in self.nodes if n.training)

    @property
    def grouped(self) -> bool:
        """More than one node: a task group per node, takeovers by the training node, shards collected."""
        return len(self.nodes) > 1

    def __iter__(self) -> Iterator[FleetNodeRoute]:
        return iter(self.nodes)


def fleet_routing(config_path: str | None = None) -> FleetRoutes:
    """Every node of the fleet named by ``config_path`` (default ``default_config_path()``), at parse time;
    a config without a fleet is one training node."""
    cfg = load_config(resolve_config_path(config_path or default_config_path()))
    names = cfg.fleet_node_names()
    out = []
    for name in names:
        r = NodeRouting.for_config(cfg.node_view(name))
        out.append(FleetNodeRoute(name=name, queue=r.queue, pool=r.pool, training=name == cfg.node.name,
                                  grouped=len(names) > 1))
    return FleetRoutes(tuple(out))


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
