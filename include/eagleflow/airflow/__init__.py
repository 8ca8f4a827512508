"""Operators, sensors, triggers, notifiers: the package that adapts the core to Airflow.

Outside it, only nodes/ssh.py and nodes/ssh_async.py import Airflow (its SSH provider, lazily, for a node
reached by an Airflow connection) and demo.py (which drives Airflow); tests/unit/test_airflow_boundary.py
checks this.
"""
