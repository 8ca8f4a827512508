"""Extraction's own check in Airflow: every stored hidden state verified against its manifest before training.

The phase's server, shards and teardown are the shard operators every sharded phase shares
(``eagleflow.airflow.shard_operators``); this is what only extraction has after them.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

from eagleflow.airflow.base import RunOperator
from eagleflow.nodes import NodeError
from eagleflow.airflow.alerts import ConsequentialFailure
from eagleflow.stores import store_for


class VerifyHiddenStatesOperator(RunOperator):
    """Every sample of every shard stored and matching its manifest, or the run fails (no retry).

    Runs after the extraction whatever its outcome (trigger rule all_done), so
    a shard that failed all its tries is reported here with the others: the
    failure names each failed shard and its counts, and nothing downstream
    (training, export) runs. When the capture never started (an earlier task
    failed) it fails without a second alert: nothing was captured to verify.
    A pass leaves the verification record that training requires.

    A streaming run (a store whose ``streaming`` is set, ``stream.storage: mooncake``) has no files to check:
    its samples were checked against their manifests' digests as the trainer took them, and the trainer
    writes the exactly-once record (``hidden_states/stream_verified.json``) when it ends. This task then
    waits for that record, rescheduling itself every ``poll_interval_s`` (no worker slot held while training
    runs beside it), and fails unless it is green; it fails without a second alert when ``train_task_id``
    ended without one (its own alert says why).
    """

    def __init__(self, *, check_digest: bool = True, plan_task_id: str = "plan_shards",
                 train_task_id: str = "train_draft", poll_interval_s: float = 5.0, **kw):
        super().__init__(**kw)
        self.check_digest = check_digest
        self.plan_task_id = plan_task_id
        self.train_task_id = train_task_id
        self.poll_interval_s = poll_interval_s

    def execute(self, context):
        ti = context.get("ti")
        if ti is not None and ti.xcom_pull(task_ids=self.plan_task_id) is None:
            raise ConsequentialFailure(f"nothing verified: the capture never ran ({self.plan_task_id} has no result "
                                       "because an earlier task failed; its own alert says why). Nothing is "
                                       "trained or exported for this run")
        return super().execute(context)

    def run(self, ctx, context):
        if store_for(ctx.cfg.stream.storage).streaming:
            return self._stream_verified(ctx, context)
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

    def _train_state(self, context) -> str | None:
        """``train_task_id``'s state in this run (None when Airflow cannot say)."""
        ti = context.get("ti")
        dag_run = context.get("dag_run")
        if ti is None or dag_run is None or not hasattr(ti, "get_task_states"):
            return None
        try:
            states = ti.get_task_states(dag_id=dag_run.dag_id, task_ids=[self.train_task_id],
                                        run_ids=[dag_run.run_id])
        except Exception as e:   # noqa: BLE001 - a look that fails is retried at the next poll
            self.log.warning("could not read %s's state: %s", self.train_task_id, e)
            return None
        return (states.get(dag_run.run_id) or {}).get(self.train_task_id)

    def _stream_verified(self, ctx, context):
        """The streaming run's record from the trainer: judged once it is there; until then the task is
        rescheduled (AirflowRescheduleException), so it holds no worker slot while training runs."""
        path = str(ctx.layout.stream_verified_file)
        try:
            text = ctx.node.read_text(path)
        except NodeError as e:
            self.log.warning("could not read %s yet: %s", path, e)
            text = None
        if not text:
            state = self._train_state(context)
            if state in ("failed", "upstream_failed", "skipped", "removed"):
                raise ConsequentialFailure(f"nothing verified: {self.train_task_id} ended {state} without the "
                                           f"streaming run's exactly-once record ({path} on node {ctx.node.name}); "
                                           "its own alert says why. Nothing is exported for this run")
            self.log.info("streaming run (stream.storage %s): no hidden-state files to verify; the trainer's "
                          "exactly-once record %s on node %s is not written yet (%s %s): looking again in %.0f s",
                          ctx.cfg.stream.storage, path, ctx.node.name, self.train_task_id, state or "not ended",
                          self.poll_interval_s)
            raise AirflowRescheduleException(datetime.now(timezone.utc) + timedelta(seconds=self.poll_interval_s))
        try:
            rec = json.loads(text)
        except ValueError as e:
            raise AirflowFailException(f"the streaming run's exactly-once record {path} on node {ctx.node.name} "
                                       f"is not JSON ({e})") from None
        summary = (f"streaming: {rec.get('samples')} sample(s) x {rec.get('epochs')} epoch(s), trained per epoch "
                   f"{rec.get('trained_per_epoch')}")
        self.log.info("%s; record %s", summary, rec)
        if not rec.get("ok"):
            raise AirflowFailException(f"the streaming run's exactly-once check failed on node {ctx.node.name}, so "
                                       f"nothing is exported: {rec.get('summary') or rec} ({path})")
        return summary + ": every sample trained exactly once per epoch"
