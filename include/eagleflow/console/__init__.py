"""The operator's console: what the GPU view, the metrics endpoint and the run report show.

Airflow-free renderings (gpu_page, prometheus, run_report) of what eagleflow.health
keeps (the status documents, the incident book). Layering: console imports health and
gpu, never the other way round. eagleflow.airflow.console_app serves them behind Airflow's login.
"""
