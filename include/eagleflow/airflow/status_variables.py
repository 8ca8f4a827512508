"""The console's status documents in Airflow's metadata database, as Airflow Variables.

Why Variables: a task in Airflow 3 has no database connection of its own, but
it can write a Variable through the execution API, on every executor (local,
Celery, Kubernetes); the API server (which serves the GPU view) reads the same
rows from the database. One Variable per node, plus an index of the node keys
(a task cannot list Variables). Each document is bounded (status_doc.MAX_POINTS)
and a node not checked for a while is deleted (StatusStore.forget_unchecked).
"""
from __future__ import annotations

import json
from typing import Any

from eagleflow import bounded_json
from eagleflow.health.status_store import KEY_PREFIX, StatusStore

INDEX_KEY = "eagleflow.gpu_status_index"
DESCRIPTION = "eagleflow GPU view: written by gpu_node_health every check; do not edit"


class VariableKV:
    """Key-value over Airflow Variables: the task SDK's in a task, the database's in the API server."""

    def __init__(self, in_task: bool = True):
        if in_task:
            from airflow.sdk import Variable
            self._get = lambda k: Variable.get(k, default=None)
            self._var: Any = Variable   # either class: both have the set and delete used here
        else:
            from airflow.models.variable import Variable as DbVariable
            self._get = lambda k: DbVariable.get(k, default_var=None)
            self._var = DbVariable

    def get(self, key: str) -> str | None:
        return self._get(key)

    def _index(self) -> list[str]:
        try:
            keys = bounded_json.loads(self._get(INDEX_KEY) or "[]", source=f"Airflow Variable {INDEX_KEY}")
        except ValueError:
            return []
        return [k for k in keys if isinstance(k, str) and k.startswith(KEY_PREFIX)]

    def set(self, key: str, value: str) -> None:
        self._var.set(key, value, description=DESCRIPTION)
        keys = self._index()
        if key.startswith(KEY_PREFIX) and key not in keys:   # the index lists node documents only
            self._var.set(INDEX_KEY, json.dumps(sorted(keys + [key])), description=DESCRIPTION)

    def delete(self, key: str) -> None:
        self._var.delete(key)
        self._var.set(INDEX_KEY, json.dumps([k for k in self._index() if k != key]), description=DESCRIPTION)

    def items(self, prefix: str) -> list[tuple[str, str]]:
        out = []
        for k in self._index():
            if k.startswith(prefix):
                v = self._get(k)
                if v is not None:
                    out.append((k, v))
        return out


def variable_status_store(in_task: bool = True) -> StatusStore:
    return StatusStore(VariableKV(in_task=in_task))
