"""One message schema, and a precise error for each kind of bad record."""
from __future__ import annotations

import json

import pytest

from eagleflow.corpus.normalise import (EMPTY_CONVERSATION, MALFORMED_JSON, MISSING_FIELD, UNKNOWN_ROLE, WRONG_TYPE,
                                        BadRecord, RecordError, normalise_batch, normalise_record, parse_raw,
                                        shuffle_key)


def test_sharegpt_and_openai_forms_give_the_same_messages():
    sg = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                            {"from": "gpt", "value": "a"}]}
    oa = {"messages": [{"role": "developer", "content": "s"}, {"role": "user", "content": "q"},
                       {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
    expected = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    assert normalise_record(sg) == expected
    assert normalise_record(oa) == expected


@pytest.mark.parametrize("record, field, kind", [
    ({"text": "x"}, "conversations|messages", MISSING_FIELD),
    ({"conversations": "human: hi"}, "conversations", WRONG_TYPE),
    ({"conversations": []}, "conversations", EMPTY_CONVERSATION),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", UNKNOWN_ROLE),
    ({"messages": [{"role": "user"}]}, "messages[0].content", MISSING_FIELD),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", WRONG_TYPE),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", WRONG_TYPE),
    ({"conversations": ["hi"]}, "conversations[0]", WRONG_TYPE),
    ([1, 2], "(record)", WRONG_TYPE),
])
def test_each_bad_kind_names_field_and_kind(record, field, kind):
    with pytest.raises(RecordError) as e:
        normalise_record(record)
    assert (e.value.field, e.value.kind) == (field, kind)


def test_malformed_json_is_a_record_error():
    with pytest.raises(RecordError) as e:
        parse_raw('{"messages": [')
    assert e.value.kind == MALFORMED_JSON and e.value.field == "(line)"


def test_batch_reports_file_line_field_value():
    out = normalise_batch({"__row": [0, 1], "__where": ["line 1", "line 3"],
                           "__raw": ['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
                                     '{"messages": [{"role": "robot", "content": "beep"}]}']},
                          source="s", file="/data/s.jsonl", seed=1)
    assert out["id"] == ["s:0", "s:1"]
    assert out["error"][0] is None
    bad = BadRecord.from_json(out["error"][1])
    assert bad.describe().startswith("/data/s.jsonl line 3: field messages[0].role = 'robot': unknown role")


def test_shuffle_key_depends_on_seed_and_id_only():
    assert shuffle_key(1, "a:0") == shuffle_key(1, "a:0")
    assert shuffle_key(1, "a:0") != shuffle_key(2, "a:0")
    assert 0 <= shuffle_key(123, "x:9") < 2**63


# --- tool-calling records ---------------------------------------------------------------------------------

from eagleflow.corpus.normalise import (BAD_TOOL_CALL, BAD_TOOLS, INVALID_UTF8, NON_TEXT_CONTENT,  # noqa: E402
                                        normalise_conversation)
from tests.fixtures.corpus.make_fixtures import ADD, REVERSE, TOOLS_OPENAI, TOOLS_SHAREGPT  # noqa: E402

ADD_TOOL = {"type": "function", "function": ADD}
REVERSE_TOOL = {"type": "function", "function": REVERSE}


def test_openai_tool_calls_tool_role_tools_and_reasoning_are_kept():
    conv = normalise_conversation(TOOLS_OPENAI[0])
    assert conv.tools == [ADD_TOOL]
    assert conv.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call add.",   # content null -> ""
         "tool_calls": [{"type": "function", "id": "call_1",
                         "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},  # JSON text -> object
        {"role": "tool", "content": "7", "tool_call_id": "call_1", "name": "add"},      # name from the call
        {"role": "assistant", "content": "3 plus 4 is 7."}]
    assert conv.uses_tools()


def test_parallel_calls_object_arguments_and_text_parts():
    conv = normalise_conversation(TOOLS_OPENAI[1])
    user, call, r1, r2, answer = conv.messages
    assert user == {"role": "user", "content": "Reverse kilo lima and add 1 2."}
    assert [c["function"] for c in call["tool_calls"]] == [
        {"name": "reverse_words", "arguments": {"words": ["kilo", "lima"]}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert call["content"] == "Two calls."
    assert (r1["name"], r1["tool_call_id"], r2["name"], r2["tool_call_id"], r2["content"]) == (
        "reverse_words", "c1", "add", "c2", "3")
    assert conv.tools == [REVERSE_TOOL, ADD_TOOL]


def test_sharegpt_function_calling_gives_the_openai_conversation():
    """glaive / LLaMA-Factory form: top-level system and tools (JSON text of bare schemas), function_call
    and observation / tool turns. Same messages as the OpenAI form, less the ids the ShareGPT form lacks."""
    def strip_ids(conv):
        for m in conv.messages:
            m.pop("tool_call_id", None)
            m.pop("reasoning_content", None)
            for c in m.get("tool_calls", ()):
                c.pop("id", None)
        return conv
    for sg, oa in zip(TOOLS_SHAREGPT, TOOLS_OPENAI):
        a, b = strip_ids(normalise_conversation(sg)), strip_ids(normalise_conversation(oa))
        assert a.messages == b.messages and a.tools == b.tools


def test_legacy_function_call_and_function_role():
    conv = normalise_conversation({"messages": [
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}},
        {"role": "function", "name": "add", "content": "3"}, {"role": "assistant", "content": "3"}]})
    assert conv.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "add",
                                                                               "arguments": {"a": 1, "b": 2}}}]
    assert conv.messages[2] == {"role": "tool", "content": "3", "name": "add"}


@pytest.mark.parametrize("record, field, kind", [
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", BAD_TOOL_CALL),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", BAD_TOOL_CALL),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.name", BAD_TOOL_CALL),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": {"name": "f"}}]},
     "messages[0].tool_calls", BAD_TOOL_CALL),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", MISSING_FIELD),
    ({"messages": [{"role": "tool", "content": None}]}, "messages[0].content", MISSING_FIELD),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type", NON_TEXT_CONTENT),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "[{oops"}, "tools", BAD_TOOLS),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"description": "no name"}]}, "tools[0].name", BAD_TOOLS),
    ({"conversations": [{"from": "function_call", "value": "add(1, 2)"}]}, "conversations[0].value", BAD_TOOL_CALL),
    ({"conversations": [{"from": "human", "value": "x"}], "system": 5}, "system", WRONG_TYPE),
])
def test_bad_tool_records_name_field_and_kind(record, field, kind):
    with pytest.raises(RecordError) as e:
        normalise_conversation(record)
    assert (e.value.field, e.value.kind) == (field, kind)


def test_non_text_parts_dropped_when_the_config_says_so():
    rec = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}},
                                                      {"type": "text", "text": "what is it?"}]},
                        {"role": "assistant", "content": "a cat"}]}
    conv = normalise_conversation(rec, non_text="drop")
    assert conv.messages[0] == {"role": "user", "content": "what is it?"} and conv.non_text_parts_dropped == 1


def test_structured_rows_with_arrow_nulls_and_invalid_utf8_lines():
    # a Parquet row: Arrow gave every message every field, nulls where absent
    row = {"messages": [{"role": "user", "content": "q", "tool_calls": None, "tool_call_id": None},
                        {"role": "assistant", "content": None, "tool_call_id": None,
                         "tool_calls": [{"id": "k", "type": "function",
                                         "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
                        {"role": "tool", "content": "3", "tool_calls": None, "tool_call_id": "k"}],
           "tools": [{"type": "function", "function": {"name": "add", "description": None,
                                                       "parameters": {"type": "object", "properties": {
                                                           "a": {"type": "integer"}, "words": None}}}}]}
    out = normalise_batch({"__row": [0], "messages": [row["messages"]], "tools": [row["tools"]]},
                          source="pq", file="/d/x.parquet", seed=1)
    assert out["error"] == [None] and out["uses_tools"] == [True]
    conv = json.loads(out["conversation"][0])
    assert conv["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    assert conv["messages"][2] == {"role": "tool", "content": "3", "tool_call_id": "k", "name": "add"}

    bad = normalise_batch({"__row": [0], "__where": ["line 6"], "__raw": ['{"x": "caf\ufffd"}'],
                           "__decode_error": ["not valid UTF-8: byte b'\\xe9' at byte 12 of the line"]},
                          source="s", file="/d/s.jsonl", seed=1)
    rec = BadRecord.from_json(bad["error"][0])
    assert (rec.kind, rec.where, rec.field) == (INVALID_UTF8, "line 6", "(line)")
    assert rec.describe().startswith("/d/s.jsonl line 6: field (line) = ") and "not valid UTF-8" in rec.describe()


def test_jsonl_reader_reports_invalid_utf8_by_line(tmp_path):
    from eagleflow.corpus.sources import _jsonl_lines
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n\n{"b": "caf\xe9"}\n')
    rows = list(_jsonl_lines(str(p), None))
    assert [(r["__where"], r["__decode_error"] is None) for r in rows] == [("line 1", True), ("line 3", False)]
    assert "byte b'\\xe9' at byte 11" in rows[1]["__decode_error"]
