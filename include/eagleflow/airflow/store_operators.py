"""The run's hidden-state store in Airflow (``stream.storage``, issue 53): started before the capture, stopped at
the end, and the choice of when training may start.

The storage is chosen per run (the ``storage`` Param, frozen as ``stream.storage``) while the DAG's shape is
static, so the store tasks always exist and say what they do for the run's store:

* ``StartStoreOperator`` runs ``eagleflow store start`` on the training node: a streaming store's master and
  segment holder as recorded processes (``<run_dir>/store_endpoint.json``); a store without a server (disk)
  does nothing, without asking the node.
* ``StopStoreOperator`` runs ``eagleflow store stop`` (by the pid records only) at the end of the run, whatever
  it did (trigger rule all_done), so the store never outlives the run; a run whose config was never frozen
  started nothing and skips.
* ``ChooseTrainingStartOperator`` is a branch after the capture is ready and the store is up: a streaming run
  follows ``stream_task`` (training beside the extraction shards, drawing samples as they arrive) and skips
  ``offline_task`` (the GPU gate behind verification); an offline run follows ``offline_task`` and skips
  ``stream_task``, so it trains only on verified data, as before.

Nothing here compares a store's name: a ``Store`` says what differs (``streaming``, ``start``).
"""
from __future__ import annotations

from typing import Any

from airflow.providers.standard.operators.branch import BranchMixIn
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from pydantic import BaseModel, ConfigDict

from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.fleet.stream import EndpointRefused, hand_endpoint_to_capture_nodes
from eagleflow.nodes import NodeError
from eagleflow.stores import Store, store_for


class StoreAnswer(BaseModel):
    """`eagleflow store start|stop` (the last stdout line)."""
    model_config = ConfigDict(extra="allow")
    store: str


def run_store(ctx: RunContext) -> Store:
    """The run's store (its frozen ``stream.storage``)."""
    return store_for(ctx.cfg.stream.storage)


class StartStoreOperator(RunOperator):
    """``eagleflow store start`` on the training node for a store that has a server; a no-op otherwise.

    The store's own start attaches to a store already running for the run (a retry, a cleared task), never
    starting a second; a failed start names the process and its log (exit 3) and fails the task (retried)."""

    ui_color = "#e6f4ea"

    def __init__(self, *, timeout_s: float = 120.0, **kw):
        super().__init__(**kw)
        self.timeout_s = timeout_s

    def run(self, ctx: RunContext, context):
        store = run_store(ctx)
        if not store.start:
            self.log.info("stream.storage %s: the %s has no server to start; nothing to do", store.name, store.label)
            return {"store": store.name, "started": False}
        argv = ctx.eagleflow_argv("store", "start", "--timeout", str(max(10.0, self.timeout_s - 30)))
        answer = ctx.node.run_json(argv, StoreAnswer, timeout=self.timeout_s, log=self.log.info)
        info = answer.model_dump()
        self.log.info("%s of run %s %s on node %s: %s", store.label, ctx.layout.run_id,
                      "attached (already running)" if info.get("attached") else "started", ctx.node.name, info)
        if ctx.cfg.is_fleet:   # the other capture nodes put into this store: each gets its endpoint
            try:
                info["handed_to"] = hand_endpoint_to_capture_nodes(ctx, info, self.log.info)
            except EndpointRefused as e:
                raise AirflowFailException(str(e)) from None
        return info


class StopStoreOperator(RunOperator):
    """``eagleflow store stop`` on the training node at the end of the run, however it went (all_done).

    Stops the store's recorded processes by their records only (TERM, grace, KILL); a store without a server
    does nothing. A run whose config was never frozen (its first task failed) started no store: skipped, with
    no second alert."""

    ui_color = "#e6f4ea"

    def __init__(self, *, grace_s: float = 10.0, **kw):
        kw.setdefault("trigger_rule", "all_done")
        super().__init__(**kw)
        self.grace_s = grace_s

    def execute(self, context):
        if RunContext.frozen_in(context) is None:
            raise AirflowSkipException("no store to stop: the run's config was never frozen, so nothing started one")
        return super().execute(context)

    def run(self, ctx: RunContext, context):
        store = run_store(ctx)
        if not store.stop:
            self.log.info("stream.storage %s: the %s has no server to stop; nothing to do", store.name, store.label)
            return {"store": store.name, "stopped": []}
        argv = ctx.eagleflow_argv("store", "stop", "--grace", str(self.grace_s))
        try:
            answer = ctx.node.run_json(argv, StoreAnswer, timeout=self.grace_s * 2 + 120, answer_codes=(0, 1),
                                       log=self.log.info)
        except NodeError as e:
            raise AirflowFailException(f"the run's {store.label} could not be stopped on node {ctx.node.name}: "
                                       f"{e}") from None
        stopped: list[dict[str, Any]] = list(answer.model_dump().get("stopped") or [])
        for r in stopped:
            self.log.info("stopped: %s", r)
        bad = [r for r in stopped if r.get("outcome") in ("refused", "unkillable", "survived", "not_ours")]
        if bad:
            raise AirflowFailException(f"the run's {store.label} on node {ctx.node.name} did not stop cleanly: "
                                       + "; ".join(f"{r.get('role', '?')} pid {r.get('pid', '?')}: {r.get('outcome')}"
                                                   for r in bad))
        return {"store": store.name, "stopped": stopped}


class ChooseTrainingStartOperator(RunOperator, BranchMixIn):
    """When training may start: beside the extraction shards for a streaming store (``stream_task``), after
    verification for an offline one (``offline_task``). The branch not taken is skipped at once."""

    inherits_from_skipmixin = True
    ui_color = "#fdf3e1"

    def __init__(self, *, stream_task: str, offline_task: str, **kw):
        super().__init__(**kw)
        self.stream_task = stream_task
        self.offline_task = offline_task

    def run(self, ctx: RunContext, context):
        store = run_store(ctx)
        if store.streaming:
            self.log.info("stream.storage %s: training starts now, beside the extraction shards, drawing samples "
                          "from the %s as they arrive (%s)", store.name, store.label, self.stream_task)
            return self.stream_task
        self.log.info("stream.storage %s: training waits for every sample stored and verified (%s)", store.name,
                      self.offline_task)
        return self.offline_task

    def execute(self, context):
        return self.do_branch(context, super().execute(context))
