"""The generation phase in Airflow: serving-mode server (setup), shards under the stall watch, server stop (teardown).

Every operator is a logged no-op success when ``generate.enabled`` is off, so
the DAG's wiring stays one shape and the corpus phase after it runs as before.
A generation shard is watched by the extraction's own watch
(``ShardWatchTrigger`` with phase generate, node-side ``eagleflow watch --shard I --phase generate``):
the worker writes the same heartbeat and manifest, so the verdicts (stalled,
dead, failed) and their evidence are the same, and so is the recovery: a stall
blamed on the generation server or the worker is recovered in the watch
(``watchdog.recovery.recover_in_watch`` with phase generate: the incident
opened and mailed, the server restarted once per incident, the worker started
again from its manifest, RECOVERED mailed when the shard stores again). Only
when that fails, or the watch's recoveries are spent, does the task fail with
the diagnosis; the retry then resumes the shard from its manifest, after
stopping a server the stall was blamed on (hung but alive) and the shard's
worker by their records. A server found stopped (state T), a zombie or gone
before a shard starts, or a retry's first look finding the shard stalled on
its server or worker, is a fault like the watch's: incident, mail, recovery
through the watch, RECOVERED (``eagleflow.airflow.shard_start``).
"""
from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from eagleflow.airflow.base import RunOperator, default_deferrable
from eagleflow.airflow.fleet_operators import skip_if_handed_over
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_start import fault_before_start, first_watch_of_a_fault, retry_look
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.generate.lifecycle import (SERVER_ROLE, GenerateServerDied, check_ready, record_server_stall,
                                          start_generate_server, start_or_attach_generate_worker, stop_after_server_stall,
                                          stop_generate_server, wait_generate_server_ready)
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes.process_record import RecordList
from eagleflow.phase_jobs import ServerNotReady, ServerStuck
from eagleflow.phases import GENERATE, KINDS

OFF = "generate.enabled is off: the sources are tokenised as they are"


class StartGenerateServerOperator(RunOperator):
    """Setup: the target in serving mode (kept when one of this run is alive), then wait until it answers."""

    ui_color = "#e0ecff"

    def run(self, ctx, context):
        if not ctx.cfg.generate.enabled:
            self.log.info("%s", OFF)
            return None
        rec, _ = start_generate_server(ctx, log=self.log.info)
        try:
            info = wait_generate_server_ready(ctx, log=self.log.info)
        except ServerNotReady as e:
            raise AirflowFailException(str(e)) from None
        return {"pid": rec.pid, "url": info.get("url")}


class PlanGenerateShardsOperator(RunOperator):
    """The shard numbers this node's ``generate_responses`` is mapped over: all of them on a single node, its
    share (in proportion to its GPU slots, eagleflow.fleet.assign) on a fleet node; one no-op shard when the
    phase is off."""

    def run(self, ctx, context):
        if not ctx.cfg.generate.enabled:
            return [0]
        from eagleflow.airflow.pipeline_operators import plan_node_shards
        return plan_node_shards(ctx, "generate", self.log)


class GenerateShardOperator(RunOperator):
    """One generation shard: its detached worker (started or attached to), watched until complete."""

    ui_color = "#e8f0fb"
    retry_advice = "The retry resumes the shard from its manifest (finished records are kept, never redone)."

    def __init__(self, *, shard: int, deferrable: bool | None = None, **kw):
        super().__init__(**kw)
        self.shard = shard
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    def run(self, ctx, context):
        if not ctx.cfg.generate.enabled:
            self.log.info("%s", OFF)
            return None
        shard = int(self.shard)
        skip_if_handed_over(ctx, shard, "generate")   # a fleet node's group cleared after its hand-over
        # a retry's first look finding the shard stalled, dead or failed on its server or worker, or the server
        # stopped (state T), a zombie or gone: a fault like one the watch finds, mailed and recovered through the
        # watch (eagleflow.airflow.shard_start), never restarted silently
        try_number = getattr(context.get("ti"), "try_number", None) or 1
        first = first_watch_of_a_fault(self._rewatch, ctx)
        look = retry_look(ctx, shard, first, try_number, self.log) if try_number > 1 else None
        fault = fault_before_start(ctx, shard, GENERATE, first, self.log, look)
        if fault is not None:
            return self._watch(ctx, context, fault.to_dict())
        stop_after_server_stall(ctx, shard, log=self.log.warning)   # restarts it once if it is the stalled one
        state, _, detail = check_ready(ctx, ctx.cfg.watchdog.health_timeout_s)
        if state != "ready":   # loading: attach, never run ahead of it (stuck or gone since the look: the retry)
            self.log.warning("generate shard %d: %s; starting (or attaching to) the generation server", shard, detail)
            start_generate_server(ctx, log=self.log.info)
            try:
                wait_generate_server_ready(ctx, log=self.log.info)
            except (GenerateServerDied, ServerStuck) as e:   # e.g. another shard's retry restarted it, or it was
                # stopped while this try waited: the retry starts (or restarts) it
                raise AirflowException(f"generate shard {shard}: the generation server failed while this try "
                                       f"waited for it ({e}); the retry starts it again") from None
            except ServerNotReady as e:
                raise AirflowFailException(str(e)) from None
        start_or_attach_generate_worker(ctx, shard, log=self.log.info)
        return self._watch(ctx, context, self._rewatch(run=ctx.trigger_ref(),
                                                       recoveries_left=ctx.cfg.watchdog.recoveries_in_watch))

    def execute_complete(self, context, event: dict[str, Any]):
        ctx = RunContext.from_airflow(context)
        try:
            return self._watch(ctx, context, event)
        finally:
            ctx.close()

    def _rewatch(self, **kw):
        return ShardWatchTrigger(shard=int(self.shard), phase=GENERATE, **kw)

    def _watch(self, ctx, context, start):
        """The watch (deferred or here) until its final event, each event through the one handler, a stall
        recovered in the watch as an extraction shard's is (the one ``mail_and_recover``)."""
        from eagleflow.airflow.watch_handler import fail_with, follow_event, mail_and_recover, watch_to_the_end
        from eagleflow.watchdog.protocol import Complete
        final = watch_to_the_end(self, context, start, lambda ev: follow_event(
            ev, ctx=ctx, context=context, log=self.log, rewatch=self._rewatch,
            recover=lambda raw, pending: mail_and_recover(ctx, context, raw, pending, shard=int(self.shard),
                                                          phase=GENERATE, log=self.log)))
        shard = int(self.shard)
        text = ctx.node.read_text(str(ctx.layout.generate_shard_dir(shard) / "heartbeat.json"))
        if text:
            self.log.info("%s", Heartbeat.from_json(text).progress_line())
        if isinstance(final, Complete):
            return {"shard": shard, "summary": final.summary}
        if record_server_stall(ctx, shard, final.to_dict()):
            self.log.warning("generate shard %d: the stall is blamed on the generation server: the retry stops "
                             "and restarts it", shard)
        fail_with(final, f"generate shard {shard}")


class StopGenerateServerOperator(RunOperator):
    """Teardown: stop this run's live generation workers and the generation server, before capture starts."""

    def __init__(self, *, grace_s: float = 30.0, **kw):
        super().__init__(**kw)
        self.grace_s = grace_s

    def run(self, ctx, context):
        records = ctx.node.run_json(ctx.node.process_record_argv(
            "list", "--pids-dir", str(ctx.layout.pids_dir), "--run-id", ctx.layout.run_id,
            "--role-pattern", KINDS[GENERATE].worker_role_pattern()), RecordList, timeout=60)
        for st in records.records:
            if st.record is not None:
                stopped = ctx.node.stop_recorded(st.record.pid_file, grace_s=self.grace_s)
                if stopped.outcome not in ("already_gone", "not_recorded"):
                    self.log.warning("stopped a still-running generation worker (%s): %s", st.record.role,
                                     stopped.detail)
        if ctx.node.process_status(str(ctx.layout.pid_file(SERVER_ROLE))).recorded or ctx.cfg.generate.enabled:
            return stop_generate_server(ctx, grace_s=self.grace_s, log=self.log.info)
        return None
