"""What a sharded phase is, as data: its ``ShardKind`` (names, folders, shard-count field, takeover key, the DAG
tasks of its chain) and the ``PhaseLifecycle`` its own folder defines (what it does to its server and workers).

Static data only (it imports nothing but config and layout), so every layer can read it: the watch
(``watchdog.signals.WatchedJob``), reconcile and the fleet's hand-over, the recovery, the operators and the
DAG's wiring (``airflow.shard_operators``: one set of operators and one ``phase_tasks`` call for every phase).
Each phase is a folder ``eagleflow/phases/<name>/`` whose ``__init__`` holds its ``KIND``; the registry
(``eagleflow.phases``) lists those folders. What a phase *does* (start its server, its workers) is named by the
descriptor's ``lifecycle`` ("module:attribute" of a ``PhaseLifecycle``, imported on first use by
``ShardKind.lifecycle()``), so the watchdog and the operators import no phase's worker (docs/phases.md).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Callable, Iterable

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout

HEARTBEAT = "heartbeat.json"    # in every shard's folder: its worker's heartbeat (phases.shared.worker.PhaseWorker)
MANIFEST = "manifest.jsonl"     # in every shard's folder: one line per finished unit (eagleflow.capture.manifest)


@dataclass(frozen=True)
class PhaseLifecycle:
    """What the operators, the recovery and reconcile do to a sharded phase's server and workers: its own
    package's functions, one shape for every phase (a phase's ``LIFECYCLE``, named by ``ShardKind.lifecycle``)."""
    start_server: Callable[..., Any]            # (run, log=None) -> (record, started now); a live one is kept
    # (run, health_timeout_s) -> ("ready" | "loading" | "stuck" | "dead", its info, why)
    check_ready: Callable[..., Any]
    # (run, timeout_s=None, poll_s=1.0, log=None) -> info; raises ServerNotReady when the wait ran out, a
    # subclass of it when the server died or is stuck (phase_jobs.wait_server_ready)
    wait_server_ready: Callable[..., Any]
    stop_server: Callable[..., Any]             # (run, grace_s=30.0, log=None) -> what it did
    start_worker: Callable[..., Any]            # (run, shard, log) -> (record, attached); one per shard
    # control plane, a retry (or a reconcile rerun) of a shard whose last watch failed: (ctx, shard, log) -> anything
    before_retry: Callable[..., Any]
    # control plane, a watch that ended failed: keep what the retry needs; (ctx, shard, event) -> True if kept
    after_failed_watch: Callable[..., bool]
    # on the node, reconcile: (run, shard) -> (units the shard must store, its worker marked it finished)
    shard_expectation: Callable[..., tuple[int, bool]]
    # on the node, reconcile: (run) -> whether the phase's shards can be judged (and rerun) now
    can_be_judged: Callable[..., bool]


_LIFECYCLES: dict[str, PhaseLifecycle] = {}


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
    started_dir: str                            # its folder in the run dir (shards inside); there = it started
    shards_field: str                           # the config field that says how many shards (in messages)
    enabled_field: str | None                   # the config switch that turns the phase on (None: always on)
    shards_of: Callable[[PipelineConfig], int]  # reads shards_field
    enabled_of: Callable[[PipelineConfig], bool] | None   # reads enabled_field
    takeover_key: str                           # its map in a run's takeover.json (fleet.takeover)
    prepared_key: str                           # its list in prepare_node's answer (the shards a node holds)
    shard_task: str                             # the DAG task (mapped over shards) that runs and watches a shard
    collect_task: str                           # the DAG task that copies a node's shards to the training node
    takeover_task: str                          # the DAG task that finds a fleet node's shards to take over
    copy_last: tuple[str, ...]                  # a shard's files copied last (their presence says "complete")
    copy_skip: tuple[str, ...]                  # a shard's files never copied (node-local state)
    # the rest of its DAG chain, on each node (airflow.shard_operators.phase_tasks)
    free_task: str                              # GPUs freed before its server
    idle_task: str                              # GPUs checked idle before its server
    start_task: str                             # its server started (setup)
    ready_task: str | None                      # a sensor waiting until its server answers (None: start_task waits)
    plan_task: str                              # the shards the node's shard_task is mapped over
    stop_task: str                              # its server stopped (teardown)
    free_after_task: str                        # GPUs freed after its server (teardown)
    lifecycle_ref: str                          # "module:attribute" of its PhaseLifecycle (``lifecycle()``)
    command: str                                # its CLI group: ``eagleflow <command> run|serve|stop|...``
    server_mode: str                            # the mode its server runs in (the engines' ``--mode``, info "mode")
    # its shard task makes sure the server answers before its worker starts (starting it when needed) and clears
    # a server stall on every try (``PhaseLifecycle.before_retry``); otherwise the worker waits for the server
    # by itself and ``before_retry`` runs only when a retry's look found a fault the watch does not recover
    shard_starts_server: bool
    retry_advice: str                           # what a retry of its shard task does, for the retry mail
    # reconcile no longer scans the phase once its stats say every shard is complete (generate.phase)
    done_when_stats_complete: bool = False
    # where its shards and its server's info file are when not where ``shard_dir``/``server_info_file`` put
    # them by default (the run layout's own names: ``RunLayout.shard_dir``, ``generate_server_info_file``...)
    shard_dir_in: Callable[[RunLayout, int], PurePosixPath] | None = None
    server_info_in: Callable[[RunLayout], PurePosixPath] | None = None

    def worker_role(self, shard: int) -> str:
        return f"{self.worker_prefix}{shard:05d}"

    def worker_role_pattern(self) -> str:
        """A regular expression matching every ``worker_role`` whole."""
        return re.escape(self.worker_prefix) + r"\d{5}"

    def num_shards(self, cfg: PipelineConfig) -> int:
        return int(self.shards_of(cfg))

    def with_shards(self, cfg: PipelineConfig, n: int) -> PipelineConfig:
        """``cfg`` with ``shards_field`` set to ``n`` (a worker's ``--of``: its records are split by it)."""
        section, _, field = self.shards_field.partition(".")
        return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={field: n})})

    def enabled(self, cfg: PipelineConfig) -> bool:
        return self.enabled_of is None or bool(self.enabled_of(cfg))

    def shards_to_run(self, cfg: PipelineConfig) -> int:
        """The shards this run has of the phase: none while it is switched off."""
        return self.num_shards(cfg) if self.enabled(cfg) else 0

    def phase_dir(self, layout: RunLayout) -> PurePosixPath:
        """Its folder in the run dir (``started_dir``): one ``shard_NNNNN`` folder per shard inside."""
        return layout.run_dir / self.started_dir

    def shard_dir(self, layout: RunLayout, shard: int) -> PurePosixPath:
        if self.shard_dir_in is not None:
            return self.shard_dir_in(layout, shard)
        return self.phase_dir(layout) / f"shard_{shard:05d}"

    def server_info_file(self, layout: RunLayout) -> PurePosixPath:
        """Written by its server once it listens: ``<server_role>.json`` (tagged on a fleet node: each runs one)."""
        if self.server_info_in is not None:
            return self.server_info_in(layout)
        return layout.run_dir / layout._tagged(self.server_role, ".json")

    def heartbeat_file(self, layout: RunLayout, shard: int) -> PurePosixPath:
        return self.shard_dir(layout, shard) / HEARTBEAT

    def lifecycle(self) -> PhaseLifecycle:
        """Its ``PhaseLifecycle``, imported on first use (the phase's package is heavier than this data)."""
        life = _LIFECYCLES.get(self.phase)
        if life is None:
            module, _, attr = self.lifecycle_ref.partition(":")
            life = getattr(importlib.import_module(module), attr)
            if not isinstance(life, PhaseLifecycle):
                raise TypeError(f"{self.lifecycle_ref} is a {type(life).__name__}, not a PhaseLifecycle")
            _LIFECYCLES[self.phase] = life
        return life


def load_phases(modules: Iterable[str]) -> dict[str, ShardKind]:
    """name -> the ``KIND`` of each phase module; a module without a ``ShardKind`` there, or a name or CLI group
    twice, is refused naming the module."""
    found: dict[str, ShardKind] = {}
    for module in modules:
        kind = getattr(importlib.import_module(module), "KIND", None)
        if not isinstance(kind, ShardKind):
            raise TypeError(f"{module}.KIND is {type(kind).__name__}, not an eagleflow.phases.ShardKind")
        for other in found.values():
            if other.phase == kind.phase or other.command == kind.command:
                raise ValueError(f"{module}.KIND is named {kind.phase!r} (CLI group {kind.command!r}), like the "
                                 f"phase {other.phase!r} registered before it")
        found[kind.phase] = kind
    return found
