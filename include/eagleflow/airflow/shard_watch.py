"""Triggers that watch a detached node job (an extraction shard, the trainer) until it ends or stalls.

Each poll is ONE node-side command, ``eagleflow watch --shard I --json`` (or
``--train``): over SSH that is one round trip, and the node keeps the
watcher's memory (when a D state was first seen, the GPU window) in a small
state file, so the trigger itself holds no state a triggerer restart would lose.

Polls are paced from their start: the next one begins ``poll_interval_s``
after the previous began (or at once if it took longer). The server is asked
for health only once progress is stale, so polls before that are quick; the
detecting poll starts at most one interval after progress turned stale and
lasts at most the health timeout plus the command's cost (~2 s). Hence the
time from the last progress to the event is at most
``WatchdogConfig.detection_bound_s`` = stall_after + poll_interval +
max(poll_interval, health_timeout + 2 s), which is the issue's
``stall_after_s + 2 x poll_interval_s`` whenever the health check fits in a poll.

Every trigger yields exactly one event:
``{"status": "complete", "summary": str}`` or
``{"status": "stalled"|"dead"|"failed", "verdict": str, "diagnosis": str, "subject": str}``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.runtime import RunContext, RunRef
from eagleflow.nodes import NodeError
from eagleflow.watchdog.diagnosis import StallDiagnosis

WATCH_ANSWER_CODES = (0, 3, 4, 5, 6)  # `eagleflow watch` exit codes that come with a diagnosis


class _NodeJobWatchTrigger(BaseTrigger):
    """Shared loop: run the node-side watch command, turn its verdict into one event."""

    def __init__(self, run: dict[str, Any], poll_interval_s: float | None = None):
        super().__init__()
        self.run_data = RunRef.from_dict(run).to_dict()  # 0.1.0 payloads carried the whole config
        self.poll_interval_s = poll_interval_s

    # -- what subclasses say ------------------------------------------------
    def _watch_args(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _job_name(self, ctx: RunContext) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- the loop -----------------------------------------------------------
    async def run(self) -> AsyncIterator[TriggerEvent]:
        ctx = await asyncio.to_thread(RunContext.from_serialized, self.run_data)  # reads run-config.json on the node
        wd = ctx.cfg.watchdog
        interval = self.poll_interval_s or wd.poll_interval_s
        # The node can be unreachable for a while (SSH hiccup) without the job being at fault;
        # past this long we cannot vouch for it any more and say so.
        unreachable_limit = wd.stall_after_s + 2 * interval
        first_failure: float | None = None
        try:
            while True:
                started = time.monotonic()
                try:
                    diag = await asyncio.to_thread(self._observe, ctx)
                    first_failure = None
                except (NodeError, ValueError) as e:
                    now = time.monotonic()
                    first_failure = first_failure or now
                    self.log.warning("watching %s on node %s failed: %s", self._job_name(ctx), ctx.node.name, e)
                    if now - first_failure >= unreachable_limit:
                        yield TriggerEvent(self._unreachable_event(ctx, now - first_failure, str(e)))
                        return
                else:
                    self.log.info("%s", diag.summary)
                    if diag.status is not None:
                        yield TriggerEvent(diag.event_payload())
                        return
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        finally:
            await asyncio.to_thread(ctx.close)

    def _observe(self, ctx: RunContext) -> StallDiagnosis:
        """One node-side `eagleflow watch ... --json` call (blocking; run off the event loop)."""
        wd = ctx.cfg.watchdog
        argv = ctx.eagleflow_argv("watch", *self._watch_args(), "--json")
        # exit 0 healthy/complete, 3 slow, 4 stalled, 5 dead, 6 failed: each carries the diagnosis
        return ctx.node.run_json(argv, StallDiagnosis, timeout=wd.health_timeout_s + 60, answer_codes=WATCH_ANSWER_CODES)

    def _unreachable_event(self, ctx: RunContext, for_s: float, error: str) -> dict:
        job = self._job_name(ctx)
        subject = f"[eagleflow] UNREACHABLE {job} on {ctx.node.name}"
        diagnosis = (f"UNREACHABLE {job} on {ctx.node.name}: the watch command has failed for {for_s:.0f} s, "
                     f"so the job's health is unknown; last error: {error}. Check the node connection "
                     f"(node.conn_id={ctx.cfg.node.conn_id!r}) and that eagleflow is installed there.")
        return {"status": "failed", "verdict": "unreachable", "diagnosis": diagnosis, "subject": subject}


class ShardWatchTrigger(_NodeJobWatchTrigger):
    """Watch extraction shard ``shard`` of a run until it completes, stalls, dies or fails."""

    def __init__(self, run: dict[str, Any], shard: int, poll_interval_s: float | None = None):
        super().__init__(run, poll_interval_s)
        self.shard = shard

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("eagleflow.airflow.shard_watch.ShardWatchTrigger",
                {"run": self.run_data, "shard": self.shard, "poll_interval_s": self.poll_interval_s})

    def _watch_args(self) -> list[str]:
        return ["--shard", str(self.shard)]

    def _job_name(self, ctx: RunContext) -> str:
        return f"shard {self.shard}/{ctx.cfg.capture.shards}"


class TrainWatchTrigger(_NodeJobWatchTrigger):
    """Watch the draft training job of a run."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("eagleflow.airflow.shard_watch.TrainWatchTrigger",
                {"run": self.run_data, "poll_interval_s": self.poll_interval_s})

    def _watch_args(self) -> list[str]:
        return ["--train"]

    def _job_name(self, ctx: RunContext) -> str:
        return "training"
