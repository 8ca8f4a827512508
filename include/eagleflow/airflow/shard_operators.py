"""Every sharded phase in Airflow, one set of operators: start its server (setup), wait until it answers, plan
its shards, run each shard under the stall watch, stop its server (teardown); and ``phase_tasks``, the one call
that wires a phase's chain on a node.

Each operator takes the phase's name (``phase``: a plain value, so a mapped task's partial kwargs and the DAG's
serialisation keep it) and works from its descriptor (``eagleflow.phases.ShardKind``): its names and task ids,
its server's role, its switch, and its lifecycle (``ShardKind.lifecycle()``: start, readiness, stop, worker,
what a retry does first), so nothing here names a phase. A phase switched off (``ShardKind.enabled``) makes
each operator a logged no-op success, so the DAG keeps one shape.

A shard is watched by the one watch (``ShardWatchTrigger`` with its phase, node-side ``eagleflow watch --shard I
--phase P``): a stall blamed on the phase's server or the worker is recovered in the watch
(``watchdog.recovery.recover_in_watch``: the incident opened and mailed, the server restarted once per incident,
the worker started again from its manifest, RECOVERED mailed when the shard stores again). Only when that
fails, or the watch's recoveries are spent, does the task fail with the diagnosis; the retry then looks first
and resumes the shard from its manifest. A server found stopped (state T), a zombie or gone before a shard
starts, or a retry's first look finding the shard stalled on its server or worker, is a fault like the
watch's: incident, mail, recovery through the watch, RECOVERED (``eagleflow.airflow.shard_start``).

How a phase's shard meets its server is the descriptor's ``shard_starts_server``: on, the shard's try clears a
server stall its last try left (``before_retry``) and makes sure the server answers before its worker starts
(generation: its start task waits for the server too); off, the worker waits for the server by itself, a
separate sensor (``ready_task``) waits for it after the start, and ``before_retry`` runs only when a retry's
look found a fault the watch does not recover (extraction: stop the worker, restart an unhealthy server).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from airflow.sdk import PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from eagleflow.airflow.base import RunOperator, RunSensor, default_deferrable
from eagleflow.airflow.defer_settle import look_before_deferring
from eagleflow.airflow.fleet_operators import PREPARE_TASK, CollectShardsOperator, skip_if_handed_over
from eagleflow.airflow.gpu_operators import FreeGpusOperator, GpuIdleSensor
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.server_triggers import ServerReadyEvent, ServerReadyTrigger
from eagleflow.airflow.shard_start import fault_before_start, first_watch_of_a_fault, retry_look, watch_recovers
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes import NodeUnreachable
from eagleflow.nodes.process_record import RecordList
from eagleflow.phase_jobs import ServerNotReady
from eagleflow.phases import ShardKind, kind_of
from eagleflow.watchdog.protocol import EventPayload
from eagleflow.airflow.pipeline_operators import plan_node_shards
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.airflow.watch_handler import fail_with, follow_event, mail_and_recover, watch_to_the_end
from eagleflow.watchdog.protocol import Complete


def off_note(kind: ShardKind) -> str:
    return f"{kind.enabled_field} is off: no {kind.noun} in this run, so this task has nothing to do"


class PhaseOperator(RunOperator):
    """An operator of one sharded phase: ``phase`` names its descriptor (``phases.KINDS``)."""

    def __init__(self, *, phase: str, **kw):
        super().__init__(**kw)
        self.phase = kind_of(phase).phase   # a plain value; refuses an unknown phase, naming the known ones

    @property
    def kind(self) -> ShardKind:
        return kind_of(self.phase)

    def phase_off(self, ctx: RunContext) -> bool:
        """True (logged) when the run switched the phase off: the task is a no-op success."""
        if self.kind.enabled(ctx.cfg):
            return False
        self.log.info("%s", off_note(self.kind))
        return True


class StartServerOperator(PhaseOperator):
    """Setup: the phase's server started detached on the node (kept if one of this run is alive); when the phase
    has no readiness sensor (``ready_task`` None), it also waits until the server answers."""

    ui_color = "#d9f2e6"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.retry_advice = f"The retry keeps a {self.kind.server} of this run that is still alive, else starts one."

    def run(self, ctx, context):
        if self.phase_off(ctx):
            return None
        kind, life = self.kind, self.kind.lifecycle()
        rec, _ = life.start_server(ctx, log=self.log.info)
        out = {"pid": rec.pid, "log_file": rec.log_file or str(ctx.layout.log_file(kind.server_role))}
        if kind.ready_task is None:
            try:
                info = life.wait_server_ready(ctx, log=self.log.info)
            except ServerNotReady as e:
                raise AirflowFailException(str(e)) from None
            out["url"] = info.get("url")
        return out


class ServerReadySensor(RunSensor):
    """Ready when the phase's server answers /health_generate (its info is the XCom); fails at once when the
    server died loading or is stuck.

    The wait is bounded by the run's ``server.ready_timeout_s``. ``deferrable`` (default: Airflow's
    ``[operators] default_deferrable``) waits in the triggerer; otherwise it pokes every ``poke_interval``.
    """

    def __init__(self, *, phase: str, poke_interval: float = 2.0, **kw):
        super().__init__(poke_interval=poke_interval, **kw)
        self.phase = kind_of(phase).phase

    @property
    def kind(self) -> ShardKind:
        return kind_of(self.phase)

    def execute(self, context):
        ctx = RunContext.from_airflow(context)
        try:
            # one cheap look first; deferring, a few (defer_settle: a server ready right after would race)
            done = look_before_deferring(lambda: self._look(ctx), lambda d: d.is_done, self.poke_interval,
                                         window_s=None if self.deferrable else 0.0)
            timeout_s = ctx.cfg.server.ready_timeout_s
            ref = ctx.trigger_ref()
        finally:
            ctx.close()
        if done.is_done:
            return done.xcom_value
        if not self.deferrable:
            return super().execute(context)
        end_at = self.gate_started_at(context) + timeout_s
        self.log.info("%s loading; deferring for up to %.0f s", self.kind.server, timeout_s)
        self.defer(trigger=ServerReadyTrigger(run=ref, end_at=end_at, poll_interval_s=self.poke_interval,
                                              phase=self.phase, deferred_at=time.time()),
                   method_name="execute_complete", timeout=timedelta(seconds=timeout_s + 120))

    def poke(self, context):
        ctx = RunContext.from_airflow(context)
        try:
            done = self._look(ctx)
            if done.is_done:
                return done
            if time.time() >= self.gate_started_at(context) + ctx.cfg.server.ready_timeout_s:
                raise AirflowFailException(
                    f"the {self.kind.server} was not ready within {ctx.cfg.server.ready_timeout_s:.0f} s; raise "
                    f"server.ready_timeout_s if the model loads slowly, or read "
                    f"{ctx.layout.log_file(self.kind.server_role)}")
            return done
        finally:
            ctx.close()

    def _look(self, ctx: RunContext) -> PokeReturnValue:
        state, info, detail = self.kind.lifecycle().check_ready(ctx, ctx.cfg.watchdog.health_timeout_s)
        if state in ("dead", "stuck"):   # gone, or ours but SIGSTOP'd/zombie: waiting cannot help
            raise AirflowFailException(detail)
        if state == "ready" and info is not None:   # a ready server has answered its info
            self._log_ready(info)
            return PokeReturnValue(is_done=True, xcom_value=info)
        self.log.info("%s not ready yet: %s", self.kind.server, detail)
        return PokeReturnValue(is_done=False)

    def _log_ready(self, info: dict) -> None:
        self.log.info("%s ready at %s (model %s, aux layers %s)", self.kind.server, info["url"], info.get("model"),
                      info.get("aux_layers"))

    def execute_complete(self, context, event: ServerReadyEvent):
        if event.get("status") == "ready":
            self._log_ready(event["info"])
            return event["info"]
        raise AirflowFailException(event.get("detail") or f"{self.kind.server} not ready: {event}")


class PlanShardsOperator(PhaseOperator):
    """The shard numbers this node's shard task is mapped over: all of them on a single node, its share (in
    proportion to its GPU slots, eagleflow.fleet.assign) on a fleet node; one no-op shard when the phase is off."""

    def run(self, ctx, context):
        if not self.kind.enabled(ctx.cfg):
            return [0]
        return plan_node_shards(ctx, self.kind, self.log)


class ShardOperator(PhaseOperator):
    """One shard of a phase: its detached worker (started, or attached to when it still runs: pid record + /proc
    start ticks), watched until its manifest is complete.

    A retry first looks (one watch look): a live, progressing worker is attached to; a fault the watch recovers
    (the server or the worker) goes through the watch; any other lets the phase's ``before_retry`` act (see the
    module's doc), and the shard resumes from its manifest.
    """

    ui_color = "#fdf2d0"
    failure_advice = ("The shard's stored units are kept; the hourly eagle3_shard_reconcile reruns it from its "
                      "manifest, or trigger that DAG now.")

    def __init__(self, *, shard: int, deferrable: bool | None = None, **kw):
        super().__init__(**kw)
        self.shard = shard
        self.retry_advice = self.kind.retry_advice
        # deferred: the watch runs in the triggerer; otherwise the same watch runs in this worker slot
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    def run(self, ctx, context):
        if self.phase_off(ctx):
            return None
        kind, life = self.kind, self.kind.lifecycle()
        shard = int(self.shard)
        skip_if_handed_over(ctx, shard, kind)   # a fleet node's group cleared after its hand-over
        try_number = getattr(context.get("ti"), "try_number", None) or 1
        # a fault found before the worker starts (a retry's look blaming the server or the worker, the server
        # stopped, a zombie or gone) is mailed and recovered through the watch (eagleflow.airflow.shard_start)
        first = first_watch_of_a_fault(self._rewatch, ctx)
        look = retry_look(ctx, shard, first, try_number, self.log) if try_number > 1 else None
        if look is not None and not kind.shard_starts_server and not watch_recovers(look):
            if look.status is None or look.verdict == "complete":
                self.log.info("%s %d: try %d attaches, nothing stopped: %s", kind.watch_name, shard, try_number,
                              look.summary)
            else:   # e.g. a full disk, the job's own error: the phase's recovery before resuming from the manifest
                self.log.info("%s %d: try %d, recovering before resuming from the manifest: %s", kind.watch_name,
                              shard, try_number, look.summary)
                life.before_retry(ctx, shard, self.log)
            look = None
        fault = fault_before_start(ctx, shard, kind, first, self.log, look)
        if fault is not None:
            return self._watch(ctx, context, fault.to_dict())
        if kind.shard_starts_server:
            self._server_answering(ctx, shard)
        life.start_worker(ctx, shard, log=self.log.info)
        self._log_progress(ctx, shard)
        return self._watch(ctx, context, self._rewatch(run=ctx.trigger_ref(),
                                                       recoveries_left=ctx.cfg.watchdog.recoveries_in_watch))

    def _server_answering(self, ctx: RunContext, shard: int) -> None:
        """A phase whose shard meets its server itself: a stall its last try blamed on the server cleared (the
        server restarted once, if still the one that stalled); a loading server waited for, never run ahead of;
        one gone since the check started again. A server that died or is stuck while waited for fails the try
        (the retry starts it again); one that never got ready fails the task."""
        kind, life = self.kind, self.kind.lifecycle()
        life.before_retry(ctx, shard, self.log)
        state, _, detail = life.check_ready(ctx, ctx.cfg.watchdog.health_timeout_s)
        if state == "ready":
            return
        self.log.warning("%s %d: %s; starting (or attaching to) the %s", kind.watch_name, shard, detail, kind.server)
        life.start_server(ctx, log=self.log.info)
        try:
            life.wait_server_ready(ctx, log=self.log.info)
        except ServerNotReady as e:
            if type(e) is ServerNotReady:   # the wait ran out: a person looks
                raise AirflowFailException(str(e)) from None
            # died or stuck (a subclass), e.g. another shard's retry restarted it, or it was stopped while this try
            # waited: the retry starts (or restarts) it
            raise AirflowException(f"{kind.watch_name} {shard}: the {kind.server} failed while this try waited "
                                   f"for it ({e}); the retry starts it again") from None

    def execute_complete(self, context, event: EventPayload):
        ctx = RunContext.from_airflow(context)
        try:
            return self._watch(ctx, context, event)
        finally:
            ctx.close()

    def _rewatch(self, **kw):
        return ShardWatchTrigger(shard=int(self.shard), phase=self.phase, **kw)

    def _watch(self, ctx: RunContext, context, start):
        """The watch (deferred or here) until its final event, each event through the one handler."""
        final = watch_to_the_end(self, context, start, lambda ev: follow_event(
            ev, ctx=ctx, context=context, log=self.log, rewatch=self._rewatch,
            recover=lambda raw, pending: mail_and_recover(ctx, context, raw, pending, shard=int(self.shard),
                                                          kind=self.kind, log=self.log)))
        return self._finish(ctx, final)

    def _finish(self, ctx: RunContext, final):
        """The watch's final event (its mails already tried): the shard's result, or the task fails."""
        kind, shard = self.kind, int(self.shard)
        try:
            self._log_progress(ctx, shard)
        except NodeUnreachable as e:   # the event's own verdict matters more than this log line
            self.log.warning("%s %d: progress not read: %s", kind.watch_name, shard, e)
        if isinstance(final, Complete):
            self.log.info("%s %d complete: %s", kind.watch_name, shard, final.summary)
            return {"shard": shard, "summary": final.summary}
        self.log.error("%s %d %s: %s", kind.watch_name, shard, final.kind, final.to_dict().get("diagnosis"))
        if kind.lifecycle().after_failed_watch(ctx, shard, final.payload()):
            self.log.warning("%s %d: the stall is blamed on the %s: the retry stops and restarts it",
                             kind.watch_name, shard, kind.server)
        fail_with(final, f"{kind.watch_name} {shard}")

    def _log_progress(self, ctx: RunContext, shard: int) -> None:
        hb_file = self.kind.heartbeat_file(ctx.layout, shard)
        text = ctx.node.read_text(str(hb_file))
        if text:
            try:
                self.log.info("%s", Heartbeat.from_json(text).progress_line())
            except (ValueError, TypeError, KeyError):
                self.log.warning("%s %d: unreadable heartbeat %s", self.kind.watch_name, shard, hb_file)


class StopServerOperator(PhaseOperator):
    """Teardown: stop this run's live workers of the phase and its server (TERM, grace, KILL; the phase's own
    ``stop_server`` cleans what else it left, e.g. the capture server's dumps)."""

    def __init__(self, *, grace_s: float = 30.0, **kw):
        super().__init__(**kw)
        self.grace_s = grace_s

    def run(self, ctx, context):
        kind = self.kind
        # every worker record of exactly this run (another run's id may start with this one's)
        records = ctx.node.run_json(ctx.node.process_record_argv(
            "list", "--pids-dir", str(ctx.layout.pids_dir), "--run-id", ctx.layout.run_id,
            "--role-pattern", kind.worker_role_pattern()), RecordList, timeout=60)
        for st in records.records:
            if st.record is None:
                continue
            stopped = ctx.node.stop_recorded(st.record.pid_file, grace_s=self.grace_s)
            if stopped.outcome not in ("already_gone", "not_recorded"):
                self.log.warning("stopped a still-running %s worker (%s): %s", kind.noun, st.record.role,
                                 stopped.detail)
        # a switched-off phase leaves a server of this run recorded (switched off after a try that started one)
        if kind.enabled(ctx.cfg) or ctx.node.process_status(str(ctx.layout.pid_file(kind.server_role))).recorded:
            return kind.lifecycle().stop_server(ctx, grace_s=self.grace_s, log=self.log.info)
        return None


@dataclass
class PhaseTasks:
    """One node's chain of a sharded phase, as ``phase_tasks`` wired it."""
    first: Any                                  # its first task (GPUs freed)
    shards: Any                                 # the mapped shard task
    last: Any                                   # the last task before the server's teardown (shards or ``after``)
    free_after: Any                             # the GPUs freed after its server (teardown)
    collect: Any | None                         # its shards copied to the training node (off shared storage)
    plan_task_id: str                           # the node's plan task id (prefixed in a fleet's group)


def phase_tasks(kind: ShardKind, node, *, after_shards: Callable[[], Any] | None = None,
                collect_after_teardown: bool = False) -> PhaseTasks:
    """Wire one sharded phase on one node (inside its task group, ``routing.FleetNodeRoute``): GPUs freed and
    checked idle, its server started as the setup of a setup/teardown pair (and waited for: its ``ready_task``),
    its shards planned and mapped under the watch, its server stopped and the GPUs freed as teardowns, and, off
    shared storage, its shards collected to the training node (whatever the shards did: all_done).

    ``after_shards``: builds a task that runs after the shards and before the teardown (the held-out records on
    the training node); ``collect_after_teardown``: the collection waits for the GPUs freed too."""
    free = FreeGpusOperator(task_id=kind.free_task, phase=kind.phase)
    idle = GpuIdleSensor(task_id=kind.idle_task, pool=node.pool, phase=kind.phase)
    start = StartServerOperator(task_id=kind.start_task, phase=kind.phase, pool=node.pool)
    plan = PlanShardsOperator(task_id=kind.plan_task, phase=kind.phase)
    # named, not left to the group's default_args: a mapped task is rebuilt from its partial kwargs
    shards = ShardOperator.partial(task_id=kind.shard_task, phase=kind.phase, retries=2, pool=node.pool,
                                   fleet_node=node.fleet_node).expand(shard=plan.output)
    stop = StopServerOperator(task_id=kind.stop_task, phase=kind.phase)
    free_after = FreeGpusOperator(task_id=kind.free_after_task, phase=kind.phase)
    free >> idle >> start
    if kind.ready_task is not None:
        start >> ServerReadySensor(task_id=kind.ready_task, phase=kind.phase, pool=node.pool) >> plan
    else:
        start >> plan
    plan >> shards
    last = shards
    if after_shards is not None:
        last = after_shards()
        shards >> last
    last >> stop.as_teardown(setups=start)
    # GPU cleanup is a teardown: it runs whenever the server was started, whatever the shards did
    stop >> free_after.as_teardown(setups=start)
    collect = None
    if node.ships_to_training:
        collect = CollectShardsOperator(task_id=kind.collect_task, phase=kind.phase, trigger_rule="all_done",
                                        prepare_task_id=node.prefix + PREPARE_TASK, retries=2)
        shards >> collect
        if collect_after_teardown:
            free_after >> collect
    return PhaseTasks(first=free, shards=shards, last=last, free_after=free_after, collect=collect,
                      plan_task_id=node.prefix + kind.plan_task)
