"""The sentinel beside a detached job: the look log, one alarm when looks stop, none while they go on, exit with
the job; the real detached sentinel mails through a real SMTP server and is recorded and stoppable."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.phases.extract.lifecycle import ensure_sentinel
from eagleflow.local_run import LocalRun
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from eagleflow.nodes.process_record import read_record
from eagleflow.watchdog.sentinel import (SILENT_POLLS, Sentinel, alarm_path, last_look, looks_path, record_look,
                                        sentinel_role)
from eagleflow.watchdog.signals import WatchedJob
from tests.fixtures.processes import alive
from tests.fixtures.waiting import wait_until
from tests.fixtures.watchdog_jobs import kill_group, spawn_sleeper, wait_gone, watch_config

JOB = WatchedJob(shard=1, num_shards=4)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup(tmp_path):
    cfg = watch_config(tmp_path, poll_interval_s=10)
    layout = RunLayout.for_run(cfg, "run1")
    return cfg, layout


def _sentinel(cfg, layout, clock, running=lambda: True):
    mails: list[tuple[str, str]] = []
    s = Sentinel(cfg, layout, JOB, worker_alive=running, clock=clock,
                 mailer=lambda subj, body: mails.append((subj, body)) or "", log=lambda m: None)
    return s, mails


def _alarm(layout) -> dict:
    return json.loads(Path(alarm_path(layout, JOB)).read_text())


def test_no_look_for_three_intervals_alarms_once_naming_job_and_last_look(setup):
    cfg, layout = setup
    clock = Clock(1000.0)
    record_look(looks_path(layout, JOB), {"at": 1000.0, "by": "watch", "pid": 4242, "verdict": "healthy",
                                          "summary": "shard 1/4 healthy: 10/100"})
    s, mails = _sentinel(cfg, layout, clock)
    for t in range(1000, 1000 + SILENT_POLLS * 10, 2):     # just under 3 intervals: quiet
        clock.t = float(t)
        assert s.check()
    assert mails == [] and not os.path.exists(alarm_path(layout, JOB))
    for t in range(1030, 1200, 2):                          # past it: one alarm, however long the silence lasts
        clock.t = float(t)
        assert s.check()
    assert len(mails) == 1
    subject, body = mails[0]
    assert "WATCH SILENT shard 1/4 of run run1 on test-node" in subject and "no look for 30 s" in subject
    assert "last look at" in body and "pid 4242" in body and "shard 1/4 healthy: 10/100" in body
    rec = _alarm(layout)
    assert rec["state"] == "raised" and rec["role"] == "worker_shard_00001" and rec["job"] == "shard 1/4"
    assert rec["last_look"]["at"] == 1000.0 and rec["mailed"] is True and rec["raised_at"] == 1030.0


def test_looks_going_on_never_alarm(setup):
    cfg, layout = setup
    clock = Clock(1000.0)
    s, mails = _sentinel(cfg, layout, clock)
    for t in range(1000, 1600, 2):
        clock.t = float(t)
        if t % 20 == 0:   # a look every 2 intervals (a slow poll): still watched
            record_look(looks_path(layout, JOB), {"at": float(t), "by": "watch", "pid": 1})
        assert s.check()
    assert mails == [] and not os.path.exists(alarm_path(layout, JOB))


def test_a_watch_slower_than_its_poll_interval_is_judged_by_its_own_pace(setup):
    cfg, layout = setup                      # poll 10 s, but each look lands 25 s after the one before
    clock = Clock(1000.0)
    s, mails = _sentinel(cfg, layout, clock)
    for i in range(6):
        record_look(looks_path(layout, JOB), {"at": 1000.0 + 25 * i, "by": "watch", "pid": 1})
    last = 1125.0
    for t in range(1126, int(last + 3 * 25), 2):   # past 3 poll intervals, within 3 of its pace: quiet
        clock.t = float(t)
        s.check()
    assert mails == []
    clock.t = last + 3 * 25
    s.check()
    assert len(mails) == 1 and "3 poll intervals of 25 s, the watch's own pace (poll_interval_s 10 s)" in mails[0][1]


def test_a_recovery_look_covers_its_own_bound(setup):
    cfg, layout = setup
    clock = Clock(1000.0)
    record_look(looks_path(layout, JOB), {"at": 1000.0, "by": "recover", "pid": 1, "until": 1500.0})
    s, mails = _sentinel(cfg, layout, clock)
    for t in range(1000, 1500, 5):
        clock.t = float(t)
        assert s.check()
    assert mails == []
    clock.t = 1500.0
    s.check()
    assert len(mails) == 1


def test_looks_coming_back_clear_the_alarm_and_rearm(setup):
    cfg, layout = setup
    clock = Clock(1000.0)
    s, mails = _sentinel(cfg, layout, clock)
    clock.t = 1059.0                                # never looked at: 3 intervals after the first look's grace
    s.check()
    assert mails == []
    clock.t = 1060.0
    s.check()
    assert len(mails) == 1 and "no look recorded since the sentinel started" in mails[0][1]
    record_look(looks_path(layout, JOB), {"at": 1070.0, "by": "watch", "pid": 1})
    clock.t = 1071.0
    s.check()
    assert _alarm(layout)["state"] == "cleared" and "WATCH BACK" in mails[1][0]
    clock.t = 1100.0                                # silent again for 3 intervals: a new alarm
    s.check()
    assert len(mails) == 3 and "WATCH SILENT" in mails[2][0] and _alarm(layout)["state"] == "raised"


def test_job_end_stops_the_check_and_closes_a_raised_alarm(setup):
    cfg, layout = setup
    clock = Clock(1000.0)
    running = [True]
    s, mails = _sentinel(cfg, layout, clock, running=lambda: running[0])
    clock.t = 1100.0
    assert s.check() and _alarm(layout)["state"] == "raised"
    running[0] = False
    assert not s.check()
    s.end()
    assert _alarm(layout)["state"] == "ended" and len(mails) == 1


def test_look_log_is_bounded_and_last_look_survives_the_move(tmp_path):
    path = str(tmp_path / "watch" / "run1.worker_shard_00001.looks.jsonl")
    for i in range(200):
        record_look(path, {"at": float(i), "by": "watch", "pid": 1, "summary": "x" * 40}, max_bytes=2000)
    assert os.path.getsize(path) <= 2000 and os.path.getsize(path + ".1") <= 2000
    assert last_look(path)["at"] == 199.0
    os.replace(path, path + ".1")            # just moved, nothing new yet: the older file still tells
    assert last_look(path)["at"] == 199.0
    with open(path + ".1", "a") as f:
        f.write('{"at": 300.0, "by": "wat')   # cut mid-line by a crash: the line before is the last look
    assert last_look(path)["at"] == 199.0


@pytest.mark.slow
def test_the_watch_command_records_each_look(tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "model"),
        "node": {"name": "test-node", "has_gpu": False, "state_dir": str(tmp_path / "state")},
        "capture": {"shards": 2}, "watchdog": {"poll_interval_s": 1}}))
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "eagleflow.cli", "watch", "--config", str(cfg_path),
                            "--run-id", "r1", "--shard", "1", "--json"], capture_output=True, text=True, timeout=60)
        assert p.returncode in (0, 3, 4, 5, 6), p.stderr
    from eagleflow.config import load_config
    layout = RunLayout.for_run(load_config(str(cfg_path)), "r1")
    lines = Path(looks_path(layout, WatchedJob(shard=1, num_shards=2))).read_text().splitlines()
    assert len(lines) == 2
    look = json.loads(lines[-1])
    assert look["by"] == "watch" and look["pid"] > 1 and look["verdict"] and look["at"] <= time.time()


def _run_config(tmp_path, **wd) -> tuple[LocalRun, Path]:
    data = {"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "model"),
            "node": {"name": "test-node", "has_gpu": False, "state_dir": str(tmp_path / "state")},
            "capture": {"shards": 2}, "watchdog": {"poll_interval_s": 1, "health_timeout_s": 0.5, **wd}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    from eagleflow.config import load_config
    cfg = load_config(str(path))
    return LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, "r1"), config_path=str(path)), path


@pytest.mark.slow
def test_detached_sentinel_mails_from_the_node_and_exits_with_the_job(tmp_path):
    from tests.fixtures.smtp import SmtpSink
    with SmtpSink() as smtp:
        run, _ = _run_config(tmp_path, node_smtp=f"127.0.0.1:{smtp.port}", alert_emails=["ops@example.test"])
        job = WatchedJob(shard=1, num_shards=2)
        worker = spawn_sleeper(run.layout, job.role)
        try:
            record_look(looks_path(run.layout, job), {"at": time.time(), "by": "watch", "pid": 7, "summary": "ok"})
            rec = ensure_sentinel(run, 1)
            assert rec is not None and rec.role == sentinel_role(job)
            assert read_record(str(run.layout.pid_file(sentinel_role(job)))).pid == rec.pid   # recorded
            assert ensure_sentinel(run, 1) is None    # one per shard: the lock holds
            t0 = time.time()
            msg = smtp.wait_for(lambda m: "WATCH SILENT" in m["Subject"], timeout_s=15)
            waited = time.time() - t0
            assert "shard 1/2 of run r1 on test-node" in msg["Subject"] and "last look at" in msg.get_content()
            # 3 intervals of 1 s, but never under one interval plus the longest look (0.5 s health + 2 x 2 s)
            assert waited <= 1 + 4.5 + 2.5, waited
            # the alarm is written once the mail's outcome is known (it records "mailed"): just after the mail
            wait_until(lambda: Path(alarm_path(run.layout, job)).is_file(), 5, what="the sentinel's alarm file")
            assert json.loads(Path(alarm_path(run.layout, job)).read_text())["state"] == "raised"
            time.sleep(2)
            assert len([m for m in smtp.messages if "WATCH SILENT" in m["Subject"]]) == 1   # once
            kill_group(worker.pgid)                   # the job ends: the sentinel follows
            wait_gone(rec.pid, timeout_s=15)
            assert json.loads(Path(alarm_path(run.layout, job)).read_text())["state"] == "ended"
        finally:
            kill_group(worker.pgid)


@pytest.mark.slow
def test_detached_sentinel_is_stopped_like_the_worker_and_signals_nothing_itself(tmp_path):
    run, _ = _run_config(tmp_path)
    job = WatchedJob(shard=0, num_shards=2)
    worker = spawn_sleeper(run.layout, job.role)
    try:
        record_look(looks_path(run.layout, job), {"at": time.time(), "by": "watch", "pid": 7})
        rec = ensure_sentinel(run, 0)
        time.sleep(7.5)                      # silent past its bound (5.5 s): an alarm, no mail configured
        a = json.loads(Path(alarm_path(run.layout, job)).read_text())
        assert a["state"] == "raised" and not a["mailed"] and "watchdog.node_smtp" in a["mail_error"]
        assert alive(worker.pid)             # the sentinel never signals the job
        res = LocalNode(name="test-node").stop_recorded(str(run.layout.pid_file(sentinel_role(job))), grace_s=5)
        assert res.outcome == "terminated", res
        wait_gone(rec.pid, timeout_s=5)
        assert alive(worker.pid)
    finally:
        kill_group(worker.pgid)


def test_each_watched_job_names_its_sentinel_as_the_watch_names_the_job():
    from eagleflow.watchdog.sentinel import sentinel_args
    assert sentinel_args(WatchedJob(shard=3, num_shards=4)) == ["sentinel", "--shard", "3", "--phase", "extract"]
    assert sentinel_args(WatchedJob(shard=3, num_shards=4, phase="generate")) == ["sentinel", "--shard", "3",
                                                                                  "--phase", "generate"]
    assert sentinel_args(WatchedJob(shard=None)) == ["sentinel", "--train"]
    assert sentinel_role(WatchedJob(shard=None)) == "sentinel_trainer"
    assert sentinel_role(WatchedJob(shard=2, num_shards=4, phase="generate")) == "sentinel_generate_shard_00002"


@pytest.mark.slow
@pytest.mark.parametrize("job", [WatchedJob(shard=None), WatchedJob(shard=0, num_shards=1, phase="generate")],
                         ids=["trainer", "generate-shard"])
def test_the_trainer_and_a_generation_shard_get_a_detached_sentinel_that_alarms_and_ends_with_them(tmp_path, job):
    from eagleflow.watchdog.sentinel import ensure_sentinel as start
    run, _ = _run_config(tmp_path)
    worker = spawn_sleeper(run.layout, job.role)
    try:
        record_look(looks_path(run.layout, job), {"at": time.time(), "by": "watch", "pid": 7})
        rec = start(run, job)
        assert rec is not None and read_record(str(run.layout.pid_file(sentinel_role(job)))).pid == rec.pid
        assert start(run, job) is None                     # one per job: the lock holds
        deadline = time.time() + 15
        while not Path(alarm_path(run.layout, job)).exists():
            assert time.time() < deadline, "no alarm within 15 s of silence"
            time.sleep(0.2)
        a = json.loads(Path(alarm_path(run.layout, job)).read_text())
        assert a["state"] == "raised" and a["role"] == job.role and a["job"] == job.name
        kill_group(worker.pgid)                            # the job ends: the sentinel follows
        wait_gone(rec.pid, timeout_s=15)
        assert json.loads(Path(alarm_path(run.layout, job)).read_text())["state"] == "ended"
    finally:
        kill_group(worker.pgid)


def test_looks_left_by_an_earlier_try_do_not_make_a_new_sentinel_alarm_at_once(setup):
    """The look log outlives a try: a sentinel started for a retry (or a reconcile rerun) 310 s after the last
    look gives the new watch its first-look grace instead of mailing WATCH SILENT at its first check."""
    cfg, layout = setup
    for t in (650.0, 670.0, 690.0):
        record_look(looks_path(layout, JOB), {"at": t, "by": "watch", "pid": 1})
    clock = Clock(1000.0)
    s, mails = _sentinel(cfg, layout, clock)
    for t in range(1000, 1059, 2):          # grace 30 s + 3 intervals of 10 s
        clock.t = float(t)
        assert s.check()
    assert mails == []
    record_look(looks_path(layout, JOB), {"at": 1050.0, "by": "watch", "pid": 2})   # the new watch looks
    for t in range(1060, 1079, 2):
        clock.t = float(t)
        s.check()
    assert mails == []
    clock.t = 1080.0                        # then falls silent: 3 intervals after its own last look
    s.check()
    assert len(mails) == 1 and "pid 2" in mails[0][1]


def test_the_last_tries_failed_heartbeat_does_not_end_the_sentinel_of_a_new_worker(setup):
    from eagleflow.heartbeat import Heartbeat
    cfg, layout = setup
    hb_path = JOB.heartbeat_path(layout)
    Path(hb_path).parent.mkdir(parents=True, exist_ok=True)
    Path(hb_path).write_text(Heartbeat(job="extract shard 1/4", pid=111, state="failed", time=900.0,
                                       started_at=800.0).to_json())
    s = Sentinel(cfg, layout, JOB, worker_alive=lambda: True, worker_pid=lambda: 222, clock=Clock(1000.0),
                 mailer=lambda subj, body: "", log=lambda m: None)
    assert s.check()                        # pid 222 runs; the "failed" was pid 111's
    ended = Sentinel(cfg, layout, JOB, worker_alive=lambda: True, worker_pid=lambda: 111, clock=Clock(1000.0),
                     mailer=lambda subj, body: "", log=lambda m: None)
    assert not ended.check()                # its own worker said failed: the job ended


def test_looks_since_the_recorded_worker_started_count_even_from_before_the_sentinel(setup):
    """A sentinel (re)started beside a running worker takes that worker's looks; an earlier worker's do not."""
    cfg, layout = setup
    record_look(looks_path(layout, JOB), {"at": 900.0, "by": "watch", "pid": 1})     # the last try's worker
    record_look(looks_path(layout, JOB), {"at": 995.0, "by": "watch", "pid": 2})     # this worker's watch
    clock = Clock(1000.0)
    mails: list = []
    s = Sentinel(cfg, layout, JOB, worker_alive=lambda: True, worker_started_at=lambda: 950.0, clock=clock,
                 mailer=lambda subj, body: mails.append(subj) or "", log=lambda m: None)
    clock.t = 1024.0
    s.check()
    assert mails == []
    clock.t = 1025.0                         # 3 intervals of 10 s after this worker's last look at 995
    s.check()
    assert len(mails) == 1 and "no look for 30 s" in mails[0]
