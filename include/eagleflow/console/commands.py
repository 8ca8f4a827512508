"""`eagleflow report`: the run's HTML report, written into its run directory (eagleflow.console.run_report)."""
from __future__ import annotations

import json
import sys

from eagleflow import bounded_json
from eagleflow.cliargs import add_run_args, run_from_args
from .run_report import write_report


def register(sub) -> None:
    r = sub.add_parser("report", help="write <run_dir>/report.html: corpus, shards and stalls, GPUs, training, "
                                      "export and the SGLang command", description=__doc__)
    add_run_args(r)
    r.add_argument("--extras", default=None, metavar="FILE",
                   help="JSON with what only the control plane knows: {\"tasks\": {task: state}, \"gpu\": the "
                        "node's status document}; '-' = stdin")
    r.set_defaults(func=_report)


def _report(args) -> int:
    cfg, layout = run_from_args(args)
    extras: dict = {}
    if args.extras:
        text = sys.stdin.read() if args.extras == "-" else open(args.extras).read()
        try:
            extras = bounded_json.loads(text, source=f"--extras {args.extras}") if text.strip() else {}
        except ValueError as e:
            print(f"eagleflow report: --extras {args.extras}: not JSON ({e}); expected "
                  "{\"tasks\": {...}, \"gpu\": {...}}", file=sys.stderr)
            return 2
        if not isinstance(extras, dict):
            print(f"eagleflow report: --extras {args.extras}: expected a JSON object, got "
                  f"{type(extras).__name__}", file=sys.stderr)
            return 2
    path = write_report(cfg, layout, tasks=extras.get("tasks"), gpu=extras.get("gpu"))
    print(json.dumps({"path": str(path), "bytes": path.stat().st_size}), flush=True)
    return 0
