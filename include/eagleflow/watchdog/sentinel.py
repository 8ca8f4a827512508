"""Who watches the watcher: the node's look log and a sentinel beside each detached job.

The watch (Airflow's triggerer, or the worker in non-deferrable mode) runs one
``eagleflow watch`` on the node per poll. Each of those looks is appended to the
job's look log (``<state_dir>/watch/<run>.<role>.looks.jsonl``, beside the watch's
memory; bounded: past LOOKS_MAX_BYTES it moves to ``.1`` and a new one starts).
A recovery run by the watch (``eagleflow recover --cause``) writes a look that
says how long it may take (``until``): a server restart is the watch at work,
not a silent watch.

The sentinel (``eagleflow sentinel --shard I``) is a small detached process the
node starts beside each worker (``capture.lifecycle.start_or_attach_worker``,
recorded like the worker, one per shard under its own lock). While a live worker
is recorded for the shard and its heartbeat is not complete or failed, it reads
the look log every few seconds; when no look happened for SILENT_POLLS poll
intervals (the watch's own pace instead when it is slower: the median gap
between its recent looks, as each look is a node command that can outlast a
short poll interval; never less than one interval plus the longest one look
may take; before the first look, FIRST_LOOK_GRACE_S more) it raises one alarm
naming the job and the last look:

- a record, ``<state_dir>/watch/<run>.<role>.alarm.json`` (state ``raised``),
  which gpu_node_health reads from the node (``health.node_activity``) and
  opens an incident for (it mails that incident unless the node already did);
- a mail, when the node has an SMTP relay of its own (``watchdog.node_smtp``).

When looks come back it marks the alarm ``cleared`` (and mails that, if it
mailed the alarm) and watches on; when no live worker is recorded any more
(checked twice, SENTINEL_EXIT_CONFIRM_S apart, so a recovery's worker restart
does not end it) or the heartbeat says complete or failed, it marks any raised
alarm ``ended`` and exits. It signals nothing, ever: it only reads and writes
its own files and mails.

Standard library and eagleflow's core only (runs on the node, no Airflow).
"""
from __future__ import annotations

import json
import os
import smtplib
import sys
import time
from email.errors import MessageError
from email.message import EmailMessage
from typing import Callable

from eagleflow import bounded_json
from eagleflow.config import PipelineConfig
from eagleflow.durable import atomic_write, open_owned
from eagleflow.layout import RunLayout
from eagleflow.mail_header import header_text
from eagleflow.heartbeat import Heartbeat
from eagleflow.nodes import JobAlreadyRunning
from eagleflow.nodes.process_record import leader_state, read_record

from .signals import WatchedJob, memory_path

SILENT_POLLS = 3                 # no look for this many poll intervals while the job runs: the watch is gone
LOOKS_MAX_BYTES = 256 * 1024     # the look log moves to .1 past this (two files at most: bounded)
SENTINEL_CHECK_MAX_S = 5.0       # the sentinel reads the look log at least this often
SENTINEL_EXIT_CONFIRM_S = 3.0    # no live worker on two reads this far apart: the job ended
PACE_LOOKS = 9                   # the watch's pace: the median gap between its last this-many looks
FIRST_LOOK_GRACE_S = 30.0        # a new worker's task defers and a triggerer picks the watch up: its first look


# --------------------------------------------------------------------------- paths
def looks_path(layout: RunLayout, job: WatchedJob) -> str:
    return memory_path(layout, job)[: -len(".json")] + ".looks.jsonl"


def alarm_path(layout: RunLayout, job: WatchedJob) -> str:
    return memory_path(layout, job)[: -len(".json")] + ".alarm.json"


def sentinel_role(job: WatchedJob) -> str:
    return f"sentinel_{job.role}"


def sentinel_args(job: WatchedJob) -> list[str]:
    """The `eagleflow sentinel` arguments that name ``job`` (as `eagleflow watch` names it)."""
    if job.shard is None:
        return ["sentinel", "--train"]
    return ["sentinel", "--shard", str(job.shard), "--phase", job.phase]


def ensure_sentinel(ctx, job: WatchedJob, log: Callable[[str], None] | None = None):
    """Start the job's sentinel beside it, detached, recorded and locked like a worker; one already there (its
    lock held) follows whichever worker is recorded now. ``ctx``: a RunLike (node, layout, eagleflow_argv).
    A sentinel that cannot start is said, never fatal: the job runs without it. Its record, or None."""
    role = sentinel_role(job)
    try:
        rec = ctx.node.spawn_detached(ctx.eagleflow_argv(*sentinel_args(job)), role=role,
                                      pid_file=str(ctx.layout.pid_file(role)),
                                      log_file=str(ctx.layout.log_file(role)), lock_file=str(ctx.layout.lock_file(role)),
                                      owned_roots=ctx.layout.owned_roots)
    except JobAlreadyRunning:
        return None   # the live sentinel of this job watches the new worker too
    except Exception as e:   # noqa: BLE001 - the job must not fail for its sentinel
        if log:
            log(f"{job.name}: WARNING: no sentinel started ({type(e).__name__}: {e}); nothing will say so if "
                f"the watch of this job goes silent")
        return None
    if log:
        log(f"{job.name}: sentinel started: pid {rec.pid}, log {rec.log_file}")
    return rec


# --------------------------------------------------------------------------- the look log
def record_look(path: str, entry: dict, max_bytes: int = LOOKS_MAX_BYTES) -> None:
    """Append one look (one JSON line). Never raises: a look log that cannot be written must not stop the
    watch (the sentinel then alarms, which is what a person should hear)."""
    line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            if os.lstat(path).st_size + len(line) > max_bytes:
                os.replace(path, path + ".1")   # bounded: the older half is dropped at the next move
        except FileNotFoundError:
            pass
        fd = open_owned(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, narrow=True)
        try:
            os.write(fd, line)   # one write of one line under O_APPEND: lines never interleave
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:   # UnsafeFile is a ValueError
        print(f"eagleflow: look not recorded in {path}: {e}", file=sys.stderr, flush=True)


def _tail(path: str, max_bytes: int = 8192) -> list[dict]:
    try:
        fd = open_owned(path, os.O_RDONLY, narrow=True)
    except (OSError, ValueError):
        return []
    with os.fdopen(fd, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - max_bytes))
        lines = f.read().decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        try:
            d = bounded_json.loads(line, source=path)
        except ValueError:
            continue   # a line cut by a crash mid-write (or by the tail's start)
        if isinstance(d, dict) and isinstance(d.get("at"), (int, float)):
            out.append(d)
    return out


def recent_looks(path: str) -> list[dict]:
    """The newest looks in the log, oldest first (the ``.1`` file's too when the current one has few)."""
    looks = _tail(path)
    return looks if len(looks) >= PACE_LOOKS else _tail(path + ".1") + looks


def last_look(path: str) -> dict | None:
    """The newest look in the log (the ``.1`` file when the current one has none yet)."""
    looks = recent_looks(path)
    return looks[-1] if looks else None


def look_interval_s(looks: list[dict], poll_interval_s: float) -> float:
    """The watch's own pace: the poll interval, or the median gap between its recent looks when that is longer
    (each look is one node command; on a loaded node it can take longer than a short poll interval)."""
    times = [float(x["at"]) for x in looks if x.get("by") == "watch"][-PACE_LOOKS:]
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    return max(poll_interval_s, gaps[len(gaps) // 2] if gaps else 0.0)


def look_cost_s(cfg: PipelineConfig) -> float:
    """The longest one look may take (a health check at its timeout plus the command's own cost): the next look
    can land this long after one interval (WatchdogConfig.detection_bound_s counts the same)."""
    wd = cfg.watchdog
    return wd.health_timeout_s + 2 * wd.WATCH_COMMAND_ALLOWANCE_S


def watched_until(look: dict | None, interval_s: float, cost_s: float = 0.0) -> float | None:
    """Until when the watch accounts for the job: SILENT_POLLS intervals past its last look (never less than one
    interval plus the longest a look may take), or a recovery's own bound (``until``) when that is later."""
    if look is None:
        return None
    return max(float(look["at"]) + max(SILENT_POLLS * interval_s, interval_s + cost_s),
               float(look.get("until") or 0.0))


# --------------------------------------------------------------------------- the alarm
def node_mail(cfg: PipelineConfig, subject: str, body: str, timeout_s: float = 20.0) -> str:
    """Send one plain mail through the node's own relay (``watchdog.node_smtp``); '' when sent, else why not."""
    relay = cfg.watchdog.node_smtp
    if not relay or not cfg.watchdog.alert_emails:
        return "no mail from the node (watchdog.node_smtp or watchdog.alert_emails empty)"
    host, _, port = relay.rpartition(":")
    try:   # building the mail too: whatever is wrong with it is a reason returned, never raised
        msg = EmailMessage()
        # the subject names the node and the job: one line through the one header helper, whatever they hold
        msg["Subject"], msg["From"] = header_text(subject), cfg.watchdog.node_mail_from
        msg["To"] = ", ".join(cfg.watchdog.alert_emails)
        msg.set_content(body)
        with smtplib.SMTP(host or relay, int(port or 25), timeout=timeout_s) as s:
            s.send_message(msg)
    except (OSError, smtplib.SMTPException, ValueError, MessageError) as e:
        return f"mail through {relay} (watchdog.node_smtp) failed: {type(e).__name__}: {e}"
    return ""


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "never"


class Sentinel:
    """The sentinel's state between checks; ``check`` is one pass (clock and mailer injectable for tests)."""

    def __init__(self, cfg: PipelineConfig, layout: RunLayout, job: WatchedJob, *,
                 worker_alive: Callable[[], bool], clock: Callable[[], float] = time.time,
                 mailer: Callable[[str, str], str] | None = None, log: Callable[[str], None] | None = None,
                 worker_pid: Callable[[], int | None] = lambda: None,
                 worker_started_at: Callable[[], float | None] = lambda: None):
        self.cfg, self.layout, self.job = cfg, layout, job
        self.interval_s = cfg.watchdog.poll_interval_s
        self.worker_alive = worker_alive
        self.worker_pid = worker_pid     # the recorded worker's pid (None: unknown)
        self.worker_started_at = worker_started_at   # when the recorded worker started (None: unknown)
        self.clock = clock
        self.mailer = mailer or (lambda subject, body: node_mail(cfg, subject, body))
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.started_at = clock()
        self.alarm: dict | None = None   # the raised alarm, until looks come back or the job ends

    @property
    def check_every_s(self) -> float:
        return min(SENTINEL_CHECK_MAX_S, self.interval_s / 4)

    def job_running(self) -> bool:
        try:
            hb = Heartbeat.read(self.job.heartbeat_path(self.layout))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            hb = None   # no heartbeat yet (starting) or a damaged one: the worker is what tells
        if hb is not None and hb.state in ("complete", "failed"):
            # a retry's new worker may not have written its heartbeat yet: the last try's "failed" is not its word
            pid = self.worker_pid()
            if pid is None or hb.pid == pid:
                return False
        return self.worker_alive()

    def check(self) -> bool:
        """One pass; False when the job ended (the sentinel exits)."""
        now = self.clock()
        if not self.job_running():
            return False
        looks = recent_looks(looks_path(self.layout, self.job))
        # the log outlives a try (one per run and role): looks from before the recorded worker started (or,
        # not knowing that, before this sentinel started) are an earlier try's, and say nothing about the
        # watch of this one (nor does the gap across tries about its pace)
        since = self.worker_started_at() or self.started_at
        fresh = [lk for lk in looks if float(lk.get("at", 0)) >= since]
        look = fresh[-1] if fresh else None
        interval = look_interval_s(fresh, self.interval_s)
        cost = look_cost_s(self.cfg)
        until = watched_until(look, interval, cost)
        base = max(self.started_at, since)   # no look yet: the first one's grace runs from here
        silent_since = float(look["at"]) if look else base
        deadline = until if until is not None else \
            base + FIRST_LOOK_GRACE_S + max(SILENT_POLLS * interval, interval + cost)
        if now >= deadline and self.alarm is None:
            self._raise(look, silent_since, now, interval)
        elif now < deadline and self.alarm is not None and look is not None \
                and float(look["at"]) > self.alarm["silent_since"]:
            self._clear(look, now)
        return True

    def end(self) -> None:
        """The job ended: a raised alarm is closed as ``ended`` (gpu_node_health resolves its incident)."""
        if self.alarm is not None:
            self._write("ended", self.clock(), f"the job ended while its watch was silent (alarm at "
                                               f"{_clock(self.alarm['raised_at'])})")
            self.alarm = None

    def _describe(self, look: dict | None) -> str:
        if look is None:
            return f"no look recorded since the sentinel started at {_clock(self.started_at)}"
        return (f"last look at {_clock(look['at'])} by {look.get('by', 'watch')} (pid {look.get('pid', '?')}): "
                f"{look.get('summary') or look.get('verdict') or '?'}")

    def _raise(self, look: dict | None, silent_since: float, now: float, interval: float) -> None:
        job, node = self.job.name, self.cfg.node.name
        pace = "" if interval <= self.interval_s else f", the watch's own pace (poll_interval_s {self.interval_s:g} s)"
        subject = (f"[eagleflow] WATCH SILENT {job} of run {self.layout.run_id} on {node}: no look for "
                   f"{now - silent_since:.0f} s")
        body = (f"Nothing has looked at {job} of run {self.layout.run_id} on node {node} for "
                f"{now - silent_since:.0f} s ({SILENT_POLLS} poll intervals of {interval:.3g} s{pace}) while it runs: "
                f"{self._describe(look)}.\n\nThe job keeps running, but a stall now would go unnoticed. The "
                f"watch runs in Airflow's triggerer (or in the task's worker when not deferrable): check that "
                f"the triggerer and the scheduler are alive (the GPU view shows Airflow's health; `make airflow` "
                f"restarts a dead part). This sentinel (pid {os.getpid()}) mails again only after looks come back "
                f"and stop again.")
        self.alarm = {"silent_since": silent_since, "raised_at": now, "subject": subject, "mailed": False}
        why = self.mailer(subject, body)
        self.alarm["mailed"] = not why
        self.alarm["mail_error"] = why
        self.log(f"sentinel: {subject}; {'mailed' if not why else why}")
        self._write("raised", now, body, last_look=look)

    def _clear(self, look: dict, now: float) -> None:
        raised = self.alarm or {}
        detail = (f"looks came back at {_clock(look['at'])} after {look['at'] - raised.get('silent_since', now):.0f} s "
                  f"of silence")
        self.log(f"sentinel: {self.job.name}: {detail}")
        if raised.get("mailed"):
            why = self.mailer(f"[eagleflow] WATCH BACK {self.job.name} of run {self.layout.run_id} on "
                              f"{self.cfg.node.name}", f"The watch of {self.job.name} is looking again: {detail}.")
            if why:
                self.log(f"sentinel: {why}")
        self._write("cleared", now, detail, last_look=look)
        self.alarm = None

    def _write(self, state: str, now: float, detail: str, last_look: dict | None = None) -> None:
        a = self.alarm or {}
        rec = {"state": state, "at": now, "run_id": self.layout.run_id, "role": self.job.role, "job": self.job.name,
               "node": self.cfg.node.name, "poll_interval_s": self.interval_s,
               "silent_since": a.get("silent_since"), "raised_at": a.get("raised_at"), "subject": a.get("subject"),
               "mailed": bool(a.get("mailed")), "mail_error": a.get("mail_error", ""), "detail": detail,
               "last_look": last_look, "sentinel_pid": os.getpid()}
        try:
            atomic_write(alarm_path(self.layout, self.job), json.dumps(rec), fsync=False)
        except (OSError, ValueError) as e:
            self.log(f"sentinel: alarm record {alarm_path(self.layout, self.job)} not written: {e}")


def recorded_worker_alive(layout: RunLayout, job: WatchedJob) -> bool:
    """A live process is recorded for the job's role (whichever worker it is now: a recovery may restart it)."""
    try:
        rec = read_record(str(layout.pid_file(job.role)))
    except (OSError, ValueError):
        return False
    st = leader_state(rec) if rec is not None else None
    return st is not None and st.alive


def recorded_worker_started_at(layout: RunLayout, job: WatchedJob) -> float | None:
    """When the job's recorded worker started (unix time; None when there is no trusted record)."""
    try:
        rec = read_record(str(layout.pid_file(job.role)))
    except (OSError, ValueError):
        return None
    return float(rec.started_at) if rec is not None and rec.started_at else None


def recorded_worker_pid(layout: RunLayout, job: WatchedJob) -> int | None:
    """The pid in the job's process record (None when there is no trusted record)."""
    try:
        rec = read_record(str(layout.pid_file(job.role)))
    except (OSError, ValueError):
        return None
    return rec.pid if rec is not None else None


def run_sentinel(cfg: PipelineConfig, layout: RunLayout, job: WatchedJob, *,
                 sleep: Callable[[float], None] = time.sleep) -> int:
    """The sentinel process's loop: until the job ended (confirmed twice), one check every few seconds."""
    s = Sentinel(cfg, layout, job, worker_alive=lambda: recorded_worker_alive(layout, job),
                 worker_pid=lambda: recorded_worker_pid(layout, job),
                 worker_started_at=lambda: recorded_worker_started_at(layout, job))
    s.log(f"sentinel for {job.name} of run {layout.run_id} on {cfg.node.name}: pid {os.getpid()}, alarm after "
          f"{SILENT_POLLS} x {s.interval_s:g} s without a look ({looks_path(layout, job)})")
    while True:
        if not s.check():
            sleep(SENTINEL_EXIT_CONFIRM_S)   # a recovery stops the worker and starts it again: look once more
            if not s.check():
                s.end()
                s.log(f"sentinel: {job.name} ended; exiting")
                return 0
        sleep(s.check_every_s)
