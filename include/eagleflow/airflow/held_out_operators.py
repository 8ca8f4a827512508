"""capture_held_out: the held-out records' hidden states, for the trainer's held-out evaluation.

Runs on the node while the capture server is up, after the extraction shards:
`eagleflow capture held-out` stores the first ``train.held_out_samples``
records of the corpus's evaluation split apart from the training store
(``<run>/hidden_states_held_out``) and verifies them. It is small (64 records
by default) and runs in the foreground over the node connection; each request
has the extraction's own deadline, so a hung server fails it within one
request's time, and a retry resumes from its manifest.
"""
from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException

from eagleflow.airflow.base import RunOperator
from eagleflow.nodes import NodeError


class CaptureHeldOutOperator(RunOperator):
    def run(self, ctx, context):
        tc, cc = ctx.cfg.train, ctx.cfg.capture
        if tc.eval_every == 0 or tc.held_out_samples == 0:
            self.log.info("train.eval_every %d, train.held_out_samples %d: no held-out evaluation while training, "
                          "nothing to capture", tc.eval_every, tc.held_out_samples)
            return None
        # the outer bound only: every request in it has its own deadline (capture.request_timeout_*)
        timeout = 300.0 + tc.held_out_samples * (cc.request_timeout_base_s
                                                 + cc.request_timeout_per_token_s * ctx.cfg.corpus.max_length)
        try:
            # exit 1 still carries the report: the capture ran and verification found what is missing
            report = ctx.node.run_json(ctx.eagleflow_argv("capture", "held-out", "--json"), dict[str, Any],
                                       timeout=timeout, answer_codes=(0, 1))
        except NodeError as e:
            raise AirflowException(f"held-out capture on node {ctx.node.name} failed (a retry resumes from its "
                                   f"manifest): {e}") from None
        self.log.info("held-out hidden states: %s in %s", report["summary"], report["dir"])
        if not report["ok"]:
            raise AirflowException(f"held-out hidden states on node {ctx.node.name} did not verify: "
                                   f"{report['summary']}; a retry captures what is missing")
        return {"samples": report["stored"], "dir": report["dir"]}
