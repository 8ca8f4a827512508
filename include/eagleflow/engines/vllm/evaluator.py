"""eval.backend vllm: the target served by vLLM with the exported draft, acceptance from vLLM's own counters.

The servers, their order and the rows are the sglang backend's (:mod:`.served`): the target alone once, then
per configuration and per draft ``vllm serve`` (``python -m vllm.entrypoints.cli.main serve``) with
``--speculative-config '{"method": "eagle3", "model": <export>/speculators, "num_speculative_tokens": S}'``,
each started detached, recorded, polled on vLLM's ``/health`` until it answers, warmed up and stopped by its
record. vLLM drafts chains only (its EAGLE-3 proposer has no tree: one token per step, ``steps`` of them), so
a configuration with top-k > 1 is refused at config load (``Engine.eval_trees`` false).

Each prompt set goes to vLLM's ``/v1/completions`` by token ids (``vllm_api.completion_body``, the capture
middleware's request: ``return_token_ids``), greedy, ``eval.concurrency`` in flight. The target alone also
asks for each position's best ``TOP_CANDIDATES`` log-probabilities with ``return_tokens_as_token_ids`` (the
candidates keyed ``token_id:<id>``, never a token's text), served with ``--max-logprobs`` that many (vLLM's
default allows 20): the emitted-token lossless rule of :mod:`.lossless` reads them.

Acceptance is what vLLM itself counts (vLLM 0.33 ``v1/spec_decode/metrics.py``): the scheduler calls
``SpecDecodingStats.observe_draft`` once per request per step that verified drafts (``num_drafts += 1``,
``num_draft_tokens += proposed``, ``num_accepted_tokens += accepted``, ``num_accepted_tokens_per_pos[i] += 1``
for each accepted position i), and ``SpecDecodingProm`` adds those to the Prometheus counters on ``/metrics``:

- ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total`` (labels model_name, engine: summed over engines);
- ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` for i < num_speculative_tokens.

They are read before and after each prompt set (after: until two reads agree, the stat logger records a
step's stats after handing out its outputs) and the differences taken. The acceptance length is vLLM's own
definition, 1 + accepted / drafts (``SpecDecodingLogging.log``: "mean_acceptance_length = 1 +
(num_accepted_tokens / num_drafts)", the bonus token included), the same tokens-per-verify-pass figure the
hf and sglang backends report (a draft never right scores exactly 1.0); per position: accepted at i / drafts.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from eagleflow.config import PipelineConfig, SpecConfig
from eagleflow.engines import ENGINES, EngineError
from eagleflow.layout import RunLayout

from eagleflow.evaluate.served import ServedEngine, lossless_and_speed, near_tie_threshold, post_all, serve_and_measure
from eagleflow.engines.vllm.api import completion_body
from eagleflow.engines.vllm.launcher import VllmLaunchError, check_supported_version, installed_vllm_version
from eagleflow.evaluate.lossless import TOP_CANDIDATES
from eagleflow.serving.client import request_json
from eagleflow.train.export_formats import format_dir

# vLLM 0.33's Prometheus counters (v1/spec_decode/metrics.py, SpecDecodingProm), as families (no _total)
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
TOKEN_ID_PREFIX = "token_id:"   # vLLM's format_token_id_placeholder (return_tokens_as_token_ids)
SETTLE_S = 5.0                  # how long the counters may take to stop moving after the last answer


class VllmEvalError(EngineError):
    """A vLLM evaluation server could not be started or answered something we cannot read; the message says what."""


# --- the servers -----------------------------------------------------------------------------------------------

def speculators_dir(draft_dir: str | Path) -> Path:
    """The export's folder vLLM serves (the vllm engine's draft format, train.export_formats)."""
    return format_dir(draft_dir, str(ENGINES["vllm"].draft_format))


def speculative_config(draft_dir: str | Path, sc: SpecConfig) -> dict:
    """vLLM's EAGLE-3 ``--speculative-config`` for one configuration: a chain of ``steps`` draft tokens."""
    return {"method": "eagle3", "model": str(speculators_dir(draft_dir)), "num_speculative_tokens": sc.steps}


def build_command(cfg: PipelineConfig, *, model_path: str, host: str, port: int, draft_dir: str | None,
                  sc: SpecConfig | None, python: str = sys.executable) -> list[str]:
    """``vllm serve`` for the target, with the draft at ``sc`` (or alone, answering TOP_CANDIDATES log-probs,
    when None). Proven against vLLM's own parser in tests/node_vllm/test_vllm_eval.py."""
    argv = [python, "-m", "vllm.entrypoints.cli.main", "serve", model_path, "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(cfg.server.tp), "--dtype", cfg.server.dtype]
    if sc is None:
        argv += ["--max-logprobs", str(TOP_CANDIDATES)]   # the reference's candidates; vLLM allows 20 by default
    else:
        argv += ["--speculative-config", json.dumps(speculative_config(str(draft_dir), sc), separators=(",", ":"))]
    return argv + list(cfg.eval.extra_server_args)


def check_drafts(drafts: dict[str, Path], target_dir: str | Path) -> None:
    """Each draft has the speculators folder vLLM loads, naming the target layers it was trained on (vLLM takes
    its default layers where the ids are missing), before any server starts."""
    from eagleflow.train.export import layer_ids_problem  # lazy: torch (the evaluation's client side needs none)
    for draft_role, d in drafts.items():
        spec = speculators_dir(d)
        if not (spec / "config.json").is_file():
            raise VllmEvalError(f"{draft_role} draft {d} has no {spec}/config.json (the speculators format vLLM "
                                "serves): export it with train.export_formats including speculators (the default) "
                                "and rerun `eagleflow export`, or use eval.backend sglang")
        try:
            problem = layer_ids_problem(d, target_dir, str(ENGINES["vllm"].draft_format))
        except (OSError, ValueError) as e:   # unreadable JSON, a target vLLM cannot number
            problem = str(e)
        if problem:
            raise VllmEvalError(f"{draft_role} draft {d}: {problem}")


# --- one prompt set ---------------------------------------------------------------------------------------------

def completion_request(prompt_ids: list[int], max_new: int, candidates: bool) -> dict:
    """A greedy completion of the token ids (the capture middleware's body); ``candidates``: each position's
    best TOP_CANDIDATES log-probabilities, keyed by token id."""

    body = completion_body({"input_ids": list(prompt_ids),
                            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}, None)
    if candidates:
        body.update({"logprobs": TOP_CANDIDATES, "return_tokens_as_token_ids": True})
    return body


def read_completion(ans: dict, where: str, candidates: bool) -> dict:
    """What one /v1/completions answer says: the output ids, and the reference's candidates per position."""
    choices = ans.get("choices")
    choice: dict = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise VllmEvalError(f"{where}: the /v1/completions answer has no choices[0].token_ids (keys {sorted(ans)}); "
                            "is this vLLM 0.33's OpenAI server (return_token_ids)?")
    got = {"tokens": [int(t) for t in ids], "finish_reason": choice.get("finish_reason")}
    if candidates:
        top = (choice.get("logprobs") or {}).get("top_logprobs")
        if not isinstance(top, list) or len(top) != len(ids):
            raise VllmEvalError(f"{where}: {len(ids)} tokens but logprobs.top_logprobs has "
                                f"{len(top) if isinstance(top, list) else 'no'} positions; the lossless check needs "
                                "each position's log-probabilities (was --max-logprobs overridden in "
                                "eval.extra_server_args?)")
        got["candidates"] = [_candidates(p, where, i) for i, p in enumerate(top)]
    return got


def _candidates(position: dict | None, where: str, i: int) -> list[tuple[int, float]]:
    out = []
    for key, lp in (position or {}).items():
        if not key.startswith(TOKEN_ID_PREFIX):
            raise VllmEvalError(f"{where}: top_logprobs at position {i} is keyed {key!r}, not "
                                f"'{TOKEN_ID_PREFIX}<id>': the server ignored return_tokens_as_token_ids")
        out.append((int(key[len(TOKEN_ID_PREFIX):]), float(lp)))
    return sorted(out, key=lambda c: -c[1])   # best first; vLLM adds the sampled token to the top k


def send_all(url: str, prompts: list[dict], max_new: int, *, candidates: bool, concurrency: int,
             timeout_s: float) -> tuple[dict[str, dict], float]:
    """Every prompt to /v1/completions, ``concurrency`` in flight; (answers by prompt id, wall seconds)."""
    return post_all(url, "/v1/completions", prompts,
                    body=lambda p: completion_request(p["prompt_ids"], max_new, candidates),
                    read=lambda ans, where: read_completion(ans, where, candidates), error=VllmEvalError,
                    concurrency=concurrency, timeout_s=timeout_s)


# --- vLLM's spec-decode counters --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters at one moment, summed over its engines."""
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: tuple[float, ...]

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pos = [(self.accepted_per_pos[i] if i < len(self.accepted_per_pos) else 0.0)
               - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0.0) for i in range(n)]
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(pos))


def parse_spec_counters(text: str, where: str = "/metrics") -> SpecCounters:
    """vLLM's spec-decode counters from its Prometheus text (prometheus_client's own parser)."""
    # vLLM's own dependency (it renders /metrics with it): installed wherever this backend runs
    from prometheus_client.parser import text_string_to_metric_families
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        # the counters' <name>_total samples (a counter's <name>_created timestamp is a family of its own)
        if family.name not in (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS):
            continue
        for s in family.samples:   # one per engine (data parallel): summed
            if family.name == ACCEPTED_PER_POS:
                i = int(s.labels["position"])
                per_pos[i] = per_pos.get(i, 0.0) + s.value
            else:
                totals[family.name] = totals.get(family.name, 0.0) + s.value
    missing = [n for n in (DRAFTS, DRAFT_TOKENS, ACCEPTED) if n not in totals]
    if missing:
        raise VllmEvalError(f"{where} has no {', '.join(n + '_total' for n in missing)}: the server does not "
                            "decode speculatively or does not log its stats (remove --disable-log-stats from "
                            "eval.extra_server_args; check --speculative-config in the server's log)")
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED],
                        tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1 if per_pos else 0)))


def read_metrics(url: str, timeout_s: float = 30.0) -> str:
    """``GET /metrics``: Prometheus text (not JSON, so not the capture client's request)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise VllmEvalError(f"GET {url}/metrics failed ({e}); read the server's log") from None


def read_counters(url: str, settle: bool = False) -> SpecCounters:
    """The counters now; ``settle``: until two reads 0.2 s apart agree (at most SETTLE_S)."""
    now = parse_spec_counters(read_metrics(url), f"{url}/metrics")
    deadline = time.monotonic() + SETTLE_S
    while settle and time.monotonic() < deadline:
        time.sleep(0.2)
        again = parse_spec_counters(read_metrics(url), f"{url}/metrics")
        if again == now:
            break
        now = again
    return now


def measure(delta: SpecCounters, answers: dict[str, dict], alone: dict[str, dict], secs: float, alone_secs: float,
            steps: int, threshold: float, where: str = "vLLM") -> dict:
    """One draft, one configuration, one prompt set: the hf backend's figures from vLLM's counters."""
    if min(delta.drafts, delta.draft_tokens, delta.accepted, *delta.accepted_per_pos, 0.0) < 0:
        raise VllmEvalError(f"{where}: vLLM's spec-decode counters went down during a prompt set ({delta}): "
                            "the server restarted; read its log")
    decoded = sum(max(0, len(a["tokens"]) - 1) for a in answers.values())   # tokens after each prefill's one
    if delta.drafts == 0 and decoded > 0:
        raise VllmEvalError(f"{where}: {decoded} tokens decoded but vllm:spec_decode_num_drafts did not move: the "
                            "server is not decoding speculatively (check --speculative-config in its log)")
    drafts, accepted = int(delta.drafts), int(delta.accepted)
    # vLLM's own mean acceptance length (v1/spec_decode/metrics.py, SpecDecodingLogging.log): 1 + accepted/drafts
    accept_length = round(1 + accepted / drafts, 4) if drafts else 1.0
    pos = list(delta.accepted_per_pos[:steps]) + [0.0] * max(0, steps - len(delta.accepted_per_pos))
    return {"accept_length": accept_length,
            "verify_passes": drafts, "verify_tokens": drafts + accepted, "correct_drafts": accepted,
            "draft_tokens": int(delta.draft_tokens),
            "draft_acceptance_rate": round(accepted / delta.draft_tokens, 4) if delta.draft_tokens else None,
            "accepted_at_position": [round(x / drafts, 4) if drafts else 0.0 for x in pos],
            **lossless_and_speed(answers, alone, secs, alone_secs, accept_length, threshold)}


# --- the run (the servers, their order and the rows: .served) ------------------------------------------------

def check_vllm() -> str:
    """The installed vLLM, the version the node tier proves (the capture launcher's check, worded for eval)."""
    try:
        return check_supported_version(installed_vllm_version())
    except VllmLaunchError as e:
        raise VllmEvalError(str(e).replace("capture.backend vllm runs `eagleflow capture serve`",
                                           "eval.backend vllm runs `eagleflow evaluate`")
                            .replace("eagleflow's capture supports", "eagleflow's evaluation supports")
                            .replace("capture.backend hf", "eval.backend hf or sglang")) from None


def results(cfg: PipelineConfig, layout: RunLayout, *, target_dir: str, drafts: dict[str, Path],
            prompt_sets: dict[str, list[dict]], log, node=None, command=None) -> tuple[list[dict], dict]:
    """The result rows (configuration x prompt set, each draft's figures), and what describes the target.

    ``command`` (build_command's signature) replaces vLLM's argv: a test can start a server that answers as
    vLLM does, through the same records, readiness and stop."""
    ec = cfg.eval
    version = check_vllm() if command is None else None
    check_drafts(drafts, target_dir)
    threshold = near_tie_threshold(cfg.server.dtype, ec.near_tie_logit_gap)
    first = next((ps[0] for ps in prompt_sets.values() if ps), None)

    def send(url, prompts, max_new, candidates):
        return send_all(url, prompts, max_new, candidates=candidates, concurrency=ec.concurrency,
                        timeout_s=ec.request_timeout_s)

    def warm_up(url, speculative):   # first requests pay for allocations and graph capture: untimed
        if first is not None:
            send(url, [first], min(4, ec.max_new_tokens), False)

    def with_draft(url, prompts, tag, sc, alone, alone_secs):
        before = read_counters(url)
        answers, secs = send(url, prompts, ec.max_new_tokens, False)
        delta = read_counters(url, settle=True) - before
        return measure(delta, answers, alone, secs, alone_secs, sc.steps, threshold, f"{url} ({tag}, {sc.label})")

    engine = ServedEngine(
        label="vllm", error=VllmEvalError, command=command or build_command,
        ready=lambda url: request_json(url, "GET", "/health", None, 20),   # vLLM listens once its engine is up
        reference=lambda url, prompts, tag: send(url, prompts, ec.max_new_tokens, True),
        with_draft=with_draft, warm_up=warm_up)
    rows = serve_and_measure(cfg, layout, engine, target_dir=target_dir, drafts=drafts, prompt_sets=prompt_sets,
                             log=log, node=node)
    return rows, {"vllm_version": version, "concurrency": ec.concurrency, "target_dtype": cfg.server.dtype,
                  "device": "vllm"}
