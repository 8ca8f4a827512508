"""Corpus phase in Airflow: prepare the corpus, optionally delete old caches, check the disk budget.

Each operator runs the phase's CLI command on the node (``ctx.node.check``)
and logs what it printed. The prepared corpus is the Asset ``CORPUS_ASSET``:
a DAG can be scheduled on it (``schedule=[CORPUS_ASSET]``); each event carries
the run dir and the corpus' numbers in its ``extra``.

``delete_old_caches`` is a logged no-op success when the Param / config is off
(not a skip), so ``check_disk`` after it runs under the default trigger rule.
"""
from __future__ import annotations

import json
from typing import Any

from airflow.sdk import Asset
from airflow.sdk.exceptions import AirflowFailException
from pydantic import BaseModel, ConfigDict

from eagleflow.airflow.base import RunOperator
from eagleflow.corpus_commands import EXIT_BAD_INPUT, EXIT_BAD_RECORDS, EXIT_NOT_ENOUGH_DISK, EXIT_REFUSED
from eagleflow.nodes import NodeCommandFailed

CORPUS_ASSET = Asset(name="eagleflow_corpus", uri="eagleflow://corpus")

PREPARE_TIMEOUT_S = 12 * 3600.0  # the seeds' 87.8 M tokens take minutes; leave ample room on slow nodes


class CorpusAnswer(BaseModel):
    """The last stdout line of a `eagleflow corpus ...` command: its result document (fields vary per command)."""
    model_config = ConfigDict(extra="allow")

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def _run_cli(op: RunOperator, ctx, args: list[str], timeout: float, final_codes: dict[int, str]) -> CorpusAnswer:
    """Run the command; log its stderr lines; a known exit code fails without retry."""
    try:
        return ctx.node.run_json(ctx.eagleflow_argv(*args), CorpusAnswer, timeout=timeout,
                                 log=lambda line: op.log.info("%s", line))
    except NodeCommandFailed as e:
        if e.exit_code in final_codes:
            raise AirflowFailException(f"{final_codes[e.exit_code]} (node {ctx.node.name}):\n"
                                       f"{e.stderr.strip()[-4000:]}") from None
        raise


class PrepareCorpusOperator(RunOperator):
    """`eagleflow corpus prepare` on the node; emits the corpus Asset with its numbers."""

    def __init__(self, **kw):
        kw.setdefault("outlets", [CORPUS_ASSET])
        super().__init__(**kw)

    def run(self, ctx, context):
        stats = _run_cli(self, ctx, ["corpus", "prepare"], PREPARE_TIMEOUT_S,
                         {EXIT_BAD_RECORDS: "corpus has bad records",
                          EXIT_BAD_INPUT: "corpus source unreadable or chat template cannot render it"})
        summary = {"run_dir": str(ctx.layout.run_dir), "corpus_file": stats.get("corpus_file"),
                   "records": stats.get("records"), "tokens": stats.get("tokens"),
                   "masked_tokens": stats.get("masked_tokens"), "length": stats.get("length"),
                   "dropped": stats.get("dropped"), "mask_method": stats.get("mask_method"),
                   "order_sha256": stats.get("order_sha256")}
        self.log.info("corpus ready on node %s: %s records, %s tokens (%s masked), per source %s",
                      ctx.node.name, summary["records"], summary["tokens"], summary["masked_tokens"],
                      json.dumps({k: v.get("records") for k, v in stats.get("per_source", {}).items()}))
        outlet_events = context.get("outlet_events")
        if outlet_events is not None:
            outlet_events[CORPUS_ASSET].extra = summary
        return summary


class DeleteOldCachesOperator(RunOperator):
    """`eagleflow corpus delete-caches` on the node: deletes only when disk.delete_old_caches is on
    (DAG Param delete_old_caches), only under disk.cache_root; otherwise logs what could be freed."""

    def run(self, ctx, context):
        result = _run_cli(self, ctx, ["corpus", "delete-caches"], 6 * 3600.0,
                          {EXIT_REFUSED: "cache deletion refused"})
        if result.get("enabled"):
            self.log.info("deleted %d old cache(s), %d bytes freed", len(result.get("deleted", {})),
                          result.get("freed_bytes", 0))
        else:
            self.log.info("old cache deletion is off (Param delete_old_caches): nothing deleted")
        return result.model_dump()


class CheckDiskOperator(RunOperator):
    """`eagleflow corpus budget --check` on the node: fails (no retry) when the hidden states will not fit."""

    def run(self, ctx, context):
        verdict = _run_cli(self, ctx, ["corpus", "budget", "--check"], 3600.0,
                           {EXIT_NOT_ENOUGH_DISK: "not enough disk for the hidden states"})
        self.log.info("%s", verdict.get("message", ""))
        return {k: verdict.get(k) for k in ("ok", "where", "free_bytes")} | {
            "needed_bytes": verdict.get("estimate", {}).get("needed_bytes")}
