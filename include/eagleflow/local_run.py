"""The run object of commands that run on the node itself: the frozen config, the run's layout, this node.

Every phase's node command (corpus, generation, capture, watch, recovery, training) acts on a run through it,
as the Airflow operators act through ``eagleflow.airflow.runtime.RunContext``: both are ``layout.RunLike``
(``cfg``, ``layout``, ``node``, ``eagleflow_argv``). It lives under the phases, not in one of them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eagleflow.config import PipelineConfig
from eagleflow.durable import owned_dir
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


def own_run_folders(layout: RunLayout, *if_present: str | os.PathLike) -> None:
    """Make or prove ours (``durable.owned_dir``) the run's folders a node job keeps its proof in (run dir, state
    dir, pids/, locks/, logs/), and prove ours those of ``if_present`` (each under one of the two) that exist
    (one made later is made inside folders proven ours): UnsafeFolder, naming the folder, its owner and mode,
    when another user made one first."""
    roots = [Path(os.path.abspath(str(r))) for r in layout.owned_roots]
    present = [f for f in if_present if os.path.lexists(f)]
    for folder in (*roots, layout.pids_dir, layout.locks_dir, layout.logs_dir, *present):
        f = Path(os.path.abspath(str(folder)))
        owned_dir(f, root=next((r for r in roots if f == r or r in f.parents), f))
