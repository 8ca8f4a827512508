"""The watch's protocol: what a node job's watch tells its operator, as small frozen types.

A watch (``eagleflow.airflow.shard_watch``) yields exactly one event and ends; the operator acts on it
(``next_step``: done, mail and recover, watch again, fail) and, unless it is final, watches again. Events
cross Airflow's trigger-event payload, hence plain values: each type has ``to_dict()``/``from_dict()``
(unknown keys are ignored, so a payload from a newer or older release still parses) and ``parse_event``
picks the type by ``status``. The wire shape is the one documented in ``eagleflow.airflow.shard_watch``.

Every event carries the watch's own state (``WatchState``: the incidents its task mailed and must mail the
end of, the mails its SMTP server refused, a shard's in-watch recoveries left), so a stall or an outage in
between loses none of it. No Airflow import: the node side and the tests build and read these too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from .incidents import incident_id

Step = Literal["done", "recover", "watch", "fail"]


def _plain(v: Any) -> Any:
    if hasattr(v, "to_dict"):
        return v.to_dict()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _known(cls: type[Any], data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


CLOSE_KINDS = ("stall", "outage")
MAIL_KINDS = ("stall", "unreachable", "over")


def _of_kind(data: Any, kinds: tuple[str, ...], what: str) -> dict[str, Any]:
    """A state entry from plain values: a mapping whose ``kind`` is one of ``kinds``; anything else is refused
    (ValueError) naming it, never carried along untyped."""
    if not isinstance(data, dict) or data.get("kind") not in kinds:
        raise ValueError(f"{what} must be a mapping with kind one of {kinds}, got {data!r}")
    return data


@dataclass(frozen=True)
class IncidentClose:
    """An incident this task mailed, whose end it mails too: a stall (over once more than ``done`` are stored
    or the job completes) or a node outage (over once the node answers). ``since``: when it began (unix
    time); ``subject``: the mail it answers. Built by ``eagleflow.airflow.alerts.close_of_stall``/``close_of_outage``."""
    kind: str
    id: str
    subject: str = ""
    since: float = 0.0
    done: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: "dict[str, Any] | IncidentClose") -> "IncidentClose":
        """From a trigger's kwargs or an event's payload; a kind that is neither is refused (ValueError)."""
        if isinstance(data, IncidentClose):
            return data
        data = _of_kind(data, CLOSE_KINDS, "an incident to close")
        return cls(kind=str(data["kind"]), id=str(data.get("id") or ""), subject=str(data.get("subject") or ""),
                   since=float(data.get("since") or 0.0), done=int(data.get("done") or 0))


@dataclass(frozen=True)
class PendingMail:
    """A watch's mail its SMTP server has not taken yet (``eagleflow.airflow.alerts.send_pending``): the kind
    of mail, the event it is rendered from (plain values), the incident it closes (kind "over"), how often it
    failed, when it is due again (unix time) and the last error."""
    kind: str
    event: dict[str, Any] = field(default_factory=dict)
    close: IncidentClose | None = None
    tries: int = 0
    next_at: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "event": _plain(self.event), "close": self.close.to_dict() if self.close else None,
                "tries": self.tries, "next_at": self.next_at, "error": self.error}

    @classmethod
    def from_dict(cls, data: "dict[str, Any] | PendingMail") -> "PendingMail":
        if isinstance(data, PendingMail):
            return data
        data = _of_kind(data, MAIL_KINDS, "a pending mail")
        close = data.get("close")
        return cls(kind=str(data["kind"]), event=dict(data.get("event") or {}),
                   close=None if close is None else IncidentClose.from_dict(close), tries=int(data.get("tries") or 0),
                   next_at=float(data.get("next_at") or 0.0), error=str(data.get("error") or ""))


@dataclass(frozen=True)
class WatchState:
    """What a watch hands to the next one: incidents this task mailed, the mails still pending, and (shards
    only; None for the trainer) the in-watch recoveries left."""
    close_incidents: tuple[IncidentClose, ...] = ()
    pending_mails: tuple[PendingMail, ...] = ()
    recoveries_left: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"close_incidents": _plain(self.close_incidents),
                             "pending_mails": _plain(self.pending_mails)}
        if self.recoveries_left is not None:
            d["recoveries_left"] = self.recoveries_left
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WatchState":
        left = data.get("recoveries_left")
        return cls(close_incidents=tuple(IncidentClose.from_dict(c) for c in data.get("close_incidents") or ()),
                   pending_mails=tuple(PendingMail.from_dict(m) for m in data.get("pending_mails") or ()),
                   recoveries_left=None if left is None else int(left))


@dataclass(frozen=True)
class OpenIncident:
    """The incident of (node, cause) a stalled shard opened or joined on the node (``eagleflow recover
    --incident-only``): its id, whether this shard opened it (then it mails), the shards in it, every
    shard's stored/total count for the mail."""
    incident: str
    opened: bool
    cause: str = ""
    incident_shards: tuple[str, ...] = ()
    shards: dict[str, str] = field(default_factory=dict)
    summary: str = ""
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OpenIncident":
        """Read from the node's answer: an id that is not a plain token (it goes into a mail's Message-ID) is
        refused here with ValueError (``incidents.incident_id``)."""
        d = _known(cls, data)
        d["incident"], d["opened"] = incident_id(d.get("incident")), bool(d.get("opened"))
        d["incident_shards"] = tuple(str(s) for s in d.get("incident_shards") or ())
        d["shards"] = dict(d.get("shards") or {})
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class WatchEvent:
    """Base of the events: ``status`` names the kind on the wire, ``state`` is carried flat beside it."""
    STATUSES: ClassVar[tuple[str, ...]] = ()
    state: WatchState = field(default_factory=WatchState)

    @property
    def kind(self) -> str:
        return getattr(self, "status", None) or self.STATUSES[0]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.kind}
        for f in fields(self):
            if f.name in ("state", "status"):
                continue
            v = getattr(self, f.name)
            if v is None and f.default is None and f.name not in self.KEEP_NONE:
                continue
            out[f.name] = v.to_dict() if hasattr(v, "to_dict") else _plain(v)
        return {**out, **self.state.to_dict()}

    KEEP_NONE: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WatchEvent":
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in _known(cls, data).items()}
        d.pop("state", None)
        return cls(**d, state=WatchState.from_dict(data))


@dataclass(frozen=True, kw_only=True)
class Complete(WatchEvent):
    """The job finished."""
    STATUSES: ClassVar[tuple[str, ...]] = ("complete",)
    summary: str = ""
    detected_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class JobVerdict(WatchEvent):
    """The job is stalled, dead or failed (the task fails with it; Airflow's retry resumes it), or the watch
    itself cannot vouch for it any more (status failed, verdict unreachable)."""
    STATUSES: ClassVar[tuple[str, ...]] = ("stalled", "dead", "failed")
    status: str
    verdict: str
    diagnosis: str
    subject: str
    cause: str | None = None
    observed_at: float | None = None
    job: str | None = None
    node: str | None = None
    done: int | None = None
    total: int | None = None
    detected_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class Recovering(JobVerdict):
    """A stall the watch can recover in the same task try: the incident it opened or joined on the node; the
    operator mails (the shard that opened it), recovers, watches again."""
    STATUSES: ClassVar[tuple[str, ...]] = ("recovering",)
    status: str = "recovering"
    incident: OpenIncident | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recovering":
        d = {**_known(cls, data), "status": "recovering"}
        d.pop("state", None)
        inc = data.get("incident")
        d["incident"] = OpenIncident.from_dict(inc) if isinstance(inc, dict) else None
        return cls(**d, state=WatchState.from_dict(data))


@dataclass(frozen=True, kw_only=True)
class Unreachable(WatchEvent):
    """The node (link, sshd) does not answer: no verdict on the job. ``mail``: this watch is the first to report
    this node's outage (one mail per outage); the next watch keeps reconnecting silently from ``since``."""
    STATUSES: ClassVar[tuple[str, ...]] = ("unreachable",)
    KEEP_NONE: ClassVar[tuple[str, ...]] = ("last_contact",)
    since: float
    diagnosis: str
    subject: str
    last_contact: float | None = None
    verdict: str = "unreachable"
    cause: str = "network"
    mail: bool = False


@dataclass(frozen=True, kw_only=True)
class Resumed(WatchEvent):
    """Incidents this task mailed are over (a sample stored since the stall, or the node answers again)."""
    STATUSES: ClassVar[tuple[str, ...]] = ("resumed",)
    closed: tuple[IncidentClose, ...] = ()
    still_open: tuple[IncidentClose, ...] = ()
    done: int = 0
    total: int = 0
    observed_at: float = 0.0
    job: str = ""
    node: str = ""
    summary: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Resumed":
        d = _known(cls, data)
        d.pop("state", None)
        for name in ("closed", "still_open"):
            d[name] = tuple(IncidentClose.from_dict(c) for c in d.get(name) or ())
        return cls(**d, state=WatchState.from_dict(data))


@dataclass(frozen=True, kw_only=True)
class MailDue(WatchEvent):
    """A mail the SMTP server refused is due again: the operator tries it and watches on, with the outage
    already reported (``unreachable_since``) and the running clocks (``clocks``) as they were."""
    STATUSES: ClassVar[tuple[str, ...]] = ("mail_due",)
    KEEP_NONE: ClassVar[tuple[str, ...]] = ("unreachable_since",)
    unreachable_since: float | None = None
    clocks: dict[str, float] = field(default_factory=dict)


EVENT_TYPES: dict[str, type[WatchEvent]] = {s: t for t in (Complete, JobVerdict, Recovering, Unreachable, Resumed,
                                                           MailDue) for s in t.STATUSES}


def parse_event(data: dict[str, Any] | WatchEvent | None) -> WatchEvent:
    """The typed event of a trigger-event payload; an unknown or missing status is a failure of the watch."""
    if isinstance(data, WatchEvent):
        return data
    data = dict(data or {})
    kind = EVENT_TYPES.get(str(data.get("status")))
    if kind is None:
        return JobVerdict(status="failed", verdict="failed", subject=str(data.get("subject") or ""),
                          diagnosis=str(data.get("diagnosis") or f"the watch ended with {data!r}"),
                          state=WatchState.from_dict(data))
    if kind is JobVerdict:
        data.setdefault("verdict", data.get("status"))
        data.setdefault("diagnosis", "")
        data.setdefault("subject", "")
    return kind.from_dict(data)


def next_step(event: WatchEvent, can_recover: bool) -> Step:
    """What the operator does with an event: done (complete), recover (mail and recover, then watch again),
    watch (mail what is due, watch again) or fail (the task fails with the diagnosis)."""
    if isinstance(event, Complete):
        return "done"
    if isinstance(event, Recovering):
        return "recover" if can_recover else "fail"
    if isinstance(event, (Unreachable, Resumed, MailDue)):
        return "watch"
    return "fail"


# -- the one builder of the unreachable event ------------------------------------------------------------

def unreachable_event(*, job: str, since: float, error: str, state: WatchState, node: str | None = None,
                      conn_id: str | None = None, run_id: str | None = None, last_contact: float | None = None,
                      gave_up_after_s: float | None = None, command_failing_s: float | None = None,
                      mail: bool = False, now: float | None = None) -> Unreachable | JobVerdict:
    """The node cannot be vouched for: ``Unreachable`` (the watch goes on) or, when the watch gave up
    (``gave_up_after_s``) or its command keeps failing on a reachable node (``command_failing_s``), the final
    ``JobVerdict`` failed/unreachable. ``node`` None: the run's config could not be read yet (no node name)."""
    now = time.time() if now is None else now
    if command_failing_s is not None:
        return JobVerdict(
            status="failed", verdict="unreachable", subject=f"[eagleflow] UNREACHABLE {job} on {node}",
            diagnosis=(f"UNREACHABLE {job} on {node}: the watch command has failed for {command_failing_s:.0f} s, "
                       f"so the job's health is unknown; last error: {error}. Check the node connection "
                       f"(node.conn_id={conn_id!r}) and that eagleflow is installed there."), state=state)
    if node is None:
        diagnosis = (f"UNREACHABLE {job} of run {run_id} over connection {conn_id!r}: the node has not answered "
                     f"since {clock(since)} ({now - since:.0f} s; the watch could not read the run's config there); "
                     f"last error: {error}. This is the network or the node's sshd, not a verdict on the job: "
                     f"nothing is restarted, and the watch keeps reconnecting.")
        subject = f"[eagleflow] UNREACHABLE {job} over {conn_id}"
    else:
        seen = f"last answer at {clock(last_contact)}" if last_contact else "no answer in this watch"
        diagnosis = (f"UNREACHABLE {job} on {node}: the node has not answered since {clock(since)} "
                     f"({now - since:.0f} s; {seen}); last error: {error}. This is the network or the "
                     f"node's sshd, not a verdict on the job: its detached processes keep running there, nothing "
                     f"is restarted, and the watch keeps reconnecting (check node.conn_id={conn_id!r}).")
        subject = f"[eagleflow] UNREACHABLE {job} on {node}"
    if gave_up_after_s is not None:
        return JobVerdict(status="failed", verdict="unreachable", subject=subject, cause="network",
                          diagnosis=diagnosis + f"\nGave up after {gave_up_after_s / 3600:.0f} h.", state=state)
    return Unreachable(since=since, last_contact=last_contact, diagnosis=diagnosis, subject=subject, mail=mail,
                       state=state)


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
