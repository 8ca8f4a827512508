"""The GPU gate shared by the CLI, the sensor and its trigger: read, judge, wait.

The baseline file lives on the node (``gpu.baseline_file``), so it is read
through the node like everything else there.
"""
from __future__ import annotations

import time
from typing import Callable

from eagleflow.nodes import Node

from .idle_policy import IdlePolicy, IdleReport, parse_baselines
from .probes import GpuProbe, probe_for


def no_gpu_message(cfg) -> str:
    return (f"node {cfg.node.name} has no GPU (node.has_gpu is false in the config): "
            f"nothing to check, the GPU gate passes")


def load_policy(node: Node, cfg) -> IdlePolicy:
    baselines = None
    path = cfg.gpu.baseline_file
    if path:
        path = str(cfg.resolve(path))
        text = node.read_text(path, missing_ok=True)
        if text is not None:
            baselines = parse_baselines(text, where=f"gpu.baseline_file {path} on node {node.name}")
    return IdlePolicy(cfg.gpu.idle_threshold_mib, baselines)


class IdleGate:
    """One node's probe and policy, reused across polls (one SSH connection). ``select``: the GPUs it judges
    (UUIDs or indices, as gpu.select names them); None = gpu.select (all when empty)."""

    def __init__(self, node: Node, cfg, probe: GpuProbe | None = None, select: list[str] | None = None):
        self.node = node
        self.cfg = cfg
        self.select = list(cfg.gpu.select) if select is None else list(select)
        self.probe = probe or probe_for(node, cfg)
        self.policy = load_policy(node, cfg)

    def check(self) -> IdleReport:
        return self.policy.evaluate(self.probe.snapshot(), self.select, self.node.name)

    def wait(self, timeout_s: float, poll_s: float, log: Callable[[str], None] = print,
             sleep: Callable[[float], None] = time.sleep) -> IdleReport:
        """Poll until every selected GPU is idle or timeout_s passed; returns the last report."""
        deadline = time.monotonic() + timeout_s
        last_msg = None
        while True:
            report = self.check()
            if report.all_idle:
                return report
            msg = report.message()
            if msg != last_msg:
                log(f"waiting for idle GPUs: {msg}")
                last_msg = msg
            if time.monotonic() + poll_s > deadline:
                return report
            sleep(poll_s)
