"""The run report's held-out evaluation section, from the eval.json `eagleflow evaluate` writes."""
from __future__ import annotations

import json

from eagleflow.config import load_config
from eagleflow.console.run_report import write_report
from eagleflow.layout import RunLayout


def _row(config: str, acc: float, lossless: bool = True, baseline: float | None = None) -> dict:
    d = {"accept_length": acc, "accepted_at_position": [0.62, 0.03, 0.01], "tokens_per_s": 12.5,
         "target_tokens_per_s": 10.0, "speedup": 1.25, "lossless": lossless, "near_ties": 0, "mismatches": []}
    r = {"config": config, "prompt_set": "held_out", "prompts": 6, "min_accept_length": 1.5, "draft": d}
    if baseline is not None:
        r["baseline"] = {**d, "accept_length": baseline}
    return r


def test_report_shows_the_table_and_the_refusal(tmp_path):
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": "/models/t"})
    layout = RunLayout.for_run(cfg, "r1")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    html = write_report(cfg, layout).read_text()
    assert "No evaluation: evaluate_draft did not finish." in html
    ev = {"results": [_row("3/1/4", 1.688, baseline=1.9), _row("7/1/8", 1.701)], "passed": False,
          "refused": ["configuration 3/1/4 on held_out (6 prompts): acceptance length 1.688 is worse than the "
                      "baseline draft's 1.900 by more than eval.tolerance 0.05"],
          "target_dtype": "float32", "device": "cpu", "max_new_tokens": 64, "eval_file": str(run_dir / "eval.json")}
    (run_dir / "eval.json").write_text(json.dumps(ev))
    html = write_report(cfg, layout).read_text()
    assert "Refused by the promotion gate (the export is kept): configuration 3/1/4" in html
    assert "<td>3/1/4</td><td>held_out (6)</td><td>1.688</td><td>0.62 0.03 0.01</td><td>12.5</td><td>10.0</td>" \
           "<td>1.25x</td><td>yes</td><td>1.50</td><td>1.900</td>" in html
    assert "<td>7/1/8</td>" in html and "<td>1.701</td>" in html


def test_report_shows_the_held_out_figures_of_training_beside_the_training_curves(tmp_path):
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": "/models/t"})
    layout = RunLayout.for_run(cfg, "r1")
    draft = tmp_path / "runs" / "r1" / "draft"
    draft.mkdir(parents=True)
    rows = [{"step": s, "loss": 2.0 / s, "loss_per_position": 3.0 / s, "acc_0": 0.1 * s, "accept_length": 1 + 0.1 * s}
            for s in range(1, 5)]
    rows[1].update(eval_loss_per_position=2.5, eval_acc_0=0.15, eval_accept_length=1.2, eval_samples=16)
    rows[3].update(eval_loss_per_position=1.75, eval_acc_0=0.3, eval_accept_length=1.4, eval_samples=16)
    (draft / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = write_report(cfg, layout).read_text()
    assert ("Held-out (16 samples never trained on) at step 4: loss per scored position 1.750, acc_0 0.300, "
            "simulated acceptance length 1.400.") in html
    assert "held-out loss per scored position" in html and "held-out acc_0" in html
    (draft / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("eval_")})
                                                 + "\n" for r in rows))
    assert "Held-out (" not in write_report(cfg, layout).read_text()


def test_report_shows_the_paired_speedup_spread_and_its_note(tmp_path):
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": "/models/t"})
    layout = RunLayout.for_run(cfg, "r2")
    run_dir = tmp_path / "runs" / "r2"
    run_dir.mkdir(parents=True)
    row = _row("3/1/4", 1.0)
    row["draft"].update({"speedup": 1.08, "speedup_spread": [0.91, 1.2],
                         "speedup_note": "speed-up 1.08 is above the acceptance length 1.000 <noise>"})
    (run_dir / "eval.json").write_text(json.dumps({"results": [row], "passed": True, "promoted": "p",
                                                   "eval_file": str(run_dir / "eval.json")}))
    html = write_report(cfg, layout).read_text()
    assert "<td>1.08x (0.91-1.20) <b title='speed-up 1.08 is above the acceptance length 1.000 &lt;noise&gt;'>*</b>" \
        in html


def test_report_says_who_approved_or_rejected_the_draft_and_why(tmp_path):
    """eval.approval: pending, approved, rejected (the draft in service stays), a person's text escaped."""
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": "/models/t"})
    layout = RunLayout.for_run(cfg, "r1")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    base = {"results": [_row("3/1/4", 1.9, baseline=1.8)], "passed": True, "refused": [], "target_dtype": "float32",
            "device": "cpu", "max_new_tokens": 64, "eval_file": str(run_dir / "eval.json"),
            "baseline_draft": "/runs/old/draft/export"}

    def report(**ev) -> str:
        (run_dir / "eval.json").write_text(json.dumps({**base, **ev}))
        return write_report(cfg, layout).read_text()
    assert "waiting for a person's approval" in report(approval={"mode": "always", "state": "pending"})
    html = report(approval={"state": "approved", "decision": "approve", "by": "alice", "why": "better on GSM8K",
                            "decided_at": "2026-12-06T08:00:00Z"}, promoted="/runs/promoted.json")
    assert ("approved by alice at 2026-12-06T08:00:00Z: &ldquo;better on GSM8K&rdquo;; promoted: "
            "<code>/runs/promoted.json</code>") in html
    html = report(approval={"state": "rejected", "decision": "reject", "by": "bob", "why": "<b>worse</b> on MT"})
    assert ("rejected by bob: &ldquo;&lt;b&gt;worse&lt;/b&gt; on MT&rdquo;. Not promoted: the draft in service "
            "stays: <code>/runs/old/draft/export</code>.") in html and "<b>worse" not in html
    assert "rejected by nobody: no answer in time" in report(approval={"state": "rejected", "decision": "timeout"})
