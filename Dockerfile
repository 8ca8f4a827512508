# Control-plane image for docker-compose.yaml: Airflow 3.3.2 plus eagleflow's pinned deps.
FROM apache/airflow:3.3.2-python3.11
COPY --chown=airflow:root requirements.txt pyproject.toml /opt/eagleflow/
COPY --chown=airflow:root include /opt/eagleflow/include
RUN pip install --no-cache-dir -r /opt/eagleflow/requirements.txt \
 && pip install --no-cache-dir --no-deps -e /opt/eagleflow
