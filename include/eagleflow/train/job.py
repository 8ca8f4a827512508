"""The trainer as a detached node job: start it, attach to it, stop it (recorded PIDs only).

One trainer per run: a live pid record (checked against /proc start ticks)
means attach, never a second trainer. The trainer always resumes from its
newest checkpoint, so starting it again after a stall or a crash continues
the run instead of restarting it.
"""
from __future__ import annotations

import time
from typing import Callable

from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import TRAINER_ROLE, RunLike
from eagleflow.nodes import ProcessRecord
from eagleflow.watchdog.sentinel import ensure_sentinel
from eagleflow.watchdog.signals import WatchedJob


def trainer_argv(ctx: RunLike) -> list[str]:
    """`eagleflow train` on the node; under torchrun when ``train.nproc_per_node`` > 1."""
    argv = ctx.eagleflow_argv("train")
    n = ctx.cfg.train.nproc_per_node
    if n <= 1:
        return argv
    python, _, _, *rest = argv          # [python, -m, eagleflow.cli, train, --config, ...]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            "-m", "eagleflow.cli", *rest]


def read_train_heartbeat(ctx: RunLike) -> Heartbeat | None:
    text = ctx.node.read_text(str(ctx.layout.train_heartbeat_file))
    if not text:
        return None
    try:
        return Heartbeat.from_json(text)
    except (ValueError, TypeError, KeyError):
        return None


def start_or_attach_trainer(ctx: RunLike, log: Callable[[str], None] | None = None) -> tuple[ProcessRecord, bool]:
    """(pid record, attached): the live trainer of this run, or a newly started one."""
    pid_file = str(ctx.layout.pid_file(TRAINER_ROLE))
    rec = ctx.node.live_record(pid_file)
    if rec is not None:
        if log:
            log(f"trainer pid {rec.pid} is still running (record {pid_file}); attaching to it")
        ensure_sentinel(ctx, WatchedJob(shard=None), log)
        return rec, True
    # A heartbeat left by an earlier trainer ("failed", old times) must not be read as this one's.
    now = time.time()
    fresh = Heartbeat(job="train", pid=0, state="starting", time=now, started_at=now, last_progress_at=now,
                      unit="steps", total=ctx.cfg.train.max_steps)
    ctx.node.write_text(str(ctx.layout.train_heartbeat_file), fresh.to_json())
    proc = ctx.node.spawn_detached(trainer_argv(ctx), role=TRAINER_ROLE, pid_file=pid_file,
                                   log_file=str(ctx.layout.log_file(TRAINER_ROLE)), owned_roots=ctx.layout.owned_roots)
    if log:
        log(f"trainer started on node {ctx.node.name}: pid {proc.pid}, log {proc.log_file}")
    ensure_sentinel(ctx, WatchedJob(shard=None), log)   # it alarms when nothing looks at training while it runs
    return proc, False


def stop_trainer(ctx: RunLike, grace_s: float = 30.0, log: Callable[[str], None] | None = None) -> str:
    """TERM then KILL the recorded trainer's process group (torchrun and its workers)."""
    res = ctx.node.stop_recorded(str(ctx.layout.pid_file(TRAINER_ROLE)), grace_s=grace_s)
    if log and res.outcome != "not_recorded":
        log(res.detail)
    return res.outcome
