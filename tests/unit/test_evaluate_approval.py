"""eval.approval's core (eagleflow.evaluate.approval, run.decide), without Airflow: who is asked, what a person
sees, and what approve / reject / timeout do to promoted.json and eval.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.evaluate.approval import PENDING, approval_body, decision_line, needs_approval, pending
from eagleflow.evaluate.run import EVAL_FILE, PROMOTED_FILE, ApprovalError, acceptance_table, decide, promote
from eagleflow.layout import RunLayout


def _cfg(root: Path, **eval_):
    return load_config(data={"run_root": str(root / "runs"), "target_model": str(root / "target"),
                             "node": {"name": "local", "has_gpu": False},
                             "corpus": {"sources": [{"name": "a", "path": str(root / "a.jsonl")}]},
                             "eval": {"approval": "always", **eval_}})


def _export(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def _row(config, prompt_set, acc, base):
    return {"config": config, "prompt_set": prompt_set, "prompts": 2, "decides_gate": prompt_set == "held_out",
            "draft": {"accept_length": acc, "speedup": 1.4, "lossless": True, "accepted_at_position": [0.5]},
            **({"baseline": {"accept_length": base}} if base is not None else {})}


def _evaluated(cfg, run_id: str, in_service: Path | None, *, approval=None) -> RunLayout:
    """eval.json as `eagleflow evaluate` leaves it for a draft the gate passed, waiting for a person."""
    layout = RunLayout.for_run(cfg, run_id)
    draft = _export(Path(str(layout.draft_dir)) / "export")
    summary = {"run_id": run_id, "draft": str(draft), "passed": True, "refused": [],
               "baseline_draft": str(in_service) if in_service else None,
               "baseline_source": "the draft in service, x" if in_service else "no promoted.json in run_root",
               "eval_file": str(Path(str(layout.run_dir)) / EVAL_FILE),
               "results": [_row("3/1/4", "held_out", 1.8, 1.6 if in_service else None),
                           _row("3/1/4", "mt_bench", 1.7, 1.7 if in_service else None)],
               "approval": approval or pending(cfg)}
    Path(summary["eval_file"]).write_text(json.dumps(summary))
    return layout


def _served(cfg) -> str | None:
    p = Path(str(cfg.resolve(cfg.run_root))) / PROMOTED_FILE
    return json.loads(p.read_text())["draft"] if p.exists() else None


def test_who_is_asked():
    for mode, passed, source, asked in [("none", True, "the draft in service, x", False),
                                        ("always", False, "the draft in service, x", False),
                                        ("always", True, "no promoted.json in run_root", True),
                                        ("on_improvement", True, "no promoted.json in run_root", False),
                                        ("on_improvement", True, "the draft in service, x", True),
                                        ("on_improvement", True, "eval.baseline_draft", False)]:
        cfg = type("C", (), {"eval": type("E", (), {"approval": mode})()})()
        assert needs_approval(cfg, passed, source) is asked, (mode, passed, source)


def test_approve_promotes_reject_keeps_the_draft_in_service(tmp_path):
    cfg = _cfg(tmp_path)
    first = _evaluated(cfg, "first", None)
    summary = decide(cfg, first, "approve", by="alice", why="looks good")
    assert summary["approval"]["state"] == "approved" and summary["approval"]["by"] == "alice"
    assert _served(cfg) == summary["draft"]
    assert json.loads(Path(summary["eval_file"]).read_text())["approval"]["why"] == "looks good"
    assert decide(cfg, first, "approve", by="alice")["approval"]["by"] == "alice"   # a retried task: same answer
    with pytest.raises(ApprovalError, match="already approved"):
        decide(cfg, first, "reject", by="bob")

    in_service = Path(_served(cfg))
    second = _evaluated(cfg, "second", in_service)
    summary = decide(cfg, second, "reject", by="bob", why="MT-Bench\x1b[31m flat\nagainst in service")
    a = json.loads(Path(summary["eval_file"]).read_text())["approval"]
    assert a["state"] == "rejected" and a["by"] == "bob" and a["why"] == "MT-Bench [31m flat against in service"
    assert _served(cfg) == str(in_service) and "promoted" not in summary
    assert decision_line(summary).startswith("rejected by bob: MT-Bench")


def test_timeout_keeps_or_promotes_as_configured(tmp_path):
    keep = _cfg(tmp_path)
    layout = _evaluated(keep, "t1", None)
    s = decide(keep, layout, "timeout")
    assert s["approval"]["state"] == "rejected" and "approval_timeout_h 72.0" in s["approval"]["why"]
    assert _served(keep) is None
    promote_cfg = _cfg(tmp_path, approval_on_timeout="promote", approval_timeout_h=1)
    layout = _evaluated(promote_cfg, "t2", None)
    assert decide(promote_cfg, layout, "timeout")["approval"]["state"] == "approved"
    assert _served(promote_cfg).endswith("/t2/draft/export")


def test_an_approval_over_a_draft_in_service_that_changed_meanwhile_promotes_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    layout = _evaluated(cfg, "late", None)               # compared with nothing in service ...
    other = _evaluated(cfg, "other", None)
    promote(cfg, other, json.loads((Path(str(other.run_dir)) / EVAL_FILE).read_text()))   # ... then one was
    s = decide(cfg, layout, "approve", by="alice")
    assert s["approval"]["state"] == "rejected" and "changed while the approval waited" in s["approval"]["stale"]
    assert _served(cfg).endswith("/other/draft/export")


def test_no_pending_approval_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    layout = _evaluated(cfg, "auto", None, approval={"mode": "none", "state": "not_needed"})
    with pytest.raises(ApprovalError, match="no approval is pending"):
        decide(cfg, layout, "approve")
    with pytest.raises(ApprovalError, match="decision"):
        decide(cfg, layout, "maybe")


def test_the_body_shows_the_table_against_the_draft_in_service(tmp_path):
    cfg = _cfg(tmp_path)
    layout = _evaluated(cfg, "b", tmp_path / "runs" / "old" / "draft" / "export")
    summary = json.loads((Path(str(layout.run_dir)) / EVAL_FILE).read_text())
    summary["results"][1]["prompt_set"] = "<img src=x>|x"
    body = approval_body({**summary, "table": acceptance_table(summary["results"])})
    assert "| 3/1/4 | held\\_out (decides the gate) | 2 | 1.800 | 1.600 | +0.200 | 1.40 |" in body
    assert "\\<img src=x\\>\\|x" in body and "<img" not in body.replace("\\<img", "")
    assert "**In service**: `" + str(tmp_path / "runs" / "old" / "draft" / "export") + "`" in body
    assert summary["approval"]["state"] == PENDING
