"""GPU check (run on a GPU node with sglang or vLLM installed): our draft served as EAGLE-3 by either engine.

What it proves, after bench/gpu_check_capture.py (whose kept folder it reuses;
a failed capture check is never re-run here), for ``--engine sglang`` (stage
sglang_eagle3) or ``--engine vllm`` (stage vllm_eagle3):

1. `eagleflow train` trains the draft on the GPU on the hidden states the live
   capture server stored, and `eagleflow export` writes it (both formats:
   SGLang's and the speculators one vLLM serves) and records it in the folder
   (eagle3_export.json); a later stage given the same folder evaluates that
   same draft rather than training another, so one draft is proven on both
   engines (bench/gpu_check.sh hands vllm_eagle3 the sglang stage's folder
   when that stage exported one);
2. the engine loads that export with the run report's own serve command
   (sglang: `--speculative-algorithm EAGLE3 ... --tp-size N`,
   eagleflow.console.run_report.serve_command; vLLM: `vllm serve TARGET
   --speculative-config '{"method": "eagle3", ...}'`, run_report.vllm_serve_command)
   plus a port, a memory share and a fast start (no CUDA graphs:
   bench/gpu_check_engines.py);
3. greedy completions of held-out prompts against the target served alone:
   each divergence is reported with the target's own top-1/top-2 logit gap at
   the first differing token (a transformers forward on the GPU); one at a
   near tie (gap within two bf16 steps of the top logit) is tolerated, any
   other fails the check;
4. the draft's tokens are really accepted, summed over the prompts above 0:
   sglang: the accepted-draft counter it puts in meta_info
   (``spec_accept_token_num`` or, by version, ``spec_num_correct_drafts`` /
   ``spec_accepted_drafts``); ``spec_accept_length`` (completion tokens /
   verify passes) is reported but is no test: a draft never accepted scores
   64/63. vLLM: its own spec-decode counters on /metrics, read before and after
   the prompts by the vLLM evaluator's reader (engines/vllm/evaluator.py:
   accepted tokens, draft tokens, per position; 1 + accepted / drafts is vLLM's
   mean acceptance length). The prompts go to vLLM's /v1/completions as the
   evaluator sends them (token ids in and out).

    python bench/gpu_check_eagle3.py --from DIR [--engine sglang|vllm] [--steps 200] [--prompts 8]

``--from``: a folder kept by `gpu_check_capture.py --keep DIR` (of either
engine) whose verdict passed. Exit 0 = PASS.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_check_common import results_dir, write_verdict  # noqa: E402
from gpu_check_engines import ENGINES, EXPORT_RECORD, CheckEngine  # noqa: E402

READY_S = 300
# (accepted, proposed) counters in meta_info, newest sglang names first (0.5.23: spec_num_correct_drafts)
ACCEPT_KEYS = (("spec_num_correct_drafts", "spec_num_proposed_drafts"), ("spec_accepted_drafts", "spec_proposed_drafts"),
               ("spec_accept_token_num", "spec_draft_token_num"))


def accepted_drafts(meta: dict) -> tuple[int, int] | None:
    """(draft tokens accepted, proposed) for one request, or None when this sglang reports no counter."""
    for acc, prop in ACCEPT_KEYS:
        if acc in meta:
            return int(meta[acc] or 0), int(meta.get(prop) or 0)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """An engine's server in its own process group; stopped by that group only (nothing else on the GPU)."""

    def __init__(self, argv: list[str], log: Path, engine: CheckEngine):
        self.port = free_port()
        self.argv = argv + ["--host", "127.0.0.1", "--port", str(self.port), *engine.server_args]
        self.engine = engine
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        print("$", shlex.join(self.argv), flush=True)
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + READY_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-6000:]}")
            try:
                urllib.request.urlopen(self.url + self.engine.ready_path, timeout=30)
                return self
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"{self.engine.name} not ready in {READY_S} s:\n{self.log.read_text()[-6000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)   # the group we started, never a pattern
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    print("$", shlex.join(argv), flush=True)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    print(p.stdout[-3000:], p.stderr[-3000:], sep="\n", flush=True)
    return p


def logit_gap(model_path: str, ids: list[int], want: list[int], got: list[int]) -> dict:
    """The target's top-1/top-2 logit gap where ``got`` first leaves ``want`` (the target's own greedy output)."""
    import torch
    from transformers import AutoModelForCausalLM
    k = next(i for i, (w, g) in enumerate(zip(want, got)) if w != g)
    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        logits = m(torch.tensor([ids + want[:k]], device="cuda")).logits[0, -1].float()
    top = torch.topk(logits, 2)
    t1, t2 = top.values.tolist()
    tie = max(abs(t1), 1.0) * 2 ** -7 * 2   # two bf16 steps at the top logit's magnitude
    return {"position": k, "target_token": want[k], "served_token": got[k], "top1": t1, "top2": t2,
            "gap": t1 - t2, "near_tie": (t1 - t2) <= tie, "tie_tolerance": tie}


class SglangServing:
    """sglang.launch_server: greedy /generate, the accepted-draft counters in each answer's meta_info."""

    def target_argv(self, cfg) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(cfg.target_model),
                "--tp-size", str(cfg.server.tp)] + (["--dtype", cfg.server.dtype] if cfg.server.dtype != "auto"
                                                     else [])

    def draft_argv(self, cfg, export: str) -> list[str]:
        from eagleflow.console.run_report import serve_command
        serve = shlex.split(serve_command(cfg, export))
        serve[0] = sys.executable                   # this venv's python: the sglang this check is about
        return serve

    def start_counting(self, s: Server) -> None:
        return None                                 # sglang counts per request, in each answer

    def generate(self, s: Server, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        ans = http_json(s.url + "/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}, timeout=300)
        return ans.get("output_ids") or [], ans.get("meta_info", {})

    def describe(self, meta: dict) -> str:
        return (f"accepted drafts {accepted_drafts(meta)}; accept length {meta.get('spec_accept_length')}; verify "
                f"passes {meta.get('spec_verify_ct')}; completion tokens {meta.get('completion_tokens')}")

    def acceptance(self, s: Server, metas: list[dict], counting) -> tuple[dict, list[str]]:
        accepted = proposed = missing = 0
        for meta in metas:
            counts = accepted_drafts(meta)
            if counts is None:
                missing += 1
            else:
                accepted, proposed = accepted + counts[0], proposed + counts[1]
        measured = [m["spec_accept_length"] for m in metas if isinstance(m.get("spec_accept_length"), (int, float))]
        states = http_json(s.url + "/get_server_info").get("internal_states") or [{}]
        problems = []
        if missing:
            problems.append(f"{missing} of {len(metas)} answers carry no accepted-draft counter (meta_info keys: "
                            f"{sorted(metas[0])}); this sglang cannot show acceptance")
        elif accepted == 0:
            problems.append(f"no draft token accepted in {len(metas)} prompts ({proposed} proposed)")
        return {"accepted_drafts": accepted, "proposed_drafts": proposed,
                "accept_rate": accepted / proposed if proposed else None,
                "mean_accept_length": sum(measured) / len(measured) if measured else None,
                "server_avg_spec_accept_length": states[0].get("avg_spec_accept_length")}, problems


class VllmServing:
    """``vllm serve``: greedy /v1/completions by token ids, acceptance from vLLM's own /metrics counters, both
    through the vLLM evaluator's own helpers (engines/vllm/evaluator.py)."""
    CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]   # `vllm serve` of this venv, as the launchers run it

    def target_argv(self, cfg) -> list[str]:
        return self.CLI + ["serve", str(cfg.target_model), "--tensor-parallel-size", str(cfg.server.tp)] + (
            ["--dtype", cfg.server.dtype] if cfg.server.dtype != "auto" else [])

    def draft_argv(self, cfg, export: str) -> list[str]:
        from eagleflow.console.run_report import vllm_serve_command
        from eagleflow.engines.vllm.evaluator import speculators_dir
        serve = shlex.split(vllm_serve_command(cfg, str(speculators_dir(export))))
        if serve[0] != "vllm":
            raise RuntimeError(f"the run report's vLLM command starts with {serve[0]!r}, not 'vllm': "
                               f"{shlex.join(serve)}")
        return self.CLI + serve[1:]

    def start_counting(self, s: Server):
        from eagleflow.engines.vllm.evaluator import read_counters
        return read_counters(s.url)

    def generate(self, s: Server, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        from eagleflow.engines.vllm.evaluator import completion_request, read_completion
        body = {**completion_request(ids, max_new, False), "ignore_eos": True}   # equal lengths, as sglang's
        got = read_completion(http_json(s.url + "/v1/completions", body, timeout=300), f"{s.url}/v1/completions",
                              False)
        return got["tokens"], {"finish_reason": got["finish_reason"]}

    def describe(self, meta: dict) -> str:
        return f"finish reason {meta.get('finish_reason')} (acceptance: vLLM's counters over all prompts)"

    def acceptance(self, s: Server, metas: list[dict], counting) -> tuple[dict, list[str]]:
        from eagleflow.engines.vllm.evaluator import read_counters
        delta = read_counters(s.url, settle=True) - counting   # settle: the stat logger lags the last answer
        drafts, accepted, proposed = int(delta.drafts), int(delta.accepted), int(delta.draft_tokens)
        problems = []
        if drafts == 0:
            problems.append(f"vllm:spec_decode_num_drafts did not move over {len(metas)} prompts: the server did "
                            "not decode speculatively (read its --speculative-config line in vllm-eagle3.log)")
        elif accepted == 0:
            problems.append(f"no draft token accepted in {len(metas)} prompts ({proposed} proposed, vLLM's counters)")
        return {"accepted_drafts": accepted, "proposed_drafts": proposed, "verify_passes": drafts,
                "accept_rate": accepted / proposed if proposed else None,
                # vLLM's own mean acceptance length (v1/spec_decode/metrics.py): 1 + accepted / drafts
                "mean_accept_length": 1 + accepted / drafts if drafts else None,
                "accepted_at_position": [x / drafts for x in delta.accepted_per_pos] if drafts else []}, problems


SERVING = {"sglang": SglangServing(), "vllm": VllmServing()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", required=True, help="a folder kept by gpu_check_capture.py --keep")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="sglang",
                    help="the engine that serves the draft (stage <engine>_eagle3)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    engine, serving = ENGINES[a.engine], SERVING[a.engine]
    stage = f"{engine.name}_eagle3"
    import torch
    import yaml
    if not torch.cuda.is_available():
        return write_verdict(stage, "fail", "torch sees no CUDA GPU here")
    t0 = time.time()
    root = Path(a.src)
    if not (root / "config.yaml").is_file():
        return write_verdict(stage, "skipped", f"no capture check left its folder here (no config.yaml in {root}); "
                                               "not re-run")
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    captured_by = cfg["capture"]["backend"]   # the folder's capture engine, whichever engine serves now
    capture = (results_dir() or root) / f"{captured_by}_capture.json"
    capture_status = json.loads(capture.read_text()).get("status") if capture.is_file() else None
    if capture_status not in (None, "pass"):
        # never re-run a failed capture here: it costs the start-up again and fails the same way
        return write_verdict(stage, "skipped", f"the {captured_by} capture check did not pass ({capture_status}); "
                                               "not re-run")
    cfgp = root / "config-eagle3.yaml"
    record = root / EXPORT_RECORD
    if record.is_file():   # an earlier stage trained and exported this folder's draft: prove that one here
        trained = json.loads(record.read_text())
        export, steps = trained["export"], trained["train_steps"]
        print(f"evaluating the draft {trained['stage']} trained and exported: {export}", flush=True)
    else:
        cfg["train"] = {"device": "cuda", "max_steps": a.steps, "batch_size": 4, "draft_vocab_size": 256,
                        "checkpoint_every": a.steps, "log_every": 50}
        cfgp.write_text(yaml.safe_dump(cfg))
        cli = [sys.executable, "-m", "eagleflow.cli"]
        if run(cli + ["train", "--config", str(cfgp), "--run-id", "gpucheck"], 300).returncode != 0:
            return write_verdict(stage, "fail", "eagleflow train failed (its output is in this stage's log)")
        p = run(cli + ["export", "--config", str(cfgp), "--run-id", "gpucheck"], 120)
        if p.returncode != 0:
            return write_verdict(stage, "fail", "eagleflow export failed (its output is in this stage's log)")
        export, steps = p.stdout.strip().splitlines()[-1], a.steps
        record.write_text(json.dumps({"export": export, "stage": stage, "train_steps": steps}) + "\n")

    from eagleflow.config import load_config
    from tests.fixtures.capture_corpus import write_corpus
    loaded = load_config(cfgp)
    vocab = json.loads((Path(loaded.target_model) / "config.json").read_text())["vocab_size"]
    prompts = [r["input_ids"][:48] for r in write_corpus(root / "heldout.parquet", a.prompts, vocab, seed=99,
                                                          min_len=16, max_len=64)]   # a seed the draft never saw
    try:
        serve = serving.draft_argv(loaded, export)
        with Server(serving.target_argv(loaded), root / f"{engine.name}-target.log", engine) as s:
            want = [serving.generate(s, ids, a.new_tokens)[0] for ids in prompts]
        with Server(serve, root / f"{engine.name}-eagle3.log", engine) as s:
            counting = serving.start_counting(s)
            got = [serving.generate(s, ids, a.new_tokens) for ids in prompts]
            accept, problems = serving.acceptance(s, [meta for _, meta in got], counting)
    except (RuntimeError, OSError, ValueError) as e:   # a server that did not start or answered unreadably
        return write_verdict(stage, "fail", str(e)[:4000], engine=engine.name, draft=export)
    divergences = []
    for i, (ids, wo, (go, meta)) in enumerate(zip(prompts, want, got)):
        if wo != go:
            d = logit_gap(str(loaded.target_model), ids, wo, go) if wo and go and len(wo) == len(go) else \
                {"position": None, "near_tie": False, "detail": f"lengths {len(wo)} vs {len(go)}"}
            divergences.append({"prompt": i, **d})
        print(f"prompt {i}: same greedy output {wo == go}; {serving.describe(meta)}")
    hard = [d for d in divergences if not d.get("near_tie")]
    if hard:
        problems.append(f"{len(hard)} greedy divergence(s) from the target alone not at a near tie: {hard[:3]}")
    figures = {"engine": engine.name, "draft": export, "prompts": len(prompts),
               "same_greedy_output": len(prompts) - len(divergences), "divergences": divergences, **accept,
               "serve_command": shlex.join(serve + list(engine.server_args)), "train_steps": steps,
               "seconds": round(time.time() - t0, 1)}
    return write_verdict(stage, "fail" if problems else "pass", "; ".join(problems) or None, **figures)


if __name__ == "__main__":
    sys.exit(main())
