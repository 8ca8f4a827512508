"""Issue 53, a store lost mid-run: the watch's word on a trainer that waits for its store to come back."""
from __future__ import annotations

from eagleflow.heartbeat import WAITING_FOR_STORE
from eagleflow.watchdog.policy import decide
from eagleflow.watchdog.signals import CpuSignal, ProcessSignal, StoreSignal
from tests.unit.test_watchdog_policy import NOW, cfg, obs


def _waiting_trainer(state: str = "S"):
    quiet = CpuSignal(read_at=NOW, first_at=NOW - 300, quiet_since=NOW - 100, members=1)
    worker = ProcessSignal(role="trainer", recorded=True, pid=4242, alive=True, state=state, started_at=NOW - 3600,
                           cpu=quiet)
    o = obs(progress_ago=200, worker=worker)
    o.heartbeat.extra[WAITING_FOR_STORE] = NOW - 40
    return o


def test_a_trainer_waiting_for_its_store_is_not_stuck_once_the_store_runs_again():
    o = _waiting_trainer()
    o.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", detail="answering", answering=True)
    d = decide(o, cfg())
    assert d.verdict == "slow" and d.cause == "store" and d.status is None, d.summary
    assert "waiting 40 s for the run's hidden-state store to come back" in d.summary and "not stuck" in d.summary


def test_while_the_store_is_down_the_verdict_is_the_stores_stall_whatever_the_trainer_says():
    o = _waiting_trainer()
    o.store = StoreSignal(ok=False, label="Mooncake store (master 127.0.0.1:5)",
                          detail="its mooncake-master is not running (not running; record /s/r.mooncake-master.json)")
    d = decide(o, cfg())
    assert d.verdict == "stalled" and d.cause == "store" and "hidden-state store is down" in d.summary


def test_a_stopped_trainers_word_that_it_waits_for_the_store_is_stale():
    o = _waiting_trainer(state="T")
    d = decide(o, cfg())
    assert "come back" not in d.summary and d.cause != "store", d.summary


def test_reconcile_counts_a_streaming_shards_samples_by_its_stores_rule(tmp_path, monkeypatch):
    """A shard complete before its store died is incomplete to reconcile (its claim reruns it); the disk rule
    (each file intact) would count a streaming shard's keys as missing files, and every shard as empty."""
    from pathlib import Path

    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    from eagleflow.local_run import LocalRun
    from eagleflow.stores.ledger import EpochLedger
    from eagleflow.stores.mooncake import store as mstore
    from eagleflow.stores.mooncake.master import MooncakeEndpoint
    from eagleflow.watchdog.reconcile import shard_state
    from tests.fixtures.capture_corpus import write_corpus
    cfg = load_config(data={"target_model": "/models/t", "run_root": str(tmp_path / "runs"),
                            "capture": {"shards": 1}, "node": {"name": "n", "state_dir": str(tmp_path / "state")},
                            "stream": {"storage": "mooncake"},
                            # one epoch: one capture pass (several over a buffer they exceed: test_stream_recapture)
                            "train": {"max_steps": 2, "batch_size": 2}})
    layout = RunLayout.for_run(cfg, "r")
    rows = write_corpus(Path(str(layout.corpus_dir)) / "corpus.parquet", 4, 50)
    with ManifestWriter(Path(str(layout.shard_dir(0))) / "manifest.jsonl", fsync=False) as w:
        for i, r in enumerate(rows):
            w.append(ManifestEntry(id=r["id"], index=i, file=f"r/shard_00000/{i:08d}", tokens=5, bytes=10,
                                   sha256="0" * 64, store_dtype="auto", store_id="old"))
    led = EpochLedger(Path(str(layout.stream_ledger_file)), fsync=False)
    led.plan(1)
    led.trained(0, [rows[0]["id"]], step=1)
    led.close()
    run = LocalRun(cfg=cfg, layout=layout, config_path=str(tmp_path / "c.yaml"))
    monkeypatch.setattr(mstore, "running_store", lambda f: MooncakeEndpoint(
        host="127.0.0.1", rpc_port=1, metadata_port=2, metrics_port=3, segment_bytes=1, store_id="old"))
    st = shard_state(run, 0)
    assert (st.stored, st.expected, st.incomplete) == (4, 4, False)      # the store that holds them runs
    monkeypatch.setattr(mstore, "running_store", lambda f: MooncakeEndpoint(
        host="127.0.0.1", rpc_port=1, metadata_port=2, metrics_port=3, segment_bytes=1, store_id="new"))
    st = shard_state(run, 0)
    assert (st.stored, st.expected, st.incomplete) == (1, 4, True)       # lost with it, but the one trained
