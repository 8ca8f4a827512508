"""EAGLE-3 draft training: model, draft vocabulary, data streaming, TTT loss, trainer, export.

Never imports Airflow: it runs on the GPU node under the CLI (`eagleflow train`, `eagleflow export`).
"""
