"""`eagleflow watch` (the live diagnosis of a shard or the trainer) and `eagleflow recover`.

``eagleflow watch --shard I --json`` is what the Airflow trigger runs on the
node at every poll: one command, one JSON line, one SSH round trip.

Exit codes of `eagleflow watch`: 0 healthy, starting or complete; 3 slow;
4 stalled; 5 dead; 6 failed (2 is a config error).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.phases import EXTRACT, KINDS, kind_of
from eagleflow.local_run import LocalRun
from eagleflow.protocol import ClaimAnswer, HandOverAnswer, ShardStates, answer_line

from .policy import decide
from .reconcile import claim, hand_over, release, scan, shard_state
from .recovery import open_incident, recover_in_watch, recover_server, recovery_budget_s
from .sentinel import looks_path, record_look, run_sentinel
from .signals import WatchMemory, WatchedJob, memory_path, observe


def register(sub) -> None:
    w = sub.add_parser("watch", help="diagnose a shard of a sharded phase or the trainer: healthy, slow, stalled, "
                                     "dead", description=__doc__)
    add_run_args(w)
    which = w.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard", type=int, help="the shard to watch (of --phase)")
    which.add_argument("--train", action="store_true", help="watch the draft training job")
    _phase_arg(w, "with --shard: the sharded phase of the shard")
    w.add_argument("--json", action="store_true", help="print the diagnosis as one JSON line")
    w.add_argument("--follow", action="store_true",
                   help="look again every watchdog.poll_interval_s until the job completes, stalls or dies")
    w.set_defaults(func=_watch)

    r = sub.add_parser("recover", help="before a shard's retry: restart the phase's server once per incident when "
                                       "unhealthy (under a node lock), free and verify the GPUs")
    add_run_args(r)
    r.add_argument("--shard", type=int, required=True, help="the shard about to be retried (for the log)")
    r.add_argument("--json", action="store_true")
    r.add_argument("--cause", choices=["capture_server", "worker"],
                   help="recover in the watch (no Airflow retry): open or join the incident of this node and "
                        "cause, restart the server once per incident if it is the cause, restart the worker")
    r.add_argument("--summary", default="", help="the watch's diagnosis line, kept in the incident")
    r.add_argument("--incident-only", action="store_true",
                   help="with --cause: only open or join the incident (quick; the caller mails, then recovers)")
    r.add_argument("--incident", help="with --cause: the incident id --incident-only returned")
    _phase_arg(r, "the sharded phase of --shard (its server and worker are recovered)")
    r.set_defaults(func=_recover)

    s = sub.add_parser("sentinel", help="(started detached beside each worker) alarm when nothing looked at the "
                                        "job for 3 poll intervals while it runs; exits when it ends")
    add_run_args(s)
    sjob = s.add_mutually_exclusive_group(required=True)
    sjob.add_argument("--shard", type=int, help="a shard (of --phase)")
    sjob.add_argument("--train", action="store_true", help="the draft training job")
    _phase_arg(s, "with --shard: the sharded phase of the shard")
    s.set_defaults(func=_sentinel)

    c = sub.add_parser("reconcile", help="find extraction and generation shards left incomplete with no worker, "
                                         "and rerun them")
    csub = c.add_subparsers(dest="reconcile_command", metavar="ACTION", required=True)
    sc = csub.add_parser("scan", help="list the shards of the latest runs under run_root, as JSON lines")
    add_run_args(sc)
    sc.add_argument("--latest", type=int, default=3, help="how many of the newest runs to look at")
    sc.set_defaults(func=_reconcile_scan)
    cl = csub.add_parser("claim", help="under a node lock: start the shard's worker (and the server) if still needed")
    add_run_args(cl)
    cl.add_argument("--shard", type=int, required=True)
    _phase_arg(cl, "which phase's shard: extraction (capture server) or generation (generation server)")
    cl.add_argument("--taken-from", help="a fleet node that handed this shard over to this one "
                                         "(`reconcile hand-over` there): recorded, then claimed as this node's")
    cl.set_defaults(func=_reconcile_claim)
    ho = csub.add_parser("hand-over", help="on a fleet node: hand shards proven free of our workers (lock free, "
                                           "no live worker) over to another node; their workers here refuse them")
    add_run_args(ho)
    ho.add_argument("--shards", type=_shard_list, required=True, help="comma-separated shards of the phase")
    ho.add_argument("--to", required=True, help="the fleet node that takes them")
    _phase_arg(ho, "whose shards: extraction or generation")
    ho.set_defaults(func=_reconcile_hand_over)
    st = csub.add_parser("states", help="stored / expected units of the given shards of a phase in this node's "
                                        "run dir, whoever owns them, as JSON")
    add_run_args(st)
    st.add_argument("--shards", type=_shard_list, required=True, help="comma-separated shards of the phase")
    _phase_arg(st, "whose shards: extraction (samples) or generation (records)")
    st.set_defaults(func=_reconcile_states)
    rl = csub.add_parser("release", help="stop the run's server of a phase if reconcile started it and it is unused")
    add_run_args(rl)
    _phase_arg(rl, "extract: the capture server; generate: the generation server")
    rl.set_defaults(func=_reconcile_release)


def _phase_arg(parser, help_text: str) -> None:
    parser.add_argument("--phase", choices=sorted(KINDS), default=EXTRACT, help=help_text)


def _watch(args) -> int:
    cfg, layout = run_from_args(args)
    kind = kind_of(args.phase)
    shards, field = kind.num_shards(cfg), kind.shards_field
    if args.shard is not None and not 0 <= args.shard < shards:
        print(f"eagleflow watch: --shard {args.shard} is outside 0..{shards - 1} "
              f"({field} = {shards})", file=sys.stderr)
        return 2
    job = WatchedJob(shard=None if args.train else args.shard, num_shards=shards, phase=kind.phase)
    mpath = memory_path(layout, job)
    while True:
        started = time.monotonic()
        mem = WatchMemory.load(mpath)
        diag = decide(observe(cfg, layout, job, mem), cfg)
        mem.save(mpath)
        # every look is logged on the node: the sentinel beside the job alarms when they stop
        record_look(looks_path(layout, job), {"at": time.time(), "by": "watch", "pid": os.getppid(),
                                              "verdict": diag.verdict, "summary": diag.summary[:300]})
        if args.json:
            print(diag.to_json(), flush=True)
        else:
            print(diag.summary if args.follow and diag.status is None else diag.render(), flush=True)
        if not args.follow or diag.status is not None:
            return diag.exit_code
        time.sleep(max(0.0, cfg.watchdog.poll_interval_s - (time.monotonic() - started)))


def _recover(args) -> int:
    cfg, layout = run_from_args(args)
    run = LocalRun(cfg=cfg, layout=layout, config_path=args.config)
    kind = kind_of(args.phase)   # the phase is its descriptor from here on
    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(msg)
        print(msg, file=sys.stderr, flush=True)

    if args.cause and not args.incident_only:
        # the watch at work, not a silent watch: the sentinel allows the recovery its own bound
        job = WatchedJob(shard=args.shard, num_shards=kind.num_shards(cfg), phase=kind.phase)
        record_look(looks_path(layout, job), {"at": time.time(), "by": "recover", "pid": os.getppid(),
                                              "until": time.time() + recovery_budget_s(cfg),
                                              "summary": f"recovering ({args.cause})"})
    if args.cause and args.incident_only:
        result = open_incident(run, args.shard, args.cause, args.summary, kind).to_dict()
    elif args.cause:
        result = recover_in_watch(run, args.shard, args.cause, args.summary, log=log, incident_id=args.incident,
                                  kind=kind)
    else:
        result = recover_server(run, args.shard, log=log, kind=kind)
    if args.cause and not args.incident_only:
        record_look(looks_path(layout, job), {"at": time.time(), "by": "recover", "pid": os.getppid(),
                                              "summary": str(result.get("summary", ""))[:300]})
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(result["summary"])
    return 0 if result["ok"] else 1


def _sentinel(args) -> int:
    cfg, layout = run_from_args(args)
    kind = kind_of(args.phase)
    shards, field = kind.num_shards(cfg), kind.shards_field
    if args.shard is not None and not 0 <= args.shard < shards:
        print(f"eagleflow sentinel: --shard {args.shard} is outside 0..{shards - 1} ({field} = {shards})",
              file=sys.stderr)
        return 2
    return run_sentinel(cfg, layout, WatchedJob(shard=None if args.train else args.shard, num_shards=shards,
                                                phase=kind.phase))


def _reconcile_scan(args) -> int:
    from dataclasses import asdict

    cfg, _ = run_from_args(args)
    states = scan(cfg, args.latest)
    for st in states:
        print(st.line(), file=sys.stderr, flush=True)
    # one JSON line: the control plane reads the last line (Node.run_json)
    print(answer_line(ShardStates, {"shards": [{**asdict(st), "needs_rerun": st.needs_rerun, "line": st.line()}
                                                for st in states]}), flush=True)
    return 0


def _reconcile_claim(args) -> int:
    cfg, layout = run_from_args(args)
    result = claim(LocalRun(cfg=cfg, layout=layout, config_path=args.config), args.shard,
                   log=lambda m: print(m, file=sys.stderr, flush=True), phase=args.phase,
                   taken_from=args.taken_from)
    print(answer_line(ClaimAnswer, result), flush=True)
    return 0


def _shard_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shards {text!r}: expected comma-separated shard numbers, "
                                         "e.g. 2,3") from None
    if any(k < 0 for k in out):
        raise argparse.ArgumentTypeError(f"--shards {text!r}: shard numbers start at 0")
    return out


def _shards_of_run(args, cfg, prog: str) -> bool:
    """Whether every --shards value is a shard of the phase in this run's config (else said on stderr)."""
    kind = kind_of(args.phase)
    n = kind.num_shards(cfg)
    bad = [k for k in args.shards if k >= n]
    if bad:
        print(f"eagleflow reconcile {prog}: --shards {bad} outside 0..{n - 1} ({kind.shards_field} = {n} in "
              f"{args.config}); pass shards of this run's phase", file=sys.stderr)
    return not bad


def _reconcile_hand_over(args) -> int:
    cfg, layout = run_from_args(args)
    if not _shards_of_run(args, cfg, "hand-over"):
        return 2
    print(answer_line(HandOverAnswer, hand_over(LocalRun(cfg=cfg, layout=layout, config_path=args.config),
                                                args.shards, args.to, phase=args.phase)), flush=True)
    return 0


def _reconcile_states(args) -> int:
    from dataclasses import asdict


    cfg, layout = run_from_args(args)
    if not _shards_of_run(args, cfg, "states"):
        return 2
    run = LocalRun(cfg=cfg, layout=layout, config_path=args.config)
    print(answer_line(ShardStates, {"shards": [{**asdict(st), "needs_rerun": st.needs_rerun, "line": st.line()}
                                                for st in (shard_state(run, s, args.phase) for s in args.shards)]}),
          flush=True)
    return 0


def _reconcile_release(args) -> int:
    cfg, layout = run_from_args(args)
    result = release(LocalRun(cfg=cfg, layout=layout, config_path=args.config),
                     log=lambda m: print(m, file=sys.stderr, flush=True), phase=args.phase)
    print(answer_line(ClaimAnswer, result), flush=True)
    return 0
