"""Extraction's own check in Airflow: every stored hidden state verified against its manifest before training.

The phase's server, shards and teardown are the shard operators every sharded phase shares
(``eagleflow.airflow.shard_operators``); this is what only extraction has after them.
"""
from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.base import RunOperator
from eagleflow.nodes import NodeError


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
