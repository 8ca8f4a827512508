"""The capture server on a node: start detached, wait until ready, check health, stop.

Works through ``eagleflow.nodes.Node`` primitives only, so the same calls serve
a LocalNode, an SSHNode, the Airflow operators and the watchdog's recovery.
``ctx`` is anything with ``cfg``, ``layout``, ``node`` and ``eagleflow_argv``
(``eagleflow.airflow.runtime.RunContext`` or ``eagleflow.local_run.LocalRun``).

Pid records, their proof of ownership and the one stop are
``eagleflow.nodes.process_record``, checked and run on the node through
``Node.process_status`` / ``Node.live_record`` / ``Node.stop_recorded``: a
reused PID or a foreign process group is never signalled.
"""
from __future__ import annotations

import json
import os
import shlex
import time
from typing import Any

from pydantic import BaseModel

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLike
from eagleflow.nodes import JobAlreadyRunning, LocalNode, ProcessRecord
from eagleflow.phases import EXTRACT, KINDS

from .client import CaptureServerError, health_generate

SERVER_ROLE = KINDS[EXTRACT].server_role


class CaptureServerNotReady(RuntimeError):
    """The server died while loading or did not answer /health_generate in time."""


def worker_role(shard: int) -> str:
    return KINDS[EXTRACT].worker_role(shard)


def worker_role_pattern() -> str:
    """A regular expression matching every ``worker_role`` whole."""
    return KINDS[EXTRACT].worker_role_pattern()


def dump_dir(cfg: PipelineConfig) -> str:
    return str(cfg.resolve(cfg.capture.dump_dir))


# --- the capture server -------------------------------------------------------------

def read_server_info(ctx: RunLike, info_file: str) -> dict | None:
    """A server's info file (url, pid, model, ...) as written once it listens; None while absent or unreadable."""
    text = ctx.node.read_text(info_file)
    try:
        info = json.loads(text) if text else None
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def server_info(ctx: RunLike) -> dict | None:
    return read_server_info(ctx, str(ctx.layout.server_info_file))


def start_capture_server(ctx: RunLike, log=None) -> tuple[ProcessRecord, bool]:
    """Start ``eagleflow capture serve`` detached; a live recorded server is kept.

    Returns (its record, whether it was started now).
    """
    return start_or_attach_server(ctx, SERVER_ROLE, ctx.eagleflow_argv("capture", "serve"),
                                  str(ctx.layout.server_info_file), f"capture server ({ctx.cfg.capture.backend})", log)


def start_or_attach_server(ctx: RunLike, role: str, argv: list[str], info_file: str, what: str,
                           log=None) -> tuple[ProcessRecord, bool]:
    """The one server start (capture and generation): a live recorded server is kept, and the start is
    exclusive, like a worker's: detach takes ``lock_file(role)`` and the server holds it for its life, so
    two callers at once (concurrent retries) start one server and the other attaches to it."""
    # A stale info file from an earlier server would make readiness read the wrong URL (a concurrent
    # starter's server writes its own only once loaded, long after this).
    rec, started = start_exclusive(ctx, role, argv,
                                   before=lambda: ctx.node.run(["rm", "-f", "--", info_file], timeout=30))
    if log and started:
        log(f"{what} started on node {ctx.node.name}: pid {rec.pid}, log {rec.log_file}, command {shlex.join(argv)}")
    elif log:
        log(f"{what.split(' (')[0]} already running: pid {rec.pid} (record {ctx.layout.pid_file(role)}); keeping it")
    return rec, started


def start_exclusive(ctx: RunLike, role: str, argv: list[str], before=None) -> tuple[ProcessRecord, bool]:
    """(record, started): the live recorded process of ``role``, or a new detached one that holds
    ``lock_file(role)`` for its life; a concurrent start that won the lock is attached to (servers, workers).
    ``before`` runs just before a spawn."""
    pid_file = str(ctx.layout.pid_file(role))
    rec = ctx.node.live_record(pid_file)
    if rec is not None:
        return rec, False
    if before is not None:
        before()
    try:
        return ctx.node.spawn_detached(argv, role=role, pid_file=pid_file, log_file=str(ctx.layout.log_file(role)),
                                       lock_file=str(ctx.layout.lock_file(role))), True
    except JobAlreadyRunning as e:   # a concurrent start won the lock: the process it records
        return _recorded_holder(ctx, pid_file, e), False


def capture_server_healthy(url: str, timeout_s: float) -> bool:
    """One real one-token generation answered within ``timeout_s``."""
    try:
        health_generate(url, timeout_s)
        return True
    except CaptureServerError:
        return False


class ServerStuck(CaptureServerNotReady):
    """The recorded server is ours and alive but stopped (state T/t) or a zombie: it can never answer, so
    nobody waits for it to load; it must be stopped and started again."""


# /proc states in which a live recorded server cannot answer however long one waits
STUCK_STATES = {"T": "stopped (state T: SIGSTOP'd)", "t": "stopped by a tracer (state t)", "Z": "a zombie (state Z)"}


def check_server_ready(ctx: RunLike, role: str, info_file: str, health_cmd: str, what: str,
                       health_timeout_s: float) -> tuple[str, dict | None, str]:
    """One cheap look at a recorded server (capture or generation): ("ready" | "loading" | "stuck" | "dead",
    its info, detail). "stuck" is read off the leader's /proc state, with no health request: a SIGSTOP'd
    server must not be taken for one still loading (the generation drill that waited out ready_timeout_s).

    Over SSH the health request runs on the node (the server binds the node's loopback), through
    ``eagleflow <health_cmd> health``.
    """
    pid_file = ctx.layout.pid_file(role)
    st = ctx.node.process_status(str(pid_file))
    if not st.alive:
        return "dead", None, (f"the {what} is not running (pid record {pid_file}: "
                              f"{'absent' if not st.recorded else st.detail}); last lines of "
                              f"{ctx.layout.log_file(role)}:\n{log_tail(ctx, role)}")
    if st.state in STUCK_STATES:
        pid = st.record.pid if st.record else "?"
        return "stuck", None, (f"the {what} pid {pid} is {STUCK_STATES[st.state]}: it cannot answer until it is "
                               "stopped and started again")
    info = read_server_info(ctx, info_file)
    if not info or not info.get("url"):
        return "loading", None, f"loading: {info_file} not written yet"
    if isinstance(ctx.node, LocalNode):
        ok = capture_server_healthy(info["url"], health_timeout_s)
    else:
        ok = ctx.node.run(ctx.eagleflow_argv(health_cmd, "health", "--timeout", str(health_timeout_s)),
                          timeout=health_timeout_s + 60).ok
    return ("ready" if ok else "loading"), info, ("ready" if ok else f"{info['url']} not answering yet")


def wait_server_ready(ctx: RunLike, look, what: str, role: str, timeout_s: float, poll_s: float = 1.0,
                      died: type[CaptureServerNotReady] = CaptureServerNotReady) -> dict:
    """Poll ``look()`` (a ``check_server_ready``) until "ready"; ``died`` when the server is gone, ServerStuck at
    once when it can never answer, CaptureServerNotReady when ``timeout_s`` ran out."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, info, detail = look()
        if state == "ready":
            return info
        if state == "dead":
            raise died(detail)
        if state == "stuck":
            raise ServerStuck(detail)
        if time.monotonic() >= deadline:
            raise CaptureServerNotReady(f"the {what} did not become ready within {timeout_s:.0f} s "
                                        f"({detail}); raise capture.ready_timeout_s if the model loads slowly, "
                                        f"or read {ctx.layout.log_file(role)}")
        time.sleep(poll_s)


def check_ready(ctx: RunLike, health_timeout_s: float = 20.0) -> tuple[str, dict | None, str]:
    """The capture server's ``check_server_ready``."""
    return check_server_ready(ctx, SERVER_ROLE, str(ctx.layout.server_info_file), "capture", "capture server",
                              health_timeout_s)


def wait_capture_server_ready(ctx: RunLike, timeout_s: float | None = None, poll_s: float = 1.0,
                              log=None) -> dict:
    """Block until /health_generate answers; raise CaptureServerNotReady when it died, is stuck or the grace
    ran out."""
    info = wait_server_ready(ctx, lambda: check_ready(ctx, ctx.cfg.watchdog.health_timeout_s), "capture server",
                             SERVER_ROLE, ctx.cfg.capture.ready_timeout_s if timeout_s is None else timeout_s, poll_s)
    if log:
        log(f"capture server ready at {info['url']}: model {info.get('model')}, aux layers {info.get('aux_layers')}")
    return info


def log_tail(ctx: RunLike, role: str, lines: int = 20) -> str:
    res = ctx.node.run(["tail", "-n", str(lines), "--", str(ctx.layout.log_file(role))], timeout=30)
    return res.stdout if res.ok else "(no log)"


class RemovedDumps(BaseModel):
    removed: int


def remove_run_dumps(ctx: RunLike) -> int:
    """This run's dumps (all shards) in the dump dir, matched by exact run id; other runs' dumps are left alone."""
    argv = [ctx.node.python, "-m", "eagleflow.capture.protocol", "remove-dumps", "--dump-dir", dump_dir(ctx.cfg),
            "--run-id", ctx.layout.run_id]
    return ctx.node.run_json(argv, RemovedDumps, timeout=120).removed


def stop_capture_server(ctx: RunLike, grace_s: float = 30.0, log=None) -> dict[str, Any]:
    stopped = ctx.node.stop_recorded(str(ctx.layout.pid_file(SERVER_ROLE)), grace_s=grace_s)
    ctx.node.run(["rm", "-f", "--", str(ctx.layout.server_info_file)], timeout=30)
    removed = remove_run_dumps(ctx)
    if log:
        log(f"capture server: {stopped.detail}; removed {removed} dump(s) of run {ctx.layout.run_id}")
    return {"server": stopped.outcome, "detail": stopped.detail, "dumps_removed": removed}


# --- extraction workers ---------------------------------------------------------------

def start_or_attach_worker(ctx: RunLike, shard: int, log=None) -> tuple[ProcessRecord, bool]:
    """Start the detached worker of ``shard``, or return the live one: never two workers on one shard.

    Returns (its record, attached). The start is exclusive on the node: the
    worker holds ``<state_dir>/locks/<run>.worker_shard_NNNNN.lock`` for its
    lifetime, taken by detach before the worker starts, so two callers at
    once start one worker; the other attaches to it. A holder that is not the
    recorded worker (a hand-started ``capture run``) raises JobAlreadyRunning
    naming its PID.
    """
    role = worker_role(shard)
    argv = ctx.eagleflow_argv("capture", "run", "--shard", str(shard), "--of", str(ctx.cfg.capture.shards))
    rec, started = start_exclusive(ctx, role, argv)
    if started:
        if log:
            log(f"shard {shard}: worker started on node {ctx.node.name}: pid {rec.pid}, log {rec.log_file}")
        ensure_sentinel(ctx, shard, log)
        return rec, False
    if log:
        log(f"shard {shard}: worker pid {rec.pid} is still running (record {ctx.layout.pid_file(role)}); "
            f"attaching to it")
    ensure_sentinel(ctx, shard, log)
    return rec, True


def ensure_sentinel(ctx: RunLike, shard: int, log=None) -> ProcessRecord | None:
    """The extraction shard's sentinel (eagleflow.watchdog.sentinel: it alarms when nothing looks at the shard)."""
    from eagleflow.watchdog.sentinel import ensure_sentinel as start
    from eagleflow.watchdog.signals import WatchedJob
    return start(ctx, WatchedJob(shard=shard, num_shards=ctx.cfg.capture.shards), log)


def _recorded_holder(ctx: RunLike, pid_file: str, refused: JobAlreadyRunning, wait_s: float = 10.0) -> ProcessRecord:
    """The recorded worker that holds the lock (a concurrent start records it within moments), else the refusal.

    A live recorded worker is the holder: detach hands the lock to the worker it records, and a
    worker that finds the lock taken exits at once.
    """
    deadline = time.monotonic() + wait_s
    while True:
        rec = ctx.node.live_record(pid_file)
        if rec is not None:
            return rec
        if time.monotonic() >= deadline:
            raise refused
        time.sleep(0.2)


def stop_worker(ctx: RunLike, shard: int, grace_s: float = 15.0, log=None) -> str:
    res = ctx.node.stop_recorded(str(ctx.layout.pid_file(worker_role(shard))), grace_s=grace_s)
    if log and res.outcome != "not_recorded":
        log(res.detail)
    return res.outcome


def shard_expectation(run, shard: int) -> tuple[int, bool]:
    """(samples shard ``shard`` extracts, True): its share of the corpus; an extraction shard is finished
    when its manifest holds them all (0 before the corpus exists)."""
    from .worker import shard_indexes
    corpus = str(run.layout.corpus_dir / "corpus.parquet")
    return (len(shard_indexes(corpus, shard, run.cfg.capture.shards)) if os.path.exists(corpus) else 0), True


def can_be_judged(run) -> bool:
    """Reconcile judges the extraction shards of a run whose corpus exists (nothing to compare them with before)."""
    return os.path.exists(str(run.layout.corpus_dir / "corpus.parquet"))

