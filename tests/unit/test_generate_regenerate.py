"""The generation core: token-exact records, tool-faithfulness, bad records, max_new_tokens hits.

A scripted target (the turns a test wants, as the real tokenizer's ids) drives the rules; the tiny real
target (transformers, CPU) checks token-exactness by being re-run on the stored records.
"""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eagleflow.corpus.normalise import Conversation, normalise_conversation
from eagleflow.demo_assets import CHAT_TEMPLATE
from eagleflow.phases.generate.regenerate import (BAD, CUT_AT_CONTEXT, CUT_AT_DIVERGING_CALL, CUT_AT_TRUNCATED, DROPPED_TRUNCATED,
                                           EXCEEDS_CONTEXT, REGENERATED, STARTS_WITH_ASSISTANT, TOOL_WITHOUT_CALL,
                                           Generation, RecordBuilder, Sampling, calls_identical, parse_turn)

# The demo template, except that an assistant turn's reasoning is rendered only when it is the last message
# (as Qwen3-style templates drop the reasoning of earlier turns from the history)
DROPS_HISTORY_REASONING = CHAT_TEMPLATE.replace("{% if m.get('reasoning_content') %}",
                                                "{% if m.get('reasoning_content') and loop.last %}")
assert DROPS_HISTORY_REASONING != CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok(demo_assets):
    t = AutoTokenizer.from_pretrained(demo_assets["target_model"])
    t.chat_template = DROPS_HISTORY_REASONING
    return t


class Scripted:
    """A target that answers each prompt with the next scripted text (its ids by the real tokenizer)."""

    def __init__(self, tok, turns: list[str], finish: str = "stop"):
        self.tok, self.turns, self.finish, self.prompts, self.outputs = tok, list(turns), finish, [], []

    def __call__(self, input_ids, *, max_new_tokens, temperature, top_p, seed, stop_token_ids):
        self.prompts.append(list(input_ids))
        ids = self.tok(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        ids = ids + [self.tok.eos_token_id] if self.finish == "stop" else ids[:max_new_tokens]
        self.outputs.append(ids)
        return Generation(ids, self.finish)


def _builder(tok, target, **kw):
    return RecordBuilder(tok, target, Sampling(temperature=0.0, max_new_tokens=kw.pop("max_new_tokens", 64)),
                         max_length=kw.pop("max_length", 2048), **kw)


def _assert_token_exact(res, target):
    """Every span is what the target returned, given exactly the tokens before it in the record; mask = spans."""
    assert len(res.spans) == len(target.prompts) == len(target.outputs)
    for (start, end), prompt, out in zip(res.spans, target.prompts, target.outputs):
        assert res.input_ids[:start] == prompt
        assert res.input_ids[start:end] == out
    want = [0] * len(res.input_ids)
    for start, end in res.spans:
        want[start:end] = [1] * (end - start)
    assert res.loss_mask == want


def test_a_template_that_drops_history_reasoning_still_gives_a_token_exact_record(tok):
    conv = Conversation([{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha bravo"},
                         {"role": "assistant", "content": "old one"}, {"role": "user", "content": "charlie"},
                         {"role": "assistant", "content": "old two"}])
    target = Scripted(tok, ["<think>first thoughts</think>one answer", "<think>second thoughts</think>two"])
    res = _builder(tok, target).regenerate(conv, record_id="s:0", source="s", file="f.jsonl", where="line 1")
    assert res.status == REGENERATED and res.turns_regenerated == 2
    _assert_token_exact(res, target)
    # the target saw its first reasoning before its second turn, so the record keeps it there...
    assert "first thoughts" in tok.decode(res.input_ids[:res.spans[1][0]])
    assert [m.get("reasoning_content") for m in res.messages if m["role"] == "assistant"] == \
        ["first thoughts", "second thoughts"]
    # ...while re-rendering the regenerated messages drops it: that rendering is NOT what the target saw
    rerendered = tok.apply_chat_template(res.messages, tokenize=False)
    assert "first thoughts" not in rerendered and tok.decode(res.input_ids) != rerendered


def test_records_without_tools_regenerate_every_assistant_turn(tok):
    conv = Conversation([{"role": "user", "content": f"q{i}"} if k == 0 else {"role": "assistant", "content": "x"}
                         for i in range(3) for k in range(2)])
    target = Scripted(tok, ["a0", "a1", "a2"])
    res = _builder(tok, target).regenerate(conv, record_id="s:1", source="s", file="f", where="line 2")
    assert res.status == REGENERATED and res.turns_regenerated == 3
    assert [m["content"] for m in res.messages if m["role"] == "assistant"] == ["a0", "a1", "a2"]
    assert [m["content"] for m in res.messages if m["role"] == "user"] == ["q0", "q1", "q2"]
    _assert_token_exact(res, target)


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def _tool_conv():
    return normalise_conversation({"tools": TOOLS, "messages": [
        {"role": "user", "content": "find kilo"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "kilo", "n": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "RESULT-lima-42"},
        {"role": "assistant", "content": "it is lima"}]})


def test_an_identical_call_keeps_the_original_tool_result(tok):
    # same function, same arguments after JSON normalisation (other key order and spacing)
    target = Scripted(tok, ['<tool_call>{"arguments": {"n": 2,   "q": "kilo"}, "name": "lookup"}</tool_call>',
                            "lima it is"])
    res = _builder(tok, target).regenerate(_tool_conv(), record_id="t:0", source="t", file="f", where="line 1")
    assert res.status == REGENERATED and res.turns_regenerated == 2
    assert [m["role"] for m in res.messages] == ["user", "assistant", "tool", "assistant"]
    assert res.messages[2]["content"] == "RESULT-lima-42" and res.messages[1]["tool_calls"][0]["id"] == "c1"
    assert "RESULT-lima-42" in tok.decode(res.input_ids[res.spans[0][1]:res.spans[1][0]])
    _assert_token_exact(res, target)


def test_the_first_diverging_call_ends_the_record_with_the_targets_own_call(tok):
    target = Scripted(tok, ['<tool_call>{"name": "lookup", "arguments": {"q": "mike", "n": 2}}</tool_call>'])
    res = _builder(tok, target).regenerate(_tool_conv(), record_id="t:1", source="t", file="f", where="line 2")
    assert res.status == CUT_AT_DIVERGING_CALL and res.cut_turn == 1 and len(target.prompts) == 1
    assert res.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"q": "mike", "n": 2}
    assert "RESULT-lima-42" not in tok.decode(res.input_ids)
    _assert_token_exact(res, target)
    # a text answer where the original called diverges too, and so does a call where it answered in text
    res2 = _builder(tok, Scripted(tok, ["no tools today"])).regenerate(_tool_conv(), record_id="t:2", source="t",
                                                                       file="f", where="line 3")
    assert res2.status == CUT_AT_DIVERGING_CALL and [m["role"] for m in res2.messages] == ["user", "assistant"]


def test_a_call_written_with_parameters_is_read_as_sglang_reads_it(tok):
    # {"name", "parameters"} is the same call as {"name", "arguments"} (SGLang's parse_base_json): the original
    # tool result is kept; read as add({}) it would differ and cut the record
    target = Scripted(tok, ['<tool_call>{"name": "lookup", "parameters": {"n": 2, "q": "kilo"}}</tool_call>',
                            "lima it is"])
    res = _builder(tok, target).regenerate(_tool_conv(), record_id="t:p", source="t", file="f", where="line 1")
    assert res.status == REGENERATED and res.turns_regenerated == 2
    assert res.messages[1]["tool_calls"][0]["function"]["arguments"] == {"n": 2, "q": "kilo"}
    assert res.messages[2]["content"] == "RESULT-lima-42"
    _assert_token_exact(res, target)
    assert parse_turn('<tool_call>{"name":"add","parameters":{"a":1,"b":2}}</tool_call>')["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]


@pytest.mark.parametrize("call", [
    '{"name": "lookup", "parameters": {"q": "kilo", "n": 2}, "arguments": {"q": "kilo", "n": 2}}',  # both keys
    '{"name": "lookup", "arguments": [["q", "kilo"], ["n", 2]]}',                                   # not an object
    '{"name": "lookup", "arguments": "q=kilo n=2"}',                                               # not JSON
    '{"name": "lookup", "args": {"q": "kilo", "n": 2}}',                                          # unknown key
])
def test_a_call_of_unknown_shape_is_a_different_call(tok, call):
    res = _builder(tok, Scripted(tok, [f"<tool_call>{call}</tool_call>"])).regenerate(
        _tool_conv(), record_id="t:u", source="t", file="f", where="line 1")
    assert res.status == CUT_AT_DIVERGING_CALL and res.cut_turn == 1
    assert "RESULT-lima-42" not in tok.decode(res.input_ids)
    assert parse_turn(f"<tool_call>{call}</tool_call>")["malformed_calls"] == 1


def test_calls_compare_by_function_and_normalised_arguments():
    a = [{"function": {"name": "f", "arguments": {"x": [1, 2], "y": "z"}}}]
    assert calls_identical(a, [{"function": {"name": "f", "arguments": '{"y":"z","x":[1,2]}'}}])
    assert not calls_identical(a, [{"function": {"name": "g", "arguments": {"x": [1, 2], "y": "z"}}}])
    assert not calls_identical(a, [{"function": {"name": "f", "arguments": {"x": [2, 1], "y": "z"}}}])
    assert not calls_identical(a, a + a) and not calls_identical(a, None)
    m = parse_turn('<think>hm</think>ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert m == {"role": "assistant", "reasoning_content": "hm", "content": "ok",
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert parse_turn("<tool_call>not json</tool_call>")["malformed_calls"] == 1


@pytest.mark.parametrize("messages, kind, field", [
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}], STARTS_WITH_ASSISTANT,
     "messages[0].role"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"}], STARTS_WITH_ASSISTANT,
     "messages[1].role"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}],
     TOOL_WITHOUT_CALL, "messages[1].role"),
])
def test_records_that_cannot_be_regenerated_are_named(tok, messages, kind, field):
    target = Scripted(tok, [])
    res = _builder(tok, target).regenerate(Conversation(messages), record_id="b:4", source="b",
                                           file="/data/b.jsonl", where="line 5")
    assert res.status == BAD and not target.prompts
    assert (res.bad["kind"], res.bad["field"], res.bad["source"], res.bad["file"], res.bad["where"]) == \
        (kind, field, "b", "/data/b.jsonl", "line 5")


def test_a_prompt_over_the_context_is_a_bad_record(tok):
    conv = Conversation([{"role": "user", "content": "alpha " * 200}, {"role": "assistant", "content": "a"}])
    res = _builder(tok, Scripted(tok, []), max_length=64).regenerate(conv, record_id="b:0", source="b", file="f",
                                                                      where="line 1")
    assert res.status == BAD and res.bad["kind"] == EXCEEDS_CONTEXT and "64" in res.bad["problem"]


def test_max_new_tokens_hits_are_kept_or_dropped_by_setting(tok):
    conv = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}])
    long = "alpha bravo charlie delta echo foxtrot golf hotel"
    kept = _builder(tok, t := Scripted(tok, [long], finish="length"), max_new_tokens=4).regenerate(
        conv, record_id="m:0", source="m", file="f", where="line 1")
    assert kept.status == CUT_AT_TRUNCATED and kept.truncated_turns == 1 and kept.cut_turn == 1
    assert len(kept.messages) == 2 and kept.input_ids[-4:] == t.outputs[0]   # ends with the target's own ids
    dropped = _builder(tok, Scripted(tok, [long], finish="length"), max_new_tokens=4, keep_truncated=False).regenerate(
        conv, record_id="m:1", source="m", file="f", where="line 2")
    assert dropped.status == DROPPED_TRUNCATED and not dropped.kept


def test_a_turn_ended_by_the_contexts_room_is_cut_at_context_not_a_max_new_tokens_hit(tok):
    conv = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}])
    long = "alpha bravo charlie delta echo foxtrot golf hotel"
    probe = Scripted(tok, ["a", "b"])
    _builder(tok, probe).regenerate(conv, record_id="c:0", source="c", file="f", where="line 1")
    prompt = len(probe.prompts[0])
    res = _builder(tok, t := Scripted(tok, [long], finish="length"), max_new_tokens=64,
                   max_length=prompt + 3, keep_truncated=False).regenerate(conv, record_id="c:1", source="c",
                                                                           file="f", where="line 2")
    assert (res.status, res.cut_turn, res.context_cut_turns, res.truncated_turns) == (CUT_AT_CONTEXT, 1, 1, 0)
    assert res.kept and len(t.outputs[0]) == 3 and res.input_ids[-3:] == t.outputs[0]
    assert len(res.input_ids) == prompt + 3


def test_a_finish_other_than_stop_or_length_is_an_error_not_a_stopped_turn(tok):
    conv = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    with pytest.raises(ValueError, match=r"record a:0, assistant turn 1: the target's finish is 'abort'"):
        _builder(tok, Scripted(tok, ["half"], finish="abort")).regenerate(conv, record_id="a:0", source="a",
                                                                         file="f", where="line 1")


@pytest.mark.slow
def test_the_real_target_rerun_on_the_stored_record_reproduces_every_span(demo_assets, tok):
    """Regenerate with the tiny transformers target; then re-run it on the stored record: each span's prefix, with
    the same seed, gives the span again, and (greedy) the teacher-forced argmax at every span position is the
    stored token."""
    import torch

    from eagleflow.engines.hf.server import CaptureModel
    from eagleflow.phases.generate.regenerate import turn_seed
    model = CaptureModel(demo_assets["target_model"])
    eos = tok.eos_token_id
    for temperature in (0.0, 0.9):
        def target(ids, **kw):
            out, finish = model.generate_ids(ids, **kw)
            return Generation(out, finish)
        b = RecordBuilder(tok, target, Sampling(temperature=temperature, max_new_tokens=6, seed=3), max_length=512,
                          stop_token_ids=[eos])
        with open(demo_assets["sources"][0]["path"]) as f:
            lines = [json.loads(x) for x in f.read().splitlines()[:3]]
        for n, rec in enumerate(lines):
            res = b.regenerate(normalise_conversation(rec), record_id=f"d:{n}", source="d", file="f",
                               where=f"line {n + 1}")
            assert res.kept and res.spans
            for turn, (start, end) in enumerate(res.spans, start=1):
                again, _ = model.generate_ids(res.input_ids[:start], max_new_tokens=end - start, temperature=temperature,
                                              top_p=1.0, seed=turn_seed(3, f"d:{n}", turn), stop_token_ids=[eos])
                assert again == res.input_ids[start:end]
            if temperature == 0.0:
                with torch.inference_mode():
                    logits = model.model(torch.tensor([res.input_ids])).logits[0]
                for start, end in res.spans:
                    assert logits[start - 1:end - 1].argmax(-1).tolist() == res.input_ids[start:end]


def test_the_corpus_phase_takes_regenerated_ids_as_they_are_and_cuts_them_only_at_a_span_end():
    from eagleflow.corpus.tokenize import token_exact_record
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    ids, mask = list(range(100, 120)), [0] * 5 + [1] * 5 + [0] * 5 + [1] * 5
    conv = Conversation(msgs, token_exact={"input_ids": ids, "loss_mask": mask, "span_ends": [10, 20]})
    whole = token_exact_record(conv, max_length=64, over_max_length="cut_at_message")
    assert (whole.ids, whole.mask, whole.status, whole.turns) == (ids, mask, "whole", 4)
    cut = token_exact_record(conv, max_length=15, over_max_length="cut_at_message")
    assert (cut.ids, cut.mask, cut.status, cut.turns) == (ids[:10], mask[:10], "cut", 2)
    assert token_exact_record(conv, max_length=15, over_max_length="drop").drop_reason == "over_max_length"
    assert token_exact_record(conv, max_length=15, over_max_length="truncate").ids == ids[:15]
    # the conversation JSON the corpus map passes carries the ids through
    assert Conversation.from_json(conv.to_json()).token_exact == conv.token_exact
