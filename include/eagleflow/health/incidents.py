"""gpu_node_health's findings as incidents: one mail when one opens, reminders that back off, one when it ends.

A check runs every minute; a GPU held at 0 % for hours is one problem, not 120
mails. Each finding has a stable ``key`` (the same problem on the next check
has the same key) and a ``scope`` (what a check must have looked at to say the
problem is gone: a node that cannot be reached says nothing about its GPUs).

``step`` is pure: the incident book kept between checks, this check's findings
and the scopes it observed in, to the new book and the mails now due:

- a finding first seen waits ``after_s`` (an SSH blip is not an outage), then
  its incident opens: one mail;
- while it stays open: a reminder after ``remind_after_s``, then after twice
  that, four times ... (capped at a day);
- when a check observes its scope without the finding: one "resolved" mail;
- a notice (``one_shot``: uncorrected ECC errors rose) is mailed once; a further
  rise is a new notice.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, TypedDict, cast

from eagleflow.gpu.snapshot import GpuSnapshot

from eagleflow.watchdog.incidents import node_time

from .airflow_health import HEALTH_PATH, AirflowHealth, gone
from .durations import duration
from .node_activity import WatchAlarm
from .rules import GpuHealth, HealthAlert
from .status_doc import program_name

MAX_REMIND_S = 24 * 3600.0


@dataclass(frozen=True)
class Finding:
    key: str          # the same problem has the same key on every check
    scope: str        # what a check observes to tell the problem is gone ("gpus:<node>", "link:<node>", "config:<path>")
    node: str
    kind: str         # "memory_held_idle" | "ecc_rising" | "unreachable" | "config"
    topic: str        # the problem named without numbers that change ("gpu-node-1: GPU memory held at 0 % ...")
    subject: str      # the fact now ("gpu-node-1: 4 GPUs hold 88 GiB at 0 % for 11 min")
    detail: str       # the evidence, one line per GPU or error
    after_s: float = 0.0     # opens only once seen this long (the held window is applied before: 0)
    one_shot: bool = False


@dataclass(frozen=True)
class MailDue:
    kind: str                 # "opened" | "reminder" | "resolved" | "notice"
    incident: dict[str, Any]  # the book's record after this step
    subject: str
    detail: str


def _gib(mib: float) -> str:
    return f"{mib / 1024:.0f} GiB"


def held_idle_finding(node: str, alerts: list[HealthAlert], snaps: list[GpuSnapshot], state: dict[str, GpuHealth],
                      now: float) -> Finding | None:
    """The node's GPUs held at 0 % with no eagleflow job, as one finding (the seeds' incident is per node)."""
    uuids = {a.uuid for a in alerts if a.kind == "memory_held_idle"}
    held = [s for s in snaps if s.uuid in uuids]
    if not held:
        return None
    def since(s: GpuSnapshot) -> float:
        h = state.get(s.uuid)
        v = h.get("held_idle_since") if h else None
        return now if v is None else float(v)

    first = min(since(s) for s in held)
    mems = sorted(s.memory_used_mib or 0 for s in held)
    amount = _gib(mems[0]) if _gib(mems[0]) == _gib(mems[-1]) else f"{_gib(mems[0])}-{_gib(mems[-1])}"
    n = len(held)
    subject = (f"{node}: {n} GPU{'s' if n > 1 else ''} hold{'' if n > 1 else 's'} {amount}"
               f"{' each' if n > 1 else ''} at 0 % for {duration(now - first)}")
    lines = []
    for s in held:
        procs = "; ".join(f"pid {p.pid} `{program_name(p.name)}` ({p.user or 'user ?'}"
                          f"{', ' + str(p.used_mib) + ' MiB' if p.used_mib is not None else ''})"
                          for p in s.processes) or "no process listed (another container?)"
        lines.append(f"{s.label}: {s.memory_used_mib} MiB of {s.memory_total_mib} MiB at 0 % for "
                     f"{duration(now - since(s))}; processes: {procs}")
    lines.append("No eagleflow job is registered on these GPUs. If the processes are a stalled capture "
                 "server, stop them by PID (never pkill/fuser -k on a shared node) and rerun the shard.")
    return Finding(key=f"{node}:memory_held_idle", scope=f"gpus:{node}", node=node, kind="memory_held_idle",
                   topic=f"{node}: GPU memory held at 0 % with no eagleflow job", subject=subject,
                   detail="\n".join(lines))


def ecc_findings(node: str, alerts: list[HealthAlert]) -> list[Finding]:
    out = []
    for a in alerts:
        if a.kind == "ecc_rising":
            out.append(Finding(key=f"{node}:ecc_rising:{a.uuid}", scope=f"gpus:{node}", node=node,
                               kind="ecc_rising", topic=f"{node}: GPU {a.index} uncorrected ECC errors rising",
                               subject=f"{node}: GPU {a.index} uncorrected ECC errors rose", detail=a.message,
                               one_shot=True))
    return out


def unreachable_finding(node: str, error: str, after_s: float) -> Finding:
    return Finding(key=f"{node}:unreachable", scope=f"link:{node}", node=node, kind="unreachable",
                   topic=f"{node}: node unreachable", subject=f"{node}: unreachable ({error})",
                   detail=(f"The health check cannot read {node}: {error}. Its GPUs are not being watched "
                           "until it answers; the check keeps trying every interval."),
                   after_s=after_s)


def config_finding(path: str, error: str) -> Finding:
    return Finding(key=f"config:{path}", scope=f"config:{path}", node=path, kind="config",
                   topic=f"node config {path} cannot be read", subject=f"node config {path} cannot be read",
                   detail=f"{error}\n\nThe node this config names is not being checked until it is fixed.")


def _fresh(f: Finding, now: float) -> dict[str, Any]:
    return {"id": uuid.uuid4().hex[:12], **asdict(f), "state": "pending", "first_seen": now,
            "opened_at": None, "last_seen": now, "last_mail_at": None, "reminders": 0, "next_reminder_at": None}


def step(book: dict[str, dict[str, Any]], findings: list[Finding], *, observed: set[str], now: float,
         remind_after_s: float, forget_after_s: float = 24 * 3600.0
         ) -> tuple[dict[str, dict[str, Any]], list[MailDue]]:
    """The new incident book and the mails due now (see the module's doc)."""
    if remind_after_s <= 0:
        raise ValueError(f"remind_after_s={remind_after_s!r}: must be > 0 seconds")
    new: dict[str, dict[str, Any]] = {}
    due: list[MailDue] = []
    seen = {f.key: f for f in findings}
    for key, f in seen.items():
        rec = dict(book.get(key) or _fresh(f, now))
        rec.update(subject=f.subject, detail=f.detail, topic=f.topic, last_seen=now)
        if rec["state"] == "notice":       # already mailed: a notice stays quiet while it is repeated
            new[key] = rec
            continue
        if rec["state"] == "pending" and now - rec["first_seen"] >= f.after_s:
            if f.one_shot:
                rec.update(state="notice", opened_at=now, last_mail_at=now)
                due.append(MailDue("notice", rec, f.subject, f.detail))
            else:
                rec.update(state="open", opened_at=now, last_mail_at=now, next_reminder_at=now + remind_after_s)
                due.append(MailDue("opened", rec, f.subject, f.detail))
        elif rec["state"] == "open" and now >= float(rec["next_reminder_at"]):
            rec["reminders"] += 1
            gap = min(remind_after_s * 2 ** rec["reminders"], MAX_REMIND_S)
            rec.update(last_mail_at=now, next_reminder_at=now + gap)
            due.append(MailDue("reminder", rec,
                               f"{f.subject} (still open, reminder {rec['reminders']}; next in {duration(gap)})",
                               f.detail))
        new[key] = rec
    for key, rec in book.items():
        if key in seen:
            continue
        if rec.get("scope") in observed:
            if rec.get("state") == "open":   # a pending finding that went away never mailed: nothing to close
                rec = {**rec, "state": "resolved", "resolved_at": now}
                due.append(MailDue("resolved", rec,
                                   f"resolved: {rec['topic']} (open {duration(now - rec['opened_at'])})",
                                   f"Resolved at this check. Last seen while open:\n{rec['detail']}"))
            continue
        if now - float(rec.get("last_seen", now)) > forget_after_s:   # its node left the configs
            if rec.get("state") == "open":
                rec = {**rec, "state": "resolved", "resolved_at": now}
                due.append(MailDue("resolved", rec, f"no longer checked: {rec['topic']}",
                                   f"Nothing has checked this for {duration(forget_after_s)} (its config was "
                                   f"removed?); closing the incident. Last seen:\n{rec['detail']}"))
            continue
        new[key] = rec       # not looked at this time (node unreachable): still open, no mail
    return new, due


def airflow_findings(doc: AirflowHealth) -> list[Finding]:
    """One finding per Airflow part its health endpoint reports not healthy (scope "airflow": a check that read
    the endpoint and found the part healthy again resolves it)."""
    out = []
    for p in gone(doc):
        beat = (f"its last heartbeat was {duration(doc['read_at'] - p['heartbeat_at'])} before this check"
                if p["heartbeat_at"] and doc.get("read_at") else "no heartbeat recorded")
        out.append(Finding(key=f"airflow:{p['part']}", scope="airflow", node="airflow", kind="airflow_part_gone",
                           topic=f"Airflow {p['part']} gone", subject=f"Airflow {p['part']} is {p['status']}",
                           detail=(f"Airflow's health endpoint ({HEALTH_PATH}) reports the {p['part']} as "
                                   f"{p['status']}: {beat}. The {p['part']} {p['role']}. Restart it (`make airflow` "
                                   f"restarts a dead part by itself; in docker compose its restart policy does).")))
    return out


def watch_silent_findings(node: str, alarms: list[dict[str, Any]]) -> list[Finding]:
    """Sentinels' raised alarms on the node (nothing looked at a running job for 3 poll intervals) as one finding
    per run, naming every silent job of it: those whose sentinel raised its alarm, and those nothing has looked at
    either since (``silent_with``, read on the node: their sentinels alarm later, each on its own clock; the mail
    named shard 0 only in the issue 52 drill, though shard 1 was just as silent). Scope "watch:<node>": a node
    read without those alarms resolves it. "the node mailed this already" only when the node mailed every one."""
    by_run: dict[str, list[WatchAlarm]] = {}
    for a in cast(list[WatchAlarm], alarms):   # NodeActivity.watch_alarms: the node's records, each a WatchAlarm
        by_run.setdefault(str(a.get("run_id") or "?"), []).append(a)
    return [_watch_silent_finding(node, run, group) for run, group in by_run.items()]


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class SilentLook(TypedDict):
    """One ``silent_with`` entry of an alarm, checked: the job's name (cut) and its last look (a node time)."""
    job: str
    last_look_at: float | None


def _silent_with(a: WatchAlarm) -> list[SilentLook]:
    """The alarm's ``silent_with`` entries as plain values (a node's answer: text cut, times checked)."""
    out: list[SilentLook] = []
    for x in a.get("silent_with") or []:
        if not isinstance(x, dict):
            continue
        try:
            last = node_time(x.get("last_look_at"), "last_look_at")
        except ValueError:
            continue
        out.append({"job": str(x.get("job") or x.get("role") or "?")[:80], "last_look_at": last})
    return out


def _watch_silent_finding(node: str, run: str, alarms: list[WatchAlarm]) -> Finding:
    alarms = sorted(alarms, key=lambda a: str(a.get("role")))
    raised = [str(a.get("job") or a.get("role") or "?") for a in alarms]
    also: dict[str, float | None] = {}
    for a in alarms:
        for x in _silent_with(a):
            if x["job"] not in raised:
                also.setdefault(x["job"], x["last_look_at"])
    jobs = raised + sorted(also)
    lines = []
    for a in alarms:
        look = a.get("last_look") or {}
        lines.append(f"{a.get('detail') or ''}\n\nLast look at {a.get('job') or a.get('role')}: "
                     f"{json.dumps(look) if look else 'none'}")
    for job, last in sorted(also.items()):
        lines.append(f"{job} of run {run} is just as silent (its own sentinel alarms later): last look "
                     + (time.strftime("at %H:%M:%S", time.localtime(last)) if last else "none since its worker started"))
    if all(a.get("mailed") for a in alarms) and not also:
        mailed = "The node mailed this already."
    elif any(a.get("mailed") for a in alarms):
        mailed = (f"The node mailed {_and([str(a.get('job')) for a in alarms if a.get('mailed')])} only; this mail "
                  f"names every silent job.")
    else:
        errors = {str(a.get("mail_error") or "no watchdog.node_smtp") for a in alarms}
        mailed = f"The node could not mail it ({'; '.join(sorted(errors))})."
    if len(jobs) == 1:
        subject = str(alarms[0].get("subject") or f"{node}: nothing watches {jobs[0]} of run {run}")
    else:
        silent_s = [float(raised_at) - float(since) for a in alarms
                    if isinstance(raised_at := a.get("raised_at"), (int, float))
                    and isinstance(since := a.get("silent_since"), (int, float))]
        subject = (f"WATCH SILENT {_and(jobs)} of run {run} on {node}"
                   + (f": no look for {max(silent_s):.0f} s" if silent_s else ""))
    return Finding(key=f"{node}:watch_silent:{run}", scope=f"watch:{node}", node=node, kind="watch_silent",
                   topic=f"{node}: nothing watches {_and(jobs)} of run {run}",
                   subject=subject.removeprefix("[eagleflow] "),   # the mail adds it
                   detail="\n\n".join(lines) + f"\n\n{mailed}")
