"""The watch's protocol (eagleflow.watchdog.protocol): each event round-trips through the plain-value payload
Airflow stores, a payload of another release (unknown keys, missing optional ones) still parses, the one
unreachable builder says each case, and next_step maps every kind to what the operator does."""
from __future__ import annotations

import json

import pytest

from eagleflow.watchdog.protocol import (Complete, IncidentClose, JobVerdict, MailDue, OpenIncident, PendingMail,
                                         Recovering, Resumed, Unreachable, WatchState, next_step, parse_event,
                                         unreachable_event)

STALL = IncidentClose(kind="stall", id="i1", subject="[eagleflow] STALLED shard 0/2", since=5.0, done=3)
STATE = WatchState(close_incidents=(STALL,),
                   pending_mails=(PendingMail(kind="over", event={"job": "shard 0/2", "done": 4}, close=STALL,
                                              next_at=9.0, tries=1, error="SMTPDataError: 451"),), recoveries_left=1)

EVENTS = [
    Complete(summary="COMPLETE shard 0/2", detected_at=10.0, state=STATE),
    JobVerdict(status="dead", verdict="dead", diagnosis="DEAD shard 0/2", subject="[eagleflow] DEAD shard 0/2",
               cause="worker", observed_at=4.0, job="shard 0/2", node="n1", done=3, total=9, state=STATE),
    Recovering(verdict="stalled", diagnosis="d", subject="s", cause="capture_server", done=3, total=9,
               incident=OpenIncident(incident="n1-capture_server-x", opened=True, incident_shards=("0", "1"),
                                     shards={"0": "3/9"}), state=STATE),
    Unreachable(since=100.0, diagnosis="d", subject="s", mail=True, state=STATE),
    Resumed(closed=(IncidentClose(kind="outage", id="o", since=2.0),), still_open=(STALL,), done=4, total=9, observed_at=11.0, job="j",
            node="n1", summary="HEALTHY", state=STATE),
    MailDue(unreachable_since=None, clocks={"outage_started": 7.5}, state=STATE),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_each_event_round_trips_through_a_json_payload(event):
    payload = json.loads(json.dumps(event.to_dict()))    # what the triggerer stores and hands back
    assert parse_event(payload) == event
    assert payload["status"] == event.kind
    assert payload["close_incidents"] == [{"kind": "stall", "id": "i1", "subject": "[eagleflow] STALLED shard 0/2",
                                           "since": 5.0, "done": 3}]


def test_a_payload_of_another_release_parses():
    ev = parse_event({"status": "stalled", "verdict": "stalled", "diagnosis": "x", "subject": "y", "cause": "worker",
                      "from_a_newer_node": [1, 2]})
    assert isinstance(ev, JobVerdict) and ev.cause == "worker" and ev.state == WatchState()
    bare = parse_event({"status": "recovering", "verdict": "stalled", "diagnosis": "x", "subject": "y",
                        "incident": {"incident": "i", "opened": False, "extra": 1}, "recoveries_left": "2"})
    assert isinstance(bare, Recovering) and bare.incident.incident == "i" and bare.state.recoveries_left == 2
    odd = parse_event({"status": "exploded"})
    assert isinstance(odd, JobVerdict) and odd.status == "failed" and "exploded" in odd.diagnosis
    assert parse_event(None).status == "failed"


def test_the_one_unreachable_builder():
    silent = unreachable_event(job="shard 1/4", since=100.0, error="no route", state=STATE, node="n1", conn_id="c",
                               last_contact=90.0, mail=True, now=160.0)
    assert isinstance(silent, Unreachable) and silent.mail and silent.since == 100.0
    assert silent.subject == "[eagleflow] UNREACHABLE shard 1/4 on n1" and "(60 s; last answer at" in silent.diagnosis
    early = unreachable_event(job="shard 1", since=100.0, error="e", state=STATE, conn_id="c", run_id="r", now=170.0)
    assert isinstance(early, Unreachable) and early.subject == "[eagleflow] UNREACHABLE shard 1 over c"
    assert "could not read the run's config" in early.diagnosis and "run r" in early.diagnosis
    gave_up = unreachable_event(job="training", since=0.0, error="e", state=STATE, node="n1", conn_id="c",
                                gave_up_after_s=6 * 3600, now=7 * 3600)
    assert isinstance(gave_up, JobVerdict) and (gave_up.status, gave_up.verdict) == ("failed", "unreachable")
    assert gave_up.diagnosis.endswith("Gave up after 6 h.")
    failing = unreachable_event(job="training", since=0.0, error="exit 127", state=STATE, node="n1", conn_id="c",
                                command_failing_s=41.0)
    assert failing.status == "failed" and "the watch command has failed for 41 s" in failing.diagnosis
    assert failing.to_dict()["pending_mails"] == [STATE.pending_mails[0].to_dict()]


def test_next_step_of_each_kind():
    steps = {type(e).__name__: next_step(e, can_recover=True) for e in EVENTS}
    assert steps == {"Complete": "done", "JobVerdict": "fail", "Recovering": "recover", "Unreachable": "watch",
                     "Resumed": "watch", "MailDue": "watch"}
    assert next_step(EVENTS[2], can_recover=False) == "fail"


def test_a_close_or_mail_of_no_known_kind_is_refused_naming_it():
    """The watch's state comes back from the triggerer as plain values: an entry that is not one of ours fails
    loudly instead of being carried as an untyped dict."""
    with pytest.raises(ValueError, match="kind one of .'stall', 'outage'.*'kind': 'storm'"):
        WatchState.from_dict({"close_incidents": [{"kind": "storm", "id": "x"}]})
    with pytest.raises(ValueError, match="a pending mail must be a mapping"):
        WatchState.from_dict({"pending_mails": [{"subject": "no kind"}]})
    again = WatchState.from_dict(json.loads(json.dumps(STATE.to_dict())))
    assert again == STATE and again.pending_mails[0].close == STALL


def test_a_payload_that_does_not_fit_its_type_is_a_failed_watch_naming_it_and_keeps_the_state():
    """A known status with fields of the wrong shape (a node or a release that writes them otherwise) is not
    guessed at: the watch failed, the diagnosis names the status and the field, and the mails and incidents
    the payload carried go on."""
    payload = {"status": "unreachable", "since": "yesterday", "diagnosis": "d", "subject": "s",
               **STATE.to_dict()}
    ev = parse_event(payload)
    assert isinstance(ev, JobVerdict) and (ev.status, ev.verdict) == ("failed", "failed")
    assert "unreachable event does not fit its type" in ev.diagnosis and "since" in ev.diagnosis
    assert ev.state == STATE
    broken_state = parse_event({"status": "resumed", "close_incidents": [{"kind": "storm"}]})
    assert broken_state.status == "failed" and broken_state.state == WatchState()


def test_the_union_picks_each_type_by_status_alone():
    for event in EVENTS:
        payload = event.to_dict()
        assert type(parse_event(payload)) is type(event)
        assert set(payload) >= {"status", "close_incidents", "pending_mails"} and "state" not in payload
    assert "recoveries_left" not in WatchState().to_dict()
    assert Unreachable(since=1.0, diagnosis="d", subject="s").to_dict()["last_contact"] is None   # kept: None says
    assert "cause" not in JobVerdict(status="dead", verdict="dead", diagnosis="d", subject="s").to_dict()
