"""The extraction worker of one shard: corpus samples -> capture server -> stored hidden states.

Order per sample, so that a crash at any point loses nothing and repeats
nothing: request (a dump appears) -> its MAC checked under the dump key
(``protocol.verify_dump``: a replaced dump is refused) -> final file (temp, fsync, rename) ->
manifest append -> delete the dump. The dump's bytes are moved unchanged
(``eagleflow.safetensors_format``): a worker imports no torch unless it stores
fp8, so it starts in a fraction of the time. On start the manifest says what is done
(each file must exist with its recorded size, and a file changed since it was
recorded must still hash to its sha256); a manifest with damaged, repeated or
stale lines is rewritten atomically with one line per intact sample; temp
files and this shard's
orphaned dumps are removed; everything else is requested again.

``in_flight`` requests run at once: while one thread writes a file, the
others keep the server busy. Told to stop (SIGTERM, Ctrl-C), the worker takes
no new sample and stores none that is not already being written (those get
``HALT_GRACE_S``); the rest in flight are abandoned and redone at resume.

A request's deadline (``request_deadline``) counts the requests in flight
ahead of it and this run's own pace; past it the request is overdue, evidence
the watch reads from the heartbeat, and the worker waits on: it gives up only
at ``GIVE_UP_FACTOR`` deadlines, so that a worker run with no watch still ends.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagleflow.capture.manifest import compact_manifest, read_manifest
from eagleflow.capture.storage import remove_temp_files
from eagleflow.heartbeat import (PACE_WINDOW, ROOM_WAIT_ENDED, WAITING_FOR_PASS, WAITING_FOR_ROOM, Heartbeat,
                                 HeartbeatWriter, InFlight, record_pace)
from eagleflow.phases.shared.worker import PhaseWorker
from eagleflow.serving.client import CaptureServerError, CaptureTimeout, generate
from eagleflow.serving.dump_protocol import DumpTrustError, dump_path, read_dump, remove_dumps, request_id, verify_dump
from eagleflow.stop_signal import stop_arrived
from eagleflow.stores import Store, StoreSettings, pass_manifest, store_for
from eagleflow.stores.contract import SampleSink, StoreError
from eagleflow.stores.encoding import encode_sample

from . import KIND


HALT_GRACE_S = 3.0   # a stopped worker's samples already being written finish within this, or are redone
PACE_SEED_SAMPLES = 3       # completions before the run's own pace replaces the config's figure
PACE_MARGIN = 2.0           # x the observed seconds per request, for each request in the queue
DEADLINE_CAP_S = 3600.0     # no deadline grows past this (or the config's own figure, if longer)
GIVE_UP_FACTOR = 3.0        # the worker itself gives up only at this many deadlines: the watch decides first
HELD_BACK = "held_back"      # heartbeat extra: the puts held back by a full streaming store (waits, seconds, longest)


def note_held_back(hb: Heartbeat, since: float | None, now: float) -> None:
    """A put began to wait for room at ``since`` (the earliest waiting thread's time is kept under
    WAITING_FOR_ROOM), or (None) the wait ended at ``now``: then added to HELD_BACK (waits, seconds in all, the
    longest's [since, until])."""
    if since is not None:
        hb.extra.setdefault(WAITING_FOR_ROOM, since)
        return
    began = hb.extra.pop(WAITING_FOR_ROOM, None)
    if not isinstance(began, (int, float)) or isinstance(began, bool):
        return
    hb.extra[ROOM_WAIT_ENDED] = now
    rec = hb.extra.setdefault(HELD_BACK, {"waits": 0, "seconds": 0.0, "longest": None})
    rec["waits"] += 1
    rec["seconds"] = round(rec["seconds"] + max(0.0, now - began), 3)
    if rec["longest"] is None or now - began > rec["longest"][1] - rec["longest"][0]:
        rec["longest"] = [began, now]


def request_deadline(own_s: float, ahead: int, per_request_s: float | None) -> float:
    """When a request counts as overdue: its own figure plus the queue in front of it at this run's pace.

    ``own_s`` is the config's figure for the request alone (base + per token); ``ahead`` the requests
    already in flight when it was sent (a serial server answers them first); ``per_request_s`` this
    run's observed seconds of server time per request (None until PACE_SEED_SAMPLES completions:
    then each request in the queue is counted at ``own_s``). A uniformly slow node is slow, not late.
    """
    queue = ahead + 1
    d = queue * own_s if per_request_s is None else own_s + PACE_MARGIN * queue * per_request_s
    return min(max(DEADLINE_CAP_S, own_s), d)


class ExtractionError(RuntimeError):
    """The shard cannot go on; the message says which sample, what failed and what to do."""


@dataclass(frozen=True)
class Sample:
    index: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class WorkerSettings:
    run_id: str
    shard: int
    num_shards: int
    corpus_file: str
    shard_dir: str
    dump_dir: str
    server_url: str
    in_flight: int = 2
    request_timeout_base_s: float = 60.0
    request_timeout_per_token_s: float = 0.05
    heartbeat_interval_s: float = 2.0
    model: str = ""
    fsync: bool = True
    dump_key: bytes = b""          # the dump key: a dump without its MAC under it is never stored
    store_dtype: str = "auto"      # capture.store_dtype
    limit: int | None = None       # only corpus indexes below this (the held-out capture's train.held_out_samples)
    request_shard: int | None = None  # the shard number in request ids and dump names, when not ``shard``
    storage: str = "disk"          # stream.storage: the store the samples go to (eagleflow.stores)
    buffer_bytes: int = 0          # stream.buffer_gib, for a streaming store's backpressure
    endpoint_file: str = ""        # a streaming store's endpoint (RunLayout.store_endpoint_file)
    put_timeout_s: float = 600.0   # stream.put_timeout_s
    writer_nodes: int = 1          # a fleet's nodes putting into one store (StoreSettings.headroom_bytes)
    max_sample_bytes: int = 0      # stream.max_sample_mib: what each node keeps free for another node's put
    passes: int = 1                # captures of the shard, one per epoch when the corpus exceeds the buffer
                                   # (corpus.passes.capture_plan)

    @property
    def rid_shard(self) -> int:
        return self.shard if self.request_shard is None else self.request_shard

    def request_timeout(self, tokens: int) -> float:
        return self.request_timeout_base_s + self.request_timeout_per_token_s * tokens

    def store_settings(self) -> StoreSettings:
        """The store settings of this shard's sink: its root is the folder holding ``shard_dir``."""
        return StoreSettings(run_id=self.run_id, root=str(Path(self.shard_dir).parent), store_dtype=self.store_dtype,
                             fsync=self.fsync, buffer_bytes=self.buffer_bytes, endpoint_file=self.endpoint_file,
                             put_timeout_s=self.put_timeout_s, writer_nodes=self.writer_nodes,
                             max_sample_bytes=self.max_sample_bytes)


def shard_indexes(corpus_file: str, shard: int, num_shards: int, limit: int | None = None) -> list[int]:
    import pyarrow.parquet as pq  # lazy: pyarrow takes 0.19 s to import; the CLI and reconcile load this module
    idx = pq.read_table(corpus_file, columns=["index"]).column("index").to_pylist()
    return sorted(i for i in idx if i % num_shards == shard and (limit is None or i < limit))


def load_samples(corpus_file: str, shard: int, num_shards: int, skip: set[int],
                 limit: int | None = None) -> tuple[int, list[Sample]]:
    """(shard total, samples still to do in index order); input ids are read only for those."""
    import pyarrow.parquet as pq  # lazy: as in shard_indexes

    if not Path(corpus_file).is_file():
        raise ExtractionError(f"corpus file {corpus_file} does not exist; run `eagleflow corpus prepare` first")
    pf = pq.ParquetFile(corpus_file)
    # to_pylist, not to_numpy: pyarrow's numpy conversion imports pandas
    idx = pf.read(columns=["index"]).column("index").to_pylist()
    mine = [i for i in idx if i % num_shards == shard and (limit is None or i < limit)]
    total = len(mine)
    wanted = {i for i in mine if i not in skip}
    if not wanted:
        return total, []
    samples = []
    # Batch by batch: a worker holds its own shard's tokens, not the whole corpus (seeds: 87.8 M tokens).
    for batch in pf.iter_batches(batch_size=4096, columns=["index", "id", "input_ids", "loss_mask"]):
        bidx = batch.column("index").to_pylist()
        for k, i in enumerate(bidx):
            if i in wanted:      # a zero-copy slice per row: take() would import pandas, a third of a worker's start
                row = batch.slice(k, 1).to_pydict()
                samples.append(Sample(index=int(i), id=str(row["id"][0]),
                                      input_ids=[int(t) for t in row["input_ids"][0]],
                                      loss_mask=[int(m) for m in row["loss_mask"][0]]))
    samples.sort(key=lambda s: s.index)
    return total, samples


def remove_orphan_dumps(dump_dir: str, run_id: str, shard: int) -> int:
    """Dumps of this shard left by an earlier worker (never consumed): safe to delete, they are re-requested."""
    return remove_dumps(dump_dir, run_id, shard)  # exact run and shard: never another run's by prefix


def free_space(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError as e:
        return f"free space unknown ({e.strerror})"
    return f"{free / 2**20:.1f} MiB free on that filesystem"


def dump_dir_full(dump_dir: str, needed_bytes: int, server_error: str) -> str | None:
    """Why a failed request is the dump dir's fault (full), or None: a full dump_dir is no dead server."""
    try:
        free = shutil.disk_usage(dump_dir).free
    except OSError:
        return None
    said_enospc = any(t in server_error for t in ("No space left", "ENOSPC", "Errno 28", "Disk quota"))
    if said_enospc or free < max(needed_bytes, 1 << 20):
        return (f"server.dump_dir {dump_dir} is full (ENOSPC: {free / 2**20:.1f} MiB free"
                + (f", this sample's dump needs about {needed_bytes / 2**20:.1f} MiB" if needed_bytes else "")
                + "); the server could not write the dump")
    return None


class ShardWorker(PhaseWorker):
    """One extraction shard's worker (the loop around it: ``phases.shared.worker.PhaseWorker``)."""
    kind = KIND
    error = ExtractionError

    def __init__(self, settings: WorkerSettings, log=print):
        super().__init__(settings.shard, settings.num_shards, settings.shard_dir, settings.heartbeat_interval_s, log)
        self.s = settings
        self._halt = threading.Event()     # told to stop (SIGTERM): nothing more is stored
        self._dump_bytes_per_token = 0     # learnt from the first dump: what a full dump_dir cannot hold
        self._per_request: list[float] = []  # this run's seconds per request (request time / its queue)

    def heartbeat_extra(self) -> dict[str, Any]:
        return {**super().heartbeat_extra(), "server_url": self.s.server_url}

    def _run(self, hbw: HeartbeatWriter) -> None:
        s = self.s
        shard_dir = Path(s.shard_dir)
        removed_tmp = remove_temp_files(shard_dir)
        removed_dumps = remove_orphan_dumps(s.dump_dir, s.run_id, s.rid_shard)
        store = store_for(s.storage)
        # each pass resumes as the one capture always did (a run that re-captures per epoch has s.passes)
        dones: list[set[int]] = []
        broken: list = []
        hashed = damaged = repeated = resumed_tokens = 0
        for cp in range(s.passes):
            scan, check = self._resume(store, shard_dir, cp)
            dones.append(check.done)
            broken += check.broken
            hashed += check.hashed
            damaged += len(scan.bad_lines) + scan.partial_tail
            repeated += len(scan.duplicates) + len(scan.duplicate_ids)
            resumed_tokens += sum(scan.entries[i].tokens for i in check.done if i in scan.entries)
        total, todo = load_samples(s.corpus_file, s.shard, s.num_shards, dones[0], s.limit)
        resumed = sum(len(d) for d in dones)
        left = total * s.passes - resumed

        if s.store_dtype == "fp8_e4m3":
            import torch  # noqa: F401  # lazy: torch (heavy), only to quantise fp8: now, not in the first sample's clock

        def init(hb: Heartbeat) -> None:
            hb.state = "running"
            # rates count from here: the work, not the interpreter's start and the corpus read
            hb.started_at = hb.last_progress_at = time.time()
            # done/total over every pass: the watch judges a shard that re-captures as any other
            hb.total, hb.done, hb.resumed, hb.tokens = total * s.passes, resumed, resumed, resumed_tokens
        hbw.update(init)
        hbw.flush()
        self.log(f"shard {s.shard}/{s.num_shards}: {total} samples"
                 + (f" x {s.passes} capture passes (one per epoch: the corpus exceeds the store's buffer)"
                    if s.passes > 1 else "")
                 + f", {resumed} already stored, {left} to do; "
                 f"removed {len(removed_tmp)} temp file(s), {removed_dumps} orphaned dump(s)"
                 + (f"; {len(broken)} stored sample(s) will be redone ("
                    + ", ".join(f"{e.file}: {why}" for e, why in broken[:5])
                    + (f", +{len(broken) - 5} more" if len(broken) > 5 else "") + ")" if broken else "")
                 + (f"; hashed {hashed} file(s) changed since recorded" if hashed else "")
                 + (f"; manifest rewritten without {damaged} damaged and {repeated} repeated line(s)"
                    if damaged or repeated else ""))
        if not left:
            return

        def held_back(since: float | None) -> None:
            # a put waiting for room in a streaming store: the heartbeat says since when (the watch then blames the
            # consumer's pace, not this worker or the server); the earliest of the threads that wait. Each wait
            # ended is added to the heartbeat's record (HELD_BACK: waits, seconds in all, the longest's [since,
            # until]), which its last write keeps: the worker's own account of being held back, not a look's
            hbw.update(lambda hb: note_held_back(hb, since, time.time()))
        try:
            for cp in range(s.passes):
                if cp:
                    todo = load_samples(s.corpus_file, s.shard, s.num_shards, dones[cp], s.limit)[1]
                if not todo:
                    continue
                if cp:
                    self._wait_for_pass(store, cp, held_back, hbw)
                self._capture_pass(store, cp, todo, hbw, held_back)
        finally:
            rec = hbw.hb.extra.get(HELD_BACK)
            if rec:
                self.log(f"shard {s.shard}/{s.num_shards}: held back {rec['waits']} time(s), {rec['seconds']:.1f} s "
                         f"in all (longest {rec['longest'][1] - rec['longest'][0]:.1f} s) waiting for room in the "
                         "run's hidden-state store")

    def _resume(self, store: Store, shard_dir: Path, cp: int):
        """One pass's manifest as a restarted worker keeps it (rewritten when it holds lines to drop)."""
        s = self.s
        path = shard_dir / pass_manifest(cp)
        scan = read_manifest(path)
        # a pass of a run that re-captures: its samples are needed only by its own epoch
        check = store.resume_check(str(shard_dir), scan, **({"last_epoch": cp} if s.passes > 1 else {}))
        done = check.done
        other = sorted(i for i in done if (scan.entries[i].store_dtype or "auto") != s.store_dtype)
        if other:
            # one shard, one storage format: training refuses a mix, so never start one
            was = scan.entries[other[0]].store_dtype or "auto"
            raise ExtractionError(f"shard {s.shard}: {len(other)} sample(s) in {shard_dir} were stored with "
                                  f"capture.store_dtype {was} (e.g. {scan.entries[other[0]].file}), the config "
                                  f"now says {s.store_dtype}; set capture.store_dtype back to {was} to resume, "
                                  f"or delete {shard_dir} to capture the shard again as {s.store_dtype}")
        if check.broken or check.refreshed or not scan.clean:
            # one clean line per intact sample before anything is appended: a redone sample
            # must not sit beside a damaged, repeated or stale line of itself
            keep = [check.refreshed.get(i, scan.entries[i]) for i in sorted(done)]
            compact_manifest(path, keep, fsync=s.fsync)
        return scan, check

    def _wait_for_pass(self, store: Store, cp: int, held_back, hbw: HeartbeatWriter) -> None:
        """Pass ``cp`` starts once every shard's pass ``cp - 1`` is put: a sample of a later epoch must never hold
        room the trainer's current epoch still needs from another shard (both sides would wait). Meanwhile the
        heartbeat says the worker is held back, as a put waiting for room."""
        s = self.s
        root = Path(s.shard_dir).parent
        need = len(shard_indexes(s.corpus_file, 0, 1, s.limit))
        waiting = False
        try:
            while True:
                have = sum(len(store.resume_check(str(d), read_manifest(d / pass_manifest(cp - 1)),
                                                  last_epoch=cp - 1).done)
                           for d in sorted(root.glob("shard_*")) if d.is_dir())
                if have >= need:
                    return
                if not waiting:
                    self.log(f"shard {s.shard}/{s.num_shards}: pass {cp} waits until every shard's pass {cp - 1} "
                             f"is put ({have}/{need})")
                    hbw.update(lambda hb: hb.extra.__setitem__(WAITING_FOR_PASS, cp))   # what it waits for: the watch
                    held_back(time.time())
                    waiting = True
                time.sleep(0.5)
        finally:
            if waiting:
                held_back(None)
                hbw.update(lambda hb: hb.extra.pop(WAITING_FOR_PASS, None))

    def _capture_pass(self, store: Store, cp: int, todo: list[Sample], hbw: HeartbeatWriter, held_back) -> None:
        s = self.s
        try:
            # the manifest's writer: after any compaction; a later pass's sink puts under its own keys and manifest
            sink = store.open_sink(replace(s.store_settings(), capture_pass=cp), s.shard)
        except StoreError as e:
            raise ExtractionError(f"shard {s.shard}: cannot write to the run's store: {e}") from None
        sink.on_wait = held_back
        try:
            # in_flight requests at once: while one thread writes a file, the others keep the server busy
            self._drive(todo, s.in_flight, "capture", lambda: lambda smp: self._one(smp, sink, hbw), self._abandon)
        finally:
            sink.close()
        self._raise_failure()

    def _abandon(self, threads: list[threading.Thread]) -> None:
        """No new sample, none stored that is not already being written (those get HALT_GRACE_S); the rest of
        the requests in flight are abandoned and redone at resume."""
        self._halt.set()
        self._stop.set()
        end = time.monotonic() + HALT_GRACE_S
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    def _pace(self) -> float | None:
        """Median seconds per request over this run's recent completions; None while too few to trust."""
        with self._lock:
            recent = sorted(self._per_request)
        return recent[len(recent) // 2] if len(recent) >= PACE_SEED_SAMPLES else None

    def _one(self, smp: Sample, sink: SampleSink, hbw: HeartbeatWriter) -> None:
        s = self.s
        rid = request_id(s.run_id, s.rid_shard, smp.index)
        fl = InFlight(id=rid, since=0.0, tokens=smp.tokens)
        ahead, pace = 0, self._pace()

        def sent(hb: Heartbeat) -> None:
            # the deadline counts the requests in flight ahead of this one, at this run's own pace
            nonlocal ahead
            ahead = len(hb.in_flight)
            fl.since = time.time()
            fl.timeout_s = round(request_deadline(s.request_timeout(smp.tokens), ahead, pace), 1)
            hb.in_flight.append(fl)
        hbw.update(sent)
        try:
            try:
                # past fl.timeout_s the request is overdue: evidence the watch reads from the heartbeat
                # (it tells a stalled server from a slow one); the worker waits on, and gives up itself
                # only at GIVE_UP_FACTOR deadlines, for a run with no watch
                generate(s.server_url, smp.input_ids, rid, GIVE_UP_FACTOR * fl.timeout_s)
            except CaptureServerError as e:
                full = dump_dir_full(s.dump_dir, smp.tokens * self._dump_bytes_per_token, str(e))
                if full:
                    raise ExtractionError(f"shard {s.shard}: sample {smp.id} (index {smp.index}, request {rid}) "
                                          f"failed because {full}. The server is not at fault: free space in "
                                          f"server.dump_dir or point it at a bigger filesystem, then re-run this "
                                          f"shard: stored samples are kept") from None
                late = (f" ({GIVE_UP_FACTOR:g} x its {fl.timeout_s:g} s deadline, which counted {ahead} request(s) "
                        f"ahead of it at this run's pace)" if isinstance(e, CaptureTimeout) else "")
                raise ExtractionError(
                    f"shard {s.shard}: sample {smp.id} (index {smp.index}, {smp.tokens} tokens, request {rid}) "
                    f"failed: {e}{late}. The capture server at {s.server_url} is dead, hung or rejected the sample; "
                    f"check its log, restart it (`eagleflow capture serve`) and re-run this shard: "
                    f"stored samples are kept") from None
            dpath = dump_path(s.dump_dir, rid)
            try:
                dump = read_dump(dpath)
                verify_dump(dump, s.dump_key, dpath, rid)   # before its hidden states go anywhere near the store
            except FileNotFoundError:
                raise ExtractionError(f"shard {s.shard}: the server answered request {rid} but wrote no dump at "
                                      f"{dpath}; is server.dump_dir ({s.dump_dir}) the server's dump dir, and is "
                                      "its capture hook installed?") from None
            except DumpTrustError as e:
                raise ExtractionError(f"shard {s.shard}: sample {smp.id} (index {smp.index}): {e}") from None
            if dump.input_ids.tolist() != smp.input_ids:
                raise ExtractionError(f"shard {s.shard}: the dump {dpath} holds {dump.input_ids.shape[0]} tokens "
                                      f"that differ from sample {smp.id} ({smp.tokens} tokens); the server did not "
                                      "run the whole sample in one prefill (radix cache or chunked prefill on?)")
            try:
                self._dump_bytes_per_token = max(self._dump_bytes_per_token,
                                                 os.stat(dpath).st_size // max(smp.tokens, 1))
            except FileNotFoundError:
                pass
            if self._halt.is_set() or stop_arrived():
                return   # abandoned: its dump is an orphan the next start removes, the sample is redone then
            # the server has answered: the request is no longer in flight there (a put held back by a streaming
            # store's buffer is not the server's delay, and must not read as an overdue request)
            hbw.update(lambda hb: hb.in_flight.remove(fl) if fl in hb.in_flight else None)
            try:
                # stored, then recorded in the shard's manifest: the sink's one step (eagleflow.stores)
                sink.put(encode_sample(index=smp.index, sample_id=smp.id, input_ids=dump.input_ids,
                                       loss_mask=smp.loss_mask, aux_hidden_states=dump.aux_hidden_states,
                                       hidden_states=dump.hidden_states, aux_layers=dump.aux_layers,
                                       model=dump.model or s.model, store_dtype=s.store_dtype))
            except StoreError as e:   # a streaming store full past its put timeout, or gone: named by the error
                raise ExtractionError(f"shard {s.shard}: sample {smp.id} (index {smp.index}) not stored: {e}. "
                                      "Re-run this shard once the store takes samples again: every sample its "
                                      "manifest records is kept") from None
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise ExtractionError(f"shard {s.shard}: disk full ({errno.errorcode[e.errno]}) storing sample "
                                      f"{smp.id} (index {smp.index}) in {s.shard_dir}: {free_space(s.shard_dir)}. "
                                      "Free space there (or move run_root to a bigger disk) and re-run this shard: "
                                      "every sample stored so far is kept and verified at resume") from None
            try:
                os.unlink(dpath)
            except FileNotFoundError:
                pass
        finally:
            hbw.update(lambda hb: hb.in_flight.remove(fl) if fl in hb.in_flight else None)

        finished = time.time()
        with self._lock:
            self._per_request.append((finished - fl.since) / (ahead + 1))
            del self._per_request[:-PACE_WINDOW]

        def progressed(hb: Heartbeat) -> None:
            hb.done += 1
            hb.tokens += smp.tokens
            hb.extra["tokens_this_run"] = hb.extra.get("tokens_this_run", 0) + smp.tokens
            # this run's own pace, for the watchdog (slow is judged against it, not a fixed limit)
            record_pace(hb, gap_s=finished - hb.last_progress_at, request_s=finished - fl.since)
        hbw.update(progressed)
        hbw.mark_progress()
        hb = hbw.hb
        if hb.done == hb.total or (hb.done - hb.resumed) % 50 == 0:
            self.log(hb.progress_line())
