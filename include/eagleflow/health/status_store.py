"""Where the status documents live: one key per node in a key-value store.

gpu_node_health writes them, the API server reads them. In Airflow that store
is Airflow's metadata database (eagleflow.airflow.status_variables: Airflow
Variables, reachable from every worker through the execution API and from the
API server directly, in every deployment); ``FolderKV`` is the same on local
disk, for the CLI and tests. A document whose node was not checked for
``forget_after_s`` (a node removed from the configs) is deleted: retention is
bounded both in time per node (the history) and in the number of nodes.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, cast

from eagleflow import bounded_json
from eagleflow.durable import atomic_write
from eagleflow.settings import env_positive

from .rules import GpuHealth
from .status_doc import StatusDoc, next_status

KEY_PREFIX = "eagleflow.gpu_status."
INCIDENTS_KEY = "eagleflow.gpu_health_incidents"   # gpu_node_health's incident book


class KeyValue(Protocol):
    def get(self, key: str) -> str | None: ...
    def set(self, key: str, value: str) -> None: ...
    def delete(self, key: str) -> None: ...
    def items(self, prefix: str) -> list[tuple[str, str]]: ...


class FolderKV:
    """One file per key in a folder (atomic writes)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def _path(self, key: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".json")

    def get(self, key: str) -> str | None:
        try:
            return self._path(key).read_text()
        except OSError:
            return None

    def set(self, key: str, value: str) -> None:
        atomic_write(self._path(key), value)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def items(self, prefix: str) -> list[tuple[str, str]]:
        if not self.folder.is_dir():
            return []
        out = []
        for p in sorted(self.folder.glob("*.json")):
            if p.stem.startswith(prefix):
                try:
                    out.append((p.stem, p.read_text()))
                except OSError:
                    continue
        return out


def node_key(node: str) -> str:
    return KEY_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", node)


class StatusStore:
    """The latest status document per node (with its history and the health rules' state)."""

    def __init__(self, kv: KeyValue | str | Path):
        self.kv: KeyValue = FolderKV(kv) if isinstance(kv, (str, Path)) else kv

    def load(self, node: str) -> dict[str, Any]:
        """The node's document (a ``StatusDoc``, as ``next_status`` wrote it); {} when absent or unreadable."""
        text = self.kv.get(node_key(node))
        try:
            doc = bounded_json.loads(text, source=f"status document {node_key(node)}") if text else {}
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def save(self, node: str, snaps=None, state: dict[str, GpuHealth] | None = None, alerts=(), error: str | None = None,
             *, now: float | None = None, **kw) -> StatusDoc:
        """One check's result merged into the node's document; ``kw``: see ``status_doc.next_status``."""
        from dataclasses import asdict, is_dataclass
        alert_dicts = [asdict(a) if is_dataclass(a) and not isinstance(a, type) else dict(a) for a in alerts or ()]
        prev = cast(StatusDoc, self.load(node))   # what next_status wrote last time, or {}
        doc = next_status(prev, node=node, now=time.time() if now is None else now, snaps=snaps,
                          state=state, alerts=alert_dicts, error=error, **kw)
        self.kv.set(node_key(node), json.dumps(doc, separators=(",", ":")))
        return doc

    def load_extra(self, key: str) -> dict[str, Any]:
        """A document kept beside the nodes' (e.g. gpu_node_health's incident book); {} when absent or unreadable."""
        text = self.kv.get(key)
        try:
            doc = bounded_json.loads(text, source=f"status document {key}") if text else {}
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def incidents(self) -> dict[str, dict[str, Any]]:
        """gpu_node_health's incident book (eagleflow.health.incidents), keyed by finding."""
        return self.load_extra(INCIDENTS_KEY)

    def save_incidents(self, book: dict[str, dict[str, Any]]) -> None:
        self.save_extra(INCIDENTS_KEY, book)

    def save_extra(self, key: str, doc: Mapping[str, object]) -> None:
        """Any JSON object beside the nodes' documents, written whole (the incident book, Airflow's health answer):
        no key of it is read here; ``load_extra`` reads it back."""
        if key.startswith(KEY_PREFIX):
            raise ValueError(f"{key!r}: keys under {KEY_PREFIX!r} are node documents")
        self.kv.set(key, json.dumps(doc, separators=(",", ":")))

    def all(self) -> list[dict[str, Any]]:
        out = []
        for _, text in self.kv.items(KEY_PREFIX):
            try:
                doc = bounded_json.loads(text, source="status document")
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("node"):
                out.append(doc)
        return sorted(out, key=lambda d: str(d["node"]))

    def forget_unchecked(self, *, keep: set[str], forget_after_s: float, now: float | None = None) -> list[str]:
        """Delete documents of nodes outside ``keep`` not checked for ``forget_after_s``; their names."""
        now = time.time() if now is None else now
        gone = []
        for doc in self.all():
            if doc["node"] not in keep and now - float(doc.get("checked_at") or 0) > forget_after_s:
                self.kv.delete(node_key(doc["node"]))
                gone.append(doc["node"])
        return gone


def history_retention_s() -> float:
    """How much history each node document keeps: $EAGLEFLOW_GPU_HISTORY_MIN minutes (default 60)."""
    return env_positive("EAGLEFLOW_GPU_HISTORY_MIN", 60, upper=24 * 60, unit="minutes") * 60
