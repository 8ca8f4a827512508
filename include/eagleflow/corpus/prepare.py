"""Merge the sources into one shuffled, tokenised corpus with its statistics.

Every stage is a ``datasets`` (Arrow) step written to a work folder beside the
output, so memory stays flat however large the corpus is: read -> normalise
(batched, multi-process map) -> check bad records -> check that the chat
template renders the first record and the first tool-calling one whole ->
tokenise with the target's chat template (batched, multi-process map; every
record's rendering checked, over-long ones cut or dropped) -> bad records the
template raised on, records without assistant tokens out -> sort by a seeded
hash of the sample id -> stream to Parquet, reading the rows by position.

Output (the shared contract): ``<run_dir>/corpus/corpus.parquet`` with columns
index, id, source, input_ids, loss_mask, num_tokens, and ``stats.json``.

Held-out split: by groups of records. A record's group is what it is about,
the value of its ``corpus.eval_group_key`` field (e.g. the function a record
of the learnable target explains), or, unset, its own id ``source:row``. The
groups whose ``eval_key`` (sha256 of "eval" and the group) is among the lowest
``corpus.eval_fraction`` (raised by whole groups to ``eval_min_records``
records, capped by whole groups at ``eval_max_records``) go, every record of
them, to ``eval.parquet`` instead, normalised, rendered and masked the same
way, plus the conversation and ``prompt_ids`` (the conversation before its
last assistant turn, rendered with the generation prompt). Capture reads
corpus.parquet only, so held-out records are never captured nor trained on,
and no training record shares a held-out record's group.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Callable, Protocol

from eagleflow.config import PipelineConfig
from eagleflow.durable import atomic_replace, atomic_write
from eagleflow.layout import RunLayout

from .normalise import BAD_KINDS, TEMPLATE_ERROR, BadRecord, control_token_strings, normalise_batch, short_repr
from .sources import SourceError, load_source
from .tokenize import (DROP_REASONS, TemplateError, load_tokenizer, mask_method_for, template_label,
                       tokenize_batch)
from .normalise import Conversation, record_groups
from .tokenize import render, tokenise_record

CORPUS_FILE = "corpus.parquet"
EVAL_FILE = "eval.parquet"
STATS_FILE = "stats.json"
BAD_RECORDS_FILE = "bad_records.jsonl"
SHOWN_BAD_RECORDS = 10
NORMALISE_ROWS_PER_PROCESS = 20_000  # below this a pool's start costs more than parsing the JSON
_WRITE_BATCH = 256


class BadRecordsError(ValueError):
    """More bad records than corpus.max_bad_records allows; the message lists the first ten."""


class GroupKeyError(ValueError):
    """corpus.eval_group_key is set and a record lacks that field; the message names the first such record."""


def corpus_schema():
    import pyarrow as pa
    return pa.schema([("index", pa.int64()), ("id", pa.string()), ("source", pa.string()),
                      ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("num_tokens", pa.int32())])


def eval_schema():
    import pyarrow as pa
    return pa.schema(list(corpus_schema()) + [pa.field("conversation", pa.string()),
                                              pa.field("prompt_ids", pa.list_(pa.int32()))])


def eval_key(group: str) -> int:
    """Held-out rank of a group (a record id ``source:row`` when ungrouped): the same for any seed, run, machine
    or set of other sources."""
    return int.from_bytes(hashlib.sha256(f"eval\x00{group}".encode()).digest()[:8], "big")


def held_out_count(candidates: int, total: int, cc) -> int:
    """How many records the split holds out: the hash's share, raised to the minimum, capped."""
    if cc.eval_fraction <= 0 or total < 2:
        return 0
    return max(0, min(max(candidates, cc.eval_min_records), cc.eval_max_records, total - 1))


def _held_out_rows(ids_col, kept_rows, cc, groups_col=None) -> list[int]:
    """Rows (positions in ``ids_col``) of the held-out records, lowest eval_key first; by group when
    ``groups_col`` (each row's ``corpus.eval_group_key`` value, aligned with ``ids_col``) is given."""
    if groups_col is not None:
        return _held_out_group_rows(ids_col, kept_rows, cc, groups_col)
    import heapq
    threshold = cc.eval_fraction * 2 ** 64
    cands: list[tuple[int, str, int]] = []
    lowest: list[tuple[int, str, int]] = []   # the eval_min_records lowest keys (max-heap by negation)
    rows = kept_rows.to_pylist()
    for s in range(0, len(rows), 65536):   # ids in batches: memory stays flat
        part = rows[s:s + 65536]
        for row, sid in zip(part, ids_col.take(part).to_pylist()):
            key = eval_key(sid)
            if key < threshold:
                cands.append((key, sid, row))
            elif cc.eval_min_records:
                item = (-key, sid, row)
                if len(lowest) < cc.eval_min_records:
                    heapq.heappush(lowest, item)
                elif item > lowest[0]:
                    heapq.heapreplace(lowest, item)
    pool = sorted(cands + [(-k, sid, r) for k, sid, r in lowest])
    return [r for _, _, r in pool[:held_out_count(len(cands), len(rows), cc)]]


def held_out_groups(sizes: dict[str, int], cc) -> list[str]:
    """The groups the split holds out, lowest eval_key first, given each group's record count: those of the
    hash's share, then the next ones while fewer than eval_min_records records are held out; whole groups
    only, never past eval_max_records records, never every group (by record, held_out_count's rule)."""
    order = sorted(sizes, key=lambda g: (eval_key(g), g))
    threshold = cc.eval_fraction * 2 ** 64
    total = sum(sizes.values())
    target = held_out_count(sum(sizes[g] for g in order if eval_key(g) < threshold), total, cc)
    cap = min(cc.eval_max_records, total - 1)
    held: list[str] = []
    records = 0
    for g in order[:len(order) - 1]:   # one group at least stays for training
        if records >= target or records + sizes[g] > cap:
            break
        held.append(g)
        records += sizes[g]
    return held


def _held_out_group_rows(ids_col, kept_rows, cc, groups_col) -> list[int]:
    """Every row of the held-out groups (``held_out_groups``), by group, lowest record eval_key first within."""
    rows = kept_rows.to_pylist()
    sizes: Counter[str] = Counter()
    for s in range(0, len(rows), 65536):   # groups in batches: memory grows with the groups, not the text
        sizes.update(groups_col.take(rows[s:s + 65536]).to_pylist())
    held = {g: i for i, g in enumerate(held_out_groups(sizes, cc))}
    picked: list[tuple[int, int, int]] = []
    for s in range(0, len(rows), 65536):
        part = rows[s:s + 65536]
        for row, sid, g in zip(part, ids_col.take(part).to_pylist(), groups_col.take(part).to_pylist()):
            if g in held:
                picked.append((held[g], eval_key(sid), row))
    return [r for _, _, r in sorted(picked)]


def _group_counts(groups_col, rows: list[int]) -> int:
    """Distinct groups among ``rows``."""
    seen: set[str] = set()
    for s in range(0, len(rows), 65536):
        seen.update(groups_col.take(rows[s:s + 65536]).to_pylist())
    return len(seen)


def _missing_group_key(good, key: str, files: dict[str, str]) -> GroupKeyError | None:
    """The error naming the first record without corpus.eval_group_key's field (and how many lack it per
    source), or None when every record has it."""
    groups = _column(good, "group")
    missing = groups.is_null()
    first = _first_true(missing)
    if first is None:
        return None
    row = good[first]
    import pyarrow.compute as pc
    per_source = Counter(_column(good, "source").filter(missing).to_pylist())
    where = "top level" if "." in key else "top level nor in its `metadata` object"
    return GroupKeyError(
        f"corpus.eval_group_key is {key!r} but {_record_name(row, files)} has no such field (not at the record's "
        f"{where}, or null or empty): {pc.sum(missing).as_py()} of {len(good)} record(s) lack it ("
        + ", ".join(f"{n} {c}" for n, c in sorted(per_source.items())) + "). The key says what a record is "
        f"about, so that all the records about one thing land on one side of the held-out split: add the field to "
        f"every record of those sources, point corpus.eval_group_key at a field they all have, or unset it to "
        f"split record by record")


def _original_groups(src, path: Path, key: str, cache_dir: str) -> dict[int, str | None]:
    """A regenerated source's groups, read from its original records (the generated ones keep only the
    conversation), by row."""
    raw = load_source(src, path, cache_dir=cache_dir)
    out: dict[int, str | None] = {}
    for s in range(0, len(raw), 4096):
        part = raw[s:s + 4096]
        out.update(zip(part["__row"], record_groups(part, key)))
    return out


def content_key(conversation_json: str) -> bytes:
    """What makes two records the same conversation: their normalised messages and tools (ids, sources and
    token-exact ids aside), every text with its whitespace runs collapsed and its ends stripped."""
    d = json.loads(conversation_json)

    def canon(v):
        if isinstance(v, str):
            return " ".join(v.split())
        if isinstance(v, list):
            return [canon(x) for x in v]
        if isinstance(v, dict):
            return {k: canon(x) for k, x in v.items()}
        return v
    text = json.dumps(canon({"messages": d.get("messages"), "tools": d.get("tools")}), sort_keys=True,
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()[:16]


def _deduplicated_split(conversations, kept_rows, eval_rows: list[int]) -> tuple[list[int], list[int], dict]:
    """Identical conversations on one side only: (held-out rows, rows dropped, counts).

    ``conversations``: the normalised records' dataset (arrow format, row positions as ``kept_rows``).

    The held-out split keeps the first of identical held-out records (in held-out order); every copy of a
    held-out conversation elsewhere (training or held out again) leaves the corpus, so no training record
    repeats a held-out one. Copies within training stay (counted)."""
    first: dict[bytes, int] = {}
    key_of: dict[int, bytes] = {}
    copies = 0
    rows = kept_rows.to_pylist()
    for s in range(0, len(rows), 4096):   # conversations in batches: memory stays flat (16 bytes a record)
        part = rows[s:s + 4096]
        for row, conv in zip(part, conversations[part]["conversation"].to_pylist()):
            k = content_key(conv)
            key_of[row] = k
            if k in first:
                copies += 1
            else:
                first[k] = row
    held: dict[bytes, int] = {}
    kept_eval, dropped = [], []
    for row in eval_rows:
        k = key_of[row]
        if k in held:
            dropped.append(row)            # a second held-out copy: the figures would count it twice
        else:
            held[k] = row
            kept_eval.append(row)
    eval_set = set(eval_rows)
    twins = [row for row in rows if row not in eval_set and key_of[row] in held]
    return kept_eval, sorted(twins + dropped), {
        "records_with_an_identical_earlier_one": copies,
        "held_out_twins_dropped_from_training": len(twins),
        "held_out_copies_dropped": len(dropped),
        "key": "sha256 of the normalised messages and tools, whitespace collapsed"}


def eval_prompt_ids(tokenizer, conv, max_length: int) -> list[int]:
    """The conversation before its last assistant turn, with the generation prompt; [] when it has
    none before it or the prompt leaves no room to generate within max_length."""
    last = max((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), default=0)
    if last == 0:
        return []
    ids = tokenizer(render(tokenizer, conv, last, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return list(ids) if len(ids) < max_length else []


def _features():
    from datasets import Features, List, Value
    norm = Features({"id": Value("string"), "source": Value("string"), "where": Value("string"),
                     "conversation": Value("string"), "uses_tools": Value("bool"),
                     "non_text_dropped": Value("int32"), "error": Value("string"), "shuffle_key": Value("int64"),
                     "group": Value("string")})
    tok = Features({"id": Value("string"), "source": Value("string"), "where": Value("string"),
                    "uses_tools": Value("bool"), "non_text_dropped": Value("int32"), "shuffle_key": Value("int64"),
                    "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
                    "num_tokens": Value("int32"), "masked_tokens": Value("int32"),
                    "length_status": Value("string"), "drop_reason": Value("string"), "turns": Value("int32"),
                    "tool_calls": Value("int32"), "tool_messages": Value("int32"),
                    "reasoning_not_rendered": Value("int32"), "template_error": Value("string"),
                    "content_dropped": Value("string"), "group": Value("string")})
    return norm, tok


def _split(requested: int, rows: int, max_batch: int) -> tuple[int, int | None]:
    """(batch size, processes): every process gets work, no more processes than batches."""
    batch = max(1, min(max_batch, -(-rows // max(requested, 1))))
    n = max(1, min(requested, -(-rows // batch)))
    return batch, (n if n > 1 else None)


def _column(ds, name: str):
    """One column as a pyarrow ChunkedArray, honouring a filter's indices mapping."""
    return ds.select_columns([name]).with_format("arrow")[:][name]


def _percentiles(lengths) -> dict:
    import numpy as np
    if len(lengths) == 0:
        return {"min": 0, "mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "max": 0}
    a = np.asarray(lengths)
    pct = {f"p{q}": int(np.percentile(a, q, method="nearest")) for q in (50, 90, 99)}
    return {"min": int(a.min()), "mean": round(float(a.mean()), 1), **pct, "max": int(a.max())}


def _no_records_left(read: dict[str, int], n_bad: int, dropped: Counter, max_length: int) -> None:
    raise BadRecordsError(
        f"corpus: no record left to train on: {sum(read.values())} read "
        f"({', '.join(f'{k} {v}' for k, v in read.items())}), {n_bad} bad, "
        f"{sum(dropped.values())} dropped ({', '.join(f'{k} {v}' for k, v in sorted(dropped.items())) or 'none'}); "
        f"check the sources' paths and contents, corpus.max_length ({max_length}) and corpus.over_max_length")


class _BadRecordLedger:
    """Bad records of every stage: counted by source and kind, all in bad_records.jsonl, the first ten shown."""

    def __init__(self, path: Path, allowed: int, log: Callable[[str], None]):
        self.path, self.allowed, self.log = path, allowed, log
        self.by_kind: Counter = Counter()
        self.by_source: dict[str, Counter] = {}
        self.shown: list[BadRecord] = []
        self._logged = 0
        path.unlink(missing_ok=True)

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def add(self, records) -> None:
        with open(self.path, "a") as f:
            for rec in records:
                self.by_kind[rec.kind] += 1
                self.by_source.setdefault(rec.source, Counter())[rec.kind] += 1
                if len(self.shown) < SHOWN_BAD_RECORDS:
                    self.shown.append(rec)
                f.write(rec.to_json() + "\n")

    def enforce(self, stage: str) -> None:
        n = self.count
        if n > self.allowed:
            lines = [f"corpus: {n} bad record(s), more than corpus.max_bad_records={self.allowed}. "
                     f"First {len(self.shown)}:"]
            lines += [f"  - {r.describe()}" for r in self.shown]
            lines.append(f"All of them are in {self.path}. Fix those records, or set corpus.max_bad_records to at "
                         f"least {n} to skip them (counted in stats.json).")
            raise BadRecordsError("\n".join(lines))
        if n > self._logged:
            self._logged = n
            self.log(f"corpus: skipping {n} bad record(s) found by {stage} (max_bad_records {self.allowed}): "
                     + ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items())))

    def finish(self) -> None:
        if not self.count:
            self.path.unlink(missing_ok=True)
        for r in self.shown:
            self.log(f"corpus: skipped {r.describe()}")


def _first_true(flags) -> int | None:
    """Position of the first true value of a boolean (Chunked)Array, in source order."""
    import pyarrow.compute as pc
    hits = pc.indices_nonzero(flags.combine_chunks() if hasattr(flags, "combine_chunks") else flags)
    return int(hits[0].as_py()) if len(hits) else None


def _record_name(row: dict, files: dict[str, str]) -> str:
    return f"record {row['id']} ({files[row['source']]} {row['where']})"


def _content_dropped_error(label: str, row: dict, files: dict[str, str], problem: str) -> TemplateError:
    return TemplateError(f"{label} drops content of {_record_name(row, files)}: {problem}. Use the target's own "
                         "template, one that renders tools and tool calls (transformers passes them as "
                         "apply_chat_template(messages, tools=...) with assistant 'tool_calls'), or fix the "
                         "template in the target's chat_template.jinja / tokenizer_config.json")


def _check_template(tokenizer, label: str, good, files: dict[str, str], *, max_length: int, method: str,
                    policy: str, fail_on_template_error: bool) -> None:
    """Before tokenising everything: render the first record and the first that uses tools in this
    process, so a template that cannot render tools fails in seconds, not after the whole corpus."""
    first_tools = _first_true(_column(good, "uses_tools"))
    for i in sorted({0} if first_tools is None else {0, first_tools}):
        row = good[i]
        rec = tokenise_record(tokenizer, Conversation.from_json(row["conversation"]), max_length=max_length,
                              method=method, over_max_length=policy)
        if rec.content_dropped:
            raise _content_dropped_error(label, row, files, rec.content_dropped)
        if rec.template_error and fail_on_template_error:
            raise TemplateError(f"{label} cannot render {_record_name(row, files)}: {rec.template_error}. "
                                "Fix the template or the record (or allow it with corpus.max_bad_records)")


class RegeneratedSources(Protocol):
    """The sources an earlier phase rewrote (the generation phase's results, ``eagleflow.phases.generate``).

    Handed in by the caller, not imported: the generation phase reads this package (normalise, sources,
    tokenize), so the corpus reading it back would close a circle between the two layers."""

    def names(self, log: Callable[[str], None]) -> list[str]:
        """The rewritten sources' names, after checking the phase is complete (else ``SourceError``)."""
        ...

    def rows(self, source: str) -> list[dict]:
        """One rewritten source's records as ``load_source`` rows (``__row``, ``__where``, ``__raw``, ...)."""
        ...


def prepare_corpus(cfg: PipelineConfig, layout: RunLayout, *, num_proc: int | None = None,
                   mask_method: str = "auto", log: Callable[[str], None] = print,
                   regenerated: RegeneratedSources | None = None) -> dict:
    """Build corpus.parquet and stats.json under the run's corpus dir; return the stats. ``regenerated``: the
    generation phase's results when ``generate.enabled`` (``eagleflow corpus prepare`` passes them)."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # map workers are the parallelism
    datasets.disable_progress_bars()
    started = time.monotonic()
    cc = cfg.corpus
    if not cc.sources:
        raise ValueError("corpus.sources is empty; list at least one source (name, path) in the config")
    procs = num_proc or cc.num_proc
    out_dir = Path(str(layout.corpus_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (CORPUS_FILE, EVAL_FILE, STATS_FILE, BAD_RECORDS_FILE):
        (out_dir / stale).unlink(missing_ok=True)  # a failed run must not leave an old claim behind
    for old_work in out_dir.glob(".work-*"):  # left by a killed run of this same run dir
        shutil.rmtree(old_work, ignore_errors=True)
    model_path = str(cfg.resolve(cfg.target_model))
    tokenizer = load_tokenizer(model_path)
    method = mask_method_for(tokenizer, mask_method)
    label = template_label(tokenizer, model_path)
    log(f"corpus: {len(cc.sources)} source(s), tokenizer {model_path}, loss mask by {method}, "
        f"max_length {cc.max_length} ({cc.over_max_length} when over), seed {cc.seed}, {procs} process(es)")
    norm_features, tok_features = _features()
    control_tokens = control_token_strings(tokenizer)   # record text holding one is a bad record (normalise)
    files = {s.name: str(cfg.resolve(s.path)) for s in cc.sources}
    ledger = _BadRecordLedger(out_dir / BAD_RECORDS_FILE, cc.max_bad_records, log)
    work = tempfile.mkdtemp(dir=out_dir, prefix=".work-")
    try:
        normalised = []
        read_per_source: dict[str, int] = {}
        rewritten = _rewritten_names(cfg, regenerated, log)
        for src in cc.sources:
            path = cfg.resolve(src.path)
            groups = None
            if regenerated is not None and src.name in rewritten:   # the target's own turns, token-exact
                raw = _generated_source(regenerated, src.name)
                log(f"corpus: source {src.name}: {len(raw)} record(s) as the target regenerated them")
                if cc.eval_group_key:
                    groups = _original_groups(src, path, cc.eval_group_key, os.path.join(work, "sources"))
            else:
                raw = load_source(src, path, cache_dir=os.path.join(work, "sources"))
            read_per_source[src.name] = len(raw)
            if len(raw) == 0:  # datasets' map drops the columns of an empty dataset
                log(f"corpus: source {src.name}: no records in {path}")
                normalised.append(datasets.Dataset.from_dict({k: [] for k in norm_features}, features=norm_features))
                continue
            # parsing JSON is cheap next to a process pool's start: several processes only for big sources
            batch, nproc = _split(min(procs, max(1, len(raw) // NORMALISE_ROWS_PER_PROCESS)), len(raw), 1000)
            norm = raw.map(normalise_batch, batched=True, batch_size=batch, num_proc=nproc,
                           remove_columns=raw.column_names, features=norm_features,
                           fn_kwargs={"source": src.name, "file": str(path), "seed": cc.seed,
                                      "non_text": cc.non_text_parts, "token_exact": src.name in rewritten,
                                      "control_tokens": control_tokens, "group_key": cc.eval_group_key,
                                      "groups": groups},
                           cache_file_name=os.path.join(work, f"norm-{src.name}.arrow"),
                           load_from_cache_file=False, desc=f"normalise {src.name}")
            normalised.append(norm)
            log(f"corpus: source {src.name}: {len(raw)} record(s) read from {path}, "
                f"normalised in {nproc or 1} process(es) ({time.monotonic() - started:.1f} s so far)")
        merged = datasets.concatenate_datasets(normalised)

        # Bad records: fail now (before the costly tokenising) unless they are allowed.
        errors = _column(merged, "error")
        ledger.add(BadRecord.from_json(t) for chunk in errors.filter(errors.is_valid()).chunks
                   for t in chunk.to_pylist())
        ledger.enforce("normalise")
        good = merged.filter(lambda e: [x is None for x in e], input_columns="error", batched=True,
                             batch_size=1000).remove_columns(["error"])
        if len(good) == 0:
            _no_records_left(read_per_source, ledger.count, Counter(), cc.max_length)
        if cc.eval_group_key:   # before the costly tokenising: every record must say what it is about
            missing = _missing_group_key(good, cc.eval_group_key, files)
            if missing is not None:
                raise missing

        _check_template(tokenizer, label, good, files, max_length=cc.max_length, method=method,
                        policy=cc.over_max_length, fail_on_template_error=cc.max_bad_records == 0)
        tok_batch, tok_procs = _split(procs, len(good), 64)
        tokenised = good.map(tokenize_batch, batched=True, batch_size=tok_batch,
                             num_proc=tok_procs, remove_columns=good.column_names,
                             features=tok_features,
                             fn_kwargs={"model_path": model_path, "max_length": cc.max_length, "method": method,
                                        "over_max_length": cc.over_max_length},
                             cache_file_name=os.path.join(work, "tokenised.arrow"), load_from_cache_file=False,
                             desc="tokenise")
        log(f"corpus: {len(good)} record(s) tokenised in {tok_procs or 1} process(es), batches of {tok_batch} "
            f"({time.monotonic() - started:.1f} s so far)")
        meta = tokenised.select_columns(
            ["id", "source", "where", "shuffle_key", "drop_reason", "template_error", "content_dropped",
             "uses_tools", "non_text_dropped", "length_status", "turns", "tool_calls", "tool_messages",
             "reasoning_not_rendered", "num_tokens", "masked_tokens", "group"]).with_format("arrow")[:]

        first_dropped = _first_true(meta["content_dropped"].is_valid())
        if first_dropped is not None:
            row = {k: meta[k][first_dropped].as_py() for k in ("id", "source", "where", "content_dropped")}
            raise _content_dropped_error(label, row, files, row["content_dropped"])
        template_failed = meta["template_error"].is_valid()
        ledger.add(BadRecord(source=s, file=files[s], where=w, field="(chat template)", value=short_repr(e),
                             kind=TEMPLATE_ERROR, problem=f"{label} raised on this record")
                   for s, w, e in zip(*(meta.filter(template_failed)[k].to_pylist()
                                        for k in ("source", "where", "template_error"))))
        ledger.enforce("tokenise")
        ledger.finish()

        dropped = Counter({v["values"]: v["counts"]
                           for v in pc.value_counts(meta["drop_reason"].drop_null()).to_pylist()})
        kept_mask = pc.and_(meta["drop_reason"].is_null(), meta["template_error"].is_null())
        kept_rows = pc.indices_nonzero(kept_mask.combine_chunks())
        if len(kept_rows) == 0:
            _no_records_left(read_per_source, ledger.count, dropped, cc.max_length)
        keys = pa.table({"shuffle_key": meta["shuffle_key"].take(kept_rows), "id": meta["id"].take(kept_rows),
                         "row": kept_rows})
        order = keys.take(pc.sort_indices(keys, sort_keys=[("shuffle_key", "ascending"), ("id", "ascending")]))
        order_rows = order["row"].to_numpy()
        import numpy as np
        # a record's group: its eval_group_key value, else itself
        groups_col = meta["group"] if cc.eval_group_key else None
        eval_rows = _held_out_rows(meta["id"], kept_rows, cc, groups_col)
        # identical conversations land on one side only: a held-out one's copies leave training
        eval_rows, dup_rows, duplicates = _deduplicated_split(
            good.select_columns(["conversation"]).with_format("arrow"), kept_rows, eval_rows)
        if eval_rows or dup_rows:
            out_rows = np.asarray(eval_rows + dup_rows, dtype=order_rows.dtype)
            order_rows = order_rows[~np.isin(order_rows, out_rows)]

        split_groups = ({"eval": _group_counts(groups_col, eval_rows),
                         "train": _group_counts(groups_col, order_rows.tolist())}
                        if groups_col is not None else {"eval": len(eval_rows), "train": len(order_rows)})
        per_source: dict[str, dict] = {s.name: _source_stats(read_per_source[s.name]) for s in cc.sources}
        _count_per_source(per_source, meta, kept_mask, ledger)
        eval_sources = Counter(meta["source"].take(eval_rows).to_pylist()) if eval_rows else Counter()
        dup_sources = Counter(meta["source"].take(dup_rows).to_pylist()) if dup_rows else Counter()
        not_trained = eval_rows + dup_rows   # the training split's figures leave out both
        eval_masked = sum(meta["masked_tokens"].take(not_trained).to_pylist()) if not_trained else 0
        eval_calls = meta["tool_calls"].take(not_trained).to_pylist() if not_trained else []
        eval_tool_messages = sum(meta["tool_messages"].take(not_trained).to_pylist()) if not_trained else 0
        for name, ps in per_source.items():   # records = training records; the held-out ones apart
            ps["eval_records"] = eval_sources.get(name, 0)
            ps["duplicates_of_held_out"] = dup_sources.get(name, 0)
            ps["train_records"] = ps["records"] - ps["eval_records"] - ps["duplicates_of_held_out"]

        # Stream to Parquet in shuffled order, reading the rows by position (flat memory).
        schema = corpus_schema()
        lengths = array("i")  # 4 bytes a record: the only per-record state kept in memory
        order_digest = hashlib.sha256()
        index = 0
        rows = tokenised.select_columns(["id", "source", "input_ids", "loss_mask", "num_tokens"]).with_format("arrow")
        # the corpus appears whole or not at all (temp, fsync, rename); the writer closes first
        with atomic_replace(out_dir / CORPUS_FILE) as tmp_path, pq.ParquetWriter(str(tmp_path), schema) as writer:
            for start in range(0, len(order_rows), _WRITE_BATCH):
                batch = rows[order_rows[start:start + _WRITE_BATCH].tolist()]
                n = batch.num_rows
                table = pa.table({"index": pa.array(range(index, index + n), pa.int64()), "id": batch["id"],
                                  "source": batch["source"], "input_ids": batch["input_ids"],
                                  "loss_mask": batch["loss_mask"], "num_tokens": batch["num_tokens"]},
                                 schema=schema)
                writer.write_table(table)
                index += n
                order_digest.update("\n".join(batch["id"].to_pylist()).encode() + b"\n")
                lengths.extend(batch["num_tokens"].to_pylist())
        eval_tokens = _write_eval(out_dir / EVAL_FILE, tokenised, good, eval_rows, tokenizer, cc.max_length)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    elapsed = time.monotonic() - started
    total_tokens = sum(lengths)
    n_bad = ledger.count
    status: Counter[str] = Counter()
    for ps in per_source.values():
        status.update({"cut": ps["cut_at_message"], "truncated": ps["truncated"]})
    stats = {
        "records": index,
        "tokens": total_tokens,
        # per_source counts every kept record; the top-level figures are those of the training split
        "masked_tokens": sum(ps["masked_tokens"] for ps in per_source.values()) - eval_masked,
        "records_with_tool_calls": sum(ps["records_with_tool_calls"] for ps in per_source.values())
        - sum(1 for c in eval_calls if c > 0),
        "tool_messages": sum(ps["tool_messages"] for ps in per_source.values()) - eval_tool_messages,
        "per_source": per_source,
        "splits": {"train": {n: ps["train_records"] for n, ps in per_source.items()},
                   "eval": {n: ps["eval_records"] for n, ps in per_source.items()}},
        "eval_records": len(eval_rows),
        "duplicates": duplicates,
        "eval_tokens": eval_tokens,
        "eval_file": str(out_dir / EVAL_FILE),
        "eval_split": {"fraction": cc.eval_fraction, "min_records": cc.eval_min_records,
                       "max_records": cc.eval_max_records, "group_key": cc.eval_group_key,
                       "key": (f"sha256('eval\\0' + the record's {cc.eval_group_key})" if cc.eval_group_key
                               else "sha256('eval\\0' + source:row)"),
                       "groups": split_groups, "records": {"eval": len(eval_rows), "train": index}},
        "length": _percentiles(lengths),
        "over_max_length": cc.over_max_length,
        "cut_at_message_boundary": status["cut"],
        "truncated_to_max_length": status["truncated"],
        "dropped": {"bad_record": {k: ledger.by_kind.get(k, 0) for k in BAD_KINDS},
                    **{k: dropped.get(k, 0) for k in DROP_REASONS}},
        "bad_records_shown": [r.describe() for r in ledger.shown],
        "bad_records_file": str(out_dir / BAD_RECORDS_FILE) if n_bad else None,
        "mask_method": method,
        "chat_template": label,
        "seed": cc.seed,
        "max_length": cc.max_length,
        "tokenizer": model_path,
        "order_sha256": order_digest.hexdigest(),
        "corpus_file": str(out_dir / CORPUS_FILE),
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(total_tokens / elapsed, 1) if elapsed > 0 else None,
    }
    atomic_write(out_dir / STATS_FILE, json.dumps(stats, indent=2) + "\n")
    not_rendered = sum(ps["reasoning_not_rendered"] for ps in per_source.values())
    if not_rendered:
        log(f"corpus: {not_rendered} assistant reasoning text(s) not rendered by {label} (the template leaves "
            "them out, so the target never sees them either); counted per source as reasoning_not_rendered")
    log(f"corpus: {stats['records']} record(s), {total_tokens} tokens ({stats['masked_tokens']} masked for loss), "
        f"{stats['records_with_tool_calls']} with tool calls, "
        f"length p50 {stats['length']['p50']} p99 {stats['length']['p99']} max {stats['length']['max']}, "
        f"{status['cut']} cut at a message boundary, {status['truncated']} truncated, "
        f"dropped {sum(dropped.values())} ({', '.join(f'{k} {v}' for k, v in sorted(dropped.items())) or 'none'}), "
        f"{n_bad} bad; {elapsed:.1f} s -> {out_dir / CORPUS_FILE}")
    log(f"corpus: {len(eval_rows)} record(s) held out of training ("
        + ", ".join(f"{n} {ps['eval_records']}" for n, ps in per_source.items()) + f") -> {out_dir / EVAL_FILE}, "
        + (f"{split_groups['eval']} group(s) by {cc.eval_group_key} held out, {split_groups['train']} trained on; "
           if cc.eval_group_key else "split by record; ") +
        f"{duplicates['records_with_an_identical_earlier_one']} record(s) repeat an earlier conversation, "
        f"{duplicates['held_out_twins_dropped_from_training']} copies of held-out ones left out of training, "
        f"{duplicates['held_out_copies_dropped']} repeated held-out ones dropped")
    return stats


def _rewritten_names(cfg: PipelineConfig, regenerated: RegeneratedSources | None, log) -> list[str]:
    """The sources the generation phase rewrote; it must be complete (its stats are written by it)."""
    if regenerated is None:
        if cfg.generate.enabled:
            raise SourceError("generate.enabled is on but the corpus was prepared without the generation phase's "
                              "results: run `eagleflow corpus prepare` (task prepare_corpus), which reads them, "
                              "or pass prepare_corpus(regenerated=...)")
        return []
    return regenerated.names(log)


def _generated_source(regenerated: RegeneratedSources, name: str):
    import datasets
    features = datasets.Features({"__row": datasets.Value("int64"), "__where": datasets.Value("string"),
                                  "__raw": datasets.Value("string"), "__decode_error": datasets.Value("string")})
    rows = regenerated.rows(name)
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in features}, features=features)


def _write_eval(path: Path, tokenised, good, eval_rows: list[int], tokenizer, max_length: int) -> int:
    """eval.parquet: the held-out records as corpus.parquet has them, plus conversation and prompt ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tokenised.select_columns(["id", "source", "input_ids", "loss_mask", "num_tokens"]).with_format("arrow")
    convs = [good[int(r)]["conversation"] for r in eval_rows]   # tokenise's map keeps good's rows 1:1
    prompts = [eval_prompt_ids(tokenizer, Conversation.from_json(c), max_length) for c in convs]
    n = len(eval_rows)
    if n:
        batch = rows[eval_rows]
        cols = {k: batch[k] for k in ("id", "source", "input_ids", "loss_mask", "num_tokens")}
    else:
        empty = pa.array([], pa.string())
        cols = {"id": empty, "source": empty, "input_ids": pa.array([], pa.list_(pa.int32())),
                "loss_mask": pa.array([], pa.list_(pa.int8())), "num_tokens": pa.array([], pa.int32())}
    table = pa.table({"index": pa.array(range(n), pa.int64()), **cols,
                      "conversation": pa.array(convs, pa.string()),
                      "prompt_ids": pa.array(prompts, pa.list_(pa.int32()))}, schema=eval_schema())
    with atomic_replace(path) as tmp:
        pq.write_table(table, str(tmp))
    return sum(cols["num_tokens"].to_pylist())


def read_eval_records(corpus_dir: Path) -> list[dict]:
    """The held-out records (eval.parquet) as dicts; a message naming the fix when absent."""
    import pyarrow.parquet as pq
    path = Path(corpus_dir) / EVAL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no held-out split at {path}; rerun `eagleflow corpus prepare` for this run "
                                "(corpus.eval_fraction > 0 holds records out of training)")
    return pq.read_table(str(path)).to_pylist()


def _source_stats(read: int) -> dict:
    return {"read": read, "bad": 0, "bad_by_reason": {}, "dropped": 0, "dropped_by_reason": {}, "records": 0,
            "turns": 0, "records_with_tool_calls": 0, "tool_calls": 0, "tool_messages": 0, "tokens": 0,
            "masked_tokens": 0, "cut_at_message": 0, "truncated": 0, "reasoning_not_rendered": 0,
            "non_text_parts_dropped": 0}


def _count_per_source(per_source: dict[str, dict], meta, kept_mask, ledger: _BadRecordLedger) -> None:
    """Per-source statistics of the kept records, of the dropped ones by reason, of bad ones by kind."""
    for name, kinds in ledger.by_source.items():
        per_source[name]["bad"] = sum(kinds.values())
        per_source[name]["bad_by_reason"] = dict(sorted(kinds.items()))
    kept = meta.filter(kept_mask)
    cols = {k: kept[k].to_pylist() for k in ("source", "turns", "tool_calls", "tool_messages", "num_tokens",
                                             "masked_tokens", "length_status", "reasoning_not_rendered",
                                             "non_text_dropped")}
    for s, turns, calls, tools, ntok, masked, status, reasoning, non_text in zip(*cols.values()):
        ps = per_source[s]
        ps["records"] += 1
        ps["turns"] += turns
        ps["records_with_tool_calls"] += calls > 0
        ps["tool_calls"] += calls
        ps["tool_messages"] += tools
        ps["tokens"] += ntok
        ps["masked_tokens"] += masked
        ps["cut_at_message"] += status == "cut"
        ps["truncated"] += status == "truncated"
        ps["reasoning_not_rendered"] += reasoning
        ps["non_text_parts_dropped"] += non_text
    dropped = meta.filter(meta["drop_reason"].is_valid())
    for s, reason in zip(dropped["source"].to_pylist(), dropped["drop_reason"].to_pylist()):
        ps = per_source[s]
        ps["dropped"] += 1
        ps["dropped_by_reason"][reason] = ps["dropped_by_reason"].get(reason, 0) + 1


def read_stats(layout: RunLayout) -> dict:
    path = Path(str(layout.corpus_dir)) / STATS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no corpus statistics at {path}; run `eagleflow corpus prepare` for this run first")
    return json.loads(path.read_text())
