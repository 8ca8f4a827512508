"""Alert emails on a stall, a retry and a final failure, through the SMTP provider's notifier.

Recipients and the SMTP connection come from the run's own config (its
``alert_emails`` Param or ``watchdog.alert_emails``, ``watchdog.smtp_conn_id``),
read when the callback fires, so a run triggered with other recipients mails
them. No recipients: the callback logs that and sends nothing.

A stall arrives as ``StallDetected`` (subject and diagnosis from the
watchdog); any other failure is mailed with its exception text.
"""
from __future__ import annotations

import html
import logging
from typing import Any
from urllib.parse import quote

from airflow.providers.smtp.notifications.smtp import SmtpNotifier
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.watchdog.diagnosis import StallDetected

log = logging.getLogger(__name__)


def task_log_url(base_url: str, context: dict[str, Any]) -> str:
    """The task instance's log page in the Airflow 3 UI."""
    ti = context["ti"]
    url = (f"{base_url.rstrip('/')}/dags/{quote(ti.dag_id, safe='')}/runs/{quote(ti.run_id, safe='')}"
           f"/tasks/{quote(ti.task_id, safe='')}")
    map_index = getattr(ti, "map_index", -1)
    if map_index is not None and map_index >= 0:
        url += f"/mapped/{map_index}"
    return url + f"?try_number={getattr(ti, 'try_number', 1)}"


def airflow_base_url(fallback: str) -> str:
    """Where a person reaches this Airflow: its configured ``[api] base_url``; ``fallback`` only when unset."""
    try:
        from airflow.configuration import conf
        url = conf.get("api", "base_url", fallback=None)
    except Exception:  # no Airflow config readable: the run's own setting
        url = None
    return (url or fallback).rstrip("/")


def alert_content(context: dict[str, Any], kind: str, base_url: str) -> tuple[str, str]:
    """(subject, html body) for a failed or retried task."""
    ti = context["ti"]
    exc = context.get("exception")
    try_number = getattr(ti, "try_number", 1)
    max_tries = getattr(ti, "max_tries", None)
    where = f"task {ti.task_id}" + (f"[{ti.map_index}]" if getattr(ti, "map_index", -1) not in (None, -1) else "")
    if isinstance(exc, StallDetected):
        subject, text = exc.subject, exc.diagnosis
    else:
        subject = f"[eagleflow] FAILED {where} of {ti.dag_id}"
        text = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception recorded"
    if kind == "incident":
        next_step = ("The watchdog is recovering it now, in the same task try (no Airflow retry): it restarts "
                     "what the cause names (the capture server once per incident, or the worker) and the shard "
                     "resumes from its manifest; the task log shows the outcome.")
    elif kind == "unreachable":
        next_step = ("The control plane cannot reach the node (network or its sshd). This is not a verdict on the "
                     "job: its detached processes keep running there and nothing was restarted. The watch keeps "
                     "reconnecting and the task goes on when the node answers; no further mail for this outage.")
    elif kind == "retry":
        next_step = (f"Airflow retries it (try {try_number} failed; up to {max_tries} retries): the retry restarts "
                     "an unhealthy capture server once and resumes the shard from its manifest.")
    else:
        next_step = f"No retries left (try {try_number}): this is the final failure; a person must act."
    url = task_log_url(base_url, context)
    body = (f"<p><b>{html.escape(subject)}</b></p>"
            f"<p>{html.escape(where)} of DAG {html.escape(ti.dag_id)}, run {html.escape(ti.run_id)}. "
            f"{html.escape(next_step)}</p>"
            f"<pre>{html.escape(text)}</pre>"
            f"<p>Task log: <a href=\"{html.escape(url)}\">{html.escape(url)}</a></p>")
    return subject, body


class ConsequentialFailure(AirflowFailException):
    """A task that fails only because an earlier one did: the run must end failed, but one alert is enough."""


class PipelineAlertNotifier(SmtpNotifier):
    """SmtpNotifier whose recipients, connection, subject and body are decided per run when it fires."""

    def __init__(self, kind: str):
        super().__init__(to=[], from_email=None, subject=None, html_content=None)
        self.kind = kind

    def notify(self, context) -> None:
        from eagleflow.airflow.runtime import RunContext
        if isinstance(context.get("exception"), ConsequentialFailure):
            log.info("eagleflow alert (%s) for %s not sent: %s", self.kind, context["ti"].task_id,
                     context["exception"])
            return
        try:
            params = dict(context.get("params") or {})
            if not params.get("config_path") and params.get("config_paths"):
                params["config_path"] = params["config_paths"][0]  # DAGs that look at several nodes
            # the run's frozen config; the Params only when nothing was frozen (its first task failed)
            cfg = (RunContext.frozen_in(context) or RunContext.from_params(params, context["run_id"])).cfg
        except Exception as e:  # a broken config must not hide the failure it accompanies
            log.error("eagleflow alert (%s) not sent: the run's config cannot be read: %s", self.kind, e)
            return
        wd = cfg.watchdog
        if not wd.alert_emails:
            log.info("eagleflow alert (%s) for %s: no recipients configured (watchdog.alert_emails / the "
                     "alert_emails Param); nothing sent", self.kind, context["ti"].task_id)
            return
        self.to = list(wd.alert_emails)
        self.smtp_conn_id = wd.smtp_conn_id
        self.subject, self.html_content = alert_content(context, self.kind, airflow_base_url(wd.airflow_base_url))
        self.__dict__.pop("hook", None)  # the cached hook was built for the default connection
        super().notify(context)
        log.info("eagleflow alert (%s) sent to %s: %s", self.kind, ", ".join(self.to), self.subject)


def send_incident_alert(context: dict[str, Any], event: dict[str, Any]) -> None:
    """The one mail of an incident (sent by the shard whose watch opened it, before the recovery runs)."""
    inc = event.get("incident") or {}
    shards = inc.get("shards") or {}
    lines = [event.get("diagnosis") or "", "",
             f"incident {inc.get('incident')} (cause {event.get('cause')}); shards in it so far: "
             f"{', '.join(inc.get('incident_shards') or []) or '-'}; shards that join later get no mail",
             "stored samples per shard (from the manifests): "
             + ", ".join(f"shard {k}: {v}" for k, v in sorted(shards.items(), key=lambda kv: int(kv[0])))]
    exc = StallDetected(event.get("subject") or "[eagleflow] STALLED", "\n".join(lines))
    PipelineAlertNotifier("incident").notify({**context, "exception": exc})


def send_unreachable_alert(context: dict[str, Any], event: dict[str, Any]) -> None:
    """The one mail of a node outage: sent by the watch that first found the node unreachable."""
    PipelineAlertNotifier("unreachable").notify(
        {**context, "exception": StallDetected(event.get("subject") or "[eagleflow] UNREACHABLE node",
                                               event.get("diagnosis") or "")})


def pipeline_failure_callbacks() -> dict:
    """default_args entries: mail on every retry and on the final failure."""
    return {"on_failure_callback": PipelineAlertNotifier("failure"),
            "on_retry_callback": PipelineAlertNotifier("retry")}
