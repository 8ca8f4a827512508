"""`eagleflow evaluate`: the exported draft decodes the held-out prompts with the target verifying; the gate.

Exit 0: the draft passed (eval.json written, <run_root>/promoted.json names it);
1: the gate refused it (eval.json says why, with both numbers);
2: an input is missing or not usable (the message names it; no figures).
"""
from __future__ import annotations

import json
import sys

from eagleflow.cliargs import add_run_args, run_from_args


def register(sub) -> None:
    e = sub.add_parser("evaluate", help="speculative decoding of the held-out prompts with the exported draft "
                                        "(acceptance length per eval.configs entry) and the promotion gate",
                       description=__doc__)
    add_run_args(e)
    e.add_argument("--draft", default=None, help="export directory (default: <run_dir>/draft/export)")
    e.add_argument("--json", action="store_true",
                   help="answer the summary (eval.json's figures) as the last stdout line (for the control plane)")
    e.set_defaults(func=_evaluate)


def _evaluate(args) -> int:
    from .run import EvalBackendError, evaluate_run

    cfg, layout = run_from_args(args)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        summary = evaluate_run(cfg, layout, draft_dir=args.draft, log=log)
    except (EvalBackendError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"eagleflow evaluate: {e}", file=sys.stderr, flush=True)
        return 2   # not an answer: the control plane reports stderr as the node command's failure
    if args.json:
        keep = ("run_id", "passed", "refused", "eval_file", "promoted", "draft", "baseline_draft", "results",
                "elapsed_s")
        print(json.dumps({k: summary.get(k) for k in keep}), flush=True)
    return 0 if summary["passed"] else 1
