"""The generation phase: the target writes the assistant turns of the corpus itself (``regenerate``), one
resumable worker per shard (``worker``), the phase's stats and settings (``phase``), its server and workers on a
node (``lifecycle``, ``phase_lifecycle``) and its node commands (``commands``: ``eagleflow generate ...``).

This module is the phase's descriptor only (the registry ``eagleflow.phases`` imports it; it imports nothing
but the descriptor's data), so every layer can read it without the worker's dependencies.
"""
from __future__ import annotations

from eagleflow.phases.descriptor import ShardKind

GENERATE = "generate"
# in a generation shard's dir: its last try ended on a stall blamed on the server (generate.lifecycle)
SERVER_STALL = "server_stall.json"

KIND = ShardKind(
    phase=GENERATE, noun="generation", unit="records", label="generate shard", watch_name="generate shard",
    server="generation server", server_role="generate_server", worker_prefix="generate_shard_",
    marker="reconcile-started-generate_server", started_dir="generated", shards_field="generate.shards",
    enabled_field="generate.enabled",
    shards_of=lambda cfg: cfg.generate.shards, enabled_of=lambda cfg: cfg.generate.enabled,
    shard_dir_in=lambda lay, s: lay.generate_shard_dir(s), server_info_in=lambda lay: lay.generate_server_info_file,
    takeover_key="generate_shards", prepared_key="generate_shards", shard_task="generate_responses",
    collect_task="collect_generated",
    takeover_task="take_over_generated",
    # the manifest and final heartbeat last (the phase's stats accept a shard once its heartbeat says
    # complete, and it is final once the worker ended); the stall marker is the node's own note
    copy_last=("manifest.jsonl", "heartbeat.json"), copy_skip=(SERVER_STALL,), done_when_stats_complete=True,
    free_task="free_gpus_before_generation", idle_task="gpus_idle_before_generation",
    start_task="start_generate_server", ready_task=None, plan_task="plan_generate_shards",
    stop_task="stop_generate_server", free_after_task="free_gpus_after_generation",
    lifecycle_ref="eagleflow.phases.generate.phase_lifecycle:LIFECYCLE", command=GENERATE, server_mode=GENERATE,
    shard_starts_server=True,
    retry_advice="The retry resumes the shard from its manifest (finished records are kept, never redone).")
