"""The extraction phase's ``PhaseLifecycle`` (named by its descriptor, ``phases.KINDS``' extract entry): what the
shard operators, the recovery and reconcile do to its server and workers."""
from __future__ import annotations

from eagleflow.phases import PhaseLifecycle
from eagleflow.watchdog.protocol import EventPayload
from eagleflow.watchdog.recovery import recover_before_retry

from . import lifecycle as capture


def _nothing_to_keep(ctx, shard: int, event: EventPayload) -> bool:
    return False   # an extraction retry looks at the shard itself first (airflow.shard_operators.ShardOperator)


LIFECYCLE = PhaseLifecycle(
    start_server=capture.start_capture_server, check_ready=capture.check_ready,
    wait_server_ready=capture.wait_capture_server_ready, stop_server=capture.stop_capture_server,
    start_worker=capture.start_or_attach_worker,
    # the capture server and the worker, restarted when unhealthy (``recover_server`` on the node)
    before_retry=recover_before_retry, after_failed_watch=_nothing_to_keep,
    shard_expectation=capture.shard_expectation, can_be_judged=capture.can_be_judged)
