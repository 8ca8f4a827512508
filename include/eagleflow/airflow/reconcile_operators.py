"""Operators of ``eagle3_shard_reconcile``: find unattended incomplete shards, rerun them watched, mail a summary.

The decisions are made on the node by ``eagleflow reconcile scan|claim|release``
(eagleflow.watchdog.reconcile), for extraction and generation shards alike;
these operators only run those commands and watch the restarted workers with
the same trigger as the pipeline (ShardWatchTrigger, with the shard's phase).
"""
from __future__ import annotations

import json
from typing import Any, cast

from airflow.sdk import BaseOperator

from eagleflow import bounded_json
from eagleflow.airflow.base import RunOperator, default_deferrable, run_trigger_here
from eagleflow.airflow.runtime import RunContext, apply_control_plane, control_plane_settings
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes import NodeAnswerError, NodeError
from eagleflow.phases import EXTRACT, KINDS, kind_of
from eagleflow.protocol import ClaimAnswer, ShardStates
from eagleflow.watchdog.protocol import EventPayload
from eagleflow.airflow.alerts import Mail, Recipients, send_mail, task_log_url
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.watchdog.diagnosis import StallDetected


def _reconcile_config_path(ctx: RunContext) -> str:
    """The reconcile run's config on the node: beside the node state, never a run dir of its own."""
    return str(ctx.layout.state_dir / "reconcile" / "config.json")


def _scan(ctx: RunContext, latest: int) -> list[dict]:
    """The node's scan, each shard's state checked for shape (``eagleflow.protocol.ShardStates``: a run name
    that is one path component, counts, an absolute config path), as plain values for XCom."""
    path = _reconcile_config_path(ctx)
    ctx.node.write_text(path, json.dumps(ctx.cfg.model_dump(mode="json")))
    answer = ctx.node.run_json(ctx.node.eagleflow_argv("reconcile", "scan", "--config", path, "--latest",
                                                       str(latest)), ShardStates, timeout=300)
    return [st.model_dump() for st in answer.shards]


class FindIncompleteShardsOperator(RunOperator):
    """The shards of the latest runs that are incomplete with no live worker (the mapped reruns' input).

    The reconcile run's first task: it freezes the reconcile config for the reruns and the summary."""

    freezes_run_config = True

    def __init__(self, *, latest_runs: int | str = 3, **kw):
        super().__init__(**kw)
        self.latest_runs = latest_runs

    template_fields = ("latest_runs",)

    def run(self, ctx, context):
        states = _scan(ctx, int(self.latest_runs))
        for st in states:
            self.log.info("%s%s", st["line"], "  -> rerun" if st["needs_rerun"] else "")
        todo = [{"run_id": st["run_id"], "phase": st.get("phase", EXTRACT), "shard": st["shard"],
                 "run_config": st["run_config"], "stored": st["stored"], "expected": st["expected"]}
                for st in states if st["needs_rerun"]]
        self.log.info("%d shard(s) to rerun of %d looked at on node %s", len(todo), len(states), ctx.node.name)
        context["ti"].xcom_push(key="scanned", value=states)
        return todo


class RerunShardOperator(BaseOperator):
    """Claim one shard on the node (lock, recheck, server, worker), then watch it to the end."""

    ui_color = "#fdf2d0"
    template_fields = ("target",)
    retry_advice = "The retry claims the shard again and resumes it from its manifest."

    def __init__(self, *, target: dict, deferrable: bool | None = None, **kw):
        super().__init__(**kw)
        self.target = target
        # deferred: the watch runs in the triggerer; otherwise the same watch runs in this worker slot
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    def _run_context(self, context) -> RunContext:
        # the run's own config, as its pipeline wrote it on the node; the node from the reconcile config
        node_ctx = RunContext.from_airflow(context)
        text = node_ctx.node.read_text(self.target["run_config"])
        if text is None:
            raise FileNotFoundError(f"run config {self.target['run_config']} vanished from node {node_ctx.node.name}")
        cfg = load_config(data=bounded_json.loads(text, source=f"{self.target['run_config']} on node "
                                                               f"{node_ctx.node.name}"))
        # what runs on the control plane and whom to mail: the reconcile's frozen config, not the node's file
        apply_control_plane(cfg, control_plane_settings(node_ctx.cfg))
        return RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, self.target["run_id"]), _node=node_ctx.node)

    def execute(self, context):
        ctx = self._run_context(context)
        shard = int(self.target["shard"])
        phase = kind_of(self.target.get("phase", EXTRACT)).phase
        ti = context.get("ti")
        if ti is not None and (ti.try_number or 1) > 1:
            # the rerun itself stalled: what the pipeline's retry of that phase does first (extraction: the
            # stuck worker and an unhealthy capture server; generation: a hung server stopped once), then the
            # claim restarts what is gone through the phase's lifecycle
            kind_of(phase).lifecycle().before_retry(ctx, shard, self.log)
        taken = ["--taken-from", str(self.target["taken_from"])] if self.target.get("taken_from") else []
        result = ctx.node.run_json(ctx.eagleflow_argv("reconcile", "claim", "--shard", str(shard), "--phase", phase,
                                                      *taken),
                                   ClaimAnswer, timeout=ctx.cfg.server.ready_timeout_s + 300,
                                   log=lambda line: self.log.info("claim (node %s): %s", ctx.node.name, line))
        # an answer about another shard or run proves nothing about this one
        other = ({"shard": result.shard} if result.shard not in (None, shard) else {}) | (
            {"run_id": result.run_id} if result.run_id not in (None, ctx.layout.run_id) else {})
        if other:
            raise NodeAnswerError(f"on node {ctx.node.name}: the claim of {phase} shard {shard} of run "
                                  f"{ctx.layout.run_id} answered about "
                                  + ", ".join(f"{k} {v!r} (field '{k}')" for k, v in other.items())
                                  + "; nothing is watched. Check eagleflow on that node, then clear this task")
        self.log.info("run %s %s shard %d: %s (%s)", ctx.layout.run_id, phase, shard, result.action, result.reason)
        if result.action == "skipped":
            ctx.close()
            return {**self.target, "outcome": "skipped", "reason": result.reason}
        trigger = ShardWatchTrigger(run=ctx.serialize(), shard=shard, phase=phase)
        ctx.close()
        if not self.deferrable:
            return self.execute_complete(context, cast(EventPayload, run_trigger_here(trigger)))
        self.defer(trigger=trigger, method_name="execute_complete")

    def execute_complete(self, context, event: EventPayload):
        if event.get("status") == "complete":
            self.log.info("run %s shard %s rerun complete: %s", self.target["run_id"], self.target["shard"],
                          event.get("summary"))
            return {**self.target, "outcome": "complete", "reason": event.get("summary", "")}
        ctx = self._run_context(context)
        try:   # what the phase's retry needs, as the pipeline's task of that phase keeps it
            if kind_of(self.target.get("phase", EXTRACT)).lifecycle().after_failed_watch(
                    ctx, int(self.target["shard"]), event):
                self.log.warning("the stall is blamed on the phase's server: the retry stops and restarts it")
        finally:
            ctx.close()
        raise StallDetected(event.get("subject") or f"rerun of shard {self.target['shard']} {event.get('status')}",
                            event.get("diagnosis") or str(event))


class ReconcileSummaryOperator(RunOperator):
    """After the reruns (whatever their outcome): release servers reconcile started, mail what was rerun."""

    def run(self, ctx, context):
        ti = context["ti"]
        todo = ti.xcom_pull(task_ids="find_incomplete_shards") or []
        if not todo:
            self.log.info("nothing was rerun: every shard of the latest runs is complete or has a live worker")
            return {"rerun": 0, "summary": "nothing to rerun"}
        # a phase that finished since (its stats complete) is not scanned again: its shards read as complete below
        after = {(s["run_id"], s.get("phase", EXTRACT), s["shard"]): s for s in _scan(ctx, 1000)}
        lines = []
        for t in todo:
            kind = kind_of(t.get("phase", EXTRACT))
            now = after.get((t["run_id"], kind.phase, t["shard"]))
            finished_phase = now is None and kind.done_when_stats_complete   # its stats say every shard is complete
            stored = now["stored"] if now else (t["expected"] if finished_phase else "?")
            state = ("complete" if finished_phase or (now and now["stored"] >= now["expected"]
                                                      and now.get("finished", True))
                     else "still incomplete" + (", worker running" if now and now["worker_alive"] else ""))
            lines.append(f"run {t['run_id']} {kind.label} {t['shard']}: {t['stored']}/{t['expected']} -> "
                         f"{stored}/{t['expected']} {kind.unit} stored ({state})")
        for run_id, phase in sorted({(t["run_id"], t.get("phase", EXTRACT)) for t in todo}):
            t = next(x for x in todo if x["run_id"] == run_id)
            server = kind_of(phase).server
            try:
                released = ctx.node.run_json(ctx.node.eagleflow_argv("reconcile", "release", "--config",
                                                                     t["run_config"], "--run-id", run_id,
                                                                     "--phase", phase),
                                             ClaimAnswer, timeout=300)
                lines.append(f"run {run_id} {server}: {released.action} ({released.reason})")
            except NodeError as e:
                lines.append(f"run {run_id} {server}: release failed: {e}")
        summary = "\n".join(lines)
        self.log.info("reconcile summary:\n%s", summary)
        per_phase: dict[str, int] = {}
        for t in todo:
            per_phase[t.get("phase", EXTRACT)] = per_phase.get(t.get("phase", EXTRACT), 0) + 1
        subject = (f"[eagleflow] reconcile on {ctx.node.name}: reran {len(todo)} shard(s) ("
                   + ", ".join(f"{n} {KINDS[p].noun}" for p, n in sorted(per_phase.items())) + ")")
        recipients = Recipients.of_config(ctx.cfg)
        send_mail(context, Mail(recipients, subject, summary,
                                where=f"DAG {ti.dag_id}, run {ti.run_id}: incomplete shards with no live worker.",
                                links=(("Task log", task_log_url(recipients.base_url, context)),)))
        return {"rerun": len(todo), "summary": summary}
