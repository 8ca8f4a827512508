"""From one observation to a verdict: healthy, slow, stalled, dead, failed, complete (or starting).

The rules, in order:

1. The heartbeat says complete -> complete; failed -> failed (with the job's error).
2. The worker is gone or a zombie -> dead.
3. Progress is younger than ``stall_after_s`` -> healthy. While the job has
   done nothing yet and is younger than ``startup_grace_s`` -> starting
   (model and tokenizer loading read 0 % and complete nothing).
4. Progress is stale. It is *stalled* only if at least one independent signal
   says something is wrong:
   - the server process is gone, a zombie or stopped (state T);
   - the server did not answer /health_generate (timeout, refused, 5xx) and
     the GPUs are not busy (a hung kernel reads 100 %; the in-flight timeout
     catches that case instead);
   - an in-flight request is older than its own timeout;
   - the worker is alive but its heartbeat has not been rewritten for
     ``max(5 x heartbeat interval, stall_after_s, 10 s)`` (the process is frozen);
   - the worker (or a thread) has been in D state for ``d_state_after_s``;
   - the GPUs hold memory above baseline at 0 % for ``gpu_window_s``;
   - a shard worker has no request in flight at all.
   Otherwise it is *slow*: one long sample in flight, within its timeout,
   with the server answering and/or the GPUs busy.
"""
from __future__ import annotations

import time

from eagleflow.config import PipelineConfig
from eagleflow.watchdog.diagnosis import GpuRow, StallDiagnosis
from eagleflow.watchdog.signals import Observation, progress_at


def heartbeat_stale_after_s(cfg: PipelineConfig) -> float:
    """How old a heartbeat may be before the writer itself counts as frozen.

    Not just a few intervals: the writer fsyncs, and on a node busy writing
    hidden states one fsync can take seconds (seen at 4 s on a loaded CI box).
    """
    return max(5 * cfg.capture.heartbeat_interval_s, cfg.watchdog.stall_after_s, 10.0)


def no_step_limit_s(cfg: PipelineConfig) -> float:
    """The longest a trainer step may take before it counts as stuck whatever else is seen."""
    return max(20 * cfg.watchdog.stall_after_s, 300.0)


def decide(obs: Observation, cfg: PipelineConfig) -> StallDiagnosis:
    wd = cfg.watchdog
    hb = obs.heartbeat
    w = obs.worker
    if hb is not None and w.recorded and w.alive and w.started_at and hb.time < w.started_at:
        # Written by the previous process (e.g. the worker a retry replaced); the live one has not
        # written its first heartbeat yet, so that file's "failed" or "complete" is not its state.
        hb = None
    now = obs.now
    done, total = (hb.done, hb.total) if hb else (0, 0)
    p_at = progress_at(obs)
    p_age = None if p_at is None else max(0.0, now - p_at)
    unit = hb.unit if hb else "samples"
    counts = f"{done:,}/{total:,} done" if total else f"{done:,} done"
    counts_u = (f"{done:,}/{total:,} {unit} done" if total else f"{done:,} {unit} done")
    last_txt = f"last at {_clock(p_at)}" if p_at else "never"

    def diag(verdict: str, headline: str, evidence: list[str] | None = None, with_log: bool = False) -> StallDiagnosis:
        return StallDiagnosis(
            verdict=verdict, job=obs.job.name, node=obs.node, observed_at=now, headline=headline,
            evidence=evidence or [], done=done, total=total, progress_age_s=p_age,
            gpus=_gpu_rows(obs), gpu_note=obs.gpu.note, log_tail=obs.log_tail if with_log else [])

    # 1. the job said how it ended
    if hb is not None and hb.state == "complete":
        return diag("complete", hb.progress_line())
    if hb is not None and hb.state == "failed":
        ev = [f"the job reported: {hb.error or 'no error text'}"]
        ev += _server_process_evidence(obs) + _disk_evidence(obs)
        return diag("failed", f"the job stopped with an error at {counts} ({last_txt})", ev, with_log=True)

    # 2. the worker is gone
    if not w.recorded:
        return diag("dead", f"no {w.role} process is recorded (no pid file); {counts_u}", _disk_evidence(obs),
                    with_log=True)
    if not w.alive:
        what = "is a zombie (exited, not yet reaped)" if w.zombie else "is gone"
        hb_txt = f"; last heartbeat at {_clock(hb.time)}" if hb else "; it never wrote a heartbeat"
        ev = [f"{counts_u}, {last_txt}{hb_txt}"] + _server_process_evidence(obs) + _disk_evidence(obs)
        if obs.heartbeat_error:
            ev.append(obs.heartbeat_error)
        return diag("dead", f"worker pid {w.pid} {what} without completing", ev, with_log=True)

    # 3. advancing, or still starting
    since_txt = ""
    if obs.done_since_last_look is not None and obs.last_look_at is not None:
        since_txt = f", +{obs.done_since_last_look:,} since the last look {now - obs.last_look_at:.0f} s ago"
    rate_txt = f", {hb.rate:.2f} {unit}/s" if hb and hb.rate else ""
    nothing_yet = hb is None or hb.done <= hb.resumed
    started = w.started_at or (hb.started_at if hb else None) or now
    if nothing_yet and now - started < wd.startup_grace_s:
        # The grace covers loading (0 %, nothing done), not a process that is visibly frozen or gone.
        frozen = _frozen_evidence(obs, cfg)
        if frozen and p_age is not None and p_age >= wd.stall_after_s:
            head = f"nothing completed {now - started:.0f} s after the start ({counts}), inside the startup grace"
            return diag("stalled", head, frozen, with_log=True)
        return diag("starting", f"{counts_u}; started {now - started:.0f} s ago, within the "
                                f"{wd.startup_grace_s:.0f} s startup grace")
    if p_age is not None and p_age < wd.stall_after_s:
        return diag("healthy", f"{counts_u}{since_txt}{rate_txt}, {last_txt} ({p_age:.0f} s ago)")

    # 4. progress is stale: stalled only with independent evidence
    head = f"no {unit[:-1] if unit.endswith('s') else unit} completed for {p_age:.0f} s ({counts}, {last_txt})"
    bad: list[str] = []
    fine: list[str] = []
    gpu = obs.gpu
    gpu_busy = bool(gpu.applicable and gpu.busy_now)

    s = obs.server
    if obs.job.uses_server:
        bad += _server_process_evidence(obs)
        h = obs.health
        if h.checked and h.ok:
            fine.append(f"server answered /health_generate in {h.latency_s:.1f} s")
        elif h.checked:
            what = (f"timed out after {wd.health_timeout_s:.0f} s" if h.outcome == "timeout"
                    else f"failed ({h.outcome})")
            if gpu_busy:
                fine.append(f"server /health_generate {what} but the GPUs are busy")
            else:
                bad.append(f"server /health_generate {what}")
        elif h.outcome == "no server info":
            bad.append(f"no server info file ({'capture_server.json'}) to reach the server")
        if s is not None and s.alive and s.d_state and s.d_since is not None and now - s.d_since >= wd.d_state_after_s:
            bad.append(f"server pid {s.pid} in D state for {now - s.d_since:.0f} s"
                       + (f" (waiting in {s.wchan})" if s.wchan else ""))

    if gpu.applicable and gpu.readings:
        if gpu.idle_held_since is not None and now - gpu.idle_held_since >= wd.gpu_window_s:
            bad.append(f"{_gpu_span(obs)} hold {_held_gb(obs):.1f} GB at 0 % for {now - gpu.idle_held_since:.0f} s")
        elif gpu_busy:
            fine.append(f"{_gpu_span(obs)} busy ({_max_util(obs):.0f} % now)")

    if hb is not None:
        overdue = []
        for r in hb.in_flight:
            age = now - r.since
            limit = r.timeout_s or (cfg.capture.request_timeout_base_s
                                    + cfg.capture.request_timeout_per_token_s * r.tokens)
            if age > limit:
                overdue.append(f"request {r.id} in flight for {age:.0f} s, past its {limit:.0f} s timeout")
            else:
                fine.append(f"request {r.id} ({r.tokens:,} tokens) in flight for {age:.0f} s of its {limit:.0f} s timeout")
        bad += overdue
        if obs.job.uses_server and not hb.in_flight:
            bad.append("the worker has no request in flight")
        hb_age = now - hb.time
        if hb_age > heartbeat_stale_after_s(cfg):
            bad.append(f"worker pid {w.pid} is alive but its heartbeat was last written {hb_age:.0f} s ago "
                       f"(at {_clock(hb.time)}; interval {cfg.capture.heartbeat_interval_s:g} s)")
    else:
        bad.append(f"worker pid {w.pid} never wrote a heartbeat ({obs.heartbeat_error or 'no heartbeat file'})")

    if w.stopped:
        bad.append(f"worker pid {w.pid} is stopped (state {w.state})")
    if w.d_state and w.d_since is not None and now - w.d_since >= wd.d_state_after_s:
        bad.append(f"worker pid {w.pid} in D state for {now - w.d_since:.0f} s"
                   + (f" (waiting in {w.wchan})" if w.wchan else ""))

    bad += _disk_evidence(obs, only_low=True)
    if not obs.job.uses_server and p_age is not None and p_age >= no_step_limit_s(cfg):
        # a trainer has no per-request timeout: a deadlock that keeps its heartbeat thread and the GPU
        # spinning (an NCCL hang reads 100 %) would otherwise stay "slow" for ever
        bad.append(f"no step for {p_age:.0f} s, over the {no_step_limit_s(cfg):.0f} s limit for one step")

    if bad:
        return diag("stalled", head, bad, with_log=True)
    return diag("slow", head, fine or ["no signal says it is stuck"])


def _frozen_evidence(obs: Observation, cfg: PipelineConfig) -> list[str]:
    """Signals that no loading phase explains: a stopped or long-D worker, a stale heartbeat, a dead server."""
    w, hb, now = obs.worker, obs.heartbeat, obs.now
    out = _server_process_evidence(obs) if obs.server is not None and obs.server.recorded else []
    if w.stopped:
        out.append(f"worker pid {w.pid} is stopped (state {w.state})")
    if w.d_state and w.d_since is not None and now - w.d_since >= cfg.watchdog.d_state_after_s:
        out.append(f"worker pid {w.pid} in D state for {now - w.d_since:.0f} s")
    if hb is not None and now - hb.time > heartbeat_stale_after_s(cfg):
        out.append(f"worker pid {w.pid} is alive but its heartbeat was last written {now - hb.time:.0f} s ago")
    return out


def _server_process_evidence(obs: Observation) -> list[str]:
    s = obs.server
    if not obs.job.uses_server:
        return []
    if s is None or not s.recorded:
        return ["no capture server is recorded (no pid file)"]
    if not s.alive:
        return [f"server pid {s.pid} is {'a zombie (exited, not yet reaped)' if s.zombie else 'gone'}"]
    if s.stopped:
        return [f"server pid {s.pid} is stopped (state {s.state}: SIGSTOP or a debugger), so it cannot answer"]
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
