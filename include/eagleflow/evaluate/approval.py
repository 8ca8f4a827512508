"""A person's approval before a draft the gate passed is promoted (``eval.approval``); no Airflow here.

The evaluation (:func:`.run.evaluate_run`) asks :func:`needs_approval`: when a person must approve, the
draft is not promoted yet and eval.json's ``approval`` says ``pending``. Whoever asks the person (the DAG's
human-in-the-loop task) shows :func:`approval_body`, then records the answer with :func:`.run.decide`
(``eagleflow evaluate-decision`` on the node): ``approve`` promotes the draft the existing way
(``promoted.json``, :func:`.run.promote`), ``reject`` keeps the draft in service; either way eval.json says
who decided, why and when, and the run report shows it (:func:`.run.decide`). An unanswered approval ends as eval.approval_on_timeout
says (``timeout``). A draft is never promoted over a draft in service it was not compared with: when
promoted.json changed while the person looked, the approval promotes nothing and says so.
"""
from __future__ import annotations

import time

from eagleflow.config import PipelineConfig

PENDING, APPROVED, REJECTED = "pending", "approved", "rejected"
NOT_NEEDED = "not_needed"
DECISIONS = ("approve", "reject", "timeout")
MAX_BY, MAX_WHY = 200, 2000


class ApprovalError(ValueError):
    """The run's evaluation cannot take this decision (no pending approval, or one decided otherwise)."""


def needs_approval(cfg: PipelineConfig, passed: bool, baseline_source: str) -> bool:
    """Whether a person must approve this draft before it is promoted: never one the gate refused."""
    mode = cfg.eval.approval
    if not passed or mode == "none":
        return False
    if mode == "always":
        return True
    return in_service_compared(baseline_source)   # on_improvement: it would replace a draft in service


def in_service_compared(baseline_source: str) -> bool:
    """Whether the baseline the draft was compared with is the draft in service (promoted.json)."""
    return baseline_source.startswith("the draft in service")


def pending(cfg: PipelineConfig) -> dict:
    """eval.json's ``approval`` while a person has not answered."""
    ec = cfg.eval
    return {"mode": ec.approval, "state": PENDING, "timeout_h": ec.approval_timeout_h,
            "on_timeout": ec.approval_on_timeout,
            "asked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def clean_text(text: object, limit: int) -> str | None:
    """A person's free text as stored: printable, one paragraph, bounded (it is shown on pages and in logs)."""
    if text is None:
        return None
    s = "".join(c if c.isprintable() else " " for c in str(text)).strip()
    return s[:limit] or None


def _md(text: object) -> str:
    """Text in a Markdown table cell: no markup, no HTML, no cell break."""
    s = str(text)
    for ch in "\\`*_[]<>|#":
        s = s.replace(ch, "\\" + ch)
    return s.replace("\n", " ")


def _code(text: object) -> str:
    """Text as a Markdown code span (shown as is: no markup, no HTML)."""
    return "`" + str(text).replace("`", "'").replace("\n", " ") + "`"


def approval_body(summary: dict) -> str:
    """The evaluation table a person approves or rejects, in Markdown: acceptance length per configuration and
    prompt set, against the draft it was compared with (the draft in service). ``summary``: the evaluation's
    answer with its ``table`` (:func:`.run.acceptance_table`)."""
    baseline = summary.get("baseline_draft")
    lines = [f"**Draft** {_code(summary.get('draft'))} of run {_code(summary.get('run_id'))} passed the promotion "
             "gate (every output lossless).", ""]
    lines.append(f"**In service**: {_code(baseline)}" if baseline else
                 f"**In service**: none ({_md(summary.get('baseline_source') or 'no baseline')})")
    lines += ["", "| configuration | prompt set | prompts | acceptance length | in service | difference | "
              "speed-up |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in summary.get("table") or []:
        acc, base = r["accept_length"], r.get("baseline_accept_length")
        lines.append(f"| {_md(r['config'])} | {_md(r['prompt_set'])}"
                     + (" (decides the gate)" if r.get("decides_gate", True) else "")
                     + f" | {r['prompts']} | {acc:.3f} | " + (f"{base:.3f} | {acc - base:+.3f}" if base is not None
                                                                else "- | -")
                     + " | " + (f"{r['speedup']:.2f}" if r.get("speedup") is not None else "-") + " |")
    lines += ["", f"Figures: {_code(summary.get('eval_file'))}.",
              "", "**Approve** promotes this draft (promoted.json names it). **Reject** keeps the draft in "
              "service; say why below: the run report records who rejected it and why."]
    return "\n".join(lines)


def decision_line(summary: dict) -> str:
    """One sentence: what became of the draft and who decided (the task log, the report)."""
    a = summary.get("approval") or {}
    who = a.get("by") or ("nobody (timed out)" if a.get("decision") == "timeout" else "unknown")
    why = f": {a['why']}" if a.get("why") else ""
    if a.get("state") == APPROVED:
        return f"approved by {who}{why}; promoted {summary.get('draft')}"
    if a.get("state") == REJECTED:
        return (f"{'rejected' if a.get('decision') != 'approve' else 'approved'} by {who}{why}; not promoted, the "
                f"draft in service stays" + (f" ({a['stale']})" if a.get("stale") else ""))
    if a.get("state") == PENDING:
        return "waiting for a person's approval; not promoted yet"
    return "promoted by the gate" if summary.get("promoted") else "not promoted"
