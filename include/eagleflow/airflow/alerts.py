"""PLACEHOLDER until the watchdog issue lands: no alert callbacks yet."""


def pipeline_failure_callbacks() -> dict:
    return {}
