"""The one check before a shard's worker starts, for every sharded phase (extraction and generation alike).

A fault found here is a fault like one the watch finds, and takes the same road: the shard's server ours but
stopped (state T, SIGSTOP'd or traced) or a zombie, or gone while the shard is not complete; or, on a retry, the
watch's own look finding the shard stalled, dead or failed with a cause the watch recovers (the server, the
worker). ``fault_before_start`` returns the watch's ``recovering`` event for it (the incident of (node, cause)
opened or joined on the node, ``eagleflow recover --incident-only``), and the operator starts its watch from that
event instead of starting the worker: ``watch_handler.mail_and_recover`` mails the incident once (STALLED) and
recovers it at once on the node (``watchdog.recovery.recover_in_watch``: the server restarted once per incident,
the shard's worker started, resuming from its manifest), and the next watch mails RECOVERED when the shard
stores again. Nothing is restarted silently: the drill of issue 52 item 5 found a generation server SIGSTOP'd
just before the next shard restarted without an incident or a mail, its first new record 121.7 s after the
fault.

The check reads only the server's process (its pid record and /proc state: one node command, no health
request, so a busy server is never probed here); a live server that loads or answers is the phase's own
business (generation waits for it, an extraction worker waits by itself). When no incident can be opened the
event is the plain verdict, and the task fails with it: Airflow's retry (and its mail) is the fallback.
"""
from __future__ import annotations

import time

from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.shard_watch import ShardWatchTrigger
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes import NodeError
from eagleflow.phase_jobs import STUCK_STATES, log_tail
from eagleflow.phases import ShardKind
from eagleflow.watchdog.diagnosis import StallDiagnosis
from eagleflow.watchdog.protocol import WatchEvent

SERVER_CAUSE = "capture_server"   # the watch's name for "the job's server", whichever phase's it is


def server_process_fault(ctx: RunContext, kind: ShardKind) -> tuple[str, str]:
    """("gone" | "stuck", why) when the phase's recorded server can never answer: gone, or ours and stopped,
    traced or a zombie; ("", "") when it can. Read from its pid record and /proc only."""
    pid_file = ctx.layout.pid_file(kind.server_role)
    st = ctx.node.process_status(str(pid_file))
    if not st.alive:
        return "gone", (f"the {kind.server} is not running (pid record {pid_file}: "
                        f"{'absent' if not st.recorded else st.detail})")
    if st.state in STUCK_STATES:
        pid = st.record.pid if st.record else "?"
        return "stuck", (f"the {kind.server} pid {pid} is {STUCK_STATES[st.state]}: it cannot answer until it is "
                         "restarted")
    return "", ""


def _heartbeat(ctx: RunContext, kind: ShardKind, shard: int) -> Heartbeat | None:
    text = ctx.node.read_text(str(kind.heartbeat_file(ctx.layout, shard)))
    try:
        return Heartbeat.from_json(text) if text else None
    except (ValueError, TypeError, KeyError, RecursionError):
        return None


def _manifest_lines(ctx: RunContext, kind: ShardKind, shard: int) -> int:
    """The shard's manifest lines (0 when it has none): never fewer than the entries it stores."""
    res = ctx.node.run(["wc", "-l", "--", str(kind.shard_dir(ctx.layout, shard) / "manifest.jsonl")], timeout=30)
    try:
        return int(res.stdout.split()[0]) if res.ok else 0
    except (ValueError, IndexError):
        return 0


def server_fault_diagnosis(ctx: RunContext, kind: ShardKind, shard: int, why: str,
                           hb: Heartbeat | None = None) -> StallDiagnosis:
    """The verdict of a server found unable to answer before the shard's worker started: stalled, blamed on the
    server, with the shard's counts (``done``: at least what its manifest and its last heartbeat hold, so the
    RECOVERED mail waits for a record stored after the fault) and the server's log tail."""
    done = max(hb.done if hb is not None else 0, _manifest_lines(ctx, kind, shard))
    total = hb.total if hb is not None else 0
    counts = f"{done:,}/{total:,} {kind.unit} done" if total else f"{done:,} {kind.unit} done"
    tail = [line for line in log_tail(ctx, kind.server_role).splitlines() if line.strip()][-20:]
    return StallDiagnosis(
        verdict="stalled", job=f"{kind.watch_name} {shard}/{kind.num_shards(ctx.cfg)}", node=ctx.cfg.node.name,
        observed_at=time.time(), headline=f"found before the shard's worker started ({counts})",
        evidence=[why], done=done, total=total,
        gpu_note="not read: found by the check before the shard started", log_tail=tail, cause=SERVER_CAUSE)


def retry_look(ctx: RunContext, shard: int, trigger: ShardWatchTrigger, try_number: int, log
               ) -> StallDiagnosis | None:
    """A retry looks before it acts (the try before may have died with the control plane, not with the shard):
    one look of the watch (``eagleflow watch --shard I --json``); None when the look got no answer (then
    nothing is stopped, the watch decides)."""
    try:
        return trigger.look_once(ctx)
    except (NodeError, ValueError) as e:
        log.warning("%s %d: try %d could not look at the shard first (%s); stopping nothing, the watch decides",
                    trigger.kind.watch_name, shard, try_number, e)
        return None


def watch_recovers(look: StallDiagnosis | None) -> bool:
    """A verdict the watch recovers itself: stalled, dead or failed, blamed on the server or the worker."""
    return look is not None and look.status in ("stalled", "dead", "failed") \
        and look.cause in (SERVER_CAUSE, "worker")


def first_watch_of_a_fault(trigger_of, ctx: RunContext) -> ShardWatchTrigger:
    """The shard's first watch, built by the operator's ``_rewatch``, for a fault found before it started: that
    fault gets its recovery even when ``watchdog.recoveries_in_watch`` is 0 (one found before the start was
    always recovered there)."""
    return trigger_of(run=ctx.trigger_ref(), recoveries_left=max(1, ctx.cfg.watchdog.recoveries_in_watch))


def fault_before_start(ctx: RunContext, shard: int, kind: ShardKind, trigger: ShardWatchTrigger, log,
                       look: StallDiagnosis | None = None) -> WatchEvent | None:
    """The watch's event for a fault found before the shard's worker starts (see the module's doc), or None.

    ``look``: a retry's first look of the watch (``retry_look``), when the operator took one: a verdict the watch
    recovers (``watch_recovers``) is that fault. ``trigger``: the shard's first watch (its recoveries, mails and
    incidents to close; ``first_watch_of_a_fault``)."""
    if look is not None and watch_recovers(look):
        log.warning("%s %d: a retry's first look found it %s (cause %s): opening the incident and recovering "
                    "now: %s", kind.watch_name, shard, look.verdict, look.cause, look.summary)
        return trigger.fault_event(ctx, look)
    try:
        state, why = server_process_fault(ctx, kind)
    except NodeError as e:   # the look itself failed: the watch decides, nothing is restarted here
        log.warning("%s %d: the %s was not looked at before the start (%s); the watch decides", kind.watch_name,
                    shard, kind.server, e)
        return None
    if not state:
        return None
    hb = _heartbeat(ctx, kind, shard)
    if state == "gone" and hb is not None and hb.state == "complete":
        return None   # a finished shard needs no server (its task cleared after the teardown): nothing to recover
    diag = server_fault_diagnosis(ctx, kind, shard, why, hb)
    log.warning("%s %d: before the shard started, %s; opening the incident and recovering now",
                kind.watch_name, shard, why)
    return trigger.fault_event(ctx, diag)
