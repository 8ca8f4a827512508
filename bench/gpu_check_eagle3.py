"""GPU check (run on a GPU node with sglang installed): our draft served by sglang as EAGLE-3.

What it proves, after bench/gpu_check_capture.py (whose kept folder it reuses;
a failed capture check is never re-run here):

1. `eagleflow train` trains the draft on the GPU on the hidden states the live
   sglang capture server stored, and `eagleflow export` writes it;
2. sglang.launch_server loads that export with the run report's own serve
   command (`--speculative-algorithm EAGLE3 ... --tp-size N`,
   eagleflow.console.run_report.serve_command) plus a port, a memory fraction
   and no CUDA graphs (`--cuda-graph-backend-{decode,prefill} disabled`: a
   fast start; graph capture only costs time here);
3. greedy completions of held-out prompts against the target served alone:
   each divergence is reported with the target's own top-1/top-2 logit gap at
   the first differing token (a transformers forward on the GPU); one at a
   near tie (gap within two bf16 steps of the top logit) is tolerated, any
   other fails the check;
4. the draft's tokens are really accepted: the accepted-draft counter sglang
   puts in meta_info (``spec_accept_token_num`` or, by version,
   ``spec_num_correct_drafts`` / ``spec_accepted_drafts``) summed over the
   prompts must be above 0. ``spec_accept_length`` (completion tokens / verify
   passes) is reported but is no test: a draft never accepted scores 64/63.

    python bench/gpu_check_eagle3.py --from DIR [--steps 200] [--prompts 8]

``--from``: a folder kept by `gpu_check_capture.py --keep DIR` whose verdict
passed. Exit 0 = PASS.
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

STAGE = "sglang_eagle3"
# fast start, in sglang 0.5.23's spelling (its --disable-cuda-graph is deprecated): no CUDA graph capture
FAST_START_ARGS = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
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
    """sglang.launch_server in its own process group; stopped by that group only (nothing else on the GPU)."""

    def __init__(self, argv: list[str], log: Path):
        self.port = free_port()
        self.argv = argv + ["--host", "127.0.0.1", "--port", str(self.port), "--mem-fraction-static", "0.3",
                            *FAST_START_ARGS]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        print("$", shlex.join(self.argv), flush=True)
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + READY_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited with {self.proc.returncode}:\n{self.log.read_text()[-6000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health_generate", timeout=30)
                return self
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"sglang not ready in {READY_S} s:\n{self.log.read_text()[-6000:]}")

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict:
        return http_json(f"http://127.0.0.1:{self.port}/generate",
                         {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                                      "ignore_eos": True}}, timeout=300)

    def info(self) -> dict:
        return http_json(f"http://127.0.0.1:{self.port}/get_server_info")

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", required=True, help="a folder kept by gpu_check_capture.py --keep")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    import torch
    import yaml
    if not torch.cuda.is_available():
        return write_verdict(STAGE, "fail", "torch sees no CUDA GPU here")
    t0 = time.time()
    root = Path(a.src)
    capture = (results_dir() or root) / "sglang_capture.json"
    capture_status = json.loads(capture.read_text()).get("status") if capture.is_file() else None
    if not (root / "config.yaml").is_file() or capture_status not in (None, "pass"):
        # never re-run a failed capture here: it costs the start-up again and fails the same way
        why = capture_status or f"no config.yaml in {root}"
        return write_verdict(STAGE, "skipped", f"the sglang capture check did not pass ({why}); not re-run")
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["train"] = {"device": "cuda", "max_steps": a.steps, "batch_size": 4, "draft_vocab_size": 256,
                    "checkpoint_every": a.steps, "log_every": 50}
    cfgp = root / "config-eagle3.yaml"
    cfgp.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "eagleflow.cli"]
    if run(cli + ["train", "--config", str(cfgp), "--run-id", "gpucheck"], 300).returncode != 0:
        return write_verdict(STAGE, "fail", "eagleflow train failed (its output is in this stage's log)")
    p = run(cli + ["export", "--config", str(cfgp), "--run-id", "gpucheck"], 120)
    if p.returncode != 0:
        return write_verdict(STAGE, "fail", "eagleflow export failed (its output is in this stage's log)")
    export = p.stdout.strip().splitlines()[-1]

    from eagleflow.config import load_config
    from eagleflow.console.run_report import serve_command
    from tests.fixtures.capture_corpus import write_corpus
    loaded = load_config(cfgp)
    vocab = json.loads((Path(loaded.target_model) / "config.json").read_text())["vocab_size"]
    prompts = [r["input_ids"][:48] for r in write_corpus(root / "heldout.parquet", a.prompts, vocab, seed=99,
                                                          min_len=16, max_len=64)]   # a seed the draft never saw
    serve = shlex.split(serve_command(loaded, export))
    serve[0] = sys.executable                   # this venv's python: the sglang this check is about
    target_only = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(loaded.target_model),
                   "--tp-size", str(loaded.capture.tp)] + (["--dtype", loaded.capture.dtype]
                                                           if loaded.capture.dtype != "auto" else [])
    try:
        with Server(target_only, root / "sglang-target.log") as s:
            want = [s.generate(ids, a.new_tokens) for ids in prompts]
        with Server(serve, root / "sglang-eagle3.log") as s:
            got = [s.generate(ids, a.new_tokens) for ids in prompts]
            info = s.info()
    except RuntimeError as e:
        return write_verdict(STAGE, "fail", str(e)[:4000])
    divergences, accepted, proposed, lengths, missing = [], 0, 0, [], 0
    for i, (ids, w, g) in enumerate(zip(prompts, want, got)):
        meta = g.get("meta_info", {})
        counts = accepted_drafts(meta)
        if counts is None:
            missing += 1
        else:
            accepted, proposed = accepted + counts[0], proposed + counts[1]
        lengths.append(meta.get("spec_accept_length"))
        wo, go = w.get("output_ids") or [], g.get("output_ids") or []
        if wo != go:
            d = logit_gap(str(loaded.target_model), ids, wo, go) if wo and go and len(wo) == len(go) else \
                {"position": None, "near_tie": False, "detail": f"lengths {len(wo)} vs {len(go)}"}
            divergences.append({"prompt": i, **d})
        print(f"prompt {i}: same greedy output {wo == go}; accepted drafts {counts}; accept length "
              f"{meta.get('spec_accept_length')}; verify passes {meta.get('spec_verify_ct')}; completion tokens "
              f"{meta.get('completion_tokens')}")
    states = info.get("internal_states") or [{}]
    measured = [x for x in lengths if isinstance(x, (int, float))]
    problems = []
    if missing:
        problems.append(f"{missing} of {len(got)} answers carry no accepted-draft counter (meta_info keys: "
                        f"{sorted(got[0].get('meta_info', {}))}); this sglang cannot show acceptance")
    elif accepted == 0:
        problems.append(f"no draft token accepted in {len(got)} prompts ({proposed} proposed)")
    hard = [d for d in divergences if not d.get("near_tie")]
    if hard:
        problems.append(f"{len(hard)} greedy divergence(s) from the target alone not at a near tie: {hard[:3]}")
    figures = {"prompts": len(prompts), "same_greedy_output": len(prompts) - len(divergences),
               "divergences": divergences, "accepted_drafts": accepted, "proposed_drafts": proposed,
               "accept_rate": accepted / proposed if proposed else None,
               "mean_accept_length": sum(measured) / len(measured) if measured else None,
               "server_avg_spec_accept_length": states[0].get("avg_spec_accept_length"),
               "serve_command": shlex.join(serve + FAST_START_ARGS), "train_steps": a.steps,
               "seconds": round(time.time() - t0, 1)}
    return write_verdict(STAGE, "fail" if problems else "pass", "; ".join(problems) or None, **figures)


if __name__ == "__main__":
    sys.exit(main())
