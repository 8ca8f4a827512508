"""The generation phase's ``PhaseLifecycle`` (named by its descriptor, ``phases.KINDS``' generate entry): what the
shard operators, the recovery and reconcile do to its server and workers."""
from __future__ import annotations

from typing import Any

from eagleflow.phases import PhaseLifecycle

from . import lifecycle as generate
from . import phase as generate_phase


def _stop_server_after_stall(ctx, shard: int, log) -> Any:
    # a hung generation server still answers /health_generate: stopped once (if still the one that stalled)
    return generate.stop_after_server_stall(ctx, shard, log=log.warning if hasattr(log, "warning") else log)


LIFECYCLE = PhaseLifecycle(
    start_server=generate.start_generate_server, check_ready=generate.check_ready,
    wait_server_ready=generate.wait_generate_server_ready, stop_server=generate.stop_generate_server,
    start_worker=generate.start_or_attach_generate_worker,
    before_retry=_stop_server_after_stall, after_failed_watch=generate.record_server_stall,
    shard_expectation=generate_phase.shard_expectation, can_be_judged=generate_phase.can_be_judged)
