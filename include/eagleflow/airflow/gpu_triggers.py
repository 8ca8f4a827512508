"""GpuIdleTrigger: waits in the triggerer until every selected GPU of the run's node is idle.

One node object (so one SSH connection) is held for the trigger's whole run;
every blocking call (SSH, NVML, reading the baseline) goes through
``asyncio.to_thread``. Connection or probe failures are retried with a bounded
backoff, reconnecting each time, and the last one becomes an event with its
message. ``serialize()`` round-trips every constructor argument, and the
deadline is an absolute time so a triggerer restart does not extend it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.runtime import RunContext


class GpuIdleTrigger(BaseTrigger):
    def __init__(self, run: dict[str, Any], end_at: float, poll_interval_s: float = 5.0, max_failures: int = 5):
        super().__init__()
        self.run_spec = run
        self.end_at = float(end_at)
        self.poll_interval_s = float(poll_interval_s)
        self.max_failures = int(max_failures)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"run": self.run_spec, "end_at": self.end_at, "poll_interval_s": self.poll_interval_s,
                 "max_failures": self.max_failures})

    async def run(self):
        from eagleflow.gpu.errors import GpuProbeError, NoGpuError
        from eagleflow.gpu.idle_gate import IdleGate
        from eagleflow.nodes import NodeError

        ctx = RunContext.from_serialized(self.run_spec["config"], self.run_spec["run_id"])
        gate = None
        failures = 0
        last_msg = None
        try:
            while True:
                try:
                    if gate is None:
                        gate = await asyncio.to_thread(IdleGate, ctx.node, ctx.cfg)
                    report = await asyncio.to_thread(gate.check)
                    failures = 0
                except NoGpuError as e:
                    yield TriggerEvent({"status": "no_gpu", "message": str(e)})
                    return
                except (GpuProbeError, NodeError, ValueError, OSError) as e:
                    failures += 1
                    self.log.warning("GPU reading failed (%d of %d): %s", failures, self.max_failures, e)
                    if failures >= self.max_failures or time.time() >= self.end_at:
                        yield TriggerEvent({"status": "error", "message": f"GPU reading failed {failures} time(s) "
                                                                          f"in a row; last: {e}"})
                        return
                    gate = None
                    await asyncio.to_thread(ctx.close)  # reconnect on the next try
                    await asyncio.sleep(min(self.poll_interval_s * 2 ** (failures - 1), 60.0))
                    continue
                if report.all_idle:
                    yield TriggerEvent({"status": "idle", "message": report.message()})
                    return
                msg = report.message()
                if msg != last_msg:
                    self.log.info("waiting for idle GPUs: %s", msg)
                    last_msg = msg
                if time.time() + self.poll_interval_s > self.end_at:
                    yield TriggerEvent({"status": "not_idle", "message": msg})
                    return
                await asyncio.sleep(self.poll_interval_s)
        finally:
            await asyncio.to_thread(ctx.close)
