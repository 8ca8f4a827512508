"""The ``hf`` engine's evaluation: our own speculative decoder over transformers, in process (CPU or GPU).

For each configuration and prompt set, every prompt is decoded greedily by the target alone (the reference for
the lossless check) and with each draft, the target verifying (``eagleflow.evaluate.decoder``): acceptance,
per-position acceptance, paired speed and losslessness (``measure``), the rows every engine's evaluation gives
``eagleflow.evaluate.run.evaluate_run``. It reads the SGLang-format files at the export's top
(``ENGINE.eval_format``).
"""
from __future__ import annotations

import torch

from eagleflow.config import PipelineConfig
from eagleflow.evaluate import decoder   # read at each call (decoder.greedy ...): a test may replace one
from eagleflow.evaluate.lossless import first_difference
from eagleflow.evaluate.prompt_sets import expand_turns
from eagleflow.evaluate.speed import speed_figures
from eagleflow.layout import RunLayout


def _mismatch(ref, got, threshold) -> dict | None:
    """First position where the output with the draft leaves the target's own, judged on the emitted token."""
    return first_difference(ref.tokens, got.tokens, lambda i: ref.candidates[i] if i < len(ref.candidates) else [],
                            threshold)


def measure(target, proposer, prompts: list[dict], references: dict, steps: int, max_new: int, threshold,
            verify=None) -> dict:
    """One draft, one configuration, one prompt set: acceptance, per-position acceptance, speed, lossless.

    Speed: after an untimed warm-up of both, each prompt is decoded by the target alone and with the draft
    back to back (which goes first alternates), so both see the same machine state; the speed-up is the
    median of the per-prompt ratios (:mod:`.speed`)."""
    passes = tokens = 0
    at = [0] * steps
    secs, ref_secs = [], []
    mismatches = []
    if prompts:   # first calls allocate (caches, thread pools): neither side's timing pays for it
        w = prompts[0]["prompt_ids"]
        decoder.greedy(target, w, min(4, max_new), candidates=False)
        decoder.speculative(target, proposer, w, min(4, max_new), steps, verify=verify)
    for n, p in enumerate(prompts):
        if n % 2:
            got = decoder.speculative(target, proposer, p["prompt_ids"], max_new, steps, verify=verify)
            alone = decoder.greedy(target, p["prompt_ids"], max_new, candidates=False)
        else:
            alone = decoder.greedy(target, p["prompt_ids"], max_new, candidates=False)
            got = decoder.speculative(target, proposer, p["prompt_ids"], max_new, steps, verify=verify)
        ref = references[p["id"]]
        passes += got.verify_passes
        tokens += got.verify_tokens
        for a in got.accepted:
            for j in range(min(a, steps)):
                at[j] += 1
        secs.append(got.seconds)
        ref_secs.append(alone.seconds)
        mm = _mismatch(ref, got, threshold)
        if mm:
            mismatches.append({"prompt": p["id"], **mm})
    accept_length = round(tokens / passes, 4) if passes else 1.0
    speed = speed_figures([len(references[p["id"]].tokens) for p in prompts], ref_secs, secs, accept_length,
                          "paired: target alone and with the draft back to back per prompt, after a warm-up; "
                          "median of the per-prompt ratios")
    return {"accept_length": accept_length,
            "sglang_accept_length": round((tokens + len(prompts)) / passes, 4) if passes else None,
            "verify_passes": passes, "verify_tokens": tokens,
            "accepted_at_position": [round(x / passes, 4) if passes else 0.0 for x in at],
            **speed,
            "lossless": not [m for m in mismatches if not m["near_tie"]],
            "near_ties": sum(m["near_tie"] for m in mismatches),
            # at most 20 kept, real differences first (the gate names the first one)
            "mismatches": sorted(mismatches, key=lambda m: m["near_tie"])[:20]}


def results(cfg: PipelineConfig, layout: RunLayout, *, target_dir: str, drafts: dict,
               prompt_sets: dict[str, list[dict]], log, verify=None) -> tuple[list[dict], dict]:
    """The hf engine's evaluation (eagleflow.engines): our speculative decoder over transformers, in process."""
    ec = cfg.eval
    target = decoder.Target(target_dir, device=ec.device, dtype=cfg.server.dtype)
    torch.manual_seed(0)
    proposers = {}
    for role, d in drafts.items():
        model, aux = decoder.load_draft(d, target_dir)
        proposers[role] = decoder.DraftProposer(model, target.aux_layers(aux or cfg.capture.aux_layers), target.device)
    threshold = (lambda top: decoder.near_tie_threshold(target.dtype, top, ec.near_tie_logit_gap))
    log(f"evaluate: target {target_dir} ({target.dtype}, {target.device})")
    rows = []
    for name, prompts in prompt_sets.items():
        references: dict = {}

        def answer(ps: list[dict]) -> dict[str, list[int]]:
            for p in ps:
                references[p["id"]] = decoder.greedy(target, p["prompt_ids"], ec.max_new_tokens)
            return {p["id"]: references[p["id"]].tokens for p in ps}
        # MT-Bench: each later turn follows the target's own greedy answer (its reference) to the turns before
        prompts = expand_turns(prompts, answer, target_dir)
        answer([p for p in prompts if p["id"] not in references])
        for sc in ec.configs:
            row = {"config": sc.label, "steps": sc.steps, "topk": sc.topk, "draft_tokens": sc.draft_tokens,
                   "prompt_set": name, "prompts": len(prompts),
                   "min_accept_length": sc.min_accept_length or ec.min_accept_length}
            for role, prop in proposers.items():
                row[role] = measure(target, prop, prompts, references, sc.steps, ec.max_new_tokens, threshold,
                                    verify=verify if role == "draft" else None)
            rows.append(row)
    return rows, {"target_dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device)}
