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

A ShardWatchTrigger with ``recoveries_left`` > 0 does not fail the task on a
stall blamed on the server or the worker: it opens or joins the incident of
(node, cause) on the node (``eagleflow recover --incident-only``, quick) and
yields ``recovering``. The operator then mails at once (only the shard that
opened the incident does), runs the recovery (``eagleflow recover --incident
ID``: the server restarted once per incident, the worker started again) and
watches again. No Airflow retry delay lies on that path.

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

Every trigger yields exactly one event:
``{"status": "complete", "summary": str}``,
``{"status": "stalled"|"dead"|"failed", "verdict": str, "diagnosis": str, "subject": str, "cause": str}`` or
``{"status": "recovered", ..., "recovery": {...}}`` (the stall's payload plus what the recovery did) or
``{"status": "unreachable", "verdict": "unreachable", "since": float, "diagnosis": str, "subject": str}`` or
``{"status": "resumed", "closed": [...], "still_open": [...], "done": int, "total": int, "observed_at": float,
"summary": str}`` or ``{"status": "mail_due", "pending_mails": [...], "unreachable_since": float | None}``.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, AsyncIterator, Callable

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.runtime import RunContext, RunRef
from eagleflow.nodes import NodeError, NodeUnreachable
from eagleflow.nodes.ssh_async import AsyncSSHNode
from eagleflow.watchdog.diagnosis import StallDiagnosis

WATCH_ANSWER_CODES = (0, 3, 4, 5, 6)  # `eagleflow watch` exit codes that come with a diagnosis
# An unreachable node (link, sshd) says nothing about its detached jobs: the watch keeps reconnecting,
# backed off from RECONNECT_FIRST_S up to the poll interval, and gives up only after this long.
RECONNECT_FIRST_S = 0.5
UNREACHABLE_GIVE_UP_S = 6 * 3600.0
# Silent from the start (the run's config, hence its watchdog settings, cannot be read yet): say so after this.
EARLY_UNREACHABLE_S = 60.0


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

    def __init__(self, run: dict[str, Any], poll_interval_s: float | None = None,
                 unreachable_since: float | None = None, close_incidents: list[dict[str, Any]] | None = None,
                 pending_mails: list[dict[str, Any]] | None = None, clocks: dict[str, float] | None = None):
        super().__init__()
        # a re-deferral for a due mail must not restart the watch's running clocks: an outage not yet
        # reported ("outage_started") and failing looks ("failing_since"), both unix times
        self.clocks = {k: float(v) for k, v in (clocks or {}).items() if k in ("outage_started", "failing_since")
                       and v is not None}
        self.close_incidents = list(close_incidents or [])  # see the module doc: this watch mails their end
        # mails of this task its SMTP server did not take yet (eagleflow.airflow.alerts.send_pending)
        self.pending_mails = list(pending_mails or [])
        self.run_data = RunRef.from_dict(run).to_dict()  # 0.1.0 payloads carried the whole config
        self.poll_interval_s = poll_interval_s
        # set when an earlier watch of this job already reported the node unreachable (unix time): this one
        # keeps reconnecting without a second event until the node answers or UNREACHABLE_GIVE_UP_S passed
        self.unreachable_since = unreachable_since
        self._anode: AsyncSSHNode | None = None   # an SSH node's one held connection for this run of the trigger

    # -- what subclasses say ------------------------------------------------
    def _watch_args(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _job_name(self, ctx: RunContext) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- the loop -----------------------------------------------------------
    async def _load_context(self) -> RunContext | dict:
        """The run's context (reads run-config.json on the node), reconnecting while the node is unreachable;
        an unreachable event instead when the node stays silent past EARLY_UNREACHABLE_S (not yet reported)."""
        misses, first = 0, time.time()
        while True:
            try:
                return await self._read_context()
            except NodeUnreachable as e:
                misses += 1
                if self.unreachable_since is None and time.time() - first >= EARLY_UNREACHABLE_S:
                    return self._early_unreachable_event(first, str(e))
                if time.time() - (self.unreachable_since or first) >= UNREACHABLE_GIVE_UP_S:
                    raise
                self.log.warning("node unreachable while loading the run config (try %d): %s", misses, e)
                # the poll interval is in the config we cannot read yet: retry at least every 2 s
                await asyncio.sleep(reconnect_delay_s(misses, min(self.poll_interval_s or 2.0, 2.0)))

    async def _read_context(self) -> RunContext:
        ref = RunRef.from_dict(self.run_data)
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

    async def _watch(self) -> AsyncIterator[TriggerEvent]:
        ctx = await self._load_context()
        if isinstance(ctx, dict):
            yield TriggerEvent(ctx)
            return
        wd = ctx.cfg.watchdog
        interval = self.poll_interval_s or wd.poll_interval_s
        # The node can be unreachable for a while (SSH hiccup) without the job being at fault;
        # past this long we cannot vouch for it any more and say so.
        unreachable_limit = wd.stall_after_s + 2 * interval
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
                    yield TriggerEvent({**self._resume_fields(), "status": "mail_due",
                                        "unreachable_since": unreachable_since if reported else None,
                                        "clocks": {k: v for k, v in clocks.items() if v is not None}})
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
                        ev = self._node_unreachable_event(ctx, unreachable_since, last_contact, str(e))
                        ev["mail"] = _claim_outage(self._node_key(ctx), unreachable_since)
                        yield TriggerEvent(ev)
                        return
                    if now - unreachable_since >= UNREACHABLE_GIVE_UP_S:
                        ev = self._node_unreachable_event(ctx, unreachable_since, last_contact, str(e))
                        yield TriggerEvent({**ev, "status": "failed",
                                            "diagnosis": ev["diagnosis"] + f"\nGave up after "
                                                         f"{UNREACHABLE_GIVE_UP_S / 3600:.0f} h."})
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
                        yield TriggerEvent(self._unreachable_event(ctx, now - first_failure, str(e)))
                        return
                else:
                    self.log.info("%s", diag.summary)
                    closed = [c for c in self.close_incidents if self._incident_over(c, diag)]
                    if closed:
                        yield TriggerEvent({**self._resume_fields(), "status": "resumed", "closed": closed,
                                            "still_open": [c for c in self.close_incidents if c not in closed],
                                            "done": diag.done, "total": diag.total, "observed_at": diag.observed_at,
                                            "job": diag.job, "node": diag.node, "summary": diag.summary})
                        return
                    if diag.status is not None:
                        payload = diag.event_payload()
                        payload["detected_at"] = time.time()
                        payload["close_incidents"] = self.close_incidents
                        payload["pending_mails"] = self.pending_mails
                        if self._recoverable(diag):
                            payload = await asyncio.to_thread(self._recover, ctx, diag, payload)
                        yield TriggerEvent(payload)
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
    def _incident_over(close: dict[str, Any], diag: StallDiagnosis) -> bool:
        """A sample stored since the stall, or (an outage) the node answers."""
        if close.get("kind") == "outage":
            return True
        return diag.done > int(close.get("done", 0)) or diag.verdict == "complete"

    def _serialize_common(self, kw: dict[str, Any]) -> dict[str, Any]:
        if self.unreachable_since is not None:
            kw["unreachable_since"] = self.unreachable_since
        if self.close_incidents:
            kw["close_incidents"] = self.close_incidents
        if self.pending_mails:
            kw["pending_mails"] = self.pending_mails
        if self.clocks:
            kw["clocks"] = self.clocks
        return kw

    # -- recovery inside the watch (shards only) -----------------------------
    def _recoverable(self, diag: StallDiagnosis) -> bool:
        return False

    def _recover(self, ctx: RunContext, diag: StallDiagnosis, payload: dict) -> dict:  # pragma: no cover
        return payload

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

    def _resume_fields(self) -> dict:
        """What the operator needs to watch again after an unreachable or resumed event."""
        return {"close_incidents": self.close_incidents, "pending_mails": self.pending_mails}

    def _mail_at(self) -> float | None:
        """When the first pending mail may be tried again (they go in order); None: no mail is waiting."""
        return float(self.pending_mails[0].get("next_at") or 0) if self.pending_mails else None

    def _early_unreachable_event(self, since: float, error: str) -> dict:
        """Unreachable before the run's config could even be read (so no job or node name from it yet)."""
        ref = RunRef.from_dict(self.run_data)
        diagnosis = (f"UNREACHABLE {self._job_label()} of run {ref.run_id} over connection {ref.conn_id!r}: the node "
                     f"has not answered since {_clock(since)} ({time.time() - since:.0f} s; the watch could not read "
                     f"the run's config there); last error: {error}. This is the network or the node's sshd, not a "
                     f"verdict on the job: nothing is restarted, and the watch keeps reconnecting.")
        return {**self._unreachable_payload(since, None, diagnosis,
                                            f"[eagleflow] UNREACHABLE {self._job_label()} over {ref.conn_id}"),
                "mail": _claim_outage(ref.conn_id, since)}

    def _unreachable_payload(self, since: float, last_contact: float | None, diagnosis: str, subject: str) -> dict:
        """The "unreachable since T" event: no verdict on the job, what the operator needs to watch on."""
        return {"status": "unreachable", "verdict": "unreachable", "since": since, "last_contact": last_contact,
                "diagnosis": diagnosis, "subject": subject, "cause": "network", **self._resume_fields()}

    def _job_label(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _node_unreachable_event(self, ctx: RunContext, since: float, last_contact: float | None, error: str) -> dict:
        """The node cannot be reached (network, sshd): the verdict "unreachable since T", not a stall."""
        job = self._job_name(ctx)
        seen = f"last answer at {_clock(last_contact)}" if last_contact else "no answer in this watch"
        diagnosis = (f"UNREACHABLE {job} on {ctx.node.name}: the node has not answered since {_clock(since)} "
                     f"({time.time() - since:.0f} s; {seen}); last error: {error}. This is the network or the "
                     f"node's sshd, not a verdict on the job: its detached processes keep running there, nothing "
                     f"is restarted, and the watch keeps reconnecting (check node.conn_id={ctx.cfg.node.conn_id!r}).")
        return self._unreachable_payload(since, last_contact, diagnosis,
                                         f"[eagleflow] UNREACHABLE {job} on {ctx.node.name}")

    def _unreachable_event(self, ctx: RunContext, for_s: float, error: str) -> dict:
        job = self._job_name(ctx)
        subject = f"[eagleflow] UNREACHABLE {job} on {ctx.node.name}"
        diagnosis = (f"UNREACHABLE {job} on {ctx.node.name}: the watch command has failed for {for_s:.0f} s, "
                     f"so the job's health is unknown; last error: {error}. Check the node connection "
                     f"(node.conn_id={ctx.cfg.node.conn_id!r}) and that eagleflow is installed there.")
        # the task ends: its operator still tries the mails it holds, and logs those never sent
        return {**self._resume_fields(), "status": "failed", "verdict": "unreachable", "diagnosis": diagnosis,
                "subject": subject}


class ShardWatchTrigger(_NodeJobWatchTrigger):
    """Watch extraction shard ``shard`` of a run until it completes, stalls, dies or fails.

    With ``recoveries_left`` > 0 a stall blamed on the capture server or the worker is recovered here,
    at once (see the module docstring); a failure the job reported itself (a full disk) is not.
    """

    def __init__(self, run: dict[str, Any], shard: int, poll_interval_s: float | None = None,
                 recoveries_left: int = 0, unreachable_since: float | None = None,
                 close_incidents: list[dict[str, Any]] | None = None,
                 pending_mails: list[dict[str, Any]] | None = None, clocks: dict[str, float] | None = None):
        super().__init__(run, poll_interval_s, unreachable_since, close_incidents, pending_mails, clocks)
        self.shard = shard
        self.recoveries_left = recoveries_left

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "eagleflow.airflow.shard_watch.ShardWatchTrigger", self._serialize_common(
            {"run": self.run_data, "shard": self.shard, "poll_interval_s": self.poll_interval_s,
             "recoveries_left": self.recoveries_left})

    def _recoverable(self, diag: StallDiagnosis) -> bool:
        return self.recoveries_left > 0 and diag.status in ("stalled", "dead", "failed") \
            and diag.cause in ("capture_server", "worker")

    def _recover(self, ctx: RunContext, diag: StallDiagnosis, payload: dict) -> dict:
        """One quick node command: open or join the incident of (node, cause); the operator mails and recovers."""
        argv = ctx.eagleflow_argv("recover", "--shard", str(self.shard), "--json", "--cause", diag.cause,
                                  "--incident-only", "--summary", diag.summary[:1500])
        try:
            inc = ctx.node.run_json(argv, dict, timeout=60)
        except NodeError as e:
            # no incident book: the task fails with the stall and Airflow's retry recovers it
            self.log.warning("shard %d: could not open an incident on node %s: %s", self.shard, ctx.node.name, e)
            return payload
        self.log.info("shard %d: %s", self.shard, inc.get("summary"))
        return {**payload, "status": "recovering", "incident": inc, "recoveries_left": self.recoveries_left}

    def _resume_fields(self) -> dict:
        return {**super()._resume_fields(), "recoveries_left": self.recoveries_left}

    def _job_label(self) -> str:
        return f"shard {self.shard}"

    def _watch_args(self) -> list[str]:
        return ["--shard", str(self.shard)]

    def _job_name(self, ctx: RunContext) -> str:
        return f"shard {self.shard}/{ctx.cfg.capture.shards}"


class TrainWatchTrigger(_NodeJobWatchTrigger):
    """Watch the draft training job of a run."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "eagleflow.airflow.shard_watch.TrainWatchTrigger", self._serialize_common(
            {"run": self.run_data, "poll_interval_s": self.poll_interval_s})

    def _watch_args(self) -> list[str]:
        return ["--train"]

    def _job_label(self) -> str:
        return "training"

    def _job_name(self, ctx: RunContext) -> str:
        return "training"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
