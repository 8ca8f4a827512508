"""What every eagleflow operator shares: its run's config, layout and node; deferral; gate deadlines."""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from airflow.providers.common.compat.sdk import conf
from airflow.sdk import BaseOperator, BaseSensorOperator
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.runtime import RUN_CONFIG_XCOM_KEY, RunContext
from eagleflow.config import ConfigError


def default_deferrable() -> bool:
    """Airflow's ``[operators] default_deferrable`` (AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE), read when a DAG is parsed."""
    return conf.getboolean("operators", "default_deferrable", fallback=False)




def run_trigger_here(trigger) -> dict:
    """The trigger's one event, waited for in this worker slot: what a non-deferrable operator does instead
    of deferring, so both modes run the same watch."""
    async def first() -> dict:
        async for ev in trigger.run():
            return ev.payload
        raise RuntimeError(f"{type(trigger).__name__} ended without an event")
    return asyncio.run(first())


class RunOperator(BaseOperator):
    """An operator of the eagle3 pipeline. Subclasses implement ``run(ctx, context)``.

    ``freezes_run_config = True`` marks the DAG's first task: it resolves the config from the YAML and the
    Params once and pushes the frozen copy that every later task and callback of the run reads.
    """

    ui_color = "#e8f1fb"
    freezes_run_config = False

    def __init__(self, *, fleet_node: str | None = None, **kw):
        super().__init__(**kw)
        self.fleet_node = fleet_node   # the fleet node this task talks to; None: the training node

    def execute(self, context):
        try:
            ctx = RunContext.resolve_for(context) if self.freezes_run_config else RunContext.from_airflow(context)
        except ConfigError as e:   # a bad config or Param fails at once: a retry would read the same input
            raise AirflowFailException(str(e)) from None
        try:
            result = self.run(ctx, context)
        except ConfigError as e:
            raise AirflowFailException(str(e)) from None
        finally:
            ctx.close()
        if self.freezes_run_config:  # only a try that succeeded freezes the config for the run
            context["ti"].xcom_push(key=RUN_CONFIG_XCOM_KEY, value=ctx.frozen())
        return result

    def run(self, ctx: RunContext, context):  # pragma: no cover - abstract
        raise NotImplementedError


class RunSensor(BaseSensorOperator):
    """A sensor over the run's node with a gate deadline from the run's config (e.g. ``gpu.idle_timeout_s``).

    ``deferrable`` (default ``[operators] default_deferrable``) waits in the triggerer; otherwise the
    sensor pokes in ``mode`` (poke or reschedule) every ``poke_interval``. Its own ``timeout`` and
    ``poke_interval`` are what the DAG gave it: nothing is rewritten at run time. The gate deadline is a
    wall-clock time from the first poke of this try (reschedule mode: the first reschedule).
    """

    def __init__(self, *, deferrable: bool | None = None, fleet_node: str | None = None, **kw):
        kw.setdefault("timeout", 24 * 3600.0)  # a ceiling: the gate's own deadline (from config) fires first
        super().__init__(**kw)
        self.fleet_node = fleet_node   # the fleet node this sensor polls; None: the training node
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self._poke_started: float | None = None

    def gate_started_at(self, context) -> float:
        """Wall-clock start of this try's wait (epoch seconds)."""
        if self.reschedule:
            first = context["ti"].get_first_reschedule_date(context)
            if first is not None:
                return first.timestamp()
            return datetime.now(timezone.utc).timestamp()
        if self._poke_started is None:
            self._poke_started = time.time()
        return self._poke_started
