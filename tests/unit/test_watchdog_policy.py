"""The verdict rules on hand-built observations: each signal, and the slow/stalled line between them."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.heartbeat import Heartbeat, InFlight
from eagleflow.watchdog.diagnosis import StallDetected, StallDiagnosis
from eagleflow.watchdog.policy import decide
from eagleflow.watchdog.signals import (CpuSignal, GpuReading, GpuSignal, HealthSignal, Observation, ProcessSignal,
                                        WatchedJob)

NOW = 1_800_000_000.0


def cfg(**wd):
    base = {"poll_interval_s": 15, "stall_after_s": 20, "health_timeout_s": 20, "startup_grace_s": 120,
            "gpu_window_s": 20, "d_state_after_s": 20}
    base.update(wd)
    return load_config(data={"target_model": "/m", "node": {"name": "gpu-node-1", "has_gpu": True},
                             "capture": {"shards": 8}, "watchdog": base})


def obs(*, done=18_402, total=37_312, progress_ago=5.0, written_ago=1.0, state="running", in_flight=None,
        worker=None, server=None, health=None, gpu=None, error=None, started_ago=3600.0, resumed=0):
    hb = Heartbeat(job="extract shard 3/8", pid=4242, state=state, time=NOW - written_ago,
                   started_at=NOW - started_ago, done=done, total=total, resumed=resumed,
                   last_progress_at=NOW - progress_ago, error=error, rate=1.09,
                   in_flight=in_flight if in_flight is not None else
                   [InFlight(id="r.s00003.00018403", since=NOW - min(progress_ago, 30), tokens=4000, timeout_s=260)])
    return Observation(
        job=WatchedJob(shard=3, num_shards=8), node="gpu-node-1", now=NOW, heartbeat=hb, heartbeat_error=None,
        worker=worker or ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=True, state="S",
                                       started_at=NOW - started_ago),
        server=server or ProcessSignal(role="capture_server", recorded=True, pid=4100, alive=True, state="S"),
        health=health or HealthSignal(), gpu=gpu or GpuSignal(applicable=True, readings=[]),
        free_bytes=10**12, done_since_last_look=12, last_look_at=NOW - 15, log_tail=["worker log line"])


def idle_held_gpus(since_ago: float) -> GpuSignal:
    rows = [GpuReading(index=i, name="RTX PRO 6000", memory_used_mib=92_262, memory_total_mib=97_887,
                       utilization_pct=0, held=True) for i in range(8)]
    return GpuSignal(applicable=True, readings=rows, busy_now=False, idle_held_since=NOW - since_ago,
                     max_util_window={i: 0.0 for i in range(8)})


def busy_gpus() -> GpuSignal:
    rows = [GpuReading(index=i, name="RTX PRO 6000", memory_used_mib=92_262, memory_total_mib=97_887,
                       utilization_pct=97, held=True) for i in range(8)]
    return GpuSignal(applicable=True, readings=rows, busy_now=True, max_util_window={i: 99.0 for i in range(8)})


def test_the_seeds_stall_is_stalled_with_every_signal_in_numbers():
    d_since = NOW - 540
    o = obs(progress_ago=612, health=HealthSignal(checked=True, ok=False, outcome="timeout", latency_s=20),
            gpu=idle_held_gpus(600),
            worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=True, state="D",
                                 d_state=True, d_since=d_since, wchan="futex_wait", started_at=NOW - 7200))
    d = decide(o, cfg())
    assert d.verdict == "stalled"
    s = d.summary
    assert s.startswith("STALLED shard 3/8 on gpu-node-1: no sample completed for 612 s (18,402/37,312 done, last at ")
    assert "server /health_generate timed out after 20 s" in s
    assert "GPUs 0-7 hold 90.1 GB at 0 % for 600 s" in s
    assert "worker pid 4242 in D state for 540 s (waiting in futex_wait)" in s
    assert d.subject == "[eagleflow] STALLED shard 3/8 on gpu-node-1"
    table = d.gpu_table()
    assert table.count("90.1 GB / 95.6 GB") == 8 and "yes" in table
    assert d.event_payload()["status"] == "stalled"


def test_one_long_sample_with_busy_gpus_is_slow_not_stalled():
    o = obs(progress_ago=120, in_flight=[InFlight(id="r1", since=NOW - 120, tokens=8000, timeout_s=460)],
            health=HealthSignal(checked=True, ok=True, outcome="ok", latency_s=0.4), gpu=busy_gpus())
    d = decide(o, cfg())
    assert d.verdict == "slow", d.summary
    assert "request r1 (8,000 tokens) in flight for 120 s of its 460 s deadline" in d.summary
    assert d.status is None and d.exit_code == 3


def test_health_timeout_while_gpus_busy_is_slow_but_an_overdue_request_is_stalled():
    h = HealthSignal(checked=True, ok=False, outcome="timeout", latency_s=20)
    assert decide(obs(progress_ago=60, health=h, gpu=busy_gpus()), cfg()).verdict == "slow"
    hung = obs(progress_ago=500, health=h, gpu=busy_gpus(),
               in_flight=[InFlight(id="r9", since=NOW - 500, tokens=8000, timeout_s=460)])
    d = decide(hung, cfg())
    assert d.verdict == "stalled"
    assert "request r9 in flight for 500 s, past its 460 s deadline" in d.summary


def test_fresh_progress_is_healthy_and_counts_samples_since_the_last_look():
    d = decide(obs(progress_ago=2), cfg())
    assert d.verdict == "healthy" and d.status is None and d.exit_code == 0
    assert "18,402/37,312 samples done, +12 since the last look 15 s ago" in d.summary


def test_startup_grace_hides_a_loading_job_then_expires():
    young = obs(done=0, progress_ago=100, started_ago=100, health=HealthSignal(True, False, "timeout", 20))
    assert decide(young, cfg()).verdict == "starting"
    old = obs(done=0, progress_ago=130, started_ago=130, health=HealthSignal(True, False, "timeout", 20))
    assert decide(old, cfg()).verdict == "stalled"
    # the grace covers loading, not a worker frozen (SIGSTOP) before its first sample
    frozen = obs(done=0, progress_ago=30, started_ago=30,
                 worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=True, state="T",
                                      started_at=NOW - 30))
    d = decide(frozen, cfg())
    assert d.verdict == "stalled" and "worker pid 4242 is stopped (state T: SIGSTOP" in d.summary and d.cause == "worker"
    assert "inside the startup grace" in d.summary


def test_dead_worker_and_zombie_and_failed_and_complete():
    gone = obs(worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=False))
    d = decide(gone, cfg())
    assert d.verdict == "dead" and "worker pid 4242 is gone without completing" in d.summary
    assert d.log_tail == ["worker log line"] and "worker log line" in d.render()
    zombie = obs(worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=False, state="Z"))
    assert "is a zombie" in decide(zombie, cfg()).summary
    failed = obs(state="failed", error="OSError: [Errno 28] No space left on device")
    d = decide(failed, cfg())
    assert d.verdict == "failed" and "No space left on device" in d.summary and d.exit_code == 6
    done = decide(obs(state="complete", done=37_312), cfg())
    assert done.verdict == "complete" and done.event_payload() == {"status": "complete", "summary": done.summary}


def test_stale_heartbeat_of_a_live_worker_and_a_stopped_server_are_named():
    # frozen: the heartbeat 80 s old and the worker's processes seen using no CPU for 30 s (the window is 20 s)
    quiet = CpuSignal(read_at=NOW, first_at=NOW - 300, quiet_since=NOW - 30, members=1)
    d = decide(obs(progress_ago=90, written_ago=80, health=HealthSignal(True, True, "ok", 0.2),
                   worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=True, state="S",
                                        started_at=NOW - 3600, cpu=quiet)), cfg())
    assert d.verdict == "stalled"
    assert "worker pid 4242 is alive but its heartbeat was last written 80 s before it was read" in d.summary
    assert "used no CPU time for 30 s: frozen" in d.summary
    stopped = obs(progress_ago=40, health=HealthSignal(True, False, "timeout", 20),
                  gpu=GpuSignal(applicable=False, note="not applicable: node.has_gpu is false"),
                  server=ProcessSignal(role="capture_server", recorded=True, pid=4100, alive=True, state="T"))
    d = decide(stopped, cfg())
    assert "server pid 4100 is stopped (state T" in d.summary
    assert d.gpu_table() == "GPUs: not applicable: node.has_gpu is false"


def test_diagnosis_round_trips_json_and_stall_detected_reads_well():
    d = decide(obs(progress_ago=612, health=HealthSignal(True, False, "timeout", 20), gpu=idle_held_gpus(600)),
               cfg())
    again = StallDiagnosis.from_json(d.to_json())
    assert again == d and again.render() == d.render()
    e = StallDetected(d.subject, d.render())
    assert str(e).startswith("[eagleflow] STALLED shard 3/8 on gpu-node-1\nSTALLED shard 3/8")
    assert isinstance(e, Exception) and e.subject == d.subject


@pytest.mark.parametrize("progress_ago, verdict", [(19.9, "healthy"), (20.0, "stalled")])
def test_stall_after_is_the_threshold(progress_ago, verdict):
    o = obs(progress_ago=progress_ago, health=HealthSignal(True, False, "refused", 0.01))
    assert decide(o, cfg()).verdict == verdict


def test_a_trainer_that_makes_no_step_for_too_long_is_stalled_even_with_busy_gpus():
    def train_obs(progress_ago):
        o = obs(progress_ago=progress_ago, in_flight=[], gpu=busy_gpus())
        o.job = WatchedJob(shard=None)
        o.server = None
        o.heartbeat.unit = "steps"
        return o
    assert decide(train_obs(100), cfg()).verdict == "slow"
    d = decide(train_obs(401), cfg())  # limit: max(20 x stall_after (20 s), 300 s)
    assert d.verdict == "stalled" and d.job == "training"
    assert "no step for 401 s, over the 400 s limit for one step" in d.summary


def _trainer_in(busy_with, running_s, step_times, *, progress_ago=None, gpu=None):
    """A trainer's look: its main thread busy with ``busy_with`` for ``running_s``, its heartbeat thread fresh."""
    from eagleflow.heartbeat import BUSY_SINCE, BUSY_WITH, STEP_TIMES
    o = obs(progress_ago=running_s if progress_ago is None else progress_ago, in_flight=[], gpu=gpu or busy_gpus())
    o.job, o.server = WatchedJob(shard=None), None
    o.heartbeat.unit = "steps"
    o.heartbeat.extra.update({BUSY_WITH: busy_with, BUSY_SINCE: NOW - running_s, STEP_TIMES: step_times})
    return o


def test_a_trainer_hung_inside_a_step_is_stalled_past_its_own_step_time_not_after_the_no_step_limit():
    """A collective or a transfer that never returns: the trainer's process runs, its heartbeat thread writes, an
    NCCL hang keeps the GPU busy; only the step's own clock says it. Judged against this run's step time
    (slow_factor x p95, at least 2 x stall_after_s: 40 s here), not after the 400 s no-step limit."""
    steps = [0.8, 0.9, 1.1, 0.9]
    assert decide(_trainer_in("step", 39, steps), cfg()).verdict == "slow"
    d = decide(_trainer_in("step", 41, steps), cfg())
    assert d.verdict == "stalled" and d.job == "training" and d.cause == "trainer", d.summary
    assert "step 18403 has run for 41 s while the trainer's heartbeat thread runs on, over its 40 s limit " \
           "(3 x this run's step time, 1.10 s p95, at least 2 x watchdog.stall_after_s)" in d.summary, d.summary
    # a slow run's own pace moves the limit: 3 x 20 s steps
    assert decide(_trainer_in("step", 59, [20.0, 18.0, 19.5]), cfg()).verdict == "slow"
    assert decide(_trainer_in("step", 61, [20.0, 18.0, 19.5]), cfg()).verdict == "stalled"


@pytest.mark.parametrize("case", ["eval", "checkpoint", "no pace yet", "compiled", "progress since"])
def test_a_long_evaluation_checkpoint_first_steps_or_compiled_layer_keep_the_no_step_limit(case):
    """What may run long in a healthy trainer is not judged by the step's clock: an evaluation, a checkpoint, the
    first steps (no pace: fewer than 3 step times), a compiled layer (a new shape recompiles); a wait for the
    producer that just ended restarts the step's clock (the trainer's heartbeat: busy_since)."""
    busy, steps, config = "step", [0.8, 0.9, 1.1], cfg()
    if case in ("eval", "checkpoint"):
        busy = case
    elif case == "no pace yet":
        steps = [0.8, 0.9]
    elif case == "compiled":
        config = load_config(data={**config.model_dump(mode="json"), "train": {"compile": True}})
    o = _trainer_in(busy, 120, steps)
    if case == "progress since":
        o = _trainer_in("step", 10, steps, progress_ago=120)        # the step began 10 s ago, after a long wait
    d = decide(o, config)
    assert d.verdict == "slow", d.summary
    assert decide(_trainer_in(busy, 401, steps), config).verdict == "stalled"      # the no-step limit, 400 s


def test_a_predecessors_failed_heartbeat_does_not_fail_the_worker_that_replaced_it():
    # A retry stopped the old worker (it wrote "failed: stopped by SIGTERM") and started a new one
    # that has not written its first heartbeat yet: that is a start, not a failure.
    replaced = obs(state="failed", error="shard 3: stopped by SIGTERM", written_ago=2.0, started_ago=3600.0,
                   worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=5151, alive=True, state="S",
                                        started_at=NOW - 1.0))
    assert decide(replaced, cfg()).verdict == "starting"
    # the same file written after the live worker started is its own: failed
    own = obs(state="failed", error="shard 3: stopped by SIGTERM", written_ago=0.5,
              worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=5151, alive=True, state="S",
                                   started_at=NOW - 1.0))
    assert decide(own, cfg()).verdict == "failed"


@pytest.mark.parametrize("error, cause, named", [
    ("StreamStarved: mooncake: no new sample for 300 s in epoch 0 (12/48 served): the producer ...", "producer",
     "starved: no sample arrived from the producer"),
    ("StoreUnavailable: Mooncake store (master 127.0.0.1:5): get r/shard_00000/00000003: the master does not answer",
     "store", "the run's hidden-state store does not answer")])
def test_a_streaming_trainer_that_failed_because_of_the_other_side_names_it_not_itself(error, cause, named):
    """Issue 53: a starved trainer blames the producer, a lost store the store; the trainer's own error stays
    the job's."""
    d = decide(obs(state="failed", error=error), cfg())
    assert d.verdict == "failed" and d.cause == cause and named in d.summary and error[:40] in d.summary
    own = decide(obs(state="failed", error="RuntimeError: CUDA error: an illegal memory access"), cfg())
    assert own.cause == "job" and "starved" not in own.summary


def test_a_streaming_trainer_whose_store_is_down_is_stalled_by_the_store():
    """Issue 53: the master (or segment holder) not running by its pid record is the store's failure, named, even
    while the trainer itself still runs and waits; a store that runs changes nothing."""
    from eagleflow.watchdog.signals import StoreSignal
    o = obs()
    o.store = StoreSignal(ok=False, label="Mooncake store (master 127.0.0.1:5)",
                          detail="its mooncake-master is not running (not running; record /s/r.mooncake-master.json)")
    d = decide(o, cfg())
    assert d.verdict == "stalled" and d.cause == "store"
    assert "hidden-state store is down, not the trainer: Mooncake store (master 127.0.0.1:5)" in d.summary
    assert "mooncake-master is not running" in d.summary
    up = obs()
    up.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", detail="answering", answering=True)
    assert decide(up, cfg()).verdict == decide(obs(), cfg()).verdict


def test_a_starved_streaming_trainer_is_told_from_a_stuck_one_and_names_the_producer():
    """Issue 53: a trainer whose heartbeat says it waits for the producer's next sample (StreamLoader's on_wait)
    is slow, blamed on the producer, never stalled itself, however long its progress has been stale; the same
    stale progress without that word is judged as before."""
    quiet = CpuSignal(read_at=NOW, first_at=NOW - 300, quiet_since=NOW - 100, members=1)
    worker = ProcessSignal(role="trainer", recorded=True, pid=4242, alive=True, state="S", started_at=NOW - 3600,
                           cpu=quiet)
    starved = obs(progress_ago=200, worker=worker)
    starved.heartbeat.extra["waiting_for_samples_since"] = NOW - 190
    d = decide(starved, cfg())
    assert d.verdict == "slow" and d.cause == "producer" and d.status is None
    assert "starved: waiting 190 s for a sample from the producer" in d.summary and "not the trainer" in d.summary
    stuck = obs(progress_ago=200, worker=worker)
    stuck.heartbeat.extra["waiting_for_samples_since"] = None      # it has samples: judged as before
    assert decide(stuck, cfg()).cause != "producer"


def test_a_stopped_trainer_that_had_said_it_waits_is_a_stuck_consumer_when_the_buffer_is_full():
    """Issue 53, the buffer full: a trainer SIGSTOPped while its heartbeat said it waited for the producer (its word
    stale: it cannot clear it) is stalled, not starved; with the store's buffer full the verdict says the consumer
    is stuck and the producer waits on it; a store with room left only gives its fill."""
    from eagleflow.watchdog.signals import StoreSignal
    stopped = ProcessSignal(role="trainer", recorded=True, pid=4242, alive=True, state="T", started_at=NOW - 3600)
    o = obs(progress_ago=60, written_ago=50, worker=stopped, in_flight=[])
    o.job = WatchedJob(shard=None)   # the trainer
    o.heartbeat.extra["waiting_for_samples_since"] = NOW - 55
    o.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", detail="answering", answering=True,
                          allocated_bytes=90_000, buffer_bytes=98_304)
    d = decide(o, cfg())
    assert d.verdict == "stalled" and d.cause == "worker", d.summary
    assert d.headline.startswith("the consumer is stuck: the store holds 90,000 of its 98,304-byte buffer (92 %), "
                                 "so the producer waits for room (backpressure) on this trainer"), d.headline
    assert "worker pid 4242 is stopped (state T" in d.summary and "starved" not in d.summary
    o.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", allocated_bytes=10_000,
                          buffer_bytes=98_304)
    roomy = decide(o, cfg())
    assert roomy.verdict == "stalled" and "consumer is stuck" not in roomy.headline
    assert roomy.headline.endswith("the store holds 10,000 of its 98,304-byte buffer (10 %)"), roomy.headline


def test_a_trainer_stopped_before_its_heartbeat_counted_a_step_is_a_stuck_consumer_inside_the_startup_grace():
    """CI, stop 55: a trainer SIGSTOPped after its log's second step but before its heartbeat counted one (0 done,
    19 s after the start, inside the startup grace) is stalled by the frozen-process branch; that branch too says
    the consumer is stuck when the store's buffer is full."""
    from eagleflow.watchdog.signals import StoreSignal
    stopped = ProcessSignal(role="trainer", recorded=True, pid=4242, alive=True, state="T", started_at=NOW - 30)
    o = obs(done=0, total=16, progress_ago=30, written_ago=15, started_ago=30, worker=stopped, in_flight=[])
    o.job = WatchedJob(shard=None)
    o.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", detail="answering", answering=True,
                          allocated_bytes=90_000, buffer_bytes=98_304)
    d = decide(o, cfg())
    assert d.verdict == "stalled" and "inside the startup grace" in d.summary, d.summary
    assert d.headline.startswith("the consumer is stuck: the store holds 90,000 of its 98,304-byte buffer (92 %), "
                                 "so the producer waits for room (backpressure) on this trainer"), d.headline
    assert "worker pid 4242 is stopped (state T" in d.summary


def test_a_store_whose_room_is_under_one_and_a_half_samples_is_full_below_three_quarters():
    """CI, stop 56: the producer waited for room with the store at 73,453 of 98,304 bytes (75 %, just under 3/4)
    holding 25 KiB samples; the watch judged the buffer not full and did not say the consumer is stuck. The
    mean sample held (allocated / keys) now says whether the next one fits; small samples at the same fill do."""
    from eagleflow.watchdog.signals import StoreSignal
    stopped = ProcessSignal(role="trainer", recorded=True, pid=4242, alive=True, state="T", started_at=NOW - 30)
    o = obs(done=0, total=16, progress_ago=30, written_ago=15, started_ago=30, worker=stopped, in_flight=[])
    o.job = WatchedJob(shard=None)
    o.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", answering=True,
                          allocated_bytes=73_453, buffer_bytes=98_304, key_count=3)
    assert o.store.full()
    assert decide(o, cfg()).headline.startswith("the consumer is stuck: the store holds 73,453 of its 98,304-byte "
                                                "buffer (75 %)")
    o.store = StoreSignal(ok=True, label="Mooncake store (master 127.0.0.1:5)", answering=True,
                          allocated_bytes=73_453, buffer_bytes=98_304, key_count=30)
    assert not o.store.full() and "consumer is stuck" not in decide(o, cfg()).headline
    unknown = StoreSignal(ok=True, allocated_bytes=73_453, buffer_bytes=98_304)       # keys not read: 3/4 only
    assert not unknown.full() and StoreSignal(ok=True, allocated_bytes=73_728, buffer_bytes=98_304).full()
    assert not StoreSignal(ok=True, allocated_bytes=None, buffer_bytes=98_304, key_count=3).full()


def test_a_store_is_full_when_a_capture_worker_says_its_put_waits_for_room(tmp_path):
    """CI stop 56 again (a later run): the put waited at 75 % with samples of 2-21 KiB, the mean held too small to
    say the next one would not fit. The worker's own word (its heartbeat's waiting_for_room_since) is read by the
    trainer's watch: full whatever the fill; a worker that stopped waiting, or is not running, says nothing."""
    import json as _json
    from eagleflow.heartbeat import WAITING_FOR_ROOM
    from eagleflow.layout import RunLayout
    from eagleflow.watchdog.signals import StoreSignal, _producer_waits_for_room
    assert StoreSignal(ok=True, allocated_bytes=40_000, buffer_bytes=98_304, key_count=8, producer_waits=True).full()
    assert not StoreSignal(ok=True, allocated_bytes=40_000, buffer_bytes=98_304, key_count=8).full()
    config = load_config(data={"target_model": "/m", "run_root": str(tmp_path / "runs"), "capture": {"shards": 2}})
    layout = RunLayout.for_run(config, "r")
    assert not _producer_waits_for_room(config, layout)                 # no heartbeat yet
    hb = Heartbeat(job="extract shard 1/2", pid=1, state="running", time=NOW, started_at=NOW, done=3, total=9,
                   last_progress_at=NOW, extra={WAITING_FOR_ROOM: NOW - 12})
    path = Path(str(layout.heartbeat_file(1)))
    path.parent.mkdir(parents=True)
    hb.write(path)
    assert _producer_waits_for_room(config, layout)
    data = _json.loads(path.read_text())
    for change in ({"extra": {}}, {"state": "complete"}):
        path.write_text(_json.dumps({**data, **change}))
        assert not _producer_waits_for_room(config, layout), change
    path.write_text("{not json")
    assert not _producer_waits_for_room(config, layout)


def test_a_capture_worker_held_back_by_a_full_streaming_store_is_slow_not_stalled():
    """Issue 53, found under Airflow's scheduler: a worker whose put waits for room (the store holds
    stream.buffer_gib until the trainer takes samples) says so in its heartbeat (the sink's on_wait); its watch
    calls it held back by the consumer, never a stall (which restarted a healthy server and worker), however long
    its progress is stale. The same stale progress without the word, or with another request overdue at the
    server, or from a stopped worker, is judged as before."""
    from eagleflow.heartbeat import WAITING_FOR_ROOM
    held = obs(progress_ago=200, in_flight=[], gpu=idle_held_gpus(200))
    held.heartbeat.extra[WAITING_FOR_ROOM] = NOW - 190
    d = decide(held, cfg())
    assert d.verdict == "slow" and d.cause == "consumer" and d.status is None, d.summary
    assert "held back: waiting 190 s for room in the run's hidden-state store" in d.summary, d.summary
    without = obs(progress_ago=200, in_flight=[], gpu=idle_held_gpus(200))
    assert decide(without, cfg()).verdict == "stalled"
    overdue = obs(progress_ago=200, gpu=idle_held_gpus(200),
                  in_flight=[InFlight(id="r.s00003.00018404", since=NOW - 300, tokens=4000, timeout_s=260)])
    overdue.heartbeat.extra[WAITING_FOR_ROOM] = NOW - 190
    assert decide(overdue, cfg()).verdict == "stalled"
    stopped = obs(progress_ago=200, in_flight=[], gpu=idle_held_gpus(200),
                  worker=ProcessSignal(role="worker_shard_00003", recorded=True, pid=4242, alive=True, state="T",
                                       started_at=NOW - 3600))
    stopped.heartbeat.extra[WAITING_FOR_ROOM] = NOW - 190
    assert decide(stopped, cfg()).verdict == "stalled"


def test_a_worker_at_the_gate_between_capture_passes_is_said_to_wait_for_the_other_shards_not_for_room():
    """A run that re-captures per epoch: a worker whose next pass waits for every shard's previous pass is held
    back as a put waiting for room is (slow, never stalled), but the verdict says what it waits for: the other
    shards' pass, not a full buffer (which it may not be)."""
    from eagleflow.heartbeat import WAITING_FOR_PASS, WAITING_FOR_ROOM
    gate = obs(progress_ago=200, in_flight=[], gpu=idle_held_gpus(200))
    gate.heartbeat.extra[WAITING_FOR_ROOM] = NOW - 190
    gate.heartbeat.extra[WAITING_FOR_PASS] = 1
    d = decide(gate, cfg())
    assert d.verdict == "slow" and d.status is None, d.summary
    assert ("held back: waiting 190 s to start capture pass 1 until every shard's pass 0 is in the store"
            in d.summary), d.summary
    assert "buffer" not in d.headline.split("(")[0] and "is full" not in d.summary, d.summary



def test_a_wait_for_room_that_just_ended_counts_the_workers_progress_from_its_end():
    """Between the end of a put's wait for room and that sample's record, the heartbeat says no wait and its last
    sample is as old as the wait: a look there must not read a shard stale for the whole wait (the scheduler run
    saw one such look). Progress counts from the wait's end; once that too is older than the limit, as before."""
    from eagleflow.heartbeat import ROOM_WAIT_ENDED
    just = obs(progress_ago=200, in_flight=[], gpu=idle_held_gpus(200))
    just.heartbeat.extra[ROOM_WAIT_ENDED] = NOW - 1
    assert decide(just, cfg()).verdict == "healthy"
    long_ago = obs(progress_ago=200, in_flight=[], gpu=idle_held_gpus(200))
    long_ago.heartbeat.extra[ROOM_WAIT_ENDED] = NOW - 190
    assert decide(long_ago, cfg()).verdict == "stalled"
