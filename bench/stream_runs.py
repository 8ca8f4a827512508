"""A streaming run through the node CLI, for benchmarks (issue 53): what tests/integration/test_stream_run.py does.

``eagleflow store start`` (the run's Mooncake master and segment holder, recorded processes), ``eagleflow capture
serve`` (the run's capture server, in the foreground here, stopped by its PID), ``eagleflow train`` started first
(it waits for the first sample) and one ``eagleflow capture run`` per shard putting into the store while it trains,
then ``eagleflow store stop``. Only the node CLI is called (no capture module imported), each process pinned to
the cores given (``os.sched_setaffinity`` before exec: the capture side and the training side as on separate GPUs).
The store's own allocated bytes (``master_allocated_bytes``) are sampled while it runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))


def argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagleflow.cli", *args]


def popen(args: list[str], cores: set[int] | None, log: Path, env: dict | None = None) -> subprocess.Popen:
    """``eagleflow ARGS`` in the background, pinned to ``cores``, its output to ``log``."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "w")
    p = subprocess.Popen(argv(*args), stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         preexec_fn=pin, env=env)
    out.close()
    return p


def run(args: list[str], cores: set[int] | None = None, timeout: float = 600, env: dict | None = None
        ) -> subprocess.CompletedProcess:
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    p = subprocess.run(argv(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO, preexec_fn=pin,
                       env=env)
    if p.returncode != 0:
        raise SystemExit(f"eagleflow {' '.join(args)} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    return p


def stop(p: subprocess.Popen, grace: float = 10) -> None:
    """One process we started, by its PID: TERM, grace, KILL."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_all(procs: dict[str, subprocess.Popen], timeout: float, logs: dict[str, Path]) -> None:
    deadline = time.monotonic() + timeout
    for name, p in procs.items():
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{name} still running after {timeout:g} s; log {logs[name]}") from None
        if p.returncode != 0:
            raise SystemExit(f"{name} failed (exit {p.returncode}):\n{logs[name].read_text()[-4000:]}")


class CaptureServer:
    """``eagleflow capture serve`` in the foreground of a process we own; ready once its info file names a URL
    that answers /health_generate."""

    def __init__(self, run_args: list[str], info_file: Path, cores: set[int] | None, log: Path,
                 env: dict | None = None):
        self.run_args, self.info_file, self.cores, self.log, self.env = run_args, info_file, cores, log, env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "CaptureServer":
        self.info_file.unlink(missing_ok=True)
        self.proc = popen(["capture", "serve", *self.run_args], self.cores, self.log, self.env)
        return self

    def wait_ready(self, timeout: float = 300) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"capture server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                url = json.loads(self.info_file.read_text())["url"]
                with urllib.request.urlopen(f"{url}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        return url
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise SystemExit(f"capture server not ready after {timeout:g} s: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop(self.proc)


class StorePeak:
    """The run store's own allocated bytes (the master's metrics), sampled every ``every_s`` until stopped."""

    def __init__(self, endpoint_file: str, every_s: float = 0.05):
        from eagleflow.stores.mooncake.master import MooncakeEndpoint
        self.ep = MooncakeEndpoint.read(endpoint_file)
        self.every_s, self.peak, self.samples, self.keys_peak = every_s, 0, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def read(self) -> dict[str, float]:
        from eagleflow.stores.mooncake.master import metrics
        return metrics(self.ep)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                m = self.read()
                self.peak = max(self.peak, int(m["master_allocated_bytes"]))
                self.keys_peak = max(self.keys_peak, int(m.get("master_key_count", 0)))
                self.samples += 1
            except (OSError, KeyError):
                pass
            time.sleep(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._t.join(5)
        return self.peak


def stream_run(config: Path, run_id: str, shards: int, *, capture_cores: set[int] | None = None,
               train_cores: set[int] | None = None, store_cores: set[int] | None = None,
               train_args: tuple[str, ...] = (), logs: Path,
               env: dict | None = None, timeout: float = 3600, t0: float | None = None, head_start: int = 0) -> dict:
    """One streaming run on a prepared corpus (``corpus prepare`` done): the store started, the trainer and the
    capture workers running together, the store stopped. Returns its figures: seconds from ``t0`` (default now)
    to the store ready, the capture server ready, capture done, training done; the store's peak allocated bytes
    and key count; the store's endpoint file. ``head_start``: the trainer starts only once the shards' manifests
    record that many samples (the producer ahead of the trainer from the start; ``train_start_s`` says when)."""
    t0 = time.time() if t0 is None else t0
    ra = ["--config", str(config), "--run-id", run_id]
    # the store's master and segment holder: on ``store_cores`` (None: wherever the OS puts them)
    started = run(["store", "start", *ra, "--timeout", "120"], store_cores, env=env)
    info = json.loads(started.stdout.strip().splitlines()[-1])
    out: dict = {"store_ready_s": time.time() - t0, "endpoint": info}
    peak = StorePeak(info["endpoint_file"])
    procs: dict[str, subprocess.Popen] = {}
    plogs: dict[str, Path] = {}
    try:
        from eagleflow.config import load_config
        from eagleflow.layout import RunLayout
        info_file = Path(str(RunLayout.for_run(load_config(config), run_id).server_info_file))
        with CaptureServer(ra, info_file, capture_cores, logs / f"{run_id}.server.log", env) as srv:
            plogs["train"] = logs / f"{run_id}.train.log"

            def start_trainer() -> None:
                procs["train"] = popen(["train", *ra, *train_args], train_cores, plogs["train"], env)
                out["train_start_s"] = time.time() - t0
            if not head_start:
                start_trainer()
            srv.wait_ready()
            out["server_ready_s"] = time.time() - t0
            for s in range(shards):
                plogs[f"shard {s}"] = logs / f"{run_id}.shard{s}.log"
                procs[f"shard {s}"] = popen(["capture", "run", *ra, "--shard", str(s)], capture_cores,
                                            plogs[f"shard {s}"], env)
            if head_start:
                hs = Path(str(RunLayout.for_run(load_config(config), run_id).hidden_states_dir))
                while sum(m.read_bytes().count(b"\n") for m in hs.glob("shard_*/manifest.jsonl")) < head_start:
                    if any(p.poll() is not None for p in procs.values()):
                        break           # a shard ended (or died): wait_all below says which
                    time.sleep(0.2)
                start_trainer()
            wait_all({k: v for k, v in procs.items() if k != "train"}, timeout, plogs)
            out["capture_done_s"] = time.time() - t0
        wait_all({"train": procs["train"]}, timeout, plogs)
        out["train_done_s"] = time.time() - t0
    finally:
        for p in procs.values():
            stop(p)
        out["store_peak_bytes"] = peak.stop()
        out["store_peak_keys"] = peak.keys_peak
        out["store_samples_read"] = peak.samples
        try:
            out["store_keys_left"] = int(peak.read().get("master_key_count", -1))
        except OSError:
            out["store_keys_left"] = None
        run(["store", "stop", *ra, "--grace", "5"], env=env)
    return out
