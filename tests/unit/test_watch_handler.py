"""The one handler of watch events (eagleflow.airflow.watch_handler): what each event kind leads to, the watch
state handed to the next watch (recoveries_left only when the event names it), and the one loop.
No mail is due in these events (mails and their wording: tests/integration/test_watchdog_mail.py)."""
from __future__ import annotations

import logging

import pytest

from eagleflow.airflow.watch_handler import follow_event, watch_to_the_end
from eagleflow.watchdog.protocol import (Complete, IncidentClose, JobVerdict, MailDue, OpenIncident, Recovering,
                                         Resumed, Unreachable, WatchState)

LOG = logging.getLogger("test_watch_handler")
CLOSE = IncidentClose(kind="stall", id="i1", subject="s", since=5.0, done=3)


@pytest.fixture
def ctx(tmp_path):
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.layout import RunLayout
    from tests.fixtures.watchdog_jobs import watch_config
    cfg = watch_config(tmp_path)
    c = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "manual__2026-12-02T01:00:00+00:00"))
    c.write_run_config()
    return c


def _follow(ctx, event, recover=None):
    calls = []
    out = follow_event(event.to_dict(), ctx=ctx, context={}, log=LOG, recover=recover,
                       rewatch=lambda **kw: calls.append(kw) or ("watch", kw))
    return out, calls


def test_final_events_end_the_watch(ctx):
    for ev in (Complete(summary="done"), JobVerdict(status="dead", verdict="dead", diagnosis="d", subject="s")):
        out, calls = _follow(ctx, ev)
        assert out == ev and calls == []


def test_an_outage_is_watched_again_from_its_start_with_the_shards_recoveries(ctx):
    state = WatchState(close_incidents=(CLOSE,), recoveries_left=2)
    out, [kw] = _follow(ctx, Unreachable(since=100.0, diagnosis="d", subject="s", mail=False, state=state))
    assert kw == {"run": ctx.serialize(), "unreachable_since": 100.0, "close_incidents": [CLOSE],
                  "pending_mails": [], "recoveries_left": 2}


def test_an_event_naming_no_recoveries_hands_none_to_the_next_watch(ctx):
    _, [kw] = _follow(ctx, MailDue(unreachable_since=None, clocks={"outage_started": 7.0},
                                   state=WatchState(close_incidents=(CLOSE,))))
    assert kw == {"run": ctx.trigger_ref(), "close_incidents": [CLOSE], "unreachable_since": None,
                  "clocks": {"outage_started": 7.0}, "pending_mails": []}


def test_resumed_without_a_closed_incident_watches_on_with_the_rest(ctx):
    _, [kw] = _follow(ctx, Resumed(closed=(), still_open=(CLOSE,), state=WatchState(recoveries_left=0)))
    assert kw["close_incidents"] == [CLOSE] and kw["recoveries_left"] == 0


def test_a_recoverable_stall_recovers_then_watches_with_one_recovery_less(ctx):
    ev = Recovering(verdict="stalled", diagnosis="d", subject="s", cause="worker",
                    incident=OpenIncident(incident="i2", opened=False), state=WatchState(recoveries_left=1))
    seen = []

    def recover(raw, pending):
        seen.append(raw)
        return 0, IncidentClose(kind="stall", id="i2"), pending
    _, [kw] = _follow(ctx, ev, recover=recover)
    assert seen[0]["incident"]["incident"] == "i2" and seen[0]["status"] == "recovering"
    assert kw["recoveries_left"] == 0 and kw["close_incidents"] == [IncidentClose(kind="stall", id="i2")]
    out, calls = _follow(ctx, ev)          # a job without in-watch recovery fails with the stall
    assert out == ev and calls == []


def test_the_one_loop_follows_events_until_the_final_one():
    class Op:
        deferrable = False
    events = iter([MailDue().to_dict(), Complete(summary="ok").to_dict()])
    steps = []

    def follow(ev):
        steps.append(ev["status"])
        return "trigger" if ev["status"] == "mail_due" else Complete(summary=ev["summary"])
    import eagleflow.airflow.watch_handler as wh
    real, wh.run_trigger_here = wh.run_trigger_here, lambda trigger: next(events)
    try:
        assert watch_to_the_end(Op(), {}, "trigger", follow) == Complete(summary="ok")
    finally:
        wh.run_trigger_here = real
    assert steps == ["mail_due", "complete"]
