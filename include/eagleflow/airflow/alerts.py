"""Every eagleflow mail, one way: ``EagleflowNotifier``, the SMTP provider's notifier with template fields.

A mail is a few facts (``Mail``: recipients, subject, headline, what happens
next, the evidence, links) put into the context as ``mail``; the notifier's
template fields (``to``, ``subject``, ``smtp_conn_id``, ``html_content`` and our
``text_content``) are Jinja templates over it, rendered per mail on a copy, so
a DAG can pass its own (``EagleflowNotifier("failure", subject="[prod] {{
mail.subject }}")``). Each mail has a plain-text and an HTML part
(multipart/alternative); links start at Airflow's configured ``[api] base_url``.

Who sends what:
- task callbacks (``pipeline_failure_callbacks``): a retry and the final failure,
  with the task's own ``retry_advice``/``failure_advice``;
- the capture watch: one mail per stall incident, one per node outage, one when
  each is over; a watch's mail the SMTP server does not take is logged and kept
  with the watch (``mail_or_keep``/``send_pending``), never raised: mail never
  decides a task's fate;
- the reconcile DAG: its summary; gpu_node_health: its incidents (opened,
  reminders, resolved).
Recipients and the SMTP connection come from the run's frozen config
(``watchdog.alert_emails``, ``watchdog.smtp_conn_id``); none: logged, nothing sent.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from airflow.providers.smtp.hooks.smtp import SmtpHook
from airflow.providers.smtp.notifications.smtp import SmtpNotifier
from airflow.sdk import Context
from airflow.sdk.bases.notifier import BaseNotifier
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.report_operators import REPORT_TASK_ID, report_url
from eagleflow.config import ConfigError
from eagleflow.mail_header import header_text
from eagleflow.phases import kind_of_job, unit_of_job
from eagleflow.watchdog.diagnosis import StallDetected
from eagleflow.watchdog.incidents import INCIDENT_ID
from eagleflow.watchdog.protocol import EventPayload, IncidentClose, PendingMail
from eagleflow.airflow.runtime import RunContext, run_params
from eagleflow.health.durations import duration

log = logging.getLogger(__name__)

GPU_VIEW_ROUTE = "/plugin/eagleflow-gpu"   # the plugin's external view (url_route) in the Airflow 3 UI

TEXT_TEMPLATE = """\
{{ mail.headline }}

{% if mail.where %}{{ mail.where }}
{% endif %}{% if mail.next_step %}{{ mail.next_step }}
{% endif %}
{{ mail.evidence }}
{% for link in mail.links %}
{{ link.label }}: {{ link.url }}{% endfor %}
"""

HTML_TEMPLATE = """\
<html><body>
<p><b>{{ mail.headline | e }}</b></p>
{% if mail.where %}<p>{{ mail.where | e }}</p>{% endif %}
{% if mail.next_step %}<p>{{ mail.next_step | e }}</p>{% endif %}
<pre>{{ mail.evidence | e }}</pre>
{% for link in mail.links %}<p>{{ link.label | e }}: <a href="{{ link.url | e }}">{{ link.url | e }}</a></p>
{% endfor %}</body></html>
"""


def airflow_base_url(fallback: str) -> str:
    """Where a person reaches this Airflow: its configured ``[api] base_url``; ``fallback`` only when unset."""
    try:
        from airflow.configuration import conf
        url = conf.get("api", "base_url", fallback=None)
    except Exception:  # no Airflow config readable: the run's own setting
        url = None
    return (url or fallback).rstrip("/")


def task_log_url(base_url: str, context: Context) -> str:
    """The task instance's log page in the Airflow 3 UI."""
    ti = context["ti"]
    url = (f"{base_url.rstrip('/')}/dags/{quote(ti.dag_id, safe='')}/runs/{quote(ti.run_id, safe='')}"
           f"/tasks/{quote(ti.task_id, safe='')}")
    map_index = getattr(ti, "map_index", -1)
    if map_index is not None and map_index >= 0:
        url += f"/mapped/{map_index}"
    return url + f"?try_number={getattr(ti, 'try_number', 1)}"


@dataclass(frozen=True)
class Recipients:
    """Who gets a mail, through which SMTP connection, and where its links point."""
    to: tuple[str, ...]
    smtp_conn_id: str
    base_url: str

    @classmethod
    def of_config(cls, cfg) -> "Recipients":
        wd = cfg.watchdog
        return cls(tuple(wd.alert_emails), wd.smtp_conn_id, airflow_base_url(wd.airflow_base_url))

    @classmethod
    def of_run(cls, context: Context) -> "Recipients":
        """The run's frozen config; its Params only when nothing was frozen (its first task failed), and the
        config file alone when the run refused a Param (the deployment's recipients, not the trigger's)."""
        frozen = RunContext.frozen_in(context)
        if frozen is not None:
            return cls.of_config(frozen.cfg)
        params = run_params(context.get("params") or {})
        if not params.get("config_path") and params.get("config_paths"):
            params["config_path"] = params["config_paths"][0]  # DAGs that look at several nodes
        try:
            return cls.of_config(RunContext.from_params(params, context["run_id"]).cfg)
        except ConfigError:   # a Param refused; one naming no usable config file refuses this too: no mail
            return cls.of_config(RunContext.from_params({"config_path": params.get("config_path")},
                                                        context["run_id"]).cfg)


@dataclass(frozen=True)
class Mail:
    """The facts of one mail; the templates decide how they look."""
    recipients: Recipients
    subject: str
    evidence: str
    headline: str = ""
    where: str = ""
    next_step: str = ""
    links: tuple[tuple[str, str], ...] = ()
    headers: dict[str, str] = field(default_factory=dict)   # Message-ID / In-Reply-To: one thread per incident

    def as_context(self) -> dict[str, Any]:
        return {"to": list(self.recipients.to), "smtp_conn_id": self.recipients.smtp_conn_id,
                "subject": header_text(self.subject), "headline": self.headline or self.subject,
                "where": self.where, "next_step": self.next_step, "evidence": self.evidence,
                "links": [{"label": label, "url": url} for label, url in self.links]}


# What whoever triggered a run wrote (issue 52 item 3) never reaches a mail in their words: each string of the
# run's conf that a Param with neither fixed choices (enum) nor a pattern took, other than the Param's own default
# (the deployment's), and each conf key that is no Param and no plain name, is replaced in every mail of the run
# by the Param's name. Shorter texts are left alone: they cannot say anything, and replacing them would cut the
# mail's own words apart. A plain key (a typo such as "shardz") stays: the mail names it, it says nothing.
TRIGGER_TEXT_MIN_CHARS = 4
PLAIN_CONF_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")


def _param(dag: Any, key: str) -> Any:
    try:
        return dag.params.get_param(key)
    except Exception:   # no Param of that name
        return None


def _constrained(schema: dict[str, Any]) -> bool:
    """Whether a Param's schema admits only fixed choices or a pattern (for a list, its items)."""
    items = schema.get("items")
    parts: list[dict[str, Any]] = [schema, items] if isinstance(items, dict) else [schema]
    return any(k in part for part in parts for k in ("enum", "pattern"))


def _default(param: Any) -> Any:
    try:
        return param.value
    except Exception:   # a Param without a default
        return None


def trigger_texts(context: Context) -> dict[str, str]:
    """The run's trigger text, each mapped to what a mail says instead (``[DAG Param NAME, not shown]``)."""
    conf = getattr(context.get("dag_run"), "conf", None)
    if not isinstance(conf, dict):
        return {}
    dag = context.get("dag") or getattr(context.get("task"), "dag", None)
    out: dict[str, str] = {}
    for key, value in conf.items():
        param = _param(dag, str(key)) if dag is not None else None
        if dag is not None and param is None and not PLAIN_CONF_KEY.fullmatch(str(key)):
            out[str(key)] = "[a key of the run's conf, not shown]"
        if param is not None and _constrained(param.schema):
            continue
        default = _default(param) if param is not None else None
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str) or len(text.strip()) < TRIGGER_TEXT_MIN_CHARS or text == default \
                    or (isinstance(default, list) and text in default):
                continue
            out.setdefault(text, f"[DAG Param {key}, not shown]")
    return out


def without_trigger_text(text: str, texts: dict[str, str]) -> str:
    """``text`` with each trigger text replaced, as written and as a repr or JSON string would quote it."""
    forms: dict[str, str] = {}
    for t, instead in texts.items():
        for form in (t, repr(t)[1:-1], json.dumps(t)[1:-1]):
            forms.setdefault(form, instead)
    for form in sorted(forms, key=len, reverse=True):   # the longest first: one text may hold another
        text = text.replace(form, forms[form])
    return text


def mail_without_trigger_text(mail: "Mail", context: Context) -> "Mail":
    texts = trigger_texts(context)
    if not texts:
        return mail
    def clean(text: str) -> str:
        return without_trigger_text(text, texts)
    return replace(mail, subject=clean(mail.subject), evidence=clean(mail.evidence), headline=clean(mail.headline),
                   where=clean(mail.where), next_step=clean(mail.next_step))


class _TextAndHtmlSmtpHook(SmtpHook):
    """The provider's hook, with a plain-text part first beside its HTML part (RFC 2046: plainest first)."""

    text_content: str | None = None

    def _build_mime_message(self, *args, **kwargs):
        from email.mime.text import MIMEText
        msg, recipients = super()._build_mime_message(*args, **kwargs)
        parts = msg.get_payload()
        if self.text_content and isinstance(parts, list):   # multipart, as the provider builds it
            parts.insert(0, MIMEText(self.text_content, "plain", kwargs.get("mime_charset", "utf-8")))
        return msg, recipients


class ConsequentialFailure(AirflowFailException):
    """A task that fails only because an earlier one did: the run must end failed, but one alert is enough."""


class AlreadyMailed(AirflowFailException):
    """A failure whose mail its task already sent (an incident's): the callbacks add none."""


class NotMailed(AirflowFailException):
    """A failure whose words came from whoever triggered the run (a refused Param): shown in the task's log and
    state only, never mailed, so a trigger cannot send words of its choosing to the deployment's recipients."""


class EagleflowNotifier(SmtpNotifier):
    """SmtpNotifier over a ``mail`` in the context; as a task callback (``kind``) it writes that mail itself."""

    # SmtpNotifier leaves template_fields unannotated, so mypy pins it to exactly its 11 names
    template_fields = (*SmtpNotifier.template_fields, "text_content")  # type: ignore[assignment]  # base unannotated

    def __init__(self, kind: str = "mail", *, to: str = "{{ mail.to | join(', ') }}",
                 subject: str = "{{ mail.subject }}", smtp_conn_id: str = "{{ mail.smtp_conn_id }}",
                 html_content: str = HTML_TEMPLATE, text_content: str = TEXT_TEMPLATE,
                 mime_subtype: str = "alternative", **kw):
        super().__init__(to=to, subject=subject, smtp_conn_id=smtp_conn_id, html_content=html_content,
                         mime_subtype=mime_subtype, **kw)
        self.kind = kind
        self.text_content = text_content

    @property
    def hook(self) -> SmtpHook:   # one per send: the connection id is a template rendered per mail
        hook = _TextAndHtmlSmtpHook(smtp_conn_id=self.smtp_conn_id, auth_type=self.auth_type)
        hook.text_content = self.text_content
        return hook

    def __call__(self, context) -> None:
        mail = context.get("mail")
        if mail is None:
            mail = task_mail(context, self.kind)
            if mail is None:
                return
        mail = mail_without_trigger_text(mail, context)
        if not mail.recipients.to:
            log.info("eagleflow mail not sent (no recipients configured: watchdog.alert_emails / the "
                     "alert_emails Param): %s", mail.subject)
            return
        one = copy.copy(self)   # rendering replaces the templates: keep ours for the next mail
        # every header value through one helper: a node's text with CR/LF must not write headers or the body
        one.custom_headers = {k: header_text(v) for k, v in {**(self.custom_headers or {}), **mail.headers}.items()}
        BaseNotifier.__call__(one, {**context, "mail": mail.as_context()})
        log.info("eagleflow mail sent to %s: %s", ", ".join(mail.recipients.to), mail.subject)


def send_mail(context: Context, mail: Mail) -> None:
    """Send one mail now (from inside a task)."""
    EagleflowNotifier()({**context, "mail": mail})


def explaining_links(recipients: Recipients, context: Context) -> tuple[tuple[str, str], ...]:
    """The pages that explain a run's mail, for a person woken by it: the GPU view (the node's GPUs and processes,
    every watched job's progress, the open incidents: what gpu_node_health's mails link to), the run report (when
    the run's DAG writes one: written when the run ends, whatever it did) and the task's log. Links start at the
    deployment's base URL (``airflow_base_url``: Airflow's [api] base_url, else the config's)."""
    base = recipients.base_url
    links: list[tuple[str, str]] = []
    if base:
        links.append(("GPU view (GPUs, running jobs, open incidents)", base + GPU_VIEW_ROUTE))
        ti = context["ti"]
        dag = context.get("dag") or getattr(context.get("task"), "dag", None)
        if REPORT_TASK_ID in (getattr(dag, "task_ids", None) or ()):
            links.append(("Run report (written when the run ends)", base + report_url(ti.dag_id, ti.run_id)))
    links.append(("Task log", task_log_url(base, context)))
    return tuple(links)


def _where(ti) -> str:
    mi = getattr(ti, "map_index", -1)
    return f"task {ti.task_id}" + (f"[{mi}]" if mi not in (None, -1) else "")


def task_mail(context: Context, kind: str) -> Mail | None:
    """The mail for a failed or retried task, in words right for that task; None when none is due."""
    ti = context["ti"]
    exc = context.get("exception")
    if isinstance(exc, (ConsequentialFailure, AlreadyMailed, NotMailed)):
        log.info("eagleflow %s mail for %s not sent: %s", kind, ti.task_id, exc)
        return None
    try:
        recipients = Recipients.of_run(context)
    except Exception as e:  # a broken config must not hide the failure it accompanies
        log.error("eagleflow %s mail not sent: the run's config cannot be read: %s", kind, e)
        return None
    task = context.get("task")
    try_number = getattr(ti, "try_number", 1)
    if isinstance(exc, StallDetected):
        subject, evidence = exc.subject, exc.diagnosis
    else:
        word = "RETRYING" if kind == "retry" else "FAILED"
        subject = f"[eagleflow] {word} {_where(ti)} of {ti.dag_id}"
        evidence = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception recorded"
    if kind == "retry":
        delay = getattr(task, "retry_delay", None)
        when = f" in {int(delay.total_seconds())} s" if isinstance(delay, timedelta) else ""
        tries = getattr(ti, "max_tries", None)
        next_step = (f"Airflow retries it{when} (try {try_number} failed"
                     + (f" of {tries + 1}" if isinstance(tries, int) else "") + "). "
                     + (getattr(task, "retry_advice", "") or ""))
    else:
        next_step = (f"No retries left (try {try_number}): this is the final failure. "
                     + (getattr(task, "failure_advice", "") or "A person must act."))
    return Mail(recipients, subject, evidence, where=f"{_where(ti)} of DAG {ti.dag_id}, run {ti.run_id}.",
                next_step=next_step.strip(), links=explaining_links(recipients, context))


def incident_thread(incident_id: str) -> str:
    """The Message-ID of an incident's first mail; its later mails answer it, so a mail client shows one thread.

    Ids are checked where a node's answer is parsed (``watchdog.incidents.incident_id``); one that is not a plain
    token anyway (a mail kept from before that check) is threaded by its digest, never written into the header."""
    token = str(incident_id)
    if not INCIDENT_ID.fullmatch(token):
        token = "h" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"<eagleflow-incident-{token}@eagleflow>"


def _cause_words(cause: str, job: str) -> str:
    """A cause in a subject: the server cause named as the job's phase names its server (a generation shard's
    is the generation server, not "capture server")."""
    kind = kind_of_job(job)
    if cause == "capture_server" and kind is not None:
        return kind.server
    return cause.replace("_", " ")


def stall_subject(event: EventPayload) -> str:
    """The subject of a fault the watch is recovering from: STALLED, whatever the verdict's word.

    The verdict of a shard whose server was killed is "failed" (its request failed) or "dead", but the
    task has not failed: the watch restarts what the cause names. FAILED is kept for a try that really fails
    (the task callbacks' mails); the verdict and the cause follow in brackets.
    """
    subject = event.get("subject") or "[eagleflow] STALLED"
    verdict = str(event.get("verdict") or "stalled")
    if verdict != "stalled":
        subject = subject.replace(f"[eagleflow] {verdict.upper()} ", "[eagleflow] STALLED ", 1)
        cause = _cause_words(str(event.get("cause") or ""), str(event.get("job") or ""))
        subject += f" ({verdict}{': ' + cause if cause else ''})"
    return subject


def close_of_stall(event: EventPayload) -> IncidentClose:
    """What the next watch of the job that mailed a stall needs to mail its end."""
    return IncidentClose(kind="stall", id=stall_id(event), subject=stall_subject(event),
                         since=float(event.get("detected_at") or event.get("observed_at") or 0),
                         done=int(event.get("done") or 0))


def stall_id(event: EventPayload) -> str:
    """The stall's thread: a shard's incident on the node; the trainer (one per run, no incident book) its own."""
    inc = event.get("incident")
    if inc:
        return str(inc.get("incident"))
    return f"stall-{float(event.get('detected_at') or event.get('observed_at') or 0):.3f}"


def close_of_outage(event: EventPayload) -> IncidentClose | None:
    """The same for a node outage, when this watch is the one that mailed it."""
    if not event.get("mail"):
        return None
    return IncidentClose(kind="outage", id=outage_id(event), subject=event.get("subject") or "",
                         since=float(event["since"]))


def outage_id(event: EventPayload) -> str:
    return f"outage-{float(event['since']):.3f}"


def stall_mail(context: Context, event: EventPayload, recipients: Recipients) -> Mail:
    """The one mail of a stall incident (a shard's) or of a trainer's fault, from the watch's event."""
    inc = event.get("incident")
    if inc:
        shards = inc.get("shards") or {}
        evidence = "\n".join([
            event.get("diagnosis") or "", "",
            f"incident {inc.get('incident')} (cause {event.get('cause')}); shards in it so far: "
            f"{', '.join(inc.get('incident_shards') or []) or '-'}; shards that join later get no mail",
            "stored samples per shard (from the manifests): "
            + ", ".join(f"shard {k}: {v}" for k, v in sorted(shards.items(), key=lambda kv: int(kv[0])))])
        next_step = ("The watchdog is recovering it now, in the same task try (no Airflow retry): it restarts what "
                     "the cause names (the capture server once per incident, or the worker) and the shard resumes "
                     "from its manifest; the task log shows the outcome; one more mail when samples are stored again.")
    else:
        evidence = event.get("diagnosis") or ""
        next_step = ("The watchdog is recovering it now, in the same task try (no Airflow retry): it restarts what "
                     "the cause names (the run's store, or the trainer, which resumes from its last checkpoint); "
                     "the task log shows the outcome; one more mail when training passes this step again.")
    ti = context["ti"]
    return Mail(
        recipients, stall_subject(event), evidence, headers={"Message-ID": incident_thread(stall_id(event))},
        where=f"{_where(ti)} of DAG {ti.dag_id}, run {ti.run_id}.", next_step=next_step,
        links=explaining_links(recipients, context))


def unreachable_mail(context: Context, event: EventPayload, recipients: Recipients) -> Mail:
    """The one mail of a node outage: sent by the watch that first found the node unreachable."""
    ti = context["ti"]
    return Mail(
        recipients, event.get("subject") or "[eagleflow] UNREACHABLE node", event.get("diagnosis") or "",
        headers={"Message-ID": incident_thread(outage_id(event))},
        where=f"{_where(ti)} of DAG {ti.dag_id}, run {ti.run_id}.",
        next_step=("The control plane cannot reach the node (network or its sshd). This is not a verdict on the "
                   "job: its detached processes keep running there and nothing was restarted. The watch keeps "
                   "reconnecting and the task goes on when the node answers; one more mail when it does."),
        links=explaining_links(recipients, context))


def incident_over_mail(context: Context, event: EventPayload, close: IncidentClose,
                       recipients: Recipients) -> Mail:
    """The last mail of a stall or outage this task mailed (``close``): samples are stored again / the node answers."""
    took = duration(float(event.get("observed_at") or 0) - close.since)
    job, node = event.get("job") or "the job", event.get("node") or "its node"
    if close.kind == "outage":
        subject = f"[eagleflow] REACHABLE again: {job} on {node}, {took} after it stopped answering"
        next_step = "The outage is over; the watch goes on with the progress made meanwhile."
    else:
        again = (f"{unit_of_job(str(job))} stored again" if kind_of_job(str(job)) is not None
                 else "steps done again")   # the trainer, past the step where it stalled
        subject = (f"[eagleflow] RECOVERED {job} on {node}: {again} "
                   f"({event.get('done')}/{event.get('total')}), {took} after the stall was detected")
        next_step = "The incident is over; the watch goes on."
    ti = context["ti"]
    thread = incident_thread(close.id)
    return Mail(
        recipients, subject, f"{event.get('summary') or ''}\n\nThis closes: {close.subject}",
        where=f"{_where(ti)} of DAG {ti.dag_id}, run {ti.run_id}.", next_step=next_step,
        links=explaining_links(recipients, context),
        headers={"In-Reply-To": thread, "References": thread})


# A watch's mail that cannot be sent (SMTP refusing DATA, connection refused) never fails the task: it is
# kept with the watch (``pending_mails``, carried by every trigger like ``close_incidents``) and tried again
# at later looks, backed off 5, 10, 20 ... s up to 10 min, in order: one mail per incident once the server is back.
MAIL_RETRY_FIRST_S = 5.0
MAIL_RETRY_MAX_S = 600.0
_NOT_KEPT = ("pending_mails", "close_incidents", "still_open", "closed")   # the watch's own state, not the mail's


def _mail_of(context: Context, item: PendingMail) -> Mail:
    recipients = Recipients.of_run(context)
    if item.kind == "stall":
        return stall_mail(context, item.event_payload(), recipients)
    if item.kind == "unreachable":
        return unreachable_mail(context, item.event_payload(), recipients)
    if item.close is None:
        raise ValueError(f"a pending 'over' mail without the incident it closes: {item!r}")
    return incident_over_mail(context, item.event_payload(), item.close, recipients)


def mail_or_keep(context: Context, pending: list[PendingMail], kind: str, event: EventPayload,
                 close: IncidentClose | None = None) -> list[PendingMail]:
    """Send a watch's mail (kind stall, unreachable or over) now, behind any still pending; returns those
    still pending. A send that fails is logged and kept for a later look, never raised."""
    item = PendingMail(kind=kind, event={k: v for k, v in event.items() if k not in _NOT_KEPT}, close=close)
    return send_pending(context, [*pending, item])


def send_pending(context: Context, pending: list[PendingMail], now: float | None = None,
                 force: bool = False) -> list[PendingMail]:
    """Send the watch's pending mails in order, from the first once it is due (``force``: now, the task's last
    chance); returns those still pending. A failed send ends the round (the server is down: the rest wait
    behind it, no flood) and backs that mail off."""
    now = time.time() if now is None else now
    left = list(pending)
    while left:
        head = left[0]
        if not force and head.next_at > now:
            break
        try:
            send_mail(context, _mail_of(context, head))
        except Exception as e:  # SMTP refusing, connection refused, a broken connection id: the mail waits
            tries = head.tries + 1
            wait = min(MAIL_RETRY_MAX_S, MAIL_RETRY_FIRST_S * 2 ** (tries - 1))
            left[0] = head.model_copy(update={"tries": tries, "next_at": now + wait,
                                               "error": f"{type(e).__name__}: {e}"[:500]})
            log.warning("eagleflow %s mail not sent (try %d, %d mail(s) waiting): %s: %s; the watch goes on and "
                        "tries again in %.0f s", head.kind, tries, len(left), type(e).__name__, e, wait)
            break
        if head.tries:
            log.info("eagleflow %s mail sent after %d failed tries", head.kind, head.tries)
        left.pop(0)
    return left


def log_unsent(pending: list[PendingMail]) -> None:
    """The task ends with mails its SMTP server never took: say which, in the task log."""
    for item in pending:
        subject = item.event.get("subject") or item.kind
        log.error("eagleflow %s mail never sent (%d tries, last: %s): %s", item.kind, item.tries,
                  item.error or "not tried", subject)


def pipeline_failure_callbacks(retry_mail: bool = True) -> dict:
    """default_args entries: mail on the final failure and (``retry_mail``) on every retry."""
    out: dict[str, Any] = {"on_failure_callback": EagleflowNotifier("failure")}
    if retry_mail:
        out["on_retry_callback"] = EagleflowNotifier("retry")
    return out
