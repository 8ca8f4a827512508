"""The shard watch's unreachable bookkeeping: bounded reconnect backoff, one mail per node outage, and the
``unreachable_since`` a re-deferred watch carries (round-tripped by serialize, as the triggerer rebuilds it)."""
from __future__ import annotations

import pytest

from eagleflow.airflow.shard_watch import (ShardWatchTrigger, TrainWatchTrigger, _claim_outage, _end_outage,
                                           reconnect_delay_s)

RUN = {"conn_id": "gpu_node", "run_config": "/runs/r1/run-config.json", "run_id": "r1"}


def test_reconnect_backoff_doubles_and_is_capped_by_the_poll_interval():
    top = [reconnect_delay_s(n, 20.0, jitter=lambda: 1.0) for n in range(1, 8)]
    assert top == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 20.0]
    assert [reconnect_delay_s(n, 20.0, jitter=lambda: 0.0) for n in range(1, 8)] == [d / 2 for d in top]
    assert reconnect_delay_s(50, 1.0, jitter=lambda: 1.0) == 1.0


def test_watches_that_lose_one_node_together_reconnect_at_different_moments():
    delays = [reconnect_delay_s(4, 20.0) for _ in range(8)]    # eight shard watches, fourth miss each
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert len(set(delays)) == 8


def test_one_mail_per_node_outage():
    assert _claim_outage("gpu_node/gpu-node-1", 100.0) is True
    assert _claim_outage("gpu_node/gpu-node-1", 101.0) is False      # a second shard of the same outage
    assert _claim_outage("gpu_node/gpu-node-2", 101.0) is True       # another node
    _end_outage("gpu_node/gpu-node-1")                               # a watch reached it again
    assert _claim_outage("gpu_node/gpu-node-1", 200.0) is True       # a later outage mails again
    _end_outage("gpu_node/gpu-node-1")
    _end_outage("gpu_node/gpu-node-2")


def test_unreachable_since_round_trips_and_is_absent_when_unset():
    t = ShardWatchTrigger(RUN, 3, poll_interval_s=2.0, recoveries_left=1, unreachable_since=1796098578.25)
    path, kw = t.serialize()
    assert kw["unreachable_since"] == 1796098578.25
    assert ShardWatchTrigger(**kw).serialize() == (path, kw)
    assert "unreachable_since" not in ShardWatchTrigger(RUN, 3).serialize()[1]
    tpath, tkw = TrainWatchTrigger(RUN, unreachable_since=5.0).serialize()
    assert tkw["unreachable_since"] == 5.0 and TrainWatchTrigger(**tkw).serialize() == (tpath, tkw)


@pytest.mark.slow   # waits out a 4 s unreachable bound
def test_a_due_mail_does_not_restart_the_clock_of_an_outage_not_yet_reported(tmp_path, monkeypatch):
    """The watch re-defers to send a refused mail again mid-outage; the next watch goes on from the outage's
    start (the unreachable verdict comes at start + bound, not at re-deferral + bound) and says that start."""
    import asyncio
    import time

    from eagleflow.airflow.runtime import RunContext
    from eagleflow.layout import RunLayout
    from eagleflow.nodes.base import NodeUnreachable
    from tests.fixtures.watchdog_jobs import watch_config

    cfg = watch_config(tmp_path)          # bound: stall_after_s 3 + 2 x poll 0.5 = 4 s
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "manual__2026-12-02T01:00:00+00:00"))
    ctx.write_run_config()

    async def silent(self, ctx):
        raise NodeUnreachable("no route to host")
    monkeypatch.setattr(ShardWatchTrigger, "_observe_async", silent)

    async def first(trigger):
        agen = trigger.run()
        try:
            return (await asyncio.wait_for(agen.__anext__(), 20)).payload
        finally:
            await agen.aclose()

    started = time.time()
    mail = {"kind": "stall", "event": {"subject": "[eagleflow] STALLED shard 0/4"}, "next_at": started + 1.5}
    due = asyncio.run(first(ShardWatchTrigger(ctx.serialize(), 0, pending_mails=[mail])))
    assert due["status"] == "mail_due" and due["unreachable_since"] is None       # not reported yet
    assert started - 0.1 <= due["clocks"]["outage_started"] <= started + 1.0
    again = ShardWatchTrigger(ctx.serialize(), 0, unreachable_since=due["unreachable_since"], clocks=due["clocks"])
    assert ShardWatchTrigger(**again.serialize()[1]).clocks == due["clocks"]      # as the triggerer rebuilds it
    ev = asyncio.run(first(again))
    from eagleflow.airflow.shard_watch import _OUTAGES
    for key in list(_OUTAGES):      # this test's outage claim, so later tests mail theirs
        _end_outage(key)
    assert ev["status"] == "unreachable" and ev["since"] == due["clocks"]["outage_started"]
    assert time.time() - started < 4.0 + 1.5 + 1.0     # the bound from the outage's start, not 1.5 s + bound


@pytest.mark.slow   # waits out a 4 s unreachable bound
def test_a_watch_started_while_its_node_is_unreachable_reports_by_the_same_bound_and_words(tmp_path, monkeypatch):
    """The triggerer may start a shard's watch after the node went away (the cable pulled between the task's
    deferral and the triggerer picking the watch up): the watch cannot read the run's config there, yet it
    reports the outage at the run's bound (stall_after 3 + 2 x poll 0.5 = 4 s, not 60 s) and names the node
    and the job as a watch that had read the config does; the real SSH connect to a port nobody serves."""
    import asyncio
    import time

    from eagleflow.airflow.deploy.standalone import free_port
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.airflow.shard_watch import _OUTAGES, EARLY_UNREACHABLE_S
    from eagleflow.layout import RunLayout
    from tests.fixtures.watchdog_jobs import watch_config

    cfg = watch_config(tmp_path)
    cfg.node.conn_id = "ef_gone_node"
    monkeypatch.setenv("AIRFLOW_CONN_EF_GONE_NODE", f"ssh://nobody@127.0.0.1:{free_port()}")
    payload = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "manual__2026-12-03T01:00:00+00:00")).serialize()

    async def first(trigger):
        agen = trigger.run()
        try:
            return (await asyncio.wait_for(agen.__anext__(), 30)).payload
        finally:
            await agen.aclose()

    for key in list(_OUTAGES):
        _end_outage(key)
    started = time.time()
    ev = asyncio.run(first(ShardWatchTrigger(**ShardWatchTrigger(payload, 1).serialize()[1])))
    took = time.time() - started
    for key in list(_OUTAGES):
        _end_outage(key)
    assert ev["status"] == "unreachable" and ev["mail"] is True, ev
    assert ev["subject"] == "[eagleflow] UNREACHABLE shard 1/4 on test-node", ev
    assert "ef_gone_node" in ev["diagnosis"] and "not a verdict on the job" in ev["diagnosis"], ev
    assert started - 0.1 <= ev["since"] <= started + 1.0
    assert 4.0 <= took < 4.0 + 2.0, took
    # a generation shard's watch names its job by the generation count; a payload from before the hints
    # were carried keeps the old bound and says only what it knows
    assert ShardWatchTrigger(payload, 2, phase="generate")._job_name() == "generate shard 2/1"
    again = ShardWatchTrigger(**ShardWatchTrigger(payload, 2, phase="generate").serialize()[1])
    assert again.phase == "generate" and again._watch_args() == ["--shard", "2", "--phase", "generate"]
    old = {k: v for k, v in payload.items() if k != "watch"}
    assert ShardWatchTrigger(old, 1)._early_bound_s() == EARLY_UNREACHABLE_S
    assert ShardWatchTrigger(old, 1)._job_name() == "shard 1"
    assert ShardWatchTrigger(payload, 1, poll_interval_s=2.0)._early_bound_s() == 3.0 + 2 * 2.0
