"""Why a gate's trigger never fires in the first seconds after its task deferred (apache/airflow#72716, #71580).

A task that defers exits its worker process; the executor reports that exit as a success, and the scheduler
drains the report a few seconds later (LocalExecutor: ~5 s here, longer under load). Airflow 3.3's scheduler
ignores that stale report while the task is scheduled or queued again, but not once the resumed try is already
running: it logs "state mismatch", fails the try, and the retry's callback mails RETRYING for a run that was fine
(seen on capture_server_ready in 2 of 3 runs of test_stream_scheduler: the server got ready right after the
deferral). So a gate first looks for ``DEFER_SETTLE_S`` in the worker (a server that loads in seconds never
defers), and its trigger holds an event until ``DEFER_SETTLE_S`` after the deferral (one that loads in minutes
pays nothing). Only the gates' triggers do this: a watch's alarm is never held.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, Callable, TypeVar

DEFER_SETTLE_S = 15.0

T = TypeVar("T")


def look_before_deferring(look: Callable[[], T], done: Callable[[T], bool], poll_s: float,
                          window_s: float | None = None) -> T:
    """``look()`` every ``poll_s`` until ``done`` says so or ``window_s`` (default ``DEFER_SETTLE_S``) passed;
    the last look."""
    end = time.monotonic() + (DEFER_SETTLE_S if window_s is None else window_s)
    while True:
        seen = look()
        if done(seen) or time.monotonic() + poll_s > end:
            return seen
        time.sleep(poll_s)


async def hold_until_settled(deferred_at: float | None) -> None:
    """Sleep until ``DEFER_SETTLE_S`` after ``deferred_at`` (unix time; None: a trigger not from a deferral)."""
    if deferred_at is not None:
        wait = deferred_at + DEFER_SETTLE_S - time.time()
        if wait > 0:
            await asyncio.sleep(wait)


async def first_event_settled(looks: AsyncGenerator[Any, None], deferred_at: float | None) -> Any:
    """A gate trigger's one event: the first ``looks`` yields (then it is closed, and its connection with it),
    held until settled."""
    try:
        event = await anext(looks)
    finally:
        await looks.aclose()
    await hold_until_settled(deferred_at)
    return event
