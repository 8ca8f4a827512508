"""gpu_node_health: every minute, look at each GPU node from outside any run.

Finds a GPU holding memory at 0 % utilisation for longer than a window while no
eagleflow job is registered on it (the seeds' silent stall), a rising
uncorrected ECC count, a node that stays unreachable, a config that cannot be
read. Each finding is an incident: one mail when it opens, reminders that back
off, one "resolved" mail; the task is red while one is open. A config_paths
entry that is missing or refused is no finding but a task error naming it (not
mailed when a trigger chose it). Every check is
stored in Airflow's metadata DB with the last hour of readings: the GPU view
(Browse -> GPU nodes) and /eagleflow-gpu/metrics read it. Unpaused on
creation: the view must never wait for someone to switch it on.

Schedule: every $EAGLEFLOW_GPU_HEALTH_EVERY_MIN minutes (default 1). Param defaults (seconds):
$EAGLEFLOW_GPU_HELD_WINDOW_S (600), $EAGLEFLOW_GPU_UNREACHABLE_AFTER_S (180),
$EAGLEFLOW_GPU_REMIND_AFTER_S (1800). Nodes: the
configs in $EAGLEFLOW_HEALTH_CONFIGS (os.pathsep-separated), else $EAGLEFLOW_CONFIG.
Mail recipients: each node config's watchdog.alert_emails.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.health_operators import GpuNodeHealthOperator
from eagleflow.settings import env_positive

EVERY_MIN = env_positive("EAGLEFLOW_GPU_HEALTH_EVERY_MIN", 1, unit="minutes")
# the Params' defaults, per deployment (a triggered run can still set its own)
WINDOW_S = int(env_positive("EAGLEFLOW_GPU_HELD_WINDOW_S", 600, unit="seconds"))
UNREACHABLE_AFTER_S = int(env_positive("EAGLEFLOW_GPU_UNREACHABLE_AFTER_S", 180, unit="seconds"))
REMIND_AFTER_S = int(env_positive("EAGLEFLOW_GPU_REMIND_AFTER_S", 1800, unit="seconds"))
CONFIGS = [p for p in os.environ.get("EAGLEFLOW_HEALTH_CONFIGS", "").split(os.pathsep) if p] or \
    [os.environ.get("EAGLEFLOW_CONFIG", "configs/local-demo.yaml")]

with DAG(
    dag_id="gpu_node_health",
    description="Every minute: GPU memory held at 0 % with no eagleflow job, rising ECC counts, unreachable nodes",
    doc_md=__doc__,
    schedule=timedelta(minutes=EVERY_MIN),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=max(EVERY_MIN, 2)),
    tags=["eagleflow", "gpu", "health"],
    # one retry, unmailed: the check itself failing (not a finding) is mailed once, when the retry fails too
    default_args={"owner": "eagleflow", "retries": 1, "retry_delay": timedelta(seconds=30),
                  **pipeline_failure_callbacks(retry_mail=False)},
    params={
        "config_paths": Param(CONFIGS, type="array", items={"type": "string"}, title="Node configs",
                              description="Pipeline configs whose nodes are checked (a fleet config: each of its "
                                          "nodes)."),
        "memory_threshold_mib": Param(1024, type="integer", minimum=1, title="Held memory threshold (MiB)",
                                      description="A GPU above this at 0 % utilisation counts as held."),
        "window_s": Param(WINDOW_S, type="integer", minimum=1, title="Window (s)",
                          description="Open an incident when a GPU has been held at 0 % for this long with no "
                                      "eagleflow job."),
        "unreachable_after_s": Param(UNREACHABLE_AFTER_S, type="integer", minimum=1, title="Unreachable after (s)",
                                     description="Open an incident when a node cannot be read for this long."),
        "remind_after_s": Param(REMIND_AFTER_S, type="integer", minimum=1, title="First reminder after (s)",
                                description="While an incident is open: a reminder after this, then after "
                                            "twice as long each time (at most daily)."),
    },
) as dag:
    GpuNodeHealthOperator(task_id="check_gpu_nodes", interval_s=EVERY_MIN * 60)
