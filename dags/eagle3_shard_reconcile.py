"""eagle3_shard_reconcile: rerun extraction and generation shards left incomplete with nobody working on them.

Every $EAGLEFLOW_RECONCILE_EVERY_MIN minutes (default 60): look at the latest
runs under the config's run_root on its node; an extraction shard whose
manifest holds fewer samples than the corpus assigns it, or a generation shard
(generate.enabled, phase not finished) whose manifest holds fewer records than
its sources give it, and whose worker is not alive, is rerun (the phase's own
server started if needed: the capture server, or the generation server in
serving mode) under the same stall watchdog as the pipeline; then a summary of
what was rerun, by phase, is mailed. A per-shard node lock, the live-worker
check and the worker's job lock make it idempotent: two reconciles at once, or
one beside a live pipeline, never run a shard twice.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.reconcile_operators import (FindIncompleteShardsOperator, ReconcileSummaryOperator,
                                                   RerunShardOperator)
from eagleflow.airflow.routing import default_config_path, node_routing
from eagleflow.settings import env_positive

EVERY_MIN = env_positive("EAGLEFLOW_RECONCILE_EVERY_MIN", 60, unit="minutes")
NODE = node_routing()  # the node's Celery queue and GPU pool, from $EAGLEFLOW_CONFIG

with DAG(
    dag_id="eagle3_shard_reconcile",
    description="Hourly: rerun extraction and generation shards left incomplete with no live worker, mail a summary",
    doc_md=__doc__,
    schedule=timedelta(minutes=EVERY_MIN),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["eagleflow", "eagle3", "watchdog"],
    default_args={"owner": "eagleflow", "queue": NODE.queue, "retries": 1, "retry_delay": timedelta(minutes=1),
                  **pipeline_failure_callbacks()},
    params={
        "config_path": Param(default_config_path(), type="string",
                             title="Config file", description="Pipeline config naming the node and its run_root."),
        "latest_runs": Param(3, type="integer", minimum=1, title="Latest runs",
                             description="How many of the newest runs (extraction or generation started) to look at."),
        "alert_emails": Param(None, type=["null", "array"], items={"type": "string"}, title="Alert emails",
                              description="Who gets the summary; empty = the config's watchdog.alert_emails."),
    },
) as dag:
    find = FindIncompleteShardsOperator(task_id="find_incomplete_shards", latest_runs="{{ params.latest_runs }}")
    rerun = RerunShardOperator.partial(task_id="rerun_shard", pool=NODE.pool).expand(target=find.output)
    summary = ReconcileSummaryOperator(task_id="mail_summary", trigger_rule="all_done")
    find >> rerun >> summary
