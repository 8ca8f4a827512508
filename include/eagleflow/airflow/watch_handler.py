"""The one handler of a watch's events, for every watched job (extraction shards, generation shards, training).

A watch (``eagleflow.airflow.shard_watch``) yields one event (``eagleflow.watchdog.protocol``) and ends.
``follow_event`` turns it into the next step (``protocol.next_step``): mail and recover, then watch again;
mail what is due and watch again; or the final event (done, fail), after one last try of the mails still
pending. ``watch_to_the_end`` is the one loop around it: each next watch deferred to the triggerer (a
deferrable operator) or run in this worker slot, until the final event, which it returns.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

from eagleflow.airflow.base import run_trigger_here
from eagleflow.airflow.runtime import RunContext
from eagleflow.phases import ShardKind
from eagleflow.watchdog.protocol import (EventPayload, IncidentClose, MailDue, PendingMail, Recovering, Resumed, Unreachable,
                                         WatchEvent, next_step, parse_event)
from eagleflow.airflow.alerts import close_of_outage, close_of_stall, log_unsent, mail_or_keep, send_pending
from eagleflow.nodes import NodeError
from eagleflow.watchdog.diagnosis import StallDetected
from eagleflow.watchdog.recovery import recover_after_stall

# Builds the job's next watch from the keyword arguments every watch trigger takes (run, unreachable_since,
# close_incidents, pending_mails, clocks, recoveries_left).
Rewatch = Callable[..., Any]
# Mails (a shard: when it opened the incident; the trainer: always) and recovers; returns (recoveries left, the stall's close entry
# for the next watch or None, the mails still pending). Raises to fail the task.
Recover = Callable[[EventPayload, list[PendingMail]], tuple[int, "IncidentClose | None", list[PendingMail]]]


def mail_and_recover(ctx: RunContext, context, event: EventPayload, pending: list[PendingMail], *,
                     shard: int, kind: ShardKind, log: logging.Logger | Any
                     ) -> tuple[int, "IncidentClose | None", list[PendingMail]]:
    """The one in-watch recovery step of a shard's task, whatever its phase (a ``Recover``): mail (when this shard
    opened the incident), then restart what the cause names on the node (``recovery.recover_after_stall``).

    Returns the recoveries left, for the shard that mailed what its next watch needs to mail the end, and the
    mails still pending (a mail that could not be sent never stops the recovery). A failed recovery fails the
    task with the stall (``StallDetected``), after one last try of the pending mails: Airflow's retry is the
    fallback."""
    inc = event.get("incident") or {}
    log.warning("%s %s stalled (%s, incident %s, %s it): %s", kind.watch_name, shard, event.get("cause"),
                inc.get("incident"), "opened" if inc.get("opened") else "joined", event.get("diagnosis"))
    return mail_then_recover(context, event, pending, mail=bool(inc.get("opened")),
                             recover=lambda: recover_after_stall(ctx, shard, event, log, kind=kind),
                             subject=f"{kind.watch_name} {shard} stalled")


def mail_then_recover(context, event: EventPayload, pending: list[PendingMail], *, mail: bool,
                      recover: Callable[[], object], subject: str
                      ) -> tuple[int, "IncidentClose | None", list[PendingMail]]:
    """The skeleton of every in-watch recovery (a shard's, the trainer's): the stall mailed first when ``mail``
    (a mail that cannot be sent is kept pending, never stops the recovery), then ``recover``; one recovery fewer
    left. A recovery that fails fails the task with the stall (``StallDetected``, ``subject`` when the event has
    none), after one last try of the pending mails: Airflow's retry is the fallback."""
    close = None
    if mail:
        pending = mail_or_keep(context, pending, "stall", event)
        close = close_of_stall(event)
    try:
        recover()
    except (RuntimeError, NodeError) as e:
        if pending:
            log_unsent(send_pending(context, list(pending), force=True))
        raise StallDetected(event.get("subject") or subject,
                            f"{event.get('diagnosis')}\n\nin-watch recovery failed: {e}") from None
    return max(0, int(event.get("recoveries_left") or 0) - 1), close, pending


def follow_event(event: EventPayload | Mapping[str, object] | WatchEvent, *, ctx: RunContext | Callable[[], RunContext], context,
                 log: logging.Logger | Any, rewatch: Rewatch, recover: Recover | None = None) -> Any:
    """The next watch to go on with (mails sent or kept, a recovery done), or the final ``WatchEvent``.

    ``ctx`` may be a callable giving the run's context: it is needed only to watch again (a final event needs
    no run config read)."""
    ev = parse_event(event)
    raw = ev.payload()   # the mails are rendered from the plain payload
    pending = list(ev.state.pending_mails)     # mails the SMTP server did not take yet
    closes = list(ev.state.close_incidents)    # incidents this task mailed, not over yet
    left = {} if ev.state.recoveries_left is None else {"recoveries_left": ev.state.recoveries_left}
    step = next_step(ev, can_recover=recover is not None)
    if step in ("recover", "watch"):
        run = ctx() if callable(ctx) else ctx
    if step == "recover":
        # the watch found a stall it can recover: mail once per incident, recover now, watch again
        assert isinstance(ev, Recovering) and recover is not None   # next_step recovers only with a recover
        n_left, stall, pending = recover(raw, pending)
        return rewatch(run=run.trigger_ref(), recoveries_left=n_left,
                       close_incidents=closes + ([stall] if stall else []), pending_mails=pending)
    if step == "watch":
        if isinstance(ev, Unreachable):
            # the node (link, sshd) cannot be reached: not the job's fault; mail once, keep watching
            log.warning("%s", ev.diagnosis)
            if ev.mail:   # the first watch to find this node unreachable mails for the outage
                pending = mail_or_keep(context, pending, "unreachable", raw)
            outage = close_of_outage(raw)
            return rewatch(run=run.serialize(), unreachable_since=ev.since,
                           close_incidents=closes + ([outage] if outage else []), pending_mails=pending, **left)
        if isinstance(ev, Resumed):   # incidents this task mailed are over: say so, watch on with the rest
            for close in ev.closed:
                pending = mail_or_keep(context, pending, "over", raw, close)
            return rewatch(run=run.trigger_ref(), close_incidents=list(ev.still_open),
                           pending_mails=pending, **left)
        if isinstance(ev, MailDue):   # a mail the SMTP server refused earlier: try again, watch on as before
            return rewatch(run=run.trigger_ref(), close_incidents=closes, unreachable_since=ev.unreachable_since,
                           clocks=dict(ev.clocks), pending_mails=send_pending(context, pending), **left)
    if pending:   # the task ends: one last try; what the server never took is logged
        log_unsent(send_pending(context, pending, force=True))
    return ev


def watch_to_the_end(operator, context, start: Any, follow: Callable[[dict[str, Any]], Any]) -> WatchEvent:
    """Watch until the final event: ``start`` a trigger (watch it) or an event (act on it first). A deferrable
    ``operator`` defers each watch (its ``execute_complete`` calls this again with the event); otherwise the
    same watch runs here."""
    step = start
    while not isinstance(step, WatchEvent):
        if isinstance(step, dict):
            step = follow(step)
            continue
        if operator.deferrable:
            operator.defer(trigger=step, method_name="execute_complete")
        step = run_trigger_here(step)
    return step


def fail_with(event: WatchEvent, job: str):
    """The task fails with the watch's verdict (a plain Exception: Airflow retries it)."""
    d = event.to_dict()
    raise StallDetected(d.get("subject") or f"{job} {event.kind}", d.get("diagnosis") or str(d))
