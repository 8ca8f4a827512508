"""Find extraction shards left incomplete with nobody working on them, and claim them for a rerun.

Run on the node (``eagleflow reconcile scan|claim|release``), from the
``eagle3_shard_reconcile`` DAG:

- scan: the latest runs under run_root (those with a run-config.json), and for
  each shard: expected samples (corpus), stored samples (manifest entries
  whose file exists at its recorded size), whether a worker is alive (pid
  record + /proc start ticks). Incomplete + no live worker = a candidate.
- claim: under a per-shard node lock, look again (someone may have started it
  since the scan), make sure the run's capture server is up (start it if
  needed, noting that reconcile started it), start the worker detached. A
  second reconcile, or the pipeline beside it, finds the live worker: no
  double work.
- release: stop a capture server that reconcile started, once no worker of
  that run is alive.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagleflow.capture.lifecycle import (SERVER_ROLE, LocalRun, start_capture_server,
                                         start_or_attach_worker, stop_capture_server, wait_capture_server_ready,
                                         worker_role)
from eagleflow.capture.manifest import completed_indexes, read_manifest
from eagleflow.config import PipelineConfig, load_config, safe_run_id
from eagleflow.layout import RunLayout
from eagleflow.nodes import JobAlreadyRunning
from eagleflow.watchdog.node_lock import NodeLock

RUN_CONFIG = "run-config.json"


@dataclass
class ShardState:
    run_id: str
    shard: int
    num_shards: int
    expected: int
    stored: int
    worker_alive: bool
    run_config: str

    @property
    def incomplete(self) -> bool:
        return self.stored < self.expected

    @property
    def needs_rerun(self) -> bool:
        return self.incomplete and not self.worker_alive

    def line(self) -> str:
        return (f"run {self.run_id} shard {self.shard}/{self.num_shards}: {self.stored}/{self.expected} stored, "
                f"worker {'alive' if self.worker_alive else 'not running'}")


def latest_runs(run_root: str, limit: int) -> list[Path]:
    """Run directories whose extraction started (run config + hidden_states/), newest first."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir()
            if p.is_dir() and (p / RUN_CONFIG).is_file() and (p / "hidden_states").is_dir()]
    runs.sort(key=lambda p: (p / RUN_CONFIG).stat().st_mtime, reverse=True)
    return runs[:limit]


def run_local(run_dir: Path) -> LocalRun:
    cfg = load_config(run_dir / RUN_CONFIG)
    layout = RunLayout.for_run(cfg, run_dir.name)
    return LocalRun(cfg=cfg, layout=layout, config_path=str(run_dir / RUN_CONFIG))


def shard_state(run: LocalRun, shard: int) -> ShardState:
    from eagleflow.capture.worker import shard_indexes
    lay = run.layout
    corpus = str(lay.corpus_dir / "corpus.parquet")
    n = run.cfg.capture.shards
    expected = len(shard_indexes(corpus, shard, n)) if os.path.exists(corpus) else 0
    scan = read_manifest(str(lay.manifest_file(shard)))
    done = completed_indexes(str(lay.shard_dir(shard)), scan).done
    alive = run.node.live_record(str(lay.pid_file(worker_role(shard)))) is not None
    return ShardState(run_id=lay.run_id, shard=shard, num_shards=n, expected=expected, stored=len(done),
                      worker_alive=alive, run_config=run.config_path)


def scan(cfg: PipelineConfig, latest: int = 3) -> list[ShardState]:
    """Every shard of the latest runs that has extraction started (a shard dir) or a corpus to extract."""
    out = []
    for run_dir in latest_runs(str(cfg.resolve(cfg.run_root)), latest):
        run = run_local(run_dir)
        if not (Path(str(run.layout.corpus_dir)) / "corpus.parquet").exists():
            continue  # no corpus: nothing to compare the shards against
        out += [shard_state(run, s) for s in range(run.cfg.capture.shards)]
    return out


def _marker(run: LocalRun) -> Path:
    return Path(str(run.layout.locks_dir)) / f"{run.layout.run_id}.reconcile-started-server"


def claim(run: LocalRun, shard: int, log=print) -> dict:
    """Start the shard's worker if it is still incomplete and unattended; never twice."""
    lock = NodeLock(Path(str(run.layout.locks_dir)) / f"{run.layout.run_id}.reconcile.{worker_role(shard)}.lock",
                    purpose=f"reconcile shard {shard} of run {run.layout.run_id}")
    if not lock.try_acquire():
        return {"action": "skipped", "reason": f"another reconcile holds {lock.path} ({lock.holder()})"}
    try:
        st = shard_state(run, shard)
        if st.worker_alive:
            return {"action": "skipped", "reason": f"a worker is already running ({st.line()})", **asdict(st)}
        if not st.incomplete:
            return {"action": "skipped", "reason": f"already complete ({st.line()})", **asdict(st)}
        # the server lock of the watchdog's recovery: never start a server while a recovery restarts it
        from eagleflow.watchdog.recovery import lock_path
        with NodeLock(lock_path(run), purpose=f"reconcile start of the capture server for run {run.layout.run_id}"):
            started, server_started = start_capture_server(run, log=log)
            if server_started:
                _marker(run).parent.mkdir(parents=True, exist_ok=True)
                _marker(run).write_text(json.dumps({"pid": started.pid, "at": time.time()}))
            wait_capture_server_ready(run, log=log)
        try:
            rec, attached = start_or_attach_worker(run, shard, log=log)
        except JobAlreadyRunning as e:  # a worker not recorded by us (started by hand) holds the shard
            return {"action": "skipped", "reason": str(e), **asdict(st)}
        return {"action": "attached" if attached else "started", "reason": st.line(), "worker_pid": rec.pid,
                "server_started": server_started, **asdict(st)}
    finally:
        lock.release()


def release(run: LocalRun, log=print) -> dict:
    """Stop the capture server if reconcile started it and no worker of the run is alive any more."""
    marker = _marker(run)
    if not marker.exists():
        return {"action": "none", "reason": "reconcile did not start this run's server"}
    alive = [s for s in range(run.cfg.capture.shards)
             if run.node.live_record(str(run.layout.pid_file(worker_role(s)))) is not None]
    if alive:
        return {"action": "kept", "reason": f"workers of shards {alive} still run"}
    result = stop_capture_server(run, log=log)
    marker.unlink(missing_ok=True)
    return {"action": "stopped", "reason": f"server {result['server']}", "dumps_removed": result["dumps_removed"]}


def run_dir_for(cfg: PipelineConfig, run_id: str) -> Path:
    return Path(str(cfg.resolve(cfg.run_root))) / safe_run_id(run_id)


__all__ = ["ShardState", "scan", "claim", "release", "run_local", "latest_runs", "run_dir_for", "SERVER_ROLE"]
