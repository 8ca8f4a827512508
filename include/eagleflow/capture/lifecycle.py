"""The capture server on a node: start detached, wait until ready, check health, stop.

Works through ``eagleflow.nodes.Node`` primitives only, so the same calls serve
a LocalNode, an SSHNode, the Airflow operators and the watchdog's recovery.
``ctx`` is anything with ``cfg``, ``layout``, ``node`` and ``eagleflow_argv``
(``eagleflow.airflow.runtime.RunContext`` or ``LocalRun`` below).

A process is "ours and alive" only when its pid record's start ticks match
``/proc/<pid>/stat`` now: a reused PID is never signalled.
"""
from __future__ import annotations

import json
import shlex
import signal
import time
from dataclasses import dataclass
from typing import Any

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout, RunLike
from eagleflow.nodes import DetachedProcess, LocalNode, Node
from eagleflow.nodes.proc import parse_stat

from .client import CaptureServerError, health_generate

SERVER_ROLE = "capture_server"


class CaptureServerNotReady(RuntimeError):
    """The server died while loading or did not answer /health_generate in time."""


@dataclass
class LocalRun:
    """A RunLike for CLI commands that run on the node itself."""
    cfg: PipelineConfig
    layout: RunLayout
    config_path: str
    _node: Node | None = None

    @property
    def node(self) -> Node:
        if self._node is None:
            self._node = LocalNode(name=self.cfg.node.name)
        return self._node

    def eagleflow_argv(self, *args: str) -> list[str]:
        return self.node.eagleflow_argv(*args, "--config", self.config_path, "--run-id", self.layout.run_id)


def worker_role(shard: int) -> str:
    return f"worker_shard_{shard:05d}"


def dump_dir(cfg: PipelineConfig) -> str:
    return str(cfg.resolve(cfg.capture.dump_dir))


# --- pid records -----------------------------------------------------------------

def read_pid_record(node: Node, pid_file: str) -> dict | None:
    text = node.read_text(pid_file)
    if not text:
        return None
    try:
        rec = json.loads(text)
        int(rec["pid"])
        return rec
    except (ValueError, KeyError, TypeError):
        return None


def record_alive(node: Node, rec: dict | None) -> bool:
    """True when the recorded process still runs and is the one we started (same start ticks)."""
    if not rec:
        return False
    stat = node.read_text(f"/proc/{int(rec['pid'])}/stat")
    if not stat:
        return False
    try:
        _, state, rest = parse_stat(stat)
    except ValueError:
        return False
    if state in ("Z", "X"):
        return False
    ticks = int(rest[22 - 4])
    return not rec.get("start_ticks") or ticks == int(rec["start_ticks"])


def live_record(node: Node, pid_file: str) -> dict | None:
    rec = read_pid_record(node, pid_file)
    return rec if record_alive(node, rec) else None


def stop_recorded(node: Node, pid_file: str, grace_s: float = 15.0, log=None) -> str:
    """TERM the recorded process group, wait ``grace_s``, then KILL it; remove the record.

    Returns what happened ("not running", "stopped", "killed").
    """
    rec = read_pid_record(node, pid_file)
    outcome = "not running"
    if record_alive(node, rec):
        pid, pgid = int(rec["pid"]), int(rec.get("pgid") or rec["pid"])
        node.signal(pgid, signal.SIGTERM, group=True)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and record_alive(node, rec):
            time.sleep(0.2)
        outcome = "stopped"
        if record_alive(node, rec):
            node.signal(pgid, signal.SIGKILL, group=True)
            outcome = "killed"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and record_alive(node, rec):
                time.sleep(0.1)
        if log:
            log(f"{rec.get('role', '?')} pid {pid} (group {pgid}) {outcome}")
    if rec is not None:
        node.run(["rm", "-f", "--", pid_file], timeout=30)
    return outcome


# --- the capture server -------------------------------------------------------------

def server_info(ctx: RunLike) -> dict | None:
    text = ctx.node.read_text(str(ctx.layout.server_info_file))
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def start_capture_server(ctx: RunLike, log=None) -> DetachedProcess | dict:
    """Start ``eagleflow capture serve`` detached; a live recorded server is kept (returns its record)."""
    pid_file = str(ctx.layout.pid_file(SERVER_ROLE))
    rec = live_record(ctx.node, pid_file)
    if rec is not None:
        if log:
            log(f"capture server already running: pid {rec['pid']} (record {pid_file}); keeping it")
        return rec
    # A stale info file from an earlier server would make readiness read the wrong URL.
    ctx.node.run(["rm", "-f", "--", str(ctx.layout.server_info_file)], timeout=30)
    argv = ctx.eagleflow_argv("capture", "serve")
    proc = ctx.node.spawn_detached(argv, role=SERVER_ROLE, pid_file=pid_file,
                                   log_file=str(ctx.layout.log_file(SERVER_ROLE)))
    if log:
        log(f"capture server ({ctx.cfg.capture.backend}) started on node {ctx.node.name}: pid {proc.pid}, "
            f"log {proc.log_file}, command {shlex.join(argv)}")
    return proc


def capture_server_healthy(url: str, timeout_s: float) -> bool:
    """One real one-token generation answered within ``timeout_s``."""
    try:
        health_generate(url, timeout_s)
        return True
    except CaptureServerError:
        return False


def check_ready(ctx: RunLike, health_timeout_s: float = 20.0) -> tuple[str, dict | None, str]:
    """One cheap look: ("ready" | "loading" | "dead", server info, detail).

    Over SSH the health request runs on the node (the server binds the node's
    loopback), through ``eagleflow capture health``.
    """
    rec = read_pid_record(ctx.node, str(ctx.layout.pid_file(SERVER_ROLE)))
    alive = record_alive(ctx.node, rec)
    if not alive:
        tail = log_tail(ctx, SERVER_ROLE)
        return "dead", None, (f"the capture server is not running (pid record "
                              f"{ctx.layout.pid_file(SERVER_ROLE)}: {'absent' if rec is None else 'process gone'}); "
                              f"last lines of {ctx.layout.log_file(SERVER_ROLE)}:\n{tail}")
    info = server_info(ctx)
    if not info or not info.get("url"):
        return "loading", None, "loading: capture_server.json not written yet"
    if isinstance(ctx.node, LocalNode):
        ok = capture_server_healthy(info["url"], health_timeout_s)
    else:
        res = ctx.node.run(ctx.eagleflow_argv("capture", "health", "--timeout", str(health_timeout_s)),
                           timeout=health_timeout_s + 60)
        ok = res.ok
    return ("ready" if ok else "loading"), info, ("ready" if ok else f"{info['url']}/health_generate not answering yet")


def wait_capture_server_ready(ctx: RunLike, timeout_s: float | None = None, poll_s: float = 1.0,
                              log=None) -> dict:
    """Block until /health_generate answers; raise CaptureServerNotReady when it died or the grace ran out."""
    timeout_s = timeout_s if timeout_s is not None else ctx.cfg.capture.ready_timeout_s
    deadline = time.monotonic() + timeout_s
    detail = ""
    while True:
        state, info, detail = check_ready(ctx, ctx.cfg.watchdog.health_timeout_s)
        if state == "ready":
            if log:
                log(f"capture server ready at {info['url']}: model {info.get('model')}, "
                    f"aux layers {info.get('aux_layers')}")
            return info
        if state == "dead":
            raise CaptureServerNotReady(detail)
        if time.monotonic() >= deadline:
            raise CaptureServerNotReady(f"the capture server did not become ready within {timeout_s:.0f} s "
                                        f"({detail}); raise capture.ready_timeout_s if the model loads slowly, "
                                        f"or read {ctx.layout.log_file(SERVER_ROLE)}")
        time.sleep(poll_s)


def log_tail(ctx: RunLike, role: str, lines: int = 20) -> str:
    res = ctx.node.run(["tail", "-n", str(lines), "--", str(ctx.layout.log_file(role))], timeout=30)
    return res.stdout if res.ok else "(no log)"


_REMOVE_DUMPS = (
    "import os,sys\n"
    "d,p=sys.argv[1],sys.argv[2];n=0\n"
    "for f in (os.listdir(d) if os.path.isdir(d) else []):\n"
    "    if f.startswith(p) or f.startswith('.tmp-'+p):\n"
    "        try: os.unlink(os.path.join(d,f)); n+=1\n"
    "        except FileNotFoundError: pass\n"
    "print(n)\n")


def remove_run_dumps(ctx: RunLike) -> int:
    """This run's dumps (all shards) in the dump dir; other runs' dumps are left alone."""
    res = ctx.node.check([ctx.node.python, "-c", _REMOVE_DUMPS, dump_dir(ctx.cfg), f"{ctx.layout.run_id}.s"],
                         timeout=120)
    return int(res.stdout.strip() or 0)


def stop_capture_server(ctx: RunLike, grace_s: float = 30.0, log=None) -> dict[str, Any]:
    outcome = stop_recorded(ctx.node, str(ctx.layout.pid_file(SERVER_ROLE)), grace_s=grace_s, log=log)
    ctx.node.run(["rm", "-f", "--", str(ctx.layout.server_info_file)], timeout=30)
    removed = remove_run_dumps(ctx)
    if log:
        log(f"capture server: {outcome}; removed {removed} dump(s) of run {ctx.layout.run_id}")
    return {"server": outcome, "dumps_removed": removed}


# --- extraction workers ---------------------------------------------------------------

def start_or_attach_worker(ctx: RunLike, shard: int, log=None) -> tuple[dict, bool]:
    """Start the detached worker of ``shard``, or return the live one: never two workers on one shard.

    Returns (pid record, attached). Liveness is the pid record checked against
    /proc start ticks, so a stale record (worker gone, PID reused) starts a new one.
    """
    role = worker_role(shard)
    pid_file = str(ctx.layout.pid_file(role))
    rec = live_record(ctx.node, pid_file)
    if rec is not None:
        if log:
            log(f"shard {shard}: worker pid {rec['pid']} is still running (record {pid_file}); attaching to it")
        return rec, True
    argv = ctx.eagleflow_argv("capture", "run", "--shard", str(shard), "--of", str(ctx.cfg.capture.shards))
    proc = ctx.node.spawn_detached(argv, role=role, pid_file=pid_file, log_file=str(ctx.layout.log_file(role)))
    if log:
        log(f"shard {shard}: worker started on node {ctx.node.name}: pid {proc.pid}, log {proc.log_file}")
    return {"pid": proc.pid, "pgid": proc.pgid, "start_ticks": proc.start_ticks, "role": role,
            "log_file": proc.log_file}, False


def stop_worker(ctx: RunLike, shard: int, grace_s: float = 15.0, log=None) -> str:
    return stop_recorded(ctx.node, str(ctx.layout.pid_file(worker_role(shard))), grace_s=grace_s, log=log)
