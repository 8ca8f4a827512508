"""The trainer's in-watch recovery (issue 53): TrainWatchTrigger carries ``recoveries_left`` like a shard's watch
and yields ``recovering`` for a fault the trainer's recovery handles (the trainer stopped, dead or stuck; its store
lost), never for a starved trainer (the producer's fault) or the trainer's own error; TrainDraftOperator then mails
at once, restarts the store or the trainer and watches again with one recovery fewer.

The trigger's real loop and the operator's real handler run on a FakeNode (tests/fixtures/fake_node.py): each look
is the node's ``eagleflow watch --train --json`` answer; the trainer's start, stop and the store's start are the
node commands the operator sends. The mails go through the real renderer to a list (``alerts.send_mail`` patched).
"""
from __future__ import annotations

import importlib
import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from eagleflow.airflow import alerts
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import TrainWatchTrigger, _end_outage
from eagleflow.airflow.train_operators import TrainDraftOperator
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.watchdog.diagnosis import VERDICT_EXIT_CODE, StallDetected, StallDiagnosis
from eagleflow.watchdog.protocol import IncidentClose, PendingMail
from tests.fixtures.fake_node import FakeFleet, FakeNode, Reply, capture_log, reply, task_context
from tests.unit.test_fake_node_shard_watch import first_event

RUN_ID = "manual__2026-12-06T14:00:00+00:00"
NODE = "gpu-node-1"


@pytest.fixture
def run(monkeypatch):
    cfg = load_config(data={"target_model": "/models/t", "run_root": "/data/runs",
                            "node": {"name": NODE, "state_dir": "/data/state"}, "capture": {"shards": 2},
                            "watchdog": {"poll_interval_s": 0.01, "stall_after_s": 0.05, "health_timeout_s": 1,
                                         "alert_emails": ["oncall@example.test"]}})
    node = FakeNode(NODE)
    FakeFleet().install(monkeypatch).add(node)
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, RUN_ID), _node=node)
    ctx.write_run_config()
    yield ctx, node
    _end_outage(NODE)


@pytest.fixture
def mails(monkeypatch):
    sent: list[alerts.Mail] = []
    monkeypatch.setattr(alerts, "send_mail", lambda context, mail: sent.append(mail))
    return sent


def diag(verdict: str, done: int = 12, *, cause: str = "", total: int = 30) -> Reply:
    """What `eagleflow watch --train --json` prints for ``verdict``, with its exit code."""
    d = StallDiagnosis(verdict=verdict, job="training", node=NODE, observed_at=time.time(),
                       headline=f"{done}/{total} steps done ({verdict})", evidence=[f"evidence of {verdict}"],
                       done=done, total=total, cause=cause)
    return reply(d, exit_code=VERDICT_EXIT_CODE[verdict])


def test_the_trainers_watch_round_trips_its_recoveries_and_state_through_serialize(run):
    ctx, _ = run
    close = IncidentClose(kind="stall", id="stall-1796000000.000", subject="s", since=1796000000.0, done=12)
    mail = PendingMail(kind="stall", event={"subject": "[eagleflow] STALLED training on gpu-node-1"}, tries=1,
                       next_at=1796000005.0, error="SMTPDataError: 451")
    t = TrainWatchTrigger(ctx.trigger_ref(), poll_interval_s=2.0, recoveries_left=2, close_incidents=[close],
                          pending_mails=[mail], unreachable_since=1796000001.5)
    path, kwargs = t.serialize()
    assert kwargs["recoveries_left"] == 2 and kwargs["close_incidents"] == [close.to_dict()]
    module, name = path.rsplit(".", 1)
    again = getattr(importlib.import_module(module), name)(**kwargs)
    assert isinstance(again, TrainWatchTrigger) and again.serialize() == (path, kwargs)
    assert again.recoveries_left == 2 and again.close_incidents == [close] and again.pending_mails == [mail]
    # one deferred by a build before the trainer's watch recovered: none left, the try fails as it did
    _, old = TrainWatchTrigger(ctx.trigger_ref()).serialize()
    assert old["recoveries_left"] == 0


@pytest.mark.parametrize("verdict,cause", [("stalled", "worker"), ("dead", "worker"), ("stalled", "trainer"),
                                           ("stalled", "store"), ("failed", "store")])
def test_a_fault_the_trainers_recovery_handles_yields_recovering_without_an_incident(run, verdict, cause):
    ctx, node = run
    node.on("watch", diag("healthy", 10), diag(verdict, 12, cause=cause))
    ev = first_event(TrainWatchTrigger(ctx.serialize(), recoveries_left=2))
    assert ev["status"] == "recovering" and ev["verdict"] == verdict and ev["cause"] == cause
    assert ev["recoveries_left"] == 2 and "incident" not in ev and ev["done"] == 12
    assert ev["subject"] == f"[eagleflow] {verdict.upper()} training on {NODE}"
    assert node.commands("recover") == []          # one trainer per run: no incident book on the node


@pytest.mark.parametrize("verdict,cause,left", [("failed", "producer", 2), ("failed", "job", 2), ("failed", "disk", 2),
                                                ("stalled", "worker", 0), ("dead", "worker", 0)])
def test_a_starved_trainer_its_own_error_or_no_recoveries_left_fails_the_task(run, verdict, cause, left):
    ctx, node = run
    node.on("watch", diag("slow", 10, cause="producer"), diag(verdict, 10, cause=cause))
    ev = first_event(TrainWatchTrigger(ctx.serialize(), recoveries_left=left))
    assert ev["status"] == verdict and ev["cause"] == cause   # the task fails with it: Airflow's retry recovers
    assert len(node.commands("watch")) == 2        # the starved look (slow) was watched on, not recovered


def _trainer(ctx, node):
    return node.add_process(str(ctx.layout.pid_file("trainer")), "trainer")


def test_a_dead_trainer_is_mailed_at_once_restarted_and_watched_again_with_one_recovery_fewer(run, mails):
    ctx, node = run
    old = _trainer(ctx, node)
    op = TrainDraftOperator(task_id="train_draft", deferrable=True)
    log = capture_log(op)
    context = task_context(ctx, op)
    with pytest.raises(TaskDeferred) as d:
        op.run(ctx, context)
    first = d.value.trigger
    assert isinstance(first, TrainWatchTrigger) and first.recoveries_left == ctx.cfg.watchdog.train_recoveries_in_watch
    node.processes[old.pid_file].alive = False      # the trainer killed: the watch's look says dead
    node.on("watch", diag("dead", 12, cause="worker"))
    event = first_event(first)
    assert event["status"] == "recovering"
    with pytest.raises(TaskDeferred) as again:
        op.execute_complete(context, event)
    (mail,) = mails
    assert mail.subject == f"[eagleflow] STALLED training on {NODE} (dead: worker)"
    assert "evidence of dead" in mail.evidence and "incident" not in mail.evidence
    assert "same task try" in mail.next_step and "last checkpoint" in mail.next_step
    # the recovery: the dead trainer's record stopped, a new trainer started (it resumes from its checkpoint)
    (stop,) = node.commands(("process_record", "stop"))
    assert stop.option("--pid-file") == str(ctx.layout.pid_file("trainer"))
    trainers = [r for r in node.spawned if r.role == "trainer"]
    assert len(trainers) == 1 and trainers[0].pid != old.pid and node.commands(("store", "start")) == []
    nxt = again.value.trigger
    assert isinstance(nxt, TrainWatchTrigger) and nxt.recoveries_left == first.recoveries_left - 1
    (close,) = nxt.close_incidents       # RECOVERED is mailed once training passes the step it stalled at
    assert close.kind == "stall" and close.done == 12 and close.subject == mail.subject
    assert mail.headers["Message-ID"] == alerts.incident_thread(close.id)
    assert "recovering in the watch (1 left after this)" in log.text("warning")


def test_a_stalled_trainer_whose_store_is_lost_gets_the_store_restarted_and_is_kept(run, mails):
    ctx, node = run
    live = _trainer(ctx, node)
    node.on(("store", "start"), {"store": "mooncake", "store_id": "s2", "attached": False})
    node.on(("reconcile", "claim"), {"action": "none", "reason": "no worker needed"})
    op = TrainDraftOperator(task_id="train_draft", deferrable=True)
    context = task_context(ctx, op)
    node.on("watch", diag("stalled", 7, cause="store"))
    event = first_event(TrainWatchTrigger(ctx.serialize(), recoveries_left=1))
    with pytest.raises(TaskDeferred) as again:
        op.execute_complete(context, event)
    assert [m.subject for m in mails] == [f"[eagleflow] STALLED training on {NODE}"]
    assert len(node.commands(("store", "start"))) == 1 and len(node.commands(("reconcile", "claim"))) == 2
    assert node.commands(("process_record", "stop")) == [] and node.processes[live.pid_file].alive
    assert not [r for r in node.spawned if r.role == "trainer"]     # attached to the one taking up the new store
    assert again.value.trigger.recoveries_left == 0


def test_the_last_recovery_spent_the_next_fault_fails_the_try_for_airflows_retry(run, mails):
    ctx, node = run
    _trainer(ctx, node)
    node.on("watch", diag("stalled", 12, cause="worker"))
    op = TrainDraftOperator(task_id="train_draft", deferrable=True)
    event = first_event(TrainWatchTrigger(ctx.serialize(), recoveries_left=0))
    with pytest.raises(StallDetected) as e:
        op.execute_complete(task_context(ctx, op), event)
    assert e.value.subject == f"[eagleflow] STALLED training on {NODE}" and mails == []   # the task's callbacks mail
    assert node.commands(("process_record", "stop")) == [] and node.spawned == []
