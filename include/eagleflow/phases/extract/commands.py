"""`eagleflow capture serve|run|start|wait|stop|health` (the phases' command skeleton, ``phases.shared.commands``) and
the extraction's own `held-out` and `verify`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any, TextIO

from eagleflow.capture.verify import quantisation_stats, stats_lines, verify_hidden_states
from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.config import PipelineConfig
from eagleflow.corpus.passes import capture_plan
from eagleflow.corpus.prepare import EVAL_FILE
from eagleflow.engines import engine_for, names_for
from eagleflow.layout import RunLayout
from eagleflow.phases.shared import commands as skeleton
from eagleflow.phases.shared.commands import EXIT_ALREADY_RUNNING, CommandRefused, PhaseCommands, WorkerJob
from eagleflow.serving.client import ServerError, server_info
from eagleflow.serving.dump_protocol import DumpTrustError, load_dump_key, private_dump_dir
from eagleflow.serving.launch import dump_dir
from eagleflow.stores import run_store_settings, store_for

from . import KIND
from .worker import ExtractionError, ShardWorker, WorkerSettings, shard_indexes

__all__ = ["EXIT_ALREADY_RUNNING", "HELD_OUT_REQUEST_SHARD", "HELD_OUT_ROLE", "register"]

HELD_OUT_ROLE = "worker_held_out"
HELD_OUT_REQUEST_SHARD = 99999   # request ids and dump names apart from every training shard (capture.shards <= 1024)


def _serve(args: argparse.Namespace) -> int:
    cfg, layout = run_from_args(args)
    engine = engine_for(args.backend or cfg.capture.backend, "capture_server",
                        "--backend" if args.backend else "capture.backend")
    return engine.serve_capture(cfg, layout)


def _serve_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--backend", choices=names_for("capture_server"), help="override capture.backend")


def _make_worker(cfg: PipelineConfig, layout: RunLayout, job: WorkerJob, url: str, log_to: TextIO = sys.stdout,
                 **settings: Any) -> ShardWorker:
    """The extraction worker of ``job``: the dump key found, the model the server names."""
    try:
        dumps, dump_key = str(private_dump_dir(dump_dir(cfg))), load_dump_key(layout.dump_key_file)
    except DumpTrustError as e:
        raise CommandRefused(2, f"shard {job.shard}: {e}") from None
    model = str(cfg.resolve(cfg.target_model))
    try:
        model = server_info(url).get("model") or model
    except ServerError:
        pass  # the first request reports the failure with its sample
    if not settings:   # a shard of the phase: its share of the corpus, into the run's store (stream.storage)
        store = run_store_settings(cfg, layout)
        corpus = str(layout.corpus_dir / "corpus.parquet")
        # a streaming run whose corpus exceeds the buffer captures the shard once per epoch (the trainer agrees)
        passes = (capture_plan(cfg, layout).passes
                  if store_for(cfg.stream.storage).streaming and os.path.isfile(corpus) else 1)
        settings = dict(corpus_file=corpus, storage=cfg.stream.storage,
                        buffer_bytes=store.buffer_bytes, endpoint_file=store.endpoint_file,
                        put_timeout_s=store.put_timeout_s, writer_nodes=store.writer_nodes,
                        max_sample_bytes=store.max_sample_bytes, passes=passes)
    ws = WorkerSettings(
        run_id=layout.run_id, shard=job.shard, num_shards=job.num_shards, shard_dir=job.shard_dir, dump_dir=dumps,
        dump_key=dump_key, server_url=url, in_flight=cfg.capture.in_flight,
        request_timeout_base_s=cfg.capture.request_timeout_base_s,
        request_timeout_per_token_s=cfg.capture.request_timeout_per_token_s,
        heartbeat_interval_s=cfg.capture.heartbeat_interval_s, model=model, store_dtype=cfg.capture.store_dtype,
        **settings)
    return ShardWorker(ws, log=lambda m: print(m, file=log_to, flush=True))


COMMANDS = PhaseCommands(
    kind=KIND, help="hidden-state capture: server, extraction workers, verification",
    serve=_serve, serve_help="run the capture server in the foreground (capture.backend's engine)",
    serve_args=_serve_args, run_help="extract one shard of the corpus through the capture server",
    make_worker=_make_worker, errors=(ExtractionError,),
    kept="stored samples are kept and a re-run resumes from the manifest", stop_help=" and remove its dumps")


def register(sub) -> None:
    csub = skeleton.register(sub, COMMANDS)

    o = csub.add_parser("held-out", help="capture the held-out records training evaluates on (train."
                        "held_out_samples, kept apart from the training store) and verify them")
    add_run_args(o)
    o.add_argument("--url", help=f"server URL (default: from <run_dir>/{KIND.server_role}.json)")
    o.add_argument("--json", action="store_true", help="print the verification report as JSON")
    o.set_defaults(func=_held_out)

    v = csub.add_parser("verify", help="check every stored file against its shard's manifest")
    add_run_args(v)
    v.add_argument("--no-digest", action="store_true", help="check sizes only (fast)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--stats", action="store_true", help="also print the quantisation error per stored tensor "
                   "(max and mean relative error) of a sample of files")
    v.add_argument("--stats-files", type=int, default=32, help="how many files --stats reads (default 32)")
    v.set_defaults(func=_verify)


def _held_out(args) -> int:
    """Capture the first train.held_out_samples held-out records into their own store, then verify it."""
    cfg, layout = run_from_args(args)
    eval_file = str(layout.corpus_dir / EVAL_FILE)
    if not os.path.isfile(eval_file):
        print(f"eagleflow capture held-out: FAILED: no held-out split at {eval_file}; run `eagleflow corpus "
              "prepare` first", file=sys.stderr)
        return 2
    limit = cfg.train.held_out_samples
    expected = shard_indexes(eval_file, 0, 1, limit)
    if expected:
        job = WorkerJob(shard=0, num_shards=1, role=HELD_OUT_ROLE, purpose=f"held-out capture of run {layout.run_id}",
                        shard_dir=str(PurePosixPath(layout.held_out_hidden_states_dir) / "shard_00000"),
                        handed_over_check=False)
        held_out = replace(COMMANDS, make_worker=lambda c, lay, j, url: _make_worker(
            c, lay, j, url, log_to=sys.stderr, corpus_file=eval_file, limit=limit,
            request_shard=HELD_OUT_REQUEST_SHARD))
        code = skeleton.run_worker(args, held_out, cfg, layout, job, "eagleflow capture held-out", log_to=sys.stderr)
        if code != 0:
            return code
    result = verify_hidden_states(layout.held_out_hidden_states_dir, {0: expected})
    report = {**result.to_json(), "held_out_samples": limit, "dir": str(layout.held_out_hidden_states_dir)}
    print(json.dumps(report) if args.json else f"{result.summary()} in {layout.held_out_hidden_states_dir}")
    return 0 if result.ok else 1


def _verify(args) -> int:
    cfg, layout = run_from_args(args)
    corpus = str(layout.corpus_dir / "corpus.parquet")
    if not os.path.isfile(corpus):
        print(f"eagleflow capture verify: FAILED: no corpus at {corpus}, so nothing was captured to verify; "
              "run `eagleflow corpus prepare` and the extraction first", file=sys.stderr)
        return 1
    n = cfg.capture.shards
    result = verify_hidden_states(layout.hidden_states_dir, {s: shard_indexes(corpus, s, n) for s in range(n)},
                                  check_digest=not args.no_digest)
    stats = None
    if args.stats:
        try:
            stats = quantisation_stats(layout.hidden_states_dir, args.stats_files)
        except ValueError as e:
            print(f"eagleflow capture verify --stats: {e}", file=sys.stderr)
    if args.json:
        print(json.dumps({**result.to_json(), **({"quantisation": stats} if stats is not None else {})}))
    else:
        for r in result.reports:
            print(r.line())
        print(f"{result.summary()} in {layout.hidden_states_dir}")
        if stats is not None:
            print("\n".join(stats_lines(stats)))
    return 0 if result.ok else 1
