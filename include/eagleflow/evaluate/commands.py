"""`eagleflow evaluate`: the exported draft decodes the held-out prompts with the target verifying; the gate.

Exit 0: the draft passed (eval.json written, <run_root>/promoted.json names it);
1: the gate refused it (eval.json says why, with both numbers);
2: an input is missing or not usable (the message names it; no figures).
"""
from __future__ import annotations

import json
import sys

from eagleflow.cliargs import add_run_args, run_from_args

from .approval import DECISIONS
from .approval import decision_line
from .run import EvalBackendError, decide, evaluate_run

SUMMARY_KEYS = ("run_id", "passed", "refused", "eval_file", "promoted", "draft", "baseline_draft", "baseline_source",
                "results", "approval", "elapsed_s")


def register(sub) -> None:
    e = sub.add_parser("evaluate", help="speculative decoding of the held-out prompts with the exported draft "
                                        "(acceptance length per eval.configs entry) and the promotion gate",
                       description=__doc__)
    add_run_args(e)
    e.add_argument("--draft", default=None, help="export directory (default: <run_dir>/draft/export)")
    e.add_argument("--json", action="store_true",
                   help="answer the summary (eval.json's figures) as the last stdout line (for the control plane)")
    e.set_defaults(func=_evaluate)
    d = sub.add_parser("evaluate-decision", help="record a person's approval or rejection of a draft the gate passed "
                                                 "(eval.approval); approve promotes it",
                       description="Exit 0: recorded (approve: promoted.json names the draft, unless the draft in "
                                   "service changed since the evaluation); 2: no approval pending, or decided "
                                   "otherwise (the message says)")
    add_run_args(d)
    d.add_argument("decision", choices=DECISIONS, help="approve, reject, or timeout (eval.approval_on_timeout)")
    d.add_argument("--by", default=None, help="who decided (recorded in eval.json and the run report)")
    d.add_argument("--why", default=None, help="why (recorded in eval.json and the run report)")
    d.add_argument("--json", action="store_true", help="answer the summary as the last stdout line")
    d.set_defaults(func=_decide)


def _evaluate(args) -> int:
    cfg, layout = run_from_args(args)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        summary = evaluate_run(cfg, layout, draft_dir=args.draft, log=log)
    except (EvalBackendError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"eagleflow evaluate: {e}", file=sys.stderr, flush=True)
        return 2   # not an answer: the control plane reports stderr as the node command's failure
    if args.json:
        print(json.dumps({k: summary.get(k) for k in SUMMARY_KEYS}), flush=True)
    return 0 if summary["passed"] else 1


def _decide(args) -> int:
    cfg, layout = run_from_args(args)
    try:
        summary = decide(cfg, layout, args.decision, by=args.by, why=args.why)
    except ValueError as e:   # ApprovalError, or a promoted.json that cannot be read
        print(f"eagleflow evaluate-decision: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"evaluate-decision: {decision_line(summary)}", file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps({k: summary.get(k) for k in SUMMARY_KEYS}), flush=True)
    return 0
