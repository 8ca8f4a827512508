"""The evaluate_draft phase: held-out speculative decoding per configuration, the promotion gate, eval.json.

For each configuration of ``eval.configs`` the exported draft (and a baseline
draft on the same prompts: by default the draft in service, the one
``<run_root>/promoted.json`` names; ``eval.baseline_draft`` names another or
``none``) decodes every held-out prompt greedily with the target verifying; the
target alone decodes them too (the reference for the lossless check, and,
timed in pairs with each configuration, the speed baseline). The gate: each
configuration's acceptance length >= its minimum, not below the baseline's by
more than ``eval.tolerance``, and every output equal to the target's alone (a
numerical tie excepted: the emitted token's own logit within a few ulps of the
top one, :mod:`.lossless`). A passing draft becomes ``<run_root>/promoted.json``,
or, when ``eval.approval`` asks a person first, once the person approves (:mod:`.approval`); the export stays
either way.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from eagleflow import bounded_json
from eagleflow.config import PipelineConfig
from eagleflow.durable import atomic_write
from eagleflow.engines import EngineError, eval_engine
from eagleflow.layout import RunLayout
from eagleflow.train.export_formats import format_dir
from eagleflow.corpus.prepare import read_eval_records
from eagleflow.corpus.tokenize import load_tokenizer

from .approval import (APPROVED, DECISIONS, MAX_BY, MAX_WHY, NOT_NEEDED, PENDING, REJECTED, ApprovalError, clean_text,
                       needs_approval, pending)
from .prompt_sets import read_prompt_set

EVAL_FILE = "eval.json"
PROMOTED_FILE = "promoted.json"
HELD_OUT = "held_out"


class EvalBackendError(RuntimeError):
    """The configured evaluation backend cannot run here or failed; the message says what to do."""


def prompts_from_corpus(layout: RunLayout, max_prompts: int) -> list[dict]:
    rows = [r for r in read_eval_records(Path(str(layout.corpus_dir))) if r["prompt_ids"]]
    if not rows:
        raise ValueError(f"{layout.corpus_dir}/eval.parquet holds no record with a prompt before an assistant "
                         "turn; raise corpus.eval_fraction / corpus.eval_min_records and rerun `corpus prepare`")
    return [{"id": r["id"], "prompt_ids": list(r["prompt_ids"])} for r in rows[:max_prompts]]


def gate(results: list[dict], cfg: PipelineConfig, baseline: bool) -> list[str]:
    """Why the new draft is refused (empty = it passes), each reason with both numbers."""
    ec = cfg.eval
    why = []
    for r in results:
        new = r["draft"]
        need = r["min_accept_length"]
        where = f"configuration {r['config']} on {r['prompt_set']} ({r['prompts']} prompts)"
        deciding = decides(cfg, r["prompt_set"])   # a set outside eval.gate_sets is held to losslessness only
        if deciding and new["accept_length"] < need:
            why.append(f"{where}: acceptance length {new['accept_length']:.3f} is below eval.min_accept_length "
                       f"{need:.3f}")
        if deciding and baseline and new["accept_length"] < r["baseline"]["accept_length"] - ec.tolerance:
            why.append(f"{where}: acceptance length {new['accept_length']:.3f} is worse than the baseline draft's "
                       f"{r['baseline']['accept_length']:.3f} by more than eval.tolerance {ec.tolerance}")
        if not new["lossless"]:
            m = next(m for m in new["mismatches"] if not m["near_tie"])
            why.append(f"{where}: output with the draft differs from the target alone at prompt {m['prompt']} "
                       f"position {m['position']} (emitted token {m['with_draft']} ranked {m['emitted_rank']} in "
                       f"the target's distribution, {m['emitted_logit_gap']} below its top, tie tolerance "
                       f"{m['tie_tolerance']}): the speculative decoder is not lossless")
    return why


def decides(cfg: PipelineConfig, prompt_set: str) -> bool:
    """Whether a prompt set's acceptance decides the gate (eval.gate_sets; null = every set)."""
    return cfg.eval.gate_sets is None or prompt_set in cfg.eval.gate_sets


def load_prompt_sets(cfg: PipelineConfig, layout: RunLayout, tokenizer_path: str) -> dict[str, list[dict]]:
    """The corpus's held-out split first, then each eval.prompt_sets set in its own format (:mod:`.prompt_sets`):
    {name: [{id, prompt_ids}]}; an MT-Bench record gives its first turn here, the later ones once the target has
    answered it (:func:`.prompt_sets.expand_turns`, in each engine's reference pass)."""
    ec = cfg.eval
    sets = {HELD_OUT: prompts_from_corpus(layout, ec.max_prompts)}
    if ec.prompt_sets:

        tokenizer = load_tokenizer(tokenizer_path)
        for i, ps in enumerate(ec.prompt_sets):
            sets[ps.name] = read_prompt_set(cfg.resolve(ps.path), tokenizer, ps.max_prompts or ec.max_prompts,
                                            f"eval.prompt_sets[{i}] ({ps.name})", ps.format, ps.split)
    return sets


def evaluated_format_dir(cfg: PipelineConfig, export_dir: Path) -> Path:
    """Where, in an export folder, the files the evaluation's engine loads lie: the format it reads (its
    ``eval_format``, else the one it serves; vLLM: speculators/; our own decoder, hf: the SGLang format's files
    at the export's top)."""
    engine = eval_engine(cfg)
    return format_dir(export_dir, str(engine.eval_format or engine.draft_format))


def evaluate_run(cfg: PipelineConfig, layout: RunLayout, *, draft_dir: str | Path | None = None,
                 log: Callable[[str], None] = print, verify=None, node=None, sglang_command=None) -> dict:
    """Evaluate the run's exported draft, write eval.json (and promoted.json when it passes); the summary."""
    ec = cfg.eval
    engine = eval_engine(cfg)
    hooks = {k: v for k, v in {"verify": verify, "node": node, "command": sglang_command}.items() if v is not None}
    foreign = sorted(set(hooks) - engine.eval_hooks)
    if foreign:   # e.g. a replaced verify step: only our own decoder has one; SGLang verifies inside itself
        raise EvalBackendError(f"{', '.join(foreign)}: a test hook eval.backend {ec.backend} does not take "
                               f"(it takes {', '.join(sorted(engine.eval_hooks)) or 'none'})")
    started = time.monotonic()
    draft_dir = Path(draft_dir) if draft_dir else Path(str(layout.draft_dir)) / "export"
    served = evaluated_format_dir(cfg, draft_dir)
    if not (served / "config.json").is_file():
        raise FileNotFoundError(f"draft {draft_dir} has no {served.relative_to(draft_dir) / 'config.json'} (the "
                                f"export format eval.backend {ec.backend} reads); run export_draft first with it in "
                                "train.export_formats, or pass --draft")
    target_dir = str(cfg.resolve(cfg.target_model))
    prompt_sets = load_prompt_sets(cfg, layout, target_dir)
    drafts = {"draft": draft_dir}
    baseline, baseline_source = baseline_draft(cfg)
    if baseline is not None:
        drafts["baseline"] = baseline
    log(f"evaluate ({ec.backend}): " + ", ".join(
        f"{len(p)} prompt(s) of {n}" + (" (and their later turns, after the target's own answers)"
                                        if any(x.get("next_turns") for x in p) else "")
        for n, p in prompt_sets.items())
        + f", up to {ec.max_new_tokens} new tokens each, target {target_dir}, draft {draft_dir}"
        + (f", baseline {drafts['baseline']} ({baseline_source})" if "baseline" in drafts else
           f", no baseline ({baseline_source})"))
    try:
        results, about = engine.evaluate(cfg, layout, target_dir=target_dir, drafts=drafts, prompt_sets=prompt_sets,
                                         log=log, **hooks)
    except EngineError as e:
        raise EvalBackendError(f"eval.backend {ec.backend}: {e}") from None
    for row in results:
        row["decides_gate"] = decides(cfg, row["prompt_set"])
        d = row["draft"]
        log(f"evaluate: {row['config']} on {row['prompt_set']}: acceptance length {d['accept_length']:.3f} (per "
            f"position {', '.join(f'{x:.2f}' for x in d['accepted_at_position'])}), {d['tokens_per_s']:.1f} tok/s "
            f"vs {d['target_tokens_per_s']:.1f} alone (x{d['speedup']}), lossless {'yes' if d['lossless'] else 'NO'}"
            + (f"; baseline {row['baseline']['accept_length']:.3f}" if "baseline" in row else ""))
        if d.get("speedup_note"):
            log(f"evaluate: {row['config']} on {row['prompt_set']}: {d['speedup_note']}")
    refused = gate(results, cfg, "baseline" in drafts)
    summary = {"run_id": layout.run_id, "backend": ec.backend, "draft": str(draft_dir),
               "baseline_draft": str(drafts["baseline"]) if "baseline" in drafts else None,
               "baseline_source": baseline_source,
               "target": target_dir, **about, "max_new_tokens": ec.max_new_tokens, "tolerance": ec.tolerance,
               "prompt_sets": {n: len(p) for n, p in prompt_sets.items()} | {r["prompt_set"]: r["prompts"]
                                                                             for r in results},
               "gate_sets": ec.gate_sets,
               "results": results, "passed": not refused, "refused": refused,
               "elapsed_s": round(time.monotonic() - started, 2)}
    out = Path(str(layout.run_dir)) / EVAL_FILE
    summary["eval_file"] = str(out)
    ask = needs_approval(cfg, not refused, baseline_source)
    summary["approval"] = pending(cfg) if ask else {"mode": ec.approval, "state": NOT_NEEDED}
    if not refused and not ask:
        summary["promoted"] = promote(cfg, layout, summary)
    atomic_write(out, json.dumps(summary, indent=2) + "\n")
    for line in table_lines(summary):
        log(line)
    log("evaluate: REFUSED: " + "; ".join(refused) if refused else
        f"evaluate: PASSED, waiting for a person's approval (eval.approval {ec.approval}); not promoted yet"
        if ask else "evaluate: PASSED, promoted " + str(draft_dir))
    return summary


NO_BASELINE = "none"


def baseline_draft(cfg: PipelineConfig) -> tuple[Path | None, str]:
    """(the draft the new one is compared with, where that came from): eval.baseline_draft when it names one,
    none when it says 'none', else the draft in service (promoted.json), else none (nothing promoted yet)."""
    ec = cfg.eval
    if ec.baseline_draft == NO_BASELINE:
        return None, "eval.baseline_draft: none"
    if ec.baseline_draft:
        return cfg.resolve(ec.baseline_draft), "eval.baseline_draft"
    served = draft_in_service(cfg)
    if served is None:
        return None, f"no {PROMOTED_FILE} in run_root: nothing promoted yet"
    return served, f"the draft in service, {Path(str(cfg.resolve(cfg.run_root))) / PROMOTED_FILE}"


def draft_in_service(cfg: PipelineConfig) -> Path | None:
    """The export directory ``<run_root>/promoted.json`` names, read as untrusted input; None when absent.

    A file that cannot be read, or a draft that is gone or lives outside run_root (and
    eval.promoted_draft_roots), is an error: skipping the comparison would let a worse draft through."""
    run_root = Path(str(cfg.resolve(cfg.run_root)))
    path = run_root / PROMOTED_FILE
    if not path.exists():
        return None
    fix = ("fix or remove it, set eval.baseline_draft to the draft in service, or set eval.baseline_draft: none "
           "to promote without a comparison")
    try:   # bounded (size, depth): a file nested 100,000 deep is refused, not a RecursionError
        data = bounded_json.read(path)
    except (OSError, ValueError) as e:   # UnicodeDecodeError, JSONDecodeError, bounded_json.JsonRefused
        raise ValueError(f"{path} (the draft in service) cannot be read ({e}); {fix}") from None
    draft = data.get("draft") if isinstance(data, dict) else None
    if not isinstance(draft, str) or not draft or "\x00" in draft or not Path(draft).is_absolute():
        raise ValueError(f"{path}: field draft {draft!r} is not an absolute path to an export directory; {fix}")
    if not isinstance(data.get("run_id"), str) or not isinstance(data.get("accept_length"), dict):
        raise ValueError(f"{path}: fields run_id / accept_length missing or of the wrong type (not written by "
                         f"`eagleflow evaluate`?); {fix}")
    real = Path(draft).resolve()
    roots = [run_root.resolve()] + [Path(str(cfg.resolve(r))).resolve() for r in cfg.eval.promoted_draft_roots]
    if not any(real.is_relative_to(r) for r in roots):
        raise ValueError(f"{path}: field draft {draft} is outside run_root {run_root}"
                         + (f" and eval.promoted_draft_roots {cfg.eval.promoted_draft_roots}"
                            if cfg.eval.promoted_draft_roots else "")
                         + f"; add its folder to eval.promoted_draft_roots if it is really the draft in service, "
                           f"or {fix}")
    for name in ("config.json", "model.safetensors"):
        if not (evaluated_format_dir(cfg, real) / name).is_file():
            raise ValueError(f"{path}: the draft in service {draft} has no {name} (moved or deleted?); restore it, "
                             f"or {fix}")
    return real


def promote(cfg: PipelineConfig, layout: RunLayout, summary: dict) -> str:
    """``<run_root>/promoted.json`` names this draft with its figures (replaced atomically)."""
    path = Path(str(cfg.resolve(cfg.run_root))) / PROMOTED_FILE
    atomic_write(path, json.dumps({
        "draft": summary["draft"], "run_id": layout.run_id, "eval_file": summary["eval_file"],
        "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "accept_length": accept_lengths(summary["results"]), "table": acceptance_table(summary["results"])},
        indent=2) + "\n")
    return str(path)


def read_eval(layout: RunLayout) -> tuple[Path, dict]:
    """(eval.json's path, what it says), read back as untrusted input (bounded)."""
    path = Path(str(layout.run_dir)) / EVAL_FILE
    try:
        data = bounded_json.read(path)
    except (OSError, ValueError) as e:
        raise ApprovalError(f"{path} cannot be read ({e}): run evaluate_draft first") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ApprovalError(f"{path} is not an evaluation eagleflow wrote")
    return path, data


def decide(cfg: PipelineConfig, layout: RunLayout, decision: str, *, by: str | None = None,
           why: str | None = None) -> dict:
    """Record a person's answer (or the timeout) in eval.json; promote the draft when approved. The summary.

    Taking the same decision again (a retried task) answers what was recorded; a different one is refused."""
    if decision not in DECISIONS:
        raise ApprovalError(f"decision {decision!r}: one of {', '.join(DECISIONS)}")
    path, summary = read_eval(layout)
    approval = summary.get("approval") or {}
    if approval.get("state") in (APPROVED, REJECTED):
        if approval.get("decision") == decision:
            return summary
        raise ApprovalError(f"{path}: already {approval['state']} ({approval.get('decision')}) by "
                            f"{approval.get('by') or 'nobody'}; not changed to {decision}")
    if approval.get("state") != PENDING or not summary.get("passed"):
        raise ApprovalError(f"{path}: no approval is pending for this draft (state "
                            f"{approval.get('state') or 'none'}, gate {'passed' if summary.get('passed') else 'refused'})")
    promote_it = decision == "approve" or (decision == "timeout" and cfg.eval.approval_on_timeout == "promote")
    record = {**approval, "decision": decision, "by": clean_text(by, MAX_BY), "why": clean_text(why, MAX_WHY),
              "decided_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "state": APPROVED if promote_it else REJECTED}
    if decision == "timeout":
        record["why"] = record["why"] or (f"no answer within eval.approval_timeout_h {cfg.eval.approval_timeout_h} h; "
                                          f"eval.approval_on_timeout {cfg.eval.approval_on_timeout}")
    if promote_it and not cfg.eval.baseline_draft:
        # compared with the draft in service (or with none, nothing promoted): it must still be the one in
        # service, else the figures the person saw were against another draft
        now, compared = draft_in_service(cfg), summary.get("baseline_draft")
        if (str(now) if now is not None else None) != compared:
            record["state"] = REJECTED
            record["stale"] = (f"the draft in service changed while the approval waited (compared with "
                               f"{compared or 'none'}, now {now or 'none'}): not promoted; evaluate again")
    summary["approval"] = record
    if record["state"] == APPROVED:
        summary["promoted"] = promote(cfg, layout, summary)
    atomic_write(path, json.dumps(summary, indent=2) + "\n")
    return summary


def accept_lengths(results: list[dict]) -> dict[str, float]:
    """{configuration: acceptance length} on the gate's headline set: the corpus's held-out split, or the first
    set of eval.gate_sets when that leaves the split out."""
    deciding = [r["prompt_set"] for r in results if r.get("decides_gate", True)]
    head = HELD_OUT if HELD_OUT in deciding or not deciding else deciding[0]
    return {r["config"]: r["draft"]["accept_length"] for r in results if r["prompt_set"] == head}


def acceptance_table(results: list[dict]) -> list[dict]:
    """One line per configuration x prompt set: what a deployment reads from promoted.json or the Asset event."""
    return [{"config": r["config"], "prompt_set": r["prompt_set"], "prompts": r["prompts"],
             "decides_gate": r.get("decides_gate", True),
             "accept_length": r["draft"]["accept_length"], "speedup": r["draft"]["speedup"],
             "speedup_spread": r["draft"].get("speedup_spread"), "speedup_note": r["draft"].get("speedup_note"),
             "baseline_accept_length": r["baseline"]["accept_length"] if r.get("baseline") else None}
            for r in results]


def table_lines(summary: dict) -> list[str]:
    """The figures as a text table: configuration x prompt set."""
    head = (f"{'config':<8} {'prompts':<14} {'accept len':>10} {'accepted at position':<36} {'tok/s':>8} "
            f"{'alone':>8} {'speed-up':>8} {'lossless':>8} {'baseline':>8}")
    lines = [head, "-" * len(head)]
    for r in summary["results"]:
        d = r["draft"]
        pos = " ".join(f"{x:.2f}" for x in d["accepted_at_position"])
        base = f"{r['baseline']['accept_length']:.3f}" if r.get("baseline") else "-"
        lossless = "yes" if d["lossless"] else "NO"
        if d["lossless"] and d["near_ties"]:
            lossless = f"yes ({d['near_ties']} tie)"
        # a speed-up above the acceptance length is marked: its note (below the table) says why
        speed = f"{(d['speedup'] or 0):.2f}" + ("*" if d.get("speedup_note") else "")
        lines.append(f"{r['config']:<8} {r['prompt_set'] + ' x' + str(r['prompts']):<14} {d['accept_length']:>10.3f} "
                     f"{pos[:36]:<36} {d['tokens_per_s']:>8.1f} {d['target_tokens_per_s']:>8.1f} "
                     f"{speed:>8} {lossless:>8} {base:>8}")
    lines += [f"* {r['config']} on {r['prompt_set']}: {r['draft']['speedup_note']}" for r in summary["results"]
              if r["draft"].get("speedup_note")]
    deciding = list(dict.fromkeys(r["prompt_set"] for r in summary["results"] if r.get("decides_gate", True)))
    others = list(dict.fromkeys(r["prompt_set"] for r in summary["results"] if not r.get("decides_gate", True)))
    if others:
        lines.append(f"gate: acceptance on {', '.join(deciding) or 'no set'} (eval.gate_sets); "
                     f"{', '.join(others)} reported and held to losslessness only")
    return lines
