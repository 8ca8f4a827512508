"""Benchmark: hidden-state capture, each number a ratio measured side by side in one run.

1. storage: final-format sample files (serialise, sha256, temp, fsync, rename,
   manifest append + fsync) per second vs raw sequential writes (write + fsync)
   of the same bytes to the same disk. Goal: ratio >= 0.9.
2. throughput: samples/s of the full path (detached hf capture server + CLI
   worker: HTTP, dump in /dev/shm, final file, manifest) vs a direct in-process
   transformers loop (forward with output_hidden_states, aux concat) over the
   same model and samples. The model is sized so one forward takes tens of ms.
   Goal: within 5 % (ratio >= 0.95).
3. resume: time to scan a 37,312-entry manifest and check every file (size;
   sha256 of the files changed since recorded) as a worker does at start,
   beside a size-only check of the same files. Goal: < 0.5 s.

    .venv/bin/python bench/capture.py [--samples 40] [--files 60] [--json bench/results/capture.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def bench_storage(root: Path, files: int, tokens: int, hidden: int) -> dict:
    import torch
    from safetensors.torch import save

    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    from eagleflow.capture.storage import SampleWriter, sample_file_name

    g = torch.Generator().manual_seed(0)
    samples = [dict(input_ids=torch.randint(0, 1000, (tokens,)), loss_mask=torch.ones(tokens, dtype=torch.uint8),
                    aux_hidden_states=torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16),
                    hidden_states=torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)) for _ in range(8)]
    payloads = [save({k: v.contiguous() for k, v in s.items()}, metadata={"id": "x"}) for s in samples]
    nbytes = len(payloads[0])

    # Alternate file by file (raw, ours, raw, ours...): both see the same disk and CPU load,
    # which on a shared machine drifts more between rounds than the difference we measure.
    raw_dir, ours_dir = root / "raw", root / "ours"
    raw_dir.mkdir(parents=True)
    w = SampleWriter(ours_dir)
    t_raw = t_ours = 0.0
    with ManifestWriter(ours_dir / "manifest.jsonl") as m:
        for i in range(files):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for which in order:
                t0 = time.perf_counter()
                if which == 0:
                    with open(raw_dir / f"{i:08d}.bin", "wb") as f:
                        f.write(payloads[i % 8])
                        f.flush()
                        os.fsync(f.fileno())
                    t_raw += time.perf_counter() - t0
                else:
                    st = w.write(index=i, sample_id=f"b:{i}", aux_layers=[1, 2, 3], model="bench", **samples[i % 8])
                    m.append(ManifestEntry(f"b:{i}", i, sample_file_name(i), tokens, st.bytes, st.sha256))
                    t_ours += time.perf_counter() - t0
    best = {"ours": files / t_ours, "raw": files / t_raw}
    return {"file_mb": nbytes / 1e6, "files": files, "ours_files_per_s": best["ours"], "raw_files_per_s": best["raw"],
            "ratio": best["ours"] / best["raw"]}


def build_model(out: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)


def direct_loop(model_dir: str, samples: list[list[int]], aux: list[int], threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        model(torch.tensor([samples[0]]), output_hidden_states=True)   # warm-up, like the server's health check
        t0 = time.perf_counter()
        for ids in samples:
            out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False, logits_to_keep=1)
            hs = out.hidden_states
            torch.cat([hs[i + 1][0] for i in aux], -1)
            hs[-1][0].clone()
            int(out.logits[0, -1].argmax())
        return len(samples) / (time.perf_counter() - t0)


def bench_throughput(root: Path, n: int, hidden: int, layers: int, tokens: int, threads: int,
                     rounds: int = 3, in_flight: int = 4) -> dict:
    import yaml

    from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
    from eagleflow.local_run import LocalRun
    from eagleflow.config import load_config
    from eagleflow.heartbeat import Heartbeat
    from eagleflow.layout import RunLayout
    from tests.fixtures.capture_corpus import write_corpus

    model_dir = root / "model"
    build_model(model_dir, hidden, layers, vocab=512)
    cfgp = root / "config.yaml"
    cfgp.write_text(yaml.safe_dump({
        "run_root": str(root / "runs"), "target_model": str(model_dir),
        "node": {"has_gpu": False, "state_dir": str(root / "state")},
        "server": {"port": 0, "dump_dir": "/dev/shm/eagleflow-bench-capture"},
        "capture": {"backend": "hf", "shards": 1, "in_flight": in_flight, "heartbeat_interval_s": 1.0}}))
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, "bench")
    rows = write_corpus(Path(lay.corpus_dir) / "corpus.parquet", n, 512, seed=1, min_len=tokens, max_len=tokens)
    ids = [r["input_ids"] for r in rows]
    aux = [1, layers // 2 - 1, layers - 4]
    ctx = LocalRun(cfg=cfg, layout=lay, config_path=str(cfgp))
    # the same torch thread count on both sides (the server and the worker inherit it)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    start_capture_server(ctx)
    direct, full = [], []
    try:
        wait_capture_server_ready(ctx, timeout_s=300, poll_s=0.5)
        url = json.loads(Path(lay.server_info_file).read_text())["url"]
        for rnd in range(rounds):   # alternate the two, several rounds: the shared CPU's load drifts
            direct.append(direct_loop(str(model_dir), ids, aux, threads))
            run_id = f"bench{rnd}"
            rl = RunLayout.for_run(cfg, run_id)
            Path(rl.corpus_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(lay.corpus_dir) / "corpus.parquet", Path(rl.corpus_dir) / "corpus.parquet")
            res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", str(cfgp),
                                  "--run-id", run_id, "--shard", "0", "--url", url], capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"worker failed: {res.stderr[-2000:]}")
            hb = Heartbeat.read(rl.heartbeat_file(0))
            # the worker's own clock: from its first request to its last stored sample
            full.append(hb.done / (hb.last_progress_at - hb.started_at))
    finally:
        stop_capture_server(ctx, grace_s=10)
    ratios = sorted(f / d for f, d in zip(full, direct))
    med = ratios[len(ratios) // 2]
    return {"samples": n, "tokens_per_sample": tokens, "hidden": hidden, "layers": layers, "torch_threads": threads,
            "forward_ms": 1000 / max(direct), "direct_samples_per_s": direct, "full_path_samples_per_s": full,
            "ratios": ratios, "ratio": med}


def bench_manifest(root: Path, entries: int = 37_312, changed: int = 20) -> dict:
    """The resume check as a worker runs it, side by side with a size-only check of the same files.

    The files are sparse (the check must not read them unless they changed); ``changed`` of them are
    then rewritten with their own bytes (same size, new mtime), as a byte flip would be, and must be hashed.
    """
    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter, completed_indexes, read_manifest
    from eagleflow.capture.storage import sample_file_name
    d = root / "manifest"
    d.mkdir()
    rng = random.Random(0)
    small = 64 * 1024   # the changed files are real bytes with a real digest
    with ManifestWriter(d / "manifest.jsonl", fsync=False) as m:
        for i in range(entries):
            p = d / sample_file_name(i)
            if i < changed:
                data = rng.randbytes(small)
                p.write_bytes(data)
                size, digest = small, hashlib.sha256(data).hexdigest()
            else:
                size, digest = rng.randrange(10_000, 5_000_000), "0" * 64
                with open(p, "wb") as f:
                    f.truncate(size)              # sparse: the scan only stats
            m.append(ManifestEntry(f"sharegpt:{i}", i, p.name, rng.randrange(10, 8192), size, digest,
                                   os.stat(p).st_mtime_ns))   # stamped as the worker stamps it
    t0 = time.perf_counter()
    scan = read_manifest(d / "manifest.jsonl")
    t1 = time.perf_counter()
    check = completed_indexes(d, scan)
    t2 = time.perf_counter()
    assert len(check.done) == entries and not check.broken and check.hashed == 0
    size_only = sum(os.stat(d / e.file).st_size == e.bytes for e in scan.entries.values())   # the old check
    t3 = time.perf_counter()
    assert size_only == entries
    time.sleep(0.01)
    for i in range(changed):
        p = d / sample_file_name(i)
        p.write_bytes(p.read_bytes())            # same bytes, new mtime: must be hashed, must pass
    t4 = time.perf_counter()
    check2 = completed_indexes(d, read_manifest(d / "manifest.jsonl"))
    t5 = time.perf_counter()
    assert check2.hashed == changed and len(check2.done) == entries and not check2.broken
    return {"entries": entries, "parse_s": t1 - t0, "check_s": t2 - t1, "size_only_check_s": t3 - t2,
            "total_s": t2 - t0, "changed": changed, "total_with_changed_s": t5 - t4,
            "ratio_check_vs_size_only": (t2 - t1) / (t3 - t2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the direct loop")
    ap.add_argument("--in-flight", type=int, default=4, help="worker requests in flight (capture.in_flight)")
    ap.add_argument("--skip-storage", action="store_true", help="only the throughput and resume parts")
    ap.add_argument("--files", type=int, default=60)
    ap.add_argument("--file-tokens", type=int, default=512)
    ap.add_argument("--file-hidden", type=int, default=1024)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--dir", help="scratch dir on the disk to measure (default: a temp dir under the repo)")
    a = ap.parse_args()
    base = Path(a.dir) if a.dir else REPO / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-capture-", dir=base) as tmp:
        root = Path(tmp)
        st = bench_storage(root / "storage", a.files, a.file_tokens, a.file_hidden)
        print(f"[1] storage: {st['files']} files of {st['file_mb']:.2f} MB: final format {st['ours_files_per_s']:.1f} "
              f"files/s vs raw write+fsync {st['raw_files_per_s']:.1f} files/s -> ratio {st['ratio']:.3f} "
              f"(goal >= 0.9)", flush=True)
        tp = bench_throughput(root / "throughput", a.samples, a.hidden, a.layers, a.tokens, a.threads,
                              in_flight=a.in_flight)
        fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"[2] throughput: {tp['samples']} samples x {tp['tokens_per_sample']} tokens, {a.threads} torch "
              f"thread(s), {a.in_flight} request(s) in flight"
              f", one forward {tp['forward_ms']:.1f} ms: server+worker {fmt(tp['full_path_samples_per_s'])} "
              f"samples/s vs direct loop {fmt(tp['direct_samples_per_s'])} samples/s (alternating rounds) -> "
              f"ratio median {tp['ratio']:.3f} of {fmt(tp['ratios'])} (goal >= 0.95)", flush=True)
        mf = bench_manifest(root)
        print(f"[3] resume: scan of a {mf['entries']:,}-entry manifest {mf['parse_s'] * 1000:.0f} ms + check of "
              f"every file (size, and sha256 of those changed since recorded) {mf['check_s'] * 1000:.0f} ms = "
              f"{mf['total_s']:.3f} s (goal < 0.5 s); the check vs a size-only check of the same files "
              f"{mf['size_only_check_s'] * 1000:.0f} ms -> ratio {mf['ratio_check_vs_size_only']:.2f}; with "
              f"{mf['changed']} files rewritten (hashed): {mf['total_with_changed_s']:.3f} s", flush=True)
    results = {"storage": st, "throughput": tp, "manifest": mf}
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
