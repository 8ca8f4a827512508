"""gpu_node_health's check: every configured node read from outside any run, its findings kept as incidents.

Each check stores every node's status in Airflow's metadata DB (the GPU view and
/metrics read it) and turns what it found into incidents
(eagleflow.health.incidents): one mail when one opens, reminders that back
off, one mail when a check no longer finds it. The task fails (red in the grid,
no retry, no extra mail) while an incident is open; the check itself failing
(not a finding) goes to the DAG's failure mail. A ``config_paths`` entry that is
missing or refused is a task error naming it, never an incident: one a trigger
chose is not mailed at all (HealthConfigPathRefused), one the deployment names
itself is the check failing (HealthConfigMissing, the failure mail).
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.alerts import (GPU_VIEW_ROUTE, AlreadyMailed, Mail, NotMailed, Recipients, airflow_base_url,
                                      incident_thread, send_mail, task_log_url)
from eagleflow.airflow.runtime import checked_config_path, deployment_config_files, resolve_config_path
from eagleflow.airflow.status_variables import variable_status_store
from eagleflow.config import ConfigError, load_config
from eagleflow.gpu.probes import probe_for
from eagleflow.health import incidents as hi
from eagleflow.health.airflow_health import HEALTH_PATH, AirflowHealth, fetch
from eagleflow.health.durations import duration
from eagleflow.health.node_activity import read_node_activity
from eagleflow.health.rules import HealthRules, assess
from eagleflow.health.status_doc import error_kind
from eagleflow.health.status_store import StatusStore, history_retention_s
from eagleflow.nodes import node_from_config
from eagleflow.settings import positive_number

CONFIG_PATHS_FIELD = "gpu_node_health Param config_paths"


class HealthIncidentsOpen(AlreadyMailed):
    """gpu_node_health found something a person must look at; each incident was mailed when it opened."""


class HealthConfigMissing(AirflowFailException):
    """A config the deployment names itself ($EAGLEFLOW_HEALTH_CONFIGS / $EAGLEFLOW_CONFIG) is missing or
    refused: the check itself is broken (its words are the deployment's own), mailed by the failure callback."""


class HealthConfigPathRefused(NotMailed):
    """A config_paths entry a trigger chose is missing or refused: the run's own error, never an incident or a
    mail (whoever may trigger must not make the deployment mail words of their choosing)."""


def usable_config_path(path: str):
    """The config file a ``config_paths`` entry names, checked before it is read: inside the deployment's config
    folders (or named by the deployment), an existing file this worker may read; else ConfigError naming it."""
    full = checked_config_path(path, CONFIG_PATHS_FIELD)
    if not full.is_file():
        raise ConfigError(f"{CONFIG_PATHS_FIELD} entry {str(path)!r}: no config file at {full}; name an existing "
                          "config in the deployment's config folders (see configs/), or remove the entry")
    try:
        with open(full, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{CONFIG_PATHS_FIELD} entry {str(path)!r}: {full} cannot be opened "
                          f"({e.strerror or type(e).__name__}); make it readable by the Airflow worker's user") from None
    return full


def named_by_deployment(path: str) -> bool:
    try:
        real = resolve_config_path(path).resolve()
        return real in {f.resolve() for f in deployment_config_files()}
    except (OSError, ValueError, TypeError):
        return False


def health_rules(params: dict):
    """The check's Params, each checked: 0 or a negative number is refused with its name, never defaulted."""
    where = "gpu_node_health Params"
    try:
        rules = HealthRules(memory_threshold_mib=int(positive_number(
            "memory_threshold_mib", params.get("memory_threshold_mib"), where=where, unit="MiB")),
            window_s=positive_number("window_s", params.get("window_s"), where=where, unit="seconds"))
        unreachable_after_s = positive_number("unreachable_after_s", params.get("unreachable_after_s"),
                                              where=where, unit="seconds")
        remind_after_s = positive_number("remind_after_s", params.get("remind_after_s"), where=where,
                                         unit="seconds")
    except ValueError as e:   # the same Params would fail the retry the same way
        raise AirflowFailException(f"{e}. Trigger the DAG with a valid value (see its Params form).") from None
    return rules, unreachable_after_s, remind_after_s


class GpuNodeHealthOperator(BaseOperator):
    """Snapshot every configured node; open, remind and resolve incidents for what it finds.

    Findings: a GPU holds more than ``memory_threshold_mib`` at 0 % utilisation
    for longer than ``window_s`` while no eagleflow job is registered on it (one
    incident per node); its uncorrected ECC count rose since the last check (a
    notice per rise); a node unreachable for ``unreachable_after_s``; a config
    that exists but cannot be used (a missing or refused path is a task error instead, after the other nodes
    are checked). Reminders after ``remind_after_s``, then doubling.
    """

    ui_color = "#fff3e0"
    failure_advice = ("This is the health check itself failing, not a finding on a node (findings are mailed as "
                      "incidents); the next scheduled check runs anyway.")

    def __init__(self, *, status_dir: str | None = None, interval_s: float | None = None, **kw):
        super().__init__(**kw)
        self.status_dir = status_dir  # None: Airflow's metadata DB (Variables), where the API server reads them
        self.interval_s = interval_s  # the DAG's schedule, so the GPU view can tell when a check is late

    def _store(self):
        if self.status_dir:
            return StatusStore(self.status_dir)
        return variable_status_store()

    def _check_node(self, cfg, path, store, rules, status_kw, unreachable_after_s, findings: list, observed: set,
                    recipients: dict, names: set) -> int:
        """One node of a config: its activity and GPUs into the store, its findings added; 1 when its GPUs were read."""
        name = cfg.node.name
        names.add(name)
        recipients[name] = Recipients.of_config(cfg)
        node = node_from_config(cfg)
        now = time.time()
        try:  # one call for our jobs (pid records, shard progress, incidents), one for the GPUs
            activity = read_node_activity(node, str(cfg.node_state_dir()))
            snaps = probe_for(node, cfg).snapshot() if cfg.node.has_gpu else []
        except Exception as e:  # an unreadable node is itself a finding, once it lasts
            self.log.warning("node %s (%s) could not be read: %s", name, path, e)
            store.save(name, error=str(e), has_gpu=cfg.node.has_gpu, config_path=str(path), **status_kw)
            observed.add(f"link:{name}")
            findings.append(hi.unreachable_finding(name, error_kind(str(e)), unreachable_after_s))
            return 0
        finally:
            node.close()
        observed.update({f"link:{name}", f"gpus:{name}", f"watch:{name}"})
        findings.extend(hi.watch_silent_findings(name, activity.watch_alarms))
        for line in activity.skipped:   # a bad line in the node's files: said, and the node still read
            self.log.warning("node %s: %s", name, line)
        if not cfg.node.has_gpu:
            self.log.info("%s: node %s has no GPU (node.has_gpu is false); %d eagleflow process(es) live",
                          path, name, len(activity.processes))
            store.save(name, [], None, [], has_gpu=False, activity=activity, config_path=str(path), **status_kw)
            return 0
        prev = store.load(name).get("state", {})
        alerts, state = assess(name, snaps, prev, now=now, rules=rules,
                               job_pids=activity.job_pids(), any_job_alive=bool(activity.processes))
        store.save(name, snaps, state, alerts, activity=activity, config_path=str(path), now=now, **status_kw)
        for s in snaps:
            self.log.info("node %s GPU %d %s: %s/%s MiB, %s %%, %d process(es)", name, s.index, s.uuid,
                          s.memory_used_mib, s.memory_total_mib, s.utilization_pct, len(s.processes))
        held = hi.held_idle_finding(name, alerts, snaps, state, now)
        findings.extend(([held] if held else []) + hi.ecc_findings(name, alerts))
        return 1

    def execute(self, context):
        params = dict(context["params"])
        paths = params.get("config_paths") or []
        if isinstance(paths, str):
            paths = [paths]
        rules, unreachable_after_s, remind_after_s = health_rules(params)
        store = self._store()
        retention_s = history_retention_s()
        status_kw = {"interval_s": self.interval_s, "held_threshold_mib": rules.memory_threshold_mib,
                     "retention_s": retention_s}
        findings: list[hi.Finding] = []
        observed: set[str] = set()
        recipients: dict[str, Recipients] = {}
        checked = 0
        names: set[str] = set()
        refused: list[tuple[str, str]] = []   # (entry, why): a task error once the other nodes are checked
        for path in paths:
            try:
                # relative: against the project root; only the deployment's config folders (the Param is a form field)
                full = usable_config_path(path)
            except Exception as e:   # missing or refused: never an incident (no scheduled check would end it)
                self.log.error("%s entry %r refused: %s", CONFIG_PATHS_FIELD, path, e)
                refused.append((path, str(e)))
                continue
            observed.add(f"config:{path}")
            try:
                whole = load_config(full)
                # a fleet config names several nodes: each is checked in its own view (connection, state dir, GPUs)
                views = [whole.node_view(n) for n in whole.fleet_node_names()]
            except Exception as e:   # one bad config must not blind the check to the other nodes
                self.log.error("config %s cannot be read: %s", path, e)
                findings.append(hi.config_finding(str(path), str(e)))
                continue
            for cfg in views:
                checked += self._check_node(cfg, path, store, rules, status_kw, unreachable_after_s, findings,
                                            observed, recipients, names)
        for gone in store.forget_unchecked(keep=names, forget_after_s=retention_s):
            self.log.info("node %s is no longer configured and was not checked for %.0f s: removed from the GPU view",
                          gone, retention_s)

        airflow = self._airflow_health()
        store.save_extra(AIRFLOW_HEALTH_KEY, airflow)   # the GPU view's fallback when it cannot read it live
        if not airflow.get("error"):
            observed.add("airflow")
            findings += hi.airflow_findings(airflow)
        book, due = hi.step(store.incidents(), findings, observed=observed, now=time.time(),
                            remind_after_s=remind_after_s, forget_after_s=retention_s)
        store.save_incidents(book)   # before mailing: a crash mid-mail must not mail again
        everyone = _everyone(recipients.values())
        unsent = []
        for d in due:   # each incident's mail on its own: one SMTP error must not swallow the others
            self.log.warning("incident %s %s: %s", d.incident["id"], d.kind, d.subject)
            if d.kind == "opened" and d.incident.get("kind") == "watch_silent" and "mailed this already" in \
                    d.incident.get("detail", ""):
                continue   # the node's sentinel mailed it: one mail per silent watch (its end is still mailed)
            try:
                send_mail(context, incident_mail(d, recipients.get(d.incident["node"]) or everyone, context,
                                                 remind_after_s))
            except Exception as e:
                self.log.error("incident %s: %s mail not sent: %s", d.incident["id"], d.kind, e)
                unsent.append(f"{d.kind} mail of incident {d.incident['id']} ({d.subject}): {type(e).__name__}: {e}")
        if unsent:
            raise RuntimeError("gpu_node_health could not send:\n" + "\n".join(f"- {u}" for u in unsent)
                               + "\nCheck the SMTP connection (watchdog.smtp_conn_id); the incidents stay open "
                                 "in the GPU view.")
        found = {f.key for f in findings}
        open_now = [r for r in book.values() if r["state"] == "open" or (r["state"] == "notice" and r["key"] in found)]
        if refused:
            raise _refused_error(refused, len(open_now))
        if open_now:
            raise HealthIncidentsOpen("GPU node health check found:\n" + "\n".join(
                f"- {r['subject']} (incident {r['id']}, open {duration(time.time() - r['opened_at'])})"
                for r in open_now))
        return {"nodes_checked": checked, "incidents_open": 0}


    def _airflow_health(self) -> AirflowHealth:
        """Airflow's health endpoint on this deployment's API server: $EAGLEFLOW_AIRFLOW_HEALTH_URL (where the
        workers reach it, e.g. http://airflow-apiserver:8080 in docker compose), else Airflow's [api] base_url.
        {"error": ...} when neither is set or it does not answer: no part is judged then."""
        base = os.environ.get("EAGLEFLOW_AIRFLOW_HEALTH_URL") or airflow_base_url("")
        now = time.time()
        if not base:
            return {"error": "no API server named ($EAGLEFLOW_AIRFLOW_HEALTH_URL and Airflow's [api] base_url unset)",
                    "url": "", "read_at": now}
        try:
            doc = fetch(base)
        except (OSError, ValueError) as e:
            self.log.warning("Airflow health %s%s not read: %s", base, HEALTH_PATH, e)
            return {"error": f"{type(e).__name__}: {e}", "url": base + HEALTH_PATH, "read_at": now}
        self.log.info("Airflow health (%s%s): %s", base, HEALTH_PATH,
                      ", ".join(f"{k}: {(v or {}).get('status')}" for k, v in doc.items() if isinstance(v, dict)))
        # the heartbeats' ages as of the answer, not the request (a slow answer does not age them)
        return {**doc, "url": base + HEALTH_PATH, "read_at": time.time()}


AIRFLOW_HEALTH_KEY = "eagleflow.airflow_health"


def _refused_error(refused: list[tuple[str, str]], open_count: int) -> AirflowFailException:
    """The task error for config_paths entries that are missing or refused. Entries a trigger chose make it
    unmailed (HealthConfigPathRefused); only the deployment's own named configs are mailed, as the check failing."""
    ours = all(named_by_deployment(p) for p, _ in refused)
    fix = ("Fix the deployment's $EAGLEFLOW_HEALTH_CONFIGS / $EAGLEFLOW_CONFIG (the configs a scheduled check "
           "reads)" if ours else "Trigger gpu_node_health again with config_paths naming existing configs in the "
           "deployment's config folders (the scheduled check reads the deployment's own)")
    also = (f" {open_count} incident(s) are open as well (each was mailed when it opened; see the GPU view)."
            if open_count else "")
    text = (f"gpu_node_health: {len(refused)} config_paths entr{'y' if len(refused) == 1 else 'ies'} missing or "
            "refused; the other configs' nodes were checked:\n" + "\n".join(f"- {why}" for _, why in refused)
            + f"\n{fix}.{also}")
    return (HealthConfigMissing if ours else HealthConfigPathRefused)(text)


def _everyone(rs) -> Recipients | None:
    rs = list(rs)
    if not rs:
        return None
    to = tuple(dict.fromkeys(a for r in rs for a in r.to))
    return Recipients(to, rs[0].smtp_conn_id, rs[0].base_url)


def incident_mail(d, recipients: Recipients | None, context, remind_after_s: float) -> Mail:
    """The mail of one incident step; Message-ID/In-Reply-To keep an incident in one thread."""
    inc = d.incident
    recipients = recipients or Recipients((), "smtp_default", "")
    opened_at = time.time() if inc["opened_at"] is None else inc["opened_at"]
    opened = datetime.fromtimestamp(opened_at, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    thread = incident_thread(inc["id"])
    if d.kind == "opened":
        next_step = (f"One mail per incident: a reminder follows in {duration(remind_after_s)} if it is still "
                     "open, then at doubling intervals, and a 'resolved' mail when a check no longer finds it.")
        headers = {"Message-ID": thread}
    elif d.kind == "reminder":
        next_step = (f"Still open since {opened}. Reminder {inc['reminders']}; the next in "
                     f"{duration(inc['next_reminder_at'] - inc['last_mail_at'])} if it stays open.")
        headers = {"In-Reply-To": thread, "References": thread}
    elif d.kind == "resolved":
        next_step = f"Closed: opened {opened}. No further mail for it."
        headers = {"In-Reply-To": thread, "References": thread}
    else:   # notice
        next_step = "Mailed once; a further rise is mailed again."
        headers = {"Message-ID": thread}
    links = [("GPU view", recipients.base_url + GPU_VIEW_ROUTE)] if recipients.base_url else []
    if recipients.base_url:
        links.append(("Task log", task_log_url(recipients.base_url, context)))
    return Mail(recipients, f"[eagleflow] {d.subject}", d.detail, headline=d.subject,
                where=f"gpu_node_health, incident {inc['id']} ({inc['kind']}).", next_step=next_step,
                links=tuple(links), headers=headers)
