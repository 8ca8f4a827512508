"""The node-command skeleton every sharded phase registers: ``eagleflow <kind.command> serve|run|start|wait|stop|
health``, each taking the phase's descriptor.

A phase's ``commands`` module (``phases/<name>/commands.py``) calls ``register`` with its ``ShardKind``, its own
``serve`` (which engine serves it) and its ``make_worker`` (its worker's settings), then adds the actions only it
has. What both phases did alike is here, worded from the descriptor:

- ``run --shard I [--of N] [--url U]``: one worker in the foreground, its shard's job lock held for the
  process's life (a second worker exits ``EXIT_ALREADY_RUNNING``), refused when the fleet handed the shard over,
  the server's URL read from its info file (as pid records are: a file someone else wrote names no server of
  ours), a SIGTERM turned into a "stopped" heartbeat, the worker's own error printed as FAILED (exit 3);
- ``start`` / ``wait`` / ``stop``: the phase's ``PhaseLifecycle`` (its server started detached, waited for,
  stopped through its pid record);
- ``health``: exit 0 when the recorded server answers ``/health_generate``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TextIO

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.config import PipelineConfig
from eagleflow.durable import UnsafeFile
from eagleflow.fleet.takeover import refuse_if_handed_over
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.local_run import LocalRun, own_run_folders
from eagleflow.nodes.locks import JobLockHeld, hold_for_life
from eagleflow.phase_jobs import ServerNotReady, read_server_info, server_healthy, server_url_in
from eagleflow.stop_signal import Stopped, stop_on_term

from eagleflow.phases.descriptor import ShardKind

EXIT_BAD_ARGS = 2
EXIT_FAILED = 3
EXIT_ALREADY_RUNNING = 4   # `run`: another live worker holds the shard's lock


class CommandRefused(Exception):
    """A phase's ``make_worker`` cannot build its worker: ``message`` is printed after the command's name, the
    command exits ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ShardWorker(Protocol):
    def run(self) -> Heartbeat: ...


# (cfg, layout, the run's settings of this worker, the server's url) -> the worker
MakeWorker = Callable[[PipelineConfig, RunLayout, "WorkerJob", str], ShardWorker]


@dataclass(frozen=True)
class WorkerJob:
    """One worker ``run_worker`` starts: its shard, its lock's role, its folder, what a stop keeps."""
    shard: int
    num_shards: int
    role: str
    purpose: str                  # the lock's purpose ("generation worker of shard 0 of run r")
    shard_dir: str
    handed_over_check: bool = True   # a shard of the phase (the fleet may have handed it over); False: held-out


@dataclass(frozen=True)
class PhaseCommands:
    """What a phase's ``commands`` module gives the skeleton: its descriptor and its own parts."""
    kind: ShardKind
    help: str                                    # the phase's group in `eagleflow --help`
    serve: Callable[[argparse.Namespace], int]   # `serve`: its server in the foreground (its engine's role)
    serve_help: str
    run_help: str
    make_worker: MakeWorker
    errors: tuple[type[BaseException], ...]      # the worker's own errors: printed as FAILED, exit 3
    kept: str                                    # what a stopped worker keeps ("stored samples are kept ...")
    stop_help: str = ""                          # said after "stop the run's <server> (TERM, grace, KILL)"
    serve_args: Callable[[argparse.ArgumentParser], None] | None = None


def local_run(args: argparse.Namespace) -> LocalRun:
    cfg, layout = run_from_args(args)
    return LocalRun(cfg=cfg, layout=layout, config_path=args.config)


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def register(sub: Any, phase: PhaseCommands) -> Any:
    """The phase's command group with the shared actions; returns its subparsers for the phase's own ones."""
    kind = phase.kind
    p = sub.add_parser(kind.command, help=phase.help)
    actions = p.add_subparsers(dest=f"{kind.command}_command", metavar="ACTION", required=True)

    s = actions.add_parser("serve", help=phase.serve_help)
    add_run_args(s)
    if phase.serve_args is not None:
        phase.serve_args(s)
    s.set_defaults(func=phase.serve)

    r = actions.add_parser("run", help=phase.run_help)
    add_run_args(r)
    r.add_argument("--shard", type=int, required=True)
    r.add_argument("--of", type=int, help=f"number of shards (default {kind.shards_field})")
    r.add_argument("--url", help=f"server URL (default: from <run_dir>/{kind.server_role}.json)")
    r.set_defaults(func=lambda args: run_shard(args, phase))

    st = actions.add_parser("start", help=f"start the {kind.server} detached (kept when already running)")
    add_run_args(st)
    st.set_defaults(func=lambda args: _start(args, kind))

    w = actions.add_parser("wait", help=f"wait until the {kind.server} answers")
    add_run_args(w)
    w.add_argument("--timeout", type=float)
    w.set_defaults(func=lambda args: _wait(args, kind))

    t = actions.add_parser("stop", help=f"stop the run's {kind.server} (TERM, grace, KILL){phase.stop_help}")
    add_run_args(t)
    t.add_argument("--grace", type=float, default=30.0)
    t.set_defaults(func=lambda args: _stop(args, kind))

    h = actions.add_parser("health", help=f"exit 0 when the run's {kind.server} answers /health_generate")
    add_run_args(h)
    h.add_argument("--timeout", type=float, default=20.0)
    h.set_defaults(func=lambda args: _health(args, kind))
    return actions


def run_shard(args: argparse.Namespace, phase: PhaseCommands) -> int:
    """`eagleflow <phase> run --shard I`: shard I of ``--of`` (default the config's count) in the foreground."""
    kind = phase.kind
    cfg, layout = run_from_args(args)
    of = args.of or kind.num_shards(cfg)
    if of != kind.num_shards(cfg):
        cfg = kind.with_shards(cfg, of)
    if not 0 <= args.shard < of:
        _err(f"eagleflow {kind.command} run: --shard {args.shard} is outside 0..{of - 1} (--of {of})")
        return EXIT_BAD_ARGS
    job = WorkerJob(shard=args.shard, num_shards=of, role=kind.worker_role(args.shard),
                    purpose=f"{kind.noun} worker of shard {args.shard} of run {layout.run_id}",
                    shard_dir=str(kind.shard_dir(layout, args.shard)))
    return run_worker(args, phase, cfg, layout, job, f"eagleflow {kind.command} run")


def run_worker(args: argparse.Namespace, phase: PhaseCommands, cfg: PipelineConfig, layout: RunLayout,
               job: WorkerJob, prog: str, log_to: TextIO | None = None) -> int:
    """One worker of the phase in the foreground: its lock held for life, the server found, the worker run."""
    kind = phase.kind
    out = log_to or sys.stdout
    try:
        # its folders ours first (another user's locks/ or pids/ could unlink the lock and record)
        own_run_folders(layout, job.shard_dir)
        # one worker per shard: held until this process exits (the kernel releases it, however it ends)
        hold_for_life(str(layout.lock_file(job.role)), purpose=job.purpose)
    except JobLockHeld as e:
        _err(f"{prog}: {e}")
        return EXIT_ALREADY_RUNNING
    except UnsafeFile as e:   # a link or someone else's file at the lock path: never taken as ours
        _err(f"{prog}: {e}")
        return EXIT_BAD_ARGS
    if job.handed_over_check:
        refused = refuse_if_handed_over(layout, job.shard, kind.phase, prog)
        if refused is not None:   # a fleet node took it (reconcile hand-over): it is worked on there
            return refused
    url = args.url
    if not url:
        info_file = str(kind.server_info_file(layout))
        try:   # read as pid records are: a file someone else wrote names no server of ours
            url = server_url_in(info_file)
        except (OSError, ValueError) as e:
            _err(f"{prog}: no {kind.server} recorded at {info_file} ({e}); start one "
                 f"(`eagleflow {kind.command} start`) or pass --url")
            return EXIT_FAILED
    try:
        worker = phase.make_worker(cfg, layout, job, url)
    except CommandRefused as e:
        _err(f"{prog}: {e}")
        return e.code
    # leaves "failed: stopped by SIGTERM" in the heartbeat instead of a stale "running"
    stop_on_term(f"{kind.watch_name} {job.shard}", phase.kept)
    caught: tuple[type[BaseException], ...] = (*phase.errors, Stopped)
    try:
        hb = worker.run()
    except caught as e:
        _err(f"{prog}: FAILED: {e}")
        return EXIT_FAILED
    print(hb.progress_line(), file=out, flush=True)
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _start(args: argparse.Namespace, kind: ShardKind) -> int:
    rec, started = kind.lifecycle().start_server(local_run(args), log=_log)
    print(json.dumps({"pid": rec.pid, "started": started}))
    return 0


def _wait(args: argparse.Namespace, kind: ShardKind) -> int:
    try:
        info = kind.lifecycle().wait_server_ready(local_run(args), timeout_s=args.timeout, log=_log)
    except ServerNotReady as e:
        _err(f"eagleflow {kind.command} wait: {e}")
        return EXIT_FAILED
    print(json.dumps(info))
    return 0


def _stop(args: argparse.Namespace, kind: ShardKind) -> int:
    print(json.dumps(kind.lifecycle().stop_server(local_run(args), grace_s=args.grace, log=_log)))
    return 0


def _health(args: argparse.Namespace, kind: ShardKind) -> int:
    ctx = local_run(args)
    info_file = kind.server_info_file(ctx.layout)
    info = read_server_info(ctx, str(info_file))
    if not info or not info.get("url"):
        _err(f"no {kind.server} info at {info_file}")
        return 1
    ok = server_healthy(info["url"], args.timeout)
    print(json.dumps({"healthy": ok, "url": info["url"]}))
    return 0 if ok else 1
