"""Where a run's files live, on the node. One place, so every phase agrees.

    <run_root>/<run_id>/
        run-config.json         the run's frozen config (run-config.<node>.json on another fleet node)
        generated/shard_00001/  the target's own records (generation), manifest.jsonl, heartbeat.json; stats.json
        corpus/                 corpus.parquet, stats.json
        hidden_states/shard_00003/   <sample>.safetensors, manifest.jsonl, heartbeat.json
        hidden_states_held_out/shard_00000/   the same for the held-out records trained models are scored on
        capture_server.json, generate_server.json   a live server's url and identity (tagged per fleet node)
        takeover.json           a fleet's shards handed over to this node (eagleflow.fleet.takeover)
        store_endpoint.json     a streaming store's endpoint (`eagleflow store start`, stream.storage: mooncake)
        logs/                   one log per detached process (logs/<node>/ on another fleet node)
        draft/                  checkpoints/, export/, metrics.jsonl, curves.png, heartbeat.json, stream_ledger.jsonl
    <state_dir>/                node-wide, across runs
        pids/<run_id>.<role>.json    every process we started (see nodes.detach)
        locks/                  job locks (<run_id>.<role>.lock), hand-over marks, restart locks
        keys/capture_dump.key   the dump MAC key
        watch/, incidents/      the watch's looks and alarms, the node's incident book (eagleflow.watchdog)
        reconcile/config.json   the config the hourly reconcile scans with
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Protocol

from .config import PipelineConfig, safe_run_id

if TYPE_CHECKING:
    from .nodes import Node

# the trainer's process role (its pid and log file): train.job starts it, `eagleflow gpu free --keep-trainer` spares it
TRAINER_ROLE = "trainer"


@dataclass(frozen=True)
class RunLayout:
    run_id: str
    run_dir: PurePosixPath
    state_dir: PurePosixPath
    # a fleet node other than the training node: its own files in the run dir carry its name, since the
    # nodes may share one run root (the training node keeps the plain names the tools look for)
    node_tag: str | None = None

    @classmethod
    def for_run(cls, cfg: PipelineConfig, run_id: str) -> "RunLayout":
        tag = cfg.node.name if cfg.is_fleet and cfg.node.name != cfg.fleet.training_node else None
        return cls(run_id=safe_run_id(run_id), run_dir=PurePosixPath(cfg.run_dir(run_id)),
                   state_dir=PurePosixPath(cfg.node_state_dir()), node_tag=tag)

    def _tagged(self, name: str, suffix: str) -> str:
        return f"{name}.{self.node_tag}{suffix}" if self.node_tag else f"{name}{suffix}"

    @property
    def run_config_file(self) -> PurePosixPath:
        """The run's frozen config as this node sees it (``run-config.json`` on the training node)."""
        return self.run_dir / self._tagged("run-config", ".json")

    @property
    def fleet_probe_dir(self) -> PurePosixPath:
        """Each fleet node's probe file: found on the training node, it proves the run roots are one filesystem."""
        return self.run_dir / "fleet-probe"

    @property
    def corpus_dir(self) -> PurePosixPath:
        return self.run_dir / "corpus"

    @property
    def hidden_states_dir(self) -> PurePosixPath:
        return self.run_dir / "hidden_states"

    def shard_dir(self, shard: int) -> PurePosixPath:
        return self.hidden_states_dir / f"shard_{shard:05d}"

    @property
    def held_out_hidden_states_dir(self) -> PurePosixPath:
        """The held-out records' hidden states (train.held_out_samples): evaluated on, never trained on."""
        return self.run_dir / "hidden_states_held_out"

    @property
    def generated_dir(self) -> PurePosixPath:
        """The generation phase's output: shard_NNNNN/ (one result file per record, manifest, heartbeat), stats."""
        return self.run_dir / "generated"

    def generate_shard_dir(self, shard: int) -> PurePosixPath:
        return self.generated_dir / f"shard_{shard:05d}"

    @property
    def generate_server_info_file(self) -> PurePosixPath:
        """Written by the generation (serving-mode) server once it listens (tagged: fleet nodes each run one)."""
        return self.run_dir / self._tagged("generate_server", ".json")

    @property
    def logs_dir(self) -> PurePosixPath:
        return self.run_dir / "logs" / self.node_tag if self.node_tag else self.run_dir / "logs"

    @property
    def draft_dir(self) -> PurePosixPath:
        return self.run_dir / "draft"

    @property
    def owned_roots(self) -> tuple[PurePosixPath, PurePosixPath]:
        """The run's two roots (run dir, state dir): each, and every folder under them, must be this user's
        (``durable.owned_dir``); ``spawn_detached(owned_roots=...)`` makes detach check its folders against them."""
        return self.run_dir, self.state_dir

    @property
    def pids_dir(self) -> PurePosixPath:
        return self.state_dir / "pids"

    @property
    def locks_dir(self) -> PurePosixPath:
        return self.state_dir / "locks"

    def pid_file(self, role: str) -> PurePosixPath:
        return self.pids_dir / f"{self.run_id}.{role}.json"

    def lock_file(self, role: str) -> PurePosixPath:
        """The lock a job of ``role`` holds for its lifetime (one worker per shard); an exact name per run."""
        return self.locks_dir / f"{self.run_id}.{role}.lock"

    def restart_lock_file(self, server_role: str) -> PurePosixPath:
        """Held while a server of the run is (re)started by a recovery: not the server's own life lock
        (``lock_file(role)``, taken by detach at its start), which would make the start it guards refuse itself."""
        return self.locks_dir / f"{self.run_id}.{server_role}.restart.lock"

    def log_file(self, role: str) -> PurePosixPath:
        return self.logs_dir / f"{role}.log"

    def heartbeat_file(self, shard: int) -> PurePosixPath:
        return self.shard_dir(shard) / "heartbeat.json"

    def manifest_file(self, shard: int) -> PurePosixPath:
        return self.shard_dir(shard) / "manifest.jsonl"

    @property
    def dump_key_file(self) -> PurePosixPath:
        """The node user's capture dump key (``serving.dump_protocol.load_dump_key``): made by the first capture server,
        read by every worker. One per state_dir, not per run: a server may serve several runs' workers."""
        return self.state_dir / "keys" / "capture_dump.key"

    @property
    def server_info_file(self) -> PurePosixPath:
        """Written by the capture server once it listens: url, pid, model, layers, backend."""
        return self.run_dir / self._tagged("capture_server", ".json")

    @property
    def train_heartbeat_file(self) -> PurePosixPath:
        return self.draft_dir / "heartbeat.json"

    @property
    def store_endpoint_file(self) -> PurePosixPath:
        """A streaming store's endpoint (``stream.storage: mooncake``): written by ``eagleflow store start`` on the
        training node, read by every sink and source of the run; another fleet node's copy is tagged with its
        name (handed to it by start_store, ``eagleflow.fleet.stream``)."""
        return self.run_dir / self._tagged("store_endpoint", ".json")

    @property
    def stream_ledger_file(self) -> PurePosixPath:
        """Which sample ids each epoch took and trained (``eagleflow.stores.ledger``): streaming runs."""
        return self.draft_dir / "stream_ledger.jsonl"

    @property
    def stream_verified_file(self) -> PurePosixPath:
        """A streaming run's verification record, beside the offline one (``verified.json``): the ledger's
        exactly-once check, written by the trainer when it ends."""
        return self.hidden_states_dir / "stream_verified.json"


class RunLike(Protocol):
    """What phase code needs of a run: the Airflow RunContext and the CLI's local run both fit."""
    cfg: PipelineConfig
    layout: RunLayout

    @property
    def node(self) -> "Node": ...

    def eagleflow_argv(self, *args: str) -> list[str]: ...
