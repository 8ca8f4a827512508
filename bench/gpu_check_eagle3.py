"""GPU check (prepared, run on a GPU node with sglang installed): our draft served by sglang as EAGLE-3.

What it proves, after bench/gpu_check_capture.py (whose kept folder it reuses):

1. `eagleflow train` trains the draft on the GPU on the hidden states the live
   sglang capture server stored, and `eagleflow export` writes it;
2. sglang.launch_server loads that export with the run report's own serve
   command (`--speculative-algorithm EAGLE3 --speculative-draft-model-path ...`,
   eagleflow.console.run_report.serve_command) plus a port and a memory fraction;
3. greedy completions of held-out prompts are token for token those of the
   target served alone (speculative decoding must not change greedy output);
4. the acceptance length: per request sglang's meta_info ``spec_accept_length``
   (completion tokens / verify passes, sglang tokenizer_manager.py), and the
   server's ``avg_spec_accept_length`` (/get_server_info internal_states).

PASS: the draft loads, the completions are equal, and the mean acceptance
length is above 1.0 (the draft's tokens are accepted at least sometimes; on a
tiny random target the number says little about a real one).

    python bench/gpu_check_eagle3.py [--from DIR] [--steps 400] [--prompts 8] [--keep DIR]

``--from``: a folder kept by `gpu_check_capture.py --keep DIR` (otherwise that
check runs here first, into a temporary folder). Exit 0 = PASS.
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
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_check_capture import report_verdict  # noqa: E402  (the verdict file every GPU check writes)


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
        self.argv = argv + ["--host", "127.0.0.1", "--port", str(self.port), "--mem-fraction-static", "0.3"]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        print("$", shlex.join(self.argv), flush=True)
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited with {self.proc.returncode}:\n{self.log.read_text()[-6000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health_generate", timeout=30)
                return self
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"sglang not ready in 900 s:\n{self.log.read_text()[-6000:]}")

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", help="a folder kept by gpu_check_capture.py --keep")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    import torch
    import yaml
    if not torch.cuda.is_available():
        print("gpu_check_eagle3: torch sees no CUDA GPU here; run this on a GPU node")
        return report_verdict("eagle3", {"pass": False, "error": "no CUDA GPU"})
    t0 = time.time()
    root = Path(a.src) if a.src else Path(tempfile.mkdtemp(prefix="eagleflow-gpu-check-eagle3-"))
    if not (root / "config.yaml").is_file():
        p = run([sys.executable, str(REPO / "bench" / "gpu_check_capture.py"), "--keep", str(root),
                 "--samples", "64"], 1800)
        if p.returncode != 0:
            return report_verdict("eagle3", {"pass": False, "error": f"the capture check failed (exit {p.returncode})"})
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["train"] = {"device": "cuda", "max_steps": a.steps, "batch_size": 4, "draft_vocab_size": 256,
                    "checkpoint_every": a.steps, "log_every": 50}
    cfgp = root / "config-eagle3.yaml"
    cfgp.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "eagleflow.cli"]
    if run(cli + ["train", "--config", str(cfgp), "--run-id", "gpucheck"], 1800).returncode != 0:
        return report_verdict("eagle3", {"pass": False, "error": "eagleflow train failed"})
    p = run(cli + ["export", "--config", str(cfgp), "--run-id", "gpucheck"], 600)
    if p.returncode != 0:
        return report_verdict("eagle3", {"pass": False, "error": "eagleflow export failed"})
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
                   "--tp", str(loaded.capture.tp)] + (["--dtype", loaded.capture.dtype]
                                                      if loaded.capture.dtype != "auto" else [])
    try:
        with Server(target_only, root / "sglang-target.log") as s:
            want = [s.generate(ids, a.new_tokens) for ids in prompts]
        with Server(serve, root / "sglang-eagle3.log") as s:
            got = [s.generate(ids, a.new_tokens) for ids in prompts]
            info = s.info()
    except RuntimeError as e:
        print(e)
        return report_verdict("eagle3", {"pass": False, "error": str(e)[:4000]})
    same = [w.get("output_ids", w.get("text")) == g.get("output_ids", g.get("text")) for w, g in zip(want, got)]
    lengths = [g["meta_info"].get("spec_accept_length") for g in got]
    states = info.get("internal_states") or [{}]
    avg = states[0].get("avg_spec_accept_length")
    measured = [x for x in lengths if isinstance(x, (int, float))]
    mean = sum(measured) / len(measured) if measured else None
    for i, (ok, g) in enumerate(zip(same, got)):
        print(f"prompt {i}: same greedy output {ok}; accept length {g['meta_info'].get('spec_accept_length')}; "
              f"verify passes {g['meta_info'].get('spec_verify_ct')}; completion tokens "
              f"{g['meta_info'].get('completion_tokens')}")
    verdict = {"pass": all(same) and mean is not None and mean > 1.0, "prompts": len(prompts),
               "same_greedy_output": sum(same), "mean_accept_length": mean, "server_avg_spec_accept_length": avg,
               "serve_command": shlex.join(serve), "train_steps": a.steps, "seconds": round(time.time() - t0, 1)}
    print(("PASS " if verdict["pass"] else "FAIL ") + json.dumps(verdict))
    return report_verdict("eagle3", verdict)


if __name__ == "__main__":
    sys.exit(main())
