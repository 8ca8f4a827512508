"""The GPU gates of the pipeline: FreeGpusOperator and GpuIdleSensor.

Both read everything from the run config (``gpu.*``, ``node.*``); in a DAG
they are just ``FreeGpusOperator(task_id=...)`` and
``GpuIdleSensor(task_id=..., deferrable=True)``. On a node without GPU
(``node.has_gpu: false``) they log that and succeed.
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Iterator

from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.base import RunOperator, RunSensor
from eagleflow.airflow.defer_settle import look_before_deferring
from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
from eagleflow.airflow.runtime import RunContext
from eagleflow.nodes import NodeError
from eagleflow.phases import EXTRACT, kind_of
from eagleflow.stores import store_for
from eagleflow.gpu.cleanup import CleanupReport
from eagleflow.gpu.errors import GpuProbeError, NoGpuError
from eagleflow.gpu.idle_gate import IdleGate, no_gpu_message


class GpusNotIdle(Exception):
    """The selected GPUs stayed busy past the gate's timeout (retryable: the task's retries retry it)."""


class GpuGateError(Exception):
    """The GPUs could not be read (SSH, driver); retryable."""


class GpusHeldByAnotherRun(GpusNotIdle):
    """Another run's live job holds the selected GPUs past the gate's timeout; this run does not stop it unless
    forced (retryable: the retry waits again)."""


def gate_not_needed(task, cfg, context) -> bool:
    """A gate that guards nothing this run, as a logged no-op: one of a sharded phase (``phase``) that the run
    switched off (generation with generate.enabled off), so that a node whose GPUs are held fails at the gate of
    a phase that runs, not before one that does not; or one whose ``guards`` task returned nothing to do (no shard
    taken over)."""
    kind = kind_of(task.phase) if task.phase is not None else None
    if kind is not None and not kind.enabled(cfg):
        task.log.info("%s is off: no %s starts, so this gate has nothing to guard", kind.enabled_field, kind.server)
        return True
    if task.guards and not context["ti"].xcom_pull(task_ids=task.guards):
        task.log.info("%s returned nothing to do: no server starts, so this gate has nothing to guard", task.guards)
        return True
    return False


class FreeGpusOperator(RunOperator):
    """Stop what this run recorded on the node (TERM, grace, KILL), then wait for idle GPUs.

    Runs ``eagleflow gpu free --on-node`` on the node over the run's node
    connection. Another run's live jobs are never stopped: each is named (run
    id, role, pid, command); when one holds the selected GPUs the gate waits
    for idle GPUs up to ``gpu.idle_timeout_s`` and then refuses naming it
    (retryable). Foreign processes, and other runs' jobs on the selected GPUs,
    are killed only when the run sets ``gpu.force_free`` (Param
    force_free_gpus); otherwise they are reported and left alone.
    """

    ui_color = "#fbe9e7"

    def __init__(self, *, phase: str | None = None, guards: str | None = None, **kw):
        super().__init__(**kw)
        # phase: the sharded phase (its name) whose server this gate clears the way for (None: none)
        self.phase = kind_of(phase).phase if phase is not None else None
        self.guards = guards

    def run(self, ctx: RunContext, context):
        if gate_not_needed(self, ctx.cfg, context):
            return None
        cfg, node = ctx.cfg, ctx.node
        if node.read_text(ctx.run_config_path) is None:
            ctx.write_run_config()  # the node-side command reads the run's config
        argv = ctx.eagleflow_argv("gpu", "free", "--on-node", "--json")
        if self.phase == EXTRACT and store_for(cfg.stream.storage).streaming:
            argv.append("--keep-trainer")   # a streaming run trains beside the capture (docs/streaming.md)
        if cfg.gpu.force_free:
            argv.append("--force")
            self.log.warning("force_free is set: foreign processes on the selected GPUs of node %s will be killed",
                             node.name)
        try:
            report = node.run_json(argv, CleanupReport, timeout=600,
                                   log=lambda line: self.log.info("node %s: %s", node.name, line))
        except NodeError as e:
            raise GpuGateError(str(e)) from None
        if report.unkillable:
            raise GpuGateError(f"node {node.name}: process(es) did not die after SIGKILL:\n"
                               + "\n".join("  " + o.describe() for o in report.unkillable)
                               + "\nA process in D state waits for the kernel (see wchan); it cannot be killed "
                                 "until the I/O or driver call returns. Check the device/driver on the node.")
        for job in report.other_runs:
            self.log.warning("node %s: left running, another run's live job: %s", node.name, job.describe())
        if not cfg.node.has_gpu:
            self.log.info(no_gpu_message(cfg))
            return report.to_dict()
        if report.other_runs_in_the_way:
            return self._wait_for_other_runs(ctx, report)
        if report.left_running:
            self.log.warning("node %s: %d foreign process(es) left running on the selected GPUs (not started by "
                             "eagleflow; set force_free_gpus to kill them); the idle gate will report them",
                             node.name, len(report.left_running))
            return report.to_dict()
        idle = IdleGate(node, cfg).wait(cfg.gpu.idle_timeout_s, cfg.gpu.poll_interval_s, log=self.log.info)
        if not idle.all_idle:
            raise GpusNotIdle(f"after stopping eagleflow's processes, GPUs still not idle after "
                              f"{cfg.gpu.idle_timeout_s:.0f} s (gpu.idle_timeout_s):\n{idle.message()}")
        self.log.info(idle.message())
        return report.to_dict()

    def _wait_for_other_runs(self, ctx: RunContext, report) -> dict:
        """Another run's live jobs hold the selected GPUs: wait for idle GPUs (bounded), else refuse naming them."""
        cfg, node = ctx.cfg, ctx.node
        jobs = report.other_runs_in_the_way
        names = "\n".join("  " + j.describe() for j in jobs)
        self.log.warning("node %s: the selected GPUs are held by %d live job(s) of other runs, which run %s does not "
                         "stop; waiting up to %.0f s (gpu.idle_timeout_s) for them to end:\n%s", node.name, len(jobs),
                         ctx.layout.run_id, cfg.gpu.idle_timeout_s, names)
        idle = IdleGate(node, cfg).wait(cfg.gpu.idle_timeout_s, cfg.gpu.poll_interval_s, log=self.log.info)
        if not idle.all_idle:
            records = " ".join(sorted({j.record for j in jobs}))
            raise GpusHeldByAnotherRun(
                f"node {node.name}: the selected GPUs are held by live job(s) of another run, which run "
                f"{ctx.layout.run_id} does not stop:\n{names}\nStill not idle after {cfg.gpu.idle_timeout_s:.0f} s "
                f"(gpu.idle_timeout_s):\n{idle.message()}\nWait for that run to finish (the retry waits again), "
                f"stop it on the node (python -m eagleflow.nodes.process_record stop --pid-file RECORD, for each of "
                f"{records}), or trigger this run with force_free_gpus (where the deployment allows it) to stop "
                "them.")
        self.log.info("the other runs' jobs left the selected GPUs: %s", idle.message())
        return report.to_dict()


@contextlib.contextmanager
def _gate_errors_as_task_failures() -> Iterator[None]:
    """A GPU gate's errors as task failures: no GPU fails at once, a reading that failed retries."""
    try:
        yield
    except NoGpuError as e:
        raise AirflowFailException(f"{e}\n(the config says node.has_gpu: true)") from None
    except (GpuProbeError, NodeError, ValueError) as e:
        raise GpuGateError(str(e)) from None


class GpuIdleSensor(RunSensor):
    """Succeeds when every selected GPU is at its idle baseline with no compute process.

    The gate's deadline is the run's ``gpu.idle_timeout_s`` (or ``gate_timeout_s`` here), counted in
    wall-clock time from this try's first look. ``deferrable`` (default: Airflow's ``[operators]
    default_deferrable``) waits in the triggerer; otherwise the sensor pokes every ``poke_interval``
    (default 5 s) in ``mode`` poke or reschedule, holding one node connection across pokes in poke mode.
    On the deadline it fails with each GPU that is not idle and each process on it (pid, user, command,
    MiB); the failure is retryable, so the task's retries retry it.

    ``gpus``: which GPUs it judges: ``run`` (gpu.select, all when empty) or ``trainer`` (the trainer's only,
    PipelineConfig.train_gpu_slots: a streaming trainer starts while the capture server still holds its own,
    so those are left out; a trainer on the CPU has none and the gate passes).
    """

    ui_color = "#e8f5e9"
    retry_advice = ("The retry waits again for every selected GPU to reach its idle baseline; stop what holds "
                    "them (see the processes below) or set force_free_gpus.")

    def __init__(self, *, gate_timeout_s: float | None = None, poke_interval: float = 5.0, phase: str | None = None,
                 guards: str | None = None, gpus: str = "run", **kw):
        super().__init__(poke_interval=poke_interval, **kw)
        if gpus not in ("run", "trainer"):
            raise ValueError(f"GpuIdleSensor gpus={gpus!r}: 'run' (gpu.select) or 'trainer' (the trainer's GPUs)")
        self.gpus = gpus
        self.gate_timeout_s = gate_timeout_s
        # phase: the sharded phase (its name) whose server this gate clears the way for (None: none)
        self.phase = kind_of(phase).phase if phase is not None else None
        self.guards = guards
        self._gate: tuple[RunContext, IdleGate] | None = None

    def _gate_timeout(self, ctx: RunContext) -> float:
        return float(self.gate_timeout_s if self.gate_timeout_s is not None else ctx.cfg.gpu.idle_timeout_s)

    def _select(self, cfg) -> list[str] | None:
        """The GPUs this gate judges: None = the run's gpu.select; for ``trainer``, the trainer's (maybe none)."""
        return cfg.gpu_at(cfg.train_gpu_slots()) if self.gpus == "trainer" else None

    def _check(self, ctx: RunContext, gate=None):
        """One reading through ``gate`` (or a new one on the run's node); errors as task failures."""
        with _gate_errors_as_task_failures():
            return (gate or IdleGate(ctx.node, ctx.cfg, select=self._select(ctx.cfg))).check()

    def execute(self, context):
        ctx = RunContext.from_airflow(context)
        try:
            if gate_not_needed(self, ctx.cfg, context):
                return None
            if not ctx.cfg.node.has_gpu:
                self.log.info(no_gpu_message(ctx.cfg))
                return None
            if self.gpus == "trainer" and not self._select(ctx.cfg):
                self.log.info("train.device is %r: the trainer takes no GPU of node %s, nothing to check",
                              ctx.cfg.train.device, ctx.cfg.node.name)
                return None
            timeout = self._gate_timeout(ctx)
            # one cheap look before poking; deferring, a few (defer_settle: GPUs idle right after would race)
            with _gate_errors_as_task_failures():
                gate = IdleGate(ctx.node, ctx.cfg, select=self._select(ctx.cfg))      # one for every look
            report = look_before_deferring(lambda: self._check(ctx, gate), lambda r: r.all_idle, self.poke_interval,
                                           window_s=None if self.deferrable else 0.0)
            if report.all_idle:
                self.log.info(report.message())
                return None
            self.log.info("waiting up to %.0f s for idle GPUs: %s", timeout, report.message())
            ref = ctx.trigger_ref()
        finally:
            ctx.close()
        end_at = self.gate_started_at(context) + timeout
        if self.deferrable:
            self.defer(trigger=GpuIdleTrigger(run=ref, end_at=end_at, poll_interval_s=self.poke_interval,
                                              select=self._select(ctx.cfg), deferred_at=time.time()),
                       method_name="execute_complete", timeout=timedelta(seconds=timeout + 300))
        try:
            return super().execute(context)
        finally:
            self._close_gate()

    def _close_gate(self) -> None:
        if self._gate is not None:
            self._gate[0].close()
            self._gate = None

    def poke(self, context) -> bool:
        if self._gate is None:  # held across pokes in poke mode: one connection for the whole wait
            ctx = RunContext.from_airflow(context)
            self._gate = (ctx, IdleGate(ctx.node, ctx.cfg, select=self._select(ctx.cfg)))
        ctx, gate = self._gate
        report = self._check(ctx, gate)
        timeout = self._gate_timeout(ctx)
        timed_out = time.time() >= self.gate_started_at(context) + timeout
        if self.reschedule:  # the task process ends after this poke
            self._close_gate()
        if report.all_idle:
            self.log.info(report.message())
            return True
        if timed_out:
            raise GpusNotIdle(f"GPUs not idle after {timeout:.0f} s:\n{report.message()}")
        self.log.info("not idle yet: %s", report.message())
        return False

    def execute_complete(self, context, event: dict):
        if event.get("status") == "idle":
            self.log.info(event["message"])
            return None
        if event.get("status") == "no_gpu":
            raise AirflowFailException(f"{event['message']}\n(the config says node.has_gpu: true)")
        if event.get("status") == "not_idle":
            raise GpusNotIdle(f"GPUs not idle before the gate's timeout:\n{event['message']}")
        raise GpuGateError(event.get("message", f"unexpected event {event!r}"))

