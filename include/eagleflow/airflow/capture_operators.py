"""The capture phase in Airflow: start the server (setup), wait until ready, extract shards, stop (teardown), verify.

Each operator is a thin adapter over eagleflow.capture.lifecycle; everything
that touches the node goes through the run's Node.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from airflow.sdk import PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.base import RunOperator, RunSensor, default_deferrable
from eagleflow.airflow.capture_triggers import CaptureServerReadyTrigger
from eagleflow.airflow.fleet_operators import skip_if_handed_over
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_start import fault_before_start, first_watch_of_a_fault, retry_look, watch_recovers
from eagleflow.capture.lifecycle import (check_ready, start_capture_server, start_or_attach_worker,
                                         stop_capture_server, worker_role_pattern)
from eagleflow.nodes.process_record import RecordList
from eagleflow.phases import EXTRACT
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes import NodeError, NodeUnreachable
from eagleflow.watchdog.diagnosis import StallDiagnosis


class StartCaptureServerOperator(RunOperator):
    """Start the capture server detached on the node (kept if one is already running for this run)."""

    ui_color = "#d9f2e6"
    retry_advice = "The retry keeps a capture server of this run that is still alive, else starts one."

    def run(self, ctx, context):
        rec, _ = start_capture_server(ctx, log=self.log.info)
        return {"pid": rec.pid, "log_file": rec.log_file or str(ctx.layout.log_file("capture_server"))}


class CaptureServerReadySensor(RunSensor):
    """Ready when /health_generate answers (its info is the XCom); fails at once when the server died loading.

    The wait is bounded by the run's ``capture.ready_timeout_s``. ``deferrable`` (default: Airflow's
    ``[operators] default_deferrable``) waits in the triggerer; otherwise it pokes every ``poke_interval``.
    """

    def __init__(self, *, poke_interval: float = 2.0, **kw):
        super().__init__(poke_interval=poke_interval, **kw)

    def execute(self, context):
        ctx = RunContext.from_airflow(context)
        try:
            done = self._look(ctx)              # one cheap look first
            timeout_s = ctx.cfg.capture.ready_timeout_s
            ref = ctx.trigger_ref()
        finally:
            ctx.close()
        if done.is_done:
            return done.xcom_value
        if not self.deferrable:
            return super().execute(context)
        end_at = self.gate_started_at(context) + timeout_s
        self.log.info("capture server loading; deferring for up to %.0f s", timeout_s)
        self.defer(trigger=CaptureServerReadyTrigger(run=ref, end_at=end_at, poll_interval_s=self.poke_interval),
                   method_name="execute_complete", timeout=timedelta(seconds=timeout_s + 120))

    def poke(self, context):
        ctx = RunContext.from_airflow(context)
        try:
            done = self._look(ctx)
            if done.is_done:
                return done
            if time.time() >= self.gate_started_at(context) + ctx.cfg.capture.ready_timeout_s:
                raise AirflowFailException(
                    f"the capture server was not ready within {ctx.cfg.capture.ready_timeout_s:.0f} s; raise "
                    f"capture.ready_timeout_s if the model loads slowly, or read {ctx.layout.log_file('capture_server')}")
            return done
        finally:
            ctx.close()

    def _look(self, ctx: RunContext) -> PokeReturnValue:
        state, info, detail = check_ready(ctx, ctx.cfg.watchdog.health_timeout_s)
        if state in ("dead", "stuck"):   # gone, or ours but SIGSTOP'd/zombie: waiting cannot help
            raise AirflowFailException(detail)
        if state == "ready" and info is not None:   # a ready server has answered its info
            self._log_ready(info)
            return PokeReturnValue(is_done=True, xcom_value=info)
        self.log.info("capture server not ready yet: %s", detail)
        return PokeReturnValue(is_done=False)

    def _log_ready(self, info: dict) -> None:
        self.log.info("capture server ready at %s (model %s, aux layers %s)", info["url"], info.get("model"),
                      info.get("aux_layers"))

    def execute_complete(self, context, event: dict[str, Any]):
        if event.get("status") == "ready":
            self._log_ready(event["info"])
            return event["info"]
        raise AirflowFailException(event.get("detail") or f"capture server not ready: {event}")


class ExtractShardOperator(RunOperator):
    """Run one shard's extraction worker detached, then watch it until its manifest is complete.

    A re-run attaches to the shard's live worker (pid record + /proc start
    ticks) instead of starting a second one. A retry first looks (one watch
    look): a live, progressing worker is attached to; only a stuck or dead one
    lets the watchdog stop it and put the capture server back on its feet, and
    the shard resumes from the manifest.
    """

    ui_color = "#fdf2d0"
    retry_advice = ("The retry first looks at the shard: a live worker that progresses is kept; a stuck or dead "
                    "one is stopped and the capture server restarted once if unhealthy; then it resumes the shard "
                    "from its manifest: no stored sample is redone.")
    failure_advice = ("The shard's stored samples are kept; the hourly eagle3_shard_reconcile reruns it from its "
                      "manifest, or trigger that DAG now.")

    def __init__(self, *, shard: int, deferrable: bool | None = None, **kw):
        super().__init__(**kw)
        self.shard = shard
        # deferred: the watch runs in the triggerer; otherwise the same watch runs in this worker slot
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    def run(self, ctx, context):
        shard = int(self.shard)
        skip_if_handed_over(ctx, shard, "extract")   # a fleet node's group cleared after its hand-over
        ti = context.get("ti")
        try_number = getattr(ti, "try_number", None) or 1
        # a fault found before the worker starts (a retry's look blaming the server or the worker, the capture
        # server stopped, a zombie or gone) is mailed and recovered through the watch (eagleflow.airflow.shard_start)
        first = first_watch_of_a_fault(self._rewatch, ctx)
        look = self._look_before_retry(ctx, shard, try_number, first) if try_number > 1 else None
        fault = fault_before_start(ctx, shard, EXTRACT, first, self.log, look)
        if fault is not None:
            return self._watch(ctx, context, fault.to_dict())
        rec, attached = start_or_attach_worker(ctx, shard, log=self.log.info)
        self._log_progress(ctx, shard)
        trigger = self._rewatch(run=ctx.trigger_ref(), recoveries_left=ctx.cfg.watchdog.recoveries_in_watch)
        return self._watch(ctx, context, trigger)

    def _look_before_retry(self, ctx: RunContext, shard: int, try_number: int, first) -> StallDiagnosis | None:
        """A retry looks first: the try before may have died with the control plane, not with the shard.

        One look of the watch (``eagleflow watch --shard I --json``): a worker that is starting, healthy or
        slow is kept and attached to; a verdict of stalled, dead or failed blamed on the server or the worker is
        returned, a fault for the watch to mail and recover (``shard_start.fault_before_start``); any other
        (a full disk, the job's own error) lets the recovery stop the worker and restart an unhealthy server
        here. A look that gets no answer stops nothing.
        """
        diag = retry_look(ctx, shard, first, try_number, self.log)
        if diag is None:
            return None
        if diag.status is None or diag.verdict == "complete":
            self.log.info("shard %d: try %d attaches, nothing stopped: %s", shard, try_number, diag.summary)
            return None
        if watch_recovers(diag):
            return diag
        from eagleflow.watchdog.recovery import recover_before_retry
        self.log.info("shard %d: try %d, recovering before resuming from the manifest: %s", shard, try_number,
                      diag.summary)
        recover_before_retry(ctx, shard, self.log)
        return None

    def execute_complete(self, context, event: dict[str, Any]):
        ctx = RunContext.from_airflow(context)
        try:
            return self._watch(ctx, context, event)
        finally:
            ctx.close()

    def _rewatch(self, **kw):
        from eagleflow.airflow.shard_watch import ShardWatchTrigger
        return ShardWatchTrigger(shard=int(self.shard), **kw)

    def _watch(self, ctx: RunContext, context, start):
        """The watch (deferred or here) until its final event, each event through the one handler."""
        from eagleflow.airflow.watch_handler import follow_event, mail_and_recover, watch_to_the_end
        final = watch_to_the_end(self, context, start, lambda ev: follow_event(
            ev, ctx=ctx, context=context, log=self.log, rewatch=self._rewatch,
            recover=lambda raw, pending: mail_and_recover(ctx, context, raw, pending, shard=int(self.shard),
                                                          phase=EXTRACT, log=self.log)))
        return self._finish(ctx, final)

    def _finish(self, ctx: RunContext, final):
        """The watch's final event (its mails already tried): the shard's result, or the task fails."""
        from eagleflow.airflow.watch_handler import fail_with
        from eagleflow.watchdog.protocol import Complete
        shard = int(self.shard)
        try:
            self._log_progress(ctx, shard)
        except NodeUnreachable as e:   # the event's own verdict matters more than this log line
            self.log.warning("shard %d: progress not read: %s", shard, e)
        if isinstance(final, Complete):
            self.log.info("shard %d complete: %s", shard, final.summary)
            return {"shard": shard, "summary": final.summary}
        self.log.error("shard %d %s: %s", shard, final.kind, final.to_dict().get("diagnosis"))
        fail_with(final, f"shard {shard}")

    def _log_progress(self, ctx: RunContext, shard: int) -> None:
        text = ctx.node.read_text(str(ctx.layout.heartbeat_file(shard)))
        if text:
            try:
                self.log.info("%s", Heartbeat.from_json(text).progress_line())
            except (ValueError, TypeError, KeyError):
                self.log.warning("shard %d: unreadable heartbeat %s", shard, ctx.layout.heartbeat_file(shard))



class StopCaptureServerOperator(RunOperator):
    """Teardown: stop this run's live workers and the capture server (TERM, grace, KILL); remove its dumps."""

    def __init__(self, *, grace_s: float = 30.0, **kw):
        super().__init__(**kw)
        self.grace_s = grace_s

    def run(self, ctx, context):
        # every worker record of exactly this run (another run's id may start with this one's)
        records = ctx.node.run_json(ctx.node.process_record_argv(
            "list", "--pids-dir", str(ctx.layout.pids_dir), "--run-id", ctx.layout.run_id,
            "--role-pattern", worker_role_pattern()), RecordList, timeout=60)
        for st in records.records:
            if st.record is None:
                continue
            stopped = ctx.node.stop_recorded(st.record.pid_file, grace_s=self.grace_s)
            if stopped.outcome not in ("already_gone", "not_recorded"):
                self.log.warning("stopped a still-running extraction worker (%s): %s", st.record.role, stopped.detail)
        return stop_capture_server(ctx, grace_s=self.grace_s, log=self.log.info)


class VerifyHiddenStatesOperator(RunOperator):
    """Every sample of every shard stored and matching its manifest, or the run fails (no retry).

    Runs after the extraction whatever its outcome (trigger rule all_done), so
    a shard that failed all its tries is reported here with the others: the
    failure names each failed shard and its counts, and nothing downstream
    (training, export) runs. When the capture never started (an earlier task
    failed) it fails without a second alert: nothing was captured to verify.
    A pass leaves the verification record that training requires.
    """

    def __init__(self, *, check_digest: bool = True, plan_task_id: str = "plan_shards", **kw):
        super().__init__(**kw)
        self.check_digest = check_digest
        self.plan_task_id = plan_task_id

    def execute(self, context):
        ti = context.get("ti")
        if ti is not None and ti.xcom_pull(task_ids=self.plan_task_id) is None:
            from eagleflow.airflow.alerts import ConsequentialFailure
            raise ConsequentialFailure(f"nothing verified: the capture never ran ({self.plan_task_id} has no result "
                                       "because an earlier task failed; its own alert says why). Nothing is "
                                       "trained or exported for this run")
        return super().execute(context)

    def run(self, ctx, context):
        argv = ctx.eagleflow_argv("capture", "verify", "--json", *([] if self.check_digest else ["--no-digest"]))
        try:
            # exit 1 still carries the report: verification ran and found what is missing or damaged
            report = ctx.node.run_json(argv, dict[str, Any], timeout=None, answer_codes=(0, 1))
        except NodeError as e:
            raise AirflowFailException(f"hidden-state verification could not run: {e}") from None
        for shard in report["shards"]:
            self.log.info("shard %d: %d/%d stored and verified%s", shard["shard"], shard["stored"], shard["expected"],
                          "" if shard["stored"] == shard["expected"] else " <- FAILED")
        self.log.info("%s", report["summary"])
        if not report["ok"]:
            raise AirflowFailException(f"hidden-state verification failed on node {ctx.node.name}, so nothing is "
                                       f"trained or exported: {report['summary']}. Re-run the failed shard(s) "
                                       "(clear their extract_shard tasks and this one): each resumes from its "
                                       "manifest and repairs what it finds")
        return report["summary"]
