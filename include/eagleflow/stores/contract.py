"""The typed contract every hidden-state store keeps: a sink the capture workers write through, a source the
trainer reads through, and the errors both raise.

A store keeps each sample as the bytes of ``eagleflow.stores.encoding`` (safetensors, FP8 optional) and
records it, with its sha256, in its shard's manifest (``<root>/shard_NNNNN/manifest.jsonl``, one line per
sample: ``eagleflow.capture.manifest``). The disk store keeps the bytes in a file beside the manifest; the
Mooncake store keeps them in memory under a key namespaced by run and shard. Nothing above the registry
(``eagleflow.stores``) asks which one it has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Callable, Protocol, runtime_checkable

from eagleflow.stores.encoding import EncodedSample


class BadSampleError(ValueError):
    """A stored sample that does not match its manifest or the storage format."""


class SampleRefused(BadSampleError):
    """A sample a source would not hand over: missing from the store, or its bytes not its manifest's digest.
    The message names the store and the key (or file)."""


class StoreError(RuntimeError):
    """A store that cannot do its job now; ``store`` names it (e.g. ``mooncake at 127.0.0.1:50051``)."""

    def __init__(self, store: str, message: str):
        super().__init__(f"{store}: {message}")
        self.store = store


class StoreUnavailable(StoreError):
    """The store's server is gone or unreachable (a killed Mooncake master): a clear error, never a hang."""


class StoreFull(StoreError):
    """A put waited past its deadline for room under the store's buffer (backpressure with nobody consuming)."""


@dataclass(frozen=True)
class SampleRef:
    """One recorded sample, as its shard's manifest line says. ``path`` is where its bytes are: a file
    (disk) or a store key (Mooncake)."""
    shard: int
    index: int
    id: str
    path: str
    tokens: int
    bytes: int
    sha256: str
    store_dtype: str = "auto"
    capture_pass: int = 0     # which capture of its shard: >0 only when a streaming run re-captures per epoch


@dataclass(frozen=True)
class PutReceipt:
    """What a sink recorded for one sample (its manifest line has the same figures)."""
    index: int
    sample_id: str
    where: str        # the file or the key
    bytes: int
    sha256: str
    store_dtype: str


@runtime_checkable
class SampleSink(Protocol):
    """Where one shard's capture worker puts its samples: stored, then recorded in the shard's manifest.
    ``on_wait``, set by the worker: told the time a put begins to wait for room (a streaming store's
    backpressure), then None once it has room; a store that never waits never calls it."""
    store: str
    on_wait: Callable[[float | None], None] | None

    def put(self, sample: EncodedSample) -> PutReceipt: ...

    def close(self) -> None: ...


@runtime_checkable
class SampleSource(Protocol):
    """Where the trainer takes samples from.

    ``scan()``: every sample recorded so far (a streaming store grows between calls). ``open(ref)``: the
    sample's bytes, as a binary file positioned at 0 (the caller closes it); a streaming store checks the
    digest first and raises ``SampleRefused`` naming the key. ``release(ref)``: the sample's last epoch is
    done with it (a streaming store removes it; the disk store keeps its files).
    """
    store: str
    streaming: bool

    def scan(self) -> list[SampleRef]: ...

    def open(self, ref: SampleRef) -> BinaryIO: ...

    def release(self, ref: SampleRef) -> None:
        """The sample's last epoch is done with it: the store may drop it. A sample already gone is no error
        (a resumed trainer releases again what a killed one may have left)."""

    def wait_for_store(self, timeout_s: float, on_wait: Callable[[float | None], None] | None = None) -> bool:
        """After ``StoreUnavailable``: wait up to ``timeout_s`` for the store to run again and use it; True when it
        is a new incarnation (the lost one's samples are gone until their shards capture them again: refs taken
        before are stale). Past the deadline ``StoreUnavailable`` naming the store. ``on_wait``: told the time
        the wait began, then None."""

    def close(self) -> None: ...
