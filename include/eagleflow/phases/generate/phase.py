"""The generation phase as a whole: which sources, each shard's settings, the stats, the corpus phase's input.

``generated/stats.json`` per source: records read, regenerated whole, cut at a
diverging call (and at which assistant turn), cut at the context, kept or
dropped after hitting max_new_tokens, failed generations by reason, bad records
by kind, assistant turns regenerated, tokens generated and tokens/s (the phase's
wall time, its longest shard's, apportioned to each source by its share of the
records' request time; the phase's own tokens/s beside it).
Bad records are listed whole in ``generated/bad_records.jsonl`` (source, file,
line, field, reason), never silently dropped.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from eagleflow import bounded_json
from eagleflow.config import ConfigError, PipelineConfig
from eagleflow.durable import atomic_write
from eagleflow.fleet.assign import run_assignment
from eagleflow.fleet.takeover import taken_over_in
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout

from . import KIND
from .regenerate import (BAD, CUT_AT_CONTEXT, CUT_AT_DIVERGING_CALL, CUT_AT_TRUNCATED, DROPPED_TRUNCATED, FAILED,
                         REGENERATED, RecordResult, Sampling)
from .worker import GenerateSettings, SourceInput, read_inputs, read_results

STATS_FILE = "stats.json"
BAD_RECORDS_FILE = "bad_records.jsonl"


class GenerationIncomplete(RuntimeError):
    """A shard has not finished every record; the message names the shards and counts."""


def regenerated_sources(cfg: PipelineConfig) -> list[str]:
    """The corpus sources the target rewrites (generate.sources, all when null); [] when the phase is off."""
    if not cfg.generate.enabled:
        return []
    names = [s.name for s in cfg.corpus.sources]
    chosen = names if cfg.generate.sources is None else list(cfg.generate.sources)
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise ConfigError(f"generate.sources names {unknown}, which are not in corpus.sources ({names}); "
                          "list corpus source names, or null for all")
    return chosen


def shard_settings(cfg: PipelineConfig, layout: RunLayout, shard: int, server_url: str) -> GenerateSettings:
    g = cfg.generate
    chosen = set(regenerated_sources(cfg) or [s.name for s in cfg.corpus.sources])
    sources = tuple(SourceInput(s.name, str(cfg.resolve(s.path)), s.format, s.limit)
                    for s in cfg.corpus.sources if s.name in chosen)
    return GenerateSettings(
        run_id=layout.run_id, shard=shard, num_shards=g.shards, shard_dir=str(layout.generate_shard_dir(shard)),
        server_url=server_url, model_path=str(cfg.resolve(cfg.target_model)), sources=sources,
        sampling=Sampling(temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens, seed=g.seed,
                          reasoning=g.reasoning),
        max_length=cfg.corpus.max_length, concurrency=g.concurrency, keep_truncated=g.keep_truncated,
        max_bad_records=g.max_bad_records, tool_call_format=g.tool_call_format,
        request_timeout_base_s=g.request_timeout_base_s, request_timeout_per_token_s=g.request_timeout_per_token_s,
        heartbeat_interval_s=cfg.capture.heartbeat_interval_s, non_text_parts=cfg.corpus.non_text_parts,
        seed=cfg.corpus.seed)


def phase_finished(layout: RunLayout) -> bool:
    """The phase's finished marker: ``generated/stats.json`` written by ``collect`` with every shard complete."""
    try:
        return bool(bounded_json.read(Path(str(layout.generated_dir)) / STATS_FILE).get("complete"))
    except (OSError, ValueError, AttributeError):
        return False


def shard_record_count(cfg: PipelineConfig, layout: RunLayout, shard: int) -> int:
    """How many records shard ``shard`` regenerates: its worker's own count (heartbeat total) once it got that
    far, else counted from the sources exactly as the worker reads them (slower: it loads the sources)."""
    hb = Heartbeat.read(str(KIND.heartbeat_file(layout, shard)))
    if hb is not None and hb.total:
        return hb.total
    work = tempfile.mkdtemp(prefix="eagleflow-generate-count-")
    try:
        s = shard_settings(cfg, layout, shard, server_url="")
        return len(read_inputs(s.sources, shard, s.num_shards, work, seed=s.seed, non_text=s.non_text_parts))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _source_stats() -> dict:
    return {"records": 0, "kept": 0, "regenerated": 0, "cut_at_diverging_call": 0, "cut_at_diverging_call_turns": {},
            "cut_at_context": 0, "cut_at_truncated": 0, "dropped_truncated": 0, "truncated_turns": 0,
            "context_cut_turns": 0,
            "failed": {}, "bad": {}, "turns_regenerated": 0, "tokens_generated": 0, "generation_s": 0.0,
            "tokens_per_s": None}


def collect(cfg: PipelineConfig, layout: RunLayout, *, require_complete: bool = True) -> dict:
    """Read every shard's results, write stats.json and bad_records.jsonl; refuse an incomplete phase."""
    n = cfg.generate.shards
    per: dict[str, dict] = {name: _source_stats() for name in regenerated_sources(cfg)}
    bad: list[dict] = []
    incomplete = []
    owners = {}
    if cfg.is_fleet:   # which node generates it: the one to bring back (the training node for one it took over)
        owners = {s: f" (node {node})" for node, shards in run_assignment(cfg, KIND.phase).items() for s in shards}
        owners.update({s: f" (node {cfg.node.name}, taken over from {src})"
                       for s, src in taken_over_in(layout.run_dir, KIND.phase).items()})
    wall_s = 0.0
    for shard in range(n):
        results = read_results(layout.generate_shard_dir(shard), shard, n)
        hb = Heartbeat.read(str(KIND.heartbeat_file(layout, shard)))
        if hb is not None and hb.started_at:
            # shards run side by side: the longest one, over all its runs (a resume adds its earlier ones)
            wall_s = max(wall_s, float(hb.extra.get("wall_s_before", 0.0)) + hb.time - hb.started_at)
        if hb is None or hb.state != "complete" or len(results) < hb.total:
            incomplete.append(f"shard {shard}{owners.get(shard, '')}: {len(results)}/{hb.total if hb else '?'} "
                              f"records, state {hb.state if hb else 'never started'}")
        for r in results:
            ps = per.setdefault(r.source, _source_stats())
            _count(ps, r)
            if r.status == BAD and r.bad is not None:   # a bad result always carries its reason
                bad.append(r.bad)
    if incomplete and require_complete:
        where = ("run the unfinished shards on their node (clear that node's generate_responses and "
                 "collect_generated once it is back)" if cfg.is_fleet else
                 "run the unfinished shards (`eagleflow generate run --shard I`)")
        raise GenerationIncomplete("generation is not complete: " + "; ".join(incomplete)
                                   + f". To go on, {where}: each resumes from its manifest")
    # generation_s sums each record's time, overlapping under concurrency; tokens/s divides by the phase's wall
    # time (its longest shard's runs, all of them) apportioned to each source by its share of that record time
    busy = sum(ps["generation_s"] for ps in per.values())
    for ps in per.values():
        share = wall_s * ps["generation_s"] / busy if busy else 0.0
        ps["generation_s"] = round(ps["generation_s"], 3)
        ps["tokens_per_s"] = round(ps["tokens_generated"] / share, 1) if share else None
    out = Path(str(layout.generated_dir))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / BAD_RECORDS_FILE, "".join(json.dumps(b, sort_keys=True) + "\n" for b in bad))
    stats = {"sources": list(per), "per_source": per, "records": sum(p["records"] for p in per.values()),
             "kept": sum(p["kept"] for p in per.values()), "bad_records": len(bad),
             "bad_records_file": str(out / BAD_RECORDS_FILE) if bad else None,
             "max_bad_records": cfg.generate.max_bad_records, "complete": not incomplete,
             "wall_s": round(wall_s, 3),
             "tokens_per_s": round(sum(p["tokens_generated"] for p in per.values()) / wall_s, 1) if wall_s else None,
             "sampling": cfg.generate.model_dump(include={"temperature", "top_p", "max_new_tokens", "seed",
                                                            "reasoning", "keep_truncated"})}
    atomic_write(out / STATS_FILE, json.dumps(stats, indent=2) + "\n")
    return stats


def _count(ps: dict, r: RecordResult) -> None:
    ps["records"] += 1
    ps["turns_regenerated"] += r.turns_regenerated
    ps["tokens_generated"] += r.tokens_generated
    ps["generation_s"] += r.generation_s
    ps["truncated_turns"] += r.truncated_turns
    ps["context_cut_turns"] += r.context_cut_turns
    if r.kept:
        ps["kept"] += 1
    if r.status == REGENERATED:
        ps["regenerated"] += 1
    elif r.status == CUT_AT_DIVERGING_CALL:
        ps["cut_at_diverging_call"] += 1
        turns = ps["cut_at_diverging_call_turns"]
        turns[str(r.cut_turn)] = turns.get(str(r.cut_turn), 0) + 1
    elif r.status == CUT_AT_CONTEXT:
        ps["cut_at_context"] += 1
    elif r.status == CUT_AT_TRUNCATED:
        ps["cut_at_truncated"] += 1
    elif r.status == DROPPED_TRUNCATED:
        ps["dropped_truncated"] += 1
    elif r.status == FAILED:
        ps["failed"][r.failure or "unknown"] = ps["failed"].get(r.failure or "unknown", 0) + 1
    elif r.status == BAD:
        kind = (r.bad or {}).get("kind", "unknown")
        ps["bad"][kind] = ps["bad"].get(kind, 0) + 1
    if r.failure and r.status != FAILED:
        ps["failed"][r.failure] = ps["failed"].get(r.failure, 0) + 1


def generated_source_rows(cfg: PipelineConfig, layout: RunLayout, source: str) -> list[dict]:
    """The corpus phase's rows for a regenerated source: kept records by original row, as load_source rows
    (``__row`` the original row, so the record keeps its corpus id and shuffle key)."""
    rows: list[dict[str, Any]] = []
    where: dict[str, list[int]] = {}   # id -> the shards that hold it: one record is generated once
    for shard in range(cfg.generate.shards):
        for r in read_results(layout.generate_shard_dir(shard), shard, cfg.generate.shards):
            if r.source == source:
                where.setdefault(r.id, []).append(shard)
            if r.source == source and r.kept:
                rows.append({"__row": int(r.id.rsplit(":", 1)[1]), "__where": r.where,
                             "__raw": json.dumps(r.corpus_record(), ensure_ascii=False), "__decode_error": None})
    dups = [f"{i} (shards {', '.join(map(str, w))})" for i, w in where.items() if len(w) > 1]
    if dups:
        raise GenerationIncomplete(f"generated records of source {source} appear more than once: {', '.join(dups[:10])}"
                                   f"{' ...' if len(dups) > 10 else ''}; the shard dirs under {layout.generated_dir} "
                                   "mix results of different runs or shard counts. Delete them and run the "
                                   "generation phase again")
    rows.sort(key=lambda d: d["__row"])
    return rows


def shard_expectation(run, shard: int) -> tuple[int, bool]:
    """(records shard ``shard`` regenerates, its worker marked it finished): what reconcile compares its
    stored records with; the phase's stats (``collect``) accept a shard only once its heartbeat says complete."""
    hb = Heartbeat.read(str(KIND.heartbeat_file(run.layout, shard)))
    return shard_record_count(run.cfg, run.layout, shard), hb is not None and hb.state == "complete"


def can_be_judged(run) -> bool:
    """Reconcile judges the generation shards of a run whose phase started and has not finished (a finished
    phase, its stats complete, is never rerun)."""
    return run.cfg.generate.enabled and Path(str(run.layout.generated_dir)).is_dir() and not phase_finished(run.layout)

