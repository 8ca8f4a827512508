"""Stall detection latency and false alarms, measured side by side in one run.

Phase A: a real extraction (hf capture server with a tiny local model, the CLI
worker, both detached as in production) is frozen ``--cycles`` times by
SIGSTOPping the server mid-shard (the seeds' failure: the worker lives on,
progress stops). Each time, the real ShardWatchTrigger (one `eagleflow watch`
per poll) runs until it yields; latency = event time - the heartbeat's last
progress. Then SIGCONT and the same shard goes on.

Phase B: the same watch config over a slow but healthy extraction (each
forward sleeps ``--slow-forward-s``, longer than the poll interval and than
stall_after) for as long as phase A took; every event that is not "complete"
is a false alarm.

    .venv/bin/python bench/stall.py            # ~4 min on 2 CPU cores
    .venv/bin/python bench/stall.py --cycles 3 --quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagleflow.airflow.runtime import RunContext  # noqa: E402
from eagleflow.airflow.shard_watch import ShardWatchTrigger  # noqa: E402
from eagleflow.capture.hf_server import DELAY_ENV  # noqa: E402
from eagleflow.capture.lifecycle import (LocalRun, start_capture_server, start_or_attach_worker,  # noqa: E402
                                         stop_capture_server, stop_worker, wait_capture_server_ready)
from eagleflow.config import load_config  # noqa: E402
from eagleflow.demo_assets import ensure_demo_assets  # noqa: E402
from eagleflow.heartbeat import Heartbeat  # noqa: E402
from eagleflow.layout import RunLayout  # noqa: E402
from tests.fixtures.capture_corpus import write_corpus  # noqa: E402


def make_run(root: Path, model: str, run_id: str, watch: dict, n: int) -> LocalRun:
    data = {"run_root": str(root / "runs"), "target_model": model,
            "node": {"name": "bench-node", "has_gpu": False, "state_dir": str(root / "state")},
            "capture": {"backend": "hf", "port": 0, "dump_dir": str(root / "dumps"), "shards": 1, "in_flight": 1,
                        "ready_timeout_s": 180, "heartbeat_interval_s": 0.5, "request_timeout_base_s": 600},
            "watchdog": watch}
    cfgp = root / f"{run_id}.json"
    cfgp.write_text(json.dumps(data))
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, run_id)
    RunContext(cfg=cfg, layout=layout).write_run_config()
    write_corpus(Path(str(layout.corpus_dir)) / "corpus.parquet", n, 300, seed=1)
    return LocalRun(cfg=cfg, layout=layout, config_path=str(layout.run_dir / "run-config.json"))


async def first_event(run: LocalRun, timeout_s: float) -> dict:
    agen = ShardWatchTrigger(RunContext(cfg=run.cfg, layout=run.layout).serialize(), 0).run()
    try:
        return (await asyncio.wait_for(agen.__anext__(), timeout_s)).payload
    finally:
        await agen.aclose()


def heartbeat(run: LocalRun) -> Heartbeat:
    return Heartbeat.read(str(run.layout.heartbeat_file(0)))


def server_pid(run: LocalRun) -> int:
    return json.loads(Path(str(run.layout.pid_file("capture_server"))).read_text())["pid"]


def start(run: LocalRun, forward_delay_s: float) -> None:
    os.environ[DELAY_ENV] = str(forward_delay_s)
    start_capture_server(run)
    wait_capture_server_ready(run, timeout_s=180, poll_s=0.5)
    start_or_attach_worker(run, 0)


def stop(run: LocalRun) -> None:
    stop_worker(run, 0, grace_s=3)
    try:
        os.killpg(server_pid(run), signal.SIGCONT)
    except (OSError, ValueError):
        pass
    stop_capture_server(run, grace_s=3)


def wait_progress(run: LocalRun, more: int, timeout_s: float = 120) -> None:
    hb = heartbeat(run)
    base = hb.done if hb else 0
    deadline = time.monotonic() + timeout_s
    while True:
        hb = heartbeat(run)
        if hb and hb.state == "running" and hb.done >= base + more:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no progress within {timeout_s} s; see {run.layout.log_file('worker_shard_00000')}")
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--poll-s", type=float, default=5.5)
    ap.add_argument("--stall-after-s", type=float, default=1.5)
    ap.add_argument("--health-timeout-s", type=float, default=5.0)
    ap.add_argument("--slow-forward-s", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="phase B as long as phase A, but at most 60 s")
    args = ap.parse_args()

    watch = {"poll_interval_s": args.poll_s, "stall_after_s": args.stall_after_s,
             "health_timeout_s": args.health_timeout_s, "startup_grace_s": 60.0, "gpu_window_s": 10.0,
             "d_state_after_s": 10.0}
    assets = ensure_demo_assets(str(REPO / ".cache" / "test-assets"), n_per_source=24)
    root = Path(tempfile.mkdtemp(prefix="eagleflow-bench-stall-"))
    cfg_bound = load_config(data={"target_model": "x", "watchdog": watch}).watchdog.detection_bound_s
    print(f"watch config: poll {args.poll_s} s, stall_after {args.stall_after_s} s, health timeout "
          f"{args.health_timeout_s} s -> detection bound {cfg_bound:.1f} s; workdir {root}", flush=True)

    # Phase A: injected stalls
    a = make_run(root, assets["target_model"], "stalls", watch, n=3000)
    latencies, diagnoses = [], []
    t_a = time.monotonic()
    try:
        start(a, 0.05)
        rng = random.Random(0)
        for i in range(args.cycles):
            pid = server_pid(a)

            async def cycle() -> dict:
                # the watch is already running when the stall hits, at a random phase of its poll
                watch_task = asyncio.create_task(first_event(a, cfg_bound * 3 + 60))
                await asyncio.sleep(rng.uniform(0, args.poll_s))
                await asyncio.to_thread(wait_progress, a, 1)
                os.kill(pid, signal.SIGSTOP)
                return await watch_task
            ev = asyncio.run(cycle())
            t_ev = time.time()
            lat = t_ev - heartbeat(a).last_progress_at
            os.kill(pid, signal.SIGCONT)
            latencies.append(lat)
            diagnoses.append(ev.get("verdict"))
            print(f"  stall {i + 1:>2}: {ev.get('verdict', ev['status']):<8} after {lat:5.1f} s "
                  f"({lat / cfg_bound:.2f} of the bound)", flush=True)
    finally:
        stop(a)
    dur_a = time.monotonic() - t_a

    # Phase B: slow but healthy, same watch config, same length
    b = make_run(root, assets["target_model"], "slow", watch, n=3000)
    dur_b_target = min(dur_a, 60.0) if args.quick else dur_a
    false_alarms, events, done_before = [], 0, 0
    t_b = time.monotonic()
    try:
        start(b, args.slow_forward_s)
        done_before = heartbeat(b).done if heartbeat(b) else 0
        while (left := dur_b_target - (time.monotonic() - t_b)) > 0:
            try:
                ev = asyncio.run(first_event(b, left))
            except (asyncio.TimeoutError, TimeoutError):
                break
            events += 1
            if ev["status"] != "complete":
                false_alarms.append(ev.get("diagnosis", "").splitlines()[0])
                print(f"  FALSE ALARM: {false_alarms[-1]}", flush=True)
    finally:
        done_b = heartbeat(b).done if heartbeat(b) else 0
        stop(b)
    dur_b = time.monotonic() - t_b

    stalled = sum(1 for d in diagnoses if d == "stalled")
    print()
    print(f"{'':<34}{'value':>10}{'bound':>10}{'ratio':>8}")
    print(f"{'stalls injected / caught':<34}{args.cycles:>10}{stalled:>10}{stalled / max(args.cycles, 1):>8.2f}")
    print(f"{'detection latency median (s)':<34}{statistics.median(latencies):>10.1f}{cfg_bound:>10.1f}"
          f"{statistics.median(latencies) / cfg_bound:>8.2f}")
    print(f"{'detection latency max (s)':<34}{max(latencies):>10.1f}{cfg_bound:>10.1f}{max(latencies) / cfg_bound:>8.2f}")
    print(f"{'slow-but-healthy run (s)':<34}{dur_b:>10.1f}{dur_a:>10.1f}{dur_b / dur_a:>8.2f}")
    print(f"{'  samples done in it':<34}{done_b - done_before:>10}")
    print(f"{'  false alarms':<34}{len(false_alarms):>10}")
    return 0 if stalled == args.cycles and not false_alarms and max(latencies) <= cfg_bound + 2 else 1


if __name__ == "__main__":
    sys.exit(main())
