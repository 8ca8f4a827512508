"""The watch's protocol: what a node job's watch tells its operator, as small frozen pydantic models.

A watch (``eagleflow.airflow.shard_watch``) yields exactly one event and ends; the operator acts on it
(``next_step``: done, mail and recover, watch again, fail) and, unless it is final, watches again. Events
cross Airflow's trigger-event payload, hence plain values: ``to_dict()`` is the model's JSON dump and
``parse_event`` validates a payload into the one event type its ``status`` names (a discriminated union;
unknown keys are ignored, so a payload from a newer or older release still parses). The wire shape is the
one documented in ``eagleflow.airflow.shard_watch``.

Every event carries the watch's own state (``WatchState``: the incidents its task mailed and must mail the
end of, the mails its SMTP server refused, the in-watch recoveries left), flat beside its own fields, so a
stall or an outage in between loses none of it. No Airflow import: the node side and the tests build and read
these too.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Callable, ClassVar, Literal, TypedDict, Union, cast

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, SerializerFunctionWrapHandler, TypeAdapter,
                      ValidationError, field_validator, model_serializer, model_validator)

from .incidents import incident_id

Step = Literal["done", "recover", "watch", "fail"]
CLOSE_KINDS = ("stall", "outage")
MAIL_KINDS = ("stall", "unreachable", "over")


class IncidentPayload(TypedDict, total=False):
    """An ``OpenIncident`` on the wire (inside a ``Recovering`` event)."""
    incident: str
    opened: bool
    cause: str
    incident_shards: list[str]
    shards: dict[str, str]
    summary: str
    ok: bool


class EventPayload(TypedDict, total=False):
    """A ``WatchEvent`` on the wire (``WatchEvent.payload()``): what Airflow hands ``execute_complete`` and what a
    pending mail is rendered from. Each event type sends its own fields of these, flat, with the ``WatchState``'s
    beside them; a field an event type does not have is absent. ``parse_event`` reads it back into the type."""
    status: str
    verdict: str
    diagnosis: str
    subject: str
    summary: str
    cause: str | None
    job: str | None
    node: str | None
    done: int | None
    total: int | None
    observed_at: float | None
    detected_at: float | None
    incident: IncidentPayload | None     # Recovering
    since: float                         # Unreachable
    last_contact: float | None
    mail: bool
    closed: list[dict[str, Any]]         # Resumed: IncidentClose.to_dict() each
    still_open: list[dict[str, Any]]
    unreachable_since: float | None      # MailDue
    clocks: dict[str, float]
    close_incidents: list[dict[str, Any]]   # WatchState
    pending_mails: list[dict[str, Any]]
    recoveries_left: int


class _Wire(BaseModel):
    """Frozen plain values; keys this release does not know are ignored."""
    model_config = ConfigDict(frozen=True, extra="ignore")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        return data if isinstance(data, cls) else cls.model_validate(data)


def _of_kind(kinds: tuple[str, ...], what: str) -> Callable[[Any], Any]:
    """A state entry from plain values: a mapping whose ``kind`` is one of ``kinds``; anything else is refused
    (ValueError) naming it, never carried along untyped."""
    def check(data: Any) -> Any:
        if isinstance(data, BaseModel):
            return data
        if not isinstance(data, dict) or data.get("kind") not in kinds:
            raise ValueError(f"{what} must be a mapping with kind one of {kinds}, got {data!r}")
        return data
    return check


class IncidentClose(_Wire):
    """An incident this task mailed, whose end it mails too: a stall (over once more than ``done`` are stored
    or the job completes) or a node outage (over once the node answers). ``since``: when it began (unix
    time); ``subject``: the mail it answers. Built by ``eagleflow.airflow.alerts.close_of_stall``/``close_of_outage``."""
    kind: Literal["stall", "outage"]
    id: str = ""
    subject: str = ""
    since: float = 0.0
    done: int = 0

    _check = model_validator(mode="before")(_of_kind(CLOSE_KINDS, "an incident to close"))


class PendingMail(_Wire):
    """A watch's mail its SMTP server has not taken yet (``eagleflow.airflow.alerts.send_pending``): the kind
    of mail, the event it is rendered from (its plain payload, as the mail templates read it), the incident it
    closes (kind "over"), how often it failed, when it is due again (unix time) and the last error."""
    kind: Literal["stall", "unreachable", "over"]
    event: dict[str, Any] = Field(default_factory=dict)
    close: IncidentClose | None = None
    tries: int = 0
    next_at: float = 0.0
    error: str = ""

    _check = model_validator(mode="before")(_of_kind(MAIL_KINDS, "a pending mail"))

    def event_payload(self) -> EventPayload:
        """The event the mail is rendered from, as the watch sent it (less its state)."""
        return cast(EventPayload, self.event)


class WatchState(_Wire):
    """What a watch hands to the next one: incidents this task mailed, the mails still pending, and the in-watch
    recoveries left (None: an event that names none, e.g. from a build before the trainer's watch counted them)."""
    close_incidents: tuple[IncidentClose, ...] = ()
    pending_mails: tuple[PendingMail, ...] = ()
    recoveries_left: int | None = None

    @model_serializer(mode="wrap")
    def _without_unset_recoveries(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("recoveries_left") is None:
            out.pop("recoveries_left", None)
        return out


STATE_KEYS = tuple(WatchState.model_fields)


class OpenIncident(_Wire):
    """The incident of (node, cause) a stalled shard opened or joined on the node (``eagleflow recover
    --incident-only`` prints it, the watch reads it with this class): its id, whether this shard opened it (then
    it mails), the shards in it, every shard's stored/total count for the mail. An id that is not a plain token
    (it goes into a mail's Message-ID) is refused (``incidents.incident_id``)."""
    incident: Annotated[str, BeforeValidator(incident_id)]
    opened: bool
    cause: str = ""
    incident_shards: tuple[str, ...] = ()
    shards: dict[str, str] = Field(default_factory=dict)
    summary: str = ""
    ok: bool = True


class WatchEvent(_Wire):
    """Base of the events: ``status`` names the kind on the wire, ``state`` travels flat beside the fields;
    a field left None is not sent, unless the type keeps it (``KEEP_NONE``: None says something there)."""
    KEEP_NONE: ClassVar[tuple[str, ...]] = ()
    status: str
    state: WatchState = Field(default_factory=WatchState)

    @property
    def kind(self) -> str:
        return self.status

    def payload(self) -> EventPayload:
        """``to_dict()`` as the wire form's type."""
        return cast(EventPayload, self.to_dict())

    @model_validator(mode="before")
    @classmethod
    def _gather_state(cls, data: Any) -> Any:
        if isinstance(data, dict) and "state" not in data:
            data = {**data, "state": {k: data[k] for k in STATE_KEYS if k in data}}
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        state: dict[str, Any] = out.pop("state")
        return {k: v for k, v in out.items() if v is not None or k in self.KEEP_NONE} | state


class Complete(WatchEvent):
    """The job finished."""
    status: Literal["complete"] = "complete"
    summary: str = ""
    detected_at: float | None = None


class _Verdict(WatchEvent):
    """What the watch found wrong with the job, and the mail that says so."""
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


class JobVerdict(_Verdict):
    """The job is stalled, dead or failed (the task fails with it; Airflow's retry resumes it), or the watch
    itself cannot vouch for it any more (status failed, verdict unreachable)."""
    status: Literal["stalled", "dead", "failed"]

    @model_validator(mode="before")
    @classmethod
    def _verdict_is_the_status(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {"verdict": data.get("status"), "diagnosis": "", "subject": "", **data}
        return data


class Recovering(_Verdict):
    """A stall the watch can recover in the same task try: the incident it opened or joined on the node (a shard's;
    the trainer, one per run, opens none); the operator mails (the shard that opened it, the trainer always),
    recovers, watches again."""
    status: Literal["recovering"] = "recovering"
    incident: OpenIncident | None = None

    @model_validator(mode="before")
    @classmethod
    def _of_a_verdict(cls, data: Any) -> Any:
        # built from the stall's verdict (``{**verdict.to_dict(), "incident": ...}``): it is recovering now
        return {**data, "status": "recovering"} if isinstance(data, dict) else data

    @field_validator("incident", mode="before")
    @classmethod
    def _an_incident_or_none(cls, v: Any) -> Any:
        return v if isinstance(v, (dict, OpenIncident)) else None


class Unreachable(WatchEvent):
    """The node (link, sshd) does not answer: no verdict on the job. ``mail``: this watch is the first to report
    this node's outage (one mail per outage); the next watch keeps reconnecting silently from ``since``."""
    KEEP_NONE: ClassVar[tuple[str, ...]] = ("last_contact",)
    status: Literal["unreachable"] = "unreachable"
    since: float
    diagnosis: str
    subject: str
    last_contact: float | None = None
    verdict: str = "unreachable"
    cause: str = "network"
    mail: bool = False


class Resumed(WatchEvent):
    """Incidents this task mailed are over (a sample stored since the stall, or the node answers again)."""
    status: Literal["resumed"] = "resumed"
    closed: tuple[IncidentClose, ...] = ()
    still_open: tuple[IncidentClose, ...] = ()
    done: int = 0
    total: int = 0
    observed_at: float = 0.0
    job: str = ""
    node: str = ""
    summary: str = ""


class MailDue(WatchEvent):
    """A mail the SMTP server refused is due again: the operator tries it and watches on, with the outage
    already reported (``unreachable_since``) and the running clocks (``clocks``) as they were."""
    KEEP_NONE: ClassVar[tuple[str, ...]] = ("unreachable_since",)
    status: Literal["mail_due"] = "mail_due"
    unreachable_since: float | None = None
    clocks: dict[str, float] = Field(default_factory=dict)


Event = Annotated[Union[Complete, JobVerdict, Recovering, Unreachable, Resumed, MailDue],
                  Field(discriminator="status")]
_EVENT = TypeAdapter(Event)
EVENT_STATUSES = ("complete", "stalled", "dead", "failed", "recovering", "unreachable", "resumed", "mail_due")


def parse_event(payload: EventPayload | Mapping[str, object] | WatchEvent | None) -> WatchEvent:
    """The typed event of a trigger-event payload (whatever reached the operator: validated here); an unknown or
    missing status is a failure of the watch, and so is a payload that does not fit its type (the failure names
    what did not fit)."""
    if isinstance(payload, WatchEvent):
        return payload
    data: dict[str, object] = dict(payload or {})
    said = str(data.get("diagnosis") or "")
    if data.get("status") in EVENT_STATUSES:
        try:
            return _EVENT.validate_python(data)
        except ValidationError as e:
            why = f"the watch's {data['status']} event does not fit its type ({' '.join(str(e).split())[:500]})"
            said = f"{why}; it said: {said}" if said else why
    return JobVerdict(status="failed", verdict="failed", subject=str(data.get("subject") or ""),
                      diagnosis=said or f"the watch ended with {data!r}", state=_state_or_empty(data))


def _state_or_empty(data: Mapping[str, object]) -> WatchState:
    """The state a broken payload carried, when that part of it is sound (its mails and incidents go on)."""
    try:
        return WatchState.model_validate({k: data[k] for k in STATE_KEYS if k in data})
    except ValidationError:
        return WatchState()


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
