"""`eagleflow generate serve|run|start|wait|stop|health` (the phases' command skeleton, ``phases.shared.commands``) and
the generation's own `unstall` and `stats`: the generation phase, each step alone."""
from __future__ import annotations

import argparse
import json
import sys

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.config import PipelineConfig
from eagleflow.engines import generation_engine
from eagleflow.layout import RunLayout
from eagleflow.phases.shared import commands as skeleton
from eagleflow.phases.shared.commands import (EXIT_ALREADY_RUNNING, EXIT_FAILED, PhaseCommands, WorkerJob,
                                       local_run)

from . import KIND
from .lifecycle import stop_after_server_stall
from .phase import GenerationIncomplete, collect, shard_settings
from .worker import GenerateWorker, GenerationError

__all__ = ["EXIT_ALREADY_RUNNING", "EXIT_FAILED", "EXIT_INCOMPLETE", "register"]

EXIT_INCOMPLETE = 5         # `generate stats`; `generate run` exits 5 for a shard handed over (reconcile's EXIT_HANDED_OVER)


def _serve(args: argparse.Namespace) -> int:
    cfg, layout = run_from_args(args)
    return generation_engine(cfg).serve_generation(cfg, layout)


def _make_worker(cfg: PipelineConfig, layout: RunLayout, job: WorkerJob, url: str) -> GenerateWorker:
    return GenerateWorker(shard_settings(cfg, layout, job.shard, url), log=lambda m: print(m, flush=True))


COMMANDS = PhaseCommands(
    kind=KIND, help="generation phase: the target regenerates the assistant turns", serve=_serve,
    serve_help="run the target in serving mode in the foreground (generate.backend's engine, default "
               "capture.backend's)",
    run_help="regenerate one shard of the chosen sources through the generation server", make_worker=_make_worker,
    errors=(GenerationError,), kept="finished records are kept and a re-run resumes from the manifest")


def register(sub) -> None:
    gsub = skeleton.register(sub, COMMANDS)
    u = gsub.add_parser("unstall", help="after a stall blamed on the generation server: stop the shard's worker "
                        "and, if it is still the one that stalled, restart the server (once for all shards)")
    add_run_args(u)
    u.add_argument("--shard", type=int, required=True)
    u.add_argument("--grace", type=float, default=30.0)
    u.set_defaults(func=_unstall)
    c = gsub.add_parser("stats", help="per-source stats of the phase (generated/stats.json); fails when incomplete")
    add_run_args(c)
    c.add_argument("--partial", action="store_true", help="report an unfinished phase instead of failing")
    c.set_defaults(func=_stats)


def _unstall(args) -> int:
    stopped = stop_after_server_stall(local_run(args), args.shard, grace_s=args.grace,
                                      log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"server_stopped": stopped}))
    return 0


def _stats(args) -> int:
    cfg, layout = run_from_args(args)
    try:
        stats = collect(cfg, layout, require_complete=not args.partial)
    except GenerationIncomplete as e:
        print(f"eagleflow generate stats: {e}", file=sys.stderr)
        return EXIT_INCOMPLETE
    print(json.dumps(stats))
    return 0
