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
