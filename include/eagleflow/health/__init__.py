"""Node health between runs: what gpu_node_health finds, remembers and mails, outside any run.

Airflow-free. The GPU rules (rules: memory held at 0 % with no job of ours, rising
ECC counts), what the node tells about our jobs (node_activity, a node-side
command), Airflow's own parts (airflow_health), each node's status document
(status_doc) and where it is kept (status_store), the findings as incidents with
their mails (incidents), and how long, as a person says it (durations).

Layering, strictly downward: ``console`` (the renderings) imports ``health`` and
``gpu``; ``health`` imports ``gpu``, ``nodes`` and ``watchdog``; ``gpu`` imports
neither ``health`` nor ``console``. ``eagleflow.airflow.health_operators`` runs the
check; ``tests/unit/test_airflow_boundary.py`` holds the arrows to this.
"""
