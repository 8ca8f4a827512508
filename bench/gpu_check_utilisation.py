"""GPU check stage ``train_util`` (issue 49): the draft training step's FLOP/s as a fraction of the device's dense
peak and of its own matmul throughput measured in the same run, before (plain step, plain loader) and after
(``TrainingTimeTest(fast=True)``, the trainer's prefetching loader), and the fraction of step time spent waiting
on data.

At Llama-3-8B draft dims (bench/gpu_check_train.py's: hidden 4096, intermediate 14336, 32 heads x 128, 8 KV
heads, target vocabulary 128,256, draft vocabulary 32,000, TTT 7), bf16 autocast as the trainer, on samples
stored in the capture format and read by ``HiddenStateLoader`` (so the data wait is the real loader's).

- FLOPs a step: ``eagleflow.train.flops.draft_step_flops`` (the draft's forward + backward counted from its
  shapes, TTT steps and padded length, plus the target head's forward), the same count as
  bench/train_utilisation.py;
- the device's matmul: ``torch.matmul`` at the draft's layer shapes in bf16 (bench/train_utilisation.py's
  probe), just before each run;
- the device's published dense peak (bf16, no sparsity): by its name (``PEAKS``) or ``--peak-tflops``; the goal
  is at least 40 % of it.

Without a CUDA GPU (``--device cpu --dims tiny``, the dry run) the same code runs at toy size on the CPU and the
verdict is ``skipped`` with the figures as a rehearsal, not a measurement.

    python bench/gpu_check_utilisation.py [--seq 2048] [--steps 6] [--rounds 2] [--peak-tflops 989]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from gpu_check_common import dry_run, write_verdict  # noqa: E402

# published dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s, by a substring of the device's name; the
# first match wins (the more specific names first)
PEAKS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.4), ("H100", 989.4), ("GH200", 989.4),
         ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0)]
GOAL_FRACTION_OF_PEAK = 0.40
FAST_LOSS_RTOL = 2e-2   # bf16 autocast: the fast step's first loss against the plain step's on the same batch


def published_peak_tflops(name: str) -> float | None:
    for key, tflops in PEAKS:
        if key in name:
            return tflops
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: rehearse the code paths")
    ap.add_argument("--dims", choices=["llama3-8b", "tiny"], default="llama3-8b")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per stored sample")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--samples", type=int, default=4, help="samples stored and read by the loader")
    ap.add_argument("--steps", type=int, default=6, help="timed steps a run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="before and after alternate this many times")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--probe-s", type=float, default=0.3, help="seconds each matmul shape is timed")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak; 0 = by its name")
    ap.add_argument("--stage", default="train_util", help="the verdict's stage name")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        return write_verdict(a.stage, "fail", f"torch {torch.__version__} sees no CUDA GPU here; run this on a GPU "
                             "node, or --device cpu --dims tiny to rehearse")

    from gpu_check_train import LLAMA3_8B, TINY, _write_samples
    from train_utilisation import matmul_probe

    from eagleflow.train.data import HiddenStateLoader, scan_samples
    from eagleflow.train.flops import draft_matmul_shapes, draft_step_flops
    from eagleflow.train.loss import TargetHead, TrainingTimeTest, target_batch
    from eagleflow.train.model import DraftConfig, Eagle3Draft

    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    torch.manual_seed(0)
    dims = LLAMA3_8B if a.dims == "llama3-8b" else TINY
    dcfg = DraftConfig(draft_vocab_size=min(a.draft_vocab, dims["vocab_size"]), **dims)
    h, v = dcfg.hidden_size, dcfg.vocab_size
    t0 = time.perf_counter()
    with torch.device(dev):
        model = Eagle3Draft(dcfg)
        head = torch.randn(v, h, dtype=dtype) * 0.02
    draft_ids = torch.sort(torch.randperm(v, device=dev)[: dcfg.draft_vocab_size]).values
    t2d = torch.zeros(v, dtype=torch.bool, device=dev)
    t2d[draft_ids] = True
    with torch.no_grad():
        model.d2t.copy_(draft_ids - torch.arange(dcfg.draft_vocab_size, device=dev))
        model.t2d.copy_(t2d)
        model.lm_head.weight.copy_(head[draft_ids].float())
    initial = {k: x.detach().clone() for k, x in model.state_dict().items()}
    th = TargetHead(head, draft_ids, t2d)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)"
    peak = a.peak_tflops or (published_peak_tflops(name) if cuda else None)
    tmp = tempfile.TemporaryDirectory(prefix="eagleflow-gpucheck-util-")
    _write_samples(Path(tmp.name), a.samples, a.seq, h, v)
    refs = scan_samples(tmp.name, log=lambda _m: None)
    f = draft_step_flops(dcfg, a.batch, a.seq, a.ttt)
    shapes = draft_matmul_shapes(dcfg, a.batch * a.seq)
    print(f"{name}; torch {torch.__version__}; draft at {a.dims} dims (H {h}, draft vocab {dcfg.draft_vocab_size}), "
          f"TTT {a.ttt}, batch {a.batch} x {a.seq} tokens; built in {time.perf_counter() - t0:.1f} s; published "
          f"dense bf16 peak {f'{peak:g} TFLOP/s' if peak else 'unknown (--peak-tflops)'}")
    print(f"FLOPs a step (eagleflow.train.flops): draft fwd+bwd {f.draft / 1e9:.1f} GFLOP (fc {f.fc / 1e9:.1f}, "
          f"projections {f.projections / 1e9:.1f}, mlp {f.mlp / 1e9:.1f}, attention {f.attention_matmul / 1e9:.1f} "
          f"+ {f.attention_diagonal / 1e9:.2f}, lm_head {f.lm_head / 1e9:.1f}) + target head fwd "
          f"{f.target_head / 1e9:.1f} = {f.total / 1e9:.1f} GFLOP")

    # the two paths on the same first batch, from the same weights
    probe_loader = HiddenStateLoader(refs, batch_size=a.batch, seed=0, prefetch=False)
    b0 = probe_loader.next_batch().to(dev, dtype)
    probe_loader.close()
    tb0 = target_batch(th, b0)
    first = {}
    for fast in (False, True):
        with torch.no_grad(), autocast():
            loss, _ = TrainingTimeTest(model, a.ttt, fast=fast)(b0.input_ids, b0.aux_hidden_states, tb0.probs,
                                                                 tb0.top, tb0.valid)
        first[fast] = float(loss)
    loss_rel = abs(first[True] - first[False]) / max(abs(first[False]), 1e-30)
    del b0, tb0
    print(f"first batch's loss: plain step {first[False]:.5f}, fast step {first[True]:.5f} "
          f"(relative difference {loss_rel:.2e})")

    def run(fast: bool, prefetch: bool) -> dict:
        model.load_state_dict(initial)
        ttt = TrainingTimeTest(model, a.ttt, fast=fast)
        params = [p for p in ttt.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
        loader = HiddenStateLoader(refs, batch_size=a.batch, seed=0, prefetch=prefetch)
        waits, steps, losses = [], [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            for i in range(a.warmup + a.steps):
                s0 = time.perf_counter()
                b = loader.next_batch().to(dev, dtype)
                sync()
                s1 = time.perf_counter()
                tb = target_batch(th, b)
                with autocast():
                    loss, _ = ttt(b.input_ids, b.aux_hidden_states, tb.probs, tb.top, tb.valid)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))   # syncs the device
                s2 = time.perf_counter()
                if i >= a.warmup:
                    waits.append(s1 - s0)
                    steps.append(s2 - s0)
                del b, tb, loss
        finally:
            loader.close()
        step_s = statistics.median(steps)
        mem = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if cuda else 0.0
        del opt
        return {"step_ms": 1000 * step_s, "flops_per_s": f.total / step_s, "draft_flops_per_s": f.draft / step_s,
                "data_fraction_of_step": sum(waits) / sum(steps), "tokens_per_s": a.batch * a.seq / step_s,
                "peak_mem_gib": mem, "tokens_per_s_per_gib": a.batch * a.seq / step_s / mem if mem else None,
                "losses": [round(x, 4) for x in losses]}

    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for rnd in range(a.rounds):
        for label, fast, prefetch in (("before", False, False), ("after", True, True)):
            probe = matmul_probe(shapes, dtype, dev, a.probe_s)
            r = run(fast, prefetch)
            r["matmul_flops_per_s"] = probe["flops_per_s"]
            r["utilisation_vs_matmul"] = r["flops_per_s"] / probe["flops_per_s"]
            if peak:
                r["fraction_of_peak"] = r["flops_per_s"] / (peak * 1e12)
            runs[label].append(r)
            print(f"round {rnd} {label:6s} ({'fast' if fast else 'plain'} step, "
                  f"{'prefetching' if prefetch else 'plain'} loader): step {r['step_ms']:.1f} ms, "
                  f"{r['tokens_per_s']:,.0f} tokens/s, {r['flops_per_s'] / 1e12:.2f} TFLOP/s = "
                  f"{r['utilisation_vs_matmul']:.3f} of the matmul at the draft's shapes "
                  f"({probe['flops_per_s'] / 1e12:.2f} TFLOP/s)"
                  + (f", {r['fraction_of_peak']:.3f} of the dense peak" if peak else "")
                  + f"; data wait {r['data_fraction_of_step']:.3f} of step time; peak memory {r['peak_mem_gib']:.1f} GiB")
    summary = {}
    for label, rs in runs.items():
        keys = ["step_ms", "flops_per_s", "draft_flops_per_s", "utilisation_vs_matmul", "data_fraction_of_step",
                "tokens_per_s", "peak_mem_gib"] + (["fraction_of_peak"] if peak else [])
        summary[label] = {k: statistics.median(r[k] for r in rs) for k in keys}
    bf, af = summary["before"], summary["after"]
    print(f"before -> after (medians of {a.rounds} rounds): utilisation vs matmul "
          f"{bf['utilisation_vs_matmul']:.3f} -> {af['utilisation_vs_matmul']:.3f}"
          + (f", fraction of the {peak:g} TFLOP/s dense peak {bf['fraction_of_peak']:.3f} -> "
             f"{af['fraction_of_peak']:.3f} (goal >= {GOAL_FRACTION_OF_PEAK})" if peak else "")
          + f", data wait {bf['data_fraction_of_step']:.3f} -> {af['data_fraction_of_step']:.3f}, "
          f"{bf['tokens_per_s']:,.0f} -> {af['tokens_per_s']:,.0f} tokens/s")
    tmp.cleanup()
    finite = all(x == x and abs(x) != float("inf") for rs in runs.values() for r in rs for x in r["losses"])
    figures = {"gpu": name, "dims": a.dims, "seq": a.seq, "batch": a.batch, "ttt": a.ttt,
               "draft_vocab": dcfg.draft_vocab_size, "peak_tflops": peak, "flops_a_step": f.as_dict(),
               "summary": summary, "runs": runs, "first_loss_plain": first[False], "first_loss_fast": first[True],
               "first_loss_rel_diff": loss_rel, "finite": finite,
               "goal_fraction_of_peak": GOAL_FRACTION_OF_PEAK,
               "goal_met": bool(peak) and af.get("fraction_of_peak", 0.0) >= GOAL_FRACTION_OF_PEAK}
    print(json.dumps({k: figures[k] for k in ("gpu", "peak_tflops", "summary", "goal_met")}))
    problems = [p for p, bad in (("a loss is not finite", not finite),
                                 (f"the fast step's loss differs from the plain step's by {loss_rel:.2e} "
                                  f"(> {FAST_LOSS_RTOL:g})", loss_rel > FAST_LOSS_RTOL)) if bad]
    if problems:
        return write_verdict(a.stage, "fail", "; ".join(problems), **figures)
    if not cuda:
        why = "dry run" if dry_run() else f"torch {torch.__version__} sees no CUDA GPU here"
        return write_verdict(a.stage, "skipped", f"{why}: needs a CUDA GPU; the utilisation runs were rehearsed on "
                             f"the CPU at {a.dims} dims (not a measurement)", rehearsal=figures)
    return write_verdict(a.stage, "pass", None, **figures)


if __name__ == "__main__":
    sys.exit(main())
