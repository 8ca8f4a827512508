"""One message schema, and a precise error for each kind of bad record."""
from __future__ import annotations

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
