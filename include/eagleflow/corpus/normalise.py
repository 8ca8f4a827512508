"""One message schema for every source, and a precise report of each bad record.

A record arrives either as the raw text of a JSON line / array element, or as a
structured row (Parquet, a ``datasets`` directory). It leaves as a
``Conversation``: messages in the schema that ``apply_chat_template`` renders
(OpenAI's, as transformers documents it) plus the record's ``tools`` list, or as
a ``BadRecord`` naming file, line or row, field, value and the problem.

Message schema (keys absent when empty):

- ``role``: ``system`` | ``user`` | ``assistant`` | ``tool``;
- ``content``: a string (``""`` for an assistant turn that only calls tools);
- assistant: ``tool_calls`` = ``[{"type": "function", "id"?, "function":
  {"name", "arguments": {...}}}]`` (arguments always an object: a JSON string is
  parsed), ``reasoning_content``;
- tool: ``tool_call_id``, ``name`` (taken from the matching call when absent).

Accepted forms: OpenAI ``messages`` (content null / string / list of parts,
``tool_calls``, legacy ``function_call`` and ``function`` role, ``tool`` role,
per-record ``tools``); ShareGPT ``conversations`` with ``human``/``gpt``/
``system`` and the function-calling variants ``function_call`` (a JSON call or
list of calls) and ``observation``/``tool``/``function_response`` (results),
with top-level ``system`` and ``tools`` (a list or its JSON text) as
function-calling datasets ship them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT `from` values seen in the wild, mapped to the one schema.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "model": "assistant", "function_call": "assistant",
                  "observation": "tool", "tool": "tool", "function_response": "tool", "ipython": "tool"}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool", "ipython": "tool"}

# kinds of bad record, as counted in stats.json
MALFORMED_JSON = "malformed_json"
INVALID_UTF8 = "invalid_utf8"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONVERSATION = "empty_conversation"
NON_TEXT_CONTENT = "non_text_content"
BAD_TOOL_CALL = "bad_tool_call"
BAD_TOOLS = "bad_tools"
TEMPLATE_ERROR = "template_error"  # raised by the chat template on this record (found while tokenising)
CONTROL_TOKEN_TEXT = "control_token_text"  # text that would become one of the tokenizer's special tokens
BAD_KINDS = (MALFORMED_JSON, INVALID_UTF8, MISSING_FIELD, WRONG_TYPE, UNKNOWN_ROLE, EMPTY_CONVERSATION,
             NON_TEXT_CONTENT, BAD_TOOL_CALL, BAD_TOOLS, TEMPLATE_ERROR, CONTROL_TOKEN_TEXT)

# the generation phase's records carry the target's own ids under this key (eagleflow.phases.generate.regenerate)
TOKEN_EXACT_KEY = "eagleflow_token_exact"

NON_TEXT_ERROR = "error"
NON_TEXT_DROP = "drop"


@dataclass(frozen=True)
class BadRecord:
    source: str
    file: str
    where: str      # "line 7" (JSONL, 1-based) or "row 3" (0-based record position)
    field: str      # e.g. "conversations[1].from"
    value: str      # a short repr of what was found
    kind: str       # one of BAD_KINDS
    problem: str    # what is wrong and what was expected

    def describe(self) -> str:
        return f"{self.file} {self.where}: field {self.field} = {self.value}: {self.problem}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BadRecord":
        return cls(**json.loads(text))


class RecordError(ValueError):
    def __init__(self, field: str, value: Any, kind: str, problem: str):
        super().__init__(problem)
        self.field, self.value, self.kind, self.problem = field, value, kind, problem


def short_repr(value: Any, limit: int = 80) -> str:
    if value is _ABSENT:
        return "(absent)"
    try:
        text = repr(value)
    except RecursionError:   # repr of a value nested thousands deep
        return "(nested too deeply to show)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ABSENT = object()


def _summary(value: Any) -> str:
    """A value's type and shape, short: for a field that may be large (a record's whole token ids)."""
    if isinstance(value, dict):
        return f"dict with keys {sorted(map(str, value))[:8]}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} items"
    return f"{type(value).__name__} {short_repr(value, 60)}"


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None
    non_text_parts_dropped: int = 0
    # a record the target regenerated (eagleflow.phases.generate): its ids and mask as the target produced them,
    # used as they are instead of rendering the messages again
    token_exact: dict | None = None

    def uses_tools(self) -> bool:
        return bool(self.tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages)

    def to_json(self) -> str:
        d: dict[str, Any] = {"messages": self.messages, "tools": self.tools}
        if self.token_exact is not None:
            d["token_exact"] = self.token_exact
        return json.dumps(d, ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> "Conversation":
        d = json.loads(text)
        return Conversation(d["messages"], d.get("tools"), token_exact=d.get("token_exact"))


def _get(d: dict, key: str) -> Any:
    """A field's value; None counts as absent (Arrow fills missing struct fields with nulls)."""
    v = d.get(key, _ABSENT)
    return _ABSENT if v is None else v


def _content_text(content: Any, field: str, non_text: str, dropped: list[int]) -> str:
    """OpenAI content: a string, or a list of parts whose text parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, p in enumerate(content):
            if isinstance(p, str):  # some exports keep plain strings as parts
                texts.append(p)
                continue
            if not isinstance(p, dict) or not isinstance(_get(p, "type"), str):
                raise RecordError(f"{field}[{j}]", p, WRONG_TYPE, "expected a content part {type: ..., ...}")
            if p["type"] == "text":
                if not isinstance(_get(p, "text"), str):
                    raise RecordError(f"{field}[{j}].text", p.get("text", _ABSENT), WRONG_TYPE,
                                      "a text part needs a string 'text'")
                texts.append(p["text"])
            elif non_text == NON_TEXT_DROP:
                dropped[0] += 1
            else:
                raise RecordError(f"{field}[{j}].type", p["type"], NON_TEXT_CONTENT,
                                  "a non-text part cannot be rendered for a text-only target; set "
                                  "corpus.non_text_parts: drop to drop such parts (counted in stats.json)")
        return "".join(texts)
    raise RecordError(field, content, WRONG_TYPE, "expected a string (or a list of {type: text, text: str} parts)")


def _arguments(value: Any, field: str) -> dict:
    """Tool call arguments as an object; a JSON string (OpenAI's wire form) is parsed."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise RecordError(field, value, BAD_TOOL_CALL,
                              f"arguments are a string but not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise RecordError(field, value, BAD_TOOL_CALL, "arguments must be a JSON object (or its JSON text)")
    return value


def _tool_call(call: Any, field: str) -> dict:
    """One call in {type: function, id?, function: {name, arguments}} form; flat {name, arguments} accepted."""
    if not isinstance(call, dict):
        raise RecordError(field, call, BAD_TOOL_CALL, "expected a tool call object {function: {name, arguments}}")
    fn, fn_field = (call["function"], f"{field}.function") if isinstance(_get(call, "function"), dict) \
        else (call, field)
    name = _get(fn, "name")
    if name is _ABSENT:
        raise RecordError(f"{fn_field}.name", _ABSENT, BAD_TOOL_CALL, "a tool call needs the function's 'name'")
    if not isinstance(name, str) or not name:
        raise RecordError(f"{fn_field}.name", name, BAD_TOOL_CALL, "the function name must be a non-empty string")
    args = _get(fn, "arguments")
    if args is _ABSENT:
        args = _get(fn, "parameters")  # some function-calling sets call them parameters
    out: dict = {"type": "function",
                 "function": {"name": name, "arguments": _arguments({} if args is _ABSENT else args,
                                                                    f"{fn_field}.arguments")}}
    call_id = _get(call, "id")
    if call_id is not _ABSENT:
        if not isinstance(call_id, str):
            raise RecordError(f"{field}.id", call_id, BAD_TOOL_CALL, "a tool call id must be a string")
        out["id"] = call_id
    return out


def _tool_calls(value: Any, field: str) -> list[dict]:
    if not isinstance(value, list):
        raise RecordError(field, value, BAD_TOOL_CALL, "tool_calls must be a list of calls")
    return [_tool_call(c, f"{field}[{j}]") for j, c in enumerate(value)]


def _tools(value: Any, field: str = "tools") -> list[dict] | None:
    """The record's tool schemas as [{type: function, function: {name, description?, parameters?}}]."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(field, value, BAD_TOOLS, f"tools is a string but not valid JSON ({e.msg})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RecordError(field, value, BAD_TOOLS, "expected a list of tool (function) schemas")
    out = []
    for j, t in enumerate(value):
        if not isinstance(t, dict):
            raise RecordError(f"{field}[{j}]", t, BAD_TOOLS, "expected a tool schema object")
        fn = t["function"] if isinstance(_get(t, "function"), dict) else t
        name = _get(fn, "name")
        if not isinstance(name, str) or not name:
            where = f"{field}[{j}].function.name" if fn is not t else f"{field}[{j}].name"
            raise RecordError(where, name, BAD_TOOLS, "each tool needs a non-empty string 'name'")
        if fn is t:  # a bare function schema (glaive, xLAM): wrap it the way chat templates expect
            t = {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        out.append(t)
    return out or None


def _parse_function_call_value(text: Any, field: str) -> list:
    """A ShareGPT `function_call` value: the JSON of one call or of a list of calls."""
    if not isinstance(text, str):
        if isinstance(text, (dict, list)):
            return text if isinstance(text, list) else [text]
        raise RecordError(field, text, WRONG_TYPE, "expected the JSON text of a call {name, arguments}")
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(field, text, BAD_TOOL_CALL,
                          f"a function_call value must be JSON {{name, arguments}} ({e.msg} at column {e.colno})") from None
    return calls if isinstance(calls, list) else [calls]


def _link_tool_results(messages: list[dict]) -> None:
    """Give each tool result the name (and id) of the call it answers, when the record left them out."""
    pending: list[dict] = []
    by_id: dict[str, dict] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = list(m["tool_calls"])
            by_id.update({c["id"]: c for c in m["tool_calls"] if "id" in c})
        elif m["role"] == "tool":
            call = by_id.get(m.get("tool_call_id", "")) or (pending[0] if pending else None)
            if call is not None:
                if call in pending:
                    pending.remove(call)
                m.setdefault("name", call["function"]["name"])
                if "id" in call:
                    m.setdefault("tool_call_id", call["id"])


def _sharegpt(record: dict, turns: list, non_text: str, dropped: list[int]) -> list[dict]:
    out: list[dict] = []
    system = _get(record, "system")
    if system is not _ABSENT:
        if not isinstance(system, str):
            raise RecordError("system", system, WRONG_TYPE, "expected the system prompt as a string")
        if system:
            out.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        role = _message_role(turn, where, "from", "value", SHAREGPT_ROLES)
        value = _get(turn, "value")
        if value is _ABSENT:
            raise RecordError(f"{where}.value", _ABSENT, MISSING_FIELD, "each message needs 'value'")
        if role == "function_call":
            calls = _tool_calls(_parse_function_call_value(value, f"{where}.value"), f"{where}.value")
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant" and "tool_calls" not in prev:
                prev["tool_calls"] = calls  # the gpt text before the call is the same assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        mapped = SHAREGPT_ROLES[role]
        if mapped == "tool" and isinstance(value, (dict, list)):
            value = json.dumps(value, ensure_ascii=False)
        out.append({"role": mapped, "content": _content_text(value, f"{where}.value", non_text, dropped)})
    return out


def _message_role(turn: Any, where: str, key: str, body: str, roles: dict) -> str:
    """The role of one message (ShareGPT's 'from', OpenAI's 'role'), checked against the form's roles."""
    if not isinstance(turn, dict):
        raise RecordError(where, turn, WRONG_TYPE, f"expected an object with '{key}' and '{body}'")
    role = _get(turn, key)
    if role is _ABSENT:
        raise RecordError(f"{where}.{key}", _ABSENT, MISSING_FIELD, f"each message needs '{key}'")
    if not isinstance(role, str):
        raise RecordError(f"{where}.{key}", role, WRONG_TYPE, "expected a string role")
    if role not in roles:
        raise RecordError(f"{where}.{key}", role, UNKNOWN_ROLE,
                          f"unknown role; expected one of {', '.join(sorted(roles))}")
    return role


def _openai(turns: list, non_text: str, dropped: list[int]) -> list[dict]:
    out: list[dict] = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        role = _message_role(turn, where, "role", "content", OPENAI_ROLES)
        mapped = OPENAI_ROLES[role]
        msg: dict[str, Any] = {"role": mapped}
        calls: list[dict] = []
        reasoning = _ABSENT
        if mapped == "assistant":
            if _get(turn, "tool_calls") is not _ABSENT:
                calls = _tool_calls(turn["tool_calls"], f"{where}.tool_calls")
            if _get(turn, "function_call") is not _ABSENT:  # the legacy single-call form
                calls.append(_tool_call(turn["function_call"], f"{where}.function_call"))
            for key in ("reasoning_content", "reasoning", "thinking"):
                reasoning = _get(turn, key)
                if reasoning is not _ABSENT:
                    if not isinstance(reasoning, str):
                        raise RecordError(f"{where}.{key}", reasoning, WRONG_TYPE, "expected reasoning as a string")
                    break
        content = _get(turn, "content")
        if content is _ABSENT:
            # an assistant turn that only calls tools (or only reasons) has content null: OpenAI's own form
            if not calls and reasoning is _ABSENT:
                raise RecordError(f"{where}.content", _ABSENT, MISSING_FIELD,
                                  "each message needs 'content' (null only on an assistant turn with tool_calls)")
            content = ""
        elif mapped == "tool" and isinstance(content, dict):
            content = json.dumps(content, ensure_ascii=False)
        msg["content"] = _content_text(content, f"{where}.content", non_text, dropped) if content != "" else ""
        if calls:
            msg["tool_calls"] = calls
        if reasoning not in (_ABSENT, ""):
            msg["reasoning_content"] = reasoning
        if mapped == "tool":
            for key in ("tool_call_id", "name"):
                v = _get(turn, key)
                if v is not _ABSENT:
                    if not isinstance(v, str):
                        raise RecordError(f"{where}.{key}", v, WRONG_TYPE, f"expected {key} as a string")
                    msg[key] = v
        out.append(msg)
    return out


def _drop_nulls(value: Any) -> Any:
    """Arrow unifies struct fields across rows and fills the missing ones with nulls: drop them again."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def normalise_conversation(record: Any, *, non_text: str = NON_TEXT_ERROR) -> Conversation:
    """The record in the one schema; raises RecordError naming the bad field."""
    if not isinstance(record, dict):
        raise RecordError("(record)", record, WRONG_TYPE, "expected a JSON object with 'conversations' or 'messages'")
    if _get(record, "conversations") is not _ABSENT:
        key = "conversations"
    elif _get(record, "messages") is not _ABSENT:
        key = "messages"
    else:
        raise RecordError("conversations|messages", _ABSENT, MISSING_FIELD,
                          "no 'conversations' (ShareGPT from/value) or 'messages' (OpenAI role/content) list")
    turns = record[key]
    if not isinstance(turns, list):
        raise RecordError(key, turns, WRONG_TYPE, "expected a list of messages")
    if not turns:
        raise RecordError(key, turns, EMPTY_CONVERSATION, "the conversation has no messages")
    dropped = [0]
    messages = (_sharegpt(record, turns, non_text, dropped) if key == "conversations"
                else _openai(turns, non_text, dropped))
    tools = _tools(record["tools"]) if _get(record, "tools") is not _ABSENT else None
    _link_tool_results(messages)
    return Conversation(messages, tools, dropped[0])


# --- record text that would become control tokens ----------------------------------------------------------
#
# A chat template renders the record's text between its own role markers, and the tokenizer then matches its
# special tokens anywhere in that text: a record holding "<|eot_id|><|start_header_id|>assistant" would end the
# turn and open an assistant turn of its own making, in the corpus and in a generation prompt alike. Such a
# record is refused (a bad record naming source, line and field), never escaped: no rendering of it is what
# the target sees at inference. Both phases call these two functions.

def control_token_strings(tokenizer) -> tuple[str, ...]:
    """The text of each special token the tokenizer finds in raw text: its named ones (bos, eos, pad, ...) and
    every added token marked special (role markers such as <|start_header_id|>). Added tokens not marked
    special (<think>, <tool_call> in some vocabularies) are markup the target writes as text; they stay."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(getattr(tok, "content", tok)))
    return tuple(sorted((t for t in found if t.strip()), key=lambda t: (-len(t), t)))


@functools.lru_cache(maxsize=8)
def _control_token_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, tokens)))


def _texts(value: Any, field: str):
    """(field, text) for every string the template may render: values and object keys, nested."""
    if isinstance(value, str):
        yield field, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield f"{field} key", str(k)
            yield from _texts(v, f"{field}.{k}")
    elif isinstance(value, (list, tuple)):
        for n, v in enumerate(value):
            yield from _texts(v, f"{field}[{n}]")


def control_token_error(conv: Conversation, tokens: tuple[str, ...]) -> RecordError | None:
    """The first message, tool-call or tool-schema text of ``conv`` holding one of ``tokens``, as the
    RecordError both phases report (None: the record's text cannot become a control token)."""
    if not tokens:
        return None
    pattern = _control_token_pattern(tuple(tokens))
    parts: list[tuple[str, Any]] = [(f"messages[{i}]", {k: v for k, v in m.items() if k != "role"})
                                    for i, m in enumerate(conv.messages)]
    parts.append(("tools", conv.tools or []))
    for base, value in parts:
        for field, text in _texts(value, base):
            hit = pattern.search(text)
            if hit:
                return RecordError(field, hit.group(0), CONTROL_TOKEN_TEXT,
                                   f"holds {hit.group(0)!r}, the text of one of the tokenizer's special tokens: "
                                   "rendered by the chat template it would become that control token (a turn or "
                                   "role boundary set by the record, not the template); remove or rewrite it in "
                                   "the source (records like it are skipped when max_bad_records allows, and "
                                   f"counted as {CONTROL_TOKEN_TEXT})")
    return None


def normalise_record(record: Any, *, non_text: str = NON_TEXT_ERROR) -> list[dict]:
    """The record's messages only (see normalise_conversation)."""
    return normalise_conversation(record, non_text=non_text).messages


def parse_raw(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise RecordError("(line)", raw.strip(), MALFORMED_JSON, f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:   # e.g. a 100,000-deep array: Python's JSON reader recurses once per level
        raise RecordError("(line)", raw.strip(), MALFORMED_JSON, "nested too deeply to read (thousands of levels of "
                          "arrays/objects); no conversation is nested like that: fix or drop the record") from None


def _too_deep(field: str) -> RecordError:
    return RecordError(field, _ABSENT, WRONG_TYPE, "a value nested too deeply to handle (thousands of levels of "
                       "arrays/objects); no conversation is nested like that: fix or drop the record")


def shuffle_key(seed: int, sample_id: str) -> int:
    """Position key of a sample: a hash of (seed, id), so the order is the same on any machine,
    with any number of processes and any library version, and does not depend on other samples."""
    digest = hashlib.sha256(f"{seed}\x00{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # fits int64


def checked_token_exact(value: Any) -> dict:
    """The generation phase's ids, mask and span ends, checked: the corpus takes them as they are, so a
    misaligned mask would train on the wrong tokens. RecordError names the field that is wrong."""
    f = TOKEN_EXACT_KEY
    if not isinstance(value, dict):
        raise RecordError(f, value, WRONG_TYPE, "must be an object {input_ids, loss_mask, span_ends}")
    ids, mask, ends = value.get("input_ids"), value.get("loss_mask"), value.get("span_ends", [])
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise RecordError(f"{f}.input_ids", ids, WRONG_TYPE, "must be a non-empty list of token ids (ints >= 0)")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise RecordError(f"{f}.loss_mask", mask if not isinstance(mask, list) else f"{len(mask)} entries", WRONG_TYPE,
                          f"must be a list of 0/1, as long as input_ids ({len(ids)})")
    if (not isinstance(ends, list) or not all(type(e) is int and 0 < e <= len(ids) for e in ends)
            or any(a >= b for a, b in zip(ends, ends[1:])) or any(mask[e - 1] != 1 for e in ends)):
        raise RecordError(f"{f}.span_ends", ends, WRONG_TYPE, f"must be increasing ends (1..{len(ids)}) of "
                          "spans whose last token is masked in")
    return {"input_ids": ids, "loss_mask": mask, "span_ends": ends}


def record_group(record: Any, key: str) -> str | None:
    """What ``record`` is about, by ``corpus.eval_group_key``: the value at ``key`` (a dotted path into its
    objects; a first name absent at the top level is looked up in its ``metadata`` object), as text (a string
    as it is, any other value as canonical JSON); None when absent, null or empty."""
    parts = key.split(".")
    node: Any = record
    if isinstance(record, dict) and parts[0] not in record and isinstance(record.get("metadata"), dict):
        node = record["metadata"]
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if node is None or node == "" or node == [] or node == {}:
        return None
    if isinstance(node, str):
        return node
    return json.dumps(node, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def record_groups(rows: dict[str, list], key: str) -> list[str | None]:
    """``record_group`` of each raw or structured row of a ``load_source`` batch; None for an unreadable one."""
    record_cols = [c for c in rows if not c.startswith("__")]
    out: list[str | None] = []
    for i in range(len(rows["__row"])):
        try:
            record = (parse_raw(rows["__raw"][i]) if "__raw" in rows
                      else _drop_nulls({c: rows[c][i] for c in record_cols}))
            out.append(record_group(record, key))
        except (RecordError, RecursionError):
            out.append(None)
    return out


def normalise_batch(batch: dict[str, list], *, source: str, file: str, seed: int,
                    non_text: str = NON_TEXT_ERROR, token_exact: bool = False,
                    control_tokens: tuple[str, ...] = (), group_key: str | None = None,
                    groups: dict[int, str | None] | None = None) -> dict[str, list]:
    """``datasets.map`` body: raw or structured rows in, one schema (as JSON text) or an error out.

    ``token_exact``: the rows are the generation phase's (``generate.phase.generated_source_rows``); only
    there is ``eagleflow_token_exact`` taken (checked), in any other source it is refused.
    ``control_tokens``: the target tokenizer's special-token texts (``control_token_strings``); a record
    whose text holds one is bad (``control_token_error``). A token-exact record is never rendered: its ids stand.
    ``group_key``: ``corpus.eval_group_key``; the ``group`` column is each record's ``record_group`` (None when
    unset or absent), or ``groups[row]`` when given (a regenerated source: its original records' groups)."""
    n = len(batch["__row"])
    out: dict[str, list] = {"id": [], "source": [], "where": [], "conversation": [], "uses_tools": [],
                            "non_text_dropped": [], "error": [], "shuffle_key": [], "group": []}
    record_cols = [c for c in batch if not c.startswith("__")]
    decode_errors = batch.get("__decode_error")
    for i in range(n):
        row = batch["__row"][i]
        where = batch["__where"][i] if "__where" in batch else f"row {row}"
        sample_id = f"{source}:{row}"
        conv: Conversation | None = None
        group: str | None = groups.get(row) if groups is not None else None
        try:
            if decode_errors is not None and decode_errors[i] is not None:
                raise RecordError("(line)", batch["__raw"][i], INVALID_UTF8, decode_errors[i])
            try:
                if "__raw" in batch:
                    record = parse_raw(batch["__raw"][i])
                else:
                    record = _drop_nulls({c: batch[c][i] for c in record_cols})
                conv = normalise_conversation(record, non_text=non_text)
                if group_key is not None and groups is None:
                    group = record_group(record, group_key)
                if isinstance(record, dict) and TOKEN_EXACT_KEY in record:
                    if not token_exact:
                        raise RecordError(TOKEN_EXACT_KEY, _summary(record[TOKEN_EXACT_KEY]), WRONG_TYPE,
                                          "is written only by the generation phase (the target's own ids); a "
                                          "source may not carry it: remove the key from the record")
                    conv.token_exact = checked_token_exact(record[TOKEN_EXACT_KEY])
                control = control_token_error(conv, control_tokens) if conv.token_exact is None else None
                if control is not None:
                    raise control
                conv_json = conv.to_json()
            except RecursionError:   # read, but a field nested too deeply for the walk, repr or dumps
                raise _too_deep("(record)") from None
            error = None
        except RecordError as e:
            conv, conv_json = None, None
            error = BadRecord(source=source, file=file, where=where, field=e.field, value=short_repr(e.value),
                              kind=e.kind, problem=e.problem).to_json()
        out["id"].append(sample_id)
        out["source"].append(source)
        out["where"].append(where)
        out["conversation"].append(conv_json)
        out["uses_tools"].append(conv.uses_tools() if conv else False)
        out["non_text_dropped"].append(conv.non_text_parts_dropped if conv else 0)
        out["error"].append(error)
        out["shuffle_key"].append(shuffle_key(seed, sample_id))
        out["group"].append(group if conv is not None else None)
    return out
