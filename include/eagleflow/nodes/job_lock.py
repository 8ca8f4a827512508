"""Moved to ``eagleflow.nodes.locks`` (both node locks, one rule); this name stays until its last caller,
capture/commands.py, imports it from there."""
from eagleflow.nodes.locks import LOCK_FD_ENV, JobLockHeld, hold_for_life, lock_exclusive, read_holder, write_holder

__all__ = ["LOCK_FD_ENV", "JobLockHeld", "hold_for_life", "lock_exclusive", "read_holder", "write_holder"]
