"""Profile the streaming trainer's step with the store already full (issue 53), and the offline trainer beside it.

    .venv/bin/python bench/profile_stream_step.py N TAG MODES [DIR]      e.g.  400 before streaming,offline

A corpus of N synthetic records (96-320 tokens) and the 12 x 128 Llama target of bench/stream_vs_offline.py;
per mode (``offline``: stream.storage disk; ``streaming``: mooncake, buffer 1 GiB so capture never waits) the
capture server and both shards' workers run to the end first (streaming: into the run's store, started by
``eagleflow store start``), then ``eagleflow train`` runs under cProfile, pinned to core 1, one torch thread:
DIR/MODE-TAG.prof (read it with pstats). Prints the trainer's steps/s from its metrics.jsonl and the load."""
import json, os, shutil, subprocess, sys, time
from pathlib import Path
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench")); sys.path.insert(0, str(REPO))
from stream_runs import CaptureServer, popen, run, wait_all  # noqa
import yaml
sys.path.insert(0, str(REPO / "include"))
from eagleflow.demo_assets import ensure_demo_assets, build_tiny_llama
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from eagleflow.config import load_config
from eagleflow.layout import RunLayout

N = int(sys.argv[1]); tag = sys.argv[2]; modes = sys.argv[3].split(",")
OUT = Path(sys.argv[4] if len(sys.argv) > 4 else "/tmp/eagleflow-profile-stream")
root = OUT / "work"; root.mkdir(parents=True, exist_ok=True)
assets = ensure_demo_assets(REPO / ".cache" / "test-assets", n_per_source=24, fit_target=False)
target = assets["target_model"]; vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
built = root / "target-12x128"
if not (built / "model.safetensors").is_file():
    shutil.copytree(target, built, dirs_exist_ok=True)
    build_tiny_llama(built, vocab_size=vocab, hidden_size=128, layers=12, intermediate=256)
env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "include")}
base = yaml.safe_load(write_run_config(root, str(built), shards=2, in_flight=2).read_text())
steps = -(-N // 4)
base["train"] = {"device": "cpu", "max_steps": steps, "batch_size": 4, "ttt_length": 3, "draft_vocab_size": 256,
                 "checkpoint_every": 50, "log_every": 50, "warmup_steps": 5, "seed": 0}
base["watchdog"] = {"poll_interval_s": 2, "stall_after_s": 60, "startup_grace_s": 60}
corpus = root / "corpus.parquet"
if not corpus.exists():
    write_corpus(corpus, N, vocab, seed=0, min_len=96, max_len=320)
def cfg(name, stream):
    d = json.loads(json.dumps(base)); d["stream"] = stream
    p = root / f"config-{name}.yaml"; p.write_text(yaml.safe_dump(d)); return p
for mode in modes:
    c = cfg(mode, {"storage": "disk"} if mode == "offline" else
            {"storage": "mooncake", "buffer_gib": 1.0, "shuffle_window": 64, "put_timeout_s": 600})
    rid = f"{mode}-{tag}"
    rdir = Path(str(load_config(c).run_dir(rid))); shutil.rmtree(rdir, ignore_errors=True)
    (rdir / "corpus").mkdir(parents=True); shutil.copy(corpus, rdir / "corpus" / "corpus.parquet")
    ra = ["--config", str(c), "--run-id", rid]
    if mode != "offline":
        info = json.loads(run(["store", "start", *ra, "--timeout", "120"], env=env).stdout.strip().splitlines()[-1])
    try:
        info_file = Path(str(RunLayout.for_run(load_config(c), rid).server_info_file))
        with CaptureServer(ra, info_file, None, root / f"{rid}.server.log", env) as srv:
            srv.wait_ready()
            procs = {f"s{s}": popen(["capture", "run", *ra, "--shard", str(s)], None, root / f"{rid}.s{s}.log", env) for s in range(2)}
            wait_all(procs, 1800, {k: root / f"{rid}.{k}.log" for k in procs})
        if mode == "offline":
            run(["capture", "verify", *ra], env=env)
        prof = OUT / f"{rid}.prof"
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "eagleflow.cli", "train", *ra],
                           cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {1}))
        (root / f"{rid}.train.log").write_text(p.stdout + p.stderr)
        if p.returncode: print(p.stdout[-3000:], p.stderr[-3000:]); raise SystemExit(1)
        rows = [json.loads(x) for x in (rdir / "draft" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        ts = [r["time"] for r in rows]
        print(f"{rid}: train wall {time.time()-t0:.1f}s steps {len(rows)} steps/s {(len(ts)-1)/(ts[-1]-ts[0]):.2f} load {os.getloadavg()}", flush=True)
    finally:
        if mode != "offline":
            run(["store", "stop", *ra, "--grace", "5"], env=env)
