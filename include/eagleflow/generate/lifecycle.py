"""The generation server and workers on a node: start detached, wait until ready, stop.

The server runs in serving mode (the hf backend's ``--mode generate``; sglang's
own ``launch_server`` with its radix cache and CUDA graphs on, no capture
hook), under its own role and info file, so it never mixes with the capture
server: the DAG stops it before the capture server starts. Workers are
started like extraction workers: recorded, one per shard by the lock detach
takes before the worker starts.
"""
from __future__ import annotations

import json
import time

from eagleflow.capture.lifecycle import CaptureServerNotReady, capture_server_healthy, log_tail, start_or_attach_server
from eagleflow.layout import RunLike
from eagleflow.nodes import LocalNode, ProcessRecord

SERVER_ROLE = "generate_server"


def worker_role(shard: int) -> str:
    return f"generate_shard_{shard:05d}"


def server_info(ctx: RunLike) -> dict | None:
    text = ctx.node.read_text(str(ctx.layout.generate_server_info_file))
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def start_generate_server(ctx: RunLike, log=None) -> tuple[ProcessRecord, bool]:
    """``eagleflow generate serve`` detached; a live recorded one is kept. (record, started now)."""
    return start_or_attach_server(ctx, SERVER_ROLE, ctx.eagleflow_argv("generate", "serve"),
                                  str(ctx.layout.generate_server_info_file),
                                  f"generation server ({ctx.cfg.capture.backend}, serving mode)", log)


def check_ready(ctx: RunLike, health_timeout_s: float = 20.0) -> tuple[str, dict | None, str]:
    st = ctx.node.process_status(str(ctx.layout.pid_file(SERVER_ROLE)))
    if not st.alive:
        return "dead", None, (f"the generation server is not running (pid record {ctx.layout.pid_file(SERVER_ROLE)}: "
                              f"{'absent' if not st.recorded else st.detail}); last lines of "
                              f"{ctx.layout.log_file(SERVER_ROLE)}:\n{log_tail(ctx, SERVER_ROLE)}")
    info = server_info(ctx)
    if not info or not info.get("url"):
        return "loading", None, "loading: generate_server.json not written yet"
    if isinstance(ctx.node, LocalNode):
        ok = capture_server_healthy(info["url"], health_timeout_s)
    else:
        ok = ctx.node.run(ctx.eagleflow_argv("generate", "health", "--timeout", str(health_timeout_s)),
                          timeout=health_timeout_s + 60).ok
    return ("ready" if ok else "loading"), info, ("ready" if ok else f"{info['url']} not answering yet")


def wait_generate_server_ready(ctx: RunLike, timeout_s: float | None = None, poll_s: float = 1.0, log=None) -> dict:
    timeout_s = timeout_s if timeout_s is not None else ctx.cfg.capture.ready_timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        state, info, detail = check_ready(ctx, ctx.cfg.watchdog.health_timeout_s)
        if state == "ready":
            if log:
                log(f"generation server ready at {info['url']}: model {info.get('model')}")
            return info
        if state == "dead":
            raise CaptureServerNotReady(detail)
        if time.monotonic() >= deadline:
            raise CaptureServerNotReady(f"the generation server did not become ready within {timeout_s:.0f} s "
                                        f"({detail}); raise capture.ready_timeout_s if the model loads slowly, "
                                        f"or read {ctx.layout.log_file(SERVER_ROLE)}")
        time.sleep(poll_s)


def stop_generate_server(ctx: RunLike, grace_s: float = 30.0, log=None) -> dict:
    stopped = ctx.node.stop_recorded(str(ctx.layout.pid_file(SERVER_ROLE)), grace_s=grace_s)
    ctx.node.run(["rm", "-f", "--", str(ctx.layout.generate_server_info_file)], timeout=30)
    if log:
        log(f"generation server: {stopped.detail}")
    return {"server": stopped.outcome, "detail": stopped.detail}


def start_or_attach_generate_worker(ctx: RunLike, shard: int, log=None) -> tuple[ProcessRecord, bool]:
    """The detached worker of generation shard ``shard``, or the live one: never two on one shard."""
    role = worker_role(shard)
    pid_file = str(ctx.layout.pid_file(role))
    from eagleflow.watchdog.sentinel import ensure_sentinel
    from eagleflow.watchdog.signals import WatchedJob
    job = WatchedJob(shard=shard, num_shards=ctx.cfg.generate.shards, phase="generate")
    rec = ctx.node.live_record(pid_file)
    if rec is not None:
        if log:
            log(f"generate shard {shard}: worker pid {rec.pid} is still running; attaching to it")
        ensure_sentinel(ctx, job, log)
        return rec, True
    argv = ctx.eagleflow_argv("generate", "run", "--shard", str(shard), "--of", str(ctx.cfg.generate.shards))
    # detach takes the shard's lock before the worker starts: a hand-started holder raises JobAlreadyRunning
    rec = ctx.node.spawn_detached(argv, role=role, pid_file=pid_file, log_file=str(ctx.layout.log_file(role)),
                                  lock_file=str(ctx.layout.lock_file(role)))
    if log:
        log(f"generate shard {shard}: worker started on node {ctx.node.name}: pid {rec.pid}, log {rec.log_file}")
    ensure_sentinel(ctx, job, log)   # it alarms when nothing looks at this shard while it runs
    return rec, False


SERVER_STALL = "server_stall.json"   # in the shard dir: the last try ended on a stall blamed on the server


def record_server_stall(ctx: RunLike, shard: int, event: dict) -> bool:
    """Remember a stall verdict that blames the generation server, for the shard's retry; True when recorded."""
    if event.get("status") != "stalled" or event.get("cause") != "capture_server":
        return False
    ctx.node.write_text(str(ctx.layout.generate_shard_dir(shard) / SERVER_STALL),
                        json.dumps({"subject": event.get("subject"), "verdict": event.get("verdict"),
                                    "at": time.time()}) + "\n")
    return True


def stop_after_server_stall(ctx: RunLike, shard: int, grace_s: float = 30.0, log=None) -> bool:
    """A retry after a stall blamed on the server: a hung server still answers /health_generate, so attaching
    again would hang again. Stop the shard's recorded worker and the recorded server (by their records);
    the caller then starts the server again. True when it stopped them."""
    marker = str(ctx.layout.generate_shard_dir(shard) / SERVER_STALL)
    text = ctx.node.read_text(marker)
    if not text:
        return False
    try:
        why = json.loads(text).get("subject") or "a stall"
    except ValueError:
        why = "a stall"
    if log:
        log(f"generate shard {shard}: the last try ended on {why} blamed on the generation server ({marker}); "
            "stopping this shard's worker and the server by their records before starting it again (other "
            "shards' workers on that server fail and resume on their own retries)")
    stopped = ctx.node.stop_recorded(str(ctx.layout.pid_file(worker_role(shard))), grace_s=grace_s)
    if log:
        log(f"generate shard {shard}: worker: {stopped.detail}")
    stop_generate_server(ctx, grace_s=grace_s, log=log)
    ctx.node.run(["rm", "-f", "--", marker], timeout=30)
    return True
