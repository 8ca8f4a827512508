"""The sharded phases as core descriptors: one ``ShardKind`` per phase (extraction, generation) owning its role
names, unit words, shard-count field, folders, server lifecycle, takeover key and collect task.

Reconcile, the fleet's hand-over and the operators read these instead of branching on the phase's name; a new
sharded phase is a descriptor here plus its worker, its CLI registration and its DAG wiring. (Issue 39: the
watch's ``WatchedJob`` and the fleet operators' tables still keep their own words; they move here next.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eagleflow.capture import lifecycle as capture
from eagleflow.config import PipelineConfig
from eagleflow.generate import lifecycle as generate
from eagleflow.layout import RunLayout

EXTRACT, GENERATE = "extract", "generate"


@dataclass(frozen=True)
class ShardKind:
    """One sharded phase as reconcile sees it: its workers, its server and where its shards write."""
    phase: str
    unit: str                                   # what the manifest counts
    label: str                                  # how a shard is named in lines and mails
    server: str                                 # how its server is named
    server_role: str
    marker: str                                 # <run>.<marker>: reconcile started this phase's server
    started_dir: str                            # a run dir holding this means the phase started
    worker_role: Callable[[int], str]
    num_shards: Callable[[PipelineConfig], int]
    shards_field: str                           # the config field num_shards reads, for messages
    shard_dir: Callable[[RunLayout, int], object]
    start_server: Callable
    wait_server_ready: Callable
    stop_server: Callable
    start_worker: Callable                      # (run, shard, log) -> (record, attached); one per shard
    takeover_key: str                           # its map in a run's takeover.json (fleet.takeover)
    collect_task: str                           # the DAG task that copies a node's shards to the training node


KINDS = {
    EXTRACT: ShardKind(
        phase=EXTRACT, unit="samples", label="extract shard", server="capture server", server_role=capture.SERVER_ROLE,
        marker="reconcile-started-server", started_dir="hidden_states", worker_role=capture.worker_role,
        num_shards=lambda cfg: cfg.capture.shards, shards_field="capture.shards", shard_dir=lambda lay, s: lay.shard_dir(s),
        start_server=capture.start_capture_server, wait_server_ready=capture.wait_capture_server_ready,
        stop_server=capture.stop_capture_server, start_worker=capture.start_or_attach_worker,
        takeover_key="shards", collect_task="collect_shards"),
    GENERATE: ShardKind(
        phase=GENERATE, unit="records", label="generate shard", server="generation server",
        server_role=generate.SERVER_ROLE, marker="reconcile-started-generate_server", started_dir="generated",
        worker_role=generate.worker_role, num_shards=lambda cfg: cfg.generate.shards, shards_field="generate.shards",
        shard_dir=lambda lay, s: lay.generate_shard_dir(s),
        start_server=generate.start_generate_server, wait_server_ready=generate.wait_generate_server_ready,
        stop_server=generate.stop_generate_server, start_worker=generate.start_or_attach_generate_worker,
        takeover_key="generate_shards", collect_task="collect_generated"),
}


def kind_of(phase: str) -> ShardKind:
    try:
        return KINDS[phase]
    except KeyError:
        raise ValueError(f"phase {phase!r} is not one of {sorted(KINDS)}") from None
