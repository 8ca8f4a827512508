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

from pydantic import BaseModel, ConfigDict

from eagleflow import bounded_json
from eagleflow.engines import generation_engine
from eagleflow.layout import RunLike
from eagleflow.nodes import LocalNode, ProcessRecord
from eagleflow.nodes.locks import NodeLock
from eagleflow.phase_jobs import ServerNotReady, wait_server_ready
from eagleflow.phases.shared import lifecycle as shared

from . import KIND, SERVER_STALL

SERVER_ROLE = KIND.server_role


class GenerateServerDied(ServerNotReady):
    """The generation server exited while a shard waited for it: a retry starts it again."""


def worker_role(shard: int) -> str:
    return KIND.worker_role(shard)


def server_info(ctx: RunLike) -> dict | None:
    return shared.server_info(ctx, KIND)


def start_generate_server(ctx: RunLike, log=None) -> tuple[ProcessRecord, bool]:
    """``eagleflow generate serve`` detached; a live recorded one is kept. (record, started now)."""
    return shared.start_server(ctx, KIND, f"{KIND.server} ({generation_engine(ctx.cfg).name}, serving mode)", log)


def check_ready(ctx: RunLike, health_timeout_s: float = 20.0) -> tuple[str, dict | None, str]:
    """The generation server's ``check_server_ready`` (a SIGSTOP'd server is "stuck", never "loading")."""
    return shared.check_ready(ctx, KIND, health_timeout_s)


def wait_generate_server_ready(ctx: RunLike, timeout_s: float | None = None, poll_s: float = 1.0, log=None) -> dict:
    info = wait_server_ready(ctx, lambda: check_ready(ctx, ctx.cfg.watchdog.health_timeout_s), "generation server",
                             SERVER_ROLE, ctx.cfg.server.ready_timeout_s if timeout_s is None else timeout_s, poll_s,
                             died=GenerateServerDied)
    if log:
        log(f"generation server ready at {info['url']}: model {info.get('model')}")
    return info


def stop_generate_server(ctx: RunLike, grace_s: float = 30.0, log=None) -> dict:
    stopped = ctx.node.stop_recorded(str(ctx.layout.pid_file(SERVER_ROLE)), grace_s=grace_s)
    ctx.node.run(["rm", "-f", "--", str(KIND.server_info_file(ctx.layout))], timeout=30)
    if log:
        log(f"generation server: {stopped.detail}")
    return {"server": stopped.outcome, "detail": stopped.detail}


def start_or_attach_generate_worker(ctx: RunLike, shard: int, log=None) -> tuple[ProcessRecord, bool]:
    """The detached worker of generation shard ``shard``, or the live one: never two on one shard
    (``phases.shared.lifecycle.start_or_attach_worker``). Returns (its record, attached)."""
    return shared.start_or_attach_worker(ctx, KIND, shard, log)


def _server_identity(ctx: RunLike) -> dict | None:
    """pid + start_ticks of the live recorded generation server (None when none runs): tells it from a later one."""
    st = ctx.node.process_status(str(ctx.layout.pid_file(SERVER_ROLE)))
    return {"pid": st.record.pid, "start_ticks": st.record.start_ticks} if st.alive and st.record else None


def record_server_stall(ctx: RunLike, shard: int, event: dict) -> bool:
    """Remember a stall verdict that blames the generation server, and which server that was, for the shard's
    retry; True when recorded."""
    if event.get("status") != "stalled" or event.get("cause") != "capture_server":
        return False
    ctx.node.write_text(str(KIND.shard_dir(ctx.layout, shard) / SERVER_STALL),
                        json.dumps({"subject": event.get("subject"), "verdict": event.get("verdict"),
                                    "server": _server_identity(ctx), "at": time.time()}) + "\n")
    return True


def stop_after_server_stall(ctx: RunLike, shard: int, grace_s: float = 30.0, log=None) -> bool:
    """A retry after a stall blamed on the server: a hung server still answers /health_generate, so attaching
    again would hang again. Stop the shard's recorded worker and, when the recorded server is still the one
    that stalled, stop it and start a fresh one; a server another shard's retry already replaced is kept.
    Runs on the node (``eagleflow generate unstall``) under the server's recovery lock, so several shards'
    retries stop one hung server once. True when it stopped the server."""
    if not isinstance(ctx.node, LocalNode):
        ans = ctx.node.run_json(ctx.eagleflow_argv(KIND.command, "unstall", "--shard", str(shard),
                                                   "--grace", str(grace_s)),
                                UnstallAnswer, timeout=grace_s + 300, log=log)
        return ans.server_stopped
    marker = str(KIND.shard_dir(ctx.layout, shard) / SERVER_STALL)
    if not ctx.node.read_text(marker):
        return False
    with NodeLock(str(ctx.layout.restart_lock_file(SERVER_ROLE)),
                  purpose=f"generation server restart after a stall, shard {shard} of run {ctx.layout.run_id}"):
        text = ctx.node.read_text(marker)
        if not text:
            return False
        try:
            seen = bounded_json.loads(text, source=str(marker))
        except ValueError:
            seen = {}
        why = seen.get("subject") or "a stall"
        stopped = ctx.node.stop_recorded(str(ctx.layout.pid_file(worker_role(shard))), grace_s=grace_s)
        if log:
            log(f"generate shard {shard}: the last try ended on {why} blamed on the generation server ({marker}); "
                f"this shard's worker: {stopped.detail}")
        now = _server_identity(ctx)
        # a marker without "server" predates the identity: the recorded server is taken to be the stalled one
        stalled = seen.get("server", now)
        server_stopped = now is not None and now == stalled
        if now is not None and server_stopped:
            if log:
                log(f"generate shard {shard}: the generation server pid {now['pid']} is the one that stalled; "
                    "stopping it and starting a fresh one (other shards' workers on it fail and resume on their "
                    "own retries)")
            stop_generate_server(ctx, grace_s=grace_s, log=log)
            start_generate_server(ctx, log=log)
        elif log:
            log(f"generate shard {shard}: the server that stalled ({stalled}) is no longer the recorded one "
                f"({now}): another retry replaced it; attaching")
        ctx.node.run(["rm", "-f", "--", marker], timeout=30)
    return server_stopped


class UnstallAnswer(BaseModel):
    """What ``eagleflow generate unstall`` prints."""
    model_config = ConfigDict(extra="allow")
    server_stopped: bool
