"""Streaming against offline (issue 53): capture plus training of the same corpus on the same target, side by side.

Each round runs both ways on the same corpus (the same ``corpus.parquet``, written once and copied into each run)
and target (the tiny demo Llama, hf capture server), through the node CLI only, the capture side (its server and
its ``eagleflow capture run`` workers) pinned to one core and the training side (``eagleflow train``, and for
streaming the store's master and segment holder) to the other, as on separate GPUs; every process one torch thread.

* **offline** (``stream.storage: disk``): the capture server, every shard's worker writing safetensors files,
  ``eagleflow capture verify``, then ``eagleflow train``;
* **streaming** (``stream.storage: mooncake``): ``eagleflow store start``, ``eagleflow train`` (waiting for the
  first sample), the capture server and the same workers putting into the store while it trains,
  ``eagleflow store stop``.

Measured per run, from the run's start (the corpus prepared, nothing started): hidden-state bytes on disk at peak
(``*.safetensors`` under ``hidden_states/``, sampled every 0.2 s and at the end of capture), the store's allocated
bytes at peak (the master's ``master_allocated_bytes``, sampled every 50 ms) against ``stream.buffer_gib``, the
time to the first training step (its ``metrics.jsonl`` row), training steps per second (steps 2..N over their
``metrics.jsonl`` times; for streaming also over the steps that ended after capture had finished, where the
loader cannot have waited for the producer, and the checkpoints taken), and wall time of capture plus training.
Rounds alternate (offline, streaming, offline, ...); the ratios streaming / offline are per round and their median.

``--control``: per round a third run, **offline beside a capture**: the offline run's verified hidden states
(hard links) trained again while a capture of the same corpus (to disk, a run of its own) runs on the capture
core. A streaming trainer always trains beside its capture; offline trains alone. On this 2-core machine the two
cores share a cache and the memory bus, which separate GPUs do not, so the control says how much of the streaming
trainer's steps/s goes to the neighbour's work, not to streaming: its steps/s over the steps that ended while the
capture ran, and the ratio of the streaming trainer's (producer kept up) to it.

    .venv/bin/python bench/stream_vs_offline.py [--rounds 2] [--samples 960] [--json bench/results/stream_vs_offline.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_runs import REPO, CaptureServer, popen, run, stream_run, wait_all  # noqa: E402

sys.path.insert(0, str(REPO))
import yaml  # noqa: E402

CAPTURE_CORE, TRAIN_CORE = {0}, {1}
STORE_CORES = {"training": TRAIN_CORE, "capture": CAPTURE_CORE, "any": None}


def hidden_state_bytes(hs: Path) -> int:
    total = 0
    for p in hs.rglob("*.safetensors") if hs.is_dir() else ():
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


class DiskPeak:
    """Hidden-state bytes on disk under a run's hidden_states/, sampled until stopped."""

    def __init__(self, hs: Path, every_s: float = 0.2):
        self.hs, self.every_s, self.peak = hs, every_s, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, hidden_state_bytes(self.hs))
            time.sleep(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._t.join(5)
        self.peak = max(self.peak, hidden_state_bytes(self.hs))
        return self.peak


def training_figures(metrics_file: Path, t0: float, capture_done: float | None, window: int = 0) -> dict:
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    times = [r["time"] for r in rows]
    out = {"steps": len(rows), "first_step_s": times[0] - t0, "last_step_s": times[-1] - t0,
           "steps_per_s": (len(rows) - 1) / (times[-1] - times[0]) if len(rows) > 1 else None}
    # when the producer keeps up: steps 2..N over their time less the seconds their draws waited for a sample
    # (the trainer's own producer_wait_s a step; offline has none: the same figure as steps_per_s)
    waited = sum(float(r.get("producer_wait_s", 0.0)) for r in rows[1:])
    out["producer_wait_s"] = waited
    out["steps_per_s_kept_up"] = ((len(rows) - 1) / (times[-1] - times[0] - waited)
                                  if len(rows) > 1 and times[-1] - times[0] > waited else None)
    # the producer ahead, as the goal means it: steps whose batches were drawn from a full shuffle window (the
    # trainer's stream_window; the loader never waiting is not enough: a trainer as fast as capture draws every
    # batch from the few samples just put, never waiting, at the producer's pace)
    full = [(a, b) for a, b in zip(rows[1:], rows[2:]) if (b.get("stream_window") or 0) >= window] if window else []
    if full:
        out["steps_window_full"] = len(full)
        out["steps_per_s_window_full"] = len(full) / sum(b["time"] - a["time"] for a, b in full)
    if capture_done is not None:
        # steps that began after capture had finished: every sample was in the store, the loader never waited
        after = [t for t in times if t > capture_done]
        if len(after) > 2:
            out["steps_after_capture"] = len(after)
            out["steps_per_s_after_capture"] = (len(after) - 1) / (after[-1] - after[0])
    return out


def checkpoints_taken(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("checkpoint ") or " checkpoint /" in line)


def offline_run(cfgp: Path, run_id: str, shards: int, logs: Path, env: dict, rdir: Path) -> dict:
    t0 = time.time()
    ra = ["--config", str(cfgp), "--run-id", run_id]
    disk = DiskPeak(rdir / "hidden_states")
    out: dict = {}
    try:
        from eagleflow.config import load_config
        from eagleflow.layout import RunLayout
        info_file = Path(str(RunLayout.for_run(load_config(cfgp), run_id).server_info_file))
        with CaptureServer(ra, info_file, CAPTURE_CORE, logs / f"{run_id}.server.log",
                           env) as srv:
            srv.wait_ready()
            out["server_ready_s"] = time.time() - t0
            procs, plogs = {}, {}
            for s in range(shards):
                plogs[f"shard {s}"] = logs / f"{run_id}.shard{s}.log"
                procs[f"shard {s}"] = popen(["capture", "run", *ra, "--shard", str(s)], CAPTURE_CORE,
                                            plogs[f"shard {s}"], env)
            wait_all(procs, 3600, plogs)
        out["capture_done_s"] = time.time() - t0
        run(["capture", "verify", *ra], CAPTURE_CORE, env=env)
        out["verified_s"] = time.time() - t0
        tlog = logs / f"{run_id}.train.log"
        wait_all({"train": popen(["train", *ra], TRAIN_CORE, tlog, env)}, 3600, {"train": tlog})
        out["train_done_s"] = time.time() - t0
    finally:
        out["disk_peak_bytes"] = disk.stop()
    out["wall_s"] = out["train_done_s"]
    out |= training_figures(rdir / "draft" / "metrics.jsonl", t0, None)
    out["checkpoints"] = checkpoints_taken(logs / f"{run_id}.train.log")
    return out


def streaming_run(cfgp: Path, run_id: str, shards: int, logs: Path, env: dict, rdir: Path,
                  store_on: str = "training", window: int = 0, head_start: int = 0) -> dict:
    t0 = time.time()
    disk = DiskPeak(rdir / "hidden_states")
    try:
        out = stream_run(cfgp, run_id, shards, capture_cores=CAPTURE_CORE, train_cores=TRAIN_CORE,
                         store_cores=STORE_CORES[store_on], logs=logs, env=env, t0=t0, head_start=head_start)
    finally:
        disk_peak = disk.stop()
    out["disk_peak_bytes"] = disk_peak
    out["wall_s"] = max(out["capture_done_s"], out["train_done_s"])
    out |= training_figures(rdir / "draft" / "metrics.jsonl", t0 + 0, t0 + out["capture_done_s"], window)
    out["checkpoints"] = checkpoints_taken(logs / f"{run_id}.train.log")
    ver = json.loads((rdir / "hidden_states" / "stream_verified.json").read_text())
    out["exactly_once"] = ver["ok"]
    out["manifest_bytes"] = sum(json.loads(x)["bytes"] for m in (rdir / "hidden_states").glob("shard_*/manifest.jsonl")
                                for x in m.read_text().splitlines() if x.strip())
    out.pop("endpoint", None)
    return out


def offline_beside_capture(cfgp: Path, src: Path, run_id: str, neighbour_id: str, shards: int, logs: Path,
                           env: dict, prepared) -> dict:
    """The control: ``src``'s hidden states (an offline run's, hard-linked, verified again) trained on the training
    core while a capture of the same corpus into another run writes to disk on the capture core."""
    rdir, ndir = prepared(cfgp, run_id), prepared(cfgp, neighbour_id)
    shutil.copytree(src / "hidden_states", rdir / "hidden_states", copy_function=os.link)
    ra, na = ["--config", str(cfgp), "--run-id", run_id], ["--config", str(cfgp), "--run-id", neighbour_id]
    run(["capture", "verify", *ra], CAPTURE_CORE, env=env)
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    info_file = Path(str(RunLayout.for_run(load_config(cfgp), neighbour_id).server_info_file))
    t0 = time.time()
    with CaptureServer(na, info_file, CAPTURE_CORE, logs / f"{neighbour_id}.server.log", env) as srv:
        srv.wait_ready()
        procs = {f"shard {s}": popen(["capture", "run", *na, "--shard", str(s)], CAPTURE_CORE,
                                     logs / f"{neighbour_id}.shard{s}.log", env) for s in range(shards)}
        tlog = logs / f"{run_id}.train.log"
        train = popen(["train", *ra], TRAIN_CORE, tlog, env)
        wait_all(procs, 3600, {k: logs / f"{neighbour_id}.shard{k.split()[1]}.log" for k in procs})
    capture_done = time.time()
    wait_all({"train": train}, 3600, {"train": tlog})
    shutil.rmtree(ndir / "hidden_states", ignore_errors=True)
    rows = [json.loads(x) for x in (rdir / "draft" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    during = [r["time"] for r in rows if r["time"] <= capture_done]
    out = {"neighbour_capture_s": capture_done - t0, "train_done_s": time.time() - t0, "steps": len(rows),
           "steps_beside_capture": len(during),
           "steps_per_s_beside_capture": (len(during) - 1) / (during[-1] - during[0]) if len(during) > 2 else None}
    out |= {k: v for k, v in training_figures(rdir / "draft" / "metrics.jsonl", t0, None).items()
            if k in ("steps_per_s",)}
    return out


RATIOS = {"steps_per_s_kept_up": "training steps/s, the producer's waits left out",
          "steps_per_s": "training steps/s (all steps, waits for the producer included)",
          "first_step_s": "time to the first step", "wall_s": "wall time, capture + training"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=960)
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--buffer-fraction", type=float, default=0.25, help="stream.buffer_gib as a fraction of the "
                    "corpus's hidden-state bytes (measured on the first offline run; < 1: capture must wait)")
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--store-on", choices=sorted(STORE_CORES), default="training", help="the cores of the store's "
                    "master and segment holder: the training core (the store lives on the training node), the "
                    "capture core, or any (on a GPU node they run on its host CPUs, neither GPU)")
    ap.add_argument("--target-layers", type=int, default=0, help="build a Llama target of this many layers (the "
                    "demo's tokenizer and vocabulary, --target-hidden wide) in the work dir, so capture costs about "
                    "what training does; 0 = the demo's tiny target (8 layers, hidden 64)")
    ap.add_argument("--target-hidden", type=int, default=128)
    ap.add_argument("--head-start", type=int, default=0, help="per round also a streaming run whose trainer starts "
                    "once capture has put this many samples: its steps drawn from a full shuffle window are the "
                    "'producer keeps up' figure (else the streaming run's own such steps)")
    ap.add_argument("--control", action="store_true", help="per round also offline training beside a capture of "
                    "the same corpus on the capture core (the machine's own interference; see above)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores (one for capture, one for training)")
    from eagleflow.demo_assets import ensure_demo_assets
    from tests.fixtures.capture_corpus import write_corpus, write_run_config

    t_all = time.time()
    assets = ensure_demo_assets(REPO / ".cache" / "test-assets", n_per_source=24, fit_target=False)   # the tests' own
    target = assets["target_model"]
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    root = Path(a.dir or tempfile.mkdtemp(prefix="eagleflow-stream-vs-offline-"))
    if a.target_layers:
        from eagleflow.demo_assets import build_tiny_llama
        built = root / f"target-{a.target_layers}x{a.target_hidden}"
        if not (built / "model.safetensors").is_file():
            shutil.copytree(target, built, dirs_exist_ok=True)     # the tokenizer and chat template
            build_tiny_llama(built, vocab_size=vocab, hidden_size=a.target_hidden, layers=a.target_layers,
                             intermediate=2 * a.target_hidden)
        target = str(built)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "include")}
    base = yaml.safe_load(write_run_config(root, target, shards=a.shards, in_flight=a.in_flight).read_text())
    steps = -(-a.samples // a.batch)      # one epoch
    base["train"] = {"device": "cpu", "max_steps": steps, "batch_size": a.batch, "ttt_length": a.ttt,
                     "draft_vocab_size": 256, "checkpoint_every": a.checkpoint_every, "log_every": 50,
                     "warmup_steps": 5, "seed": 0}
    base["watchdog"] = {"poll_interval_s": 2, "stall_after_s": 60, "startup_grace_s": 60}
    corpus = root / "corpus.parquet"
    rows = write_corpus(corpus, a.samples, vocab, seed=0, min_len=a.min_len, max_len=a.max_len)
    tokens = sum(r["num_tokens"] for r in rows)
    print(f"corpus: {a.samples} samples, {tokens:,} tokens ({a.min_len}-{a.max_len} a sample); target {target}; "
          f"{a.shards} shards x {a.in_flight} in flight; train batch {a.batch}, ttt {a.ttt}, {steps} steps "
          f"(one epoch), checkpoint every {a.checkpoint_every}; capture on core {min(CAPTURE_CORE)}, training on "
          f"core {min(TRAIN_CORE)}, 1 torch thread each; load average {os.getloadavg()}", flush=True)

    def config(name: str, stream: dict) -> Path:
        data = json.loads(json.dumps(base))
        data["stream"] = stream
        p = root / f"config-{name}.yaml"
        p.write_text(yaml.safe_dump(data))
        return p

    def prepared(cfgp: Path, run_id: str) -> Path:
        from eagleflow.config import load_config
        rdir = Path(str(load_config(cfgp).run_dir(run_id)))
        shutil.rmtree(rdir, ignore_errors=True)
        (rdir / "corpus").mkdir(parents=True)
        shutil.copy(corpus, rdir / "corpus" / "corpus.parquet")
        return rdir

    off_cfg = config("offline", {"storage": "disk"})
    results: dict = {"args": vars(a), "samples": a.samples, "tokens": tokens, "steps": steps, "rounds": []}
    buffer_bytes = None
    st_cfg = None
    for r in range(a.rounds):
        rnd: dict = {"load_before": os.getloadavg()}
        # alternating; round 0 offline first: the buffer is sized on its bytes
        for mode in ("offline", "streaming") if r % 2 == 0 else ("streaming", "offline"):
            run_id = f"{mode}-r{r}"
            if mode == "offline":
                rdir = prepared(off_cfg, run_id)
                fig = offline_run(off_cfg, run_id, a.shards, logs, env, rdir)
                if buffer_bytes is None:
                    buffer_bytes = int(fig["disk_peak_bytes"] * a.buffer_fraction)
                    st_cfg = config("streaming", {"storage": "mooncake", "buffer_gib": buffer_bytes / 2**30,
                                                  "shuffle_window": a.shuffle_window, "put_timeout_s": 600})
                    results["buffer_bytes"] = buffer_bytes
            else:
                assert st_cfg is not None
                rdir = prepared(st_cfg, run_id)
                fig = streaming_run(st_cfg, run_id, a.shards, logs, env, rdir, a.store_on, a.shuffle_window)
                fig["buffer_bytes"] = buffer_bytes
            fig["load_after"] = os.getloadavg()
            rnd[mode] = fig
            print(f"round {r} {mode}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in fig.items() if not isinstance(v, (dict, list, tuple))),
                  flush=True)
        if a.head_start:
            # the producer ahead: the trainer starts once capture has put head_start samples, and its steps whose
            # batches came from a full shuffle window are the "producer keeps up" figure
            assert st_cfg is not None
            rdir = prepared(st_cfg, f"ahead-r{r}")
            fig = streaming_run(st_cfg, f"ahead-r{r}", a.shards, logs, env, rdir, a.store_on, a.shuffle_window,
                                head_start=a.head_start)
            fig["load_after"] = os.getloadavg()
            rnd["streaming_ahead"] = fig
            print(f"round {r} streaming, {a.head_start} samples ahead: " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in fig.items()
                if not isinstance(v, (dict, list, tuple))), flush=True)
        if a.control:
            from eagleflow.config import load_config
            src = Path(str(load_config(off_cfg).run_dir(f"offline-r{r}")))
            fig = offline_beside_capture(off_cfg, src, f"control-r{r}", f"neighbour-r{r}", a.shards, logs, env,
                                         prepared)
            fig["load_after"] = os.getloadavg()
            rnd["offline_beside_capture"] = fig
            print(f"round {r} offline beside a capture: " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in fig.items()
                if not isinstance(v, (dict, list, tuple))), flush=True)
        rnd["ratios"] = {k: rnd["streaming"][k] / rnd["offline"][k] for k in RATIOS}
        ahead = rnd.get("streaming_ahead", rnd["streaming"])
        rnd["ratios"]["steps_per_s_window_full"] = (ahead.get("steps_per_s_window_full", float("nan"))
                                                    / rnd["offline"]["steps_per_s"])
        rnd["ratios"]["steps_per_s_after_capture"] = (rnd["streaming"].get("steps_per_s_after_capture", float("nan"))
                                                      / rnd["offline"]["steps_per_s"])
        if a.control and rnd["offline_beside_capture"]["steps_per_s_beside_capture"]:
            c = rnd["offline_beside_capture"]
            rnd["ratios"]["offline_beside_capture"] = c["steps_per_s_beside_capture"] / rnd["offline"]["steps_per_s"]
            rnd["ratios"]["steps_per_s_kept_up_vs_beside_capture"] = (rnd["streaming"]["steps_per_s_kept_up"]
                                                                     / c["steps_per_s_beside_capture"])
        results["rounds"].append(rnd)
    report(results)
    results["seconds"] = round(time.time() - t_all, 1)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _join(values, fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def report(results: dict) -> None:
    rounds = results["rounds"]
    med = lambda v: statistics.median(v)  # noqa: E731
    o = [r["offline"] for r in rounds]
    s = [r["streaming"] for r in rounds]
    print(f"\nstreaming against offline, {len(rounds)} round(s), {results['samples']} samples, "
          f"{results['steps']} steps; per round, then the median:")
    print(f"  hidden-state bytes on disk at peak: offline {_join([x['disk_peak_bytes'] / 2**20 for x in o])} MiB; "
          f"streaming {_join([x['disk_peak_bytes'] for x in s], '{}')} bytes")
    print(f"  store's allocated bytes at peak: {_join([x['store_peak_bytes'] / 2**20 for x in s])} MiB against "
          f"stream.buffer_gib {results['buffer_bytes'] / 2**20:.2f} MiB (corpus "
          f"{s[0]['manifest_bytes'] / 2**20:.2f} MiB); every sample exactly once: {all(x['exactly_once'] for x in s)}")
    for key, label in (("first_step_s", "time to the first step, s"),
                       ("steps_per_s_kept_up", "training steps/s, the producer's waits left out"),
                       ("steps_per_s", "training steps/s, all steps"), ("wall_s", "wall time capture + training, s")):
        ratios = [r["ratios"][key] for r in rounds]
        print(f"  {label}: offline {_join([x[key] for x in o])}; streaming {_join([x[key] for x in s])}; ratio "
              f"{_join(ratios, '{:.3f}')} (median {med(ratios):.3f})")
    if all("offline_beside_capture" in r["ratios"] for r in rounds):
        c = [r["offline_beside_capture"] for r in rounds]
        print(f"  control, offline training beside a capture of the same corpus on the other core: steps/s "
              f"{_join([x['steps_per_s_beside_capture'] for x in c])} over {_join([x['steps_beside_capture'] for x in c], '{}')} "
              f"steps, ratio to offline alone {_join([r['ratios']['offline_beside_capture'] for r in rounds], '{:.3f}')}; "
              f"streaming (kept up) against it {_join([r['ratios']['steps_per_s_kept_up_vs_beside_capture'] for r in rounds], '{:.3f}')} "
              f"(median {med([r['ratios']['steps_per_s_kept_up_vs_beside_capture'] for r in rounds]):.3f})")
    sa = [r.get("streaming_ahead", r["streaming"]) for r in rounds]
    ratios = [r["ratios"]["steps_per_s_window_full"] for r in rounds]
    print(f"  training steps/s with the producer ahead (batches from a full shuffle window"
          f"{', the trainer started ' + str(results['args']['head_start']) + ' samples behind' if results['args'].get('head_start') else ''}): "
          f"streaming {_join([x.get('steps_per_s_window_full', float('nan')) for x in sa])} over "
          f"{_join([x.get('steps_window_full') for x in sa], '{}')} of {_join([x['steps'] for x in sa], '{}')} steps, "
          f"capture done at {_join([x['capture_done_s'] for x in sa])} s, training started at "
          f"{_join([x.get('train_start_s', float('nan')) for x in sa])} s; ratio to offline {_join(ratios, '{:.3f}')} "
          f"(median {med(ratios):.3f})")
    print(f"  streaming steps/s over the steps after capture ended (the loader never waited): "
          f"{_join([x.get('steps_per_s_after_capture', float('nan')) for x in s])} over "
          f"{_join([x.get('steps_after_capture') for x in s], '{}')} steps; ratio to offline "
          f"{_join([r['ratios']['steps_per_s_after_capture'] for r in rounds], '{:.3f}')}")
    print(f"  checkpoints: offline {_join([x['checkpoints'] for x in o], '{}')}; streaming "
          f"{_join([x['checkpoints'] for x in s], '{}')}")
    print(f"  capture done at, s from the start: offline {_join([x['capture_done_s'] for x in o])}; streaming "
          f"{_join([x['capture_done_s'] for x in s])}")
    results["median_ratios"] = {k: med([r["ratios"][k] for r in rounds]) for k in rounds[0]["ratios"]}
    print(f"  streaming trainer's waits for the producer: {_join([x['producer_wait_s'] for x in s])} s")
    goals = {"steps_per_s_window_full": (">=", 0.9), "first_step_s": ("<=", 0.1), "wall_s": ("<=", 0.7)}
    results["goals"] = {k: {"goal": f"{op} {v}", "median": results["median_ratios"][k],
                            "met": results["median_ratios"][k] >= v if op == ">=" else results["median_ratios"][k] <= v}
                        for k, (op, v) in goals.items()}
    labels = {**RATIOS, "steps_per_s_window_full": "training steps/s when the producer keeps up (a full window)"}
    print("  goals: " + "; ".join(f"{labels[k]} {g['median']:.3f} {g['goal']}: {'met' if g['met'] else 'NOT met'}"
                                  for k, g in results["goals"].items()))


if __name__ == "__main__":
    sys.exit(main())
