"""Draft training utilisation (issue 49): the step's FLOP/s as a fraction of this machine's own matmul
throughput, measured in the same run, and the fraction of each step spent waiting on data.

1. FLOP count: ``eagleflow.train.flops.draft_step_flops`` from the draft's shapes, TTT steps and each
   batch's padded length, forward + backward (printed with how it is derived, per part).
2. Matmul probe, a moment before each run of steps (and again after the last, to show the drift):
   ``torch.matmul`` at the draft's layer shapes (fc, qkv, o, gate+up, down, lm_head, target head;
   M = the batches' median padded tokens) in the training dtype (float32 on the CPU, as the trainer), and a
   large square matmul (``--square``) as the dense peak for reference; each shape's rate is the median of 7
   timed blocks, the aggregate one matmul of each shape (all their FLOPs over all their time).
3. The training step as the trainer runs it (``loader.next_batch().to``, target head, TTT forward/backward,
   clip, AdamW), for the plain loader (``prefetch=False``: reads in line) and the trainer's prefetching
   loader (a background thread reads the next batch while the step runs), each from the same seed, so their
   losses must be identical (checked). Per step: the time in ``next_batch().to`` (data wait) and the whole.

Before each run (plain and prefetching alternate ``--rounds`` times) the probe runs again, and that run's
ratio is against it. Prints, per run and as the median over rounds: tokens/s, data wait / step time, FLOP/s
(the median step's), utilisation = FLOP/s / same-shape matmul FLOP/s
(and / the square matmul's), tokens/s per GiB of peak memory (the process's peak RSS on the CPU; peak
allocated on a GPU).

    .venv/bin/python bench/train_utilisation.py [--steps 40] [--batch 4] [--ttt 7] [--threads 1] \
        [--json bench/results/train_utilisation.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import eagleflow.train  # noqa: E402,F401 - before torch: it turns on huge pages for the reader's buffers
import torch  # noqa: E402

from eagleflow.demo_assets import ensure_demo_assets  # noqa: E402
from eagleflow.train.data import HiddenStateLoader, scan_samples  # noqa: E402
from eagleflow.train.flops import draft_matmul_shapes, draft_step_flops  # noqa: E402
from eagleflow.train.loss import (TargetHead, TrainingTimeTest, load_target_head_and_embedding,  # noqa: E402
                                  target_batch)
from eagleflow.train.model import DraftConfig  # noqa: E402
from eagleflow.train.trainer import build_draft  # noqa: E402
from eagleflow.train.vocab import build_draft_vocab, count_loss_tokens  # noqa: E402
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_probe(shapes: list[tuple[str, int, int, int]], dtype: torch.dtype, device: torch.device,
                 min_s: float = 0.3, blocks: int = 7) -> dict[str, Any]:
    """FLOP/s of ``torch.matmul`` at each (name, M, K, N): the median rate of ``blocks`` blocks of at least
    ``min_s / blocks`` seconds each (a shared machine preempts some blocks: the median is the rate when the
    process has its core, as the median step below), and the aggregate: one matmul of each shape, all their
    FLOPs over all their time at those rates."""
    g = torch.Generator(device="cpu").manual_seed(0)
    per: dict[str, float] = {}
    flops_sum = time_sum = 0.0
    for name, m, k, n in shapes:
        a = torch.randn(m, k, generator=g).to(device, dtype)
        b = torch.randn(k, n, generator=g).to(device, dtype)
        for _ in range(3):
            torch.matmul(a, b)
        _sync(device)
        f = 2.0 * m * k * n
        rates = []
        for _ in range(blocks):
            reps, el = 0, 0.0
            t0 = time.perf_counter()
            while el < min_s / blocks:
                torch.matmul(a, b)
                reps += 1
                if reps % 8 == 0 or device.type != "cuda":
                    _sync(device)
                    el = time.perf_counter() - t0
            _sync(device)
            rates.append(f * reps / (time.perf_counter() - t0))
        per[name] = statistics.median(rates)
        flops_sum += f
        time_sum += f / per[name]
    return {"per_shape_flops_per_s": per, "flops_per_s": flops_sum / time_sum}


def run_steps(a, refs, dcfg, vocab, head, embed, device, dtype, prefetch: bool) -> dict[str, Any]:
    loader = HiddenStateLoader(refs, batch_size=a.batch, seed=0, prefetch=prefetch)
    ttt = TrainingTimeTest(build_draft(dcfg, vocab, head, embed, seed=0), a.ttt).to(device)
    params = [p for p in ttt.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    th = TargetHead(head, vocab.draft_ids, vocab.t2d).to(device, dtype)
    waits, steps, flops, draft_flops, tokens, padded, losses = [], [], [], [], [], [], []
    ready = 0   # steps whose batch the prefetch thread had finished before the step asked for it
    try:
        for i in range(a.steps + a.warmup):
            ahead = loader._ahead
            was_ready = ahead is not None and ahead[1].done()
            t0 = time.perf_counter()
            b = loader.next_batch().to(device, dtype)
            _sync(device)
            t1 = time.perf_counter()
            tb = target_batch(th, b)
            loss, _ = ttt(b.input_ids, b.aux_hidden_states, tb.probs, tb.top, tb.valid)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))   # syncs the device
            t2 = time.perf_counter()
            if i < a.warmup:
                continue
            bsz, t = b.input_ids.shape
            f = draft_step_flops(dcfg, bsz, t, a.ttt)
            ready += was_ready
            waits.append(t1 - t0)
            steps.append(t2 - t0)
            flops.append(f.total)
            draft_flops.append(f.draft)
            tokens.append(b.num_tokens)
            padded.append(bsz * t)
            del b, tb, loss
    finally:
        loader.close()
    return {"prefetch": prefetch, "steps": len(steps), "step_s_total": sum(steps), "wait_s_total": sum(waits),
            "step_ms_median": 1000 * statistics.median(steps), "wait_ms_median": 1000 * statistics.median(waits),
            "data_fraction_of_step": sum(waits) / sum(steps), "tokens": sum(tokens), "padded_tokens": sum(padded),
            "tokens_per_s": sum(tokens) / sum(steps), "flops": sum(flops), "draft_flops": sum(draft_flops),
            # the median step's rate (robust to a preempted step, as the probe's median block)
            "flops_per_s": statistics.median(f / t for f, t in zip(flops, steps)),
            "draft_flops_per_s": statistics.median(f / t for f, t in zip(draft_flops, steps)),
            "flops_per_s_over_total_time": sum(flops) / sum(steps),
            "batches_ready_when_asked": ready, "losses": losses}


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30, "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30, "process peak RSS (ru_maxrss)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per loader (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--square", type=int, default=1024, help="the reference square matmul's size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=2, help="plain and prefetching runs alternate this many times")
    ap.add_argument("--probe-s", type=float, default=0.7, help="seconds each matmul shape is timed (7 blocks)")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    load_before = os.getloadavg()

    assets = ensure_demo_assets(REPO / ".cache" / "test-assets", n_per_source=24)
    target = assets["target_model"]
    root = Path(tempfile.mkdtemp(prefix="eagleflow-bench-util-"))
    write_synthetic_hidden_states(root / "hs", target, samples=a.samples, min_len=a.min_len, max_len=a.max_len)
    refs = scan_samples(root / "hs", log=lambda _m: None)
    dcfg = DraftConfig.from_target(target, a.draft_vocab)
    vocab = build_draft_vocab(count_loss_tokens(refs, dcfg.vocab_size), a.draft_vocab, log=lambda _m: None)
    head, embed = load_target_head_and_embedding(target)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}, {dtype}; os.cpu_count() "
          f"{os.cpu_count()}, load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    print(f"draft: H {dcfg.hidden_size}, I {dcfg.intermediate_size}, heads {dcfg.num_attention_heads} x "
          f"{dcfg.head_dim} ({dcfg.num_key_value_heads} KV), aux {dcfg.aux_width}, draft vocab "
          f"{dcfg.draft_vocab_size}, target vocab {dcfg.vocab_size}; TTT {a.ttt}; {len(refs)} samples of "
          f"{a.min_len}-{a.max_len} tokens, batch {a.batch}")

    # the padded length the probe uses: the median over the batches the steps will see
    plan = HiddenStateLoader(refs, batch_size=a.batch, seed=0, prefetch=False)
    lens = []
    for _ in range(a.steps + a.warmup):
        b = plan.next_batch()
        lens.append(b.input_ids.shape[1])
    plan.close()
    t_med = int(statistics.median(lens))
    f = draft_step_flops(dcfg, a.batch, t_med, a.ttt)
    fwd = draft_step_flops(dcfg, a.batch, t_med, a.ttt, backward=False)
    print(f"\nFLOPs of one step at B {a.batch} x T {t_med} (median padded length), forward -> forward+backward:")
    for part in ("fc", "projections", "mlp", "attention_matmul", "attention_diagonal", "lm_head", "target_head"):
        print(f"  {part:19s} {getattr(fwd, part) / 1e6:10.2f} -> {getattr(f, part) / 1e6:10.2f} MFLOP")
    print(f"  draft (fwd+bwd) {f.draft / 1e6:.2f} MFLOP + target head (fwd only) {f.target_head / 1e6:.2f} = "
          f"{f.total / 1e6:.2f} MFLOP a step; {f.total / (a.batch * t_med) / 1e6:.3f} MFLOP a padded token "
          f"(eagleflow.train.flops: fc 2x fwd, every other matmul 3x fwd; T x T attention unhalved)")

    shapes = draft_matmul_shapes(dcfg, a.batch * t_med)
    runs: list[dict[str, Any]] = []
    first_probe = None
    # plain and prefetching loaders alternate for --rounds rounds; each run's ratio is against the matmul
    # probe taken just before it (a shared machine's load drifts between minutes)
    for rnd in range(a.rounds):
        for p in (False, True):
            probe = matmul_probe(shapes, dtype, device, a.probe_s)
            square = matmul_probe([("square", a.square, a.square, a.square)], dtype, device,
                                  a.probe_s)["flops_per_s"]
            if first_probe is None:
                first_probe = probe
            print(f"\nround {rnd}, matmul probe ({dtype}, M = {a.batch * t_med}): draft shapes "
                  f"{probe['flops_per_s'] / 1e9:.2f} GFLOP/s (" + ", ".join(
                      f"{k} {v / 1e9:.2f}" for k, v in probe["per_shape_flops_per_s"].items())
                  + f"); square {a.square}^3 {square / 1e9:.2f} GFLOP/s; load {os.getloadavg()[0]:.2f}")
            r = run_steps(a, refs, dcfg, vocab, head, embed, device, dtype, prefetch=p)
            r.update(round=rnd, matmul_flops_per_s=probe["flops_per_s"], square_flops_per_s=square,
                     matmul_per_shape=probe["per_shape_flops_per_s"],
                     utilisation_vs_draft_shapes=r["flops_per_s"] / probe["flops_per_s"],
                     draft_utilisation_vs_draft_shapes=r["draft_flops_per_s"] / probe["flops_per_s"],
                     utilisation_vs_square=r["flops_per_s"] / square)
            print(f"{'prefetching' if p else 'plain':11s} loader: {r['tokens_per_s']:,.0f} tokens/s "
                  f"(median step {r['step_ms_median']:.1f} ms), data wait {r['data_fraction_of_step']:.3f} of "
                  f"step time (median wait {r['wait_ms_median']:.2f} ms); {r['flops_per_s'] / 1e9:.2f} GFLOP/s "
                  f"= **{r['utilisation_vs_draft_shapes']:.3f}** of the matmul at the draft's shapes just before "
                  f"(draft only {r['draft_utilisation_vs_draft_shapes']:.3f}), {r['utilisation_vs_square']:.3f} "
                  f"of the square matmul; padding {1 - r['tokens'] / r['padded_tokens']:.3f} of the computed "
                  f"tokens; {r['batches_ready_when_asked']}/{r['steps']} batches read ahead and ready when asked")
            runs.append(r)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak, peak_how = peak_memory_gib(device)
    after = matmul_probe(shapes, dtype, device, a.probe_s)
    load_after = os.getloadavg()
    print(f"\nmatmul probe after the last run: draft shapes {after['flops_per_s'] / 1e9:.2f} GFLOP/s; load average "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    same = all(r["losses"] == runs[0]["losses"] for r in runs)
    print(f"losses of the {len(runs[0]['losses'])} steps, every run (plain and prefetching loader): "
          f"{'identical' if same else 'DIFFERENT'}")
    print(f"peak memory ({peak_how}): {peak:.3f} GiB")
    summary: dict[str, dict[str, float]] = {}
    for p in (False, True):
        rs = [r for r in runs if r["prefetch"] == p]
        for r in rs:
            r["tokens_per_s_per_gib"] = r["tokens_per_s"] / peak
        s = {k: statistics.median(r[k] for r in rs) for k in (
            "utilisation_vs_draft_shapes", "draft_utilisation_vs_draft_shapes", "utilisation_vs_square",
            "data_fraction_of_step", "tokens_per_s", "tokens_per_s_per_gib", "flops_per_s",
            "matmul_flops_per_s")}
        summary["prefetch" if p else "plain"] = s
        print(f"{'prefetching' if p else 'plain':11s} loader, median of {len(rs)} rounds: utilisation "
              f"**{s['utilisation_vs_draft_shapes']:.3f}** of matmul at the draft's shapes "
              f"(each a median over the runs: step {s['flops_per_s'] / 1e9:.2f}, probe "
              f"{s['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s; draft only "
              f"{s['draft_utilisation_vs_draft_shapes']:.3f}; {s['utilisation_vs_square']:.3f} of the square), "
              f"data wait {s['data_fraction_of_step']:.3f} of step time, {s['tokens_per_s']:,.0f} tokens/s, "
              f"{s['tokens_per_s_per_gib']:,.0f} tokens/s per GiB of peak memory")
    if a.json:
        out = {"torch": torch.__version__, "threads": a.threads, "device": str(device), "dtype": str(dtype),
               "cpu_count": os.cpu_count(), "load_before": load_before, "load_after": load_after,
               "batch": a.batch, "ttt": a.ttt, "samples": len(refs), "median_padded_len": t_med,
               "flops_at_median": f.as_dict(), "flops_forward_at_median": fwd.as_dict(),
               "matmul_first": first_probe, "matmul_after": after, "square": a.square, "rounds": a.rounds,
               "summary": summary,
               "peak_memory_gib": peak, "peak_memory_how": peak_how, "losses_identical": same,
               "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs]}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    import shutil
    shutil.rmtree(root, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
