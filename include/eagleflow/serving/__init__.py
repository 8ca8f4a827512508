"""What every target server shares, whatever its engine (``eagleflow.engines``) and its role (capture,
generation, evaluation): the client the workers and the evaluations speak (``client``), the launch of an engine's
capture server (``launch``), the dump protocol between a capture server and the worker (``dump_protocol``) and
the capture layers in eagleflow's own numbering (``aux_layers``). Never imports Airflow."""
