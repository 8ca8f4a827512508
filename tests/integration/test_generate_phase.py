"""The generation phase end to end on CPU: the hf server in serving mode (detached, as in production), CLI shard
workers killed with SIGKILL and resumed, the phase's stats, and the corpus phase taking the target's own ids."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagleflow.local_run import LocalRun
from eagleflow.config import load_config
from eagleflow.phases.generate.lifecycle import start_generate_server, stop_generate_server, wait_generate_server_ready
from eagleflow.phases.generate.phase import regenerated_sources
from eagleflow.phases.generate.regenerate import KEPT_STATUSES
from eagleflow.phases.generate.worker import read_results
from eagleflow.layout import RunLayout
from tests.fixtures.pipeline_config import write_short_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _ctx(cfgp: Path, run_id: str) -> LocalRun:
    cfg = load_config(cfgp)
    return LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, run_id), config_path=str(cfgp))


def _cli(ctx, *args) -> list[str]:
    return [sys.executable, "-m", "eagleflow.cli", *args, "--config", ctx.config_path, "--run-id", ctx.layout.run_id]


def _manifest(ctx, shard) -> list[dict]:
    p = Path(ctx.layout.generate_shard_dir(shard)) / "manifest.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


@pytest.fixture(scope="module")
def run(demo_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")
    sources = demo_assets["sources"]
    cfgp = write_short_config(tmp, demo_assets, corpus={"sources": sources, "seed": 1, "max_length": 512,
                                                        "eval_fraction": 0.0, "eval_min_records": 0},
                              generate={"enabled": True, "sources": [sources[1]["name"]], "shards": 2,
                                        "temperature": 0.8, "max_new_tokens": 6, "concurrency": 2, "seed": 5})
    ctx = _ctx(cfgp, "gen")
    # a slow forward, so that a SIGKILL lands while records are in flight
    os.environ["EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S"] = "0.15"
    try:
        start_generate_server(ctx)
        info = wait_generate_server_ready(ctx, timeout_s=120)
    finally:
        os.environ.pop("EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S", None)
    yield ctx, info
    stop_generate_server(ctx, grace_s=5)


def test_kill_9_resume_loses_and_repeats_nothing_and_one_worker_per_shard(run):
    ctx, info = run
    assert info["mode"] == "generate"
    w = subprocess.Popen(_cli(ctx, "generate", "run", "--shard", "0"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_manifest(ctx, 0)) < 3:
            assert w.poll() is None, w.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # a second worker on the same shard is refused while the first lives
        second = subprocess.run(_cli(ctx, "generate", "run", "--shard", "0"), capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 4 and "already running" in second.stderr
        os.kill(w.pid, signal.SIGKILL)
        w.wait(10)
    finally:
        if w.poll() is None:
            w.kill()
    before = {e["id"]: e["sha256"] for e in _manifest(ctx, 0)}
    hb = json.loads((Path(ctx.layout.generate_shard_dir(0)) / "heartbeat.json").read_text())
    assert hb["state"] == "running" and 0 < len(before) < hb["total"]
    for shard in (0, 1):
        done = subprocess.run(_cli(ctx, "generate", "run", "--shard", str(shard)), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    n = ctx.cfg.corpus.sources[1]
    with open(n.path) as f:
        total = sum(1 for line in f if line.strip())
    ids = [e["id"] for s in (0, 1) for e in _manifest(ctx, s)]
    assert sorted(ids) == sorted(f"{n.name}:{r}" for r in range(total)), "every record exactly once"
    after = {e["id"]: e["sha256"] for e in _manifest(ctx, 0)}
    assert all(after[i] == h for i, h in before.items()), "records finished before the kill were not redone"
    for s in (0, 1):
        assert not list(Path(ctx.layout.generate_shard_dir(s)).glob(".tmp-*"))
        hb = json.loads((Path(ctx.layout.generate_shard_dir(s)) / "heartbeat.json").read_text())
        assert hb["state"] == "complete" and hb["done"] == hb["total"] and hb["unit"] == "records"


def test_stats_and_the_corpus_takes_the_targets_own_ids(run):
    ctx, _ = run
    # on its own (pytest-xdist may run it apart from the test above): each shard generated or resumed to its end
    for shard in (0, 1):
        done = subprocess.run(_cli(ctx, "generate", "run", "--shard", str(shard)), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    res = subprocess.run(_cli(ctx, "generate", "stats"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    name = regenerated_sources(ctx.cfg)[0]
    ps = stats["per_source"][name]
    assert stats["complete"] and ps["records"] == stats["records"] > 0
    assert ps["turns_regenerated"] >= ps["kept"] > 0 and ps["tokens_generated"] > 0 and ps["tokens_per_s"] > 0
    # the tiny random target writes noise: its calls never match, so every tool record ends at its first call
    assert ps["cut_at_diverging_call"] + ps["cut_at_truncated"] + ps["regenerated"] + ps["cut_at_context"] == ps["kept"]
    prep = subprocess.run(_cli(ctx, "corpus", "prepare"), capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    import pyarrow.parquet as pq
    rows = {r["id"]: r for r in pq.read_table(Path(ctx.layout.corpus_dir) / "corpus.parquet").to_pylist()}
    results = {r.id: r for s in (0, 1) for r in read_results(ctx.layout.generate_shard_dir(s))}
    kept = {i: r for i, r in results.items() if r.status in KEPT_STATUSES}
    regen_rows = {i: r for i, r in rows.items() if r["source"] == name}
    assert set(regen_rows) == set(kept)
    for i, r in kept.items():
        assert regen_rows[i]["input_ids"] == r.input_ids and regen_rows[i]["loss_mask"] == r.loss_mask
        assert sum(r.loss_mask) == sum(e - s for s, e in r.spans)
    # the other sources are tokenised from their original text as before
    assert any(r["source"] != name for r in rows.values())
