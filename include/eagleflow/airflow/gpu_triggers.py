"""GpuIdleTrigger: waits in the triggerer until every selected GPU of the run's node is idle.

Payload: the run's ``RunRef`` (connection, run-config.json on the node, run id), the absolute
wall-clock deadline ``end_at``, the sensor's poll interval, and ``select`` only for a gate on some of the
run's GPUs (the streaming trainer's); the run's GPU selection, baselines and thresholds come from the node's
frozen run-config.json; ``deferred_at``, when the task deferred: its event is held until
``defer_settle.DEFER_SETTLE_S`` after (Airflow's stale-report race).

One node object (so one SSH connection) is held for the trigger's whole run;
every blocking call (SSH, NVML, reading the baseline) goes through
``asyncio.to_thread``. Connection or probe failures are retried with a bounded
backoff, reconnecting each time, and the last one becomes an event with its
message. ``serialize()`` round-trips every constructor argument.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagleflow.airflow.defer_settle import first_event_settled
from eagleflow.airflow.runtime import RunContext, RunPayload, RunRef
from eagleflow.config import ConfigError
from eagleflow.gpu.errors import GpuProbeError, NoGpuError
from eagleflow.gpu.idle_gate import IdleGate
from eagleflow.nodes import NodeError


class GpuIdleTrigger(BaseTrigger):
    MAX_FAILURES = 5  # GPU readings failing in a row before the trigger gives up

    def __init__(self, run: RunPayload | RunRef, end_at: float, poll_interval_s: float = 5.0,
                 select: list[str] | None = None, deferred_at: float | None = None):
        super().__init__()
        self.deferred_at = None if deferred_at is None else float(deferred_at)
        self.run_ref = RunRef.from_dict(run)
        self.end_at = float(end_at)
        self.poll_interval_s = float(poll_interval_s)
        self.select = None if select is None else [str(g) for g in select]   # None: the run's gpu.select
        self.max_failures = self.MAX_FAILURES

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {"run": self.run_ref.to_dict(), "end_at": self.end_at,
                                  "poll_interval_s": self.poll_interval_s}
        if self.select is not None:           # a gate on some of the run's GPUs (the trainer's)
            kwargs["select"] = self.select
        if self.deferred_at is not None:
            kwargs["deferred_at"] = self.deferred_at
        return (f"{type(self).__module__}.{type(self).__qualname__}", kwargs)

    async def run(self):
        yield await first_event_settled(self._look(), self.deferred_at)

    async def _look(self):
        try:
            ctx = await asyncio.to_thread(RunContext.from_ref, self.run_ref)
        except (ConfigError, NodeError, OSError) as e:
            yield TriggerEvent({"status": "error", "message": f"cannot read the run's frozen config: {e}"})
            return
        gate = None
        failures = 0
        last_msg = None
        try:
            while True:
                try:
                    if gate is None:
                        gate = await asyncio.to_thread(IdleGate, ctx.node, ctx.cfg, None, self.select)
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
