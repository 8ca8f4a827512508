"""eval.prompt_sets in the public sets' own formats, through `evaluate_run` with the tiny target and a draft
written as `eagleflow export` writes one (small files made here in each format; nothing is downloaded):

- MT-Bench ``question.jsonl`` (both turns; the second asked after the target's OWN greedy first answer),
  GSM8K (question, answer), HumanEval (task_id, prompt, ...) from a datasets ``save_to_disk`` folder;
- a row per set and configuration, every turn scored; the gate decided by ``eval.gate_sets``;
- a record of no known format, or not of the set's format, stops the phase naming the file, line and fields;
- the served backends (sglang's control plane, a fake server) ask MT-Bench's second turn after the target's
  own answer too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagleflow.config import load_config
from eagleflow.corpus.prepare import prepare_corpus
from eagleflow.evaluate.run import evaluate_run, table_lines
from eagleflow.layout import RunLayout
from tests.unit.test_evaluate_gate import write_export

pytestmark = pytest.mark.timeout(600)

MT_BENCH = [{"question_id": 81, "category": "writing",
             "turns": ["Repeat golf 3 times.", "Now once more, with commas."]},
            {"question_id": 82, "category": "math", "turns": ["Count from 3 to 9.", "Now count back."],
             "reference": ["3 4 5 6 7 8 9", "9 8 7 6 5 4 3"]}]
GSM8K = [{"question": "What is 12 plus 30?", "answer": "12 plus 30 is 42.\n#### 42"},
         {"question": "Count from 1 to 4.", "answer": "1 2 3 4\n#### 4"}]
HUMANEVAL = [{"task_id": f"HumanEval/{i}", "prompt": f'def add{i}(a, b):\n    """Add two integers."""\n',
              "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(1, 2) == 3\n",
              "entry_point": f"add{i}"} for i in range(2)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _saved(path: Path, records: list[dict], split: str | None = None) -> Path:
    """A datasets save_to_disk folder (a DatasetDict when ``split`` names one)."""
    from datasets import Dataset, DatasetDict
    ds = Dataset.from_list(records)
    (DatasetDict({split: ds, "prompt": Dataset.from_list(records[:1])}) if split else ds).save_to_disk(str(path))
    return path


def _cfg(root: Path, target: str, sources, **eval_cfg):
    return load_config(data={
        "run_root": str(root / "runs"), "target_model": target, "node": {"name": "local", "has_gpu": False},
        "corpus": {"sources": sources, "max_length": 256, "eval_fraction": 0.05, "eval_min_records": 3},
        "eval": {"max_prompts": 2, "max_new_tokens": 8, "configs": [{"steps": 3, "draft_tokens": 4}],
                 "min_accept_length": 1.0, "baseline_draft": "none", **eval_cfg}})


@pytest.fixture(scope="module")
def corpus(demo_assets, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sets-corpus")
    cfg = _cfg(root, demo_assets["target_model"], demo_assets["sources"])
    layout = RunLayout.for_run(cfg, "ev")
    prepare_corpus(cfg, layout, num_proc=1, log=lambda _: None)
    return Path(str(layout.corpus_dir))


def _run(tmp_path, corpus, demo_assets, **eval_cfg):
    cfg = _cfg(tmp_path, demo_assets["target_model"], demo_assets["sources"], **eval_cfg)
    layout = RunLayout.for_run(cfg, "ev")
    if not Path(str(layout.corpus_dir)).exists():
        shutil.copytree(corpus, str(layout.corpus_dir))
    draft = Path(str(layout.draft_dir)) / "export"
    if not draft.exists():
        write_export(draft, demo_assets["target_model"])
    return cfg, layout


def _public_sets(tmp_path) -> list[dict]:
    return [{"name": "mt_bench", "path": str(_jsonl(tmp_path / "question.jsonl", MT_BENCH))},
            {"name": "gsm8k", "path": str(_jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K))},
            {"name": "humaneval", "path": str(_saved(tmp_path / "humaneval", HUMANEVAL, split="test")),
             "format": "humaneval", "split": "test"}]


def test_each_public_format_is_scored_per_set_mt_bench_turn_two_after_the_target_s_own_answer(
        tmp_path, corpus, demo_assets, monkeypatch):
    import eagleflow.evaluate.decoder as decoder
    from eagleflow.corpus.tokenize import load_tokenizer
    from eagleflow.evaluate.prompt_sets import prompt_ids
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=_public_sets(tmp_path))
    greedy, seen = decoder.greedy, {}

    def recording_greedy(target, prompt, max_new, candidates=True):   # the target alone, as the evaluator calls it
        out = greedy(target, prompt, max_new, candidates=candidates)
        if candidates:   # the references (the timed decodes ask for none)
            seen[tuple(prompt)] = out.tokens
        return out
    monkeypatch.setattr(decoder, "greedy", recording_greedy)
    logs: list[str] = []
    summary = evaluate_run(cfg, layout, log=logs.append)

    assert [(r["config"], r["prompt_set"], r["prompts"]) for r in summary["results"]] == [
        ("3/1/4", "held_out", 2), ("3/1/4", "mt_bench", 4), ("3/1/4", "gsm8k", 2), ("3/1/4", "humaneval", 2)]
    assert summary["prompt_sets"] == {"held_out": 2, "mt_bench": 4, "gsm8k": 2, "humaneval": 2}
    for r in summary["results"]:
        assert r["draft"]["lossless"] and r["draft"]["verify_passes"] > 0 and r["decides_gate"]
    assert summary["passed"]
    table = table_lines(summary)
    rows = [line for line in table[2:] if line.startswith("3/1/4 ")]   # a timing note ("* 3/1/4 on ...") may follow
    assert [line.split()[1] for line in rows] == ["held_out", "mt_bench", "gsm8k", "humaneval"]
    assert "mt_bench x4" in table[3]

    # each prompt as the chat template renders it; MT-Bench's second turn after the target's own first answer
    tok = load_tokenizer(demo_assets["target_model"])
    user = [{"role": "user", "content": q["question"]} for q in GSM8K]
    assert all(tuple(prompt_ids(tok, [u])) in seen for u in user)
    assert all(tuple(prompt_ids(tok, [{"role": "user", "content": h["prompt"]}])) in seen for h in HUMANEVAL)
    for q in MT_BENCH:
        first = [{"role": "user", "content": q["turns"][0]}]
        answer = seen[tuple(prompt_ids(tok, first))]
        assert answer, "the target said nothing: the test proves nothing"
        second = first + [{"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)},
                          {"role": "user", "content": q["turns"][1]}]
        assert tuple(prompt_ids(tok, second)) in seen, f"question {q['question_id']}: turn 2 not asked after turn 1"
    assert any("(and their later turns, after the target's own answers)" in m for m in logs)


def test_the_gate_is_decided_by_the_sets_named_in_gate_sets(tmp_path, corpus, demo_assets):
    sets = _public_sets(tmp_path)[1:2]   # gsm8k
    # a random draft scores about 1.0 everywhere: held to 1.2, every deciding set refuses it
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=sets, min_accept_length=1.2,
                       gate_sets=["gsm8k"])
    summary = evaluate_run(cfg, layout, log=lambda _: None)
    assert not summary["passed"] and summary["gate_sets"] == ["gsm8k"]
    assert [why.split(":")[0] for why in summary["refused"]] == ["configuration 3/1/4 on gsm8k (2 prompts)"]
    assert [r["decides_gate"] for r in summary["results"]] == [False, True]
    assert table_lines(summary)[-1] == ("gate: acceptance on gsm8k (eval.gate_sets); held_out reported and held "
                                        "to losslessness only")
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=sets, min_accept_length=1.2)   # every set
    summary = evaluate_run(cfg, layout, log=lambda _: None)
    assert [why.split(":")[0] for why in summary["refused"]] == [
        "configuration 3/1/4 on held_out (2 prompts)", "configuration 3/1/4 on gsm8k (2 prompts)"]
    with pytest.raises(ValueError, match=r"eval.gate_sets \['gsm8k', 'mmlu'\]: name one or more of held_out, "
                                         r"gsm8k .*unknown: \['mmlu'\]"):
        _cfg(tmp_path, demo_assets["target_model"], demo_assets["sources"], prompt_sets=sets,
             gate_sets=["gsm8k", "mmlu"])


@pytest.mark.parametrize("records, fmt, problem", [
    ([{"question": "q", "answer": "a"}, {"query": "q", "response": "a"}], "auto",
     r"line 2: fields \['query', 'response'\] match no prompt format eagleflow reads \(mt_bench: question_id, "
     r"turns; gsm8k: question, answer; humaneval: task_id, prompt, entry_point; chat: messages\|conversations; "
     r"prompt: prompt\)"),
    (HUMANEVAL, "gsm8k", r"line 1: fields \['canonical_solution', 'entry_point', 'prompt', 'task_id', 'test'\], "
     r"but format gsm8k needs question, answer \(the record looks like humaneval\)"),
    ([{"question_id": 1, "turns": []}], "auto", r"line 1: field turns must be a non-empty list of texts"),
    ([{"question": "", "answer": "a"}], "auto", r"line 1: field question is empty, expected text"),
    ([[1, 2]], "auto", r"line 1: a JSON list, not an object; one JSON object a line"),
    ([{"question": "q", "answer": "a", "id": None}, {"prompt": "p", "id": "gsm8k_test:1"}], "auto",
     r"line 2: id 'gsm8k_test:1' repeats .* line 1; each prompt of a set needs its own id"),
])
def test_a_record_of_no_known_format_or_not_the_set_s_is_named_by_file_line_and_fields(
        tmp_path, corpus, demo_assets, records, fmt, problem):
    path = _jsonl(tmp_path / "gsm8k_test.jsonl", records)
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=[{"name": "s", "path": str(path), "format": fmt}])
    with pytest.raises(ValueError, match=problem) as e:
        evaluate_run(cfg, layout, log=lambda _: None)
    assert str(e.value).startswith(f"eval.prompt_sets[0] (s): {path} ")


def test_a_datasets_folder_names_its_splits_and_a_file_takes_none(tmp_path, corpus, demo_assets):
    saved = _saved(tmp_path / "gsm8k", GSM8K, split="main")
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=[{"name": "g", "path": str(saved)}])
    with pytest.raises(ValueError, match=r"holds the splits \['main', 'prompt'\]; name one with the set's split"):
        evaluate_run(cfg, layout, log=lambda _: None)
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=[{"name": "g", "path": str(saved), "split": "x"}])
    with pytest.raises(ValueError, match=r"holds the splits \['main', 'prompt'\], not 'x'"):
        evaluate_run(cfg, layout, log=lambda _: None)
    plain = _jsonl(tmp_path / "g.jsonl", GSM8K)
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=[{"name": "g", "path": str(plain), "split": "x"}])
    with pytest.raises(ValueError, match=r"split 'x' is set but .*g.jsonl is a file"):
        evaluate_run(cfg, layout, log=lambda _: None)
    folder = tmp_path / "not-a-dataset"
    folder.mkdir()
    cfg, layout = _run(tmp_path, corpus, demo_assets, prompt_sets=[{"name": "g", "path": str(folder)}])
    with pytest.raises(ValueError, match=r"is a folder but not one written by datasets' save_to_disk"):
        evaluate_run(cfg, layout, log=lambda _: None)


@pytest.mark.slow   # fake sglang servers in subprocesses
def test_a_served_backend_asks_mt_bench_s_second_turn_after_the_target_s_own_answer(tmp_path, demo_assets,
                                                                                     monkeypatch):
    """eval.backend sglang's control plane (tests/fixtures/fake_sglang_generate.py answers as sglang 0.5.23):
    the target alone answers the first turns, the second turns are built on those answers, and every turn is
    then sent to the alone and the draft servers alike."""
    from eagleflow.corpus.tokenize import load_tokenizer
    from eagleflow.engines.sglang import evaluator as sb
    from eagleflow.evaluate.prompt_sets import prompt_ids, read_prompt_set
    from tests.fixtures.fake_sglang_generate import next_token
    from tests.unit.test_evaluate_sglang import _draft, _fake_command
    target = demo_assets["target_model"]
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": target,
                            "server": {"dtype": "bfloat16"},
                            "eval": {"backend": "sglang", "concurrency": 4, "max_new_tokens": 6, "ready_timeout_s": 30,
                                     "configs": [{"steps": 3, "draft_tokens": 4}]}})
    layout = RunLayout.for_run(cfg, "ev")
    Path(str(layout.run_dir)).mkdir(parents=True)
    tok = load_tokenizer(target)
    first = read_prompt_set(_jsonl(tmp_path / "question.jsonl", MT_BENCH), tok, 8, "mt")
    assert [p["id"] for p in first] == ["81:turn1", "82:turn1"]
    sent: dict[str, dict[str, list[int]]] = {}
    send_all = sb.send_all

    def recording(url, prompts, max_new, *, tag, **kw):
        sent.setdefault(tag, {}).update({p["id"]: p["prompt_ids"] for p in prompts})
        return send_all(url, prompts, max_new, tag=tag, **kw)
    monkeypatch.setattr(sb, "send_all", recording)
    rows, _ = sb.results(cfg, layout, target_dir=target, drafts={"draft": _draft(tmp_path, "new", accept=2)},
                         prompt_sets={"mt_bench": first}, log=lambda _: None, command=_fake_command())
    [row] = rows
    # 6 tokens: the prefill's, then 2 drafts + the bonus, then 1 + the bonus
    assert row["prompts"] == 4 and row["draft"]["lossless"] and row["draft"]["accept_length"] == 2.5
    assert sorted(sent["alone-mt_bench-turns"]) == ["81:turn1", "82:turn1"]
    assert sent["alone-mt_bench"] == sent["draft-mt_bench"] and sorted(sent["draft-mt_bench"]) == [
        "81:turn1", "81:turn2", "82:turn1", "82:turn2"]
    for p, q in zip(first, MT_BENCH):
        t, answer = p["prompt_ids"][-1], []   # the fake target's answer: its rule from the prompt's last token
        for _ in range(6):
            t = next_token(t)
            answer.append(t)
        second = p["messages"] + [{"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)},
                                  {"role": "user", "content": q["turns"][1]}]
        assert sent["draft-mt_bench"][f"{q['question_id']}:turn2"] == prompt_ids(tok, second)


def test_the_frozen_run_config_keeps_the_prompt_sets_where_the_yaml_named_them(tmp_path):
    """The run's frozen config (run-config.json, in the run's folder) is read by every node command: a prompt set
    named relative to the YAML's folder must stay that file, not one beside run-config.json (the demo's first
    run with public sets failed so)."""
    import yaml

    from eagleflow.airflow.runtime import resolved_config_dict
    (tmp_path / "configs").mkdir()
    (tmp_path / "data").mkdir()
    prompts = _jsonl(tmp_path / "data" / "gsm8k.jsonl", GSM8K)
    drafts = tmp_path / "drafts"
    cfg_file = tmp_path / "configs" / "run.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "run_root": "../runs", "target_model": "../target",
        "eval": {"prompt_sets": [{"name": "gsm8k", "path": "../data/gsm8k.jsonl"}],
                 "baseline_draft": "../drafts/good", "promoted_draft_roots": ["../drafts"]}}))
    frozen = resolved_config_dict(load_config(cfg_file))
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "run-config.json").write_text(json.dumps(frozen))
    again = load_config(run_dir / "run-config.json")
    assert again.resolve(again.eval.prompt_sets[0].path) == prompts
    assert again.resolve(again.eval.baseline_draft) == drafts / "good"
    assert [again.resolve(p) for p in again.eval.promoted_draft_roots] == [drafts]
    cfg_file.write_text(cfg_file.read_text().replace("../drafts/good", "none"))
    assert resolved_config_dict(load_config(cfg_file))["eval"]["baseline_draft"] == "none"
