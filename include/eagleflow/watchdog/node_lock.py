"""Moved to ``eagleflow.nodes.locks`` (both node locks, one rule); this name stays until its last caller,
watchdog/recovery.py, imports it from there."""
from eagleflow.nodes.locks import NodeLock, NodeLockTimeout

__all__ = ["NodeLock", "NodeLockTimeout"]
