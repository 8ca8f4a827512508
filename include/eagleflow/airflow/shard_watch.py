"""Triggers that watch a detached node job (an extraction shard, the trainer) until it ends or stalls.

Each poll is ONE node-side command, ``eagleflow watch --shard I --json`` (or
``--train``): over SSH that is one round trip, and the node keeps the
watcher's memory (when a D state was first seen, the GPU window) in a small
state file, so the trigger itself holds no state a triggerer restart would lose.

Polls are paced from their start: the next one begins ``poll_interval_s``
after the previous began, or sooner, when the node says progress turns stale
then (``recheck_in_s``): the detecting look starts at most about a second after
progress turned stale, skips the health check when the server or worker is
provably stuck (gone, zombie, state T) and otherwise lasts at most the health
timeout plus the command's cost. Hence ``WatchdogConfig.detection_bound_s`` =
stall_after + 1 s + 2 x 2 s + health_timeout (40 s with the defaults).

A watch with ``recoveries_left`` > 0 does not fail the task on a stall, death
or failure whose cause its job's recovery handles (``RECOVERS``): it yields
``recovering`` and the operator mails at once, recovers and watches again with
one recovery fewer. No Airflow retry delay lies on that path. A shard (blamed:
the server or the worker) first opens or joins the incident of (node, cause)
on the node (``eagleflow recover --incident-only``, quick), so eight shards of
one frozen server mail once; its operator (only the shard that opened the
incident mails) runs ``eagleflow recover --incident ID`` (the server restarted
once per incident, the worker started again). The trainer (blamed: itself or
the run's store) is one per run, so it opens no incident: its operator mails,
restarts the store or the trainer from its last checkpoint
(``TrainDraftOperator``). A starved trainer (cause producer) is not its fault
and is not recovered; the shards' watch judges the producer.

A node that cannot be reached (``NodeUnreachable``: the link, the node's sshd,
a connection dropped mid-poll) is not a stalled job: its detached workers keep
running there. The watch reconnects with bounded backoff and, once the node has
not answered for ``stall_after_s + 2 x poll_interval_s``, yields
``{"status": "unreachable", "since": T, ...}`` (no recovery on the node). The
operator mails that once and watches again with ``unreachable_since=T``, which
keeps reconnecting silently; when the node answers, the watch goes on with the
progress made meanwhile.

A watch given ``close_incidents`` (each a few plain values: kind "stall" with
the stored count at the stall, or kind "outage"; its id, subject, since) is the
one whose task mailed those incidents: on the first look that shows a new
sample stored (stall) or the node answering (outage) it yields
``{"status": "resumed", "closed": [...], "still_open": [...], ...}``; the
operator mails that each closed one is over and watches on with the rest. Every
other event carries ``close_incidents`` too, so a stall or an outage in
between does not lose them.

A watch given ``pending_mails`` (mails of its task the SMTP server refused,
each with its next try time; eagleflow.airflow.alerts) yields
``{"status": "mail_due", ...}`` at the first look after the first one is due;
the operator tries it again and watches on. Every event carries them too: a
mail never decides the task's fate.

Every trigger yields exactly one event, a type of ``eagleflow.watchdog.protocol`` sent as its ``to_dict()``:
``Complete`` (status complete), ``JobVerdict`` (stalled, dead, failed; failed/unreachable when the watch cannot
vouch for the job any more), ``Recovering`` (the stall's verdict plus the ``OpenIncident``), ``Unreachable``,
``Resumed`` or ``MailDue``; each carries the ``WatchState`` (close_incidents, pending_mails, recoveries_left).
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.runtime import RunContext, RunPayload, RunRef
from eagleflow.nodes import NodeError, NodeUnreachable
from eagleflow.nodes.ssh_async import AsyncSSHNode
from eagleflow.phases import EXTRACT, kind_of
from eagleflow.protocol import one_line
from eagleflow.watchdog.diagnosis import StallDiagnosis
from eagleflow.watchdog.protocol import (IncidentClose, MailDue, OpenIncident, PendingMail, Recovering, Resumed,
                                         WatchEvent, WatchState, clock as _clock, parse_event, unreachable_event)

WATCH_ANSWER_CODES = (0, 3, 4, 5, 6)  # `eagleflow watch` exit codes that come with a diagnosis
# An unreachable node (link, sshd) says nothing about its detached jobs: the watch keeps reconnecting,
# backed off from RECONNECT_FIRST_S up to the poll interval, and gives up only after this long.
RECONNECT_FIRST_S = 0.5
UNREACHABLE_GIVE_UP_S = 6 * 3600.0
# Silent from the start, and the payload carries no watchdog settings (one deferred before they were
# carried, RunRef.watch, WatchHints): say so after this.
EARLY_UNREACHABLE_S = 60.0


def unreachable_bound_s(stall_after_s: float, poll_interval_s: float) -> float:
    """How long a node may not answer before its watch says it is unreachable."""
    return stall_after_s + 2 * poll_interval_s


def reconnect_delay_s(misses: int, cap_s: float, jitter: Callable[[], float] = random.random) -> float:
    """Bounded exponential backoff with equal jitter: 0.5, 1, 2, 4 ... s capped at cap_s (the poll interval),
    then scaled by 0.5-1.0 at random, so eight shard watches that lost one node do not hit its sshd together."""
    return min(cap_s, RECONNECT_FIRST_S * 2 ** max(0, misses - 1)) * (0.5 + 0.5 * jitter())


# One mail per node outage: eight shard watches that lose the same node in one triggerer (or worker
# process) mail once. The first to report an outage claims it; any watch that reaches the node ends it.
_OUTAGES: dict[str, float] = {}
_OUTAGES_LOCK = threading.Lock()


def _claim_outage(node_key: str, since: float) -> bool:
    with _OUTAGES_LOCK:
        if node_key in _OUTAGES:
            return False
        _OUTAGES[node_key] = since
        return True


def _end_outage(node_key: str) -> None:
    with _OUTAGES_LOCK:
        _OUTAGES.pop(node_key, None)


class _NodeJobWatchTrigger(BaseTrigger):
    """Shared loop: run the node-side watch command, turn its verdict into one event."""

    def __init__(self, run: RunPayload | RunRef, poll_interval_s: float | None = None,
                 unreachable_since: float | None = None, close_incidents: list[dict[str, Any] | IncidentClose] | None = None,
                 pending_mails: list[dict[str, Any] | PendingMail] | None = None,
                 clocks: dict[str, float] | None = None, recoveries_left: int = 0):
        super().__init__()
        self.recoveries_left = recoveries_left   # faults this watch (and the ones after it) still recovers itself
        # a re-deferral for a due mail must not restart the watch's running clocks: an outage not yet
        # reported ("outage_started") and failing looks ("failing_since"), both unix times
        self.clocks = {k: float(v) for k, v in (clocks or {}).items() if k in ("outage_started", "failing_since")
                       and v is not None}
        # see the module doc: this watch mails their end (plain values from the triggerer, typed here)
        self.close_incidents = [IncidentClose.from_dict(c) for c in close_incidents or []]
        # mails of this task its SMTP server did not take yet (eagleflow.airflow.alerts.send_pending)
        self.pending_mails = [PendingMail.from_dict(m) for m in pending_mails or []]
        self.ref = RunRef.from_dict(run)          # parsed once
        self.run_data = self.ref.to_dict()
        self.poll_interval_s = poll_interval_s
        # set when an earlier watch of this job already reported the node unreachable (unix time): this one
        # keeps reconnecting without a second event until the node answers or UNREACHABLE_GIVE_UP_S passed
        self.unreachable_since = unreachable_since
        self._anode: AsyncSSHNode | None = None   # an SSH node's one held connection for this run of the trigger

    # -- what subclasses say ------------------------------------------------
    def _watch_args(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _job_name(self, ctx: RunContext | None = None) -> str:  # pragma: no cover - abstract
        """The job as mails and logs name it ("shard 3/8"); without the run's config (not read yet) the count
        is the payload's hint, unknown in an older payload ("shard 3")."""
        raise NotImplementedError

    # -- the loop -----------------------------------------------------------
    def _early_bound_s(self) -> float:
        """The unreachable bound before the run's config is read: the one the watch keeps after, from the
        payload's hints (a watch the triggerer starts mid-outage reports it as late as one already watching)."""
        stall_after, interval = self.ref.hints.stall_after_s, self.ref.hints.poll_interval_s
        if stall_after is None or interval is None:
            return EARLY_UNREACHABLE_S
        return unreachable_bound_s(float(stall_after), float(self.poll_interval_s or interval))

    async def _load_context(self) -> RunContext | WatchEvent:
        """The run's context (reads run-config.json on the node), reconnecting while the node is unreachable;
        an unreachable event instead when the node stays silent past the bound (not yet reported)."""
        misses, first, bound = 0, time.time(), self._early_bound_s()
        while True:
            try:
                return await self._read_context()
            except NodeUnreachable as e:
                misses += 1
                now = time.time()
                if self.unreachable_since is None and now - first >= bound:
                    return self._early_unreachable_event(first, str(e))
                if now - (self.unreachable_since or first) >= UNREACHABLE_GIVE_UP_S:
                    raise
                self.log.warning("node unreachable while loading the run config (try %d): %s", misses, e)
                # retry at least every 2 s, and look again when the bound is reached, so the verdict is not late
                wait = reconnect_delay_s(misses, min(self.poll_interval_s or 2.0, 2.0))
                if self.unreachable_since is None:
                    wait = min(wait, max(RECONNECT_FIRST_S, first + bound - now))
                await asyncio.sleep(wait)

    async def _read_context(self) -> RunContext:
        ref = self.ref
        if not ref.conn_id:
            return await asyncio.to_thread(RunContext.from_serialized, self.run_data)
        if self._anode is None:
            self._anode = AsyncSSHNode(ref.conn_id)
        ctx = RunContext.from_frozen_text(ref, await self._anode.read_text(ref.run_config), self._anode.name)
        self._anode.name = ctx.cfg.node.name
        return ctx

    async def run(self) -> AsyncIterator[TriggerEvent]:
        watch = self._watch()
        try:
            async for event in watch:
                yield event
        finally:
            await watch.aclose()
            if self._anode is not None:
                self._anode.close()

    async def _watch(self) -> AsyncGenerator[TriggerEvent, None]:
        ctx = await self._load_context()
        if isinstance(ctx, WatchEvent):
            yield TriggerEvent(ctx.to_dict())
            return
        wd = ctx.cfg.watchdog
        interval = self.poll_interval_s or wd.poll_interval_s
        # The node can be unreachable for a while (SSH hiccup) without the job being at fault;
        # past this long we cannot vouch for it any more and say so.
        unreachable_limit = unreachable_bound_s(wd.stall_after_s, interval)
        first_failure: float | None = self.clocks.get("failing_since")   # unix time of the first failed look
        # unreachable_since: unix time of the node's last answer before failed looks (or of the first failed
        # look); reported: this outage was already yielded (by this watch or, re-deferred, the one before)
        unreachable_since, misses, reported = self.unreachable_since, 0, self.unreachable_since is not None
        if unreachable_since is None:
            unreachable_since = self.clocks.get("outage_started")
        last_contact: float | None = None
        try:
            while True:
                started, look_started = time.monotonic(), time.time()
                mail_at = self._mail_at()
                if mail_at is not None and mail_at <= look_started:
                    # a mail is due again: the operator sends it and watches on; the outage stays reported
                    clocks = {"outage_started": None if reported else unreachable_since,
                              "failing_since": first_failure}
                    yield TriggerEvent(MailDue(unreachable_since=unreachable_since if reported else None,
                                               clocks={k: v for k, v in clocks.items() if v is not None},
                                               state=self._state()).to_dict())
                    return
                diag: StallDiagnosis | None = None
                reconnect_in: float | None = None
                try:
                    diag = await self._observe_async(ctx)
                    first_failure = None
                    if unreachable_since is not None:
                        self.log.warning("node %s reachable again after %.0f s (unreachable since %s, %d failed "
                                         "looks); the job was not touched meanwhile", ctx.node.name,
                                         time.time() - unreachable_since, _clock(unreachable_since), misses)
                    unreachable_since, misses, reported, last_contact = None, 0, False, time.time()
                    _end_outage(self._node_key(ctx))
                except NodeUnreachable as e:
                    # the link or sshd, not the job: no verdict on the job, no recovery action on the node
                    now = time.time()
                    misses += 1
                    if unreachable_since is None:   # no answer since the last one (a dead link takes ~13 s to show)
                        unreachable_since = last_contact or look_started
                    self.log.warning("%s on node %s: node unreachable since %s (%d failed looks): %s",
                                     self._job_name(ctx), ctx.node.name, _clock(unreachable_since), misses, e)
                    if not reported and now - unreachable_since >= unreachable_limit:
                        yield TriggerEvent(self._unreachable(
                            ctx, unreachable_since, str(e), last_contact=last_contact,
                            mail=_claim_outage(self._node_key(ctx), unreachable_since)).to_dict())
                        return
                    if now - unreachable_since >= UNREACHABLE_GIVE_UP_S:
                        yield TriggerEvent(self._unreachable(ctx, unreachable_since, str(e), last_contact=last_contact,
                                                             gave_up_after_s=UNREACHABLE_GIVE_UP_S).to_dict())
                        return
                    reconnect_in = reconnect_delay_s(misses, interval)
                    if not reported:   # look again when the bound is reached, so the verdict is not late
                        reconnect_in = min(reconnect_in, max(RECONNECT_FIRST_S, unreachable_since
                                                             + unreachable_limit - now))
                except (NodeError, ValueError) as e:
                    now = time.time()
                    first_failure = first_failure or now
                    self.log.warning("watching %s on node %s failed: %s", self._job_name(ctx), ctx.node.name, e)
                    if now - first_failure >= unreachable_limit:
                        # the task ends: its operator still tries the mails it holds, and logs those never sent
                        yield TriggerEvent(self._unreachable(ctx, first_failure, str(e),
                                                             command_failing_s=now - first_failure).to_dict())
                        return
                else:
                    self.log.info("%s", diag.summary)
                    closed = [c for c in self.close_incidents if self._incident_over(c, diag)]
                    if closed:
                        yield TriggerEvent(Resumed(
                            closed=tuple(closed), still_open=tuple(c for c in self.close_incidents if c not in closed),
                            done=diag.done, total=diag.total, observed_at=diag.observed_at, job=diag.job,
                            node=diag.node, summary=diag.summary, state=self._state()).to_dict())
                        return
                    if diag.status is not None:
                        # a verdict carries the mails and incidents, not the recoveries left (Recovering does)
                        event = parse_event({**diag.event_payload(), "detected_at": time.time(),
                                             "close_incidents": self.close_incidents,
                                             "pending_mails": self.pending_mails})
                        if self._recoverable(diag):
                            event = await asyncio.to_thread(self._recover, ctx, diag, event)
                        yield TriggerEvent(event.to_dict())
                        return
                wait = interval if reconnect_in is None else reconnect_in
                if diag is not None and diag.recheck_in_s is not None:
                    wait = min(interval, diag.recheck_in_s + wd.RECHECK_SLACK_S / 2)
                if mail_at is not None:
                    wait = min(wait, max(0.0, mail_at - look_started))
                await asyncio.sleep(max(0.0, wait - (time.monotonic() - started)))
        finally:
            await asyncio.to_thread(ctx.close)

    @staticmethod
    def _incident_over(close: IncidentClose, diag: StallDiagnosis) -> bool:
        """A sample stored since the stall, or (an outage) the node answers."""
        if close.kind == "outage":
            return True
        return diag.done > close.done or diag.verdict == "complete"

    def _state_kwargs(self) -> dict[str, Any]:
        """The watch's own state as the keyword arguments of the next trigger (only those it holds)."""
        kw: dict[str, Any] = {"recoveries_left": self.recoveries_left}
        if self.unreachable_since is not None:
            kw["unreachable_since"] = self.unreachable_since
        if self.close_incidents:   # a few plain values each, as Airflow serialises a trigger
            kw["close_incidents"] = [c.to_dict() for c in self.close_incidents]
        if self.pending_mails:
            kw["pending_mails"] = [m.to_dict() for m in self.pending_mails]
        if self.clocks:
            kw["clocks"] = self.clocks
        return kw

    # -- recovery inside the watch -------------------------------------------
    RECOVERS: tuple[str, ...] = ()   # the causes the job's operator recovers

    def _recoverable(self, diag: StallDiagnosis) -> bool:
        return self.recoveries_left > 0 and diag.status in ("stalled", "dead", "failed") and diag.cause in self.RECOVERS

    def fault_event(self, ctx: RunContext, diag: StallDiagnosis) -> WatchEvent:
        """A fault found outside this watch's loop (the check before a shard starts, a retry's first look) as the
        loop's own event: ``recovering`` when the cause is one the watch recovers, else the plain verdict."""
        event = parse_event({**diag.event_payload(), "detected_at": time.time(),
                             "close_incidents": self.close_incidents, "pending_mails": self.pending_mails})
        return self._recover(ctx, diag, event) if self._recoverable(diag) else event

    def _recover(self, ctx: RunContext, diag: StallDiagnosis, event: WatchEvent) -> WatchEvent:
        """The verdict as ``recovering``: the operator mails and recovers (a shard first opens its incident)."""
        return Recovering.model_validate({**event.to_dict(), "recoveries_left": self.recoveries_left})

    async def _observe_async(self, ctx: RunContext) -> StallDiagnosis:
        """One look; over SSH on the trigger's held asynchronous connection, never blocking the event loop."""
        if self._anode is None:
            return await asyncio.to_thread(self._observe, ctx)
        argv = ctx.eagleflow_argv("watch", *self._watch_args(), "--json")
        return await self._anode.run_json(argv, StallDiagnosis, timeout=ctx.cfg.watchdog.health_timeout_s + 60,
                                          answer_codes=WATCH_ANSWER_CODES)

    def look_once(self, ctx: RunContext) -> StallDiagnosis:
        """One look, blocking, outside any watch loop: what a retry asks the node before it acts on the job."""
        return self._observe(ctx)

    def _observe(self, ctx: RunContext) -> StallDiagnosis:
        """One node-side `eagleflow watch ... --json` call (blocking; run off the event loop)."""
        wd = ctx.cfg.watchdog
        argv = ctx.eagleflow_argv("watch", *self._watch_args(), "--json")
        # exit 0 healthy/complete, 3 slow, 4 stalled, 5 dead, 6 failed: each carries the diagnosis
        return ctx.node.run_json(argv, StallDiagnosis, timeout=wd.health_timeout_s + 60,
                                 answer_codes=WATCH_ANSWER_CODES)

    @staticmethod
    def _node_key(ctx: RunContext) -> str:
        return ctx.cfg.node.conn_id or ctx.node.name

    def _state(self) -> WatchState:
        """What the next watch of this job needs (every event carries it)."""
        return WatchState(close_incidents=tuple(self.close_incidents), pending_mails=tuple(self.pending_mails),
                          recoveries_left=self.recoveries_left)

    def _mail_at(self) -> float | None:
        """When the first pending mail may be tried again (they go in order); None: no mail is waiting."""
        return self.pending_mails[0].next_at if self.pending_mails else None

    def _early_unreachable_event(self, since: float, error: str) -> WatchEvent:
        """Unreachable before the run's config could even be read: the node's name and the job count from the
        payload's hints, so the mail reads as one from a watch that had read it (none in an older payload)."""
        return unreachable_event(job=self._job_name(), since=since, error=error, state=self._state(),
                                 node=self.ref.hints.node_name, conn_id=self.ref.conn_id, run_id=self.ref.run_id,
                                 mail=_claim_outage(self.ref.conn_id or self.ref.hints.node_name or "local",
                                                    since))

    def _unreachable(self, ctx: RunContext, since: float, error: str, **kw) -> WatchEvent:
        return unreachable_event(job=self._job_name(ctx), since=since, error=error, state=self._state(),
                                 node=ctx.node.name, conn_id=ctx.cfg.node.conn_id, **kw)


class ShardWatchTrigger(_NodeJobWatchTrigger):
    """Watch shard ``shard`` of a sharded phase (``phase``, a ``phases.KINDS`` key: its names and shard count
    from its descriptor) until it completes, stalls, dies or fails.

    With ``recoveries_left`` > 0 a stall blamed on the phase's server or the worker is recovered here,
    at once (see the module docstring); a failure the job reported itself (a full disk) is not.
    """

    def __init__(self, run: RunPayload | RunRef, shard: int, poll_interval_s: float | None = None,
                 recoveries_left: int = 0, unreachable_since: float | None = None,
                 close_incidents: list[dict[str, Any] | IncidentClose] | None = None,
                 pending_mails: list[dict[str, Any] | PendingMail] | None = None, clocks: dict[str, float] | None = None,
                 phase: str = EXTRACT):
        super().__init__(run, poll_interval_s, unreachable_since, close_incidents, pending_mails, clocks,
                         recoveries_left)
        self.shard = shard
        self.kind = kind_of(phase)
        self.phase = self.kind.phase

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "eagleflow.airflow.shard_watch.ShardWatchTrigger", {
            "run": self.run_data, "shard": self.shard, "poll_interval_s": self.poll_interval_s,
            "phase": self.phase, **self._state_kwargs()}

    RECOVERS = ("capture_server", "worker")   # the server's name on the wire, whichever phase's (recovery.SERVER_CAUSE)

    def _recover(self, ctx: RunContext, diag: StallDiagnosis, event: WatchEvent) -> WatchEvent:
        """One quick node command: open or join the incident of (node, cause); the operator mails and recovers."""
        argv = ctx.eagleflow_argv("recover", "--shard", str(self.shard), "--json", "--cause", diag.cause,
                                  "--incident-only", "--summary", diag.summary[:1500], "--phase", self.phase)
        try:
            # the node's answer is untrusted: one unfit for OpenIncident (an id unfit for a mail header) is refused
            # here, naming the node and the command (NodeAnswerError)
            inc = ctx.node.run_json(argv, OpenIncident, timeout=60)
        except NodeError as e:
            # no incident book: the task fails with the stall and Airflow's retry recovers it
            self.log.warning("shard %d: could not open an incident on node %s (no in-watch recovery, the task fails "
                             "with the stall and Airflow's retry recovers it): %s", self.shard, ctx.node.name, e)
            return event
        self.log.info("shard %d: %s", self.shard, one_line(inc.summary))
        return Recovering.model_validate({**event.to_dict(), "incident": inc, "recoveries_left": self.recoveries_left})

    def _watch_args(self) -> list[str]:
        return ["--shard", str(self.shard), "--phase", self.phase]

    def _job_name(self, ctx: RunContext | None = None) -> str:
        total = self.kind.num_shards(ctx.cfg) if ctx is not None else self.ref.hints.shards(self.kind)
        return f"{self.kind.watch_name} {self.shard}" + (f"/{total}" if total is not None else "")


class TrainWatchTrigger(_NodeJobWatchTrigger):
    """Watch the draft training job of a run. With ``recoveries_left`` > 0 a trainer stopped, dead or stuck, or
    its store lost, is recovered by the operator at once (see the module docstring); a starved trainer (the
    producer's fault) or one that failed with its own error is not."""

    RECOVERS = ("worker", "trainer", "store")   # the trainer's process (stopped, gone, no step), its store

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "eagleflow.airflow.shard_watch.TrainWatchTrigger", {
            "run": self.run_data, "poll_interval_s": self.poll_interval_s, **self._state_kwargs()}

    def _watch_args(self) -> list[str]:
        return ["--train"]

    def _job_name(self, ctx: RunContext | None = None) -> str:
        return "training"

