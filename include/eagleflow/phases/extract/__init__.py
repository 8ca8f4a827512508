"""The extraction phase: every corpus sample through the capture server, its hidden states stored, one resumable
worker per shard (``worker``), its server and workers on a node (``lifecycle``, ``phase_lifecycle``) and its node
commands (``commands``: ``eagleflow capture ...``).

This module is the phase's descriptor only (the registry ``eagleflow.phases`` imports it; it imports nothing
but the descriptor's data), so every layer can read it without the worker's dependencies.
"""
from __future__ import annotations

from eagleflow.phases.descriptor import ShardKind

EXTRACT = "extract"

KIND = ShardKind(
    phase=EXTRACT, noun="extraction", unit="samples", label="extract shard", watch_name="shard",
    server="capture server",
    server_role="capture_server", worker_prefix="worker_shard_", marker="reconcile-started-server",
    started_dir="hidden_states", shards_field="capture.shards", enabled_field=None,
    shards_of=lambda cfg: cfg.capture.shards, enabled_of=None,
    shard_dir_in=lambda lay, s: lay.shard_dir(s), server_info_in=lambda lay: lay.server_info_file,
    takeover_key="shards", prepared_key="shards",
    shard_task="extract_shard", collect_task="collect_shards", takeover_task="take_over_shards",
    # the manifest last; the heartbeat stays: verification reads the manifest, not a node's live heartbeat
    copy_last=("manifest.jsonl",), copy_skip=("heartbeat.json",),
    free_task="free_gpus", idle_task="gpus_idle", start_task="start_capture_server",
    ready_task="capture_server_ready", plan_task="plan_shards", stop_task="stop_capture_server",
    free_after_task="free_gpus_after_capture", lifecycle_ref="eagleflow.phases.extract.phase_lifecycle:LIFECYCLE",
    command="capture", server_mode="capture", shard_starts_server=False,
    retry_advice=("The retry first looks at the shard: a live worker that progresses is kept; a stuck or dead "
                  "one is stopped and the capture server restarted once if unhealthy; then it resumes the shard "
                  "from its manifest: no stored sample is redone."))
