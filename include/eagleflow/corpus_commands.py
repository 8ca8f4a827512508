"""`eagleflow corpus ...`: prepare, stats, budget, delete-caches.

A top-level module, above both the corpus package and the generation phase: ``prepare`` hands the
generation phase's results to ``corpus.prepare`` (which must not import the phase: it reads the corpus).

Each command prints human-readable lines and, as its last stdout line, one
JSON object, which the Airflow operators parse.
"""
from __future__ import annotations

import argparse
import json
import sys

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.nodes import LocalNode
from eagleflow.corpus.budget import BudgetError, check_budget
from eagleflow.corpus.caches import CacheDeletionRefused, delete_old_caches
from eagleflow.corpus.prepare import BadRecordsError, prepare_corpus, read_stats
from eagleflow.corpus.sources import SourceError
from eagleflow.corpus.tokenize import TemplateError
from eagleflow.phases.generate.phase import GeneratedSources

EXIT_BAD_INPUT = 2  # a source that cannot be read, a chat template that cannot render the records
EXIT_BAD_RECORDS = 3
EXIT_NOT_ENOUGH_DISK = 4
EXIT_REFUSED = 5


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cmd_prepare(args: argparse.Namespace) -> int:
    cfg, layout = run_from_args(args)
    try:
        stats = prepare_corpus(cfg, layout, num_proc=args.num_proc, mask_method=args.mask_method, log=_log,
                               regenerated=GeneratedSources(cfg, layout))
    except BadRecordsError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_RECORDS
    except (SourceError, TemplateError) as e:
        print(f"eagleflow corpus prepare: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(stats))
    return 0


def format_stats(stats: dict) -> str:
    lines = [f"corpus {stats['corpus_file']}",
             f"  records {stats['records']}, tokens {stats['tokens']}, masked (loss) tokens {stats['masked_tokens']}, "
             f"mask method {stats['mask_method']}, seed {stats['seed']}, max_length {stats['max_length']}"]
    if stats.get("chat_template"):
        lines.append(f"  rendered by {stats['chat_template']}")
    if stats.get("splits"):   # records above are the training split; per-source rows count both
        lines.append(f"  held out of training: {stats['eval_records']} record(s) in {stats['eval_file']} ("
                     + ", ".join(f"{k} {v}" for k, v in stats["splits"]["eval"].items()) + ")")
    ln = stats["length"]
    lines.append(f"  length: min {ln['min']} mean {ln['mean']} p50 {ln['p50']} p90 {ln['p90']} p99 {ln['p99']} "
                 f"max {ln['max']}; over max_length: {stats.get('over_max_length', 'truncate')}, "
                 f"{stats.get('cut_at_message_boundary', 0)} cut at a message boundary, "
                 f"{stats['truncated_to_max_length']} truncated")
    lines.append(f"  {'source':<20} {'read':>8} {'bad':>5} {'dropped':>7} {'records':>8} {'turns':>8} "
                 f"{'w/ tool calls':>13} {'tool msgs':>9} {'tokens':>12} {'masked':>12}")
    for name, s in stats["per_source"].items():
        lines.append(f"  {name:<20} {s['read']:>8} {s['bad']:>5} {s['dropped']:>7} {s['records']:>8} "
                     f"{s.get('turns', 0):>8} {s.get('records_with_tool_calls', 0):>13} {s.get('tool_messages', 0):>9} "
                     f"{s['tokens']:>12} {s['masked_tokens']:>12}")
        why = {**s.get("bad_by_reason", {}), **s.get("dropped_by_reason", {})}
        if why:
            lines.append(f"  {'':<20} bad/dropped by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(why.items())))
    dropped = stats["dropped"]
    lines.append("  bad records: " + (", ".join(f"{k} {v}" for k, v in dropped["bad_record"].items() if v) or "none"))
    lines.append("  dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items() if k != "bad_record"))
    return "\n".join(lines)


def _cmd_stats(args: argparse.Namespace) -> int:
    _cfg, layout = run_from_args(args)
    try:
        stats = read_stats(layout)
    except FileNotFoundError as e:
        print(f"eagleflow corpus stats: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _cmd_budget(args: argparse.Namespace) -> int:
    cfg, layout = run_from_args(args)
    try:
        verdict = check_budget(cfg, layout, LocalNode(name=cfg.node.name))  # this command runs on the node
    except BudgetError as e:
        print(f"eagleflow corpus budget: {e}", file=sys.stderr)
        return 2
    print(verdict.message, file=sys.stderr if (args.check and not verdict.ok) else sys.stdout)
    print(json.dumps(verdict.to_dict()))
    return EXIT_NOT_ENOUGH_DISK if (args.check and not verdict.ok) else 0


def _cmd_delete_caches(args: argparse.Namespace) -> int:
    cfg, _layout = run_from_args(args)
    try:
        result = delete_old_caches(cfg, log=_log)
    except CacheDeletionRefused as e:
        print(f"eagleflow corpus delete-caches: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps({"enabled": result.enabled, "deleted": result.deleted, "freed_bytes": result.freed_bytes,
                      "missing": result.missing, "would_delete": result.would_delete}))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("corpus", help="merge, shuffle and tokenise the corpus; disk budget; old caches")
    sub = p.add_subparsers(dest="corpus_command", metavar="ACTION", required=True)

    prep = sub.add_parser("prepare", help="build <run_dir>/corpus/corpus.parquet and stats.json from the sources")
    add_run_args(prep)
    prep.add_argument("--num-proc", type=int, default=None, help="map processes (default: corpus.num_proc)")
    prep.add_argument("--mask-method", choices=["auto", "generation_tags", "prefix_diff"], default="auto",
                      help="how assistant tokens are found (auto: generation tags when the template has them)")
    prep.set_defaults(func=_cmd_prepare)

    st = sub.add_parser("stats", help="print the prepared corpus' statistics")
    add_run_args(st)
    st.add_argument("--json", action="store_true", help="print stats.json as is")
    st.set_defaults(func=_cmd_stats)

    bud = sub.add_parser("budget", help="disk needed by the hidden states vs free space at the output dir")
    add_run_args(bud)
    bud.add_argument("--check", action="store_true", help=f"exit {EXIT_NOT_ENOUGH_DISK} when it does not fit")
    bud.set_defaults(func=_cmd_budget)

    dc = sub.add_parser("delete-caches", help="delete disk.old_caches (only with disk.delete_old_caches: true, "
                                              "only under disk.cache_root)")
    add_run_args(dc)
    dc.set_defaults(func=_cmd_delete_caches)
