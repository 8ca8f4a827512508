# Control-plane image for docker-compose.yaml: Airflow 3.3.2 and eagleflow's control-plane extra only.
# The GPU node's libraries (torch, transformers, datasets, sglang) are not here: every phase runs on the
# node through the eagleflow CLI over SSH. requirements.txt is the lock: it pins each version pip installs.
FROM apache/airflow:3.3.2-python3.11
ENV EAGLEFLOW_HOME=/opt/eagleflow
COPY --chown=airflow:root requirements.txt pyproject.toml /opt/eagleflow/
COPY --chown=airflow:root include /opt/eagleflow/include
RUN pip install --no-cache-dir --constraint /opt/eagleflow/requirements.txt -e "/opt/eagleflow[control-plane]"
