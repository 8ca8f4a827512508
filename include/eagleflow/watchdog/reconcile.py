"""Find extraction and generation shards left incomplete with nobody working on them, and claim them for a rerun.

Run on the node (``eagleflow reconcile scan|claim|release``), from the
``eagle3_shard_reconcile`` DAG. Both sharded phases are one shape here
(``ShardKind``): extraction shards (``capture run``, the capture server) of
runs with a corpus, and generation shards (``generate run``, the serving-mode
generation server) of runs whose frozen config has ``generate.enabled`` and
whose generation phase has not finished (``generated/stats.json`` not
complete, ``eagleflow.phases.generate.phase.phase_finished``):

- scan: the latest runs under run_root (those with a run-config.json), and for
  each shard: expected units (extraction: the corpus's samples of the shard;
  generation: the shard's records), stored units (manifest entries whose file
  is intact), whether a worker is alive (pid record + /proc start ticks).
  Incomplete + no live worker = a candidate. A generation shard is also
  incomplete while its heartbeat does not say complete (the phase's stats
  refuse it otherwise).
- claim: under a per-shard node lock, look again (someone may have started it
  since the scan), make sure the phase's own server is up (start it if
  needed, noting that reconcile started it; a generation shard never gets the
  capture server), start the worker detached. The worker holds its shard's
  job lock for life: a second reconcile, or the pipeline beside it, finds the
  live worker: no double work.
- release: stop a server that reconcile started, once no worker of that
  phase of the run is alive.
- hand-over (a fleet, on the node that owns the shards; either phase): prove
  each shard free of our workers (its job lock taken, no live pid record)
  and, holding that lock, leave a hand-over mark: the shard's worker checks
  for it once it holds the lock and refuses the shard
  (``refuse_if_handed_over``), so the owner never works on a shard another
  node took (never two workers on one shard). A held lock or a live worker
  keeps the shard where it is.
- states / claim --taken-from (on the taking node): how much of the shards it
  holds, and a claim of a shard handed over to it, recorded in its run dir
  (``takeover.json``, per phase) so that a later scan and claim there count
  it as its own.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagleflow.local_run import LocalRun
from eagleflow.capture.manifest import completed_indexes, read_manifest
from eagleflow.config import PipelineConfig, load_config, safe_run_id
from eagleflow.corpus.passes import capture_plan
from eagleflow.fleet.takeover import hand_over_mark, handed_over_to, record_taken_over, taken_over
from eagleflow.layout import RunLayout
from eagleflow.nodes import JobAlreadyRunning
from eagleflow.nodes.locks import JobLockHeld, NodeLock, lock_exclusive
from eagleflow.phases import EXTRACT, KINDS, RUN_ORDER, ShardKind, kind_of
from eagleflow.stores import pass_manifest, store_for
from eagleflow.watchdog.recovery import lock_path
from eagleflow.durable import atomic_write
from eagleflow.fleet.assign import shards_of


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
    phase: str = EXTRACT
    finished: bool = True      # the worker said complete (generation: its heartbeat); extraction: by counts

    @property
    def incomplete(self) -> bool:
        return self.stored < self.expected or not self.finished

    @property
    def needs_rerun(self) -> bool:
        return self.incomplete and not self.worker_alive

    def line(self) -> str:
        k = kind_of(self.phase)
        return (f"run {self.run_id} {k.label} {self.shard}/{self.num_shards}: {self.stored}/{self.expected} "
                f"{k.unit} stored{'' if self.finished else ', not marked complete'}, "
                f"worker {'alive' if self.worker_alive else 'not running'}")


def latest_runs(run_root: str, limit: int) -> list[Path]:
    """Run directories where a sharded phase started (run config + hidden_states/ or generated/), newest first."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir()
            if p.is_dir() and (p / RUN_CONFIG).is_file() and any((p / k.started_dir).is_dir() for k in KINDS.values())]
    runs.sort(key=lambda p: (p / RUN_CONFIG).stat().st_mtime, reverse=True)
    return runs[:limit]


def run_local(run_dir: Path) -> LocalRun:
    cfg = load_config(run_dir / RUN_CONFIG)
    layout = RunLayout.for_run(cfg, run_dir.name)
    return LocalRun(cfg=cfg, layout=layout, config_path=str(run_dir / RUN_CONFIG))


def shard_state(run: LocalRun, shard: int, phase: str = EXTRACT) -> ShardState:
    kind = kind_of(phase)
    lay = run.layout
    shard_dir = str(kind.shard_dir(lay, shard))
    expected, finished = kind.lifecycle().shard_expectation(run, shard)
    # both phases write capture's manifest; the stored units are what the shard's worker would keep at resume:
    # generation, each intact file; extraction, its run's store's rule (disk: the same; a streaming store: each
    # sample not lost with a store killed since, so a shard complete before its store died is incomplete now)
    store = store_for(run.cfg.stream.storage)
    resume = store.resume_check if kind.phase == EXTRACT else completed_indexes
    # a streaming run that re-captures per epoch: a shard is each of its passes (its worker's done/total)
    passes = capture_plan(run.cfg, lay).passes if kind.phase == EXTRACT and store.streaming and expected else 1
    stored = sum(len(resume(shard_dir, read_manifest(os.path.join(shard_dir, pass_manifest(cp))),
                            **({"last_epoch": cp} if passes > 1 else {})).done) for cp in range(passes))
    alive = run.node.live_record(str(lay.pid_file(kind.worker_role(shard)))) is not None
    return ShardState(run_id=lay.run_id, shard=shard, num_shards=kind.num_shards(run.cfg),
                      expected=expected * passes, stored=stored, worker_alive=alive, run_config=run.config_path,
                      phase=phase, finished=finished)


def phases_to_scan(run: LocalRun) -> list[str]:
    """The sharded phases of a run whose shards can be judged now (each phase's own rule), in run order."""
    return [phase for phase in RUN_ORDER if kind_of(phase).lifecycle().can_be_judged(run)]


def scan(cfg: PipelineConfig, latest: int = 3) -> list[ShardState]:
    """Every shard of the latest runs' phases that can be judged (see ``phases_to_scan``)."""
    out = []
    for run_dir in latest_runs(str(cfg.resolve(cfg.run_root)), latest):
        run = run_local(run_dir)
        for phase in phases_to_scan(run):
            out += [shard_state(run, s, phase) for s in own_shards(run, phase)]
    return out


def own_shards(run: LocalRun, phase: str) -> list[int]:
    """The shards of ``phase`` this node may work on: in a fleet, only those assigned to it and those handed
    over to it (another node's shard has its worker and lock there, out of sight: never a second worker)."""
    if not run.cfg.is_fleet:
        return list(range(kind_of(phase).num_shards(run.cfg)))
    shards = shards_of(run.cfg, run.cfg.node.name, phase)
    return sorted(set(shards) | set(taken_over(run, phase)))


# ----------------------------------------------------------------------------- a fleet's hand-over
def hand_over(run: LocalRun, shards: list[int], to_node: str, phase: str = EXTRACT) -> dict:
    """On the shards' owning node: hand each shard of ``phase`` that is proven free of our workers over to
    ``to_node``."""
    kind = kind_of(phase)
    lay = run.layout
    handed, kept = [], {}
    for shard in shards:
        role = kind.worker_role(shard)
        mark = handed_over_to(lay, shard, phase)
        if mark is not None:   # asked again (a retried task): the same answer
            if mark.get("to") == to_node:
                handed.append(shard)
            else:
                kept[shard] = f"already handed over to {mark.get('to')}"
            continue
        try:
            fd = lock_exclusive(str(lay.lock_file(role)), purpose=f"hand-over of {kind.label} {shard} of run "
                                                                  f"{lay.run_id} to {to_node}")
        except JobLockHeld as e:
            kept[shard] = f"its worker lock is held: {e}"
            continue
        try:
            live = run.node.live_record(str(lay.pid_file(role)))
            if live is not None:   # a worker that lost its lock file but lives: never taken from it
                kept[shard] = f"a worker of it is alive (pid {live.pid})"
                continue
            st = shard_state(run, shard, phase)
            if st.expected > 0 and not st.incomplete:   # no corpus here yet (expected 0): never started here
                kept[shard] = (f"complete here ({st.stored}/{st.expected} {kind.unit}): its copy to {to_node} is "
                               f"what is missing; clear {run.cfg.node.name}.{kind.collect_task}")
                continue
            atomic_write(hand_over_mark(lay, shard, phase), json.dumps({"to": to_node, "at": time.time()}))
            handed.append(shard)
        finally:
            os.close(fd)
    return {"handed_over": handed, "kept": {str(k): v for k, v in kept.items()}, "node": run.cfg.node.name}


def _marker(run: LocalRun, kind: ShardKind) -> Path:
    return Path(str(run.layout.locks_dir)) / f"{run.layout.run_id}.{kind.marker}"


def claim(run: LocalRun, shard: int, log=print, phase: str = EXTRACT, taken_from: str | None = None) -> dict:
    """Start the shard's worker if it is still incomplete and unattended; never twice. ``taken_from``: the
    fleet node that handed this shard over (``hand_over``), recorded first so it is this node's from now on."""
    kind = kind_of(phase)
    role = kind.worker_role(shard)
    lock = NodeLock(Path(str(run.layout.locks_dir)) / f"{run.layout.run_id}.reconcile.{role}.lock",
                    purpose=f"reconcile {kind.label} {shard} of run {run.layout.run_id}")
    if taken_from is not None:
        if not run.cfg.is_fleet or taken_from not in run.cfg.fleet_node_names():
            raise ValueError(f"claim --taken-from {taken_from!r}: only a shard of a fleet run can be taken from "
                             f"one of its nodes ({', '.join(run.cfg.fleet_node_names())})")
        record_taken_over(run, shard, taken_from, phase)
    if shard not in own_shards(run, phase):
        return {"action": "skipped", "reason": f"{kind.label} {shard} of run {run.layout.run_id} belongs to "
                f"another fleet node than {run.cfg.node.name}; it is rerun there"}
    if not lock.try_acquire():
        return {"action": "skipped", "reason": f"another reconcile holds {lock.path} ({lock.holder()})"}
    try:
        st = shard_state(run, shard, phase)
        if st.worker_alive:
            return {"action": "skipped", "reason": f"a worker is already running ({st.line()})", **asdict(st)}
        if not st.incomplete:
            return {"action": "skipped", "reason": f"already complete ({st.line()})", **asdict(st)}
        # the phase's server lock (the watchdog recovery's for capture): one start of a server at a time
        with NodeLock(lock_path(run, kind.server_role),
                      purpose=f"reconcile start of the {kind.server} for run {run.layout.run_id}"):
            started, server_started = kind.lifecycle().start_server(run, log=log)
            if server_started:
                _marker(run, kind).parent.mkdir(parents=True, exist_ok=True)
                _marker(run, kind).write_text(json.dumps({"pid": started.pid, "at": time.time()}))
            kind.lifecycle().wait_server_ready(run, log=log)
        try:
            rec, attached = kind.lifecycle().start_worker(run, shard, log=log)
        except JobAlreadyRunning as e:  # a worker not recorded by us (started by hand) holds the shard
            return {"action": "skipped", "reason": str(e), **asdict(st)}
        return {"action": "attached" if attached else "started", "reason": st.line(), "worker_pid": rec.pid,
                "server_started": server_started, **asdict(st)}
    finally:
        lock.release()


def release(run: LocalRun, log=print, phase: str = EXTRACT, exit_grace_s: float = 30.0) -> dict:
    """Stop the phase's server if reconcile started it and no worker of that phase of the run is alive any more."""
    kind = kind_of(phase)
    marker = _marker(run, kind)
    if not marker.exists():
        return {"action": "none", "reason": f"reconcile did not start this run's {kind.server}"}
    def live() -> list[int]:
        return [s for s in range(kind.num_shards(run.cfg))
                if run.node.live_record(str(run.layout.pid_file(kind.worker_role(s)))) is not None]
    alive = live()
    # a worker whose shard is complete is exiting (the watch saw its heartbeat say so first): give it a moment
    deadline = time.monotonic() + exit_grace_s
    while alive and time.monotonic() < deadline and not any(shard_state(run, s, phase).incomplete for s in alive):
        time.sleep(0.5)
        alive = live()
    if alive:
        return {"action": "kept", "reason": f"workers of {kind.label}s {alive} still run"}
    result = kind.lifecycle().stop_server(run, log=log)
    marker.unlink(missing_ok=True)
    return {"action": "stopped", "reason": f"server {result['server']}",
            **({"dumps_removed": result["dumps_removed"]} if "dumps_removed" in result else {})}


def run_dir_for(cfg: PipelineConfig, run_id: str) -> Path:
    return Path(str(cfg.resolve(cfg.run_root))) / safe_run_id(run_id)


__all__ = ["ShardState", "scan", "phases_to_scan", "claim", "release", "run_local", "latest_runs", "run_dir_for",
           "hand_over", "own_shards", "shard_state"]
