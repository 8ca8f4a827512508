"""The trigger behind CaptureServerReadySensor: poll the capture server until /health_generate answers.

One event: {"status": "ready", "info": {...}} | {"status": "dead", "detail": str}
| {"status": "timeout", "detail": str}. Each poll is one ``check_ready`` (pid
record + info file + one real generation), run off the event loop.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.runtime import RunContext
from eagleflow.capture.lifecycle import check_ready
from eagleflow.nodes import NodeError


class CaptureServerReadyTrigger(BaseTrigger):
    def __init__(self, run: dict[str, Any], timeout_s: float, poll_interval_s: float = 2.0):
        super().__init__()
        self.run_data = run
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("eagleflow.airflow.capture_triggers.CaptureServerReadyTrigger",
                {"run": self.run_data, "timeout_s": self.timeout_s, "poll_interval_s": self.poll_interval_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        ctx = RunContext.from_serialized(self.run_data["config"], self.run_data["run_id"])
        deadline = time.monotonic() + self.timeout_s
        detail = "not polled yet"
        try:
            while True:
                try:
                    state, info, detail = await asyncio.to_thread(check_ready, ctx, ctx.cfg.watchdog.health_timeout_s)
                except NodeError as e:      # the node is briefly unreachable: keep polling until the deadline
                    state, info, detail = "loading", None, f"node {ctx.node.name} unreachable: {e}"
                if state == "ready":
                    yield TriggerEvent({"status": "ready", "info": info})
                    return
                if state == "dead":
                    yield TriggerEvent({"status": "dead", "detail": detail})
                    return
                if time.monotonic() >= deadline:
                    yield TriggerEvent({"status": "timeout", "detail": (
                        f"the capture server was not ready within {self.timeout_s:.0f} s ({detail}); raise "
                        f"capture.ready_timeout_s if the model loads slowly, or read {ctx.layout.log_file('capture_server')}")})
                    return
                self.log.info("capture server not ready yet: %s", detail)
                await asyncio.sleep(self.poll_interval_s)
        finally:
            await asyncio.to_thread(ctx.close)
