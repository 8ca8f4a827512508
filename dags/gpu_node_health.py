"""gpu_node_health: every few minutes, look at each GPU node from outside any run.

Fails (and so alerts, through the pipeline's failure callbacks) when a GPU
holds memory at 0 % utilisation for longer than a window while no eagleflow
job is registered on it (the seeds' silent stall), or when its uncorrected ECC
count rises. Every check is stored in Airflow's metadata DB with the last hour
of readings: the GPU view (Browse -> GPU nodes) and /eagleflow-gpu/metrics read it.
Unpaused on creation: the view must never wait for someone to switch it on.

Schedule: every $EAGLEFLOW_GPU_HEALTH_EVERY_MIN minutes (default 1). Nodes: the
configs in $EAGLEFLOW_HEALTH_CONFIGS (os.pathsep-separated), else $EAGLEFLOW_CONFIG.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.gpu_operators import GpuNodeHealthOperator

EVERY_MIN = float(os.environ.get("EAGLEFLOW_GPU_HEALTH_EVERY_MIN", "1"))
CONFIGS = [p for p in os.environ.get("EAGLEFLOW_HEALTH_CONFIGS", "").split(os.pathsep) if p] or \
    [os.environ.get("EAGLEFLOW_CONFIG", "configs/local-demo.yaml")]

with DAG(
    dag_id="gpu_node_health",
    description="Every few minutes: GPU memory held at 0 % with no eagleflow job on it, rising ECC counts",
    doc_md=__doc__,
    schedule=timedelta(minutes=EVERY_MIN),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=max(EVERY_MIN, 2)),
    tags=["eagleflow", "gpu", "health"],
    # one retry: an SSH blip should not page anyone; a real finding fails again 30 s later
    default_args={"owner": "eagleflow", "retries": 1, "retry_delay": timedelta(seconds=30),
                  **pipeline_failure_callbacks()},
    params={
        "config_paths": Param(CONFIGS, type="array", items={"type": "string"}, title="Node configs",
                              description="Pipeline configs whose node is checked (one node each)."),
        "memory_threshold_mib": Param(1024, type="integer", minimum=0, title="Held memory threshold (MiB)",
                                      description="A GPU above this at 0 % utilisation counts as held."),
        "window_s": Param(600, type="integer", minimum=0, title="Window (s)",
                          description="Alert when a GPU has been held at 0 % for this long with no eagleflow job."),
    },
) as dag:
    GpuNodeHealthOperator(task_id="check_gpu_nodes", interval_s=EVERY_MIN * 60)
