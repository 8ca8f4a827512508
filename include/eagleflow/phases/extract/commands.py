"""`eagleflow capture serve|run|held-out|verify|stop|health`."""
from __future__ import annotations

import json
import sys
from pathlib import PurePosixPath

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.engines import engine_for, names_for

EXIT_ALREADY_RUNNING = 4  # `capture run`: another live worker holds the shard's lock


def register(sub) -> None:
    p = sub.add_parser("capture", help="hidden-state capture: server, extraction workers, verification")
    csub = p.add_subparsers(dest="capture_command", metavar="ACTION", required=True)

    s = csub.add_parser("serve", help="run the capture server in the foreground (hf or sglang backend)")
    add_run_args(s)
    s.add_argument("--backend", choices=names_for("capture_server"), help="override capture.backend")
    s.set_defaults(func=_serve)

    r = csub.add_parser("run", help="extract one shard of the corpus through the capture server")
    add_run_args(r)
    r.add_argument("--shard", type=int, required=True)
    r.add_argument("--of", type=int, help="number of shards (default capture.shards)")
    r.add_argument("--url", help="server URL (default: from <run_dir>/capture_server.json)")
    r.set_defaults(func=_run)

    o = csub.add_parser("held-out", help="capture the held-out records training evaluates on (train."
                        "held_out_samples, kept apart from the training store) and verify them")
    add_run_args(o)
    o.add_argument("--url", help="server URL (default: from <run_dir>/capture_server.json)")
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

    t = csub.add_parser("stop", help="stop the run's capture server (TERM, grace, KILL) and remove its dumps")
    add_run_args(t)
    t.add_argument("--grace", type=float, default=30.0)
    t.set_defaults(func=_stop)

    h = csub.add_parser("health", help="exit 0 when the run's capture server answers /health_generate")
    add_run_args(h)
    h.add_argument("--timeout", type=float, default=20.0)
    h.set_defaults(func=_health)


def _local_run(args):
    from eagleflow.local_run import LocalRun
    cfg, layout = run_from_args(args)
    return LocalRun(cfg=cfg, layout=layout, config_path=args.config)


def _serve(args) -> int:
    cfg, layout = run_from_args(args)
    engine = engine_for(args.backend or cfg.capture.backend, "capture_server",
                        "--backend" if args.backend else "capture.backend")
    return engine.serve_capture(cfg, layout)


def _run(args) -> int:
    cfg, layout = run_from_args(args)
    of = args.of or cfg.capture.shards
    if not 0 <= args.shard < of:
        print(f"eagleflow capture run: --shard {args.shard} is outside 0..{of - 1} (--of {of})", file=sys.stderr)
        return 2
    from .lifecycle import worker_role
    from eagleflow.stores import run_store_settings
    store = run_store_settings(cfg, layout)     # stream.storage: where the samples go (the held-out: on disk)
    return _work(args, cfg, layout, "eagleflow capture run", worker_role(args.shard),
                 f"extraction worker of shard {args.shard} of run {layout.run_id}",
                 shard=args.shard, num_shards=of, corpus_file=str(layout.corpus_dir / "corpus.parquet"),
                 shard_dir=str(layout.shard_dir(args.shard)), storage=cfg.stream.storage,
                 buffer_bytes=store.buffer_bytes, endpoint_file=store.endpoint_file,
                 put_timeout_s=store.put_timeout_s)


HELD_OUT_ROLE = "worker_held_out"
HELD_OUT_REQUEST_SHARD = 99999   # request ids and dump names apart from every training shard (capture.shards <= 1024)


def _held_out(args) -> int:
    """Capture the first train.held_out_samples held-out records into their own store, then verify it."""
    import os

    from eagleflow.corpus.prepare import EVAL_FILE
    from eagleflow.capture.verify import verify_hidden_states
    from .worker import shard_indexes

    cfg, layout = run_from_args(args)
    eval_file = str(layout.corpus_dir / EVAL_FILE)
    if not os.path.isfile(eval_file):
        print(f"eagleflow capture held-out: FAILED: no held-out split at {eval_file}; run `eagleflow corpus "
              "prepare` first", file=sys.stderr)
        return 2
    limit = cfg.train.held_out_samples
    expected = shard_indexes(eval_file, 0, 1, limit)
    if expected:
        code = _work(args, cfg, layout, "eagleflow capture held-out", HELD_OUT_ROLE,
                     f"held-out capture of run {layout.run_id}", shard=0, num_shards=1, corpus_file=eval_file,
                     shard_dir=str(PurePosixPath(layout.held_out_hidden_states_dir) / "shard_00000"), limit=limit,
                     request_shard=HELD_OUT_REQUEST_SHARD, log_to=sys.stderr)
        if code != 0:
            return code
    result = verify_hidden_states(layout.held_out_hidden_states_dir, {0: expected})
    report = {**result.to_json(), "held_out_samples": limit, "dir": str(layout.held_out_hidden_states_dir)}
    print(json.dumps(report) if args.json else f"{result.summary()} in {layout.held_out_hidden_states_dir}")
    return 0 if result.ok else 1


def _work(args, cfg, layout, prog: str, role: str, purpose: str, log_to=sys.stdout, **settings) -> int:
    """One extraction worker in the foreground: its lock held for life, the server and dump key found."""
    from eagleflow.serving.client import ServerError, server_info
    from .lifecycle import dump_dir
    from .worker import ExtractionError, ShardWorker, WorkerSettings

    from eagleflow.durable import UnsafeFile
    from eagleflow.local_run import own_run_folders
    from eagleflow.nodes.locks import JobLockHeld, hold_for_life
    shard = settings["shard"]
    try:
        # its folders ours first (another user's locks/ or pids/ could unlink the lock and record)
        own_run_folders(layout, settings["shard_dir"])
        # one worker per shard: held until this process exits (the kernel releases it, however it ends)
        hold_for_life(str(layout.lock_file(role)), purpose=purpose)
    except JobLockHeld as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        return EXIT_ALREADY_RUNNING
    except UnsafeFile as e:   # a link or someone else's file at the lock path: never taken as ours
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        return 2
    from .lifecycle import worker_role
    if role == worker_role(shard):
        from eagleflow.fleet.takeover import refuse_if_handed_over
        from eagleflow.phases import EXTRACT
        refused = refuse_if_handed_over(layout, shard, EXTRACT, prog)
        if refused is not None:
            return refused
    url = args.url
    if not url:
        from eagleflow.phase_jobs import server_url_in
        try:   # read as pid records are: a file someone else wrote names no server of ours
            url = server_url_in(str(layout.server_info_file))
        except (OSError, ValueError) as e:
            print(f"{prog}: no capture server recorded at {layout.server_info_file} ({e}); start one "
                  f"(`eagleflow capture serve`) or pass --url", file=sys.stderr)
            return 3
    from eagleflow.serving.dump_protocol import DumpTrustError, load_dump_key, private_dump_dir
    try:
        dumps, dump_key = str(private_dump_dir(dump_dir(cfg))), load_dump_key(layout.dump_key_file)
    except DumpTrustError as e:
        print(f"{prog}: shard {shard}: {e}", file=sys.stderr, flush=True)
        return 2
    model = str(cfg.resolve(cfg.target_model))
    try:
        model = server_info(url).get("model") or model
    except ServerError:
        pass  # the first request reports the failure with its sample
    ws = WorkerSettings(
        run_id=layout.run_id, dump_dir=dumps, dump_key=dump_key, server_url=url, in_flight=cfg.capture.in_flight,
        request_timeout_base_s=cfg.capture.request_timeout_base_s,
        request_timeout_per_token_s=cfg.capture.request_timeout_per_token_s,
        heartbeat_interval_s=cfg.capture.heartbeat_interval_s, model=model, store_dtype=cfg.capture.store_dtype,
        **settings)
    from eagleflow.stop_signal import Stopped, stop_on_term
    # leaves "failed: stopped by SIGTERM" in the heartbeat instead of a stale "running"
    stop_on_term(f"shard {shard}", "stored samples are kept and a re-run resumes from the manifest")
    try:
        hb = ShardWorker(ws, log=lambda m: print(m, file=log_to, flush=True)).run()
    except (ExtractionError, Stopped) as e:
        print(f"{prog}: FAILED: {e}", file=sys.stderr, flush=True)
        return 3
    print(hb.progress_line(), file=log_to, flush=True)
    return 0


def _verify(args) -> int:
    from eagleflow.capture.verify import verify_hidden_states
    from .worker import shard_indexes

    cfg, layout = run_from_args(args)
    corpus = str(layout.corpus_dir / "corpus.parquet")
    import os
    if not os.path.isfile(corpus):
        print(f"eagleflow capture verify: FAILED: no corpus at {corpus}, so nothing was captured to verify; "
              "run `eagleflow corpus prepare` and the extraction first", file=sys.stderr)
        return 1
    n = cfg.capture.shards
    result = verify_hidden_states(layout.hidden_states_dir, {s: shard_indexes(corpus, s, n) for s in range(n)},
                                  check_digest=not args.no_digest)
    stats = None
    if args.stats:
        from eagleflow.capture.verify import quantisation_stats
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
            from eagleflow.capture.verify import stats_lines
            print("\n".join(stats_lines(stats)))
    return 0 if result.ok else 1


def _stop(args) -> int:
    from .lifecycle import stop_capture_server
    ctx = _local_run(args)
    print(json.dumps(stop_capture_server(ctx, grace_s=args.grace, log=lambda m: print(m, file=sys.stderr))))
    return 0


def _health(args) -> int:
    from eagleflow.phase_jobs import server_healthy

    from .lifecycle import server_info
    ctx = _local_run(args)
    info = server_info(ctx)
    if not info or not info.get("url"):
        print(f"no capture server info at {ctx.layout.server_info_file}", file=sys.stderr)
        return 1
    ok = server_healthy(info["url"], args.timeout)
    print(json.dumps({"healthy": ok, "url": info["url"]}))
    return 0 if ok else 1
