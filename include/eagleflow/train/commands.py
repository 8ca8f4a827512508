"""`eagleflow train` (train or resume the draft on the stored hidden states) and `eagleflow export`.

Run one process per GPU with torchrun:
    python -m torch.distributed.run --standalone --nproc_per_node 8 -m eagleflow.cli train --config C --run-id R
"""
from __future__ import annotations

import sys

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.engines import export_formats
from eagleflow.capture.verify import NotVerifiedError
from eagleflow.stores.contract import SampleRefused, StoreError
from eagleflow.stores.ledger import LedgerError


def register(sub) -> None:
    t = sub.add_parser("train", help="train (or resume) the EAGLE-3 draft on the run's stored hidden states",
                       description=__doc__)
    add_run_args(t)
    t.add_argument("--stop-after-steps", type=int, default=None, metavar="N",
                   help="checkpoint and stop once step N is done (the schedule still spans train.max_steps)")
    t.set_defaults(func=_train)

    e = sub.add_parser("export", help="write the latest checkpoint as a draft SGLang serves "
                                      "(--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR) and, "
                                      "in DIR/speculators, one vLLM serves (--speculative-config)")
    add_run_args(e)
    e.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the newest)")
    e.add_argument("--out", default=None, help="output directory (default: <run_dir>/draft/export)")
    e.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"],
                   help="weight dtype (default: train.export_dtype)")
    e.add_argument("--format", dest="formats", action="append", default=None, choices=export_formats(),
                   help="a format to write; repeat for several (default: train.export_formats, all)")
    e.add_argument("--json", action="store_true",
                   help='answer {"export_dir": ..., "files": [...]} as the last stdout line (for the control plane)')
    e.set_defaults(func=_export)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _train(args) -> int:
    # lazy: torch: the trainer, its checkpoints and its data load it; `eagleflow --help` and the other commands do not
    from .checkpoint import CheckpointWriteError
    from .data import MixedStoreError, StreamStarved  # lazy: torch
    from .trainer import train  # lazy: torch

    cfg, layout = run_from_args(args)
    try:
        result = train(cfg, layout, stop_after_step=args.stop_after_steps, log=_log)
    except (NotVerifiedError, CheckpointWriteError, MixedStoreError,      # not a crash: say why, what to do
            StoreError, SampleRefused, StreamStarved, LedgerError) as e:  # streaming: the store, the producer, the ledger
        print(f"eagleflow train: {e}", file=sys.stderr, flush=True)
        return 1
    return 0 if result.completed or args.stop_after_steps is not None else 1


def _export(args) -> int:
    from pathlib import Path

    from .export import export_draft, export_latest  # lazy: torch

    cfg, layout = run_from_args(args)
    dtype = args.dtype or cfg.train.export_dtype
    formats = args.formats or cfg.train.export_formats
    draft_dir = Path(layout.draft_dir)
    try:
        if args.checkpoint:
            out = export_draft(args.checkpoint, args.out or draft_dir / "export", dtype, formats)
        else:
            out = export_latest(draft_dir, args.out, dtype, formats)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"eagleflow export: {e}", file=sys.stderr)
        return 1
    if args.json:
        import json
        print(json.dumps({"export_dir": str(out), "files": sorted(p.name for p in Path(out).iterdir())}), flush=True)
    else:
        print(str(out), flush=True)
    return 0
