"""Regenerate one record: every assistant turn written by the target, token-exact and faithful to tools.

Turns are regenerated in order, each conditioned on the history as regenerated
so far. The record is built as a token sequence, never re-rendered afterwards:

    P_1 = tokens(render(messages before the first assistant turn, generation prompt))
    G_k = the ids the target returned for prompt P_k (kept as they are: never text re-tokenised)
    P_k+1 = P_k + G_k + tokens(D_k)

where D_k is the template's text between turn k and the next generation prompt
(the end of turn k after the stop token, the user or tool messages that
follow, the next assistant header). So the prompt the server saw for turn k+1
is exactly the record so far plus D_k, and **every assistant span in the
record is exactly what the target produced given exactly the tokens before it
in that record**. A template that drops the reasoning of earlier turns when it
renders the history would, re-rendered, put different tokens before a later
turn than the target saw; built this way the target sees (and the record
keeps) its own earlier turns as it wrote them, reasoning included. The loss
mask is 1 exactly on the G_k spans (``spans`` in the stored record).

D_k is found by rendering: the regenerated history up to turn k (rendered as
the last message) must be a prefix of the history up to the next generation
prompt; where the template rewrites turn k once it is no longer last (it
drops its reasoning), both are rendered without reasoning, where the prefix
holds. A template for which neither holds is named in a ``TemplateError``.

Tools: a regenerated call identical to the original (same function names, same
arguments after JSON normalisation, same number of calls) keeps the original
tool results after it; at the first call that differs (or a call where the
original answered in text, or text where the original called) the record ends
with the target's own turn. Records without tools regenerate every assistant turn.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from eagleflow import bounded_json
from eagleflow.corpus.normalise import (BadRecord, Conversation, control_token_error, control_token_strings,
                                        short_repr)

# record outcomes
REGENERATED = "regenerated"                  # every assistant turn regenerated
CUT_AT_DIVERGING_CALL = "cut_at_diverging_call"   # ends with the target's call that differs from the original
CUT_AT_CONTEXT = "cut_at_context"            # the next prompt would not fit max_length: ends at the last turn
CUT_AT_TRUNCATED = "cut_at_truncated"        # a turn hit max_new_tokens and is kept as the last turn
DROPPED_TRUNCATED = "dropped_truncated"      # a turn hit max_new_tokens and keep_truncated is off
FAILED = "failed"                            # the first generation came back empty
BAD = "bad"                                  # cannot be regenerated: see BAD_REASONS
KEPT_STATUSES = (REGENERATED, CUT_AT_DIVERGING_CALL, CUT_AT_CONTEXT, CUT_AT_TRUNCATED)

# bad record kinds (BadRecord.kind)
STARTS_WITH_ASSISTANT = "starts_with_assistant"
TOOL_WITHOUT_CALL = "tool_without_call"
EXCEEDS_CONTEXT = "exceeds_context"
NO_ASSISTANT_TURN = "no_assistant_turn"
BAD_REASONS = (STARTS_WITH_ASSISTANT, TOOL_WITHOUT_CALL, EXCEEDS_CONTEXT, NO_ASSISTANT_TURN)

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class TemplateError(ValueError):
    """The chat template does not let a record be built token-exactly; the message says why."""


@dataclass
class Generation:
    ids: list[int]
    finish: str            # "stop" (a stop token, included in ids) | "length" (max_new_tokens)


class Target(Protocol):
    def __call__(self, input_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, stop_token_ids: list[int]) -> Generation: ...


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 2048
    seed: int = 0
    reasoning: bool = True


@dataclass
class RecordResult:
    id: str
    source: str
    where: str
    status: str
    messages: list[dict] = field(default_factory=list)   # the regenerated conversation, as stored
    tools: list[dict] | None = None
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)  # [start, end) of each target-written span
    turns_regenerated: int = 0
    cut_turn: int | None = None          # 1-based assistant turn the record ended at (cut statuses)
    truncated_turns: int = 0             # turns that hit generate.max_new_tokens
    context_cut_turns: int = 0           # turns ended by the context's room (max_length), not max_new_tokens
    tokens_generated: int = 0
    generation_s: float = 0.0
    failure: str | None = None
    bad: dict | None = None              # BadRecord fields

    @property
    def kept(self) -> bool:
        return self.status in KEPT_STATUSES

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RecordResult":
        return cls(**bounded_json.loads(text, source="generation result"))   # a record read back: bounded

    def corpus_record(self) -> dict:
        """What the corpus phase reads: the conversation plus its token-exact ids, mask and span ends."""
        return {"messages": self.messages, "tools": self.tools,
                "eagleflow_token_exact": {"input_ids": self.input_ids, "loss_mask": self.loss_mask,
                                          "span_ends": [e for _, e in self.spans]}}


def turn_seed(seed: int, record_id: str, turn: int) -> int:
    """One seed per (run seed, record, turn): the same text whatever the shard, order or concurrency."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{record_id}\0{turn}".encode()).digest()[:8], "big") >> 1


def normalised_call(call: dict) -> tuple:
    fn = call.get("function", call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return fn.get("name"), json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def calls_identical(original: list[dict] | None, regenerated: list[dict] | None) -> bool:
    return [normalised_call(c) for c in original or []] == [normalised_call(c) for c in regenerated or []]


def parse_turn(text: str, tool_call_format: str = "hermes") -> dict:
    """The assistant message a generated text stands for: reasoning, content, tool calls (hermes format)."""
    if tool_call_format != "hermes":
        raise ValueError(f"generate.tool_call_format {tool_call_format!r}: only 'hermes' is supported")
    msg: dict = {"role": "assistant"}
    if "</think>" in text:
        reasoning, text = text.split("</think>", 1)
        reasoning = reasoning.replace("<think>", "", 1).strip()
        if reasoning:
            msg["reasoning_content"] = reasoning
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            d = json.loads(m.group(1))
        except ValueError:
            d = None
        args = _call_arguments(d)
        if args is not None:
            calls.append({"type": "function", "function": {"name": d["name"], "arguments": args}})
        else:   # a malformed call is still a call (it differs from any original one), kept as text
            msg["malformed_calls"] = msg.get("malformed_calls", 0) + 1
    msg["content"] = _TOOL_CALL.sub(lambda m: "" if _parses(m.group(1)) else m.group(0), text).strip()
    if calls:
        msg["tool_calls"] = calls
    return msg


_CALL_KEYS = {"name", "arguments", "parameters"}


def _call_arguments(d) -> dict | None:
    """The arguments of one hermes call object, read as SGLang reads them; None for a shape we do not know.

    SGLang (``BaseFormatDetector.parse_base_json``) takes ``parameters`` or else ``arguments`` and refuses a
    call that has both while streaming; so here: either key (not both), an object or a JSON string of one,
    no other key. Anything else is a malformed call, which differs from every original call."""
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or set(d) - _CALL_KEYS:
        return None
    if "arguments" in d and "parameters" in d:
        return None
    args = d.get("parameters", d.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return args if isinstance(args, dict) else None


def _parses(text: str) -> bool:
    try:
        d = json.loads(text)
    except ValueError:
        return False
    return _call_arguments(d) is not None


def check_record(conv: Conversation) -> tuple[str, str, str] | None:
    """(kind, field, problem) when the record cannot be regenerated, else None."""
    msgs = conv.messages
    first = next((i for i, m in enumerate(msgs) if m["role"] != "system"), None)
    if first is not None and msgs[first]["role"] == "assistant":
        return (STARTS_WITH_ASSISTANT, f"messages[{first}].role",
                "the conversation starts with an assistant turn: there is no prompt to regenerate it from")
    for i, m in enumerate(msgs):
        if m["role"] != "tool":
            continue
        j = i - 1
        while j >= 0 and msgs[j]["role"] == "tool":
            j -= 1
        if j < 0 or msgs[j]["role"] != "assistant" or not msgs[j].get("tool_calls"):
            return (TOOL_WITHOUT_CALL, f"messages[{i}].role",
                    "a tool result with no assistant tool call before it")
    if not any(m["role"] == "assistant" for m in msgs):
        return NO_ASSISTANT_TURN, "messages", "no assistant turn to regenerate"
    return None


def _strip_reasoning(msgs: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]


class RecordBuilder:
    """Renders with one tokenizer and one set of template kwargs; regenerates records through ``target``."""

    def __init__(self, tokenizer, target: Target, sampling: Sampling, *, max_length: int,
                 keep_truncated: bool = True, tool_call_format: str = "hermes",
                 stop_token_ids: list[int] | None = None):
        self.tok = tokenizer
        self.target = target
        self.sampling = sampling
        self.max_length = max_length
        self.keep_truncated = keep_truncated
        self.tool_call_format = tool_call_format
        self.stop_ids = list(stop_token_ids if stop_token_ids is not None else default_stop_ids(tokenizer))
        self.template_kwargs = {"enable_thinking": sampling.reasoning}
        self.control_tokens = control_token_strings(tokenizer)   # record text may never become one

    def render(self, messages: list[dict], tools, generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=generation_prompt, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def between(self, upto: list[dict], nxt: list[dict], tools, ended_on_stop: bool) -> str:
        """D_k: the text after turn k's stop token up to and including the next generation prompt."""
        closing = self._closing_text(upto, tools) if ended_on_stop else ""
        for u, n in ((upto, nxt), (_strip_reasoning(upto), _strip_reasoning(nxt))):
            x = self.render(u, tools)
            z = self.render(n, tools, generation_prompt=True)
            if z.startswith(x):
                return closing + z[len(x):]
        raise TemplateError("the chat template renders an earlier assistant turn differently once later messages "
                            "follow, in a way other than dropping its reasoning: the text between turns cannot be "
                            "found, so the record cannot be built token-exactly")

    def regenerate(self, conv: Conversation, *, record_id: str, source: str, file: str, where: str) -> RecordResult:
        res = RecordResult(id=record_id, source=source, where=where, status=REGENERATED, tools=conv.tools)
        problem = check_record(conv)
        if problem:
            return self._bad(res, file, *problem, value=short_repr(conv.messages[0] if conv.messages else None))
        control = control_token_error(conv, self.control_tokens)   # before any prompt is rendered
        if control is not None:
            return self._bad(res, file, control.kind, control.field, control.problem, value=short_repr(control.value))
        msgs = conv.messages
        j = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        hist = [dict(m) for m in msgs[:j]]
        ids = self.encode(self.render(hist, conv.tools, generation_prompt=True))
        mask = [0] * len(ids)
        record_end = 0       # the record ends here when a later turn cannot be made
        hist_end = 0         # and its messages here (the user or tool messages after the last turn are not kept)
        turn = 0
        started = time.monotonic()
        try:
            while True:
                room = self.max_length - len(ids)
                if room < 1:
                    if turn == 0:
                        return self._bad(res, file, EXCEEDS_CONTEXT, f"messages[:{j}]",
                                         f"the prompt before the first assistant turn is {len(ids)} tokens, "
                                         f"corpus.max_length is {self.max_length}", value=str(len(ids)))
                    res.status, res.cut_turn = CUT_AT_CONTEXT, turn
                    break
                turn += 1
                s = self.sampling
                out = self.target(ids, max_new_tokens=min(s.max_new_tokens, room), temperature=s.temperature,
                                  top_p=s.top_p, seed=turn_seed(s.seed, record_id, turn),
                                  stop_token_ids=self.stop_ids)
                if out.finish not in ("stop", "length"):
                    raise ValueError(f"record {record_id}, assistant turn {turn}: the target's finish is "
                                     f"{out.finish!r}, not stop or length")
                gen = list(out.ids)
                if not gen:
                    if turn == 1:
                        res.status, res.failure = FAILED, "empty_generation"
                        return res
                    res.status, res.cut_turn, res.failure = CUT_AT_CONTEXT, turn - 1, "empty_generation"
                    break
                res.spans.append([len(ids), len(ids) + len(gen)])
                ids += gen
                mask += [1] * len(gen)
                record_end = len(ids)
                res.tokens_generated += len(gen)
                res.turns_regenerated = turn
                ended_on_stop = out.finish == "stop" and gen[-1] in self.stop_ids
                body = gen[:-1] if ended_on_stop else gen
                msg = parse_turn(self.tok.decode(body, skip_special_tokens=False), self.tool_call_format)
                original = msgs[j]
                malformed = msg.pop("malformed_calls", 0)
                if msg.get("tool_calls") and original.get("tool_calls") and calls_identical(
                        original["tool_calls"], msg["tool_calls"]):
                    # the original results answer these calls: keep their ids so they stay linked
                    msg["tool_calls"] = [{**c, **({"id": o["id"]} if o.get("id") else {})}
                                         for c, o in zip(msg["tool_calls"], original["tool_calls"])]
                hist.append(msg)
                hist_end = len(hist)
                if out.finish == "length" and room < s.max_new_tokens:
                    # the context's room, not max_new_tokens, ended the turn: the record is full
                    res.context_cut_turns += 1
                    res.status, res.cut_turn = CUT_AT_CONTEXT, turn
                    break
                if out.finish == "length":
                    res.truncated_turns += 1
                    if not self.keep_truncated:
                        res.status = DROPPED_TRUNCATED
                        return res
                    res.status, res.cut_turn = CUT_AT_TRUNCATED, turn
                    break
                if malformed or ((original.get("tool_calls") or msg.get("tool_calls")) and not calls_identical(
                        original.get("tool_calls"), msg.get("tool_calls"))):
                    res.status, res.cut_turn = CUT_AT_DIVERGING_CALL, turn
                    break
                k = next((i for i in range(j + 1, len(msgs)) if msgs[i]["role"] == "assistant"), None)
                if k is None:
                    break
                upto = list(hist)
                hist += [dict(m) for m in msgs[j + 1:k]]
                delta = self.encode(self.between(upto, hist, conv.tools, ended_on_stop))
                ids += delta
                mask += [0] * len(delta)
                j = k
            if res.status != CUT_AT_TRUNCATED and res.spans and ids[record_end - 1] in self.stop_ids:
                tail = self._closing(hist[:hist_end], conv.tools)
                ids, mask = ids[:record_end] + tail, mask[:record_end] + [0] * len(tail)
            else:
                ids, mask = ids[:record_end], mask[:record_end]
            if len(ids) > self.max_length:   # the closing tokens after a turn that filled the context
                ids, mask = ids[:record_end], mask[:record_end]
        finally:
            res.generation_s = round(time.monotonic() - started, 4)
        res.messages, res.input_ids, res.loss_mask = hist[:hist_end], ids, mask
        return res

    def _closing_text(self, hist: list[dict], tools) -> str:
        """What the template puts after the last turn's stop token (e.g. a newline); "" when it cannot tell."""
        before = self.render(hist[:-1], tools, generation_prompt=True)
        alone = self.render(hist, tools)
        span = alone[len(before):] if alone.startswith(before) else ""
        ends = [(span.rfind(e), e) for e in (self.tok.decode([t]) for t in self.stop_ids) if e and e in span]
        if not ends:
            return ""
        at, e = max(ends)
        return span[at + len(e):]

    def _closing(self, hist: list[dict], tools) -> list[int]:
        rest = self._closing_text(hist, tools)
        return self.encode(rest) if rest else []

    def _bad(self, res: RecordResult, file: str, kind: str, fld: str, problem: str, value: str) -> RecordResult:
        res.status = BAD
        res.bad = asdict(BadRecord(source=res.source, file=file, where=res.where, field=fld, value=value,
                                   kind=kind, problem=problem))
        return res


def default_stop_ids(tokenizer, model_dir: str | None = None) -> list[int]:
    """The tokenizer's eos plus the model's generation_config eos ids (Llama 3 lists several)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    path = model_dir or getattr(tokenizer, "name_or_path", None)
    if path:
        try:
            with open(f"{path}/generation_config.json") as f:
                eos = json.load(f).get("eos_token_id")
            for t in eos if isinstance(eos, list) else [eos] if eos is not None else []:
                if int(t) not in ids:
                    ids.append(int(t))
        except (OSError, ValueError, TypeError):
            pass
    return ids


def regenerate_conversation(tokenizer, target: Target, conv: Conversation, *, sampling: Sampling, max_length: int,
                            record_id: str = "record:0", source: str = "record", file: str = "",
                            where: str = "line 1", keep_truncated: bool = True) -> RecordResult:
    """One record through a fresh builder (tests, the bench)."""
    b = RecordBuilder(tokenizer, target, sampling, max_length=max_length, keep_truncated=keep_truncated)
    return b.regenerate(conv, record_id=record_id, source=source, file=file, where=where)

