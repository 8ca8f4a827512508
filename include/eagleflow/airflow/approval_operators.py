"""A person's approval before a draft is promoted (eval.approval), asked through Airflow's human-in-the-loop.

``ApprovePromotionOperator`` follows ``evaluate_draft``. When the evaluation left the draft waiting for a
person (eval.json's approval ``pending``: eagleflow.evaluate.approval decides who is asked), it shows the
evaluation table under Required Actions (Airflow's ``ApprovalOperator``: Approve / Reject and a "Why"
field) and waits there (Airflow 3.3: the task parks in ``awaiting_input``, no worker slot, no triggerer;
the scheduler applies eval.approval_on_timeout after eval.approval_timeout_h). The answer goes to the node
as ``eagleflow evaluate-decision``, which records who decided and why in eval.json (the run report shows it)
and, on approval, promotes the draft. The task only asks and passes the answer on.

It carries the promoted-draft Asset: a promoted draft (by the gate alone, or approved) emits the event; a
rejected one skips the task (no event, the draft in service stays), and its log says who rejected it and why.
"""
from __future__ import annotations

from datetime import timedelta

from airflow.providers.standard.operators.hitl import ApprovalOperator, HITLOperator
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from pydantic import BaseModel

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.train_operators import PROMOTED_DRAFT_ASSET
from eagleflow.config import ConfigError
from eagleflow.evaluate.approval import APPROVED, MAX_WHY, PENDING, approval_body, decision_line

REASON = "reason"


class DecisionAnswer(BaseModel):
    """`eagleflow evaluate-decision --json`."""
    run_id: str
    draft: str
    promoted: str | None = None
    approval: dict


class ApprovePromotionOperator(ApprovalOperator):
    """Asks a person to approve the promotion of the draft ``evaluate_task_id`` evaluated, when it waits for one."""

    ui_color = "#fff3e0"

    def __init__(self, *, evaluate_task_id: str = "evaluate_draft", fleet_node: str | None = None,
                 timeout_s: float = 300.0, **kw):
        kw.setdefault("outlets", [PROMOTED_DRAFT_ASSET])
        kw.setdefault("subject", "Promote the evaluated draft?")
        # the form's one field; source "task": HITLOperator keeps only the task's own Params for its form (the
        # params Airflow hands in already hold the DAG's, marked "dag")
        params = ParamsDict(kw.pop("params", None) or {})
        if REASON not in params:
            params[REASON] = Param(None, type=["null", "string"], maxLength=MAX_WHY, title="Why", source="task",
                                   description="Why you approve or reject this draft (the run report records it "
                                               "with your name).")
        kw["params"] = params
        super().__init__(**kw)
        self.evaluate_task_id = evaluate_task_id
        self.fleet_node = fleet_node   # the node the evaluation ran on; None: the training node
        self.timeout_s = timeout_s

    def _evaluation(self, context) -> dict:
        summary = context["ti"].xcom_pull(task_ids=self.evaluate_task_id)
        if not isinstance(summary, dict) or not summary.get("passed"):
            raise AirflowFailException(f"no passing evaluation from {self.evaluate_task_id}: nothing to promote")
        return summary

    def _promoted(self, context, summary: dict) -> dict:
        outlet_events = context.get("outlet_events")
        if outlet_events is not None:
            outlet_events[PROMOTED_DRAFT_ASSET].extra = summary
        return summary

    def execute(self, context):
        summary = self._evaluation(context)
        if (summary.get("approval") or {}).get("state") != PENDING:
            self.log.info("draft %s: %s (eval.approval %s: nobody is asked)", summary["draft"],
                          decision_line(summary), (summary.get("approval") or {}).get("mode", "none"))
            return self._promoted(context, summary)
        answered = self._earlier_answer(context)
        if answered is not None:   # a retry never asks a person again what they have answered
            self.log.info("a person answered this request before this try (%s): taking that answer",
                          answered["chosen_options"])
            return self.execute_complete(context, answered)
        try:
            ctx = RunContext.from_airflow(context)
        except ConfigError as e:
            raise AirflowFailException(str(e)) from None
        ec = ctx.cfg.eval
        ctx.close()
        # what the person sees, and what an unanswered request becomes: set before the request is written
        self.subject = f"Promote the draft of run {summary['run_id']}?"
        self.body = approval_body(summary)
        self.response_timeout = timedelta(hours=ec.approval_timeout_h)
        self.defaults = [self.APPROVE if ec.approval_on_timeout == "promote" else self.REJECT]
        self.log.info("draft %s passed the gate; waiting for a person's approval under Required Actions (at most "
                      "%s h, then eval.approval_on_timeout %s)", summary["draft"], ec.approval_timeout_h,
                      ec.approval_on_timeout)
        return super().execute(context)

    def _earlier_answer(self, context) -> dict | None:
        """On a retry: the answer a person already gave to this task's request, as the resume event; else None.

        Airflow 3.3 can lose a resume: an answer given seconds after the task parked may reach it before the
        executor reports the parked try finished, and the scheduler then retries the task (its log: "finished
        with state success, but the task instance's state attribute is queued"). The answer is still recorded
        with the request (one per task instance, whatever the try)."""
        ti = context["ti"]
        if (getattr(ti, "try_number", 1) or 1) <= 1:
            return None
        try:
            from airflow.sdk.execution_time.hitl import get_hitl_detail_content_detail
            got = get_hitl_detail_content_detail(ti.id)
        except Exception as e:   # no request yet, or an Airflow without it: ask
            self.log.info("no earlier answer to take (%s)", e)
            return None
        if not got.response_received or not got.chosen_options:
            return None
        user = got.responded_by_user
        return {"chosen_options": list(got.chosen_options), "params_input": got.params_input or {},
                "responded_at": got.responded_at, "responded_by_user": user.model_dump() if user else None,
                "timedout": user is None}   # the scheduler's timeout default is recorded with no one

    def execute_complete(self, context, event: dict):
        # the answer checked (options, the form) as HITLOperator does; Approve/Reject handled below, not by
        # skipping downstream tasks
        ret = HITLOperator.execute_complete(self, context=context, event=event)
        timed_out = bool(event.get("timedout"))
        user = ret["responded_by_user"] or {}
        by = user.get("name") or user.get("id")
        why = (ret["params_input"] or {}).get(REASON)
        decision = "timeout" if timed_out else ("approve" if ret["chosen_options"] == [self.APPROVE] else "reject")
        try:
            ctx = RunContext.from_airflow(context)
        except ConfigError as e:
            raise AirflowFailException(str(e)) from None
        try:
            # --by=/--why= in one word each: a person's text that starts with '-' is never read as a flag
            argv = ctx.eagleflow_argv("evaluate-decision", decision, "--json",
                                      *([f"--by={by}"] if by else []), *([f"--why={why}"] if why else []))
            answer = ctx.node.run_json(argv, DecisionAnswer, timeout=self.timeout_s, log=self.log.info)
        finally:
            ctx.close()
        summary = {**self._evaluation(context), "approval": answer.approval, "promoted": answer.promoted}
        line = decision_line(summary)
        if answer.approval.get("state") == APPROVED:
            self.log.info("draft %s: %s", answer.draft, line)
            return self._promoted(context, summary)
        raise AirflowSkipException(f"draft {answer.draft}: {line}")
