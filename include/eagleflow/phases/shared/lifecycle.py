"""What every sharded phase's lifecycle does alike on a node, taking its descriptor: its server's info, start and
readiness, its workers' detached start (one per shard) with the shard's sentinel.

A phase's own ``lifecycle`` module (``phases/<name>/lifecycle.py``) calls these with its ``KIND`` and adds only
what is its own (the capture server's dumps, the generation server's stall handling); its ``phase_lifecycle``
gathers them into the ``PhaseLifecycle`` the descriptor names. Over ``eagleflow.phase_jobs`` (the exclusive start
and readiness) and ``eagleflow.nodes`` primitives only, so the same calls serve a LocalNode, an SSHNode, the
Airflow operators and the watchdog's recovery.
"""
from __future__ import annotations

from eagleflow.layout import RunLike
from eagleflow.nodes import ProcessRecord
from eagleflow.phase_jobs import check_server_ready, read_server_info, start_exclusive, start_or_attach_server
from eagleflow.watchdog.sentinel import ensure_sentinel
from eagleflow.watchdog.signals import WatchedJob

from eagleflow.phases.descriptor import ShardKind


def server_info(ctx: RunLike, kind: ShardKind) -> dict | None:
    """The phase's live server's info file (url, pid, model...), read as pid records are; None when none."""
    return read_server_info(ctx, str(kind.server_info_file(ctx.layout)))


def start_server(ctx: RunLike, kind: ShardKind, label: str, log=None) -> tuple[ProcessRecord, bool]:
    """``eagleflow <command> serve`` detached; a live recorded one is kept. (its record, started now)."""
    return start_or_attach_server(ctx, kind.server_role, ctx.eagleflow_argv(kind.command, "serve"),
                                  str(kind.server_info_file(ctx.layout)), label, log)


def check_ready(ctx: RunLike, kind: ShardKind, health_timeout_s: float = 20.0) -> tuple[str, dict | None, str]:
    """The phase's server's ``check_server_ready`` (a SIGSTOP'd server is "stuck", never "loading")."""
    return check_server_ready(ctx, kind.server_role, str(kind.server_info_file(ctx.layout)), kind.command,
                              kind.server, health_timeout_s)


def start_or_attach_worker(ctx: RunLike, kind: ShardKind, shard: int, log=None) -> tuple[ProcessRecord, bool]:
    """Start the detached worker of ``shard`` (``eagleflow <command> run``), or return the live one: never two
    workers on one shard; then the shard's sentinel (it alarms when nothing looks at the shard).

    Returns (its record, attached). The start is exclusive on the node: the worker holds
    ``<state_dir>/locks/<run>.<worker role>.lock`` for its lifetime, taken by detach before the worker starts,
    so two callers at once start one worker; the other attaches to it. A holder that is not the recorded worker
    (a hand-started ``run``) raises JobAlreadyRunning naming its PID.
    """
    role = kind.worker_role(shard)
    of = kind.num_shards(ctx.cfg)
    rec, started = start_exclusive(ctx, role, ctx.eagleflow_argv(kind.command, "run", "--shard", str(shard),
                                                                 "--of", str(of)))
    if log:
        log(f"{kind.watch_name} {shard}: worker started on node {ctx.node.name}: pid {rec.pid}, log {rec.log_file}"
            if started else f"{kind.watch_name} {shard}: worker pid {rec.pid} is still running (record "
                            f"{ctx.layout.pid_file(role)}); attaching to it")
    ensure_sentinel(ctx, WatchedJob(shard=shard, num_shards=of, phase=kind.phase), log)
    return rec, not started
