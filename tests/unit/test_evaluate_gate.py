"""The promotion gate through `evaluate_run`: a real corpus split, real export directories, the tiny target.

- lossless is judged on the emitted token: a decoder that emits wrong tokens where the target's own top-2 gap
  is small (the blind spot of a top-2 rule) is NOT lossless in bfloat16 and is not promoted; a genuine tie
  (an exactly equal logit) still passes;
- the speed-up is paired and never above the acceptance length without a note;
- the draft in service (promoted.json) is the default baseline: a worse draft does not replace it.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from eagleflow.config import load_config
from eagleflow.corpus.prepare import prepare_corpus
from eagleflow.evaluate.decoder import verify_greedy
from eagleflow.evaluate.run import evaluate_run
from eagleflow.layout import RunLayout

pytestmark = pytest.mark.timeout(600)

X = 100   # the constant target's only answer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The machine is shared: one torch thread keeps the timings (and the test) steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(demo_assets, tmp_path_factory) -> Path:
    """One held-out split of the demo sources, prepared once (copied into each test's run)."""
    root = tmp_path_factory.mktemp("gate-corpus")
    cfg = _cfg(root, demo_assets["target_model"], demo_assets["sources"])
    layout = RunLayout.for_run(cfg, "ev")
    prepare_corpus(cfg, layout, num_proc=1, log=lambda _: None)
    return Path(str(layout.corpus_dir))


@pytest.fixture(scope="module")
def constant_target(demo_assets, tmp_path_factory) -> str:
    """The tiny Llama made to answer token X after anything (residual = embedding, one column decides)."""
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("constant") / "target"
    shutil.copytree(demo_assets["target_model"], d)
    w = load_file(str(d / "model.safetensors"))
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k].zero_()
    w["model.embed_tokens.weight"][:, 0] = 1.0       # every token's state has a positive first component
    w["model.norm.weight"].zero_()
    w["model.norm.weight"][0] = 1.0                  # the final state is that component alone
    w["lm_head.weight"][:, 0] = 0.0
    w["lm_head.weight"][X, 0] = 20.0                 # only X reads it
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d)


def _cfg(root: Path, target: str, sources, **sections):
    data = {"run_root": str(root / "runs"), "target_model": target, "node": {"name": "local", "has_gpu": False},
            "corpus": {"sources": sources, "max_length": 256, "eval_fraction": 0.05, "eval_min_records": 3},
            "eval": {"max_prompts": 3, "max_new_tokens": 16, "configs": [{"steps": 3, "draft_tokens": 4}],
                     "min_accept_length": 1.0}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return load_config(data=data)


def _run(tmp_path, corpus, target, demo_assets, **sections):
    cfg = _cfg(tmp_path, target, demo_assets["sources"], **sections)
    layout = RunLayout.for_run(cfg, "ev")
    if not Path(str(layout.corpus_dir)).exists():
        shutil.copytree(corpus, str(layout.corpus_dir))
    return cfg, layout


def write_export(out: Path, target_dir: str, propose: int | None = None) -> Path:
    """A draft as `eagleflow export` writes it: random weights, or one that always proposes ``propose``."""
    from safetensors.torch import save_file

    from eagleflow.engines.sglang.export import eagle_layer_ids
    from eagleflow.train.export import export_config
    from eagleflow.train.model import DraftConfig, Eagle3Draft
    torch.manual_seed(3)
    dcfg = DraftConfig.from_target(target_dir, 128)
    model = Eagle3Draft(dcfg)
    model.t2d[:128] = True          # draft ids 0..127 are target ids 0..127
    if propose is not None:
        with torch.no_grad():
            model.lm_head.weight.zero_()   # every draft logit 0: argmax is draft id 0 ...
        model.d2t[0] = propose             # ... which is target id `propose`
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.trainable_state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(export_config(dcfg, eagle_layer_ids(target_dir, None), "float32")))
    (out / "eagleflow_export.json").write_text(json.dumps({"aux_layer_outputs": None}))
    return out


def _gap_rule_blind_spot(fired: list):
    """A verify step that emits a token from the middle of the vocabulary wherever the target's own top-2 gap
    is within 0.1 x max(1, |top|): a top-2 rule (16 eps |top| = 0.125 |top| in bf16) calls those near-ties."""
    def verify(logits, drafts):
        m, bonus = verify_greedy(logits, drafts)
        v, _ = logits[m].topk(2)
        if float(v[0] - v[1]) <= 0.1 * max(1.0, abs(float(v[0]))):
            bonus = int(logits[m].argsort(descending=True)[logits.shape[-1] // 2])
            fired.append(bonus)
        return m, bonus
    return verify


def test_a_bf16_decoder_emitting_wrong_tokens_is_not_lossless_and_not_promoted(tmp_path, corpus, demo_assets):
    cfg, layout = _run(tmp_path, corpus, demo_assets["target_model"], demo_assets, server={"dtype": "bfloat16"})
    export = write_export(tmp_path / "runs" / "ev" / "draft" / "export", demo_assets["target_model"])
    fired: list[int] = []
    logs: list[str] = []
    summary = evaluate_run(cfg, layout, log=logs.append, verify=_gap_rule_blind_spot(fired))
    assert fired, "the corrupted verify never fired: the test proves nothing"
    [row] = summary["results"]
    d = row["draft"]
    assert summary["target_dtype"] == "bfloat16"
    assert not d["lossless"] and not summary["passed"] and "promoted" not in summary
    assert not (tmp_path / "runs" / "promoted.json").exists()
    bad = [m for m in d["mismatches"] if not m["near_tie"]]
    assert bad and all(m["with_draft"] in fired for m in bad)
    # ranked in the middle of 825 tokens: below every candidate kept, logits below the top
    assert bad[0]["emitted_rank"] == ">32" and bad[0]["emitted_logit_gap"] > bad[0]["tie_tolerance"]
    assert any("not lossless" in why and "ranked >32" in why for why in summary["refused"])
    ev = json.loads((tmp_path / "runs" / "ev" / "eval.json").read_text())
    assert ev["passed"] is False and ev["results"][0]["draft"]["lossless"] is False


def test_a_genuine_tie_is_excused_and_the_speedup_is_paired(tmp_path, corpus, demo_assets, constant_target):
    # the constant target: X scores 20 x h, every other token exactly 0; tokens 0 and 1 tie exactly for second.
    # A verify step that picks the *first* of them where the target's argmax picked X is wrong (rank 2, 20
    # logits below); one that swaps X's place with nothing cannot tie. So the tie is planted in the target:
    # lm_head row 7 = row X, two tokens with one logit; the reference takes the lower id, the verify the other.
    from safetensors.torch import load_file, save_file
    tied = tmp_path / "tied"
    shutil.copytree(constant_target, tied)
    w = load_file(str(tied / "model.safetensors"))
    w["lm_head.weight"][7] = w["lm_head.weight"][X]
    save_file(w, str(tied / "model.safetensors"), metadata={"format": "pt"})
    cfg, layout = _run(tmp_path, corpus, str(tied), demo_assets, server={"dtype": "bfloat16"})
    export = write_export(tmp_path / "runs" / "ev" / "draft" / "export", str(tied), propose=7)
    flips: list[int] = []

    def other_of_the_tie(logits, drafts):   # a verify that breaks the exact tie the other way
        choice = logits.argmax(-1)
        tied_ = (logits == logits.max(-1, keepdim=True).values).sum(-1) > 1
        m = 0
        while m < len(drafts) and (drafts[m] == int(choice[m]) or (tied_[m] and drafts[m] == X)):
            m += 1
        pick = X if bool(tied_[m]) else int(choice[m])
        if bool(tied_[m]):
            flips.append(pick)
        return m, pick

    summary = evaluate_run(cfg, layout, log=lambda _: None, verify=other_of_the_tie)
    d = summary["results"][0]["draft"]
    assert flips and d["mismatches"], "no tie was broken the other way: the test proves nothing"
    m = d["mismatches"][0]
    assert m["target"] == 7 and m["with_draft"] == X and m["emitted_rank"] in (1, 2) and m["emitted_logit_gap"] == 0
    assert m["near_tie"] and d["lossless"] and d["near_ties"] >= 1
    assert summary["passed"] and summary["promoted"]
    # the speed-up: paired per prompt, a median with its spread, and never above the acceptance length unnoted
    assert d["speedup_pairs"] == 3 and d["speedup_method"].startswith("paired")
    lo, hi = d["speedup_spread"]
    assert lo <= d["speedup"] <= hi
    assert d["speedup"] <= d["accept_length"] or d["speedup_note"]


def test_a_never_right_draft_is_no_faster_than_the_target_alone(tmp_path, corpus, demo_assets, monkeypatch):
    from eagleflow.evaluate.decoder import Target
    cfg, layout = _run(tmp_path, corpus, demo_assets["target_model"], demo_assets,
                       eval={"max_prompts": 3, "max_new_tokens": 24})
    write_export(tmp_path / "runs" / "ev" / "draft" / "export", demo_assets["target_model"])
    # a cold start: the target's first 30 forwards are slow (caches, allocations, a page-in); whichever decode
    # runs first pays it, so timing the reference first and once biases every speed-up upwards
    forward, calls = Target.forward, []

    def cold_forward(self, *a, **kw):
        calls.append(1)
        if len(calls) <= 30:
            time.sleep(0.1)
        return forward(self, *a, **kw)
    monkeypatch.setattr(Target, "forward", cold_forward)
    logs: list[str] = []
    summary = evaluate_run(cfg, layout, log=logs.append)
    d = summary["results"][0]["draft"]
    assert d["accept_length"] < 1.1
    # a draft never right pays the target's forwards plus its own: warmed up and paired, it is not faster (a
    # figure above the acceptance length needs the note that says it is noise)
    assert d["speedup"] < 1.5, d
    assert d["speedup"] <= d["accept_length"] or d["speedup_note"], d
    if d["speedup_note"]:
        assert any(d["speedup_note"] in line for line in logs)


def test_the_draft_in_service_is_the_default_baseline(tmp_path, corpus, demo_assets, constant_target):
    cfg, layout = _run(tmp_path, corpus, constant_target, demo_assets)
    runs = tmp_path / "runs"
    good = write_export(runs / "drafts" / "good", constant_target, propose=X)    # always right: ~4 at 3/1/4
    worse = write_export(runs / "ev" / "draft" / "export", constant_target)       # never right: 1.0
    first = evaluate_run(cfg, layout, draft_dir=good, log=lambda _: None)
    assert first["passed"] and first["baseline_draft"] is None        # nothing in service yet
    good_len = first["results"][0]["draft"]["accept_length"]
    assert good_len > 3.5
    promoted = json.loads((runs / "promoted.json").read_text())
    assert promoted["draft"] == str(good)

    # no eval.baseline_draft: the draft in service is the baseline, on the same prompts; the worse one is refused
    second = evaluate_run(cfg, layout, log=lambda _: None)
    assert second["baseline_draft"] == str(good.resolve()) and not second["passed"]
    row = second["results"][0]
    assert row["baseline"]["accept_length"] == good_len and row["draft"]["accept_length"] < 1.1
    assert any(f"worse than the baseline draft's {good_len:.3f}" in why for why in second["refused"])
    assert json.loads((runs / "promoted.json").read_text())["draft"] == str(good)   # still in service

    # opting out is explicit
    cfg_none, _ = _run(tmp_path, corpus, constant_target, demo_assets, eval={"baseline_draft": "none"})
    third = evaluate_run(cfg_none, layout, log=lambda _: None)
    assert third["passed"] and third["baseline_draft"] is None
    assert json.loads((runs / "promoted.json").read_text())["draft"] == str(worse)


@pytest.mark.parametrize("doc, problem", [
    ("{not json", "cannot be read"),
    ({"draft": "relative/dir", "run_id": "x", "accept_length": {}}, "is not an absolute path"),
    ({"draft": "/etc", "run_id": "x", "accept_length": {}}, "is outside run_root"),
    ({"draft": "@GONE", "run_id": "x", "accept_length": {}}, "has no config.json"),
    ({"draft": "@GOOD", "run_id": 3, "accept_length": {}}, "fields run_id / accept_length"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested 100000 levels deep"),   # issue 52: not a RecursionError
])
def test_promoted_json_is_untrusted_input(tmp_path, corpus, demo_assets, doc, problem):
    cfg, layout = _run(tmp_path, corpus, demo_assets["target_model"], demo_assets)
    runs = tmp_path / "runs"
    write_export(runs / "ev" / "draft" / "export", demo_assets["target_model"])
    good = write_export(runs / "drafts" / "good", demo_assets["target_model"])
    if isinstance(doc, dict):
        doc = json.dumps({**doc, "draft": doc["draft"].replace("@GONE", str(runs / "gone"))
                          .replace("@GOOD", str(good))})
    (runs / "promoted.json").write_text(doc)
    with pytest.raises(ValueError, match=problem) as e:
        evaluate_run(cfg, layout, log=lambda _: None)
    assert str(runs / "promoted.json") in str(e.value) and "eval.baseline_draft: none" in str(e.value)
