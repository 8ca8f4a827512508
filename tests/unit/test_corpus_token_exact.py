"""``eagleflow_token_exact`` is taken only from the generation phase's rows, and only when it is sane."""
from __future__ import annotations

import json

import pytest

from eagleflow.corpus.normalise import BadRecord, Conversation, normalise_batch
from eagleflow.corpus.tokenize import token_exact_record

MSGS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
GOOD = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "span_ends": [4]}


def _norm(te, token_exact):
    raw = json.dumps({"messages": MSGS, "eagleflow_token_exact": te})
    out = normalise_batch({"__row": [3], "__where": ["line 4"], "__raw": [raw], "__decode_error": [None]},
                          source="chat", file="/data/chat.jsonl", seed=1, token_exact=token_exact)
    return out["conversation"][0], (BadRecord.from_json(out["error"][0]) if out["error"][0] else None)


def test_a_raw_source_carrying_the_key_is_a_bad_record_naming_source_line_and_field():
    conv, bad = _norm(GOOD, token_exact=False)
    assert conv is None
    assert (bad.source, bad.file, bad.where, bad.field) == ("chat", "/data/chat.jsonl", "line 4", "eagleflow_token_exact")
    assert "only by the generation phase" in bad.problem


def test_generated_rows_keep_their_ids():
    conv, bad = _norm(GOOD, token_exact=True)
    assert bad is None and Conversation.from_json(conv).token_exact == GOOD


@pytest.mark.parametrize("te,field", [
    ({**GOOD, "loss_mask": [0, 1, 1]}, "eagleflow_token_exact.loss_mask"),
    ({**GOOD, "loss_mask": [0, 0, 2, 1]}, "eagleflow_token_exact.loss_mask"),
    ({**GOOD, "input_ids": [5, "6", 7, 8]}, "eagleflow_token_exact.input_ids"),
    ({**GOOD, "input_ids": [5, -1, 7, 8]}, "eagleflow_token_exact.input_ids"),
    ({**GOOD, "span_ends": [9]}, "eagleflow_token_exact.span_ends"),
    ({**GOOD, "span_ends": [2]}, "eagleflow_token_exact.span_ends"),   # ends on a masked-out token
    ({"input_ids": [5]}, "eagleflow_token_exact.loss_mask"),
    ([1, 2], "eagleflow_token_exact")])
def test_a_misaligned_generated_row_is_a_bad_record_naming_the_field(te, field):
    conv, bad = _norm(te, token_exact=True)
    assert conv is None and bad.field == field and bad.where == "line 4"


def test_ids_outside_the_tokenizers_vocabulary_are_refused():
    conv = Conversation(MSGS, token_exact=GOOD)
    assert token_exact_record(conv, max_length=64, over_max_length="cut_at_message", vocab_size=9).ids == GOOD["input_ids"]
    with pytest.raises(ValueError, match=r"token id 8, outside this tokenizer's vocabulary \(8 ids\)"):
        token_exact_record(conv, max_length=64, over_max_length="cut_at_message", vocab_size=8)


def test_a_raw_source_carrying_the_key_reports_the_values_type_not_absent():
    _, bad = _norm(GOOD, token_exact=False)
    assert bad.value != "(absent)" and "dict with keys" in bad.value and "input_ids" in bad.value
    _, bad = _norm([1, 2], token_exact=False)
    assert "list of 2 items" in bad.value


def test_a_vocabulary_refusal_inside_the_map_names_the_record_source_and_where(demo_assets):
    from eagleflow.corpus.tokenize import load_tokenizer, tokenize_batch
    vocab = len(load_tokenizer(demo_assets["target_model"]))
    te = {"input_ids": [5, 6, 7, vocab + 3], "loss_mask": [0, 0, 1, 1], "span_ends": [4]}
    ok = Conversation(MSGS, token_exact=GOOD).to_json()
    batch = {"conversation": [ok, Conversation(MSGS, token_exact=te).to_json()], "id": ["generated:0", "generated:1"],
             "source": ["generated", "generated"], "where": ["line 1", "line 2"]}
    with pytest.raises(ValueError, match=r"record generated:1 \(source generated, line 2\): .*token id "
                                         rf"{vocab + 3}, outside"):
        tokenize_batch(batch, model_path=demo_assets["target_model"], max_length=64, method="generation_tags")
