"""Loss masks checked token by token on the demo's known template, by both methods."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagleflow.corpus.tokenize import (GENERATION_TAGS, PREFIX_DIFF, encode_conversations, mask_method_for,
                                       tokenize_batch)
from eagleflow.demo_assets import CHAT_TEMPLATE

MESSAGES = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Count 1 to 3"},
            {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "1, 2, 3"}]


@pytest.fixture(scope="module")
def tok(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets["target_model"])


@pytest.fixture(scope="module")
def tok_no_tags(demo_assets):
    t = AutoTokenizer.from_pretrained(demo_assets["target_model"])
    t.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return t


def _expected_mask(tok, messages):
    """Independent expectation: tokenize the template's pieces one by one; 1 exactly on assistant content + <|eot_id|>."""
    ids, mask = [], []
    def add(text, m, special=False):
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([m] * len(piece))
    add(tok.bos_token, 0)
    for msg in messages:
        add(f"<|start_header_id|>{msg['role']}<|end_header_id|>\n\n", 0)
        add(msg["content"] + "<|eot_id|>", 1 if msg["role"] == "assistant" else 0)
    return ids, mask


@pytest.mark.parametrize("method", [GENERATION_TAGS, PREFIX_DIFF])
def test_mask_token_by_token(tok, method):
    [(ids, mask)] = encode_conversations(tok, [MESSAGES], method)
    exp_ids, exp_mask = _expected_mask(tok, MESSAGES)
    assert ids == exp_ids
    assert mask == exp_mask
    masked_text = [tok.decode([i]) for i, m in zip(ids, mask) if m]
    assert "".join(masked_text) == "1 2 3<|eot_id|>1, 2, 3<|eot_id|>"


def test_method_detection_and_fallback(tok, tok_no_tags):
    assert mask_method_for(tok) == GENERATION_TAGS
    assert mask_method_for(tok_no_tags) == PREFIX_DIFF
    [(ids, mask)] = encode_conversations(tok_no_tags, [MESSAGES], PREFIX_DIFF)
    assert (ids, mask) == _expected_mask(tok, MESSAGES)


def test_truncation_and_drop_reasons(demo_assets, tok):
    only_user = [{"role": "user", "content": "hello there"}]
    late_answer = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]
    out = tokenize_batch({"messages": [MESSAGES, only_user, late_answer], "id": ["a:0", "a:1", "a:2"]},
                         model_path=demo_assets["target_model"], max_length=45, method=GENERATION_TAGS).to_pydict()
    assert out["id"] == ["a:0", "a:1", "a:2"]  # other columns pass through
    assert out["num_tokens"] == [45, len(_expected_mask(tok, only_user)[0]), 45]
    ids, masks = out["input_ids"], out["loss_mask"]
    assert all(len(x) == len(m) == n for x, m, n in zip(ids, masks, out["num_tokens"]))
    assert ids[1] == _expected_mask(tok, only_user)[0]
    assert out["truncated"] == [True, False, True]
    assert out["drop_reason"] == [None, "no_assistant_tokens", "no_assistant_tokens_after_truncation"]
    assert masks[0] == _expected_mask(tok, MESSAGES)[1][:45] and ids[0] == _expected_mask(tok, MESSAGES)[0][:45]
