"""What the evaluation phase costs beside plain decoding, and its held-out acceptance beside training's figure.

On a finished run (default: the newest ``runs/demo__*`` with an export; ``make demo`` makes one), the hf
backend's own pieces (eagleflow.evaluate.decoder / engines.hf.evaluator.measure), side by side in one process
on the same held-out prompts, nothing written to the run:

1. plain decoding: the target alone, greedy, every prompt (``greedy``; the evaluation's reference pass);
2. the evaluation: that reference plus, per ``eval.configs`` entry, speculative decoding of every prompt
   with the exported draft (``measure``).

Prints per configuration the held-out acceptance length, tokens/s with the draft and alone, and the
training-time simulated acceptance (the mean of the run's last 10 ``metrics.jsonl`` rows, over its
train.ttt_length positions: a figure of the training batches, not of decoding); then the evaluation's wall
seconds / plain decoding's wall seconds (the ratio: what evaluate_draft adds over decoding the prompts once).

    .venv/bin/python bench/eval.py [--run-dir runs/demo__...] [--prompts 8] [--max-new 48] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _newest_run() -> Path | None:
    runs = sorted((p for p in (REPO / "runs").glob("demo__*") if (p / "draft" / "export" / "config.json").is_file()),
                  key=lambda p: p.name)
    return runs[-1] if runs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import torch

    from eagleflow.config import load_config
    from eagleflow.corpus.prepare import read_eval_records
    from eagleflow.evaluate.decoder import DraftProposer, Target, greedy, load_draft, near_tie_threshold
    from eagleflow.engines.hf.evaluator import measure

    run = a.run_dir or _newest_run()
    if run is None or not (run / "run-config.json").is_file():
        print("bench/eval.py: no finished run with draft/export and run-config.json; run `make demo` or pass "
              "--run-dir", file=sys.stderr)
        return 2
    cfg = load_config(data=json.loads((run / "run-config.json").read_text()))
    torch.set_num_threads(1)
    target_dir = str(cfg.resolve(cfg.target_model))
    prompts = [{"id": r["id"], "prompt_ids": list(r["prompt_ids"])}
               for r in read_eval_records(run / "corpus") if r["prompt_ids"]][:a.prompts]
    if not prompts:
        print(f"bench/eval.py: {run}/corpus/eval.parquet holds no prompt", file=sys.stderr)
        return 2
    target = Target(target_dir, device="cpu", dtype=cfg.server.dtype)
    model, aux = load_draft(run / "draft" / "export", target_dir)
    proposer = DraftProposer(model, target.aux_layers(aux or cfg.capture.aux_layers), target.device)
    threshold = (lambda top: near_tie_threshold(target.dtype, top, cfg.eval.near_tie_logit_gap))

    greedy(target, prompts[0]["prompt_ids"], 4)   # warm-up (first-call allocations), timed by neither
    t0 = time.perf_counter()
    references = {p["id"]: greedy(target, p["prompt_ids"], a.max_new) for p in prompts}
    plain_s = time.perf_counter() - t0
    eval_s = plain_s   # the evaluation decodes the same references first
    rows = []
    for sc in cfg.eval.configs:
        t0 = time.perf_counter()
        m = measure(target, proposer, prompts, references, sc.steps, a.max_new, threshold)
        eval_s += time.perf_counter() - t0
        rows.append({"config": sc.label, **{k: m[k] for k in ("accept_length", "tokens_per_s",
                                                                "target_tokens_per_s", "speedup", "lossless")}})
    metrics = [json.loads(x) for x in (run / "draft" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    simulated = statistics.fmean(r["accept_length"] for r in metrics[-10:]) if metrics else None

    tokens = sum(len(r.tokens) for r in references.values())
    print(f"run {run.name}: {len(prompts)} held-out prompts, {tokens} tokens ({a.max_new} max each), target "
          f"{target.dtype} on CPU, 1 torch thread")
    print(f"{'config':<8} {'held-out accept len':>20} {'training simulated':>19} {'tok/s draft':>12} "
          f"{'tok/s alone':>12} {'speed-up':>9} {'lossless':>9}")
    for r in rows:
        sim = f"{simulated:.3f} (ttt {cfg.train.ttt_length})" if simulated is not None else "-"
        print(f"{r['config']:<8} {r['accept_length']:>20.3f} {sim:>19} {r['tokens_per_s']:>12.1f} "
              f"{r['target_tokens_per_s']:>12.1f} {r['speedup'] or 0:>9.2f} {'yes' if r['lossless'] else 'NO':>9}")
    ratio = eval_s / plain_s if plain_s else None
    print(f"evaluation {eval_s:.2f} s ({len(rows)} configurations + the reference) vs plain decoding "
          f"{plain_s:.2f} s: ratio {ratio:.2f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"run": run.name, "prompts": len(prompts), "tokens": tokens,
                                      "max_new": a.max_new, "rows": rows, "training_simulated": simulated,
                                      "ttt_length": cfg.train.ttt_length, "plain_s": round(plain_s, 3),
                                      "eval_s": round(eval_s, 3), "ratio": round(ratio, 3) if ratio else None},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
