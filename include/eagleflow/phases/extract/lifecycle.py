"""The capture phase's server and workers on a node: start detached, wait until ready, check health, stop
(what both phases' jobs share is ``eagleflow.phase_jobs``).

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

import os
from typing import Any

from pydantic import BaseModel

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLike
from eagleflow.nodes import ProcessRecord
from eagleflow.phase_jobs import wait_server_ready
from eagleflow.phases.shared import lifecycle as shared
from eagleflow.serving.launch import dump_dir  # noqa: F401  (where the capture server dumps; read here too)
from eagleflow.watchdog.sentinel import ensure_sentinel as start_sentinel
from eagleflow.watchdog.signals import WatchedJob

from . import KIND
from .worker import shard_indexes

SERVER_ROLE = KIND.server_role


def worker_role(shard: int) -> str:
    return KIND.worker_role(shard)


def worker_role_pattern() -> str:
    """A regular expression matching every ``worker_role`` whole."""
    return KIND.worker_role_pattern()


# --- the capture server -------------------------------------------------------------

def server_info(ctx: RunLike) -> dict | None:
    return shared.server_info(ctx, KIND)


def start_capture_server(ctx: RunLike, log=None) -> tuple[ProcessRecord, bool]:
    """Start ``eagleflow capture serve`` detached; a live recorded server is kept.

    Returns (its record, whether it was started now).
    """
    return shared.start_server(ctx, KIND, f"{KIND.server} ({ctx.cfg.capture.backend})", log)


def check_ready(ctx: RunLike, health_timeout_s: float = 20.0) -> tuple[str, dict | None, str]:
    """The capture server's ``check_server_ready``."""
    return shared.check_ready(ctx, KIND, health_timeout_s)


def wait_capture_server_ready(ctx: RunLike, timeout_s: float | None = None, poll_s: float = 1.0,
                              log=None) -> dict:
    """Block until /health_generate answers; raise ServerNotReady when it died, is stuck or the grace
    ran out."""
    info = wait_server_ready(ctx, lambda: check_ready(ctx, ctx.cfg.watchdog.health_timeout_s), "capture server",
                             SERVER_ROLE, ctx.cfg.server.ready_timeout_s if timeout_s is None else timeout_s, poll_s)
    if log:
        log(f"capture server ready at {info['url']}: model {info.get('model')}, aux layers {info.get('aux_layers')}")
    return info


class RemovedDumps(BaseModel):
    removed: int


def remove_run_dumps(ctx: RunLike) -> int:
    """This run's dumps (all shards) in the dump dir, matched by exact run id; other runs' dumps are left alone."""
    argv = [ctx.node.python, "-m", "eagleflow.serving.dump_protocol", "remove-dumps", "--dump-dir", dump_dir(ctx.cfg),
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
    """Start the detached worker of ``shard``, or return the live one: never two workers on one shard
    (``phases.shared.lifecycle.start_or_attach_worker``). Returns (its record, attached)."""
    return shared.start_or_attach_worker(ctx, KIND, shard, log)


def ensure_sentinel(ctx: RunLike, shard: int, log=None) -> ProcessRecord | None:
    """The extraction shard's sentinel (eagleflow.watchdog.sentinel: it alarms when nothing looks at the shard)."""
    return start_sentinel(ctx, WatchedJob(shard=shard, num_shards=KIND.num_shards(ctx.cfg), phase=KIND.phase), log)


def stop_worker(ctx: RunLike, shard: int, grace_s: float = 15.0, log=None) -> str:
    res = ctx.node.stop_recorded(str(ctx.layout.pid_file(worker_role(shard))), grace_s=grace_s)
    if log and res.outcome != "not_recorded":
        log(res.detail)
    return res.outcome


def shard_expectation(run, shard: int) -> tuple[int, bool]:
    """(samples shard ``shard`` extracts, True): its share of the corpus; an extraction shard is finished
    when its manifest holds them all (0 before the corpus exists)."""
    corpus = str(run.layout.corpus_dir / "corpus.parquet")
    return (len(shard_indexes(corpus, shard, run.cfg.capture.shards)) if os.path.exists(corpus) else 0), True


def can_be_judged(run) -> bool:
    """Reconcile judges the extraction shards of a run whose corpus exists (nothing to compare them with before)."""
    return os.path.exists(str(run.layout.corpus_dir / "corpus.parquet"))

