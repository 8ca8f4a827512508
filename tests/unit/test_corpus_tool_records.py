"""Tool-calling corpora end to end through prepare_corpus: both record forms rendered by the target's
template and masked right, per-source tool statistics, templates that cannot render tools, bad
tool-calling records, invalid UTF-8, tiny corpora, and the over-max_length policies."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagleflow.config import load_config
from eagleflow.corpus.normalise import normalise_conversation
from eagleflow.corpus.prepare import BadRecordsError, prepare_corpus
from eagleflow.corpus.tokenize import GENERATION_TAGS, TemplateError, encode_record, load_tokenizer
from eagleflow.demo_assets import CHAT_TEMPLATE
from eagleflow.layout import RunLayout
from tests.fixtures.corpus import (GOOD_SOURCES, TOOL_SOURCES, expected_bad_tools, fixture_path, write_config)
from tests.fixtures.corpus.make_fixtures import TOOLS_OPENAI


def _prepare(tmp_path, target, sources, run_id="r", num_proc=None, **corpus):
    cfg = load_config(write_config(tmp_path, target, sources, corpus=corpus, name=f"{run_id}.yaml"))
    layout = RunLayout.for_run(cfg, run_id)
    logs: list[str] = []
    stats = prepare_corpus(cfg, layout, num_proc=num_proc, log=logs.append)
    return stats, pq.read_table(str(layout.corpus_dir / "corpus.parquet")).to_pylist(), logs


def _masked_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def _target_with_template(tmp_path: Path, demo_assets, template: str, name: str) -> str:
    """A copy of the demo tokenizer with another chat template (prepare only needs the tokenizer)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_assets["target_model"])
    tok.chat_template = template
    out = tmp_path / name
    tok.save_pretrained(str(out))
    return str(out)


def test_tool_records_in_both_forms_reach_the_corpus(tmp_path, demo_assets):
    stats, rows, _ = _prepare(tmp_path, demo_assets["target_model"], TOOL_SOURCES + GOOD_SOURCES[:1])
    assert stats["records"] == 2 + 2 + 6
    for name in ("tools_oa", "tools_sg"):
        ps = stats["per_source"][name]
        assert (ps["records"], ps["turns"], ps["records_with_tool_calls"], ps["tool_calls"], ps["tool_messages"]) == \
            (2, 10, 2, 3, 3), (name, ps)
        assert ps["bad"] == 0 and ps["dropped"] == 0
    assert stats["per_source"]["sg"]["records_with_tool_calls"] == 0
    assert (stats["records_with_tool_calls"], stats["tool_messages"]) == (4, 6)

    tok = load_tokenizer(demo_assets["target_model"])
    by_id = {r["id"]: r for r in rows}
    oa = by_id["tools_oa:0"]
    exp = encode_record(tok, normalise_conversation(TOOLS_OPENAI[0]), GENERATION_TAGS)
    assert (oa["input_ids"], oa["loss_mask"]) == (exp.ids, exp.mask)
    # assistant text and tool calls trained on; system, user, tool list and tool result not
    assert _masked_runs(tok, oa["input_ids"], oa["loss_mask"]) == [
        '<think>Call add.</think><tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|eot_id|>',
        "3 plus 4 is 7.<|eot_id|>"]
    sg = by_id["tools_sg:0"]  # the ShareGPT form of the same conversation (no reasoning in that form)
    assert _masked_runs(tok, sg["input_ids"], sg["loss_mask"]) == [
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|eot_id|>', "3 plus 4 is 7.<|eot_id|>"]
    assert "<|start_header_id|>tool<|end_header_id|>\n\n7<|eot_id|>" in tok.decode(sg["input_ids"])
    assert _masked_runs(tok, by_id["tools_sg:1"]["input_ids"], by_id["tools_sg:1"]["loss_mask"]) == \
        _masked_runs(tok, by_id["tools_oa:1"]["input_ids"], by_id["tools_oa:1"]["loss_mask"])
    assert stats["masked_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


ROLE_CONTENT_ONLY = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}")


def test_template_that_cannot_render_tools_fails_fast_naming_template_and_record(tmp_path, demo_assets):
    target = _target_with_template(tmp_path, demo_assets, ROLE_CONTENT_ONLY, "no-tools-target")
    sources = GOOD_SOURCES[:1] + TOOL_SOURCES[::-1]  # the first tool-calling record: tools_sg line 1
    cfg = load_config(write_config(tmp_path, target, sources))
    logs: list[str] = []
    with pytest.raises(TemplateError) as e:
        prepare_corpus(cfg, RunLayout.for_run(cfg, "t"), log=logs.append)
    msg = str(e.value)
    assert msg.startswith(f"the chat template of {target} (tokenizer_config.json, sha256 ") or \
        msg.startswith(f"the chat template of {target} (chat_template.jinja, sha256 ")
    assert f"drops content of record tools_sg:0 ({fixture_path('tools_sharegpt.jsonl')} line 1): tools[0] " \
           "(function 'add') is not in the rendered text: the template ignores the `tools` list" in msg
    assert not any("tokenised in" in line for line in logs)  # found before tokenising the corpus
    assert not (tmp_path / "runs" / "t" / "corpus" / "corpus.parquet").exists()


def test_template_raising_on_a_record_is_a_bad_record(tmp_path, demo_assets):
    raising = CHAT_TEMPLATE.replace("{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}"
                                    "{{ raise_exception('tool role not supported') }}{% endif %}")
    target = _target_with_template(tmp_path, demo_assets, raising, "raising-target")
    with pytest.raises(TemplateError, match=r"cannot render record tools_oa:0 \(.*tools_openai.jsonl line 1\): "
                                            r"TemplateError: tool role not supported"):
        _prepare(tmp_path, target, TOOL_SOURCES + GOOD_SOURCES[:1])
    stats, rows, logs = _prepare(tmp_path, target, TOOL_SOURCES + GOOD_SOURCES[:1], run_id="allowed",
                                 max_bad_records=4)
    assert stats["records"] == 6 and stats["dropped"]["bad_record"]["template_error"] == 4
    assert stats["per_source"]["tools_oa"]["bad_by_reason"] == {"template_error": 2}
    assert any("skipping 4 bad record(s) found by tokenise" in line for line in logs)
    assert "tool role not supported" in stats["bad_records_shown"][0]
    with pytest.raises(BadRecordsError, match="4 bad record"):
        _prepare(tmp_path, target, TOOL_SOURCES + GOOD_SOURCES[:1], run_id="three", max_bad_records=3)


def test_bad_tool_records_and_invalid_utf8_name_line_and_reason(tmp_path, demo_assets):
    src = [{"name": "bad_tools", "path": fixture_path("bad_tools.jsonl")}]
    with pytest.raises(BadRecordsError) as e:
        _prepare(tmp_path, demo_assets["target_model"], src)
    listed = [ln for ln in str(e.value).splitlines() if ln.startswith("  - ")]
    expected = expected_bad_tools()
    assert len(listed) == len(expected) == 6
    for line, (fname, where, field, _kind) in zip(listed, expected):
        assert line.startswith(f"  - {fixture_path(fname)} {where}: field {field} = "), line
    assert "not valid UTF-8: byte b'\\xe9'" in listed[4]

    stats, rows, _ = _prepare(tmp_path, demo_assets["target_model"], src, run_id="skip", max_bad_records=6)
    assert sorted(r["id"] for r in rows) == ["bad_tools:0", "bad_tools:7"]
    assert stats["per_source"]["bad_tools"]["bad_by_reason"] == {
        "bad_tool_call": 2, "bad_tools": 1, "invalid_utf8": 1, "missing_field": 1, "non_text_content": 1}
    bad_file = [json.loads(x) for x in Path(stats["bad_records_file"]).read_text().splitlines()]
    assert [(b["where"], b["kind"]) for b in bad_file] == [(w, k) for _f, w, _fi, k in expected]

    stats, rows, _ = _prepare(tmp_path, demo_assets["target_model"], src, run_id="drop", max_bad_records=5,
                              non_text_parts="drop")
    assert "bad_tools:3" in {r["id"] for r in rows}
    assert stats["per_source"]["bad_tools"]["non_text_parts_dropped"] == 1


@pytest.mark.slow  # starts worker process pools
@pytest.mark.parametrize("records", [1, 2, 3, 4])
def test_tiny_corpora_with_several_processes(tmp_path, demo_assets, records):
    src = tmp_path / "tiny.jsonl"
    src.write_text("".join(Path(fixture_path("good_sharegpt.jsonl")).read_text().splitlines(True)[:records]))
    for procs in (2, 4):
        stats, rows, _ = _prepare(tmp_path, demo_assets["target_model"], [{"name": "t", "path": str(src)}],
                                  run_id=f"p{procs}", num_proc=procs)
        assert stats["records"] == len(rows) == records


def _long_trajectory(rounds: int) -> dict:
    msgs = [{"role": "user", "content": "Add these up one by one."}]
    for r in range(rounds):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{r}", "type": "function", "function": {"name": "add", "arguments": {"a": r, "b": 1}}}]},
                 {"role": "tool", "tool_call_id": f"c{r}", "content": str(r + 1)}]
    msgs.append({"role": "assistant", "content": "Done."})
    return {"messages": msgs, "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]}


def test_over_max_length_cut_or_drop(tmp_path, demo_assets):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps(_long_trajectory(12)) + "\n" + json.dumps(TOOLS_OPENAI[0]) + "\n")
    sources = [{"name": "agent", "path": str(src)}]
    whole, rows, _ = _prepare(tmp_path, demo_assets["target_model"], sources, run_id="whole", max_length=4096)
    full = {r["id"]: r for r in rows}["agent:0"]
    assert whole["per_source"]["agent"]["tool_calls"] == 13 and full["num_tokens"] < 4096
    limit = full["num_tokens"] // 2

    cut, rows, _ = _prepare(tmp_path, demo_assets["target_model"], sources, run_id="cut", max_length=limit)
    row = {r["id"]: r for r in rows}["agent:0"]
    assert row["num_tokens"] <= limit and row["input_ids"] == full["input_ids"][:row["num_tokens"]]
    assert row["loss_mask"] == full["loss_mask"][:row["num_tokens"]] and row["loss_mask"][-1] == 1
    tok = load_tokenizer(demo_assets["target_model"])
    assert tok.decode(row["input_ids"]).endswith("</tool_call><|eot_id|>")  # ends with a whole assistant turn
    ps = cut["per_source"]["agent"]
    assert (cut["cut_at_message_boundary"], ps["cut_at_message"], ps["records"]) == (1, 1, 2)
    assert ps["tool_calls"] < 13 and ps["turns"] < len(_long_trajectory(12)["messages"]) + 5

    dropped, rows, _ = _prepare(tmp_path, demo_assets["target_model"], sources, run_id="drop", max_length=limit,
                                over_max_length="drop")
    assert [r["id"] for r in rows] == ["agent:1"] and dropped["dropped"]["over_max_length"] == 1
    assert dropped["per_source"]["agent"]["dropped_by_reason"] == {"over_max_length": 1}


def test_content_dropped_by_a_later_record_is_found_after_tokenising(tmp_path, demo_assets):
    # renders the arguments of a single call but only the names of parallel calls: the first tool-calling
    # record (one call) passes the early check, the second (two calls) is caught in the full pass
    call = "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    template = CHAT_TEMPLATE.replace(call, "{% if m['tool_calls'] | length == 1 %}" + call +
                                     "{% else %}{{ c['function']['name'] }}{% endif %}")
    target = _target_with_template(tmp_path, demo_assets, template, "parallel-args-dropped")
    with pytest.raises(TemplateError) as e:
        _prepare(tmp_path, target, TOOL_SOURCES[:1])
    assert (f"drops content of record tools_oa:1 ({fixture_path('tools_openai.jsonl')} line 2): messages[1]."
            "tool_calls[0].function.arguments key 'words' is not in the rendered text: the template drops "
            "tool-call arguments") in str(e.value)
