"""Stage hf_generate of bench/gpu_check.sh: the hf backend's serving mode on the GPU.

    python bench/gpu_check_generate.py --work DIR [--prompts 16] [--max-new-tokens 64]

A random Llama in bf16 (8 layers, hidden 512) behind the hf server in
``--mode generate`` (in this process, over HTTP as the generation workers call
it). Checks: (1) the same prompt and seed give the same ids twice (sampled at
temperature 0.8); (2) greedy output equals a one-pass teacher-forced argmax of
the full sequence at >= 90 % of positions (bf16 KV-cached decoding against a
full forward: near-ties may flip, a wrong position or cache would not match);
(3) generated tokens/s over ``--prompts`` requests, 4 in flight. Without a GPU
(dry run, none seen) the same path is rehearsed on the CPU at toy size and the
stage is ``skipped`` (not a measurement); a rehearsal that breaks is a ``fail``.
"""
from __future__ import annotations

import argparse
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "bench"))

from gpu_check_common import write_verdict  # noqa: E402
from gpu_check_stages import _cuda, _tiny_target  # noqa: E402

STAGE = "hf_generate"


def _run(root: Path, on_gpu: bool, prompts: int, max_new: int, hidden: int) -> dict:
    import torch

    from eagleflow.serving.client import generate_tokens
    from eagleflow.engines.hf.server import CaptureModel, CaptureServer
    model_dir = _tiny_target(root, layers=8, hidden=hidden)
    model = CaptureModel(str(model_dir), dtype="bfloat16", device="cuda" if on_gpu else "cpu")
    srv = CaptureServer(("127.0.0.1", 0), model, None, mode="generate")
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        rng = random.Random(0)
        reqs = [[rng.randrange(3, 500) for _ in range(rng.randrange(16, 200))] for _ in range(prompts)]

        def gen(ids, seed, temperature):
            return generate_tokens(srv.url, ids, "gpu-check", max_new_tokens=max_new, temperature=temperature,
                                   top_p=0.95, seed=seed, stop_token_ids=[], timeout_s=300)[0]
        same = all(gen(r, 7, 0.8) == gen(r, 7, 0.8) for r in reqs[:4])
        matched = total = 0
        for r in reqs[:4]:
            out = gen(r, 0, 0.0)
            with torch.inference_mode():
                logits = model.model(torch.tensor([r + out], device=model.device)).logits[0]
            pred = logits[len(r) - 1:len(r) + len(out) - 1].argmax(-1).tolist()
            matched += sum(int(a == b) for a, b in zip(pred, out))
            total += len(out)
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            n = sum(len(x) for x in pool.map(lambda r: gen(r, 1, 0.8), reqs))
        secs = time.perf_counter() - t0
    finally:
        srv.shutdown()
        srv.server_close()
    return {"device": str(model.device), "prompts": prompts, "max_new_tokens": max_new, "hidden": hidden,
            "same_ids_for_same_seed": same, "greedy_teacher_forced_match": round(matched / max(total, 1), 4),
            "tokens_generated": n, "seconds": round(secs, 3), "tokens_per_s": round(n / secs, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    on_gpu, why = _cuda()
    root = Path(a.work) / STAGE
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        fig = _run(root, on_gpu, *((a.prompts, a.max_new_tokens, 512) if on_gpu else (4, 8, 128)))
    except Exception as e:
        import traceback
        traceback.print_exc()
        return write_verdict(STAGE, "fail", f"{type(e).__name__}: {e}"[:2000])
    ok = fig["same_ids_for_same_seed"] and fig["greedy_teacher_forced_match"] >= 0.9
    reason = None if ok else (f"same seed gave the same ids: {fig['same_ids_for_same_seed']}; greedy matched a "
                              f"teacher-forced forward at {fig['greedy_teacher_forced_match']} of positions (need "
                              ">= 0.9)")
    if ok and not on_gpu:
        return write_verdict(STAGE, "skipped", f"{why}: needs a CUDA GPU; the serving path was rehearsed on the "
                             "CPU in bf16 at toy size (not a measurement)", rehearsal=fig)
    return write_verdict(STAGE, "pass" if ok else "fail", reason, **fig)


if __name__ == "__main__":
    sys.exit(main())
