"""The run object of commands that run on the node itself: the frozen config, the run's layout, this node.

Every phase's node command (corpus, generation, capture, watch, recovery, training) acts on a run through it,
as the Airflow operators act through ``eagleflow.airflow.runtime.RunContext``: both are ``layout.RunLike``
(``cfg``, ``layout``, ``node``, ``eagleflow_argv``). It lives under the phases, not in one of them.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode, Node


@dataclass
class LocalRun:
    """A RunLike for CLI commands that run on the node itself."""
    cfg: PipelineConfig
    layout: RunLayout
    config_path: str
    _node: Node | None = None

    @property
    def node(self) -> Node:
        if self._node is None:
            self._node = LocalNode(name=self.cfg.node.name)
        return self._node

    def eagleflow_argv(self, *args: str) -> list[str]:
        return self.node.eagleflow_argv(*args, "--config", self.config_path, "--run-id", self.layout.run_id)
