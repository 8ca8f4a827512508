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

``--real-size`` instead measures the training reader on files of the seeds' size
(H = 7168, 8,192 tokens a sample, three aux layers plus the last; bf16 ~470 MB
and fp8 ~235 MB a file): for each store dtype it writes ``--real-samples``
files (fsynced), drops them from the page cache (posix_fadvise DONTNEED, no
root needed), times a raw sequential read of the same files, drops them again
and times the reader the way a training loop uses it (one HiddenStateLoader,
prefetching, an epoch a round: read, checks, collate; each batch taken, used,
dropped; its first epoch, when its reused buffers are allocated, apart), then
``Batch.to`` de-quantising to bf16 (on the CPU here, on the training GPU in a
run). It prints reader bytes/s / raw bytes/s and the reader's CPU seconds per
sample for both store dtypes side by side. ``--reader-buffers 0`` gives the
reader a fresh allocation per sample (no buffer reuse: how it read before).
The files are deleted at the end.

    .venv/bin/python bench/train.py --real-size [--real-samples 3] [--dir /some/disk] [--reader-buffers 3]
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

import eagleflow.train  # noqa: E402,F401 - before torch: it turns on huge pages for the reader's buffers
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
    ap.add_argument("--real-size", action="store_true", help="the reader at H=7168, 8192 tokens (see above)")
    ap.add_argument("--real-samples", type=int, default=3)
    ap.add_argument("--real-tokens", type=int, default=8192)
    ap.add_argument("--real-hidden", type=int, default=7168)
    ap.add_argument("--dir", default=None, help="--real-size: where to write the files (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=3, help="--real-size: raw read and reader (one epoch) alternate "
                    "this many times (cache dropped before each); the best of each counts (a shared disk is noisy), "
                    "the reader's first epoch (its buffers allocated) reported apart")
    ap.add_argument("--reader-buffers", type=int, default=3, help="--real-size: host buffers the reader reuses "
                    "(HiddenStateLoader buffers=; 0: a fresh allocation per sample)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.real_size:
        return real_size(a)

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


def _drop_cache(paths) -> None:
    import os
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(paths, chunk: int = 16 << 20) -> int:
    n = 0
    buf = bytearray(chunk)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n


def real_size(a) -> int:
    """The training reader against a raw sequential read of the same files, at the seeds' sizes."""
    import json
    import os
    import shutil

    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    from eagleflow.capture.storage import SampleWriter

    L, H, n = a.real_tokens, a.real_hidden, a.real_samples
    root = Path(tempfile.mkdtemp(prefix="eagleflow-bench-realsize-", dir=a.dir))
    results = {}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {n} samples x {L} tokens, H = {H}, "
          f"aux 3H + last H; files under {root}")
    try:
        g = torch.Generator().manual_seed(0)
        aux = torch.randn(L, 3 * H, generator=g).to(torch.bfloat16)
        hid = torch.randn(L, H, generator=g).to(torch.bfloat16)
        for store in ("auto", "fp8_e4m3"):
            shard = root / store / "shard_00000"
            w = SampleWriter(shard, fsync=True, store_dtype=store)
            t0 = time.perf_counter()
            with ManifestWriter(shard / "manifest.jsonl") as m:
                for i in range(n):
                    # a different sample each time (the same bytes would dedupe nowhere, but keep them honest)
                    st = w.write(index=i, sample_id=f"bench:{i}", input_ids=torch.randint(0, 150_000, (L,)),
                                 loss_mask=torch.ones(L, dtype=torch.uint8), aux_hidden_states=aux.roll(i, 0),
                                 hidden_states=hid.roll(i, 0), aux_layers=[2, 30, 57], model="bench")
                    m.append(ManifestEntry(f"bench:{i}", i, st.path.name, L, st.bytes, st.sha256,
                                           os.stat(st.path).st_mtime_ns, st.store_dtype))
            write_s = time.perf_counter() - t0
            refs = scan_samples(root / store, log=lambda _m: None)
            paths = [r.path for r in refs]
            size = sum(r.bytes for r in refs)
            raw_s = read_s = cpu_s = float("inf")
            # one loader for every round, as one training run: round 0 is its first epoch (its buffers are
            # allocated then), later rounds are the steady state a run spends its time in
            loader = HiddenStateLoader(refs, batch_size=1, seed=0, prefetch=True, buffers=a.reader_buffers)
            for rnd in range(a.rounds):
                _drop_cache(paths)
                t0 = time.perf_counter()
                got = _raw_read(paths)
                raw_s = min(raw_s, time.perf_counter() - t0)
                assert got == size
                _drop_cache(paths)
                c0, t0 = time.process_time(), time.perf_counter()
                tokens = 0
                for _ in range(n):      # an epoch, as a training loop: take a batch, use it, drop it
                    b = loader.next_batch()
                    tokens += b.num_tokens
                    del b
                el, cpu = time.perf_counter() - t0, time.process_time() - c0
                assert tokens == n * L and loader.position.cursor == 0
                if rnd == 0:
                    first_s, first_cpu_s = el, cpu
                if (rnd > 0 or a.rounds == 1) and el < read_s:
                    read_s, cpu_s = el, cpu
            loader.close()
            pool = loader.sample_buffers
            # de-quantising (fp8) or casting (bf16) to the training dtype: on the GPU in a GPU run
            # (bench/gpu_check.sh times it there), on these CPUs in a CPU run; the reads are not counted
            loader = HiddenStateLoader(refs, batch_size=1, seed=0, prefetch=False, buffers=a.reader_buffers)
            to_cpu_s = 0.0
            for _ in range(n):
                b = loader.next_batch()
                c0 = time.process_time()
                out = b.to(torch.device("cpu"), torch.bfloat16)
                to_cpu_s += time.process_time() - c0
                assert out.aux_hidden_states.dtype == torch.bfloat16 and out.num_tokens == L
                del out, b
            loader.close()
            _drop_cache(paths)
            t0 = time.perf_counter()
            from eagleflow.capture.storage import file_sha256
            for r in refs:
                assert file_sha256(r.path) == r.sha256
            sha_s = time.perf_counter() - t0
            res = {"files": n, "bytes": size, "bytes_per_token": size / (n * L), "write_s": write_s,
                   "raw_MBps": size / raw_s / 1e6, "reader_MBps": size / read_s / 1e6, "ratio": raw_s / read_s,
                   "reader_cpu_s_per_sample": cpu_s / n, "reader_first_epoch_MBps": size / first_s / 1e6,
                   "reader_first_epoch_cpu_s_per_sample": first_cpu_s / n, "rounds": a.rounds,
                   "sha256_MBps": size / sha_s / 1e6,
                   "to_bf16_on_cpu_s_per_sample": to_cpu_s / n, "reader_buffers": a.reader_buffers,
                   "buffers_allocated": pool.allocated if pool else None,
                   "buffers_reused": pool.reused if pool else None}
            results[store] = res
            print(f"{store:9s}: {size / n / 1e6:7.1f} MB a sample ({res['bytes_per_token']:,.0f} bytes/token); raw "
                  f"sequential read {res['raw_MBps']:,.0f} MB/s, reader (read+checks+collate) "
                  f"{res['reader_MBps']:,.0f} MB/s = {res['ratio']:.2f} of raw; reader CPU "
                  f"{res['reader_cpu_s_per_sample']:.2f} s/sample; to bf16 on the CPU (a CPU run only) "
                  f"{res['to_bf16_on_cpu_s_per_sample']:.2f} s/sample; sha256 (cold) {res['sha256_MBps']:,.0f} MB/s")
            shutil.rmtree(root / store)
        r8, r16 = results["fp8_e4m3"], results["auto"]
        print(f"\n{'store':9s} {'MB/sample':>9s} {'raw MB/s':>9s} {'reader MB/s':>11s} {'ratio':>6s} "
              f"{'CPU s/sample':>12s} {'1st epoch MB/s':>14s}   (goal: ratio >= 0.9; reader buffers "
              f"{a.reader_buffers})")
        for store, r in results.items():
            print(f"{store:9s} {r['bytes'] / n / 1e6:9.1f} {r['raw_MBps']:9,.0f} {r['reader_MBps']:11,.0f} "
                  f"{r['ratio']:6.2f} {r['reader_cpu_s_per_sample']:12.2f} {r['reader_first_epoch_MBps']:14,.0f}")
        print(f"fp8 / bf16 stored bytes per token = {r8['bytes_per_token'] / r16['bytes_per_token']:.4f}; "
              f"samples/s through the reader: bf16 {r16['reader_MBps'] * 1e6 / (r16['bytes'] / n):.2f}, "
              f"fp8 {r8['reader_MBps'] * 1e6 / (r8['bytes'] / n):.2f}")
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
