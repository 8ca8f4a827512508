"""Put a shard back on its feet before its retry: restart its phase's unhealthy server once per incident.

Several shards notice one frozen server at about the same time, and each
retry calls this. Under a node lock (<state_dir>/locks/<run>.capture_server.restart.lock)
the first one finds the server unhealthy and restarts it; the others, once
they get the lock, find it healthy (or still loading after that restart) and
only wait. The restart log beside the lock (<run>.capture_server.restarts.jsonl) records each restart;
incidents (what a person is mailed about) are the node's incident book, eagleflow.watchdog.incidents.

Steps of a restart: stop the shard's stuck worker (its pid record) so the
retry never runs two workers on one shard; stop the server (pid record:
TERM, grace, KILL, with a SIGCONT first so a SIGSTOPped server can act on
TERM); wait until the GPUs read idle again (baseline + margin, eagleflow.gpu.IdlePolicy);
start the server; wait until /health_generate answers.

Every phase's server and workers are reached through its descriptor (``ShardKind.lifecycle()``), never by
importing the phase's package. ``recover_server`` (a retry) and ``recover_in_watch`` (the watch's stall, per
cause) run ON the node (``eagleflow recover``) and restart the server through the one ``_restart_server``; the
Airflow side calls them through the one ``recover_on_node``, whose node command may take ``recovery_budget_s``
(the one time budget of a recovery, whatever its cause, from the config).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from eagleflow import bounded_json
from eagleflow.durable import open_owned
from eagleflow.gpu import IdlePolicy, probe_for
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLike
from eagleflow.nodes import NodeError, ProcessRecord
from eagleflow.nodes.locks import NodeLock
from eagleflow.nodes.proc import read_stat
from eagleflow.nodes.process_record import leader_state
from eagleflow.phases import EXTRACT, KINDS, ShardKind
from eagleflow.watchdog.protocol import EventPayload

from .protocol import OpenIncident
from .incidents import current, open_or_join, record_recovery
from .signals import WatchedJob, stored_samples

Log = Callable[[str], None]
# the watch's name for "the job's server", whichever phase's it is (the extraction's server role, kept on the wire)
SERVER_CAUSE = KINDS[EXTRACT].server_role
EXTRACTION = KINDS[EXTRACT]   # what a call that names no phase recovers (``eagleflow recover`` without --phase)


def server_restart_s(cfg) -> float:
    """The longest one server restart may take: the GPUs freed (``gpu.idle_timeout_s``), the model loaded
    (``server.ready_timeout_s``), 120 s for the stop and the worker. Also how long a recovery waits for the
    server's recovery lock, held by another shard's restart."""
    return cfg.server.ready_timeout_s + cfg.gpu.idle_timeout_s + 120


def recovery_budget_s(cfg) -> float:
    """The time budget of one recovery, whatever its cause: the wait for another shard's restart under the
    lock, then its own restart. The sentinel allows a recovering watch this long; the control plane waits this
    plus ``RECOVERY_COMMAND_SLACK_S`` for the node command."""
    return 2 * server_restart_s(cfg)


RECOVERY_COMMAND_SLACK_S = 60.0   # the SSH round trip and the command's own start, beyond the budget


class RecoveryResult(BaseModel):
    """What ``eagleflow recover --json`` prints (``recover_server``'s result)."""
    model_config = ConfigDict(extra="allow")
    ok: bool
    action: str
    summary: str


def lock_path(run: RunLike, server_role: str = SERVER_CAUSE) -> str:
    """The node lock held while a server of the run is (re)started (``layout.restart_lock_file``)."""
    return str(run.layout.restart_lock_file(server_role))


def restarts_path(run: RunLike, kind: ShardKind = EXTRACTION) -> str:
    """The run's restart log of the phase's server: one JSON line per restart a recovery made."""
    return str(run.layout.locks_dir / f"{run.layout.run_id}.{kind.server_role}.restarts.jsonl")


def read_restarts(run: RunLike, kind: ShardKind = EXTRACTION) -> list[dict]:
    try:
        with os.fdopen(open_owned(restarts_path(run, kind), os.O_RDONLY, narrow=True)) as f:
            return [bounded_json.loads(line, source=restarts_path(run, kind)) for line in f
                    if line.strip().endswith("}")]
    except (OSError, ValueError):
        return []


def _log_restart(run: RunLike, entry: dict, kind: ShardKind = EXTRACTION) -> None:
    # appended to, never replaced: not through a link planted at its name (durable.open_owned)
    with os.fdopen(open_owned(restarts_path(run, kind), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644,
                              narrow=True), "a") as f:
        f.write(json.dumps(entry) + "\n")


def recover_server(run: RunLike, shard: int, log: Log = print, kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    """On the node: make the run's server of the phase (``kind``) healthy, restarting it at most once per
    incident (a retry's recovery; extraction's ``before_retry``)."""
    cfg = run.cfg
    life = kind.lifecycle()
    lock = NodeLock(lock_path(run, kind.server_role), purpose=f"{kind.server} recovery for run {run.layout.run_id}")
    t0 = time.time()
    # Long enough for another shard's full restart: stop, GPU wait, model load.
    waited = lock.acquire(timeout_s=server_restart_s(cfg))
    try:
        if waited:
            log(f"shard {shard}: waited {time.time() - t0:.0f} s for another recovery to finish")
        stopped_worker = _stop_stuck_worker(run, shard, log, kind)
        # stopped (T) or a zombie comes back "stuck" with no health request: none can succeed, none is waited for
        state, info, detail = life.check_ready(run, cfg.watchdog.health_timeout_s)
        if state == "ready" and info is not None:   # a ready server has answered its info
            restarts = read_restarts(run, kind)
            last = restarts[-1] if restarts else None
            by = (f" (restarted at {time.strftime('%H:%M:%S', time.localtime(last['at']))} for shard "
                  f"{last['shard']})") if last and time.time() - last["at"] < 3600 else ""
            summary = f"{kind.server} healthy at {info['url']}{by}: nothing to restart"
            log(f"shard {shard}: {summary}")
            return {"ok": True, "action": "none", "summary": summary, "worker": stopped_worker}
        rec = run.node.process_status(str(run.layout.pid_file(kind.server_role))).record
        if (state == "loading" and rec is not None
                and _restarted_by_us_and_loading(run, rec, cfg.server.ready_timeout_s, kind)):
            log(f"shard {shard}: {kind.server} pid {rec.pid} was restarted by a recovery "
                f"{time.time() - rec.started_at:.0f} s ago and is loading ({detail}); waiting for it")
            info = life.wait_server_ready(run, log=log)
            summary = f"{kind.server} pid {rec.pid} became ready at {info['url']}; no second restart"
            return {"ok": True, "action": "waited", "summary": summary, "worker": stopped_worker}
        reason = detail if state in ("dead", "stuck") else f"not answering /health_generate within " \
                                                            f"{cfg.watchdog.health_timeout_s:.0f} s ({detail})"
        log(f"shard {shard}: {kind.server} unhealthy: {reason}; restarting it")
        restart = _restart_server(run, shard, rec, reason, log, grace_s=min(cfg.gpu.kill_grace_s, 30.0), kind=kind)
        old_pid, new_pid, gpus = restart["old_pid"], restart["new_pid"], restart["gpus"]
        summary = (f"{kind.server} restarted for shard {shard}: was pid {old_pid} ({reason}); now pid {new_pid} "
                   f"at {restart['url']}, ready after {time.time() - t0:.0f} s; GPUs: {gpus}")
        log(summary)
        return {"ok": True, "action": "restarted", "summary": summary, "worker": stopped_worker,
                "restart": restart}
    except Exception as e:  # the retry must say what went wrong, never hang on it
        summary = f"recovery for shard {shard} failed: {type(e).__name__}: {e}"
        log(summary)
        return {"ok": False, "action": "failed", "summary": summary}
    finally:
        lock.release()


def open_incident(run: RunLike, shard: int, cause: str, summary: str,
                  kind: ShardKind = EXTRACTION) -> OpenIncident:
    """On the node, the moment a shard's watch finds a stall: open or join the incident of (node, cause).

    Quick (no restart here): the caller mails when it opened the incident, then calls
    ``recover_in_watch`` with its id. Every shard's stored/total count comes back for the mail. The answer
    ``eagleflow recover --incident-only`` prints, read by the watch with the same class.
    """
    incident, opened = open_or_join(run.layout.state_dir, node=run.cfg.node.name, cause=cause,
                                    run_id=run.layout.run_id, shard=shard, summary=summary,
                                    join_window_s=run.cfg.watchdog.detection_bound_s)
    return OpenIncident(incident=incident["id"], opened=opened, cause=cause,
                        incident_shards=tuple(sorted(incident.get("shards", {}))), shards=shard_counts(run, kind),
                        summary=f"incident {incident['id']} {'opened' if opened else 'joined'}")


def recover_in_watch(run: RunLike, shard: int, cause: str, summary: str, log: Log = print,
                     incident_id: str | None = None, kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    """On the node, right after the shard's watch found a stall (no Airflow retry in between); one recovery for
    every sharded phase (``kind``: its server and workers, its descriptor's ``lifecycle()``).

    Stops the shard's stuck worker; for a server cause, restarts the server at most once per incident,
    without a health re-check when it is provably dead or stopped (gone, zombie, state T) and even when
    /health_generate answers (the watch saw /generate hang); then starts the shard's worker again,
    which resumes from its manifest. Opens or joins the incident first unless ``incident_id`` is given.
    """
    cfg = run.cfg
    lifecycle = kind.lifecycle()
    t0 = time.time()
    incident = current(run.layout.state_dir, cfg.node.name, cause)
    if incident_id is None or incident is None or incident.get("id") != incident_id:
        opened = open_incident(run, shard, cause, summary, kind).opened
        incident = current(run.layout.state_dir, cfg.node.name, cause)
        if incident is None:   # open_incident has just written it; only someone deleting the book loses it
            raise RuntimeError(f"the incident of {cause} on node {cfg.node.name} opened for shard {shard} is gone "
                               f"from {run.layout.state_dir}/incidents; check what removes files there")
    else:
        opened = False
    result: dict[str, Any] = {"ok": False, "action": "none", "incident": incident["id"],
                              "opened": opened, "cause": cause}
    try:
        if cause == SERVER_CAUSE:
            lock = NodeLock(lock_path(run, kind.server_role),
                            purpose=f"{kind.server} recovery for run {run.layout.run_id}")
            lock.acquire(timeout_s=server_restart_s(cfg))
            try:
                result["worker"] = _stop_stuck_worker(run, shard, log, kind)
                result.update(_restart_server_once(run, shard, incident, log, kind))
            finally:
                lock.release()
        else:
            result["worker"] = _stop_stuck_worker(run, shard, log, kind)
            result["action"] = "worker restarted"
        rec, attached = lifecycle.start_worker(run, shard, log=log)
        result["new_worker_pid"] = rec.pid
        result["ok"] = True
        result["summary"] = (f"{result.get('server_summary', f'{kind.server} left running')}; {kind.watch_name} "
                             f"{shard}'s "
                             f"worker {result['worker']}, {'attached to' if attached else 'restarted as'} pid "
                             f"{rec.pid}, {time.time() - t0:.1f} s after the recovery began")
    except Exception as e:  # the watch must say what went wrong, never hang on it
        result["summary"] = f"in-watch recovery of shard {shard} failed: {type(e).__name__}: {e}"
    log(f"shard {shard}: {result['summary']}")
    result["recovered_at"] = time.time()
    result["shards"] = shard_counts(run, kind)
    stored = record_recovery(run.layout.state_dir, incident,
                             {"ok": result["ok"], "action": result["action"], "summary": result["summary"],
                              "recovered_at": result["recovered_at"], "shard": shard})
    result["incident_shards"] = sorted(stored.get("shards", {}))
    return result


def _restart_server_once(run: RunLike, shard: int, incident: dict, log: Log,
                         kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    cfg = run.cfg
    status = run.node.process_status(str(run.layout.pid_file(kind.server_role)))
    rec = status.record
    st = read_stat(rec.pid) if status.alive and rec is not None else None
    restarted_in_incident = [i for i in read_restarts(run, kind)
                             if i.get("incident") == incident["id"] and rec and i.get("new_pid") == rec.pid]
    if rec is None or st is None:
        reason = f"pid {rec.pid if rec else '?'} is gone (no health re-check needed)"
    elif restarted_in_incident and st.alive and not st.stopped:
        return {"action": "none", "server_summary": f"{kind.server} already restarted in this incident "
                                                    f"(now pid {rec.pid}): no second restart"}
    elif st.stopped:
        reason = f"pid {rec.pid} is stopped (state T; no health re-check needed)"
    elif st.zombie:
        reason = f"pid {rec.pid} is a zombie (no health re-check needed)"
    else:
        reason = f"pid {rec.pid} is alive but the watch found it stuck ({incident['shards'].get(str(shard), {}).get('summary', '')[:300]})"
    log(f"{kind.watch_name} {shard}: {kind.server} {reason}; restarting it")
    t0 = time.time()
    # the watch saw the stall a moment ago: a shorter grace and a finer readiness poll than a retry's
    entry = _restart_server(run, shard, rec, reason, log, grace_s=min(cfg.gpu.kill_grace_s, 10.0), poll_s=0.25,
                            incident_id=incident["id"], kind=kind)
    return {"action": "restarted", "restart": entry,
            "server_summary": f"{kind.server} restarted: was pid {entry['old_pid']} ({reason}); now pid "
                              f"{entry['new_pid']} at {entry['url']}, ready {time.time() - t0:.1f} s later; "
                              f"GPUs: {entry['gpus']}"}


def _restart_server(run: RunLike, shard: int, rec: ProcessRecord | None, reason: str, log: Log, *, grace_s: float,
                    poll_s: float | None = None, incident_id: str | None = None,
                    kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    """The one server restart, under the caller's recovery lock: stop it (pid record; the stop sends CONT after
    TERM, so a SIGSTOPped server acts on it), wait until the GPUs read idle, start it, wait until it answers,
    and log the restart (the entry, returned). ``incident_id``: the incident book's incident it belongs to."""
    lifecycle = kind.lifecycle()
    old_pid = rec.pid if rec else None
    lifecycle.stop_server(run, grace_s=grace_s, log=log)
    gpus = _free_and_verify_gpus(run, log, kind.server)
    proc, _ = lifecycle.start_server(run, log=log)
    info = (lifecycle.wait_server_ready(run, log=log) if poll_s is None
            else lifecycle.wait_server_ready(run, poll_s=poll_s, log=log))
    entry = {"at": time.time(), "shard": shard, "reason": reason[:500], "old_pid": old_pid, "new_pid": proc.pid,
             "url": info.get("url"), "gpus": gpus}
    if incident_id is not None:
        entry["incident"] = incident_id
    _log_restart(run, entry, kind)
    return entry


def shard_counts(run: RunLike, kind: ShardKind = EXTRACTION) -> dict[str, str]:
    """Every shard's stored units (from its manifest) out of its total (from its heartbeat), of the phase."""
    out = {}
    for i in range(kind.num_shards(run.cfg)):
        try:
            hb = Heartbeat.read(str(kind.heartbeat_file(run.layout, i)))
        except (ValueError, TypeError, KeyError):
            hb = None
        total = f"/{hb.total:,}" if hb and hb.total else ""
        out[str(i)] = f"{stored_samples(run.layout, i, WatchedJob(shard=i, phase=kind.phase)):,}{total}"
    return out


def _stop_stuck_worker(run: RunLike, shard: int, log: Log, kind: ShardKind) -> str:
    """The diagnosed worker may still be alive (blocked on a frozen server): never let two run one shard."""
    res = run.node.stop_recorded(str(run.layout.pid_file(kind.worker_role(shard))), grace_s=10.0)
    if res.outcome in ("already_gone", "not_recorded"):
        return "not running"
    log(res.detail)
    return f"pid {res.pid} {res.outcome}"


def _restarted_by_us_and_loading(run: RunLike, rec: ProcessRecord | None, within_s: float,
                                 kind: ShardKind = EXTRACTION) -> bool:
    """The same incident: the live server is the one a recovery started less than ``within_s`` ago."""
    if rec is None or not rec.started_at:
        return False
    last = read_restarts(run, kind)[-1:]
    if not last or last[0].get("new_pid") != rec.pid:
        return False
    st = leader_state(rec)
    return st is not None and st.alive and not st.stopped and time.time() - rec.started_at < within_s


def _free_and_verify_gpus(run: RunLike, log: Log, server: str = "capture server") -> str:
    """After the server's process group stopped: wait until the selected GPUs read idle (baseline + margin)."""
    cfg = run.cfg
    if not cfg.node.has_gpu:
        return "not applicable (node.has_gpu is false)"
    probe = probe_for(run.node, cfg)
    baseline = None
    if cfg.gpu.baseline_file:
        baseline = run.node.read_text(str(cfg.resolve(cfg.gpu.baseline_file)))
    policy = IdlePolicy.from_config(cfg, baseline)
    # Not eagleflow.gpu.free_recorded_processes: it stops every recorded process of the run (the other
    # shards' workers). The server's group was stopped above; only waiting is left.
    deadline = time.monotonic() + cfg.gpu.idle_timeout_s
    while True:
        report = policy.evaluate(probe.snapshot(), cfg.gpu.select, node=run.node.name)
        if report.all_idle:
            return "idle (" + ", ".join(f"GPU {v.snapshot.index}" for v in report.verdicts) + ")"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"GPUs not idle {cfg.gpu.idle_timeout_s:.0f} s after stopping the {server}: "
                               f"{report.message()}")
        time.sleep(cfg.gpu.poll_interval_s)


# ----------------------------------------------------------------------------- control plane side
def recover_on_node(ctx, shard: int, log, *, cause: str | None = None, incident: str | None = None,
                    summary: str = "", kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    """The one control-plane call of a recovery, for every cause: ``eagleflow recover --shard I --json`` (with
    ``--cause``/``--incident``/``--summary`` after a watch's stall), given ``recovery_budget_s`` plus
    ``RECOVERY_COMMAND_SLACK_S``. ``log`` is a logger (``.info``) or a callable. Raises RuntimeError when the
    recovery failed or gave no answer, so the task fails with the reason instead of running blind."""
    say = log.info if hasattr(log, "info") else log
    argv = ["recover", "--shard", str(shard), "--json"]
    if cause is not None:
        argv += ["--cause", cause, "--incident", str(incident), "--summary", summary[:1500]]
    argv += ["--phase", kind.phase]
    try:
        # exit 1 still carries the result: a recovery that failed says why
        result = ctx.node.run_json(ctx.eagleflow_argv(*argv), RecoveryResult,
                                   timeout=recovery_budget_s(ctx.cfg) + RECOVERY_COMMAND_SLACK_S, answer_codes=(0, 1),
                                   log=lambda line: say(f"recover (node {ctx.node.name}): {line}"))
    except NodeError as e:
        raise RuntimeError(f"`eagleflow recover --shard {shard}` on node {ctx.node.name} gave no result: {e}") from None
    say(f"shard {shard}: {result.summary}")
    if not result.ok:
        raise RuntimeError(result.summary or "recovery failed without a reason")
    return result.model_dump()


def recover_before_retry(ctx, shard: int, log, kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    """A phase's ``before_retry`` when its worker waits for the server itself (extraction): called by the shard's
    task on a retry whose first look found the shard stalled, dead or failed with a cause the watch does not
    recover (a live, progressing worker is attached to instead), and by a reconcile rerun's retry."""
    return recover_on_node(ctx, shard, log, kind=kind)


def recover_after_stall(ctx, shard: int, event: EventPayload, log,
                        kind: ShardKind = EXTRACTION) -> dict[str, Any]:
    """Control plane, right after the watch's stall event (and its mail): the recovery of the event's cause in
    the event's incident; Airflow's retry (``recover_before_retry``) is the fallback when it fails."""
    inc = event.get("incident") or {}
    return recover_on_node(ctx, shard, log, cause=str(event.get("cause")), incident=str(inc.get("incident")),
                           summary=next(iter((event.get("diagnosis") or "").splitlines()), ""), kind=kind)
