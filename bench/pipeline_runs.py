"""The pipeline's phases through the node CLI, for benchmarks that compare whole drafts on this machine.

What ``make demo`` runs through Airflow, phase by phase: ``corpus prepare`` -> the hf capture server and
``capture run`` per shard -> ``capture verify --stats`` (one store), then per draft ``train`` -> ``export`` ->
``evaluate --json`` in a run directory whose corpus/ and hidden_states/ link to a store's run (so several
drafts share one capture). Used by ``bench/fp8_quality.py`` and ``bench/learnable_target.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

import yaml  # noqa: E402


def cli(*args: str, timeout: float = 7200) -> subprocess.CompletedProcess:
    """``eagleflow ARGS``; exit 1 is an answer only for ``evaluate`` (a draft below the gate), else it stops."""
    p = subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    if p.returncode not in (0, 1) or (p.returncode == 1 and args[0] != "evaluate"):
        raise SystemExit(f"eagleflow {' '.join(args)} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    return p


def write_config(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def _manifest_rows(hidden_states: Path) -> list[dict]:
    return [json.loads(x) for m in sorted(hidden_states.glob("shard_*/manifest.jsonl"))
            for x in m.read_text().splitlines() if x.strip()]


def capture_store(config: Path, run: str) -> dict:
    """Corpus, capture and verification of one run; its figures (samples, tokens, bytes, seconds, digest)."""
    from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
    from eagleflow.local_run import LocalRun
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout

    t0 = time.time()
    cli("corpus", "prepare", "--config", str(config), "--run-id", run)
    cfg = load_config(config)
    lay = RunLayout.for_run(cfg, run)
    ctx = LocalRun(cfg=cfg, layout=lay, config_path=str(config))
    start_capture_server(ctx)
    try:
        wait_capture_server_ready(ctx, timeout_s=300, poll_s=0.5)
        for shard in range(cfg.capture.shards):
            cli("capture", "run", "--config", str(config), "--run-id", run, "--shard", str(shard))
    finally:
        stop_capture_server(ctx, grace_s=10)
    ver = cli("capture", "verify", "--config", str(config), "--run-id", run, "--stats", "--json")
    verified = json.loads(ver.stdout.strip().splitlines()[-1])
    rows = _manifest_rows(Path(lay.hidden_states_dir))
    stored, tokens = sum(r["bytes"] for r in rows), sum(r["tokens"] for r in rows)
    return {"samples": verified["stored"], "tokens": tokens, "stored_bytes": stored,
            "bytes_per_token": stored / tokens, "quantisation": verified.get("quantisation"),
            "capture_s": time.time() - t0, "run_dir": str(lay.run_dir),
            "corpus_sha256": hashlib.sha256((Path(lay.corpus_dir) / "corpus.parquet").read_bytes()).hexdigest()}


def linked_run(config: Path, store_run_dir: str | Path, run_id: str) -> Path:
    """A run directory for one draft whose corpus/ and hidden_states/ are the store run's."""
    from eagleflow.config import load_config
    rdir = Path(load_config(config).run_dir(run_id))
    rdir.mkdir(parents=True, exist_ok=True)
    for sub in ("corpus", "hidden_states"):
        link = rdir / sub
        if not link.exists():
            os.symlink(Path(store_run_dir) / sub, link)
    return rdir


def evaluate(config: Path, run_id: str, *sets: str, draft: Path | None = None) -> dict[str, dict]:
    """``evaluate --json``: {"<prompt set>:<config>": the draft's row}."""
    extra = ["--draft", str(draft)] if draft else []
    ev = cli("evaluate", "--config", str(config), "--run-id", run_id, *sets, *extra, "--json")
    summary = json.loads(ev.stdout.strip().splitlines()[-1])
    return {f"{r.get('prompt_set', 'held_out')}:{r['config']}": r["draft"] for r in summary["results"]}


def train_export_evaluate(config: Path, store_run_dir: str | Path, run_id: str, *sets: str) -> dict:
    """One draft on a store: trained, exported, evaluated; its rows, last training metrics and seconds."""
    rdir = linked_run(config, store_run_dir, run_id)
    args = ["--config", str(config), "--run-id", run_id, *sets]
    t0 = time.time()
    tr = cli("train", *args)
    cli("export", *args)
    return _figures(rdir, evaluate(config, run_id, *sets), t0) | {"train_traceback": "Traceback" in tr.stderr}


def evaluated_again(config: Path, run_id: str, *sets: str) -> dict:
    """An exported draft's run evaluated again (train_export_evaluate's answer, without training)."""
    from eagleflow.config import load_config
    t0 = time.time()
    rdir = Path(load_config(config).run_dir(run_id))
    return _figures(rdir, evaluate(config, run_id, *sets), t0) | {"train_traceback": False}


def _figures(rdir: Path, rows: dict, t0: float) -> dict:
    metrics = [json.loads(x) for x in (rdir / "draft" / "metrics.jsonl").read_text().splitlines() if x]
    return {"rows": rows, "final_loss": metrics[-1]["loss"], "final_acc_0": metrics[-1]["acc_0"],
            "seconds": time.time() - t0, "run_dir": str(rdir)}


def finish(results: dict, started: float, root: Path, json_path: str | None, keep: bool) -> int:
    """A benchmark's end: its wall time, its JSON (when asked) and its work dir removed unless kept (--dir)."""
    results["seconds"] = round(time.time() - started, 1)
    print(f"\n{results['seconds'] / 60:.0f} min in all; work dir {root}{'' if keep else ' (removed)'}")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    if not keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return 0
