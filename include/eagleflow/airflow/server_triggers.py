"""The trigger behind ServerReadySensor: poll a sharded phase's server until /health_generate answers.

Payload: the run's ``RunRef`` (connection, run-config.json on the node, run id), an absolute wall-clock
deadline ``end_at`` (epoch seconds, so a triggerer restart neither extends nor resets it), the
sensor's poll interval, the phase (its name; its descriptor's lifecycle says how to look) and when the task
deferred (``deferred_at``: its event is held until ``defer_settle.DEFER_SETTLE_S`` after, Airflow's stale-report
race). The config itself is read from the node's frozen run-config.json.

One event: {"status": "ready", "info": {...}} | {"status": "dead" | "stuck", "detail": str}
| {"status": "timeout", "detail": str} ("stuck": ours but SIGSTOP'd or a zombie, told at once). Each poll is one ``check_ready`` (pid
record + info file + one real generation), run off the event loop.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, AsyncIterator, Literal, TypedDict

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.defer_settle import first_event_settled
from eagleflow.airflow.runtime import RunContext, RunPayload, RunRef
from eagleflow.config import ConfigError
from eagleflow.nodes import NodeError
from eagleflow.phases import EXTRACT, kind_of


class ServerReadyEvent(TypedDict, total=False):
    """The trigger's one event: ready with the server's info file, or why not (dead, stuck, timeout)."""
    status: Literal["ready", "dead", "stuck", "timeout"]
    info: dict[str, Any]
    detail: str


class ServerReadyTrigger(BaseTrigger):
    def __init__(self, run: RunPayload | RunRef, end_at: float, poll_interval_s: float = 2.0, phase: str = EXTRACT,
                 deferred_at: float | None = None):
        super().__init__()
        self.deferred_at = None if deferred_at is None else float(deferred_at)
        self.run_ref = RunRef.from_dict(run)
        self.end_at = float(end_at)
        self.poll_interval_s = float(poll_interval_s)
        self.kind = kind_of(phase)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"run": self.run_ref.to_dict(), "end_at": self.end_at, "poll_interval_s": self.poll_interval_s,
                 "phase": self.kind.phase, **({"deferred_at": self.deferred_at} if self.deferred_at is not None else {})})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield await first_event_settled(self._look(), self.deferred_at)

    async def _look(self) -> AsyncGenerator[TriggerEvent, None]:
        try:
            ctx = await asyncio.to_thread(RunContext.from_ref, self.run_ref)
        except (ConfigError, NodeError, OSError) as e:
            yield TriggerEvent({"status": "dead", "detail": f"cannot read the run's frozen config: {e}"})
            return
        detail = "not polled yet"
        kind, check_ready = self.kind, self.kind.lifecycle().check_ready
        try:
            while True:
                try:
                    state, info, detail = await asyncio.to_thread(check_ready, ctx, ctx.cfg.watchdog.health_timeout_s)
                except NodeError as e:      # the node is briefly unreachable: keep polling until the deadline
                    state, info, detail = "loading", None, f"node {ctx.node.name} unreachable: {e}"
                if state == "ready":
                    yield TriggerEvent({"status": "ready", "info": info})
                    return
                if state in ("dead", "stuck"):
                    yield TriggerEvent({"status": state, "detail": detail})
                    return
                if time.time() >= self.end_at:
                    yield TriggerEvent({"status": "timeout", "detail": (
                        f"the {kind.server} was not ready within {ctx.cfg.server.ready_timeout_s:.0f} s ({detail}); "
                        f"raise server.ready_timeout_s if the model loads slowly, or read "
                        f"{ctx.layout.log_file(kind.server_role)}")})
                    return
                self.log.info("%s not ready yet: %s", kind.server, detail)
                await asyncio.sleep(max(0.0, min(self.poll_interval_s, self.end_at - time.time())))
        finally:
            await asyncio.to_thread(ctx.close)
