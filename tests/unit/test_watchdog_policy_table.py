"""``watchdog.policy.decide``'s whole decision table, one row per rule of its docstring and per signal of
docs/watchdog.md's table ("evidence of a stall when progress is stale"): the verdict, the cause an incident
is keyed on, and the words a person reads. Hand-built observations, no node: microseconds each.

The observation builders are test_watchdog_policy's (shard 3/8, stall_after 20 s, grace 120 s, d_state_after
20 s, gpu_window 20 s, the server alive, one request in flight, progress 5 s old unless a row says otherwise).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from eagleflow.heartbeat import InFlight
from eagleflow.watchdog.policy import decide
from eagleflow.watchdog.signals import CpuSignal, GpuSignal, HealthSignal, Pace, ProcessSignal, WatchedJob
from tests.unit.test_watchdog_policy import NOW, busy_gpus, cfg, idle_held_gpus, obs

WORKER, SERVER = "worker_shard_00003", "capture_server"
TIMEOUT = HealthSignal(checked=True, ok=False, outcome="timeout", latency_s=20)
ANSWERS = HealthSignal(checked=True, ok=True, outcome="ok", latency_s=0.2)
STALE = 60.0                          # progress age of the stale rows: past stall_after (20 s)
FEW_MB, LOTS = 10 * 1024 * 1024, 10**12


def worker(**kw) -> ProcessSignal:
    return ProcessSignal(**{"role": WORKER, "recorded": True, "pid": 4242, "alive": True, "state": "S",
                            "started_at": NOW - 3600, **kw})


def server(**kw) -> ProcessSignal:
    return ProcessSignal(**{"role": SERVER, "recorded": True, "pid": 4100, "alive": True, "state": "S", **kw})


def cpu(quiet_s: float, used_s: float | None = None, over_s: float = 5.0) -> CpuSignal:
    """The worker's process group as the watch's CPU reads saw it: no tick gained for ``quiet_s`` (up to NOW), and
    before that ``used_s`` seconds of CPU over the ``over_s`` between two reads (None: none seen since its first)."""
    if used_s is None:
        return CpuSignal(read_at=NOW, first_at=NOW - quiet_s, quiet_since=NOW - quiet_s, members=3)
    return CpuSignal(read_at=NOW, first_at=NOW - 600, quiet_since=NOW - quiet_s, members=3, ticks=9000,
                     last_gain_s=used_s, last_gain_over_s=over_s, last_gain_at=NOW - quiet_s)


def late_trainer(progress_ago, started_ago=3600.0, **w):
    """The trainer, its heartbeat last written 40 s before the look (past the 20 s heartbeat window)."""
    o = trainer(progress_ago)
    o.heartbeat.time = NOW - 40
    o.heartbeat.started_at = NOW - started_ago
    o.heartbeat.done = o.heartbeat.resumed = 0 if started_ago < 120 else o.heartbeat.done
    return with_(o, worker=worker(role="trainer", started_at=NOW - started_ago, **w))


def stale(**kw):
    """Progress 60 s old, the server answering, the GPUs busy: nothing says stuck unless the row adds it."""
    return obs(**{"progress_ago": STALE, "health": ANSWERS, "gpu": busy_gpus(), **kw})


def with_(o, **fields):
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def trainer(progress_ago):
    o = obs(progress_ago=progress_ago, in_flight=[], gpu=busy_gpus())
    o.heartbeat.unit = "steps"
    return with_(o, job=WatchedJob(shard=None), server=None)


# (row id, observation, verdict, cause, words the summary must hold)
TABLE = [
    # 1. the job said how it ended
    ("1-complete", lambda: obs(state="complete", done=37_312, total=37_312), "complete", "",
     "COMPLETE shard 3/8 on gpu-node-1"),
    ("1-failed-its-own-error", lambda: obs(state="failed", error="ValueError: sample 18403 has no turns"),
     "failed", "job", "the job reported: ValueError: sample 18403 has no turns"),
    ("1-failed-server-gone", lambda: obs(state="failed", error="ConnectionRefusedError",
                                         server=server(alive=False)),
     "failed", "capture_server", "server pid 4100 is gone"),
    ("1-failed-server-restarted-under-it", lambda: with_(obs(state="failed", error="request r1 lost",
                                                             server=server(started_at=NOW - 60)),
                                                         server_restarted_under_worker=True),
     "failed", "capture_server", "the capture server (pid 4100) was restarted at"),
    ("1-failed-disk-full", lambda: with_(obs(state="failed", error="OSError: [Errno 28] No space left on device"),
                                         free_bytes=FEW_MB),
     "failed", "disk", "only 10.5 MB free where the job writes"),
    ("1-a-predecessors-heartbeat-is-not-the-live-workers", lambda: obs(
        state="failed", error="stopped by SIGTERM", written_ago=5, worker=worker(pid=5151, started_at=NOW - 1)),
     "starting", "", "within the 120 s startup grace"),
    # 2. the worker is gone
    ("2-no-record", lambda: obs(worker=ProcessSignal(role=WORKER, recorded=False)), "dead", "worker",
     "no worker_shard_00003 process is recorded (no pid file)"),
    ("2-refused-record", lambda: obs(worker=ProcessSignal(role=WORKER, recorded=False,
                                                          refused="group-writable record")),
     "dead", "worker", "the pid record is refused (group-writable record)"),
    ("2-vanished", lambda: obs(worker=worker(alive=False)), "dead", "worker",
     "it vanished without a final heartbeat"),
    ("2-zombie", lambda: obs(worker=worker(alive=False, state="Z")), "dead", "worker", "worker pid 4242 is a zombie"),
    ("2-exit-code", lambda: obs(worker=worker(alive=False, exit_code=1)), "dead", "worker",
     "it exited with code 1 without a final heartbeat"),
    ("2-kill-9", lambda: obs(worker=worker(alive=False, exit_signal=9, oom_killed=False)), "dead", "worker",
     "killed by SIGKILL; the kernel log shows no OOM kill of it, so kill -9"),
    ("2-oom", lambda: obs(worker=worker(alive=False, exit_signal=9, oom_killed=True)), "dead", "worker",
     "the kernel's OOM killer killed it"),
    ("2-dead-with-its-server", lambda: obs(worker=worker(alive=False), server=server(alive=False)), "dead",
     "capture_server", "server pid 4100 is gone"),
    # 3. advancing, or still starting
    ("3-healthy", lambda: obs(progress_ago=2), "healthy", "", "18,402/37,312 samples done, +12 since the last look"),
    ("3-slow-run-judged-by-its-own-pace", lambda: with_(obs(progress_ago=40),
                                                        pace=Pace(samples=64, gap_p95_s=30.0, stale_after_s=90.0,
                                                                  request_limit_s=90.0)),
     "healthy", "", "slow run, judged against usual gap between samples 30.0 s"),
    ("3-starting-inside-the-grace", lambda: obs(done=0, progress_ago=100, started_ago=100, health=TIMEOUT),
     "starting", "", "started 100 s ago, within the 120 s startup grace"),
    ("3-frozen-inside-the-grace", lambda: obs(done=0, progress_ago=30, started_ago=30,
                                              worker=worker(state="T", started_at=NOW - 30)),
     "stalled", "worker", "inside the startup grace"),
    ("3-grace-over", lambda: obs(done=0, progress_ago=130, started_ago=130, health=TIMEOUT), "stalled",
     "capture_server", "server /health_generate timed out after 20 s"),
    # 4. progress stale: stalled only with independent evidence, else slow
    ("4-no-signal-is-slow", lambda: stale(), "slow", "", "server answered /health_generate in 0.2 s"),
    ("4-server-gone", lambda: stale(server=server(alive=False)), "stalled", "capture_server",
     "server pid 4100 is gone"),
    ("4-server-zombie", lambda: stale(server=server(alive=False, state="Z")), "stalled", "capture_server",
     "server pid 4100 is a zombie"),
    ("4-server-stopped", lambda: stale(server=server(state="T")), "stalled", "capture_server",
     "so it cannot answer"),
    ("4-server-in-d-state", lambda: stale(server=server(state="D", d_state=True, d_since=NOW - 30,
                                                        wchan="nfs_wait")),
     "stalled", "capture_server", "server pid 4100 in D state for 30 s (waiting in nfs_wait)"),
    ("4-health-timeout-gpus-idle", lambda: stale(health=TIMEOUT, gpu=GpuSignal(applicable=True)), "stalled",
     "capture_server", "server /health_generate timed out after 20 s"),
    ("4-health-refused-gpus-idle", lambda: stale(health=HealthSignal(True, False, "refused", 0.01),
                                                 gpu=GpuSignal(applicable=True)),
     "stalled", "capture_server", "server /health_generate failed (refused)"),
    ("4-health-timeout-gpus-busy-now", lambda: stale(health=TIMEOUT), "slow", "",
     "server /health_generate timed out after 20 s but the GPUs are busy"),
    ("4-health-timeout-gpus-busy-since-progress", lambda: stale(
        health=TIMEOUT, gpu=GpuSignal(applicable=True, busy_now=False, history=[[NOW - 30, {0: 45.0}]])),
     "slow", "", "but the GPUs are busy"),
    ("4-health-timeout-sample-during-look", lambda: with_(stale(health=TIMEOUT, gpu=GpuSignal(applicable=True)),
                                                          progress_during_look=NOW - 1),
     "slow", "", "while it waited (busy, not hung)"),
    ("4-no-server-info", lambda: stale(health=HealthSignal(outcome="no server info"), gpu=GpuSignal(applicable=True)),
     "stalled", "capture_server", "no server info file (capture_server.json)"),
    ("4-hung-generate", lambda: stale(gpu=GpuSignal(applicable=True),
                                      in_flight=[InFlight(id="r7", since=NOW - 600, tokens=100, timeout_s=3000)]),
     "stalled", "capture_server", "server answers /health_generate (0.2 s) but its /generate does not: request r7"),
    ("4-request-past-its-deadline", lambda: stale(progress_ago=500, health=TIMEOUT,
                                                  in_flight=[InFlight(id="r9", since=NOW - 500, tokens=8000,
                                                                      timeout_s=460)]),
     "stalled", "capture_server", "request r9 in flight for 500 s, past its 460 s deadline"),
    ("4-worker-stopped", lambda: stale(worker=worker(state="T")), "stalled", "worker",
     "worker pid 4242 is stopped (state T"),
    ("4-worker-in-d-state", lambda: stale(worker=worker(state="D", d_state=True, d_since=NOW - 25,
                                                        wchan="io_schedule")),
     "stalled", "worker", "worker pid 4242 in D state for 25 s (waiting in io_schedule)"),
    ("4-worker-short-d-state-is-no-evidence", lambda: stale(worker=worker(state="D", d_state=True,
                                                                          d_since=NOW - 5)),
     "slow", "", "server answered /health_generate"),
    # a late heartbeat is judged by the CPU time the job's process group used (issue 52: a starved writer on a
    # node at load 50 is late too): frozen only when stopped or with no CPU time over the 20 s window
    ("4-late-heartbeat-no-cpu-for-the-window", lambda: stale(progress_ago=90, written_ago=80,
                                                             worker=worker(cpu=cpu(quiet_s=25, used_s=3.1))),
     "stalled", "worker", "interval 2 s), and its process group (3 processes) used no CPU time for 25 s: frozen"),
    ("4-late-heartbeat-cpu-advancing-is-slow", lambda: stale(progress_ago=90, written_ago=80,
                                                             worker=worker(cpu=cpu(quiet_s=0, used_s=0.42))),
     "slow", "", "but its process group (3 processes) is using CPU (0.42 s of CPU time in the 5.0 s up to "),
    ("4-late-heartbeat-cpu-seen-lately-is-slow", lambda: stale(progress_ago=90, written_ago=80,
                                                               worker=worker(cpu=cpu(quiet_s=12, used_s=0.05))),
     "slow", "", "is using CPU (0.05 s of CPU time in the 5.0 s up to "),
    ("4-late-heartbeat-no-cpu-yet-shorter-than-the-window", lambda: stale(
        progress_ago=90, written_ago=80, worker=worker(cpu=cpu(quiet_s=8))),
     "slow", "", "used no CPU time in the 8 s the watch has read it (frozen only after 20 s without any)"),
    ("4-late-heartbeat-cpu-not-read-proves-nothing", lambda: stale(progress_ago=90, written_ago=80),
     "slow", "", "its CPU time was not read, so that proves nothing"),
    ("4-late-heartbeat-stopped", lambda: stale(progress_ago=90, written_ago=80,
                                               worker=worker(state="T", cpu=cpu(quiet_s=3, used_s=2.0))),
     "stalled", "worker", "worker pid 4242 is stopped (state T"),
    ("4-no-heartbeat-ever", lambda: with_(stale(), heartbeat=None, heartbeat_error="no heartbeat file", stored=5),
     "stalled", "worker", "worker pid 4242 never wrote a heartbeat (no heartbeat file)"),
    ("4-gpus-held-at-zero", lambda: stale(health=ANSWERS, gpu=idle_held_gpus(25)), "stalled", "capture_server",
     "GPUs 0-7 hold 90.1 GB at 0 % for 25 s"),
    ("4-gpus-held-shorter-than-the-window", lambda: stale(gpu=replace(idle_held_gpus(10), busy_now=None)),
     "slow", "", "server answered /health_generate in 0.2 s; request"),
    ("4-no-request-in-flight", lambda: stale(in_flight=[]), "stalled", "worker",
     "the worker has no request in flight"),
    ("4-disk-nearly-full", lambda: with_(stale(), free_bytes=FEW_MB), "stalled", "disk",
     "only 10.5 MB free where the job writes"),
    ("4-a-process-fact-is-the-cause-before-an-inference", lambda: stale(
        health=TIMEOUT, gpu=GpuSignal(applicable=True), worker=worker(state="D", d_state=True, d_since=NOW - 25)),
     "stalled", "worker", "server /health_generate timed out after 20 s"),
    ("4-trainer-slow-within-its-step-limit", lambda: trainer(100), "slow", "", "no step completed for 100 s"),
    ("4-trainer-no-step-past-its-limit", lambda: trainer(401), "stalled", "trainer",
     "no step for 401 s, over the 400 s limit for one step"),
    # the false "STALLED training" (load 47-68 on 2 cores): a starting trainer whose heartbeat writer is
    # starved, while the trainer works
    ("3-trainer-late-heartbeat-cpu-advancing-inside-the-grace", lambda: late_trainer(
        60, started_ago=60, cpu=cpu(quiet_s=1, used_s=4.0)), "starting", "", "slow, not frozen"),
    ("3-trainer-late-heartbeat-no-cpu-inside-the-grace", lambda: late_trainer(
        60, started_ago=60, cpu=cpu(quiet_s=30, used_s=4.0)), "stalled", "worker",
     "inside the startup grace; worker pid 4242 is alive but its heartbeat was last written 40 s"),
    ("3-trainer-stopped-inside-the-grace", lambda: late_trainer(60, started_ago=60, state="T",
                                                                cpu=cpu(quiet_s=1, used_s=4.0)),
     "stalled", "worker", "worker pid 4242 is stopped (state T"),
    ("4-trainer-late-heartbeat-cpu-advancing", lambda: late_trainer(100, cpu=cpu(quiet_s=2, used_s=1.5)),
     "slow", "", "no step completed for 100 s"),
    ("4-trainer-late-heartbeat-no-cpu", lambda: late_trainer(100, cpu=cpu(quiet_s=21, used_s=1.5)),
     "stalled", "worker", "used no CPU time for 21 s: frozen"),
]


@pytest.mark.parametrize("build, verdict, cause, words", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_decision_table(build, verdict, cause, words):
    d = decide(build(), cfg())
    assert (d.verdict, d.cause) == (verdict, cause), d.summary
    assert words in d.summary, d.summary


def test_every_verdict_and_cause_is_reached_by_some_row():
    verdicts = {row[2] for row in TABLE}
    assert verdicts == {"complete", "failed", "dead", "healthy", "starting", "slow", "stalled"}
    assert {row[3] for row in TABLE} == {"", "job", "worker", "capture_server", "disk", "trainer"}


def test_plenty_of_disk_is_named_only_as_context_never_as_evidence():
    d = decide(with_(obs(worker=worker(alive=False)), free_bytes=LOTS), cfg())
    assert d.verdict == "dead" and "1000.0 GB free where the job writes" in d.summary
    assert decide(with_(stale(), free_bytes=LOTS), cfg()).verdict == "slow"


def test_a_late_heartbeat_not_yet_judged_asks_for_the_look_that_closes_its_cpu_window():
    """8 s of the 20 s window seen without CPU: the slow verdict asks for the next look in 12 s, not a poll later."""
    d = decide(stale(progress_ago=90, written_ago=80, worker=worker(cpu=cpu(quiet_s=8))), cfg())
    assert d.verdict == "slow" and d.recheck_in_s == pytest.approx(12.0), d
    assert "worker pid 4242 is alive but its heartbeat was last written 80 s before it was read" in d.summary


def test_a_request_younger_than_its_hung_limit_asks_for_the_look_that_reaches_it():
    """/health_generate answers, GPUs idle, the oldest request 30 s old against this run's 50 s limit: slow, and
    the next look is asked for when the request reaches the limit (issue 52 item 9: the bound counts on it)."""
    o = with_(stale(gpu=GpuSignal(applicable=True),
                    in_flight=[InFlight(id="r7", since=NOW - 30, tokens=100, timeout_s=3000)]),
              pace=Pace(samples=64, gap_p95_s=10.0, request_p95_s=16.0, stale_after_s=30.0, request_limit_s=50.0))
    d = decide(o, cfg())
    assert d.verdict == "slow" and d.recheck_in_s == pytest.approx(20.0, abs=0.01), d.summary
    o.now = NOW + 21
    o.heartbeat_read_at = NOW + 21
    assert decide(o, cfg()).verdict == "stalled"


SLOW_PACE = Pace(samples=64, gap_p95_s=10.0, request_p95_s=16.0, stale_after_s=30.0, request_limit_s=50.0)


def test_a_sigstopped_server_on_a_slow_paced_run_is_stalled_past_stall_after_not_the_pace_threshold():
    """A slow generation run (p95 gap 10 s: stale after 30 s) whose server is SIGSTOPped mid-shard: progress 25 s old
    is past stall_after (20 s), so the stopped server is a stall now, not at 30 s (issue 52: 66.5 s to recovery)."""
    d = decide(with_(obs(progress_ago=25, health=ANSWERS, gpu=busy_gpus(), server=server(state="T")),
                     pace=SLOW_PACE), cfg())
    assert (d.verdict, d.cause) == ("stalled", "capture_server"), d.summary
    assert "server pid 4100 is stopped (state T" in d.summary


def test_a_sigstopped_server_younger_than_stall_after_asks_for_the_look_at_stall_after():
    d = decide(with_(obs(progress_ago=12, health=ANSWERS, gpu=busy_gpus(), server=server(state="T")),
                     pace=SLOW_PACE), cfg())
    assert d.verdict == "healthy" and d.recheck_in_s == pytest.approx(8.0, abs=0.01), d.summary
    assert "so it cannot answer" in d.summary


def test_a_traced_server_on_a_slow_paced_run_waits_for_the_pace_threshold():
    """State t (a debugger or py-spy attached for a moment) is not a SIGSTOP: the run's own pace still rules."""
    d = decide(with_(obs(progress_ago=25, health=ANSWERS, gpu=busy_gpus(), server=server(state="t")),
                     pace=SLOW_PACE), cfg())
    assert d.verdict == "healthy", d.summary

