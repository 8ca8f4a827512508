"""The operator's console: what the GPU view, the metrics endpoint and the run report show.

Airflow-free: the status documents (status_doc), where they are kept (status_store),
what the node tells about our jobs (node_activity), and the renderings (gpu_page,
prometheus, run_report). eagleflow.airflow.console_app serves them behind Airflow's login.
"""
