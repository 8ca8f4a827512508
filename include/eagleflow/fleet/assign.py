"""Which node of a run extracts (or generates) which shard: in proportion to the nodes' GPU slots, the same
answer every time.

Every node's plan task computes the whole assignment from the frozen config and keeps its own part, so
the nodes agree without talking to each other, and a cleared task plans the same shards again (one
worker per shard: no shard is ever planned on two nodes).
"""
from __future__ import annotations

from eagleflow.config import PipelineConfig
from eagleflow.phases import EXTRACT, kind_of


def assign_shards(n_shards: int, slots: dict[str, int]) -> dict[str, list[int]]:
    """Shards 0..n_shards-1 to the nodes of ``slots`` (name -> GPU slots, in fleet order).

    Each node gets floor(n * slots / total) shards, the ones left over go to the largest remainders
    (ties: the earlier node); each node's shards are one contiguous block, in fleet order.
    """
    if n_shards < 0:
        raise ValueError(f"n_shards = {n_shards}: must be >= 0")
    bad = {k: v for k, v in slots.items() if not isinstance(v, int) or v < 1}
    if not slots or bad:
        raise ValueError(f"slots {slots}: every node needs at least 1 GPU slot, and there must be a node")
    total = sum(slots.values())
    counts = {name: n_shards * s // total for name, s in slots.items()}
    order = list(slots)
    left = n_shards - sum(counts.values())
    by_remainder = sorted(order, key=lambda name: (-(n_shards * slots[name] % total), order.index(name)))
    for name in by_remainder[:left]:
        counts[name] += 1
    out, start = {}, 0
    for name in order:
        out[name] = list(range(start, start + counts[name]))
        start += counts[name]
    return out


def run_assignment(cfg: PipelineConfig, phase: str = EXTRACT) -> dict[str, list[int]]:
    """The run's whole assignment of one phase's shards over the nodes it uses: capture.shards (extract) or,
    when generation is on, generate.shards (generate; none when it is off)."""
    return assign_shards(kind_of(phase).shards_to_run(cfg), {node.name: node.gpu_slots for node in cfg.nodes_in_use()})


def shards_of(cfg: PipelineConfig, node: str, phase: str = EXTRACT) -> list[int]:
    """The shards of ``phase`` node ``node`` works in this run (empty: a node the run does not use, or none
    left)."""
    return run_assignment(cfg, phase).get(node, [])
