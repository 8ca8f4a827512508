"""eval.backend sglang, the control plane: servers started detached and recorded, polled until ready, the
prompt sets sent concurrently, the figures and the gate, every server stopped by its record.

The server is tests/fixtures/fake_sglang_generate.py, whose answers carry sglang 0.5.23's meta_info fields
(its docstring names the tokenizer-manager code each comes from; tests/node/test_eval_sglang.py builds the
same fields with sglang's own classes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.engines.sglang import evaluator as sb
from eagleflow.evaluate.run import gate
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from eagleflow.nodes.process_record import records_in

FAKE = str(Path(__file__).resolve().parents[1] / "fixtures" / "fake_sglang_generate.py")

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]   # fake sglang servers in subprocesses


def _fake_command(extra=()):
    def command(cfg, *, model_path, host, port, draft_dir, sc, python=sys.executable):
        argv = sb.build_command(cfg, model_path=model_path, host=host, port=port, draft_dir=draft_dir, sc=sc)
        return [python, FAKE, *argv[1:], *extra]   # sglang's own flags, answered by the fake
    return command


def _setup(tmp_path, **eval_cfg):
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "target"),
                            "server": {"dtype": "bfloat16"},
                            "eval": {"backend": "sglang", "concurrency": 4, "max_new_tokens": 16,
                                     "ready_timeout_s": 30, "configs": [{"steps": 3, "draft_tokens": 4},
                                                                         {"steps": 3, "topk": 4, "draft_tokens": 8}],
                                     **eval_cfg}})
    layout = RunLayout.for_run(cfg, "ev")
    Path(str(layout.run_dir)).mkdir(parents=True)
    return cfg, layout


def _draft(tmp_path, name, **quality):
    d = tmp_path / name
    d.mkdir()
    # the ids are checked before any server starts (sglang would take its default layers without them)
    (d / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 6]}}))
    (d / "fake_draft.json").write_text(json.dumps(quality))
    return d


def _prompts(n, base=0):
    return [{"id": f"p{i}", "prompt_ids": [base + i, 5, 9]} for i in range(n)]


def test_a_draft_without_its_layer_ids_is_refused_before_any_server_starts(tmp_path):
    cfg, layout = _setup(tmp_path)
    d = _draft(tmp_path, "dropped", accept=2)
    (d / "config.json").write_text(json.dumps({"eagle_config": {"use_aux_hidden_state": True}}))
    with pytest.raises(sb.SglangEvalError, match=r"draft draft .*dropped: .*dropped/config.json names no "
                                                 r"eagle_aux_hidden_state_layer_ids \(None\): SGLang would feed the "
                                                 r"draft its own default layers"):
        sb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts={"draft": d},
                   prompt_sets={"held_out": _prompts(1)}, log=lambda m: None, command=_fake_command())
    assert not Path(str(layout.log_file("eval_sglang_target"))).exists()   # refused before any server


def test_acceptance_per_configuration_and_prompt_set_and_every_server_stopped(tmp_path):
    cfg, layout = _setup(tmp_path)
    drafts = {"draft": _draft(tmp_path, "new", accept=2), "baseline": _draft(tmp_path, "old", accept=0)}
    logs = []
    rows, about = sb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts=drafts,
                             prompt_sets={"held_out": _prompts(6), "mine": _prompts(3, 40)}, log=logs.append,
                             command=_fake_command())
    assert [(r["config"], r["prompt_set"], r["prompts"]) for r in rows] == [
        ("3/1/4", "held_out", 6), ("3/1/4", "mine", 3), ("3/4/8", "held_out", 6), ("3/4/8", "mine", 3)]
    for r in rows:
        new, old = r["draft"], r["baseline"]
        # 16 tokens: 1 from the prefill, then 5 passes of 2 drafts + bonus: (10 + 5) / 5 = 3.0
        assert new["accept_length"] == 3.0 and new["sglang_accept_length"] == 16 / 5
        assert new["accepted_at_position"] == [1.0, 1.0, 0.0] and new["lossless"] and not new["mismatches"]
        # a draft never right: exactly 1.0 (sglang's own figure is 16/15)
        assert old["accept_length"] == 1.0 and old["sglang_accept_length"] == round(16 / 15, 4)
        assert new["tokens_per_s"] > 0 and new["target_tokens_per_s"] > 0
    assert gate(rows, cfg, baseline=True) == []
    # one alone server + 2 configurations x 2 drafts, each started, ready, stopped by its record
    started = [m for m in logs if ", log " in m]
    assert len(started) == 5 and "--speculative-draft-model-path" not in started[0]
    assert sum("--speculative-eagle-topk 4" in m for m in started) == 2
    assert len([m for m in logs if m.endswith("terminated")]) == 5
    assert records_in(str(layout.pids_dir), "ev") == []


def test_a_never_accepted_draft_and_a_lossy_server_are_refused(tmp_path):
    cfg, layout = _setup(tmp_path, configs=[{"steps": 3, "draft_tokens": 4}])
    drafts = {"draft": _draft(tmp_path, "bad", accept=0, corrupt_at=4)}
    rows, _ = sb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts=drafts,
                         prompt_sets={"held_out": _prompts(2)}, log=lambda m: None, command=_fake_command())
    [row] = rows
    d = row["draft"]
    assert d["accept_length"] == 1.0 and not d["lossless"]
    # the emitted token is the target's second choice, 8.9 below its top: far beyond the bf16 tie tolerance
    # (4 ulps at a top logit of 32 = 1.0)
    m = d["mismatches"][0]
    assert m["position"] == 4 and m["emitted_rank"] == 2 and m["emitted_logit_gap"] == 8.9
    assert m["tie_tolerance"] == 1.0 and not m["near_tie"]
    why = gate(rows, cfg, baseline=False)
    assert why[0] == ("configuration 3/1/4 on held_out (2 prompts): acceptance length 1.000 is below "
                      "eval.min_accept_length 1.500")
    assert "position 4 (emitted token " in why[1] and "ranked 2 in the target's distribution, 8.9 below" in why[1]


def test_a_server_that_dies_while_loading_is_named_with_its_log(tmp_path):
    cfg, layout = _setup(tmp_path)
    with pytest.raises(sb.SglangEvalError, match=r"exited while loading; read .*eval_sglang_target\.log"):
        sb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts={"draft": _draft(tmp_path, "d", accept=1)},
                   prompt_sets={"held_out": _prompts(1)}, log=lambda m: None,
                   command=_fake_command(["--die-while-loading"]))
    assert records_in(str(layout.pids_dir), "ev") == []
    assert "dying while loading" in Path(str(layout.log_file("eval_sglang_target"))).read_text()


def test_without_sglang_installed_the_backend_says_what_to_do(tmp_path, monkeypatch):
    cfg, layout = _setup(tmp_path)
    # patched where the evaluator looks it up (it imports the function from the launcher at module level)
    monkeypatch.setattr(sb, "installed_sglang_version", lambda: "0.4.0")
    with pytest.raises(sb.SglangEvalError, match=r"sglang 0\.4\.0 is not a version.*eval\.backend hf"):
        sb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts={}, prompt_sets={}, log=print,
                   node=LocalNode(name="local"))


def test_the_operator_gives_the_node_command_every_servers_load_time(tmp_path):
    from types import SimpleNamespace

    from eagleflow.airflow.train_operators import EvaluateDraftOperator
    op = EvaluateDraftOperator(task_id="evaluate_draft")
    cfg, _ = _setup(tmp_path, baseline_draft=str(tmp_path / "old"), ready_timeout_s=1000, request_timeout_s=100)
    # the target alone + 2 configurations x (draft, baseline) = 5 loads, each with its requests
    assert op._timeout(SimpleNamespace(cfg=cfg)) == 5 * (1000 + 100)
    hf = load_config(data={"target_model": "t"})
    assert op._timeout(SimpleNamespace(cfg=hf)) == op.timeout_s == 3600.0


def test_the_lossless_rule_is_the_hf_backends_on_the_emitted_tokens_log_probability():
    from eagleflow.evaluate.lossless import tie_tolerance
    th = sb.near_tie_threshold("bfloat16", None)
    assert th == tie_tolerance("bfloat16", 32.0) == 1.0          # 4 ulps at a top logit of 32 (was 4.0)
    assert sb.near_tie_threshold("float32", None) < 1e-4 and sb.near_tie_threshold("bfloat16", 0.5) == 0.5

    def alone(second_gap):   # the reference: token 7 best, token 8 `second_gap` below, token 9 far below
        return {"p": {"tokens": [7, 7], "completion_tokens": 2,
                      "candidates": [[(7, -0.1), (8, -0.1 - second_gap), (9, -12.0)]] * 2}}

    def answer(tok):
        return {"p": {"tokens": [tok, 7], "completion_tokens": 2, "verify_passes": 1, "correct_drafts": 0,
                      "histogram": [1], "spec_accept_length": 2.0}}
    tie = sb.measure(answer(8), alone(0.5), 1.0, 1.0, 3, th)      # the second choice, 0.5 below: a tie
    assert tie["lossless"] and tie["near_ties"] == 1 and tie["mismatches"][0]["emitted_rank"] == 2
    far = sb.measure(answer(9), alone(0.5), 1.0, 1.0, 3, th)      # a token 11.9 below the top
    assert not far["lossless"] and far["mismatches"][0]["emitted_logit_gap"] == 11.9
    # the old top-2 rule excused this one: the target's own top-2 gap (0.5) is small, the emitted token is not
    unknown = sb.measure(answer(11), alone(0.5), 1.0, 1.0, 3, th)  # below every candidate answered
    assert not unknown["lossless"] and unknown["mismatches"][0]["emitted_rank"] == ">3"
