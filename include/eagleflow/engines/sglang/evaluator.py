"""eval.backend sglang: the target served by SGLang with the exported draft, acceptance from SGLang's own counters.

Per configuration (steps / top-k / draft tokens) one ``sglang.launch_server``
with ``--speculative-algorithm EAGLE3 --speculative-draft-model-path ...``,
started detached and recorded like every process eagleflow starts
(``Node.spawn_detached``: a pid record under the run's state, stopped through
``Node.stop_recorded``), and once more without a draft (the target alone: the
speed and lossless reference). Each prompt set is sent to ``/generate``
concurrently, greedy, ``return_logprob`` with the top ``TOP_CANDIDATES`` on the
target alone (where a lossless mismatch's emitted token is judged, :mod:`.lossless`).
Every server answers one untimed warm-up request before it is timed; the
servers cannot run side by side on one GPU set, so the speed-up here is one
pair per prompt set (alone, then with the draft), not the hf backend's
per-prompt pairs.

What is read, as sglang 0.5.23 writes it (``TokenizerManager._handle_batch_output``
and ``_calculate_spec_decoding_metrics`` in ``srt/managers/tokenizer_manager.py``;
the scheduler fills the counters in ``scheduler_components/batch_result_processor.py``:
``spec_verify_ct += 1`` and ``spec_num_correct_drafts += num_correct_drafts`` per
verify pass, ``update_spec_correct_drafts_histogram(num_correct_drafts)``):

- ``meta_info.completion_tokens``: tokens generated, the prefill's one included;
- ``meta_info.spec_verify_ct``: verify passes; present (with the other ``spec_*``
  fields) only when it is > 0;
- ``meta_info.spec_num_correct_drafts``: draft tokens accepted (no bonus);
- ``meta_info.spec_correct_drafts_histogram[j]``: verify passes that accepted
  exactly j drafts (omitted while empty);
- ``meta_info.spec_accept_length`` = completion_tokens / spec_verify_ct.

The acceptance length reported is the hf backend's: tokens per verify pass =
(correct drafts + passes) / passes, summed over the prompts, so a draft never
accepted scores exactly 1.0 (SGLang's own figure counts the prefill's token
too, 64/63 for such a draft: kept as ``sglang_accept_length``).
"""
from __future__ import annotations

import sys
from pathlib import Path

from eagleflow.config import PipelineConfig, SpecConfig
from eagleflow.engines import EngineError
from eagleflow.layout import RunLayout

from eagleflow.evaluate.served import ServedEngine, lossless_and_speed, near_tie_threshold, post_all, serve_and_measure
from eagleflow.engines import ENGINES
from eagleflow.engines.sglang.launcher import SglangLaunchError, check_supported_version, installed_sglang_version
from eagleflow.evaluate.lossless import TOP_CANDIDATES
from eagleflow.serving.client import health_generate

__all__ = ["SglangEvalError", "build_command", "measure", "near_tie_threshold", "read_answer", "results"]


class SglangEvalError(EngineError):
    """The evaluation server could not be started or answered something we cannot read; the message says what."""


def speculative_args(draft_dir: str, sc: SpecConfig) -> list[str]:
    """SGLang 0.5.23's EAGLE-3 serve flags for one configuration (node tier: parsed by its own ServerArgs)."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
            "--speculative-num-steps", str(sc.steps), "--speculative-eagle-topk", str(sc.topk),
            "--speculative-num-draft-tokens", str(sc.draft_tokens)]


def build_command(cfg: PipelineConfig, *, model_path: str, host: str, port: int, draft_dir: str | None,
                  sc: SpecConfig | None, python: str = sys.executable) -> list[str]:
    """``python -m sglang.launch_server`` for the target, with the draft at ``sc`` (or alone when None)."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(cfg.server.tp)]  # the TP the capture used; --tp is only an argparse abbreviation
    if cfg.server.dtype != "auto":
        argv += ["--dtype", cfg.server.dtype]
    if sc is not None:
        argv += speculative_args(str(draft_dir), sc)
    return argv + list(cfg.eval.extra_server_args)


def check_drafts(drafts: dict[str, Path], target_dir: str | Path) -> None:
    """Each draft names the target layers it was trained on (SGLang takes its default layers where
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` is missing), before any server starts."""
    from eagleflow.train.export import layer_ids_problem  # lazy: torch (the evaluation's client side needs none)
    for draft_role, d in drafts.items():
        try:
            problem = layer_ids_problem(d, target_dir, str(ENGINES["sglang"].draft_format))
        except (OSError, ValueError) as e:   # no config.json, unreadable JSON, a target sglang cannot number
            problem = str(e)
        if problem:
            raise SglangEvalError(f"{draft_role} draft {d}: {problem}")


# --- one request, one prompt set ------------------------------------------------------------------------------

def generate_body(prompt_ids: list[int], max_new: int, rid: str, top2: bool) -> dict:
    """``top2``: ask for each position's best TOP_CANDIDATES log-probabilities (the reference's candidates)."""
    body: dict[str, object] = {"input_ids": list(prompt_ids), "rid": rid,
                               "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
    if top2:
        body.update({"return_logprob": True, "top_logprobs_num": TOP_CANDIDATES})
    return body


def read_answer(ans: dict, where: str, speculative: bool) -> dict:
    """What one /generate answer says: output ids, and with a draft the speculative counters."""
    meta = ans.get("meta_info")
    ids = ans.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(ids, list):
        raise SglangEvalError(f"{where}: the /generate answer has no meta_info / output_ids (keys "
                              f"{sorted(ans)}); is this sglang 0.5.23's HTTP server?")
    completion = int(meta.get("completion_tokens", len(ids)))
    got = {"tokens": [int(t) for t in ids], "completion_tokens": completion}
    top = meta.get("output_top_logprobs")
    if top:
        # each position: [[logprob, token_id, text], ...] best first (detokenize_logprob_tokens)
        got["candidates"] = [[(int(c[1]), float(c[0])) for c in p] if p else [] for p in top]
    if speculative:
        verify = int(meta.get("spec_verify_ct", 0))
        if verify == 0 and completion > 1:
            raise SglangEvalError(f"{where}: {completion} tokens generated but meta_info has no spec_verify_ct: "
                                  "the server is not decoding speculatively (check its --speculative-* flags "
                                  "and its log)")
        got.update({"verify_passes": verify, "correct_drafts": int(meta.get("spec_num_correct_drafts", 0)),
                    "histogram": [int(x) for x in meta.get("spec_correct_drafts_histogram") or []],
                    "spec_accept_length": meta.get("spec_accept_length")})
    return got


def send_all(url: str, prompts: list[dict], max_new: int, *, tag: str, top2: bool, concurrency: int,
             timeout_s: float, speculative: bool) -> tuple[dict[str, dict], float]:
    """Every prompt to /generate, ``concurrency`` in flight; (answers by prompt id, wall seconds)."""
    return post_all(url, "/generate", prompts,
                    body=lambda p: generate_body(p["prompt_ids"], max_new, f"{tag}-{p['id']}", top2),
                    read=lambda ans, where: read_answer(ans, where, speculative), error=SglangEvalError,
                    concurrency=concurrency, timeout_s=timeout_s)


def measure(answers: dict[str, dict], alone: dict[str, dict], secs: float, alone_secs: float, steps: int,
            threshold: float) -> dict:
    """One draft, one configuration, one prompt set: the hf backend's figures from SGLang's counters."""
    passes = sum(a["verify_passes"] for a in answers.values())
    correct = sum(a["correct_drafts"] for a in answers.values())
    completion = sum(a["completion_tokens"] for a in answers.values())
    at = [0] * steps
    for a in answers.values():
        for accepted, count in enumerate(a["histogram"]):
            for j in range(min(accepted, steps)):
                at[j] += count
    accept_length = round((correct + passes) / passes, 4) if passes else 1.0
    return {"accept_length": accept_length,
            "sglang_accept_length": round(completion / passes, 4) if passes else None,
            "verify_passes": passes, "verify_tokens": correct + passes, "correct_drafts": correct,
            "accepted_at_position": [round(x / passes, 4) if passes else 0.0 for x in at],
            **lossless_and_speed(answers, alone, secs, alone_secs, accept_length, threshold)}


# --- the run (the servers, their order and the rows: .served) --------------------------------------------

def results(cfg: PipelineConfig, layout: RunLayout, *, target_dir: str, drafts: dict[str, Path],
            prompt_sets: dict[str, list[dict]], log, node=None, command=None) -> tuple[list[dict], dict]:
    """The result rows (configuration x prompt set, each draft's figures), and what describes the target.

    ``command`` (build_command's signature) replaces sglang's argv: the control-plane tests start a server
    that answers as sglang does, through the same records, readiness and stop."""
    ec = cfg.eval
    if command is None:
        try:
            version = check_supported_version(installed_sglang_version())
        except SglangLaunchError as e:
            raise SglangEvalError(str(e).replace("capture.backend hf", "eval.backend hf")) from None
        command = build_command
    else:
        version = None
    check_drafts(drafts, target_dir)
    threshold = near_tie_threshold(cfg.server.dtype, ec.near_tie_logit_gap)
    first = next((ps[0] for ps in prompt_sets.values() if ps), None)

    def send(url, prompts, max_new, tag, *, top2, speculative):
        return send_all(url, prompts, max_new, tag=tag, top2=top2, concurrency=ec.concurrency,
                        timeout_s=ec.request_timeout_s, speculative=speculative)

    def warm_up(url, speculative):   # first requests pay for allocations and graph capture: untimed
        if first is not None:
            send(url, [first], min(4, ec.max_new_tokens), "warm-up", top2=False, speculative=speculative)

    def with_draft(url, prompts, tag, sc, alone, alone_secs):
        answers, secs = send(url, prompts, ec.max_new_tokens, tag, top2=False, speculative=True)
        return measure(answers, alone, secs, alone_secs, sc.steps, threshold)

    engine = ServedEngine(
        label="sglang", error=SglangEvalError, command=command, ready=lambda url: health_generate(url, 20),
        reference=lambda url, prompts, tag: send(url, prompts, ec.max_new_tokens, tag, top2=True, speculative=False),
        with_draft=with_draft, warm_up=warm_up)
    rows = serve_and_measure(cfg, layout, engine, target_dir=target_dir, drafts=drafts, prompt_sets=prompt_sets,
                             log=log, node=node)
    return rows, {"sglang_version": version, "concurrency": ec.concurrency, "target_dtype": cfg.server.dtype,
                  "device": "sglang"}
