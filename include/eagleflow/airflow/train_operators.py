"""Draft training and export as Airflow tasks.

``TrainDraftOperator`` starts ``eagleflow train`` detached on the node (under
torchrun when ``train.nproc_per_node`` > 1), or attaches to the run's live
trainer, then defers to ``TrainWatchTrigger``: the stall watchdog guards
training as it guards extraction (a step that stops advancing is a stall).
A trainer stopped, dead or stuck, or its store lost, is recovered inside the watch
(``watchdog.train_recoveries_in_watch`` times per try): mailed at once, the store
or the trainer restarted (it resumes from its last checkpoint), watched again.
Past those, or on a fault the watch does not recover, the try fails; the retry
looks first (one watch look) and runs the same recovery only when the watch
finds the trainer stalled, dead or failed.
"""
from __future__ import annotations

import time
from typing import Callable

from airflow.sdk import Asset
from pydantic import BaseModel

from eagleflow.airflow.base import RunOperator, default_deferrable
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.store_operators import StoreAnswer
from eagleflow.fleet.stream import hand_endpoint_to_capture_nodes
from eagleflow.phases import EXTRACT, KINDS
from eagleflow.protocol import ClaimAnswer
from eagleflow.engines import eval_engine
from eagleflow.train.job import read_train_heartbeat, start_or_attach_trainer, stop_trainer
from eagleflow.airflow.shard_watch import TrainWatchTrigger
from eagleflow.airflow.watch_handler import fail_with, follow_event, mail_then_recover, watch_to_the_end
from eagleflow.evaluate.approval import PENDING
from eagleflow.evaluate.run import accept_lengths, acceptance_table, table_lines
from eagleflow.nodes import NodeError
from eagleflow.watchdog.protocol import Complete, EventPayload, IncidentClose, PendingMail

# a retry waits this long at most for the watch's pending evidence (a late heartbeat's CPU window) before it acts
RETRY_EVIDENCE_WAIT_S = 60.0


class TrainDraftOperator(RunOperator):
    ui_color = "#f3e8fb"
    retry_advice = ("The watch's own recoveries of this try are spent or did not apply. The retry keeps a live "
                    "trainer unless the watch finds it stalled, dead or failed; then it starts again from the last "
                    "checkpoint.")

    def __init__(self, *, deferrable: bool | None = None, poll_interval_s: float | None = None, **kw):
        super().__init__(**kw)
        # deferred: the watch runs in the triggerer; otherwise the same watch runs in this worker slot
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.poll_interval_s = poll_interval_s

    def run(self, ctx: RunContext, context):
        tc = ctx.cfg.train
        hb = read_train_heartbeat(ctx)
        if hb is not None and hb.state == "complete" and hb.done >= tc.max_steps:
            self.log.info("training of run %s already complete: %s", ctx.layout.run_id, hb.progress_line())
            return {"status": "complete", "step": hb.done, "draft_dir": str(ctx.layout.draft_dir)}
        try_number = int(getattr(context.get("ti"), "try_number", 1) or 1)
        if try_number > 1:
            self._restart_if_unhealthy(ctx)
        self._start(ctx)
        return self._watch(ctx, context, self._rewatch(run=ctx.trigger_ref(),
                                                       recoveries_left=ctx.cfg.watchdog.train_recoveries_in_watch))

    def _start(self, ctx: RunContext) -> None:
        rec, attached = start_or_attach_trainer(ctx, log=self.log.info)
        self.log.info("trainer pid %s on node %s (%s); heartbeat %s, log %s", rec.pid, ctx.node.name,
                      "attached" if attached else "started", ctx.layout.train_heartbeat_file, rec.log_file)

    def _restart_if_unhealthy(self, ctx: RunContext) -> None:
        """On a retry, the watch's look first: a trainer that is starting, healthy or slow is kept; only the
        watch's verdict stalled, dead or failed stops it. A look that gets no answer stops nothing. A slow verdict
        whose evidence is still pending (a late heartbeat's CPU window not yet covered: the first look has no
        earlier CPU reading) is looked at again when it turns, within RETRY_EVIDENCE_WAIT_S in all."""
        trigger = TrainWatchTrigger(run=ctx.trigger_ref())
        deadline = time.monotonic() + RETRY_EVIDENCE_WAIT_S
        try:
            diag = trigger.look_once(ctx)
            while diag.verdict == "slow" and diag.recheck_in_s is not None \
                    and time.monotonic() + diag.recheck_in_s <= deadline:
                self.log.info("retry: %s; looking again in %.0f s, when its evidence turns", diag.summary,
                              diag.recheck_in_s)
                time.sleep(diag.recheck_in_s)
                diag = trigger.look_once(ctx)
        except (NodeError, ValueError) as e:
            self.log.warning("retry: could not look at the trainer first (%s); stopping nothing, the watch decides", e)
            return
        if diag.status is None or diag.verdict == "complete":   # as the shard's retry: nothing to stop
            self.log.info("retry: the trainer is kept, nothing stopped: %s", diag.summary)
            return
        self._recover(ctx, diag.verdict, diag.cause, diag.summary, "retry")

    def _recover(self, ctx: RunContext, verdict: str, cause: str | None, why: str, when: str) -> None:
        """The one recovery of a faulty trainer (the watch's and the retry's; the caller starts it again): the store
        restarted when it is blamed, the trainer stopped unless it is still running and takes up the new store."""
        if cause == "store":
            self._restart_store(ctx, why, when)
            if verdict == "stalled":   # still running: it waits for its store (stream.store_down_timeout_s)
                self.log.info("%s: the trainer is kept: it takes up the new store and goes on", when)
                return
        outcome = stop_trainer(ctx, log=self.log.info)
        self.log.info("%s: %s; previous trainer %s; starting again from the last checkpoint", when, why, outcome)

    def _mail_and_recover(self, ctx: RunContext, context, event: EventPayload, pending: list[PendingMail]
                          ) -> tuple[int, IncidentClose | None, list[PendingMail]]:
        """The watch's recovery (a ``watch_handler.Recover``): mail now (a mail that cannot be sent never stops
        it), recover, start the trainer again; the watch goes on with one recovery fewer. A recovery that fails
        fails the try with the fault (the retry is the last resort)."""
        self.log.warning("training %s (%s), recovering in the watch (%s left after this): %s", event.get("verdict"),
                         event.get("cause"), max(0, int(event.get("recoveries_left") or 0) - 1),
                         event.get("diagnosis"))
        def recover() -> None:
            first_line = str(event.get("diagnosis") or "").split("\n", 1)[0]
            self._recover(ctx, str(event.get("verdict")), event.get("cause"), first_line, "watch")
            self._start(ctx)
        return mail_then_recover(context, event, pending, mail=True, recover=recover,
                                 subject="[eagleflow] STALLED training")

    def _restart_store(self, ctx: RunContext, why: str, when: str = "retry") -> None:
        """The run's store lost mid-run (issue 53): ``eagleflow store start`` on the node starts a new incarnation
        (what the dead one left stopped by its records); the shards' retries capture again what was lost with it.
        A start that fails fails this try, naming it."""
        answer = ctx.node.run_json(ctx.eagleflow_argv("store", "start", "--timeout", "90"), StoreAnswer, timeout=120,
                                   log=self.log.info)
        info = answer.model_dump()
        self.log.warning("%s: %s; the run's store %s on node %s (store id %s)", when, why,
                         "was running again (attached)" if info.get("attached") else "restarted", ctx.node.name,
                         info.get("store_id"))
        # a fleet's capture nodes put into the new incarnation (new ports, new store id): each gets it again
        hand_endpoint_to_capture_nodes(ctx, info, self.log.info)
        # the extraction shards with no worker now whose samples went with the store: rerun at once by reconcile's
        # claim (a shard whose task had succeeded has no retry of its own); a complete or attended shard is skipped
        for shard in range(KINDS[EXTRACT].num_shards(ctx.cfg)):
            claim = ctx.node.run_json(ctx.eagleflow_argv("reconcile", "claim", "--shard", str(shard), "--phase",
                                                         EXTRACT), ClaimAnswer,
                                      timeout=ctx.cfg.server.ready_timeout_s + 300, log=self.log.info)
            self.log.info("%s: extraction shard %d: %s (%s)", when, shard, claim.action, claim.reason)

    def execute_complete(self, context, event):
        # the run's context only when there is a next watch: a final event needs no config read
        made: list[RunContext] = []

        def ctx() -> RunContext:
            if not made:
                made.append(RunContext.from_airflow(context))
            return made[0]
        try:
            return self._watch(ctx, context, event or {})
        finally:
            for c in made:
                c.close()

    def _rewatch(self, **kw):
        return TrainWatchTrigger(poll_interval_s=self.poll_interval_s, **kw)

    def _watch(self, ctx: RunContext | Callable[[], RunContext], context, start):
        """The watch (deferred or here) until its final event, each event through the one handler; a fault it
        recovers through ``_mail_and_recover``."""
        def recover(raw: EventPayload, pending: list[PendingMail]):
            return self._mail_and_recover(ctx() if callable(ctx) else ctx, context, raw, pending)
        final = watch_to_the_end(self, context, start, lambda ev: follow_event(
            ev, ctx=ctx, context=context, log=self.log, rewatch=self._rewatch, recover=recover))
        if isinstance(final, Complete):
            self.log.info("%s", final.summary or "training complete")
            return {"status": "complete", "summary": final.summary}
        fail_with(final, "[eagleflow] training")


class ExportAnswer(BaseModel):
    """`eagleflow export --json`."""
    export_dir: str
    files: list[str]


class ExportDraftOperator(RunOperator):
    """`eagleflow export` on the node: the newest checkpoint as a draft directory SGLang serves, with the
    speculators-format copy vLLM serves in its ``speculators/`` folder (``train.export_formats``)."""

    ui_color = "#f3e8fb"

    def __init__(self, *, timeout_s: float = 1800.0, **kw):
        super().__init__(**kw)
        self.timeout_s = timeout_s

    def run(self, ctx: RunContext, context):
        answer = ctx.node.run_json(ctx.eagleflow_argv("export", "--json"), ExportAnswer, timeout=self.timeout_s,
                                   log=self.log.info)
        out_dir = answer.export_dir
        self.log.info("draft exported to %s on node %s; serve it with SGLang (--speculative-algorithm EAGLE3 "
                      "--speculative-draft-model-path %s) or, from its speculators/ folder when exported, with "
                      "vLLM (--speculative-config; the run report prints both commands)", out_dir, ctx.node.name,
                      out_dir)
        return {"export_dir": out_dir, "curves": str(ctx.layout.draft_dir / "curves.png"),
                "metrics": str(ctx.layout.draft_dir / "metrics.jsonl")}


# A promoted draft: one event per promotion, its extra the figures (a deployment DAG schedules on it).
PROMOTED_DRAFT_ASSET = Asset(name="eagleflow_promoted_draft", uri="eagleflow://promoted-draft")


class EvalAnswer(BaseModel):
    """`eagleflow evaluate --json` (exit 0 passed, 1 refused)."""
    run_id: str
    passed: bool
    refused: list[str]
    eval_file: str
    promoted: str | None = None
    draft: str
    baseline_draft: str | None = None
    baseline_source: str | None = None
    results: list[dict]
    approval: dict | None = None   # eval.approval: {"state": "pending", ...} while a person must approve
    elapsed_s: float


class EvaluateDraftOperator(RunOperator):
    """`eagleflow evaluate` on the node: held-out speculative decoding with the export and the promotion gate.

    Fails the run when the gate refuses the draft (the message says both numbers); the export stays. A
    promoted draft emits ``PROMOTED_DRAFT_ASSET`` with its path and the acceptance table (a failed task emits
    no event, so a refused draft never triggers a deployment). When eval.approval asks a person first, the
    draft is not promoted here: the DAG gives this task no outlet and an ``ApprovePromotionOperator`` after it
    (eagleflow.airflow.approval_operators) asks, promotes and emits the event."""

    ui_color = "#f3e8fb"

    def __init__(self, *, timeout_s: float = 3600.0, **kw):
        kw.setdefault("outlets", [PROMOTED_DRAFT_ASSET])
        super().__init__(**kw)
        self.timeout_s = timeout_s

    def _timeout(self, ctx: RunContext) -> float:
        """An engine that serves the target to evaluate (eval.backend sglang) loads it once per server (alone
        + each configuration x draft): the node command may take each load's grace plus its requests, not one
        fixed hour."""
        ec = ctx.cfg.eval
        if not eval_engine(ctx.cfg).eval_server_per_config:
            return self.timeout_s
        # a baseline (the draft in service by default) is served beside the new draft per configuration
        servers = 1 + len(ec.configs) * (1 if ec.baseline_draft == "none" else 2)
        return max(self.timeout_s, servers * (ec.ready_timeout_s + ec.request_timeout_s * (1 + len(ec.prompt_sets))))

    def run(self, ctx: RunContext, context):
        from airflow.sdk.exceptions import AirflowFailException

        answer = ctx.node.run_json(ctx.eagleflow_argv("evaluate", "--json"), EvalAnswer, timeout=self._timeout(ctx),
                                   answer_codes=(0, 1), log=self.log.info)
        for line in table_lines(answer.model_dump()):
            self.log.info("%s", line)
        if not answer.passed:
            raise AirflowFailException(f"draft {answer.draft} refused by the promotion gate (kept, not promoted): "
                                       + "; ".join(answer.refused) + f". Figures in {answer.eval_file} on node "
                                       f"{ctx.node.name}")
        summary = {"passed": True, "run_id": answer.run_id, "node": ctx.node.name, "draft": answer.draft,
                   "eval_file": answer.eval_file, "promoted": answer.promoted,
                   "baseline_draft": answer.baseline_draft, "baseline_source": answer.baseline_source,
                   "approval": answer.approval,
                   "accept_length": accept_lengths(answer.results), "table": acceptance_table(answer.results)}
        emits = any(getattr(o, "uri", None) == PROMOTED_DRAFT_ASSET.uri for o in self.outlets)
        approval = answer.approval or {}
        if approval.get("state") == PENDING:
            if emits:   # the event would announce a promotion that has not happened
                raise AirflowFailException(f"draft {answer.draft} passed and waits for a person's approval "
                                           "(eval.approval), but this DAG's evaluate_draft emits the promoted-draft "
                                           "event itself: give it outlets=[] and an ApprovePromotionOperator after it")
            self.log.info("draft %s passed; not promoted yet: a person approves it first (eval.approval %s)",
                          answer.draft, approval.get("mode"))
            return summary
        self.log.info("draft %s passed; promoted (%s)", answer.draft, answer.promoted)
        outlet_events = context.get("outlet_events")
        if emits and outlet_events is not None:
            outlet_events[PROMOTED_DRAFT_ASSET].extra = summary
        return summary
