"""Draft training utilisation (issue 49): the step's FLOP/s as a fraction of this machine's own matmul
throughput, measured in the same run, and the fraction of each step spent waiting on data.

1. FLOP count: ``eagleflow.train.flops.draft_step_flops`` from the draft's shapes, TTT steps and each
   batch's padded length, forward + backward (printed with how it is derived, per part).
2. Matmul probe, a moment before each round of steps (and again after the last, to show the drift):
   ``torch.matmul`` at the draft's layer shapes (fc, qkv, o, gate+up, down, lm_head, target head;
   M = the batches' median padded tokens) in the training dtype (float32 on the CPU, as the trainer), and a
   large square matmul (``--square``) as the dense peak for reference; each shape's rate is the median of 7
   timed blocks, the aggregate one matmul of each shape (all their FLOPs over all their time).
3. The training step as the trainer runs it (``loader.next_batch().to``, target head, TTT forward/backward,
   clip, AdamW) in three variants, each its own loader, draft and optimizer from the same seed, their steps
   alternating one by one (so a shared machine's load falls on all alike): ``plain`` (the plain step,
   ``prefetch=False``: reads in line) -- the before; ``prefetch`` (the plain step, the trainer's prefetching
   loader: a background thread reads the next batch while the step runs), whose losses must equal the plain
   run's (checked); ``fast`` (``TrainingTimeTest(fast=True)``, i.e. ``train.fast_step``, with the prefetching
   loader) -- the after, its losses within 1e-4 relative of the plain run's (checked); with ``--compile`` also
   ``compiled`` (``train.compile``). Per step: the time in ``next_batch().to`` (data wait), the whole, and the
   main thread's CPU time (torch at 1 thread works on it).

The probe runs before each round. Prints, per variant and round and as the median over rounds: tokens/s, data
wait / step time, FLOP/s (the median step's), utilisation = FLOP/s / same-shape matmul FLOP/s (and / the
square matmul's; and both by CPU time, which leaves out the time the VM's other jobs took), tokens/s per GiB of
peak memory (the process's peak RSS on the CPU; peak allocated on a GPU); then before -> after.

    .venv/bin/python bench/train_utilisation.py [--steps 40] [--batch 4] [--ttt 7] [--threads 1] \
        [--json bench/results/train_utilisation.json]
"""
from __future__ import annotations

import argparse
import contextlib
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


# (name, prefetching loader, fast step, compiled layer); "plain" is the before, "fast" the after
VARIANTS = [("plain", False, False, False), ("prefetch", True, False, False), ("fast", True, True, False),
            ("compiled", True, True, True)]
FAST_LOSS_RTOL = 1e-4   # the fast step's losses against the plain step's, over the run's optimizer steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_probe(shapes: list[tuple[str, int, int, int]], dtype: torch.dtype, device: torch.device,
                 min_s: float = 0.3, blocks: int = 7) -> dict[str, Any]:
    """FLOP/s of ``torch.matmul`` at each (name, M, K, N): the median rate of ``blocks`` blocks of at least
    ``min_s / blocks`` seconds each (a shared machine preempts some blocks: the median is the rate when the
    process has its core, as the median step below), and the aggregate: one matmul of each shape, all their
    FLOPs over all their time at those rates. On a CPU also the same by the thread's CPU time
    (``cpu_flops_per_s``: a preempted block's lost time does not count; torch runs on this thread at 1 thread)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    per: dict[str, float] = {}
    per_cpu: dict[str, float] = {}
    flops_sum = time_sum = cpu_sum = 0.0
    for name, m, k, n in shapes:
        a = torch.randn(m, k, generator=g).to(device, dtype)
        b = torch.randn(k, n, generator=g).to(device, dtype)
        for _ in range(3):
            torch.matmul(a, b)
        _sync(device)
        f = 2.0 * m * k * n
        rates, cpu_rates = [], []
        for _ in range(blocks):
            reps, el = 0, 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            while el < min_s / blocks:
                torch.matmul(a, b)
                reps += 1
                if reps % 8 == 0 or device.type != "cuda":
                    _sync(device)
                    el = time.perf_counter() - t0
            _sync(device)
            rates.append(f * reps / (time.perf_counter() - t0))
            cpu_rates.append(f * reps / max(time.thread_time() - c0, 1e-9))
        per[name] = statistics.median(rates)
        per_cpu[name] = statistics.median(cpu_rates)
        flops_sum += f
        time_sum += f / per[name]
        cpu_sum += f / per_cpu[name]
    return {"per_shape_flops_per_s": per, "flops_per_s": flops_sum / time_sum,
            "cpu_per_shape_flops_per_s": per_cpu, "cpu_flops_per_s": flops_sum / cpu_sum}


class Runner:
    """One variant's training (its own loader, draft, optimizer from the same seed), a step at a time, so the
    variants' steps can alternate one by one: load on a shared machine then falls on all of them alike."""

    def __init__(self, a, refs, dcfg, vocab, head, embed, device, dtype, prefetch: bool, fast: bool = False,
                 compile: bool = False):
        self.a, self.dcfg, self.device, self.dtype = a, dcfg, device, dtype
        self.prefetch, self.fast, self.compile = prefetch, fast or compile, compile
        self.loader = HiddenStateLoader(refs, batch_size=a.batch, seed=0, prefetch=prefetch)
        self.ttt = TrainingTimeTest(build_draft(dcfg, vocab, head, embed, seed=0), a.ttt, fast=fast or compile,
                                    compile=compile).to(device)
        self.params = [p for p in self.ttt.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)
        self.th = TargetHead(head, vocab.draft_ids, vocab.t2d).to(device, dtype)
        # as the trainer: bfloat16 autocast on a GPU, float32 on the CPU
        self.autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                         else contextlib.nullcontext)
        self.i = 0
        self.rec: dict[str, list] = {k: [] for k in ("wait", "step", "cpu", "flops", "draft_flops", "tokens",
                                                     "padded")}
        self.losses: list[float] = []
        self.ready = 0   # steps whose batch the prefetch thread had finished before the step asked for it

    def step(self) -> None:
        a, device = self.a, self.device
        ahead = self.loader._ahead
        was_ready = ahead is not None and ahead[1].done()
        t0, c0 = time.perf_counter(), time.thread_time()
        b = self.loader.next_batch().to(device, self.dtype)
        _sync(device)
        t1 = time.perf_counter()
        tb = target_batch(self.th, b)
        with self.autocast():
            loss, _ = self.ttt(b.input_ids, b.aux_hidden_states, tb.probs, tb.top, tb.valid)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))   # syncs the device
        t2, c2 = time.perf_counter(), time.thread_time()
        self.i += 1
        if self.i <= a.warmup:
            return
        bsz, t = b.input_ids.shape
        f = draft_step_flops(self.dcfg, bsz, t, a.ttt)
        self.ready += was_ready
        for k, x in (("wait", t1 - t0), ("step", t2 - t0), ("cpu", max(c2 - c0, 1e-9)), ("flops", f.total),
                     ("draft_flops", f.draft), ("tokens", b.num_tokens), ("padded", bsz * t)):
            self.rec[k].append(x)

    def result(self) -> dict[str, Any]:
        self.loader.close()
        r = self.rec
        steps, flops = r["step"], r["flops"]
        return {"prefetch": self.prefetch, "fast": self.fast, "compile": self.compile,
                "compile_error": self.ttt.compile_error, "steps": len(steps), "step_s_total": sum(steps),
                "wait_s_total": sum(r["wait"]), "step_ms_median": 1000 * statistics.median(steps),
                "step_cpu_ms_median": 1000 * statistics.median(r["cpu"]),
                "wait_ms_median": 1000 * statistics.median(r["wait"]),
                "data_fraction_of_step": sum(r["wait"]) / sum(steps), "tokens": sum(r["tokens"]),
                "padded_tokens": sum(r["padded"]), "tokens_per_s": sum(r["tokens"]) / sum(steps),
                "flops": sum(flops), "draft_flops": sum(r["draft_flops"]),
                # the median step's rate (robust to a preempted step, as the probe's median block)
                "flops_per_s": statistics.median(f / t for f, t in zip(flops, steps)),
                "draft_flops_per_s": statistics.median(f / t for f, t in zip(r["draft_flops"], steps)),
                "flops_per_s_over_total_time": sum(flops) / sum(steps),
                # by the main thread's CPU time (the step's torch work; the prefetch thread's is not in it)
                "cpu_flops_per_s": statistics.median(f / c for f, c in zip(flops, r["cpu"])),
                "batches_ready_when_asked": self.ready, "losses": self.losses}


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
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the variants (each after a matmul probe)")
    ap.add_argument("--probe-s", type=float, default=0.7, help="seconds each matmul shape is timed (7 blocks)")
    ap.add_argument("--compile", action="store_true", help="also run the fast step with torch.compile")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the device's published dense peak (TFLOP/s, training dtype) to report a fraction of")
    ap.add_argument("--hidden", type=int, default=0, help="a draft of these dims instead of the demo target's "
                    "(with --intermediate, --heads, --kv-heads, --head-dim, --vocab): the GPU check's 8B shape")
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--heads", type=int, default=0)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=0)
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
    # the variants alternate for --rounds rounds; each run's ratio is against the matmul probe taken just
    # before it (a shared machine's load drifts between minutes). before = the plain step with the plain
    # loader; after = the fast step (TrainingTimeTest(fast=True)) with the trainer's prefetching loader.
    variants = [v for v in VARIANTS if v[0] != "compiled" or a.compile]
    for rnd in range(a.rounds):
        probe = matmul_probe(shapes, dtype, device, a.probe_s)
        square = matmul_probe([("square", a.square, a.square, a.square)], dtype, device, a.probe_s)["flops_per_s"]
        if first_probe is None:
            first_probe = probe
        print(f"\nround {rnd}, matmul probe ({dtype}, M = {a.batch * t_med}): draft shapes "
              f"{probe['flops_per_s'] / 1e9:.2f} GFLOP/s (" + ", ".join(
                  f"{k} {v / 1e9:.2f}" for k, v in probe["per_shape_flops_per_s"].items())
              + f"); by CPU time {probe['cpu_flops_per_s'] / 1e9:.2f}; square {a.square}^3 {square / 1e9:.2f} "
              f"GFLOP/s; load {os.getloadavg()[0]:.2f}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runners = {name: Runner(a, refs, dcfg, vocab, head, embed, device, dtype, prefetch=p, fast=fast,
                                compile=comp) for name, p, fast, comp in variants}
        # the variants' steps alternate one by one (each its own loader, draft and optimizer)
        for _ in range(a.steps + a.warmup):
            for rn in runners.values():
                rn.step()
        for name, p, fast, comp in variants:
            r = runners[name].result()
            r.update(variant=name, round=rnd, matmul_flops_per_s=probe["flops_per_s"], square_flops_per_s=square,
                     matmul_per_shape=probe["per_shape_flops_per_s"], matmul_cpu_flops_per_s=probe["cpu_flops_per_s"],
                     utilisation_vs_draft_shapes=r["flops_per_s"] / probe["flops_per_s"],
                     draft_utilisation_vs_draft_shapes=r["draft_flops_per_s"] / probe["flops_per_s"],
                     utilisation_vs_square=r["flops_per_s"] / square,
                     cpu_utilisation_vs_draft_shapes=r["cpu_flops_per_s"] / probe["cpu_flops_per_s"])
            if device.type == "cuda":
                r["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
            print(f"{name:8s} ({'prefetching' if p else 'plain'} loader, {'fast' if fast else 'plain'} step"
                  f"{', compiled' if comp else ''}): {r['tokens_per_s']:,.0f} tokens/s "
                  f"(median step {r['step_ms_median']:.1f} ms, {r['step_cpu_ms_median']:.1f} ms CPU), data wait "
                  f"{r['data_fraction_of_step']:.3f} of step time (median wait {r['wait_ms_median']:.2f} ms); "
                  f"{r['flops_per_s'] / 1e9:.2f} GFLOP/s = **{r['utilisation_vs_draft_shapes']:.3f}** of the "
                  f"matmul at the draft's shapes (draft only {r['draft_utilisation_vs_draft_shapes']:.3f}; by CPU "
                  f"time {r['cpu_utilisation_vs_draft_shapes']:.3f}), {r['utilisation_vs_square']:.3f} of the "
                  f"square matmul; padding {1 - r['tokens'] / r['padded_tokens']:.3f} of the computed tokens; "
                  f"{r['batches_ready_when_asked']}/{r['steps']} batches read ahead and ready when asked"
                  + (f"; compile failed, ran eagerly: {r['compile_error']}" if r["compile_error"] else ""))
            runs.append(r)
        del runners
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak, peak_how = peak_memory_gib(device)
    after = matmul_probe(shapes, dtype, device, a.probe_s)
    load_after = os.getloadavg()
    print(f"\nmatmul probe after the last run: draft shapes {after['flops_per_s'] / 1e9:.2f} GFLOP/s; load average "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    plain_runs = [r for r in runs if not r["fast"]]
    same = all(r["losses"] == plain_runs[0]["losses"] for r in plain_runs)
    print(f"losses of the {len(runs[0]['losses'])} steps, every plain-step run (plain and prefetching loader): "
          f"{'identical' if same else 'DIFFERENT'}")
    ref = plain_runs[0]["losses"]
    fast_rel = max((abs(x - y) / max(abs(y), 1e-30) for r in runs if r["fast"] for x, y in zip(r["losses"], ref)),
                   default=0.0)
    fast_ok = fast_rel <= FAST_LOSS_RTOL
    print(f"losses of the fast-step runs against the plain step's: largest relative difference {fast_rel:.2e} "
          f"over {len(ref)} optimizer steps ({'within' if fast_ok else 'OVER'} {FAST_LOSS_RTOL:g})")
    print(f"peak memory ({peak_how}): {peak:.3f} GiB")
    summary: dict[str, dict[str, float]] = {}
    for name, *_ in variants:
        rs = [r for r in runs if r["variant"] == name]
        for r in rs:
            r["tokens_per_s_per_gib"] = r["tokens_per_s"] / r.get("peak_memory_gib", peak)
        s = {k: statistics.median(r[k] for r in rs) for k in (
            "utilisation_vs_draft_shapes", "draft_utilisation_vs_draft_shapes", "utilisation_vs_square",
            "data_fraction_of_step", "tokens_per_s", "tokens_per_s_per_gib", "flops_per_s",
            "matmul_flops_per_s", "step_ms_median", "step_cpu_ms_median", "cpu_utilisation_vs_draft_shapes")}
        summary[name] = s
        print(f"{name:8s} median of {len(rs)} rounds: utilisation "
              f"**{s['utilisation_vs_draft_shapes']:.3f}** of matmul at the draft's shapes "
              f"(each a median over the runs: step {s['flops_per_s'] / 1e9:.2f}, probe "
              f"{s['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s; draft only "
              f"{s['draft_utilisation_vs_draft_shapes']:.3f}; {s['utilisation_vs_square']:.3f} of the square), "
              f"data wait {s['data_fraction_of_step']:.3f} of step time, {s['tokens_per_s']:,.0f} tokens/s, "
              f"{s['tokens_per_s_per_gib']:,.0f} tokens/s per GiB of peak memory")
    b, f_ = summary["plain"], summary["fast"]
    print(f"\nbefore -> after (plain step + plain loader -> fast step + prefetching loader, medians of "
          f"{a.rounds} rounds, same run):")
    print(f"  utilisation (step FLOP/s / same-shape matmul FLOP/s): {b['utilisation_vs_draft_shapes']:.3f} -> "
          f"{f_['utilisation_vs_draft_shapes']:.3f}")
    print(f"  the same by CPU time (preemption out of both):       {b['cpu_utilisation_vs_draft_shapes']:.3f} -> "
          f"{f_['cpu_utilisation_vs_draft_shapes']:.3f}")
    print(f"  median step, wall / CPU ms:                         {b['step_ms_median']:.1f} / "
          f"{b['step_cpu_ms_median']:.1f} -> {f_['step_ms_median']:.1f} / {f_['step_cpu_ms_median']:.1f}")
    print(f"  data wait / step time:                              {b['data_fraction_of_step']:.3f} -> "
          f"{f_['data_fraction_of_step']:.3f} (goal after: under 0.05)")
    print(f"  tokens/s:                                           {b['tokens_per_s']:,.0f} -> {f_['tokens_per_s']:,.0f}"
          f" ({f_['tokens_per_s'] / b['tokens_per_s']:.2f}x)")
    if device.type == "cuda" and a.peak_tflops:
        for name, s in summary.items():
            s["fraction_of_published_peak"] = s["flops_per_s"] / (a.peak_tflops * 1e12)
        print(f"  fraction of the device's dense peak ({a.peak_tflops:g} TFLOP/s): "
              f"{b['fraction_of_published_peak']:.3f} -> {f_['fraction_of_published_peak']:.3f}")
    if a.json:
        out = {"torch": torch.__version__, "threads": a.threads, "device": str(device), "dtype": str(dtype),
               "cpu_count": os.cpu_count(), "load_before": load_before, "load_after": load_after,
               "batch": a.batch, "ttt": a.ttt, "samples": len(refs), "median_padded_len": t_med,
               "flops_at_median": f.as_dict(), "flops_forward_at_median": fwd.as_dict(),
               "matmul_first": first_probe, "matmul_after": after, "square": a.square, "rounds": a.rounds,
               "summary": summary, "fast_loss_max_rel_diff": fast_rel, "peak_tflops": a.peak_tflops,
               "command": " ".join([".venv/bin/python bench/train_utilisation.py", *sys.argv[1:]]),
               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "peak_memory_gib": peak, "peak_memory_how": peak_how, "losses_identical": same,
               "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs]}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    import shutil
    shutil.rmtree(root, ignore_errors=True)
    return 0 if same and fast_ok else 1


if __name__ == "__main__":
    sys.exit(main())
