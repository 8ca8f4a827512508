"""`eagleflow generate serve|run|start|wait|stop|unstall|health|stats`: the generation phase, each step alone."""
from __future__ import annotations

import json
import sys

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.engines import generation_engine

EXIT_ALREADY_RUNNING = 4   # `generate run`: another live worker holds the shard's lock
EXIT_FAILED = 3
EXIT_INCOMPLETE = 5         # `generate stats`; `generate run` exits 5 for a shard handed over (reconcile's EXIT_HANDED_OVER)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generation phase: the target regenerates the assistant turns")
    gsub = p.add_subparsers(dest="generate_command", metavar="ACTION", required=True)
    s = gsub.add_parser("serve", help="run the target in serving mode in the foreground (generate.backend's "
                        "engine, default capture.backend's)")
    add_run_args(s)
    s.set_defaults(func=_serve)
    r = gsub.add_parser("run", help="regenerate one shard of the chosen sources through the generation server")
    add_run_args(r)
    r.add_argument("--shard", type=int, required=True)
    r.add_argument("--of", type=int, help="number of shards (default generate.shards)")
    r.add_argument("--url", help="server URL (default: from <run_dir>/generate_server.json)")
    r.set_defaults(func=_run)
    st = gsub.add_parser("start", help="start the generation server detached (kept when already running)")
    add_run_args(st)
    st.set_defaults(func=_start)
    w = gsub.add_parser("wait", help="wait until the generation server answers")
    add_run_args(w)
    w.add_argument("--timeout", type=float)
    w.set_defaults(func=_wait)
    t = gsub.add_parser("stop", help="stop the run's generation server (TERM, grace, KILL)")
    add_run_args(t)
    t.add_argument("--grace", type=float, default=30.0)
    t.set_defaults(func=_stop)
    h = gsub.add_parser("health", help="exit 0 when the generation server answers /health_generate")
    add_run_args(h)
    h.add_argument("--timeout", type=float, default=20.0)
    h.set_defaults(func=_health)
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


def _local(args):
    from eagleflow.local_run import LocalRun
    cfg, layout = run_from_args(args)
    return LocalRun(cfg=cfg, layout=layout, config_path=args.config)


def _serve(args) -> int:
    cfg, layout = run_from_args(args)
    return generation_engine(cfg).serve_generation(cfg, layout)


def _run(args) -> int:
    from eagleflow.durable import UnsafeFile
    from eagleflow.local_run import own_run_folders
    from eagleflow.nodes.locks import JobLockHeld, hold_for_life

    from .lifecycle import worker_role
    from .phase import shard_settings
    from .worker import GenerateWorker, GenerationError

    cfg, layout = run_from_args(args)
    of = args.of or cfg.generate.shards
    if of != cfg.generate.shards:
        cfg = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"shards": of})})
    if not 0 <= args.shard < of:
        print(f"eagleflow generate run: --shard {args.shard} is outside 0..{of - 1} (--of {of})", file=sys.stderr)
        return 2
    try:
        # its folders ours first (another user's locks/ or pids/ could unlink the lock and record)
        own_run_folders(layout, str(layout.generate_shard_dir(args.shard)))
        hold_for_life(str(layout.lock_file(worker_role(args.shard))),
                      purpose=f"generation worker of shard {args.shard} of run {layout.run_id}")
    except JobLockHeld as e:
        print(f"eagleflow generate run: {e}", file=sys.stderr, flush=True)
        return EXIT_ALREADY_RUNNING
    except UnsafeFile as e:
        print(f"eagleflow generate run: {e}", file=sys.stderr, flush=True)
        return 2
    from eagleflow.fleet.takeover import refuse_if_handed_over
    from eagleflow.phases import GENERATE
    refused = refuse_if_handed_over(layout, args.shard, GENERATE, "eagleflow generate run")
    if refused is not None:   # a fleet node took it (reconcile hand-over): it is generated there
        return refused
    url = args.url
    if not url:
        from eagleflow.phase_jobs import server_url_in
        try:   # read as pid records are: a file someone else wrote names no server of ours
            url = server_url_in(str(layout.generate_server_info_file))
        except (OSError, ValueError) as e:
            print(f"eagleflow generate run: no generation server recorded at {layout.generate_server_info_file} "
                  f"({e}); start one (`eagleflow generate start`) or pass --url", file=sys.stderr)
            return EXIT_FAILED
    from eagleflow.stop_signal import Stopped, stop_on_term
    stop_on_term(f"generate shard {args.shard}", "finished records are kept and a re-run resumes from the manifest")
    try:
        hb = GenerateWorker(shard_settings(cfg, layout, args.shard, url), log=lambda m: print(m, flush=True)).run()
    except (GenerationError, Stopped) as e:
        print(f"eagleflow generate run: FAILED: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print(hb.progress_line(), flush=True)
    return 0


def _start(args) -> int:
    from .lifecycle import start_generate_server
    rec, started = start_generate_server(_local(args), log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"pid": rec.pid, "started": started}))
    return 0


def _wait(args) -> int:
    from eagleflow.phase_jobs import ServerNotReady
    from .lifecycle import wait_generate_server_ready
    try:
        info = wait_generate_server_ready(_local(args), timeout_s=args.timeout, log=lambda m: print(m, file=sys.stderr))
    except ServerNotReady as e:
        print(f"eagleflow generate wait: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(info))
    return 0


def _stop(args) -> int:
    from .lifecycle import stop_generate_server
    print(json.dumps(stop_generate_server(_local(args), grace_s=args.grace, log=lambda m: print(m, file=sys.stderr))))
    return 0


def _unstall(args) -> int:
    from .lifecycle import stop_after_server_stall
    stopped = stop_after_server_stall(_local(args), args.shard, grace_s=args.grace,
                                      log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"server_stopped": stopped}))
    return 0


def _health(args) -> int:
    from eagleflow.phase_jobs import server_healthy
    from .lifecycle import server_info
    info = server_info(_local(args))
    if not info or not info.get("url"):
        print("no generation server info", file=sys.stderr)
        return 1
    ok = server_healthy(info["url"], args.timeout)
    print(json.dumps({"healthy": ok, "url": info["url"]}))
    return 0 if ok else 1


def _stats(args) -> int:
    from .phase import GenerationIncomplete, collect
    cfg, layout = run_from_args(args)
    try:
        stats = collect(cfg, layout, require_complete=not args.partial)
    except GenerationIncomplete as e:
        print(f"eagleflow generate stats: {e}", file=sys.stderr)
        return EXIT_INCOMPLETE
    print(json.dumps(stats))
    return 0
