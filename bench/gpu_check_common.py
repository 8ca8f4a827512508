"""The verdict every stage of bench/gpu_check.sh writes: ``$GPU_CHECK_RESULTS/<stage>.json``.

One shape for all stages: ``status`` is ``pass``, ``fail`` or ``skipped`` (with
the ``reason``), ``dry_run`` says whether the GPU was meant to be used, the rest
are the stage's figures. Standard library only: the shell writes its own
verdicts (a skipped stage, a stage killed by its time limit) with it too:

    python3 bench/gpu_check_common.py STAGE STATUS REASON [KEY=JSON ...]
    python3 bench/gpu_check_common.py --summary RESULTS SUMMARY_JSON STAGE ...   # after every stage
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

STATUSES = ("pass", "fail", "skipped")


def results_dir() -> Path | None:
    out = os.environ.get("GPU_CHECK_RESULTS")
    return Path(out) if out else None


def dry_run() -> bool:
    return os.environ.get("GPU_CHECK_DRY_RUN") == "1"


def write_verdict(stage: str, status: str, reason: str | None = None, **figures) -> int:
    """Write the verdict (atomically: the shell packs results between stages); exit code 1 only for ``fail``."""
    if status not in STATUSES:
        raise ValueError(f"verdict status {status!r} for stage {stage}: must be one of {STATUSES}")
    verdict = {"stage": stage, "status": status, "reason": reason, "dry_run": dry_run(),
               "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    print(f"verdict {stage}: {status}" + (f" ({reason})" if reason else ""), flush=True)
    out = results_dir()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        # no eagleflow import here: the shell calls this before it knows the package imports
        _atomic_json(out / f"{stage}.json", verdict)
    return 1 if status == "fail" else 0


def _atomic_json(path: Path, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    os.chmod(tmp, 0o644)   # mkstemp's 0600 would make the unpacked results unreadable to others
    os.replace(tmp, path)


def summarize(results: Path, summary: Path, stages: list[str]) -> dict:
    """summary.json: every stage's verdict in order (``pending`` for those not run yet) and the overall status."""
    verdicts, pending = [], []
    for name in stages:
        f = results / f"{name}.json"
        try:
            verdicts.append(json.loads(f.read_text()))
        except FileNotFoundError:
            pending.append(name)
        except ValueError as e:
            verdicts.append({"stage": name, "status": "fail", "reason": f"unreadable verdict {f}: {e}"})
    failed = [v["stage"] for v in verdicts if v.get("status") == "fail"]
    doc = {"check": "bench/gpu_check.sh", "status": "fail" if failed else ("incomplete" if pending else "pass"),
           "failed": failed, "skipped": [v["stage"] for v in verdicts if v.get("status") == "skipped"],
           "pending": pending, "dry_run": dry_run(), "host": os.uname().nodename,
           "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "elapsed_s": float(os.environ.get("GPU_CHECK_ELAPSED_S") or 0),
           "deadline_s": float(os.environ.get("GPU_CHECK_DEADLINE_S") or 0),
           "stages": verdicts}
    _atomic_json(summary, doc)
    return doc


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"] and len(argv) >= 3:
        doc = summarize(Path(argv[1]), Path(argv[2]), argv[3:])
        print("summary: " + (", ".join(f"{v['stage']} {v['status']}" for v in doc["stages"]) or "no stage run yet")
              + (f"; pending {doc['pending']}" if doc["pending"] else ""))
        return 0
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    stage, status, reason, *pairs = argv
    figures = {}
    for kv in pairs:
        k, _, v = kv.partition("=")
        try:
            figures[k] = json.loads(v)
        except ValueError:
            figures[k] = v
    write_verdict(stage, status, reason or None, **figures)
    return 0   # writing the verdict worked; the shell knows the status it wrote


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
