"""The generation worker of one shard: source records -> the target (serving mode) -> regenerated records.

Input: the sources named by ``generate.sources`` (all when null), in config
order, each read and normalised as the corpus phase reads it; record ``index``
counts across them in that order and shard ``s`` of ``n`` takes
``index % n == s``. A record's id is the corpus id ``<source>:<row>``.

Output, per shard, in ``<run>/generated/shard_NNNNN/``: one result file per
record (``<index>.json``, written atomically: temp, fsync, rename), then its
line in ``manifest.jsonl`` (capture's manifest format: id, index, file,
bytes, sha256, mtime), and ``heartbeat.json`` (the same heartbeat the
extraction worker writes, unit "records"). Every record ends in a result
file, whatever its outcome (regenerated, cut, dropped, bad): a resume skips
exactly the indexes whose file is intact (``capture.manifest.completed_indexes``)
and redoes every other one, so a kill -9 at any point loses and repeats nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eagleflow import bounded_json
from eagleflow.capture.manifest import (ManifestEntry, ManifestWriter, compact_manifest, completed_indexes,
                                        read_manifest)
from eagleflow.capture.storage import file_sha256, remove_temp_files
from eagleflow.config import SourceConfig
from eagleflow.corpus.normalise import BadRecord, Conversation, normalise_batch
from eagleflow.corpus.sources import load_source
from eagleflow.corpus.tokenize import load_tokenizer
from eagleflow.durable import atomic_write
from eagleflow.heartbeat import Heartbeat, HeartbeatWriter, InFlight, record_pace
from eagleflow.phases.descriptor import HEARTBEAT, MANIFEST
from eagleflow.phases.shared.worker import PhaseWorker
from eagleflow.serving.client import ServerError, ServerTimeout, generate_tokens

from . import KIND
from .regenerate import BAD, Generation, RecordBuilder, RecordResult, Sampling, TemplateError

IDENTITY = "shard.json"   # {num_shards, shard, inputs_sha256}: what the stored results were generated from
GIVE_UP_FACTOR = 3.0   # as extraction: past its deadline a request is overdue evidence; the worker gives up later


class GenerationError(RuntimeError):
    """The shard cannot go on; the message says which record, what failed and what to do."""


@dataclass(frozen=True)
class SourceInput:
    name: str
    path: str
    format: str = "auto"
    limit: int | None = None


@dataclass(frozen=True)
class GenerateSettings:
    run_id: str
    shard: int
    num_shards: int
    shard_dir: str
    server_url: str
    model_path: str
    sources: tuple[SourceInput, ...]
    sampling: Sampling
    max_length: int
    concurrency: int = 8
    keep_truncated: bool = True
    max_bad_records: int = 0
    tool_call_format: str = "hermes"
    request_timeout_base_s: float = 120.0
    request_timeout_per_token_s: float = 0.1
    heartbeat_interval_s: float = 2.0
    non_text_parts: str = "error"
    seed: int = 42                    # corpus.seed: the same ids and shuffle keys as the corpus phase
    fsync: bool = True


@dataclass(frozen=True)
class InputRecord:
    index: int
    id: str
    source: str
    file: str
    where: str
    conversation: str | None      # Conversation JSON, or None for a record normalisation refused
    error: str | None             # BadRecord JSON


def result_file_name(index: int) -> str:
    return f"{index:08d}.json"


def read_inputs(sources, shard: int, num_shards: int, work_dir: str, *, seed: int = 42,
                non_text: str = "error") -> list[InputRecord]:
    """This shard's records, in index order, normalised as the corpus phase normalises them."""
    out: list[InputRecord] = []
    index = 0
    for src in sources:
        ds = load_source(SourceConfig(name=src.name, path=src.path, format=src.format, limit=src.limit),
                         Path(src.path), cache_dir=os.path.join(work_dir, src.name))
        for start in range(0, len(ds), 1000):
            batch = ds[start:start + 1000]
            n = len(batch["__row"])
            mine = [k for k in range(n) if (index + k) % num_shards == shard]
            if mine:
                part = {c: [batch[c][k] for k in mine] for c in batch}
                norm = normalise_batch(part, source=src.name, file=src.path, seed=seed, non_text=non_text)
                for k, i in enumerate(mine):
                    out.append(InputRecord(index + i, norm["id"][k], src.name, src.path, norm["where"][k],
                                           norm["conversation"][k], norm["error"][k]))
            index += n
    return out


def inputs_digest(inputs: list[InputRecord]) -> str:
    """What the shard's results were made from: per record its index, id, the conversation's sha256 and, for a
    bad record, only the error's kind and field (never its wording, which an upgrade may change)."""
    h = hashlib.sha256()
    for r in inputs:
        conv = hashlib.sha256(r.conversation.encode()).hexdigest() if r.conversation is not None else None
        err = None
        if r.error is not None:
            try:
                e = json.loads(r.error)
                err = [e.get("kind"), e.get("field")]
            except ValueError:
                err = ["?", "?"]
        h.update(json.dumps([r.index, r.id, conv, err]).encode() + b"\n")
    return h.hexdigest()


def _legacy_inputs_digest(inputs: list[InputRecord]) -> str:
    # the digest shard identities were written with before: still resumed (their identity is rewritten)
    h = hashlib.sha256()
    for r in inputs:
        h.update(json.dumps([r.index, r.id, r.conversation, r.error], ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def check_identity(shard_dir: str | os.PathLike, shard: int, num_shards: int, inputs: list[InputRecord],
                   fsync: bool = True) -> None:
    """Write the shard's identity on its first run; refuse to resume results made for another split or input.

    A resume goes by record index: under another ``generate.shards`` or changed sources the same index is
    another record, and its stored result would be kept for it."""
    path = Path(shard_dir) / IDENTITY
    want = {"num_shards": num_shards, "shard": shard, "inputs_sha256": inputs_digest(inputs)}
    try:
        have = bounded_json.read(path)
    except FileNotFoundError:
        atomic_write(path, json.dumps(want, sort_keys=True) + "\n", fsync=fsync)
        return
    except ValueError as e:
        raise GenerationError(f"generate shard {shard}: {path} is not JSON ({e}); delete {Path(shard_dir)} to "
                              "regenerate this shard from scratch") from None
    diff = [f"{k} {have.get(k)!r} there, {v!r} now" for k, v in want.items() if have.get(k) != v]
    if (len(diff) == 1 and have.get("inputs_sha256") != want["inputs_sha256"]
            and have.get("inputs_sha256") == _legacy_inputs_digest(inputs)):
        atomic_write(path, json.dumps(want, sort_keys=True) + "\n", fsync=fsync)   # the same inputs, older digest
        return
    if diff:
        raise GenerationError(f"generate shard {shard}: the results in {Path(shard_dir)} were generated for other "
                              f"inputs ({path}: {'; '.join(diff)}). Restore the generate.shards and sources they "
                              f"were made with to resume, or delete {Path(shard_dir)} to regenerate this shard")


def plan_resume(inputs: list[InputRecord], scan, done: set[int]) -> tuple[list[InputRecord], list[str]]:
    """(records to do, why stored ones are redone): an index is skipped only when its stored id is the input's."""
    todo, redo = [], []
    for r in inputs:
        if r.index in done:
            if scan.entries[r.index].id == r.id:
                continue
            redo.append(f"index {r.index}: stored {scan.entries[r.index].id!r}, input {r.id!r}")
        todo.append(r)
    return todo, redo


def earlier_wall_s(heartbeat_path: Path) -> float:
    """The wall time of this shard's earlier runs (from the heartbeat the last one left): the stats divide
    every stored record's tokens by every run's time, not by the last run's alone."""
    prev = Heartbeat.read(str(heartbeat_path))
    if prev is None:
        return 0.0
    ran = max(0.0, prev.time - prev.started_at) if prev.started_at else 0.0   # a run that failed before starting
    return float(prev.extra.get("wall_s_before", 0.0)) + ran


class GenerateWorker(PhaseWorker):
    """One generation shard's worker (the loop around it: ``phases.shared.worker.PhaseWorker``)."""
    kind = KIND
    error = GenerationError

    def __init__(self, settings: GenerateSettings, tokenizer=None, log=print):
        super().__init__(settings.shard, settings.num_shards, settings.shard_dir, settings.heartbeat_interval_s, log)
        self.s = settings
        self._tok = tokenizer
        self.bad: list[dict] = []

    def heartbeat_extra(self) -> dict[str, Any]:
        return {**super().heartbeat_extra(), "server_url": self.s.server_url, "phase": self.kind.phase,
                "wall_s_before": earlier_wall_s(self.shard_dir / HEARTBEAT)}

    def _target(self, fl_ref: list, hbw: HeartbeatWriter, rid_base: str):
        s = self.s

        def target(input_ids, *, max_new_tokens, temperature, top_p, seed, stop_token_ids) -> Generation:
            own = s.request_timeout_base_s + s.request_timeout_per_token_s * max_new_tokens
            fl = InFlight(id=f"{rid_base}-t{len(fl_ref)}", since=time.time(), tokens=len(input_ids), timeout_s=own)
            fl_ref.append(fl)
            hbw.update(lambda hb: hb.in_flight.append(fl))
            try:
                ids, finish = generate_tokens(s.server_url, input_ids, fl.id, max_new_tokens=max_new_tokens,
                                              temperature=temperature, top_p=top_p, seed=seed,
                                              stop_token_ids=stop_token_ids, timeout_s=GIVE_UP_FACTOR * own)
            finally:
                hbw.update(lambda hb: hb.in_flight.remove(fl) if fl in hb.in_flight else None)
            return Generation(ids, finish)
        return target

    def _run(self, hbw: HeartbeatWriter) -> None:
        s = self.s
        shard_dir = Path(s.shard_dir)
        removed_tmp = remove_temp_files(shard_dir)
        scan = read_manifest(shard_dir / MANIFEST)
        check = completed_indexes(shard_dir, scan)
        done = check.done
        if check.broken or check.refreshed or not scan.clean:
            keep = [check.refreshed.get(i, scan.entries[i]) for i in sorted(done)]
            compact_manifest(shard_dir / MANIFEST, keep, fsync=s.fsync)
        work = tempfile.mkdtemp(dir=shard_dir, prefix=".work-")
        try:
            inputs = read_inputs(s.sources, s.shard, s.num_shards, work, seed=s.seed, non_text=s.non_text_parts)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        check_identity(shard_dir, s.shard, s.num_shards, inputs, fsync=s.fsync)
        todo, redo = plan_resume(inputs, scan, done)
        if redo:
            self.log(f"generate shard {s.shard}: {len(redo)} stored result(s) are of another record and are redone: "
                     + "; ".join(redo[:5]))
        kept = {r.index for r in inputs} - {r.index for r in todo}
        for i in sorted(kept):   # bad records already recorded count against max_bad_records too
            try:
                stored = RecordResult.from_json((shard_dir / scan.entries[i].file).read_text())
            except (OSError, ValueError, TypeError):
                continue
            if stored.status == BAD and stored.bad is not None:
                self.bad.append(stored.bad)
        if self._tok is None:
            self._tok = load_tokenizer(s.model_path)

        def init(hb: Heartbeat) -> None:
            hb.state = "running"
            hb.started_at = hb.last_progress_at = time.time()
            hb.total, hb.done, hb.resumed = len(inputs), len(inputs) - len(todo), len(inputs) - len(todo)
        hbw.update(init)
        hbw.flush()
        self.log(f"generate shard {s.shard}/{s.num_shards}: {len(inputs)} records, {len(inputs) - len(todo)} "
                 f"already done, {len(todo)} to do; removed {len(removed_tmp)} temp file(s)"
                 + (f"; {len(check.broken)} result file(s) will be redone" if check.broken else ""))
        self._check_bad()
        if not todo:
            return
        with ManifestWriter(shard_dir / MANIFEST, fsync=s.fsync) as manifest:
            self._drive(todo, s.concurrency, self.kind.phase, lambda: self._record_loop(manifest, hbw),
                        lambda threads: self._stop.set())
            self._stop.set()
        self._raise_failure()

    def _record_loop(self, manifest: ManifestWriter, hbw: HeartbeatWriter) -> Callable[[InputRecord], None]:
        """One thread's work on a record: its own builder (a template's state is per thread)."""
        s = self.s
        builder: RecordBuilder | None = None

        def one(rec: InputRecord) -> None:
            nonlocal builder
            fl_ref: list = []
            target = self._target(fl_ref, hbw, f"{s.run_id}-g{s.shard:05d}-{rec.index:08d}")
            if builder is None:
                builder = RecordBuilder(self._tok, target, s.sampling, max_length=s.max_length,
                                        keep_truncated=s.keep_truncated, tool_call_format=s.tool_call_format)
            builder.target = target
            self._one(rec, builder, manifest, hbw)
        return one

    def _check_bad(self) -> None:
        if len(self.bad) > self.s.max_bad_records:
            shown = "; ".join(BadRecord(**b).describe() + f" [{b['kind']}]" for b in self.bad[:10])
            raise GenerationError(f"generate shard {self.s.shard}: {len(self.bad)} record(s) cannot be regenerated, "
                                  f"generate.max_bad_records is {self.s.max_bad_records}: {shown}. Fix or remove "
                                  "them in the source, or raise generate.max_bad_records to skip them")

    def _one(self, rec: InputRecord, builder: RecordBuilder, manifest: ManifestWriter, hbw: HeartbeatWriter) -> None:
        s = self.s
        started = time.time()
        if rec.conversation is None:
            if rec.error is None:   # read_inputs gives a refused record its reason
                raise GenerationError(f"generate shard {s.shard}: record {rec.id} ({rec.file} {rec.where}) has "
                                      "neither a conversation nor the reason it was refused")
            res = RecordResult(id=rec.id, source=rec.source, where=rec.where, status=BAD,
                               bad=BadRecord.from_json(rec.error).__dict__)
        else:
            try:
                res = builder.regenerate(Conversation.from_json(rec.conversation), record_id=rec.id,
                                         source=rec.source, file=rec.file, where=rec.where)
            except ServerError as e:
                late = " (no answer within its deadline)" if isinstance(e, ServerTimeout) else ""
                raise GenerationError(f"generate shard {s.shard}: record {rec.id} ({rec.file} {rec.where}) failed: "
                                      f"{e}{late}. The generation server at {s.server_url} is dead, hung or refused "
                                      "the request; check its log, restart it and re-run this shard: finished "
                                      "records are kept") from None
            except TemplateError as e:
                raise GenerationError(f"generate shard {s.shard}: record {rec.id} ({rec.file} {rec.where}): "
                                      f"{e}. Use a template that renders history as a stable prefix, or leave "
                                      f"source {rec.source} out of generate.sources") from None
        if self._stop.is_set() and self._error is not None:
            return
        if res.status == BAD and res.bad is not None:   # _bad sets both
            with self._lock:
                self.bad.append(res.bad)
                self._check_bad()
        name = result_file_name(rec.index)
        # No fsync per record (two per file cost ~0.4 s a record on a busy disk, half the phase's time): the
        # rename still publishes whole files, and a file a machine crash loses or empties is found at resume
        # by its manifest size and sha256 and redone; the manifest itself is group-committed (ManifestWriter).
        path = atomic_write(Path(s.shard_dir) / name, res.to_json() + "\n", fsync=False)
        st = os.stat(path)
        with self._lock:
            manifest.append(ManifestEntry(id=rec.id, index=rec.index, file=name, tokens=len(res.input_ids),
                                          bytes=st.st_size, sha256=file_sha256(path), mtime_ns=st.st_mtime_ns))
        finished = time.time()

        def progressed(hb: Heartbeat) -> None:
            hb.done += 1
            hb.tokens += res.tokens_generated
            hb.extra["tokens_this_run"] = hb.extra.get("tokens_this_run", 0) + res.tokens_generated
            record_pace(hb, gap_s=finished - hb.last_progress_at, request_s=finished - started)
        hbw.update(progressed)
        hbw.mark_progress()
        hb = hbw.hb
        if hb.done == hb.total or (hb.done - hb.resumed) % 50 == 0:
            self.log(hb.progress_line())


def read_results(shard_dir: str | os.PathLike, shard: int | None = None,
                 num_shards: int | None = None) -> list[RecordResult]:
    """The shard's results whose files are intact, by index (what the corpus phase and the stats read): only
    this shard's indexes (``index % num_shards == shard``; from its identity file when not given)."""
    d = Path(shard_dir)
    if shard is None or num_shards is None:
        try:
            ident = bounded_json.read(d / IDENTITY)
            shard, num_shards = int(ident["shard"]), int(ident["num_shards"])
        except (OSError, ValueError, KeyError, TypeError):
            shard = num_shards = None
    scan = read_manifest(d / MANIFEST)
    done = completed_indexes(d, scan).done
    return [RecordResult.from_json((d / scan.entries[i].file).read_text()) for i in sorted(done)
            if num_shards is None or i % num_shards == shard]

