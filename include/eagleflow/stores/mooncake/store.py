"""The Mooncake store's sink and source: samples in a Mooncake store's memory, manifests on disk.

Keys: ``<run_id>/shard_NNNNN/<index:08d>`` (a later capture pass of a run that re-captures per epoch:
``.../pass<P>/<index:08d>``, recorded in ``manifest.pass<P>.jsonl``; ``corpus.passes``). The sink puts each sample's
encoded bytes (``stores.encoding``, FP8 included) and then appends its manifest line (``file`` is the key,
``sha256`` the digest of the bytes put), so a line never names a sample the store does not hold. Before a put it
waits while the master's own ``master_allocated_bytes`` plus the sample would pass ``buffer_bytes`` (backpressure;
the check and the put are one step under a lock file beside the endpoint, so the writers of one node never overshoot
together); past ``put_timeout_s`` it raises ``StoreFull``. The master's figure is an HTTP read (``/metrics``, ~0.6
ms: a third of a put, bench/profile_stream_put.py): a single-node run's store (its own master) keeps in the lock
file an upper bound on it instead (``NodeBound``: the figure last read plus every put of the node since), and reads
the master again only when that bound leaves no room for the sample. The source reads the manifests (``scan``), gets
a sample's bytes, refuses them (``SampleRefused``, naming the key) when missing or when their sha256 is not the
manifest's, and removes the sample on ``release`` (its last epoch is done with it).

A store that does not answer (its master killed) is ``StoreUnavailable`` naming the store, within seconds:
the master's port is probed before the client's setup (which would otherwise retry for 90 s) and after any
failed call.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import io
import os
import re
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable

from eagleflow.capture.manifest import ManifestEntry, ManifestScan, ManifestWriter, ResumeCheck, parse_manifest_bytes
from eagleflow.stores import StoreSettings, pass_manifest
from eagleflow.stores.contract import (PutReceipt, SampleRef, SampleRefused, StoreError, StoreFull,
                                       StoreUnavailable)
from eagleflow.stores.encoding import EncodedSample
from eagleflow.stores.ledger import read_ledger

from . import master
from .master import MooncakeEndpoint, metrics, reachable, running_store

STORE = "mooncake"
OBJECT_NOT_FOUND = -704             # Mooncake's error codes (store_py's ErrorCode)
LOCAL_BUFFER_BYTES = 64 << 20       # the client's own transfer buffer (it contributes no segment: 0 bytes)
LOCK_WAIT_SAID_S = 0.5              # a wait this long for the node's put lock is a wait for room (said in the heartbeat)


def sample_key(run_id: str, shard: int, index: int, capture_pass: int = 0) -> str:
    """A sample's key; a later capture pass of a run that re-captures per epoch has its own (``pass<P>/``)."""
    return f"{run_id}/shard_{shard:05d}/" + (f"pass{capture_pass}/" if capture_pass else "") + f"{index:08d}"


_PASS_MANIFEST = re.compile(r"manifest\.pass([1-9][0-9]*)\.jsonl")     # stores.pass_manifest's later passes


def read_endpoint(settings: StoreSettings) -> MooncakeEndpoint:
    """The run's store endpoint, or StoreUnavailable saying that no store was started for the run."""
    try:
        return MooncakeEndpoint.read(settings.endpoint_file)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreUnavailable(f"Mooncake store of run {settings.run_id}", f"no endpoint at {settings.endpoint_file} "
                               f"({type(e).__name__}: {e}): start the run's store first (`eagleflow store start "
                               "--config C --run-id R` on the training node)") from None


def local_address(ep: MooncakeEndpoint) -> str:
    """This process's own address for the client's setup: the one it reaches the master from (a capture node's
    own address in a fleet, never the training node's); the master's host itself on loopback."""
    if ep.host.startswith("127.") or ep.host in ("localhost", "::1"):
        return ep.host
    try:
        with socket.socket(socket.AF_INET6 if ":" in ep.host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ep.host, ep.rpc_port))      # UDP: no packet sent, only the route chosen
            return str(s.getsockname()[0])
    except OSError:
        return ep.host                              # the setup then fails naming the master, as before


class MooncakeClient:
    """One process's connection to the store (one per process: Mooncake clients are heavy)."""

    def __init__(self, ep: MooncakeEndpoint):
        self.ep = ep
        self.label = ep.label
        self.unavailable_if_down("cannot connect", settle_s=0)
        os.environ.setdefault("MC_STORE_MEMCPY", "0")   # TCP-only hosts (notes/mooncake.md)
        if ep.host != local_address(ep):   # another machine's store: be reached at the address that reaches it
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_address(ep))
        # imported here: the stream extra is optional, and the wheel ships no type information
        self._s: Any = importlib.import_module("mooncake.store").MooncakeDistributedStore()
        rc = self._s.setup(local_address(ep), ep.metadata_url, 0, LOCAL_BUFFER_BYTES, ep.protocol, ep.device_names,
                           ep.master_address)
        if rc != 0:
            self.unavailable_if_down(f"setup failed ({rc})")
            raise StoreError(self.label, f"client setup failed with code {rc}")

    def unavailable_if_down(self, doing: str, settle_s: float = 1.0) -> None:
        """StoreUnavailable when the master does not answer; looked at for ``settle_s`` (a master killed a moment
        ago fails calls before its ports close)."""
        end = time.monotonic() + settle_s
        while reachable(self.ep.host, self.ep.rpc_port) and reachable(self.ep.host, self.ep.metrics_port):
            if time.monotonic() >= end:
                return
            time.sleep(0.1)
        raise StoreUnavailable(self.label, f"{doing}: the master does not answer on {self.ep.master_address} "
                               f"(dead or unreachable; its pid record: {self.ep.master_pid_file or 'none'}). "
                               "Restart the store and re-run: every sample recorded in a manifest but not "
                               "trained on is captured again")

    def allocated_bytes(self) -> int:
        try:
            return int(metrics(self.ep).get("master_allocated_bytes", 0))
        except OSError:
            self.unavailable_if_down("reading its memory in use")
            raise

    def put(self, key: str, data: bytes) -> None:
        rc = self._s.upsert(key, data)     # a redone sample replaces the old bytes (put keeps the first)
        if rc != 0:
            self.unavailable_if_down(f"put {key}")
            raise StoreError(self.label, f"put {key} ({len(data)} bytes) failed with code {rc}")

    def get(self, key: str, tries: int = 5) -> bytes:
        """The object's bytes; b"" when it is not in the store. A get whose object lease (100 ms) ran out before
        its transfer completed (Mooncake logs LEASE_EXPIRED; seen on a loaded host) returns nothing although the
        object is there: asked again, up to ``tries`` times, while the master says it exists."""
        for attempt in range(tries):
            data = self._s.get(key)
            if data:
                return bytes(data)
            if self._s.is_exist(key) != 1:
                break
            time.sleep(0.05 * (attempt + 1))
        self.unavailable_if_down(f"get {key}")
        return b""

    def remove(self, key: str, timeout_s: float = 5.0) -> None:
        end = time.monotonic() + timeout_s
        while True:
            rc = self._s.remove(key)
            if rc in (0, OBJECT_NOT_FOUND):   # (asking is_exist instead would renew the lease it waits out)
                return
            if time.monotonic() > end:          # a lease outlived its 100 ms: say so, never loop forever
                self.unavailable_if_down(f"remove {key}")
                raise StoreError(self.label, f"remove {key} failed with code {rc} for {timeout_s:g} s")
            time.sleep(0.05)

    def remove_matching(self, pattern: str) -> int:
        """Remove every key matching the regular expression; how many were removed (negative: Mooncake's error)."""
        return int(self._s.remove_by_regex(pattern))

    def close(self) -> None:
        try:
            self._s.close()
        except Exception:
            pass


ALLOC_ALIGN = 4096


def charged_bytes(size: int) -> int:
    """What one put of ``size`` bytes adds to a node's bound on the master's allocated bytes. Measured (0.3.13.post1,
    its default offset allocator, bench/profile_stream_put.py): ``master_allocated_bytes`` grows by exactly
    ``size`` per object, and not at all for an upsert of a key held at the same size; counted rounded up to 4 KiB
    plus 4 KiB, so that an allocator aligning its blocks stays under the bound too (the margin costs only an
    earlier read of the master, never a put admitted over the buffer)."""
    return -(-size // ALLOC_ALIGN) * ALLOC_ALIGN + ALLOC_ALIGN


class NodeBound:
    """A node's upper bound on the master's ``master_allocated_bytes``, kept at the start of the node's lock file
    and read and written only under its flock (every put of the node holds it).

    Removes (the trainer's) only lower the master's figure and every put of the node passes here, so the figure
    last read plus ``charged_bytes`` of each put since (counted before the put is sent: a put that fails or is
    killed midway stays counted) is never below the master's. That holds only while nothing else puts into the
    master: used for a run of one writer node on its own master (``applies``); a fleet's other nodes, or other
    runs on an existing master (``stream.master``), put unseen, so those read the master at every put. A record
    names its incarnation (store id and master address): another incarnation's, or one torn, is no bound. A read
    of the master above the bound (an allocator counting more than ``charged_bytes``) turns the bound off for
    that incarnation: every later put reads the master, as before."""

    SIZE = 160
    MAGIC = "eagleflow-bound-v1"

    def __init__(self, fd: int, ep: MooncakeEndpoint):
        self.fd = fd
        self.ident = f"{ep.store_id or '-'} {ep.master_address}"
        self.off = False

    @staticmethod
    def applies(settings: StoreSettings, ep: MooncakeEndpoint) -> bool:
        return settings.writer_nodes <= 1 and not ep.foreign_master

    def read(self) -> int | None:
        """The bound; None when there is none for this incarnation (none yet, another's, torn, or turned off:
        ``off`` then says so)."""
        self.off = False
        try:
            raw = os.pread(self.fd, self.SIZE, 0).decode("ascii")
        except (OSError, UnicodeDecodeError):
            return None
        body, _, crc = raw.rstrip(" \n").rpartition(" crc=")
        parts = body.split(" ")
        if (len(parts) != 4 or parts[0] != self.MAGIC or " ".join(parts[1:3]) != self.ident
                or crc != f"{zlib.crc32(body.encode()):08x}"):
            return None
        self.off = parts[3] == "off"
        return int(parts[3]) if parts[3].isdigit() else None

    def write(self, bound: int | None) -> None:
        """Record ``bound`` (None: off for this incarnation)."""
        body = f"{self.MAGIC} {self.ident} {'off' if bound is None else int(bound)}"
        line = f"{body} crc={zlib.crc32(body.encode()):08x}".ljust(self.SIZE - 1) + "\n"
        if len(line) != self.SIZE:
            raise ValueError(f"bound record of {len(line)} bytes: {line!r}")
        os.pwrite(self.fd, line.encode("ascii"), 0)


class MooncakeSink:
    store = STORE

    def __init__(self, settings: StoreSettings, shard: int, client: MooncakeClient | None = None):
        self.settings = settings
        self.shard = shard
        self.ep = read_endpoint(settings)
        self.client = client or MooncakeClient(self.ep)
        shard_dir = Path(settings.root) / f"shard_{shard:05d}"
        self.manifest = ManifestWriter(shard_dir / pass_manifest(settings.capture_pass), fsync=settings.fsync)
        self._budget_lock = f"{settings.endpoint_file}.budget.lock"
        self._lock = threading.Lock()          # the manifest
        self._put_lock = threading.Lock()      # the room check and the put
        self.waited_s = 0.0             # time spent held back by the buffer
        self.on_wait: Callable[[float | None], None] | None = None   # told when a put begins to wait, then None

    def _room(self, size: int, bound: NodeBound | None = None) -> None:
        # The bound: master_allocated_bytes <= buffer at every moment. One node's writers check and put one at a
        # time (the lock file), but writers on other nodes check the same master figure unserialised: up to
        # (nodes - 1) puts of at most max_sample_bytes each may be in flight elsewhere, not yet counted. So a
        # node admits a put only while allocated + sample <= buffer - (nodes - 1) x max_sample_bytes: even if
        # every other node's put lands at once, allocated <= buffer. One node: headroom 0, the plain check.
        s = self.settings
        limit = s.buffer_bytes - s.headroom_bytes
        if s.headroom_bytes and size > s.max_sample_bytes:
            raise StoreFull(self.client.label, f"one sample of {size} bytes is larger than stream.max_sample_mib "
                            f"({s.max_sample_bytes} bytes; {s.writer_nodes} nodes put into the store, each keeping "
                            "room for the others' largest sample): raise stream.max_sample_mib (and "
                            "stream.buffer_gib, which must hold nodes x max_sample_mib)")
        if size > limit:
            raise StoreFull(self.client.label, f"one sample of {size} bytes is larger than stream.buffer_gib "
                            f"({s.buffer_bytes} bytes, less {s.headroom_bytes} kept for other nodes' puts); "
                            "raise stream.buffer_gib")
        charge = charged_bytes(size)
        cached = bound.read() if bound is not None else None
        if bound is not None and cached is not None and cached + charge <= limit:
            bound.write(cached + charge)       # room by the node's bound: the master need not be asked
            return
        t0 = time.monotonic()
        waiting = False
        try:
            while True:
                allocated = self.client.allocated_bytes()
                if bound is not None and cached is not None and allocated > cached:
                    # the master above the bound: its allocator counts more than charged_bytes, or something
                    # else puts; no bound for this incarnation from now on
                    bound.write(None)
                    bound, cached = None, None
                if allocated + size <= limit:
                    break
                if time.monotonic() - t0 > self.settings.put_timeout_s:
                    raise StoreFull(self.client.label, f"no room for {size} bytes under stream.buffer_gib ({limit} "
                                    f"{f'of {s.buffer_bytes} ' if s.headroom_bytes else ''}"
                                    f"bytes) for {self.settings.put_timeout_s:g} s: nobody is taking samples (is the "
                                    "trainer running?)")
                if not waiting and self.on_wait is not None:
                    self.on_wait(time.time())   # the worker's heartbeat says so: held back, not stuck
                waiting = True
                time.sleep(0.05)
        finally:
            if waiting and self.on_wait is not None:
                self.on_wait(None)
        self.waited_s += time.monotonic() - t0
        if bound is not None and not bound.off:
            bound.write(allocated + charge)    # before the put: the figure read, and this put, counted

    def _lock_node(self, fd: int) -> None:
        """The node's lock on its writers' room check and put. Another writer holds it while its put waits for room
        (the buffer full), so a wait for the lock past LOCK_WAIT_SAID_S is a wait for room too, and the worker's
        heartbeat says so (on_wait): without it, a second shard on the node read as stalled, no request in flight,
        its watch restarting a healthy worker every stall_after_s (seen under the scheduler, a trainer hung)."""
        t0, said = time.monotonic(), False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    pass
                waited = time.monotonic() - t0
                if not said and waited >= LOCK_WAIT_SAID_S and self.on_wait is not None:
                    self.on_wait(time.time() - waited)
                    said = True
                time.sleep(0.02)
        finally:
            if said and self.on_wait is not None:
                self.on_wait(None)

    def put(self, sample: EncodedSample) -> PutReceipt:
        data = sample.to_bytes()
        digest = hashlib.sha256(data).hexdigest()
        key = sample_key(self.settings.run_id, self.shard, sample.index, self.settings.capture_pass)
        # check-then-put is one step for every writer of this node; the manifest has its own lock, so a put
        # waiting for room never holds back the line of a put already done (the trainer may need that sample
        # to free the room)
        with self._put_lock:
            lk = os.open(self._budget_lock, os.O_RDWR | os.O_CREAT, 0o644)   # not O_APPEND: the bound is at 0
            try:
                self._lock_node(lk)
                self._room(len(data), NodeBound(lk, self.ep) if NodeBound.applies(self.settings, self.ep) else None)
                self.client.put(key, data)
            finally:
                os.close(lk)
        with self._lock:
            self.manifest.append(ManifestEntry(id=sample.sample_id, index=sample.index, file=key,
                                               tokens=sample.tokens, bytes=len(data), sha256=digest,
                                               store_dtype=sample.store_dtype, store_id=self.ep.store_id or None))
        return PutReceipt(sample.index, sample.sample_id, key, len(data), digest, sample.store_dtype)

    def close(self) -> None:
        self.manifest.close()


class MooncakeSource:
    store = STORE
    streaming = True

    def __init__(self, settings: StoreSettings, client: MooncakeClient | None = None,
                 log: Callable[[str], None] = print, **_options: Any):
        self.settings = settings
        self.root = Path(settings.root)
        self.ep = read_endpoint(settings)
        self.client = client or MooncakeClient(self.ep)
        self.log = log
        self._tails: dict[tuple[str, int], ManifestTail] = {}   # by (shard folder, pass): each manifest read so far
        self._refs: list[SampleRef] | None = None
        self._refs_store_id = ""

    def scan(self) -> list[SampleRef]:
        """The samples recorded as put into this store (its incarnation): a line of a store lost since (its master
        killed) names a sample that is gone; its shard captures it again (``completed_indexes``).

        Incremental (the trainer asks at every draw and step): each shard's manifest is read from where the last
        scan stopped (``ManifestTail``: only the complete lines appended since), and read whole again when it was
        replaced or shrank (a resume's ``compact_manifest`` after a lost store rewrites it atomically); the same
        entries as ``read_manifest`` of the whole file, the last line of an index winning. New lines only extend
        the list returned before (the same ref objects first, in the order read: the loader reads just the tail);
        anything else rebuilds it, by shard, pass and index."""
        rebuild = self._refs is None or self._refs_store_id != self.ep.store_id
        appended: list[SampleRef] = []
        seen: set[tuple[str, int]] = set()
        for d in sorted(p for p in self.root.glob("shard_*") if p.is_dir()) if self.root.is_dir() else []:
            # pass 0's manifest, and each later pass's of a run that re-captures per epoch
            passes = [0] + sorted(int(m.group(1)) for m in (_PASS_MANIFEST.fullmatch(f.name)
                                                             for f in d.glob("manifest.pass*.jsonl")) if m)
            for cp in passes:
                tail = self._tails.get((d.name, cp))
                if tail is None:
                    tail = self._tails[(d.name, cp)] = ManifestTail(d / pass_manifest(cp))
                seen.add((d.name, cp))
                if tail.update():
                    if tail.appended is None:
                        rebuild = True
                    elif not rebuild:
                        appended += self._refs_of(d.name, cp, tail.appended)
        for gone in set(self._tails) - seen:
            del self._tails[gone]
            rebuild = True
        if rebuild:
            # every line again (a replaced or redone line, a new incarnation): by shard, pass and index
            self._refs = [r for name, cp in sorted(self._tails)
                          for r in self._refs_of(name, cp, sorted(self._tails[(name, cp)].entries.values(),
                                                                  key=lambda e: e.index))]
            self._refs_store_id = self.ep.store_id
        elif appended:
            # only new lines (capture appending, as it does all the time): appended in the order read, so a scan
            # costs the lines since the last one, not the corpus (it was ~4 ms a draw at 4,000 samples)
            assert self._refs is not None
            self._refs.extend(appended)
        assert self._refs is not None
        return list(self._refs)

    def _refs_of(self, shard_dir: str, capture_pass: int, entries: list[ManifestEntry]) -> list[SampleRef]:
        shard = int(shard_dir.split("_", 1)[1])
        return [SampleRef(shard=shard, index=e.index, id=e.id, path=e.file, tokens=e.tokens, bytes=e.bytes,
                          sha256=e.sha256, store_dtype=e.store_dtype or "auto", capture_pass=capture_pass)
                for e in entries if in_incarnation(e, self.ep.store_id)]

    def open(self, ref: SampleRef) -> BinaryIO:
        data = self.client.get(ref.path)
        if not data:
            raise SampleRefused(f"{self.client.label}: sample {ref.id} (key {ref.path}) is recorded in shard "
                                f"{ref.shard}'s manifest but not in the store (removed, evicted or lost with a "
                                "segment); re-capture its shard")
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != ref.bytes or digest != ref.sha256:
            raise SampleRefused(f"{self.client.label}: sample {ref.id} (key {ref.path}): {len(data)} bytes with "
                                f"sha256 {digest[:16]}..., its manifest says {ref.bytes} bytes and "
                                f"{ref.sha256[:16]}...; not trained on: re-capture its shard")
        return io.BytesIO(data)

    def release(self, ref: SampleRef) -> None:
        self.client.remove(ref.path)

    def wait_for_store(self, timeout_s: float, on_wait: Callable[[float | None], None] | None = None) -> bool:
        """After a ``StoreUnavailable``: wait, up to ``timeout_s``, until the run's store runs again (a new
        incarnation that ``eagleflow store start`` wrote to the endpoint, or this one answering again), then use
        it. True when it is a new incarnation (every sample of the old one is gone: its shards capture them again);
        ``StoreUnavailable`` naming the store past the deadline. ``on_wait`` is told when the wait begins (the
        time) and ends (None): the trainer's heartbeat says so."""
        t0 = time.monotonic()
        if on_wait is not None:
            on_wait(time.time())
        try:
            while True:
                ep = running_store(self.settings.endpoint_file)
                if ep is not None:
                    new = ep.store_id != self.ep.store_id or ep.master_address != self.ep.master_address
                    if new:
                        old = self.client
                        self.client = MooncakeClient(ep)
                        self.ep = ep
                        old.close()
                        self.log(f"the run's store is back as a new incarnation ({ep.label}, store id "
                                 f"{ep.store_id or '?'}) after {time.monotonic() - t0:.1f} s: the samples of the "
                                 "lost one are captured again by their shards")
                    return new
                if time.monotonic() - t0 > timeout_s:
                    raise StoreUnavailable(self.client.label, f"the store did not come back within {timeout_s:g} s "
                                           "(stream.store_down_timeout_s): restart it (`eagleflow store start "
                                           "--config C --run-id R` on the training node; the trainer's watch does "
                                           "so) and retry the training; nothing trained is lost (the ledger)")
                time.sleep(0.5)
        finally:
            if on_wait is not None:
                on_wait(None)

    def close(self) -> None:
        self.client.close()


class ManifestTail:
    """One shard's manifest as read so far: its entries by index, and the offset up to which its complete lines
    were parsed. ``update`` parses only the complete lines appended since (a partial tail waits for its newline,
    as ``read_manifest`` ignores it); it reads the file whole again when it is not the file read before (another
    inode: rewritten by ``compact_manifest``), is shorter than the offset, or no longer ends the part read with
    the line last parsed (rewritten in place). True when the entries changed."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[int, ManifestEntry] = {}
        self.offset = 0
        self._ident: tuple[int, int] | None = None
        self._last_line = b""
        # what the last update changed: the entries of new indexes only, in the order appended; None when it
        # replaced or dropped any (a redone index, a file read whole again): the caller rebuilds from ``entries``
        self.appended: list[ManifestEntry] | None = []

    def _reset(self) -> bool:
        had = bool(self.entries) or self.offset > 0
        self.entries, self.offset, self._ident, self._last_line = {}, 0, None, b""
        return had

    def update(self) -> bool:
        self.appended = []
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            if self._reset():
                self.appended = None
                return True
            return False
        with f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino)
            changed = False
            if (ident != self._ident or st.st_size < self.offset
                    or (self._last_line and os.pread(f.fileno(), len(self._last_line),
                                                     self.offset - len(self._last_line)) != self._last_line)):
                changed = self._reset()
                if changed:
                    self.appended = None
                self._ident = ident
            if st.st_size == self.offset:
                return changed
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n") + 1       # complete lines only
        if end == 0:
            return changed
        chunk = data[:end]
        new = parse_manifest_bytes(chunk, str(self.path)).entries
        if self.appended is not None:
            if any(i in self.entries for i in new):
                self.appended = None          # a redone index replaces its line: rebuilt
            else:
                self.appended = sorted(new.values(), key=lambda e: e.index)
        self.entries.update(new)
        self.offset += end
        self._last_line = chunk[chunk.rfind(b"\n", 0, end - 1) + 1:]
        return True


def in_incarnation(e: ManifestEntry, store_id: str) -> bool:
    """A manifest line's sample was put into the store incarnation ``store_id`` (an endpoint with no id, an older
    one's, holds every line)."""
    return not store_id or e.store_id == store_id


def completed_indexes(shard_dir: str, scan: ManifestScan, last_epoch: int | None = None) -> ResumeCheck:
    """A restarted capture worker's resume: which recorded samples need no capture again.

    A line is appended only after its put succeeded, and the trainer may already have trained on the sample
    and removed it, so the store's present keys say nothing about what is left. What does: a line is done
    when its sample was put into the store running now (its incarnation, the endpoint's ``store_id``) or the
    run's ledger has it trained in the run's last epoch (no epoch needs it again). Any other line names a
    sample lost with a store killed since (its master died and ``eagleflow store start`` began a new one): it
    is ``broken``, so the worker rewrites the manifest without it (atomically, the rest kept) and captures it
    again. The shard's folder is the run's ``hidden_states/shard_NNNNN`` (``RunLayout``): the endpoint and the
    ledger are found from it, as the run's sinks and sources find them. ``last_epoch``: the epoch after which
    ``scan``'s samples are needed no more (a later pass of a run that re-captures per epoch: its own epoch);
    None: the run's last."""
    run_dir = Path(shard_dir).parent.parent
    store_id = _current_store_id(run_dir / "store_endpoint.json")
    if not store_id:       # no store running with an id: nothing proves a line lost (the sink then says why)
        return ResumeCheck(done=set(scan.entries), broken=[], hashed=0, refreshed={})
    state = read_ledger(run_dir / "draft" / "stream_ledger.jsonl")
    trained = state.trained_in_last_epoch() if last_epoch is None else set(state.epoch(last_epoch).trained)
    return resume_rule(scan, store_id, trained)


def resume_rule(scan: ManifestScan, store_id: str, trained: set[str]) -> ResumeCheck:
    """``completed_indexes`` once it knows the store running now (``store_id``) and the ids the last epoch
    trained: a line is done when put into that store or trained; the rest are lost (``broken``, with why)."""
    done: set[int] = set()
    broken: list[tuple[ManifestEntry, str]] = []
    for idx, e in scan.entries.items():
        if in_incarnation(e, store_id) or e.id in trained:
            done.add(idx)
        else:
            broken.append((e, f"put into store {e.store_id or '(no id)'}, lost with it (the store running now is "
                              f"{store_id}) and not yet trained in the run's last epoch"))
    return ResumeCheck(done=done, broken=broken, hashed=0, refreshed={})


def _current_store_id(endpoint_file: Path) -> str:
    """The incarnation of the run's store when it runs (records alive, master answering), else "". A fleet's
    capture node cannot prove the training node's records alive (its processes are on another machine): then
    the master answering at the endpoint's address is the proof."""
    ep = running_store(endpoint_file)
    if ep is not None:
        return ep.store_id
    try:
        ep = MooncakeEndpoint.read(endpoint_file)
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    # a dead master's ports taken by another process would keep the dead store's lines: no looser than "" (all kept)
    return ep.store_id if reachable(ep.host, ep.rpc_port) and reachable(ep.host, ep.metrics_port) else ""


def stop_run_store(settings: StoreSettings, *, grace_s: float = 10.0) -> list[dict]:
    """``Store.stop``: ``master.stop_run_store``, which removes the run's keys from an existing master
    (``stream.master``) before stopping its segment holder, never that master."""
    return master.stop_run_store(settings, grace_s=grace_s, remove_keys=remove_run_keys)


def remove_run_keys(ep: MooncakeEndpoint, run_id: str) -> dict:
    """Remove every key of the run (``<run_id>/...``, ``sample_key``) from an existing master: its objects may sit
    in segments other than the run's, which outlive the run."""
    prefix = f"{run_id}/"
    try:
        client = MooncakeClient(ep)
    except Exception as e:  # noqa: BLE001 - a master gone takes its keys with it; the stop goes on and says so
        return {"role": "mooncake-keys", "pid": None, "outcome": "not_removed",
                "detail": f"keys {prefix}* not removed: {type(e).__name__}: {e}"}
    try:
        n = client.remove_matching("^" + re.escape(prefix) + ".*")
    finally:
        client.close()
    return {"role": "mooncake-keys", "pid": None, "outcome": "removed" if n >= 0 else "not_removed",
            "detail": f"{n if n >= 0 else 0} keys {prefix}* removed from the existing master {ep.master_address}"
                      + ("" if n >= 0 else f" (code {n})")}


def open_sink(settings: StoreSettings, shard: int) -> MooncakeSink:
    return MooncakeSink(settings, shard)


def open_source(settings: StoreSettings, **options: Any) -> MooncakeSource:
    return MooncakeSource(settings, log=options.get("log", print))
