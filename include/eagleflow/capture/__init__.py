"""The hidden states' storage side: how a shard's files are written (``storage``), the manifest both sharded
phases keep per shard (``manifest``) and the verification of every stored file against it (``verify``).

The extraction phase itself (its worker, node commands and lifecycle) is ``eagleflow.phases.extract``; the
servers are the engines' (``eagleflow.engines.<name>``) and what every server shares is ``eagleflow.serving``.
Never imports Airflow: it runs on the GPU node under the CLI.
"""
