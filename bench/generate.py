"""Benchmark: the generation phase's throughput against a bare client loop, side by side in one run.

Both talk to the same hf server in serving mode (a subprocess, the demo's tiny
target, a forward delay so that the model, not Python, is the bottleneck as on
a GPU node). First the phase: one shard worker (read and normalise the source,
render prompts, the token-exact record, result files, manifest, heartbeat) with
``concurrency`` records in flight. Then a bare loop sends exactly the requests
the phase sent (each turn's prompt ids, max_new_tokens and seed, read back from
the stored records) with the same concurrency and nothing else. The ratio is
generated tokens/s of the phase over the bare loop's, over the worker's whole run (start-up included) and over
its work alone (from its first record on). Goal: >= 0.95.

    .venv/bin/python bench/generate.py [--records 24] [--concurrency 4] [--json bench/results/generate.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _start_server(model: str, info: Path, delay_s: float) -> subprocess.Popen:
    env = {**os.environ, "EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S": str(delay_s)}
    proc = subprocess.Popen([sys.executable, "-m", "eagleflow.engines.hf.server", "--model", model, "--mode",
                             "generate", "--port", "0", "--info-file", str(info), "--threads", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not info.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the hf generation server did not start")
        time.sleep(0.1)
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=24, help="per source (the three demo sources)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--delay", type=float, default=0.01, help="seconds added to each request's forward")
    ap.add_argument("--no-fsync", action="store_true", help="(diagnosis) result files without fsync")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from eagleflow.serving.client import generate_tokens
    from eagleflow.demo_assets import ensure_demo_assets
    from eagleflow.phases.generate.regenerate import Sampling, turn_seed
    from eagleflow.phases.generate.worker import GenerateSettings, GenerateWorker, SourceInput, read_results

    assets = ensure_demo_assets(REPO / ".cache" / "test-assets", n_per_source=24, fit_target=False)
    sources = tuple(SourceInput(x["name"], x["path"], limit=a.records) for x in assets["sources"])
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    server = _start_server(assets["target_model"], tmp / "server.json", a.delay)
    try:
        url = json.loads((tmp / "server.json").read_text())["url"]
        sampling = Sampling(temperature=0.7, max_new_tokens=a.max_new_tokens, seed=1)
        settings = GenerateSettings(run_id="bench", shard=0, num_shards=1, shard_dir=str(tmp / "shard"),
                                    server_url=url, model_path=assets["target_model"],
                                    sources=sources,
                                    sampling=sampling, max_length=1024, concurrency=a.concurrency,
                                    heartbeat_interval_s=2.0, fsync=not a.no_fsync)
        t0 = time.perf_counter()
        hb = GenerateWorker(settings, log=lambda m: None).run()
        phase_s = time.perf_counter() - t0
        work_s = hb.time - hb.started_at   # from the first record on: without reading the sources and the tokenizer
        results = read_results(tmp / "shard")
        requests = []
        for r in results:
            for turn, (start, end) in enumerate(r.spans, start=1):
                requests.append((r.input_ids[:start], min(sampling.max_new_tokens, 1024 - start),
                                 turn_seed(sampling.seed, r.id, turn), end - start))
        tokens = sum(n for *_, n in requests)

        def one(req):
            ids, _ = generate_tokens(url, req[0], "bench-bare", max_new_tokens=req[1], temperature=0.7, top_p=1.0,
                                     seed=req[2], stop_token_ids=[4], timeout_s=300)
            return len(ids)
        def bare() -> tuple[int, float]:
            t = time.perf_counter()
            with ThreadPoolExecutor(a.concurrency) as pool:
                n = sum(pool.map(one, requests))
            return n, time.perf_counter() - t
        # the phase again after the first bare loop, and the bare loop again: a shared machine's load drifts,
        # so each is timed twice, interleaved, and the better of each pair is compared
        bare_tokens, bare1 = bare()
        shutil.rmtree(tmp / "shard")
        t0 = time.perf_counter()
        hb2 = GenerateWorker(settings, log=lambda m: None).run()
        phase_s = min(phase_s, time.perf_counter() - t0)
        work_s = min(work_s, hb2.time - hb2.started_at)
        _, bare2 = bare()
        bare_s = min(bare1, bare2)
    finally:
        server.terminate()
        server.wait(30)
    out = {"records": len(results), "requests": len(requests), "concurrency": a.concurrency,
           "tokens_generated": tokens, "bare_tokens": bare_tokens, "phase_s": round(phase_s, 3),
           "bare_s": round(bare_s, 3), "phase_tokens_per_s": round(tokens / phase_s, 1),
           "bare_tokens_per_s": round(bare_tokens / bare_s, 1),
           "phase_work_s": round(work_s, 3),
           # the whole worker run (start-up included: reading sources, loading the tokenizer) and its work alone
           "ratio": round((tokens / phase_s) / (bare_tokens / bare_s), 3),
           "ratio_work": round((tokens / work_s) / (bare_tokens / bare_s), 3),
           "same_tokens": bare_tokens == tokens}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
