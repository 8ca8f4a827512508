"""Running Airflow itself, apart from the operators: the checkout's Airflow home (home), ``make airflow``'s
supervisor (standalone: ``python -m eagleflow.airflow.deploy.standalone start|supervise|stop``) and the
CeleryExecutor deployment that docker-compose.yaml mirrors (scaleout). No DAG or task imports these.
"""
