"""Loss masks checked token by token on the demo's known template, by both methods; tool calls and
their results rendered and masked as written out by hand; templates that drop content refused;
long trajectories cut at a message boundary, dropped or truncated."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagleflow.corpus.normalise import Conversation, normalise_conversation
from eagleflow.corpus.tokenize import (CUT_AT_MESSAGE, DROP, GENERATION_TAGS, OVER_MAX_LENGTH, PREFIX_DIFF,
                                       TRUNCATE, assistant_token_ends, dropped_content, encode_conversations,
                                       encode_record, mask_method_for, render, tokenise_record, tokenize_batch)
from eagleflow.demo_assets import CHAT_TEMPLATE
from tests.fixtures.corpus.make_fixtures import TOOLS_OPENAI, TOOLS_SHAREGPT

MESSAGES = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Count 1 to 3"},
            {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "1, 2, 3"}]
NO_TAGS = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# The demo's template before it learnt tools: role and content only.
ROLE_CONTENT_ONLY = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def _tok(demo_assets, template=None):
    t = AutoTokenizer.from_pretrained(demo_assets["target_model"])
    if template is not None:
        t.chat_template = template
    return t


@pytest.fixture(scope="module")
def tok(demo_assets):
    return _tok(demo_assets)


@pytest.fixture(scope="module")
def tok_no_tags(demo_assets):
    return _tok(demo_assets, NO_TAGS)


def _from_pieces(tok, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    for text, m in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([m] * len(piece))
    return ids, mask


def _expected_mask(tok, messages):
    """Independent expectation: tokenize the template's pieces one by one; 1 exactly on assistant content + <|eot_id|>."""
    pieces = [(tok.bos_token, 0)]
    for msg in messages:
        pieces += [(f"<|start_header_id|>{msg['role']}<|end_header_id|>\n\n", 0),
                   (msg["content"] + "<|eot_id|>", 1 if msg["role"] == "assistant" else 0)]
    return _from_pieces(tok, pieces)


def _masked_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


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


# --- tool calls: the expected rendering and masked spans, written out by hand -------------------------------

ADD_SCHEMA = ('{"name": "add", "description": "Add two integers.", "parameters": {"type": "object", "properties": '
              '{"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}')
TOOL_RECORD_PIECES = [  # TOOLS_OPENAI[0] under the demo template: (text, in the loss mask)
    ("<|begin_of_text|>", 0),
    ("<|start_header_id|>system<|end_header_id|>\n\nTools:\n" + ADD_SCHEMA + "\n<|eot_id|>", 0),
    ("<|start_header_id|>system<|end_header_id|>\n\nUse tools.<|eot_id|>", 0),
    ("<|start_header_id|>user<|end_header_id|>\n\nWhat is 3 plus 4?<|eot_id|>", 0),
    ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
    ('<think>Call add.</think><tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|eot_id|>', 1),
    ("<|start_header_id|>tool<|end_header_id|>\n\n7<|eot_id|>", 0),
    ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
    ("3 plus 4 is 7.<|eot_id|>", 1),
]
PARALLEL_MASKED = [  # TOOLS_OPENAI[1]: one assistant turn with text and two calls, then the answer
    'Two calls.<tool_call>{"name": "reverse_words", "arguments": {"words": ["kilo", "lima"]}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|eot_id|>',
    "lima kilo, and 3.<|eot_id|>",
]


@pytest.mark.parametrize("method", [GENERATION_TAGS, PREFIX_DIFF])
def test_tool_call_record_masks_calls_not_results(tok, tok_no_tags, method):
    t = tok if method == GENERATION_TAGS else tok_no_tags
    enc = encode_record(t, normalise_conversation(TOOLS_OPENAI[0]), method)
    assert enc.text == "".join(p for p, _ in TOOL_RECORD_PIECES)
    assert (enc.ids, enc.mask) == _from_pieces(tok, TOOL_RECORD_PIECES)
    assert _masked_runs(tok, enc.ids, enc.mask) == [p for p, m in TOOL_RECORD_PIECES if m]

    par = encode_record(t, normalise_conversation(TOOLS_OPENAI[1]), method)
    assert _masked_runs(tok, par.ids, par.mask) == PARALLEL_MASKED
    unmasked = tok.decode([i for i, m in zip(par.ids, par.mask) if not m])
    for not_trained in ("Reverse kilo lima and add 1 2.", "lima kilo<|eot_id|>", "3<|eot_id|>", '"reverse_words", '
                        '"description"'):
        assert not_trained in unmasked  # user text, both tool results, the tools list: context only


def test_sharegpt_function_calling_masks_the_same_spans(tok):
    for sg, expected in ((TOOLS_SHAREGPT[0], ['<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
                                                '<|eot_id|>', "3 plus 4 is 7.<|eot_id|>"]),
                         (TOOLS_SHAREGPT[1], PARALLEL_MASKED)):
        enc = encode_record(tok, normalise_conversation(sg), GENERATION_TAGS)
        assert _masked_runs(tok, enc.ids, enc.mask) == expected
        assert dropped_content(tok, normalise_conversation(sg)) is None


# --- templates that cannot render tools ----------------------------------------------------------------------

@pytest.mark.parametrize("template, problem", [
    (ROLE_CONTENT_ONLY, "tools[0] (function 'add') is not in the rendered text: the template ignores the `tools`"),
    (CHAT_TEMPLATE.replace("<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} "
                           "| tojson }}</tool_call>", ""),
     "messages[2].tool_calls[0].function.name 'add' is not in the rendered text: the template drops tool calls"),
    (CHAT_TEMPLATE.replace("{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}",
                           "{{ c['function']['name'] }}"),
     "messages[2].tool_calls[0].function.arguments key 'a' is not in the rendered text: the template drops "
     "tool-call arguments"),
    (CHAT_TEMPLATE.replace("{% else %}{{ m['content'] }}<|eot_id|>{% endif %}",
                           "{% elif m['role'] != 'tool' %}{{ m['content'] }}<|eot_id|>{% endif %}"),
     "messages[3].content (tool, '7') is not in the rendered text: the template drops tool messages here"),
])
def test_dropped_content_is_found(demo_assets, template, problem):
    t = _tok(demo_assets, template)
    conv = normalise_conversation(TOOLS_OPENAI[0])
    rec = tokenise_record(t, conv, max_length=4096, method=GENERATION_TAGS)
    assert rec.content_dropped is not None and rec.content_dropped.startswith(problem), rec.content_dropped
    # the same template renders a record without tools fine
    assert tokenise_record(t, Conversation(MESSAGES), max_length=4096, method=GENERATION_TAGS).content_dropped is None


def test_template_raising_and_reasoning_left_out(demo_assets):
    raising = _tok(demo_assets, CHAT_TEMPLATE.replace(
        "{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool role not supported') }}{% endif %}"))
    rec = tokenise_record(raising, normalise_conversation(TOOLS_OPENAI[0]), max_length=4096, method=GENERATION_TAGS)
    assert rec.template_error and "tool role not supported" in rec.template_error and rec.ids == []
    no_reasoning = _tok(demo_assets, CHAT_TEMPLATE.replace(
        "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}", ""))
    rec = tokenise_record(no_reasoning, normalise_conversation(TOOLS_OPENAI[0]), max_length=4096,
                          method=GENERATION_TAGS)
    assert rec.reasoning_not_rendered == 1 and rec.content_dropped is None and rec.drop_reason is None


# --- long trajectories ---------------------------------------------------------------------------------------

def _trajectory(rounds: int) -> Conversation:
    msgs = [{"role": "user", "content": "Add these up one by one."}]
    for r in range(rounds):
        cid = f"c{r}"
        msgs += [{"role": "assistant", "content": f"Step {r}.", "tool_calls": [
                     {"id": cid, "type": "function", "function": {"name": "add", "arguments": {"a": r, "b": 10}}}]},
                 {"role": "tool", "tool_call_id": cid, "name": "add", "content": str(r + 10)}]
    msgs.append({"role": "assistant", "content": "Done."})
    return Conversation(msgs, [{"type": "function", "function": {"name": "add", "parameters": {}}}])


@pytest.mark.parametrize("method", [GENERATION_TAGS, PREFIX_DIFF])
def test_cut_at_message_boundary(tok, tok_no_tags, method):
    t = tok if method == GENERATION_TAGS else tok_no_tags
    conv = _trajectory(4)
    full = encode_record(t, conv, method)
    ends = assistant_token_ends(t, conv, full)
    assistant_idx = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    assert len(ends) == 5 and ends[-1] == len(full.ids)
    for i, end in zip(assistant_idx, ends):  # each end is exactly where that message's rendering stops
        assert tok.decode(full.ids[:end]) == render(t, conv, upto=i + 1)

    limit = ends[2] + 3  # room for three assistant messages and a bit of the next tool result
    rec = tokenise_record(t, conv, max_length=limit, method=method, over_max_length=CUT_AT_MESSAGE)
    assert rec.ids == full.ids[:ends[2]] and rec.mask == full.mask[:ends[2]]
    assert tok.decode(rec.ids).endswith('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 10}}</tool_call>'
                                        "<|eot_id|>")
    assert (rec.turns, rec.tool_calls, rec.tool_messages, rec.drop_reason) == (assistant_idx[2] + 1, 3, 2, None)

    assert tokenise_record(t, conv, max_length=ends[0] - 1, method=method).drop_reason == OVER_MAX_LENGTH
    dropped = tokenise_record(t, conv, max_length=limit, method=method, over_max_length=DROP)
    assert (dropped.drop_reason, dropped.ids) == (OVER_MAX_LENGTH, [])
    cut = tokenise_record(t, conv, max_length=limit, method=method, over_max_length=TRUNCATE)
    assert cut.ids == full.ids[:limit] and cut.mask == full.mask[:limit] and cut.turns == len(conv.messages)
    whole = tokenise_record(t, conv, max_length=len(full.ids), method=method)
    assert whole.ids == full.ids and (whole.tool_calls, whole.tool_messages) == (4, 4)


def test_tokenize_batch_columns_and_drop_reasons(demo_assets, tok):
    only_user = Conversation([{"role": "user", "content": "hello there"}])
    late_answer = Conversation([{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}])
    convs = [Conversation(MESSAGES), only_user, late_answer, normalise_conversation(TOOLS_OPENAI[0])]
    out = tokenize_batch({"conversation": [c.to_json() for c in convs], "id": ["a:0", "a:1", "a:2", "a:3"]},
                         model_path=demo_assets["target_model"], max_length=45, method=GENERATION_TAGS,
                         over_max_length=TRUNCATE).to_pydict()
    assert out["id"] == ["a:0", "a:1", "a:2", "a:3"]  # other columns pass through
    assert out["num_tokens"][:3] == [45, len(_expected_mask(tok, only_user.messages)[0]), 45]
    assert all(len(x) == len(m) == n for x, m, n in zip(out["input_ids"], out["loss_mask"], out["num_tokens"]))
    assert out["length_status"][:3] == ["truncated", "whole", "truncated"]
    assert out["drop_reason"][:3] == [None, "no_assistant_tokens", "no_assistant_tokens_after_truncation"]
    assert out["loss_mask"][0] == _expected_mask(tok, MESSAGES)[1][:45]
    assert out["turns"][:3] == [5, 1, 2] and out["tool_calls"] == [0, 0, 0, 1] and out["tool_messages"] == [0, 0, 0, 1]
    assert out["template_error"] == [None] * 4 and out["content_dropped"] == [None] * 4

    cut = tokenize_batch({"conversation": [c.to_json() for c in convs]}, model_path=demo_assets["target_model"],
                         max_length=45, method=GENERATION_TAGS).to_pydict()
    # cut at a message boundary: the first record keeps its first answer whole; the others have none that fits
    first_answer_end = len(_expected_mask(tok, MESSAGES[:3])[0])
    assert cut["num_tokens"][0] == first_answer_end and cut["turns"][0] == 3 and cut["length_status"][0] == "cut"
    assert cut["drop_reason"] == [None, "no_assistant_tokens", "over_max_length", "over_max_length"]
