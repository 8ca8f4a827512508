"""Draft training throughput on CPU at the tiny size, and what the data path costs per step.

Measured side by side in one run, on the same synthetic stored hidden states
(written in the capture storage format, tiny demo target):

1. data path: reading + verifying + collating one micro-batch from the
   safetensors shards (HiddenStateLoader, no prefetch);
2. compute: one training step (target head, TTT forward/backward, AdamW) on
   batches already in memory;
3. end to end: `eagleflow.train.trainer.train` (prefetching loader) tokens/s.

Prints tokens/s and data path / compute step as a fraction.

    .venv/bin/python bench/train.py [--samples 96] [--steps 30] [--ttt 7] [--json bench/results/train.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from eagleflow.config import load_config  # noqa: E402
from eagleflow.demo_assets import ensure_demo_assets  # noqa: E402
from eagleflow.layout import RunLayout  # noqa: E402
from eagleflow.train.data import HiddenStateLoader, scan_samples  # noqa: E402
from eagleflow.train.loss import (TargetHead, TrainingTimeTest, load_target_head_and_embedding,  # noqa: E402
                                  target_batch)
from eagleflow.train.model import DraftConfig  # noqa: E402
from eagleflow.train.trainer import build_draft, train  # noqa: E402
from eagleflow.train.vocab import build_draft_vocab, count_loss_tokens  # noqa: E402
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 keeps numbers stable on a shared machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    assets = ensure_demo_assets(REPO / ".cache" / "test-assets", n_per_source=24)
    target = assets["target_model"]
    root = Path(tempfile.mkdtemp(prefix="eagleflow-bench-train-"))
    cfg = load_config(data={"run_root": str(root), "target_model": target,
                            "train": {"device": "cpu", "max_steps": a.steps, "batch_size": a.batch,
                                      "ttt_length": a.ttt, "draft_vocab_size": a.draft_vocab, "warmup_steps": 2,
                                      "checkpoint_every": 10_000, "log_every": 10_000}})
    layout = RunLayout.for_run(cfg, "bench")
    write_synthetic_hidden_states(layout.hidden_states_dir, target, samples=a.samples, min_len=a.min_len,
                                  max_len=a.max_len)
    refs = scan_samples(layout.hidden_states_dir, log=lambda _m: None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(refs)} samples, "
          f"{sum(r.tokens for r in refs):,} tokens, batch {a.batch}, ttt {a.ttt}, draft vocab {a.draft_vocab}")

    # 1. data path alone
    loader = HiddenStateLoader(refs, batch_size=a.batch, seed=0, prefetch=False)
    batches, data_times = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        b = loader.next_batch()
        data_times.append(time.perf_counter() - t0)
        batches.append(b)
    loader.close()

    # 2. compute alone, on the same batches held in memory
    dcfg = DraftConfig.from_target(target, a.draft_vocab)
    vocab = build_draft_vocab(count_loss_tokens(refs, dcfg.vocab_size), a.draft_vocab, log=lambda _m: None)
    head, embed = load_target_head_and_embedding(target)
    ttt = TrainingTimeTest(build_draft(dcfg, vocab, head, embed, seed=0), a.ttt)
    opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=1e-3)
    th = TargetHead(head, vocab.draft_ids, vocab.t2d)
    step_times, tokens = [], 0
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        tb = target_batch(th, b)
        loss, _ = ttt(b.input_ids, b.aux_hidden_states.float(), tb.probs, tb.top, tb.valid)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # skip warm-up steps
            step_times.append(time.perf_counter() - t0)
            tokens += b.num_tokens
    compute_tps = tokens / sum(step_times)

    # 3. the real trainer end to end (prefetching loader, metrics, heartbeat, final checkpoint)
    t0 = time.perf_counter()
    train(cfg, layout, log=lambda _m: None)
    wall = time.perf_counter() - t0
    from eagleflow.train.curves import read_metrics
    rows = read_metrics(Path(layout.draft_dir) / "metrics.jsonl")[2:]
    e2e_tps = sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["tokens_per_s"] for r in rows)

    data_med = statistics.median(data_times)
    step_med = statistics.median(step_times)
    print(f"data path (read+verify+collate one batch): median {1000 * data_med:.2f} ms")
    print(f"compute step (target head + TTT fwd/bwd + AdamW): median {1000 * step_med:.2f} ms, "
          f"{compute_tps:,.0f} tokens/s")
    print(f"trainer end to end: {e2e_tps:,.0f} tokens/s (steps only), {wall:.1f} s wall incl. setup")
    print(f"data path / compute step = {data_med / step_med:.3f}")
    print(f"end-to-end / compute-only tokens/s = {e2e_tps / compute_tps:.3f}")
    if a.json:
        import json
        Path(a.json).write_text(json.dumps({
            "threads": a.threads, "samples": len(refs), "batch": a.batch, "ttt": a.ttt, "draft_vocab": a.draft_vocab,
            "data_ms": 1000 * data_med, "compute_step_ms": 1000 * step_med, "compute_tokens_per_s": compute_tps,
            "trainer_tokens_per_s": e2e_tps, "data_fraction_of_step": data_med / step_med}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
