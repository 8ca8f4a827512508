"""The hidden-state stores, one registered ``Store`` each: the one place that knows where samples go and come from.

- ``disk``: today's offline store. One safetensors file per sample under the run's ``hidden_states/``,
  an append-only manifest per shard, verified by ``eagleflow capture verify`` before training.
- ``mooncake``: a streaming store. Samples live in a Mooncake store's memory (a master and a segment
  holder the run starts, ``eagleflow.stores.mooncake.master``), keys namespaced by run and shard; the
  manifests stay on disk; the trainer takes each sample as it arrives, checks its digest, and removes it
  after its last epoch; writers wait while the store holds ``stream.buffer_gib``.

A sink (``SampleSink``) and a source (``SampleSource``) are built here from ``StoreSettings``; no module
above asks which store it has (tests/unit/test_stores.py holds this, as test_engines does for engines).
Implementations are ``"module:function"`` strings imported when called: this module imports only the
standard library, so the config can validate ``stream.storage`` against it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


class UnknownStore(ValueError):
    """A name that is no registered store; the message names the field, the value and the registered names."""


@dataclass(frozen=True)
class StoreSettings:
    """What any store needs to open a sink or a source for one run.

    ``root``: the run's hidden-states folder (where each shard's manifest is). ``endpoint_file``: where a
    streaming store's running server says how to reach it (written when the run starts it)."""
    run_id: str
    root: str
    store_dtype: str = "auto"
    fsync: bool = True
    buffer_bytes: int = 0
    endpoint_file: str = ""
    put_timeout_s: float = 600.0
    get_timeout_s: float = 60.0
    # a fleet: ``writer_nodes`` nodes put at once, each serialising only its own writers, so each keeps
    # (writer_nodes - 1) x ``max_sample_bytes`` of the buffer free for the others' puts in flight (stores.mooncake)
    writer_nodes: int = 1
    max_sample_bytes: int = 0
    # a sink's capture of its shard (``corpus.passes``): 0, or the epoch it is for when the run re-captures
    capture_pass: int = 0

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.writer_nodes - 1) * self.max_sample_bytes


@dataclass(frozen=True)
class Store:
    name: str
    label: str
    streaming: bool          # training may run beside capture, drawing samples as they arrive
    sink: str                # (settings, shard) -> SampleSink
    source: str              # (settings, **options) -> SampleSource
    resume: str              # (shard_dir, ManifestScan) -> capture.manifest.ResumeCheck: what a worker need not redo
    start: str = ""          # (settings, state_dir=, host=) -> dict: the run's store server started ("": none to run)
    stop: str = ""           # (settings, grace_s=) -> list[dict]: what stopping it did
    roles: tuple[str, ...] = ()   # its server's recorded processes: stopped by ``stop`` only, never by a GPU gate
    health: str = ""         # (settings) -> dict(ok, label, detail[, answering]): the run's server as the watch sees it

    def _function(self, ref: str) -> Callable[..., Any]:
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    def open_sink(self, settings: StoreSettings, shard: int) -> Any:
        return self._function(self.sink)(settings, shard)

    def open_source(self, settings: StoreSettings, **options: Any) -> Any:
        return self._function(self.source)(settings, **options)

    def start_server(self, settings: StoreSettings, *, state_dir: str, host: str, **options: Any) -> dict:
        """Start the run's store (recorded processes on this node); {} when the store has no server. ``options``:
        the store's own (mooncake: ``master``, an existing master named by ``stream.master``)."""
        return self._function(self.start)(settings, state_dir=state_dir, host=host, **options) if self.start else {}

    def stop_server(self, settings: StoreSettings, grace_s: float = 10.0) -> list[dict]:
        return self._function(self.stop)(settings, grace_s=grace_s) if self.stop else []

    def server_health(self, settings: StoreSettings) -> dict | None:
        """The run's store server's health for the watch; None when the store has no server."""
        return self._function(self.health)(settings) if self.health else None

    def resume_check(self, shard_dir: str, scan: Any, **options: Any) -> Any:
        """Which of a shard's recorded samples a restarted capture worker keeps (the rest it captures again).
        ``options``: a streaming store's own (mooncake: ``last_epoch``, for a pass of a run that re-captures)."""
        return self._function(self.resume)(shard_dir, scan, **options)


STORES: dict[str, Store] = {s.name: s for s in (
    Store("disk", "disk (safetensors files)", streaming=False,
          sink="eagleflow.stores.disk.store:open_sink", source="eagleflow.stores.disk.store:open_source",
          resume="eagleflow.capture.manifest:completed_indexes"),
    Store("mooncake", "Mooncake store", streaming=True,
          sink="eagleflow.stores.mooncake.store:open_sink", source="eagleflow.stores.mooncake.store:open_source",
          resume="eagleflow.stores.mooncake.store:completed_indexes",
          start="eagleflow.stores.mooncake.master:start_run_store", stop="eagleflow.stores.mooncake.store:stop_run_store",
          roles=("mooncake-master", "mooncake-segment", "mooncake-metadata"), health="eagleflow.stores.mooncake.master:run_store_health"),
)}


def pass_manifest(capture_pass: int) -> str:
    """The manifest of one capture pass in its shard's folder: pass 0's is every store's ``manifest.jsonl``; a
    later pass (a streaming run that re-captures per epoch, ``corpus.passes``) has its own."""
    return f"manifest.pass{capture_pass}.jsonl" if capture_pass else "manifest.jsonl"


def run_store_settings(cfg: Any, layout: Any, root: str | None = None) -> StoreSettings:
    """The ``StoreSettings`` of one run, from its config (``stream``, ``capture``) and layout; ``root``: another
    hidden-states folder than the run's training store (the held-out capture's, which is always on disk)."""
    buffer = int(cfg.stream.buffer_gib * (1 << 30))
    # every node the run uses may put (its own shards, or the training node's takeover): a conservative count
    nodes = len(cfg.nodes_in_use()) if cfg.is_fleet else 1
    largest = cfg.stream.max_sample_mib
    max_sample = int(largest * (1 << 20)) if largest else buffer // (4 * nodes)
    return StoreSettings(run_id=str(layout.run_id), root=str(root or layout.hidden_states_dir),
                         store_dtype=cfg.capture.store_dtype, buffer_bytes=buffer,
                         endpoint_file=str(layout.store_endpoint_file), put_timeout_s=cfg.stream.put_timeout_s,
                         writer_nodes=nodes, max_sample_bytes=max_sample if nodes > 1 else 0)


def store_for(name: str, field: str = "stream.storage") -> Store:
    try:
        return STORES[name]
    except KeyError:
        raise UnknownStore(f"{field} names no registered store; use one of {', '.join(map(repr, STORES))}") from None
