"""Hidden-state capture: servers (hf, sglang), sharded resumable extraction, safe storage.

Never imports Airflow: it runs on the GPU node under the CLI.
"""
