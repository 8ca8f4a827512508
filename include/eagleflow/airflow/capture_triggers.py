"""The old classpath of ``server_triggers.ServerReadyTrigger``, kept so that a payload the triggerer table stored
under it (``eagleflow.airflow.capture_triggers.CaptureServerReadyTrigger``) is still rebuilt, or refused naming
what it lacks, rather than failing on a missing module. New deferrals use ``ServerReadyTrigger``."""
from __future__ import annotations

from eagleflow.airflow.server_triggers import ServerReadyTrigger

CaptureServerReadyTrigger = ServerReadyTrigger

__all__ = ["CaptureServerReadyTrigger"]
