"""The sharded phases as core descriptors: one ``ShardKind`` per phase (extraction, generation), owning its names
(role, label, unit, server), its folders and files on the run layout, its shard-count field, its takeover key
and the DAG tasks that collect it.

Static data only (it imports nothing but config and layout), so every layer can read it: the watch
(``watchdog.signals.WatchedJob``), reconcile and the fleet's hand-over, the lifecycles, the operators. What a
phase *does* (start its server, its workers) stays in its own package (``capture.lifecycle``,
``generate.lifecycle``). A new sharded phase is a descriptor here plus its worker, its CLI registration, its
lifecycle and its DAG wiring.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout

EXTRACT, GENERATE = "extract", "generate"
# in a generation shard's dir: its last try ended on a stall blamed on the server (generate.lifecycle)
SERVER_STALL = "server_stall.json"


@dataclass(frozen=True)
class ShardKind:
    """One sharded phase: its workers, its server and where its shards write."""
    phase: str
    noun: str                                   # the phase in a sentence ("reran 2 generation shards")
    unit: str                                   # what the manifest counts
    label: str                                  # how reconcile and the fleet name a shard in lines
    watch_name: str                             # how the watch and its mails name a shard ("<name> 3/8")
    server: str                                 # how its server is named
    server_role: str
    worker_prefix: str                          # worker role = prefix + 5-digit shard
    marker: str                                 # <run>.<marker>: reconcile started this phase's server
    started_dir: str                            # a run dir holding this means the phase started
    shards_field: str                           # the config field that says how many shards
    enabled_field: str | None                   # the config switch that turns the phase on (None: always on)
    shard_dir: Callable[[RunLayout, int], PurePosixPath]
    server_info_file: Callable[[RunLayout], PurePosixPath]
    takeover_key: str                           # its map in a run's takeover.json (fleet.takeover)
    prepared_key: str                           # its list in prepare_node's answer (the shards a node holds)
    shard_task: str                             # the DAG task (mapped over shards) that runs and watches a shard
    collect_task: str                           # the DAG task that copies a node's shards to the training node
    takeover_task: str                          # the DAG task that finds a fleet node's shards to take over
    copy_last: tuple[str, ...]                  # a shard's files copied last (their presence says "complete")
    copy_skip: tuple[str, ...]                  # a shard's files never copied (node-local state)
    # reconcile no longer scans the phase once its stats say every shard is complete (generate.phase)
    done_when_stats_complete: bool = False

    def worker_role(self, shard: int) -> str:
        return f"{self.worker_prefix}{shard:05d}"

    def worker_role_pattern(self) -> str:
        """A regular expression matching every ``worker_role`` whole."""
        return re.escape(self.worker_prefix) + r"\d{5}"

    def num_shards(self, cfg: PipelineConfig) -> int:
        return int(_field(cfg, self.shards_field))

    def enabled(self, cfg: PipelineConfig) -> bool:
        return self.enabled_field is None or bool(_field(cfg, self.enabled_field))

    def shards_to_run(self, cfg: PipelineConfig) -> int:
        """The shards this run has of the phase: none while it is switched off."""
        return self.num_shards(cfg) if self.enabled(cfg) else 0

    def heartbeat_file(self, layout: RunLayout, shard: int) -> PurePosixPath:
        return self.shard_dir(layout, shard) / "heartbeat.json"


def _field(cfg: PipelineConfig, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


KINDS = {
    EXTRACT: ShardKind(
        phase=EXTRACT, noun="extraction", unit="samples", label="extract shard", watch_name="shard",
        server="capture server",
        server_role="capture_server", worker_prefix="worker_shard_", marker="reconcile-started-server",
        started_dir="hidden_states", shards_field="capture.shards", enabled_field=None, shard_dir=RunLayout.shard_dir,
        server_info_file=lambda lay: lay.server_info_file, takeover_key="shards", prepared_key="shards",
        shard_task="extract_shard", collect_task="collect_shards", takeover_task="take_over_shards",
        # the manifest last; the heartbeat stays: verification reads the manifest, not a node's live heartbeat
        copy_last=("manifest.jsonl",), copy_skip=("heartbeat.json",)),
    GENERATE: ShardKind(
        phase=GENERATE, noun="generation", unit="records", label="generate shard", watch_name="generate shard",
        server="generation server", server_role="generate_server", worker_prefix="generate_shard_",
        marker="reconcile-started-generate_server", started_dir="generated", shards_field="generate.shards", enabled_field="generate.enabled",
        shard_dir=RunLayout.generate_shard_dir, server_info_file=lambda lay: lay.generate_server_info_file,
        takeover_key="generate_shards", prepared_key="generate_shards", shard_task="generate_responses",
        collect_task="collect_generated",
        takeover_task="take_over_generated",
        # the manifest and final heartbeat last (the phase's stats accept a shard once its heartbeat says
        # complete, and it is final once the worker ended); the stall marker is the node's own note
        copy_last=("manifest.jsonl", "heartbeat.json"), copy_skip=(SERVER_STALL,), done_when_stats_complete=True),
}


def kind_of(phase: str) -> ShardKind:
    try:
        return KINDS[phase]
    except KeyError:
        raise ValueError(f"phase {phase!r} is not one of {sorted(KINDS)}") from None


def kind_of_job(job_name: str) -> ShardKind | None:
    """The sharded phase of a watched job, from the name the watch gives it ("generate shard 3/8": generation);
    None for a job of no sharded phase (the trainer's "training")."""
    for kind in sorted(KINDS.values(), key=lambda k: -len(k.watch_name)):
        if job_name.startswith(kind.watch_name + " "):
            return kind
    return None


def unit_of_job(job_name: str, default: str = "samples") -> str:
    """What a watched job's manifest counts, from the name the watch gives it ("generate shard 3/8": records)."""
    kind = kind_of_job(job_name)
    return kind.unit if kind else default
