"""GPU check of draft training: tokens/s of one DDP process at Llama-3-8B draft dims.

For a machine with a CUDA GPU (it exits with a message elsewhere). Synthetic
hidden states, nothing downloaded: hidden 4096, 32 heads, 8 KV heads,
intermediate 14336, target vocabulary 128,256, draft vocabulary 32,000, llama3
rope scaling, bf16 autocast, TTT length 7 -- the same modules, loss and DDP
wrapping as `eagleflow train`. Also times the data path (safetensors shards in
the storage format, read + collate + copy to the GPU) against a step.

    python bench/gpu_check_train.py [--seq 2048] [--steps 10] [--data-samples 4]
    (or under torchrun: python -m torch.distributed.run --nproc_per_node 1 bench/gpu_check_train.py)

``--store-dtype fp8_e4m3 --stage train_fp8``: the stored samples are fp8
(capture.store_dtype), the loader's batches are de-quantised on the GPU
(``Batch.to``), checked against the CPU de-quantisation, and the timed
training steps run on those loaded batches instead of a synthetic one.

Prints one line per measurement and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
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

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                 max_position_embeddings=131072)
# A dry run of this script's code paths on a CPU (gloo), at toy dims: --device cpu --dims tiny
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_8B["rope_scaling"],
            max_position_embeddings=4096)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """A world of one when not started by torchrun, so DDP and NCCL are really in the loop."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))


def _synthetic_batch(seq: int, h: int, vocab: int, device, dtype: torch.dtype, gen: torch.Generator):
    from eagleflow.train.data import Batch
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    lm = torch.ones(1, seq, dtype=torch.bool)
    lm[:, : seq // 10] = False
    return Batch(input_ids=ids, loss_mask=lm, attention_mask=torch.ones(1, seq, dtype=torch.bool),
                 aux_hidden_states=torch.randn(1, seq, 3 * h, generator=gen).to(torch.bfloat16),
                 hidden_states=torch.randn(1, seq, h, generator=gen).to(torch.bfloat16)).to(device, dtype)


def _write_samples(d: Path, n: int, seq: int, h: int, vocab: int, store_dtype: str = "auto") -> None:
    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    from eagleflow.capture.storage import SampleWriter
    shard = d / "shard_00000"
    w = SampleWriter(shard, fsync=False, store_dtype=store_dtype)
    with ManifestWriter(shard / "manifest.jsonl", fsync=False) as m:
        for i in range(n):
            s = w.write(index=i, sample_id=f"bench:{i}", input_ids=torch.randint(0, vocab, (seq,)),
                        loss_mask=torch.ones(seq, dtype=torch.uint8),
                        aux_hidden_states=torch.randn(seq, 3 * h, dtype=torch.bfloat16),
                        hidden_states=torch.randn(seq, h, dtype=torch.bfloat16), aux_layers=[1, 15, 28],
                        model="synthetic-llama3-8b")
            m.append(ManifestEntry(id=f"bench:{i}", index=i, file=s.path.name, tokens=seq, bytes=s.bytes,
                                   sha256=s.sha256, store_dtype=s.store_dtype))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample (batch of one sample)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--long-seq", type=int, default=8192,
                    help="also time one sample this long (the seeds' maximum; fused attention path); 0 skips")
    ap.add_argument("--data-samples", type=int, default=4, help="stored samples for the data-path timing; 0 skips")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: dry run of the code paths")
    ap.add_argument("--dims", choices=["llama3-8b", "tiny"], default="llama3-8b")
    ap.add_argument("--store-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="capture.store_dtype of the stored samples; fp8_e4m3 trains on the loaded batches")
    ap.add_argument("--stage", default="train", help="the verdict's stage name")
    a = ap.parse_args()
    fp8 = a.store_dtype == "fp8_e4m3"
    if fp8 and a.data_samples < 1:
        ap.error("--store-dtype fp8_e4m3 needs --data-samples >= 1: it trains on the loaded batches")
    if a.device == "cuda" and not torch.cuda.is_available():
        return write_verdict(a.stage, "fail", f"torch {torch.__version__} sees no CUDA GPU here; run this on a GPU "
                             "node (a CUDA build of torch is needed), or --device cpu --dims tiny to rehearse")

    from torch.nn.parallel import DistributedDataParallel as DDP

    from eagleflow.train.data import HiddenStateLoader, scan_samples
    from eagleflow.train.loss import TargetHead, TrainingTimeTest, summarize, target_batch
    from eagleflow.train.model import DraftConfig, Eagle3Draft
    from eagleflow.train.trainer import init_distributed

    _single_process_env()
    d = init_distributed(a.device)
    if not torch.distributed.is_initialized():   # the trainer skips it for one process; DDP needs it
        torch.distributed.init_process_group("nccl" if d.device.type == "cuda" else "gloo", init_method="env://")
    dev = d.device
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32   # as the trainer: bf16 data + autocast on GPU

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    torch.manual_seed(0)
    dims = LLAMA3_8B if a.dims == "llama3-8b" else TINY
    dcfg = DraftConfig(draft_vocab_size=min(a.draft_vocab, dims["vocab_size"]), **dims)
    a.draft_vocab = dcfg.draft_vocab_size
    h, v = dcfg.hidden_size, dcfg.vocab_size
    t0 = time.perf_counter()
    with torch.device(dev):
        model = Eagle3Draft(dcfg)
        head = torch.randn(v, h, dtype=dtype) * 0.02
    draft_ids = torch.sort(torch.randperm(v, device=dev)[: a.draft_vocab]).values
    t2d = torch.zeros(v, dtype=torch.bool, device=dev)
    t2d[draft_ids] = True
    with torch.no_grad():
        model.d2t.copy_(draft_ids - torch.arange(a.draft_vocab, device=dev))
        model.t2d.copy_(t2d)
        model.lm_head.weight.copy_(head[draft_ids].float())
    ttt = TrainingTimeTest(model, a.ttt)
    ddp = DDP(ttt, device_ids=[d.local_rank] if cuda else None)
    params = [p for p in ttt.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    th = TargetHead(head, draft_ids, t2d)
    n_params = sum(p.numel() for p in params)
    gpu_name = torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)"
    print(f"{gpu_name}; torch {torch.__version__}; draft {n_params / 1e6:.0f} M trainable "
          f"params, built in {time.perf_counter() - t0:.1f} s; seq {a.seq}, ttt {a.ttt}, draft vocab {a.draft_vocab}")

    gen = torch.Generator().manual_seed(0)
    batch = _synthetic_batch(a.seq, h, v, dev, dtype, gen)
    tmpdir = tempfile.TemporaryDirectory(prefix="eagleflow-gpucheck-")
    fp8_res: dict = {}
    if fp8:   # the steps below train on a batch the loader read from the fp8 store, de-quantised on the GPU
        from eagleflow.capture.storage import read_sample
        _write_samples(Path(tmpdir.name), a.data_samples, a.seq, h, v, "fp8_e4m3")
        refs8 = scan_samples(tmpdir.name, log=lambda _m: None, verify_sha256=True)
        loader8 = HiddenStateLoader(refs8, batch_size=1, seed=0, prefetch=False)
        raw = loader8.next_batch()
        sync()
        s0 = time.perf_counter()
        batch = raw.to(dev, dtype)
        sync()
        deq_s = time.perf_counter() - s0
        loader8.close()
        ids = raw.input_ids[0].tolist()
        src = next(r for r in refs8 if read_sample(r.path, raw=True)[0]["input_ids"].tolist() == ids)
        want = read_sample(src.path)[0]["aux_hidden_states"].float()    # the CPU's de-quantisation
        # relative to the batch's range: both round the same float32 products to bf16 (at most an ulp apart)
        diff = float((batch.aux_hidden_states[0].float().cpu() - want).abs().max() / want.abs().max())
        fp8_res = {"store_dtype": "fp8_e4m3", "stored_bytes_per_token": refs8[0].bytes / a.seq,
                   "dequant_copy_ms": 1000 * deq_s, "dequant_max_rel_diff_vs_cpu": diff,
                   "dequant_device": str(batch.aux_hidden_states.device)}
        print(f"fp8 store: {refs8[0].bytes / a.seq:,.0f} bytes/token; copy + de-quantise one {a.seq}-token batch "
              f"on {batch.aux_hidden_states.device}: {1000 * deq_s:.1f} ms; max |GPU - CPU de-quantisation| / max |x| {diff:.3g}")

    def step(batch=batch) -> tuple[float, float, list[float]]:
        s0 = time.perf_counter()
        tb = target_batch(th, batch)
        sync()
        s1 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss, stats = ddp(batch.input_ids, batch.aux_hidden_states, tb.probs, tb.top, tb.valid)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        s2 = time.perf_counter()
        m = summarize(stats, a.ttt, 1)
        return s1 - s0, s2 - s0, [float(loss.detach()), m.acc[0]]

    losses = []
    for _ in range(3):
        losses.append(step()[2][0])
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    head_t, step_t = [], []
    for _ in range(a.steps):
        ht, st, (loss, _acc) = step()
        head_t.append(ht)
        step_t.append(st)
        losses.append(loss)
    step_s = sum(step_t) / len(step_t)
    tps = a.seq / step_s
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0
    print(f"step {1000 * step_s:.1f} ms ({1000 * sum(head_t) / len(head_t):.1f} ms of it the target head), "
          f"{tps:,.0f} tokens/s per GPU, peak memory {peak:.1f} GiB")
    print(f"loss on the repeated batch: first {losses[0]:.3f} -> last {losses[-1]:.3f} (should fall)")
    finite = all(x == x and abs(x) != float("inf") for x in losses)

    data_s = None
    if a.data_samples > 0:
        with tempfile.TemporaryDirectory(prefix="eagleflow-gpucheck-") as tmp:
            if fp8:
                tmp = tmpdir.name     # the fp8 store already written
            else:
                _write_samples(Path(tmp), a.data_samples, a.seq, h, v)
            refs = scan_samples(tmp, log=lambda _m: None)
            loader = HiddenStateLoader(refs, batch_size=1, seed=0, prefetch=False)
            times = []
            for _ in range(a.data_samples):
                s0 = time.perf_counter()
                loader.next_batch().to(dev, dtype)
                sync()
                times.append(time.perf_counter() - s0)
            loader.close()
        data_s = sorted(times)[len(times) // 2]
        print(f"data path (read {a.seq}-token {a.store_dtype} sample + collate + copy to GPU"
              f"{' + de-quantise there' if fp8 else ''}): {1000 * data_s:.1f} ms "
              f"= {data_s / step_s:.3f} of a step (page cache warm; the trainer prefetches it on a thread)")

    long_res: dict = {}
    if a.long_seq > 0:
        # Past EXPLICIT_ATTENTION_MAX_LEN the TTT attention is one fused SDPA call (memory linear in length).
        from eagleflow.train.model import EXPLICIT_ATTENTION_MAX_LEN
        long_batch = _synthetic_batch(a.long_seq, h, v, dev, dtype, gen)
        try:
            step(long_batch)
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            lt = [step(long_batch)[1] for _ in range(2)]
            long_s = sum(lt) / len(lt)
            long_peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0
            fused = a.long_seq > EXPLICIT_ATTENTION_MAX_LEN
            long_res = {"long_seq": a.long_seq, "long_step_ms": 1000 * long_s,
                        "long_tokens_per_s": a.long_seq / long_s, "long_peak_mem_gib": long_peak,
                        "long_fused_attention": fused}
            print(f"{a.long_seq}-token sample ({'fused' if fused else 'explicit'} attention): "
                  f"step {1000 * long_s:.1f} ms, {a.long_seq / long_s:,.0f} tokens/s, peak memory {long_peak:.1f} GiB")
        except torch.cuda.OutOfMemoryError as e:
            long_res = {"long_seq": a.long_seq, "long_error": f"out of memory: {e}"[:300]}
            print(f"{a.long_seq}-token sample: OUT OF MEMORY: {str(e)[:300]}")
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    figures = {"gpu": gpu_name, "dims": a.dims, "seq": a.seq, "ttt": a.ttt, **long_res,
               "draft_vocab": a.draft_vocab, "hidden": h, "trainable_params_m": round(n_params / 1e6, 1),
               "steps": a.steps, "step_ms": 1000 * step_s, "tokens_per_s": tps, "peak_mem_gib": peak,
               "losses": [round(x, 4) for x in losses], "loss_first": losses[0], "loss_last": losses[-1],
               "finite": finite, "data_fraction_of_step": None if data_s is None else data_s / step_s, **fp8_res}
    tmpdir.cleanup()
    print(json.dumps(figures))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    problems = [p for p, bad in (("a loss is not finite", not finite),
                                 (f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})", losses[-1] >= losses[0]),
                                 (long_res.get("long_error", ""), "long_error" in long_res),
                                 (f"GPU de-quantisation differs from the CPU's by {fp8_res.get('dequant_max_rel_diff_vs_cpu')}",
                                  fp8 and not fp8_res["dequant_max_rel_diff_vs_cpu"] <= 1e-2)) if bad]
    if problems:
        return write_verdict(a.stage, "fail", "; ".join(problems), **figures)
    if not cuda:
        why = "dry run" if dry_run() else f"torch {torch.__version__} sees no CUDA GPU here"
        return write_verdict(a.stage, "skipped", f"{why}: needs a CUDA GPU; the training step was rehearsed on the "
                             f"CPU at {a.dims} dims (not a measurement)", rehearsal=figures)
    return write_verdict(a.stage, "pass", None, **figures)


if __name__ == "__main__":
    sys.exit(main())
