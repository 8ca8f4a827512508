"""The extraction phase: sharded resumable extraction of hidden states through a target server, safe storage.

The servers themselves are the engines' (``eagleflow.engines.<name>``); what every server shares (client,
launch, dump protocol, capture layers) is ``eagleflow.serving``. Never imports Airflow: it runs on the GPU node
under the CLI.
"""
