"""Merge the sources into one shuffled, tokenised corpus with its statistics.

Every stage is a ``datasets`` (Arrow) step written to a work folder beside the
output, so memory stays flat however large the corpus is: read -> normalise
(batched, multi-process map) -> check bad records -> tokenise with the target's
chat template (batched, multi-process map) -> drop records without assistant
tokens -> sort by a seeded hash of the sample id -> stream to Parquet.

Output (the shared contract): ``<run_dir>/corpus/corpus.parquet`` with columns
index, id, source, input_ids, loss_mask, num_tokens, and ``stats.json``.
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
from typing import Callable

from eagleflow.config import PipelineConfig
from eagleflow.durable import atomic_replace, atomic_write
from eagleflow.layout import RunLayout

from .normalise import BAD_KINDS, BadRecord, normalise_batch
from .sources import load_source
from .tokenize import load_tokenizer, mask_method_for, tokenize_batch

CORPUS_FILE = "corpus.parquet"
STATS_FILE = "stats.json"
BAD_RECORDS_FILE = "bad_records.jsonl"
SHOWN_BAD_RECORDS = 10
NORMALISE_ROWS_PER_PROCESS = 20_000  # below this a pool's start costs more than parsing the JSON
_WRITE_BATCH = 256


class BadRecordsError(ValueError):
    """More bad records than corpus.max_bad_records allows; the message lists the first ten."""


def corpus_schema():
    import pyarrow as pa
    return pa.schema([("index", pa.int64()), ("id", pa.string()), ("source", pa.string()),
                      ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("num_tokens", pa.int32())])


def _features():
    from datasets import Features, List, Value
    norm = Features({"id": Value("string"), "source": Value("string"),
                     "messages": List({"role": Value("string"), "content": Value("string")}),
                     "error": Value("string"), "shuffle_key": Value("int64")})
    tok = Features({"id": Value("string"), "source": Value("string"), "shuffle_key": Value("int64"),
                    "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
                    "num_tokens": Value("int32"), "masked_tokens": Value("int32"),
                    "truncated": Value("bool"), "drop_reason": Value("string")})
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
        f"{sum(dropped.values())} without assistant tokens; check the sources' paths and "
        f"contents, and corpus.max_length ({max_length})")


def prepare_corpus(cfg: PipelineConfig, layout: RunLayout, *, num_proc: int | None = None,
                   mask_method: str = "auto", log: Callable[[str], None] = print) -> dict:
    """Build corpus.parquet and stats.json under the run's corpus dir; return the stats."""
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
    for stale in (CORPUS_FILE, STATS_FILE, BAD_RECORDS_FILE):
        (out_dir / stale).unlink(missing_ok=True)  # a failed run must not leave an old claim behind
    for old_work in out_dir.glob(".work-*"):  # left by a killed run of this same run dir
        shutil.rmtree(old_work, ignore_errors=True)
    model_path = str(cfg.resolve(cfg.target_model))
    tokenizer = load_tokenizer(model_path)
    method = mask_method_for(tokenizer, mask_method)
    log(f"corpus: {len(cc.sources)} source(s), tokenizer {model_path}, loss mask by {method}, "
        f"max_length {cc.max_length}, seed {cc.seed}, {procs} process(es)")
    norm_features, tok_features = _features()
    work = tempfile.mkdtemp(dir=out_dir, prefix=".work-")
    try:
        normalised = []
        read_per_source: dict[str, int] = {}
        for src in cc.sources:
            path = cfg.resolve(src.path)
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
                           fn_kwargs={"source": src.name, "file": str(path), "seed": cc.seed},
                           cache_file_name=os.path.join(work, f"norm-{src.name}.arrow"),
                           load_from_cache_file=False, desc=f"normalise {src.name}")
            normalised.append(norm)
            log(f"corpus: source {src.name}: {len(raw)} record(s) read from {path}, "
                f"normalised in {nproc or 1} process(es) ({time.monotonic() - started:.1f} s so far)")
        merged = datasets.concatenate_datasets(normalised)

        # Bad records: counted by kind, all written to bad_records.jsonl, the first ten shown.
        errors = _column(merged, "error")
        bad_mask = errors.is_valid()
        bad_kinds: Counter = Counter()
        bad_per_source: Counter = Counter()
        shown: list[BadRecord] = []
        with open(out_dir / BAD_RECORDS_FILE, "w") as bad_file:
            for chunk in errors.filter(bad_mask).chunks:
                for text in chunk.to_pylist():
                    rec = BadRecord.from_json(text)
                    bad_kinds[rec.kind] += 1
                    bad_per_source[rec.source] += 1
                    if len(shown) < SHOWN_BAD_RECORDS:
                        shown.append(rec)
                    bad_file.write(text + "\n")
        n_bad = sum(bad_kinds.values())
        if n_bad > cc.max_bad_records:
            lines = [f"corpus: {n_bad} bad record(s), more than corpus.max_bad_records={cc.max_bad_records}. "
                     f"First {len(shown)}:"]
            lines += [f"  - {r.describe()}" for r in shown]
            lines.append(f"All of them are in {out_dir / BAD_RECORDS_FILE}. Fix those records, or set "
                         f"corpus.max_bad_records to at least {n_bad} to skip them (counted in stats.json).")
            raise BadRecordsError("\n".join(lines))
        if n_bad:
            log(f"corpus: skipping {n_bad} bad record(s) (max_bad_records {cc.max_bad_records}): "
                + ", ".join(f"{k} {v}" for k, v in sorted(bad_kinds.items())))
            for r in shown:
                log(f"corpus: skipped {r.describe()}")
        else:
            (out_dir / BAD_RECORDS_FILE).unlink()
        good = merged.filter(lambda e: [x is None for x in e], input_columns="error", batched=True,
                             batch_size=1000).remove_columns(["error"])

        if len(good) == 0:
            _no_records_left(read_per_source, n_bad, Counter(), cc.max_length)
        tok_batch, tok_procs = _split(procs, len(good), 64)
        tokenised = good.map(tokenize_batch, batched=True, batch_size=tok_batch,
                             num_proc=tok_procs, remove_columns=good.column_names,
                             features=tok_features,
                             fn_kwargs={"model_path": model_path, "max_length": cc.max_length, "method": method},
                             cache_file_name=os.path.join(work, "tokenised.arrow"), load_from_cache_file=False,
                             desc="tokenise")
        log(f"corpus: {len(good)} record(s) tokenised in {tok_procs or 1} process(es), batches of {tok_batch} "
            f"({time.monotonic() - started:.1f} s so far)")
        reasons = _column(tokenised, "drop_reason")
        dropped = Counter({v["values"]: v["counts"] for v in pc.value_counts(reasons.drop_null()).to_pylist()})
        kept = tokenised.filter(lambda r: [x is None for x in r], input_columns="drop_reason", batched=True,
                                batch_size=1000)
        if len(kept) == 0:
            _no_records_left(read_per_source, n_bad, dropped, cc.max_length)
        keys = kept.select_columns(["shuffle_key", "id"]).with_format("arrow")[:]
        order = pc.sort_indices(keys, sort_keys=[("shuffle_key", "ascending"), ("id", "ascending")])
        ordered = kept.select(order.to_numpy(), indices_cache_file_name=os.path.join(work, "order.arrow"))

        # Stream to Parquet in shuffled order; gather the statistics on the way.
        schema = corpus_schema()
        lengths = array("i")  # 4 bytes a record: the only per-record state kept in memory
        per_source: dict[str, dict] = {s.name: {"read": read_per_source[s.name], "bad": bad_per_source[s.name],
                                               "records": 0, "tokens": 0, "masked_tokens": 0}
                                       for s in cc.sources}
        truncated = 0
        order_digest = hashlib.sha256()
        index = 0
        cols = ["id", "source", "input_ids", "loss_mask", "num_tokens", "masked_tokens", "truncated"]
        # the corpus appears whole or not at all (temp, fsync, rename); the writer closes first
        with atomic_replace(out_dir / CORPUS_FILE) as tmp_path, pq.ParquetWriter(str(tmp_path), schema) as writer:
            for batch in ordered.select_columns(cols).with_format("arrow").iter(batch_size=_WRITE_BATCH):
                n = batch.num_rows
                table = pa.table({"index": pa.array(range(index, index + n), pa.int64()), "id": batch["id"],
                                  "source": batch["source"], "input_ids": batch["input_ids"],
                                  "loss_mask": batch["loss_mask"], "num_tokens": batch["num_tokens"]},
                                 schema=schema)
                writer.write_table(table)
                index += n
                ids = batch["id"].to_pylist()
                order_digest.update("\n".join(ids).encode() + b"\n")
                ntok = batch["num_tokens"].to_pylist()
                lengths.extend(ntok)
                for s, t, m in zip(batch["source"].to_pylist(), ntok, batch["masked_tokens"].to_pylist()):
                    ps = per_source[s]
                    ps["records"] += 1
                    ps["tokens"] += t
                    ps["masked_tokens"] += m
                truncated += sum(batch["truncated"].to_pylist())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for name, ps in per_source.items():
        ps["dropped"] = ps["read"] - ps["bad"] - ps["records"]
    elapsed = time.monotonic() - started
    total_tokens = sum(lengths)
    stats = {
        "records": index,
        "tokens": total_tokens,
        "masked_tokens": sum(ps["masked_tokens"] for ps in per_source.values()),
        "per_source": per_source,
        "length": _percentiles(lengths),
        "truncated_to_max_length": truncated,
        "dropped": {"bad_record": {k: bad_kinds.get(k, 0) for k in BAD_KINDS}, **{
            "no_assistant_tokens": dropped.get("no_assistant_tokens", 0),
            "no_assistant_tokens_after_truncation": dropped.get("no_assistant_tokens_after_truncation", 0)}},
        "bad_records_shown": [r.describe() for r in shown],
        "bad_records_file": str(out_dir / BAD_RECORDS_FILE) if n_bad else None,
        "mask_method": method,
        "seed": cc.seed,
        "max_length": cc.max_length,
        "tokenizer": model_path,
        "order_sha256": order_digest.hexdigest(),
        "corpus_file": str(out_dir / CORPUS_FILE),
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(total_tokens / elapsed, 1) if elapsed > 0 else None,
    }
    atomic_write(out_dir / STATS_FILE, json.dumps(stats, indent=2) + "\n")
    log(f"corpus: {stats['records']} record(s), {total_tokens} tokens ({stats['masked_tokens']} masked for loss), "
        f"length p50 {stats['length']['p50']} p99 {stats['length']['p99']} max {stats['length']['max']}, "
        f"dropped {sum(dropped.values())} without assistant tokens, {n_bad} bad; "
        f"{elapsed:.1f} s -> {out_dir / CORPUS_FILE}")
    return stats


def read_stats(layout: RunLayout) -> dict:
    path = Path(str(layout.corpus_dir)) / STATS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no corpus statistics at {path}; run `eagleflow corpus prepare` for this run first")
    return json.loads(path.read_text())
