"""From one observation to a verdict: healthy, slow, stalled, dead, failed, complete (or starting), with a cause.

The rules, in order:

1. The heartbeat says complete -> complete; failed -> failed (with the job's error; cause
   ``capture_server`` when the server is gone/stopped or was restarted under the worker).
2. The worker is gone or a zombie -> dead, saying how: its exit status where known, an OOM kill
   from the kernel log, else "vanished without a final heartbeat" (SIGTERM writes ``failed``).
3. Progress is younger than this run's stale threshold, ``max(stall_after_s, slow_factor x p95
   gap between samples)`` -> healthy (and ``recheck_in_s`` says when it would turn stale). While
   nothing is stored yet (counted from the manifest) inside ``startup_grace_s`` -> starting,
   unless the worker is visibly frozen.
4. Progress is stale. It is *stalled* only if at least one independent signal says so:
   - the server process is gone, a zombie or stopped (state T), or in D state;
   - the server did not answer /health_generate and the GPUs were not busy (now or in any look
     since the last progress);
   - /health_generate answers but the oldest request is far older than this run's requests take
     (a hung /generate), GPUs not busy;
   - an in-flight request is older than its own timeout;
   - the worker is stopped, in D state for ``d_state_after_s``, or alive with a heartbeat not
     rewritten for ``max(5 x interval, stall_after_s, 10 s)`` *before it was read* while its process
     group gained no CPU time over that same window (read from /proc at each look and compared with
     the previous: a late heartbeat from a process still using CPU, e.g. starved on a loaded node, is
     slow, not frozen);
   - the GPUs hold memory above baseline at 0 % for ``gpu_window_s``;
   - a shard worker has no request in flight at all; the disk is nearly full.
   Otherwise it is *slow*. The cause is the first process-level fact, else the first inference.
   A slow (or starting) verdict whose evidence may turn says when (``recheck_in_s``): the oldest
   request reaching its hung limit, the CPU window of a late heartbeat closing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from eagleflow.config import PipelineConfig
from eagleflow.heartbeat import (BUSY_SINCE, BUSY_WITH, ROOM_WAIT_ENDED, STEP_TIMES, WAITING_FOR_PASS, WAITING_FOR_ROOM,
                                 WAITING_FOR_SAMPLES, WAITING_FOR_STORE, Heartbeat)
from eagleflow.watchdog.diagnosis import GpuRow, StallDiagnosis, Verdict
from eagleflow.watchdog.signals import Observation, Pace, ProcessSignal, p95, pace_of, progress_at


def heartbeat_stale_after_s(cfg: PipelineConfig) -> float:
    """How old a heartbeat may be before the writer itself counts as frozen.

    Not just a few intervals: the writer fsyncs, and on a node busy writing
    hidden states one fsync can take seconds (seen at 4 s on a loaded CI box).
    """
    return max(5 * cfg.capture.heartbeat_interval_s, cfg.watchdog.stall_after_s, 10.0)


def frozen_window_s(cfg: PipelineConfig) -> float:
    """How long a live job's process group must be seen gaining no CPU time before its late heartbeat says it is
    frozen: the window the heartbeat itself is judged over (``heartbeat_stale_after_s``)."""
    return heartbeat_stale_after_s(cfg)


def hung_request_limit_s(pace: Pace, in_flight: int, probe_latency_s: float, slow_factor: float) -> float:
    """How old the oldest request may grow, while /health_generate answers in ``probe_latency_s``, before the
    server's /generate counts as hung: this run's own request pace (``Pace.request_limit_s``: at least the
    stale threshold), or ``slow_factor`` x the probe's latency per request queued ahead of it and the probe."""
    return max(pace.request_limit_s, slow_factor * (in_flight + 1) * probe_latency_s)


def hung_generate_bound_s(cfg: PipelineConfig, pace: Pace, in_flight: int) -> float:
    """The longest from a hung request's send to the watch's verdict on it, from the configured values and this
    run's pace: the largest limit a look can apply (a probe that answers does so within ``health_timeout_s``;
    a slower one is a timeout, another rule) plus what ``WatchdogConfig.detection_bound_s`` adds to
    ``stall_after_s`` (the look that sees the limit crossed starts within the recheck slack plus one command,
    as the slow look before it asks, and lasts at most the health timeout plus one command).

    It is not ``detection_bound_s`` itself: a hung /generate is judged against the request's age, not
    stall_after_s, and that limit follows the run's pace (3 x a 2.3 s p95 gap, 6.9 s, on a loaded test
    machine where stall_after_s was 4 s) and the probe's own latency. Counted from the hang, add the time the
    request in progress then took to finish (the hung request is sent only after it)."""
    wd = cfg.watchdog
    limit = hung_request_limit_s(pace, in_flight, wd.health_timeout_s, wd.slow_factor)
    return limit + (wd.detection_bound_s - wd.stall_after_s)


def no_step_limit_s(cfg: PipelineConfig) -> float:
    """The longest a trainer step may take before it counts as stuck whatever else is seen."""
    return max(20 * cfg.watchdog.stall_after_s, 300.0)


def step_limit_s(cfg: PipelineConfig, step_p95_s: float) -> float:
    """How long one training step may run, against this run's own step time: slow_factor x its p95, and never
    under 2 x stall_after_s (a loaded host's step; 30 s at the real-run defaults, so a hung step is mailed
    within 60 s of the hang at a 20 s poll)."""
    return max(2 * cfg.watchdog.stall_after_s, cfg.watchdog.slow_factor * step_p95_s)


def _stuck_step(hb: Heartbeat, cfg: PipelineConfig, hb_now: float) -> tuple[str, float | None]:
    """A trainer whose step runs far past its own step time while its heartbeat thread runs on (a hung collective
    or transfer: its process alive and not stopped, the GPU even busy): the evidence, or ('', in how many seconds
    the step reaches its limit). Only a step: an evaluation or a checkpoint, a step before the run has a pace
    (its first ones compile kernels and warm caches) and a compiled layer (train.compile: a new shape recompiles
    for minutes) keep the no-step limit."""
    since = hb.extra.get(BUSY_SINCE)
    if hb.extra.get(BUSY_WITH) != "step" or cfg.train.compile or not isinstance(since, (int, float)) \
            or isinstance(since, bool):
        return "", None
    usual = p95(hb.extra.get(STEP_TIMES) or [])
    if usual is None:
        return "", None
    limit, running = step_limit_s(cfg, usual), max(0.0, hb_now - float(since))
    if running < limit:
        return "", limit - running
    return (f"step {hb.done + 1} has run for {running:.0f} s while the trainer's heartbeat thread runs on, over "
            f"its {limit:.0f} s limit ({cfg.watchdog.slow_factor:g} x this run's step time, {usual:.2f} s p95, "
            f"at least 2 x watchdog.stall_after_s): stuck inside the step (a collective or a transfer that does "
            f"not return)"), None


# Evidence is tagged with what it blames, so one frozen server seen by eight shards is one incident.
_SERVER, _WORKER, _DISK = "capture_server", "worker", "disk"
# a streaming trainer's own errors that blame another side (issue 53): starved (the producer stalled) and the
# store lost; the error's type name leads the heartbeat's error text (train/trainer.py)
_PRODUCER, _STORE = "producer", "store"
# a capture worker held back by a full streaming store: the trainer (the consumer) sets its pace
_CONSUMER = "consumer"
_STREAM_BLAME = {"StreamStarved": (_PRODUCER, "starved: no sample arrived from the producer (the capture server and "
                                              "the extraction shards putting into the run's store), so the "
                                              "producer stalled, not the trainer"),
                 "StoreUnavailable": (_STORE, "the run's hidden-state store does not answer (its master dead or "
                                              "unreachable): the store failed, not the trainer")}


def decide(obs: Observation, cfg: PipelineConfig) -> StallDiagnosis:
    wd = cfg.watchdog
    hb = obs.heartbeat
    w = obs.worker
    if hb is not None and w.recorded and w.alive and w.started_at and hb.time < w.started_at:
        # Written by the previous process (e.g. the worker a retry replaced); the live one has not
        # written its first heartbeat yet, so that file's "failed" or "complete" is not its state.
        hb = None
    now = obs.now
    hb_now = obs.hb_clock   # ages of heartbeat fields are judged at the time the heartbeat was read
    done, total = (hb.done, hb.total) if hb else (obs.stored or 0, 0)
    pace = obs.pace or pace_of(hb, cfg)
    stale_after = pace.stale_after_s
    p_at = progress_at(obs)
    p_age = None if p_at is None else max(0.0, hb_now - p_at)
    unit = hb.unit if hb else "samples"
    counts = f"{done:,}/{total:,} done" if total else f"{done:,} done"
    counts_u = (f"{done:,}/{total:,} {unit} done" if total else f"{done:,} {unit} done")
    last_txt = f"last at {_clock(p_at)}" if p_at else "never"

    def diag(verdict: Verdict, headline: str, evidence: list[str] | None = None, with_log: bool = False,
             cause: str = "", turns_in_s: float | None = None) -> StallDiagnosis:
        # look again when the verdict may turn: progress turning stale, or (turns_in_s) a pending piece of evidence
        due = [turns_in_s] if turns_in_s is not None and verdict in ("starting", "slow") else []
        if verdict in ("starting", "healthy") and p_age is not None and p_age < stale_after:
            due.append(stale_after - p_age)
        recheck = max(wd.RECHECK_SLACK_S, min(due)) if due else None
        return StallDiagnosis(
            verdict=verdict, job=obs.job.name, node=obs.node, observed_at=now, headline=headline,
            evidence=evidence or [], done=done, total=total, progress_age_s=p_age,
            gpus=_gpu_rows(obs), gpu_note=obs.gpu.note, log_tail=obs.log_tail if with_log else [],
            cause=cause, recheck_in_s=recheck, stale_after_s=stale_after)

    # 1. the job said how it ended
    if hb is not None and hb.state == "complete":
        return diag("complete", hb.progress_line())
    if hb is not None and hb.state == "failed":
        ev = [f"the job reported: {hb.error or 'no error text'}"]
        server_ev = _server_process_evidence(obs)
        if obs.server_restarted_under_worker and obs.server is not None and not server_ev:
            server_ev = [f"the {obs.job.kind.server} (pid {obs.server.pid}) was restarted at "
                         f"{_clock(obs.server.started_at)}, after this worker started"]
        ev += server_ev + _disk_evidence(obs)
        low_disk = bool(_disk_evidence(obs, only_low=True))
        cause = _DISK if low_disk else (_SERVER if server_ev else "job")
        blamed = _STREAM_BLAME.get((hb.error or "").split(":", 1)[0].strip())
        if blamed is not None and not low_disk:
            return diag("failed", f"{blamed[1]}; the job stopped at {counts} ({last_txt})", ev, with_log=True,
                        cause=blamed[0])
        return diag("failed", f"the job stopped with an error at {counts} ({last_txt})", ev, with_log=True,
                    cause=cause)

    # 1b. a streaming trainer's store server not running (its pid records): the store failed, not the trainer,
    # which would only wait for samples that cannot come (or fail on its next read)
    if obs.store is not None and not obs.store.ok:
        return diag("stalled", f"the run's hidden-state store is down, not the trainer: {obs.store.label}: "
                               f"{obs.store.detail}; {counts_u}", _disk_evidence(obs), with_log=True, cause=_STORE)

    # 2. the worker is gone
    if not w.recorded:
        return diag("dead", f"{_no_record(w)}; {counts_u}", _disk_evidence(obs), with_log=True, cause=_WORKER)
    if not w.alive:
        what = f"is {w.state_text}"
        hb_txt = f"; last heartbeat at {_clock(hb.time)}" if hb else "; it never wrote a heartbeat"
        server_ev = _server_process_evidence(obs)
        source = "from the manifest" if obs.job.shard is not None else "from its heartbeat"   # a trainer has none
        ev = [_death_cause(obs), f"{counts_u} ({source}), {last_txt}{hb_txt}"] + server_ev \
            + _disk_evidence(obs)
        if obs.heartbeat_error:
            ev.append(obs.heartbeat_error)
        return diag("dead", f"worker pid {w.pid} {what} without completing", ev, with_log=True,
                    cause=_SERVER if server_ev else _WORKER)

    # 3. advancing, or still starting
    since_txt = ""
    if obs.done_since_last_look is not None and obs.last_look_at is not None:
        since_txt = f", +{obs.done_since_last_look:,} since the last look {now - obs.last_look_at:.0f} s ago"
    rate_txt = f", {hb.rate:.2f} {unit}/s" if hb and hb.rate else ""
    if hb is not None and hb.eta_s is not None:   # the watch line in the task log: when it ends, and training's figures
        rate_txt += f", ETA {hb.eta_text()}"
    figures = hb.latest_figures() if hb is not None else ""
    rate_txt += f", {figures}" if figures else ""
    # a worker still "starting" (a resumed one loads its corpus and manifest) has done nothing itself yet,
    # however many samples earlier workers stored; once running, the manifest counts (a frozen worker's
    # heartbeat can lag its first samples)
    nothing_yet = hb is None or hb.state == "starting" or done <= hb.resumed
    started = w.started_at or (hb.started_at if hb else None) or now
    if nothing_yet and now - started < wd.startup_grace_s:
        # The grace covers loading (0 %, nothing done), not a process that is visibly frozen or gone.
        frozen = _frozen_evidence(obs, cfg)
        if frozen and p_age is not None and p_age >= wd.stall_after_s:
            head = f"nothing completed {now - started:.0f} s after the start ({counts}), inside the startup grace"
            return diag("stalled", _with_store_fill(obs, head, frozen[0][0]), [t for _, t in frozen], with_log=True,
                        cause=frozen[0][0])
        late = _late_heartbeat(obs, cfg)   # late but not (yet) frozen: said, and looked at again when it may turn
        return diag("starting", f"{counts_u}; started {now - started:.0f} s ago, within the "
                                f"{wd.startup_grace_s:.0f} s startup grace" + (f"; {late.text}" if late else ""),
                    turns_in_s=late.turns_in_s if late else None)
    # A server SIGSTOPped (state T: no tracer's brief stop, which reads t) cannot answer whatever this run's pace:
    # progress is judged against stall_after_s, not slow_factor x a slow run's p95 gap (27.6 s on a slow
    # generation run in the issue 52 drill, 66.5 s to the first new record).
    server_sigstopped = _server_sigstopped(obs)
    if server_sigstopped and p_age is not None:
        stale_after = min(stale_after, wd.stall_after_s)
    # a capture worker's wait for room in a streaming store that ended a moment ago: it could not put before then,
    # so its progress counts from the wait's end (a look between that end and the put's record saw a stale shard)
    room_ended = hb.extra.get(ROOM_WAIT_ENDED) if hb is not None else None
    if p_age is not None and isinstance(room_ended, (int, float)) and not isinstance(room_ended, bool):
        p_age = min(p_age, max(0.0, hb_now - float(room_ended)))
    if p_age is not None and p_age < stale_after:
        pace_txt = "" if stale_after <= wd.stall_after_s else f"; slow run, judged against {pace.describe()}"
        return diag("healthy", f"{counts_u}{since_txt}{rate_txt}, {last_txt} ({p_age:.0f} s ago){pace_txt}"
                    + (f"; {server_sigstopped}" if server_sigstopped else ""))

    # 4a'. a streaming trainer whose store was lost and runs again (1b did not fire) is taking up the new one:
    # waiting (up to stream.store_down_timeout_s), not stuck; a stopped one's or a frozen heartbeat's word is stale
    store_since = hb.extra.get(WAITING_FOR_STORE) if hb is not None else None
    if isinstance(store_since, (int, float)) and not isinstance(store_since, bool) and not w.stopped \
            and not ((late_store := _late_heartbeat(obs, cfg)) is not None and late_store.frozen):
        return diag("slow", f"waiting {max(0.0, hb_now - float(store_since)):.0f} s for the run's hidden-state "
                            f"store to come back (lost mid-run; up to stream.store_down_timeout_s), not stuck; "
                            f"{counts_u}, {last_txt}", cause=_STORE, turns_in_s=stale_after)

    # 4a. a streaming trainer that waits for the producer's next sample is starved, not stuck: said, naming the
    # producer (whose own shards' watch judges it), never a stall of the trainer (its retry would restart it)
    # Only from a trainer that can still say so: a stopped one's or a frozen heartbeat's word is stale (issue 53,
    # the buffer full behind a trainer SIGSTOPped while it waited: it read "starved" for ever).
    waiting_since = hb.extra.get(WAITING_FOR_SAMPLES) if hb is not None else None
    late_hb = _late_heartbeat(obs, cfg)
    if w.stopped or (late_hb is not None and late_hb.frozen):
        waiting_since = None
    if isinstance(waiting_since, (int, float)) and not isinstance(waiting_since, bool):
        waited = max(0.0, hb_now - float(waiting_since))
        return diag("slow", f"starved: waiting {waited:.0f} s for a sample from the producer (the capture server "
                            f"and the extraction shards putting into the run's store): the producer is behind or "
                            f"stalled, not the trainer (its shards' watch says which); {counts_u}, {last_txt}",
                    cause=_PRODUCER, turns_in_s=stale_after)

    # 4a''. a capture worker whose put waits for room in a streaming store is held back by the consumer, not stuck:
    # the store holds stream.buffer_gib until the trainer takes samples (whose own watch judges it); restarting the
    # worker or its server would redo samples and wait all the same. Only from a worker that can still say so, and
    # none of whose other requests is overdue at the server (a server hung meanwhile is judged below as ever).
    room_since = hb.extra.get(WAITING_FOR_ROOM) if hb is not None else None
    overdue = hb is not None and any(hb_now - r.since > (r.timeout_s or cfg.capture.request_timeout_base_s)
                                     for r in hb.in_flight)
    if isinstance(room_since, (int, float)) and not isinstance(room_since, bool) and not waiting_since \
            and not overdue and not w.stopped and not (late_hb is not None and late_hb.frozen):
        waited = max(0.0, hb_now - float(room_since))
        next_pass = hb.extra.get(WAITING_FOR_PASS) if hb is not None else None
        if isinstance(next_pass, int) and not isinstance(next_pass, bool):
            # at the gate between capture passes (re-capture per epoch), not at a full buffer
            return diag("slow", f"held back: waiting {waited:.0f} s to start capture pass {next_pass} until every "
                                f"shard's pass {next_pass - 1} is in the store (this run captures its corpus again "
                                f"for each epoch: a later epoch's samples must not take the room the trainer's "
                                f"current epoch needs), not stuck (the other shards' watches judge them); "
                                f"{counts_u}, {last_txt}", cause=_CONSUMER, turns_in_s=stale_after)
        return diag("slow", f"held back: waiting {waited:.0f} s for room in the run's "
                            f"hidden-state store (its buffer, stream.buffer_gib, is full until the trainer takes "
                            f"samples): the consumer sets the pace, not stuck (the trainer's watch judges the "
                            f"trainer); {counts_u}, {last_txt}", cause=_CONSUMER, turns_in_s=stale_after)

    # 4. progress is stale: stalled only with independent evidence
    head = f"no {unit[:-1] if unit.endswith('s') else unit} completed for {p_age:.0f} s ({counts}, {last_txt})"
    if pace.gap_p95_s is not None:
        head += f"; this run's usual gap is {pace.gap_p95_s:.1f} s (p95)"
    bad: list[tuple[int, str, str]] = []   # (strength: 0 = a process-level fact, 1 = an inference; cause; text)
    fine: list[str] = []
    turns: list[float] = []   # in how many seconds a piece of evidence not yet conclusive may turn
    gpu = obs.gpu
    # busy now, or in any look since the last progress: a GPU busy in bursts (45 % duty) can read 0 % for
    # a whole look, yet it has worked since the last sample; a hang reads 0 % in every look after it
    since_progress = [m for t, m in gpu.history if p_at is None or t >= p_at]
    gpu_busy = bool(gpu.applicable and (gpu.busy_now or any(v > 0 for m in since_progress for v in m.values())))

    bad += [(0, _DISK, t) for t in _disk_evidence(obs, only_low=True)]
    s = obs.server
    if obs.job.uses_server:
        bad += [(0, _SERVER, t) for t in _server_process_evidence(obs)]
        h = obs.health
        if h.checked and h.ok:
            fine.append(f"server answered /health_generate in {h.latency_s:.1f} s")
        elif h.checked:
            what = (f"timed out after {wd.health_timeout_s:.0f} s" if h.outcome == "timeout"
                    else f"failed ({h.outcome})")
            if gpu_busy:
                fine.append(f"server /health_generate {what} but the GPUs are busy")
            elif obs.progress_during_look is not None and h.outcome == "timeout":
                # the probe queued behind real work: the server completed a sample while we waited
                fine.append(f"server /health_generate {what} but a sample completed at "
                            f"{_clock(obs.progress_during_look)} while it waited (busy, not hung)")
            else:
                bad.append((1, _SERVER, f"server /health_generate {what}"))
        elif h.outcome == "no server info":
            bad.append((1, _SERVER, "no server info file (capture_server.json) to reach the server"))
        if s is not None and s.alive and s.d_state and s.d_since is not None and now - s.d_since >= wd.d_state_after_s:
            bad.append((0, _SERVER, f"server pid {s.pid} in D state for {now - s.d_since:.0f} s"
                        + (f" (waiting in {s.wchan})" if s.wchan else "")))

    if gpu.applicable and gpu.readings:
        if gpu.idle_held_since is not None and now - gpu.idle_held_since >= wd.gpu_window_s:
            bad.append((1, _SERVER, f"{_gpu_span(obs)} hold {_held_gb(obs):.1f} GB at 0 % for "
                                    f"{now - gpu.idle_held_since:.0f} s ({gpu.samples} readings in this look)"))
        elif gpu_busy:
            fine.append(f"{_gpu_span(obs)} busy ({_max_util(obs):.0f} % now, "
                        f"{max(gpu.max_util_window.values(), default=0):.0f} % max over the window)")

    if hb is not None:
        for r in hb.in_flight:
            age = hb_now - r.since
            limit = r.timeout_s or (cfg.capture.request_timeout_base_s
                                    + cfg.capture.request_timeout_per_token_s * r.tokens)
            if age > limit:
                bad.append((1, _SERVER, f"request {r.id} in flight for {age:.0f} s, past its {limit:.0f} s deadline"))
            else:
                fine.append(f"request {r.id} ({r.tokens:,} tokens) in flight for {age:.0f} s of its {limit:.0f} s deadline")
        hung, hung_in = _hung_generate(obs, pace, gpu_busy, hb_now, cfg)
        if hung:
            bad.append((1, _SERVER, hung))
        elif hung_in is not None:
            turns.append(hung_in)
        if obs.job.uses_server and not hb.in_flight:
            bad.append((1, _WORKER, "the worker has no request in flight"))
        late = _late_heartbeat(obs, cfg)
        if late is not None and late.frozen:
            bad.append((0, _WORKER, late.text))
        elif late is not None:
            fine.append(late.text)
            if late.turns_in_s is not None:
                turns.append(late.turns_in_s)
    else:
        bad.append((0, _WORKER, f"worker pid {w.pid} never wrote a heartbeat "
                                f"({obs.heartbeat_error or 'no heartbeat file'})"))

    if w.stopped:
        bad.append((0, _WORKER, f"worker pid {w.pid} is {w.state_text}"))
    if w.d_state and w.d_since is not None and now - w.d_since >= wd.d_state_after_s:
        bad.append((0, _WORKER, f"worker pid {w.pid} in D state for {now - w.d_since:.0f} s"
                                + (f" (waiting in {w.wchan})" if w.wchan else "")))

    stuck, stuck_in = _stuck_step(hb, cfg, hb_now) if hb is not None and not obs.job.uses_server else ("", None)
    if stuck:
        bad.append((1, "trainer", stuck))
    elif stuck_in is not None:
        turns.append(stuck_in)
    if not stuck and not obs.job.uses_server and p_age is not None and p_age >= no_step_limit_s(cfg):
        # a trainer has no per-request timeout: a deadlock that keeps its heartbeat thread and the GPU
        # spinning (an NCCL hang reads 100 %) would otherwise stay "slow" for ever
        bad.append((1, "trainer", f"no step for {p_age:.0f} s, over the {no_step_limit_s(cfg):.0f} s limit for one step"))

    if bad:
        ordered = sorted(range(len(bad)), key=lambda i: (bad[i][0], i))
        cause = bad[ordered[0]][1]
        return diag("stalled", _with_store_fill(obs, head, cause), [b[2] for b in bad], with_log=True, cause=cause)
    return diag("slow", head, fine or ["no signal says it is stuck"], turns_in_s=min(turns) if turns else None)


def _with_store_fill(obs: Observation, head: str, cause: str) -> str:
    """A streaming trainer stalled by its own process (stopped, frozen, no step): the store's fill says whether the
    producer waits on it. Said in every stalled branch, the startup grace's too (a trainer stopped before its
    heartbeat counted its first steps)."""
    fill = obs.store.fill_text() if obs.store is not None else ""
    if not fill or cause not in (_WORKER, "trainer") or obs.job.uses_server:
        return head
    full = obs.store is not None and obs.store.full()
    return (f"the consumer is stuck: {fill}, so the producer waits for room (backpressure) on this trainer; {head}"
            if full else f"{head}; {fill}")


def _hung_generate(obs: Observation, pace: Pace, gpu_busy: bool, hb_now: float,
                   cfg: PipelineConfig) -> tuple[str, float | None]:
    """The server answers /health_generate, yet a request is far older than this run's requests take: the
    evidence, or ('', in how many seconds the oldest request reaches the limit) while it is younger.

    SGLang can answer its one-token health probe while chat requests hang (sglang 4191); the worker's
    own timeout (60 s + 0.05 s per token) would take minutes to notice. Busy GPUs exempt it: a
    slow-but-working server is SLOW. The slow look before the limit asks for the next look when the
    request reaches it (not a whole poll interval later): ``hung_generate_bound_s`` counts on that.
    """
    h, hb = obs.health, obs.heartbeat
    if not (obs.job.uses_server and h.checked and h.ok and hb is not None and hb.in_flight) or gpu_busy \
            or obs.progress_during_look is not None:
        return "", None
    oldest = max(hb.in_flight, key=lambda r: hb_now - r.since)
    age = hb_now - oldest.since
    # the probe's own latency is one forward now: a request queued behind the others (and the probe)
    # may take that long per request ahead of it; a hung /generate sits beside a fast probe. A probe that
    # answered did so within the health timeout (the client's bound on connect and answer alike).
    latency = min(h.latency_s or 0.0, cfg.watchdog.health_timeout_s)
    limit = hung_request_limit_s(pace, len(hb.in_flight), latency, cfg.watchdog.slow_factor)
    if age < limit:
        return "", limit - age
    usual = (f"; this run's requests take {pace.request_p95_s:.1f} s (p95)" if pace.request_p95_s is not None
             else "")
    return (f"server answers /health_generate ({h.latency_s:.1f} s) but its /generate does not: request "
            f"{oldest.id} in flight for {age:.0f} s with no {hb.unit[:-1] if hb.unit.endswith('s') else hb.unit} "
            f"completed (limit {limit:.0f} s"
            f"{usual})"), None


def _death_cause(obs: Observation) -> str:
    """How the worker ended, as far as the node can tell: exit status, kernel OOM log, or what its silence means."""
    w = obs.worker
    if w.oom_killed:
        return f"the kernel's OOM killer killed it (kernel log: \"Killed process {w.pid}\")"
    if w.exit_signal:
        oom = "" if w.exit_signal != 9 else (
            "; the kernel log shows no OOM kill of it, so kill -9" if w.oom_killed is False
            else "; kill -9 or the OOM killer (the kernel log is not readable here)")
        return f"it was killed by {_signal_name(w.exit_signal)}{oom}"
    if w.exit_code is not None:
        return f"it exited with code {w.exit_code} without a final heartbeat"
    oom = ("the kernel log shows no OOM kill of it" if w.oom_killed is False
           else "the kernel log is not readable here to tell an OOM kill")
    return (f"it vanished without a final heartbeat (state still 'running'; SIGTERM would have written "
            f"'failed'): killed by a signal it cannot catch, SIGKILL (kill -9 or the OOM killer), or a hard "
            f"crash; {oom}")


def _signal_name(num: int) -> str:
    import signal as _sig
    try:
        return _sig.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _frozen_evidence(obs: Observation, cfg: PipelineConfig) -> list[tuple[str, str]]:
    """Signals that no loading phase explains: a stopped or long-D worker, a stale heartbeat, a dead server."""
    w, hb, now = obs.worker, obs.heartbeat, obs.now
    out = [(_SERVER, t) for t in _server_process_evidence(obs)] \
        if obs.server is not None and obs.server.recorded else []
    if w.stopped:
        out.append((_WORKER, f"worker pid {w.pid} is {w.state_text}"))
    if w.d_state and w.d_since is not None and now - w.d_since >= cfg.watchdog.d_state_after_s:
        out.append((_WORKER, f"worker pid {w.pid} in D state for {now - w.d_since:.0f} s"
                             + (f" (waiting in {w.wchan})" if w.wchan else "")))
    late = _late_heartbeat(obs, cfg)
    if late is not None and late.frozen:
        out.append((_WORKER, late.text))
    return out


@dataclass(frozen=True)
class LateHeartbeat:
    """A live job's heartbeat older than ``heartbeat_stale_after_s`` when read, judged by the CPU its process
    group used: ``frozen`` (evidence of a stall) only when the process is stopped or gained no CPU time over
    ``frozen_window_s``; otherwise it is slow (starved on a loaded node, a long fsync) and ``turns_in_s`` says
    when the CPU window may close."""
    frozen: bool
    text: str
    turns_in_s: float | None = None


def _late_heartbeat(obs: Observation, cfg: PipelineConfig) -> LateHeartbeat | None:
    hb, w = obs.heartbeat, obs.worker
    if hb is None:
        return None
    age = obs.hb_clock - hb.time
    if age <= heartbeat_stale_after_s(cfg):
        return None
    said = (f"worker pid {w.pid} is alive but its heartbeat was last written {age:.0f} s before it was read at "
            f"{_clock(obs.hb_clock)} (written at {_clock(hb.time)}; interval {cfg.capture.heartbeat_interval_s:g} s)")
    if w.stopped:
        return LateHeartbeat(True, said)
    window, c = frozen_window_s(cfg), w.cpu
    if c is None:   # not read: a late heartbeat alone proves nothing (a starved writer is late too)
        return LateHeartbeat(False, f"{said}; its CPU time was not read, so that proves nothing")
    quiet = max(0.0, c.read_at - c.quiet_since)
    group = f"its process group ({c.members} process{'es' if c.members != 1 else ''})"
    if quiet >= window:
        return LateHeartbeat(True, f"{said}, and {group} used no CPU time for {quiet:.0f} s: frozen")
    if c.last_gain_at is not None and c.last_gain_s is not None and c.last_gain_over_s is not None:
        return LateHeartbeat(False, f"{said}, but {group} is using CPU ({c.last_gain_s:.2f} s of CPU time in the "
                                    f"{c.last_gain_over_s:.1f} s up to {_clock(c.last_gain_at)}): slow, not frozen",
                             turns_in_s=window - quiet)
    return LateHeartbeat(False, f"{said}; {group} used no CPU time in the {quiet:.0f} s the watch has read it "
                                f"(frozen only after {window:.0f} s without any)", turns_in_s=window - quiet)


def _no_record(p: ProcessSignal) -> str:
    """Why no process of this role counts as running: no pid file, or one that is refused (and why)."""
    if p.refused:
        return (f"no {p.role} process is recorded that eagleflow can prove its own: the pid record is refused "
                f"({p.refused}), so nothing it names is signalled or trusted. Check the process it names; stop it "
                f"yourself if it is ours and delete the record (an older eagleflow wrote group-writable records; they "
                f"are refused now)")
    return f"no {p.role} process is recorded (no pid file)"


def _server_sigstopped(obs: Observation) -> str:
    """'server pid N is stopped (state T ...)' when the job's recorded server is SIGSTOPped, else ''."""
    s = obs.server
    if not obs.job.uses_server or s is None or not s.recorded or not s.alive or s.state != "T":
        return ""
    return f"server pid {s.pid} is {s.state_text}, so it cannot answer"


def _server_process_evidence(obs: Observation) -> list[str]:
    s = obs.server
    if not obs.job.uses_server:
        return []
    server = obs.job.kind.server
    if s is None:
        return [f"no {server} is recorded (no pid file)"]
    if not s.recorded:
        return [_no_record(s).replace(f"no {s.role} process", f"no {server}", 1)]
    if not s.alive:
        return [f"server pid {s.pid} is {s.state_text}"]
    if s.stopped:
        return [f"server pid {s.pid} is {s.state_text}, so it cannot answer"]
    return []


# --------------------------------------------------------------------------- phrasing helpers
def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "never"


def _gpu_rows(obs: Observation) -> list[GpuRow]:
    return [GpuRow(index=r.index, name=r.name, memory_used_mib=r.memory_used_mib, memory_total_mib=r.memory_total_mib,
                   utilization_pct=r.utilization_pct, held=r.held,
                   max_util_window_pct=obs.gpu.max_util_window.get(r.index))
            for r in obs.gpu.readings]


def _gpu_span(obs: Observation) -> str:
    idx = sorted(r.index for r in obs.gpu.readings)
    if idx and idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 1:
        return f"GPUs {idx[0]}-{idx[-1]}"
    return ("GPU " if len(idx) == 1 else "GPUs ") + ",".join(map(str, idx))


def _held_gb(obs: Observation) -> float:
    held = [r.memory_used_mib for r in obs.gpu.readings if r.memory_used_mib is not None]
    return (sum(held) / len(held) / 1024) if held else 0.0


def _max_util(obs: Observation) -> float:
    return max((r.utilization_pct or 0.0) for r in obs.gpu.readings) if obs.gpu.readings else 0.0


_LOW_DISK_BYTES = 64 * 1024 * 1024


def _disk_evidence(obs: Observation, only_low: bool = False) -> list[str]:
    """Free space where the job writes; named when low (a full disk stalls or kills a writer)."""
    fb = obs.free_bytes
    if fb is None:
        return []
    if fb < _LOW_DISK_BYTES:
        return [f"only {fb / 1e6:.1f} MB free where the job writes"]
    return [] if only_low else [f"{fb / 1e9:.1f} GB free where the job writes"]
