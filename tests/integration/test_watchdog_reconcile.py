"""eagle3_shard_reconcile: under dag.test() it reruns exactly the incomplete, unattended shard (an extraction shard, a
generation shard killed -9 mid-shard) through its own phase's server; claims are idempotent and leave live workers be."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.phases.extract.lifecycle import (start_capture_server, start_or_attach_worker, stop_capture_server,
                                         wait_capture_server_ready)
from eagleflow.local_run import LocalRun
from eagleflow.capture.storage import FAULT_AFTER_ENV, FAULT_ENV
from eagleflow.config import load_config
from eagleflow.phases.generate import lifecycle as gen
from eagleflow.layout import RunLayout
from eagleflow.nodes.locks import NodeLock
from eagleflow.watchdog.reconcile import claim, scan
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

REPO = Path(__file__).resolve().parents[2]
N = 12
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 10.0, "health_timeout_s": 5.0, "startup_grace_s": 60.0,
         "alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_reconcile_test"}


def _pipeline_run(tmp: Path, assets: dict) -> tuple[Path, LocalRun]:
    # one request at a time: "kill after 2 stored samples" then stores exactly 2 (with more in flight a
    # concurrent sample can be renamed and recorded before the kill lands)
    cfgp = write_run_config(tmp, assets["target_model"], shards=2, in_flight=1)
    data = yaml.safe_load(cfgp.read_text())
    data["watchdog"] = WATCH
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, "pipeline-run")
    ctx = RunContext(cfg=cfg, layout=layout)
    ctx.write_run_config()
    write_corpus(Path(layout.corpus_dir) / "corpus.parquet", N, 300, seed=9)
    return cfgp, LocalRun(cfg=cfg, layout=layout, config_path=ctx.run_config_path)


def _watch(run: LocalRun, shard: int) -> dict:
    async def first():
        async for ev in ShardWatchTrigger(RunContext(cfg=run.cfg, layout=run.layout).serialize(), shard).run():
            return ev.payload
    return asyncio.run(asyncio.wait_for(first(), 120))


def _manifest_indexes(run: LocalRun, shard: int) -> list[int]:
    p = Path(run.layout.manifest_file(shard))
    return sorted(json.loads(x)["index"] for x in p.read_text().splitlines() if x.strip())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_reconcile_reruns_exactly_the_incomplete_shard(airflow_db, demo_assets, tmp_path, monkeypatch):
    cfgp, run = _pipeline_run(tmp_path, demo_assets)
    state_dir = tmp_path / "state"
    try:
        # the "pipeline": shard 0 completes; shard 1's worker dies after 2 samples; the server is stopped
        start_capture_server(run)
        wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
        start_or_attach_worker(run, 0)
        assert _watch(run, 0)["status"] == "complete"
        monkeypatch.setenv(FAULT_ENV, "kill")
        monkeypatch.setenv(FAULT_AFTER_ENV, "2")
        start_or_attach_worker(run, 1)
        monkeypatch.delenv(FAULT_ENV)
        monkeypatch.delenv(FAULT_AFTER_ENV)
        assert _watch(run, 1)["status"] == "dead"
        stop_capture_server(run, grace_s=5)
        shard0_before = Path(run.layout.manifest_file(0)).read_bytes()
        states = {s.shard: s for s in scan(load_config(cfgp))}
        assert states[0].stored == 6 and not states[0].needs_rerun
        assert states[1].stored == 2 and states[1].needs_rerun

        spec = importlib.util.spec_from_file_location("eagle3_shard_reconcile", REPO / "dags" / "eagle3_shard_reconcile.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        with SmtpSink() as smtp:
            for k, v in smtp.airflow_conn_env(WATCH["smtp_conn_id"]).items():
                monkeypatch.setenv(k, v)
            dr = mod.dag.test(run_conf={"config_path": str(cfgp), "latest_runs": 3})
            msg = smtp.wait_for(lambda m: "reconcile" in m["Subject"], timeout_s=10)
    finally:
        kill_recorded(state_dir)

    tis = [ti for ti in dr.get_task_instances()]
    reruns = [ti for ti in tis if ti.task_id == "rerun_shard"]
    assert len(reruns) == 1 and reruns[0].state == "success", [(t.task_id, t.map_index, t.state) for t in tis]
    assert dr.state == "success"
    assert _manifest_indexes(run, 1) == [i for i in range(N) if i % 2 == 1]   # each once
    assert Path(run.layout.manifest_file(0)).read_bytes() == shard0_before     # untouched
    assert msg["Subject"] == "[eagleflow] reconcile on local: reran 1 shard(s) (1 extraction)"
    body = body_text(msg)
    assert "run pipeline-run extract shard 1: 2/6 -&gt; 6/6 samples stored (complete)" in body or \
        "run pipeline-run extract shard 1: 2/6 -> 6/6 samples stored (complete)" in body
    assert "capture server: stopped (server " in body  # reconcile stopped the server it started
    assert not (state_dir / "pids" / "pipeline-run.capture_server.json").exists()


@pytest.mark.timeout(60)
def test_claim_is_idempotent_under_the_node_lock_and_for_complete_shards(demo_assets, tmp_path):
    _, run = _pipeline_run(tmp_path, demo_assets)
    Path(run.layout.shard_dir(0)).mkdir(parents=True)
    lock = NodeLock(Path(str(run.layout.locks_dir)) / "pipeline-run.reconcile.worker_shard_00000.lock", "test")
    lock.acquire()
    try:
        r = claim(run, 0)
        assert r["action"] == "skipped" and "another reconcile holds" in r["reason"]
    finally:
        lock.release()
    # a shard with nothing to do (corpus of 0 samples for it) is left alone without starting anything
    write_corpus(Path(run.layout.corpus_dir) / "corpus.parquet", 1, 300, seed=9)  # only index 0 -> shard 0
    r = claim(run, 1)
    assert r["action"] == "skipped" and "already complete" in r["reason"]
    assert not (Path(str(run.layout.pids_dir))).exists() or not list(Path(str(run.layout.pids_dir)).iterdir())


# --- the generation phase's shards --------------------------------------------------------------------------

def _reconcile_dag():
    spec = importlib.util.spec_from_file_location("eagle3_shard_reconcile", REPO / "dags" / "eagle3_shard_reconcile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dag


def _generation_run(tmp: Path, assets: dict) -> tuple[Path, LocalRun]:
    src = assets["sources"][1]
    cfgp = write_short_config(tmp, assets, corpus={"sources": [src], "seed": 1, "max_length": 512},
                              generate={"enabled": True, "shards": 2, "max_new_tokens": 4, "concurrency": 1},
                              watchdog=WATCH)
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, "gen-run")
    ctx = RunContext(cfg=cfg, layout=layout)
    ctx.write_run_config()
    return cfgp, LocalRun(cfg=cfg, layout=layout, config_path=ctx.run_config_path)


def _gen_manifest(run: LocalRun, shard: int) -> list[dict]:
    p = Path(run.layout.generate_shard_dir(shard)) / "manifest.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _gen_heartbeat(run: LocalRun, shard: int) -> dict:
    p = Path(run.layout.generate_shard_dir(shard)) / "heartbeat.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _wait(pred, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_reconcile_reruns_a_generation_shard_killed_mid_shard_and_leaves_a_live_one(airflow_db, demo_assets,
                                                                                   tmp_path, monkeypatch):
    from eagleflow.engines.hf.server import DELAY_ENV
    cfgp, run = _generation_run(tmp_path, demo_assets)
    state_dir = tmp_path / "node-state"
    pid = lambda shard: run.node.live_record(str(run.layout.pid_file(gen.worker_role(shard))))  # noqa: E731
    try:
        # the "pipeline": generation server (a slow forward, so the kill lands mid-shard), shard 0 completes
        monkeypatch.setenv(DELAY_ENV, "0.1")
        gen.start_generate_server(run)
        gen.wait_generate_server_ready(run, timeout_s=120, poll_s=0.3)
        monkeypatch.delenv(DELAY_ENV)
        gen.start_or_attach_generate_worker(run, 0)
        _wait(lambda: _gen_heartbeat(run, 0).get("state") == "complete" and pid(0) is None, "shard 0 complete")
        gen.start_or_attach_generate_worker(run, 1)
        _wait(lambda: len(_gen_manifest(run, 1)) >= 2, "2 records of shard 1")
        # a running generation worker is left alone: the scan does not pick it, a claim starts nothing
        live = pid(1)
        assert live is not None
        states = {(s.phase, s.shard): s for s in scan(load_config(cfgp))}
        assert set(states) == {("generate", 0), ("generate", 1)}   # no corpus yet: no extraction shards
        assert states["generate", 1].worker_alive and not states["generate", 1].needs_rerun
        r = claim(run, 1, phase="generate")
        assert r["action"] == "skipped" and "a worker is already running" in r["reason"], r
        assert pid(1).pid == live.pid
        # kill -9 mid-shard, then the server goes too: the rerun must bring back the generation server
        os.kill(live.pid, signal.SIGKILL)
        _wait(lambda: pid(1) is None, "the killed worker gone", 10)
        gen.stop_generate_server(run, grace_s=5)
        before = {e["id"]: e["sha256"] for e in _gen_manifest(run, 1)}
        hb = _gen_heartbeat(run, 1)
        assert hb["state"] == "running" and 2 <= len(before) < hb["total"], (len(before), hb)
        shard0_before = (Path(run.layout.generate_shard_dir(0)) / "manifest.jsonl").read_bytes()
        states = {(s.phase, s.shard): s for s in scan(load_config(cfgp))}
        assert not states["generate", 0].needs_rerun and states["generate", 0].stored == states["generate", 0].expected
        st1 = states["generate", 1]
        assert st1.needs_rerun and st1.stored == len(before) and st1.expected == hb["total"]

        with SmtpSink() as smtp:
            for k, v in smtp.airflow_conn_env(WATCH["smtp_conn_id"]).items():
                monkeypatch.setenv(k, v)
            dr = _reconcile_dag().test(run_conf={"config_path": str(cfgp), "latest_runs": 3})
            msg = smtp.wait_for(lambda m: "reconcile" in m["Subject"], timeout_s=10)
    finally:
        kill_recorded(state_dir)

    tis = list(dr.get_task_instances())
    reruns = [ti for ti in tis if ti.task_id == "rerun_shard"]
    assert len(reruns) == 1 and reruns[0].state == "success", [(t.task_id, t.map_index, t.state) for t in tis]
    assert dr.state == "success"
    # every record exactly once; the ones finished before the kill not redone; shard 0 untouched
    records = [e["id"] for s in (0, 1) for e in _gen_manifest(run, s)]
    src = run.cfg.corpus.sources[0]
    with open(src.path) as f:
        total = sum(1 for line in f if line.strip())
    assert sorted(records) == sorted(f"{src.name}:{r}" for r in range(total)), "every record exactly once"
    after = {e["id"]: e["sha256"] for e in _gen_manifest(run, 1)}
    assert all(after[i] == h for i, h in before.items()), "records finished before the kill were redone"
    assert (Path(run.layout.generate_shard_dir(0)) / "manifest.jsonl").read_bytes() == shard0_before
    hb = _gen_heartbeat(run, 1)
    assert hb["state"] == "complete" and hb["done"] == hb["total"] == st1.expected
    # the generation server was restarted through the generate lifecycle, never the capture server
    assert not (state_dir / "pids" / "gen-run.capture_server.json").exists()
    assert not Path(run.layout.log_file("capture_server")).exists()
    assert msg["Subject"] == "[eagleflow] reconcile on local: reran 1 shard(s) (1 generation)", msg["Subject"]
    body = body_text(msg).replace("-&gt;", "->")
    n = st1.expected
    assert f"run gen-run generate shard 1: {len(before)}/{n} -> {n}/{n} records stored (complete)" in body, body
    assert "run gen-run generation server: stopped (server " in body, body   # reconcile stopped what it started
    assert not (state_dir / "pids" / "gen-run.generate_server.json").exists()
