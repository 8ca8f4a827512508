"""Token ids and assistant-only loss masks from the target's own chat template.

Every record is rendered by ``tokenizer.apply_chat_template(messages,
tools=record_tools)``: system, user, assistant text, assistant tool calls, tool
results, reasoning, exactly as the target sees them. Two ways to find the
assistant tokens, chosen per tokenizer:

- ``generation_tags``: the template marks assistant turns (text and tool calls)
  with ``{% generation %}``; transformers returns the mask itself
  (``return_assistant_tokens_mask=True``).
- ``prefix_diff``: for templates without those tags. For each assistant turn,
  render the conversation up to the turn with the generation prompt (P) and up
  to and including the turn (Q); when Q starts with P, the characters between
  them are the assistant's (its text and its tool calls). The full text is
  tokenized once with character offsets and a token is masked when it starts
  inside such a span.

Every record's rendering is checked (see ``check_rendering``): tool names,
tool-call names and arguments, tool results and message text must all be in it.
A template that renders the conversation without them (one that ignores ``tools`` or has
no branch for tool calls) would train the draft on text the target never sees
at inference, so that is a ``TemplateError``, never a silent loss.

Records longer than ``max_length`` are, by ``corpus.over_max_length``: cut at
the end of the last assistant message that fits (the kept tokens are a prefix of
the full rendering, so ids and mask stay exactly right), dropped, or truncated
at the token (the old behaviour).
"""
from __future__ import annotations

import bisect
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any

from .normalise import Conversation

GENERATION_TAGS = "generation_tags"
PREFIX_DIFF = "prefix_diff"
MASK_METHODS = (GENERATION_TAGS, PREFIX_DIFF)

CUT_AT_MESSAGE = "cut_at_message"
DROP = "drop"
TRUNCATE = "truncate"
OVER_MAX_LENGTH_POLICIES = (CUT_AT_MESSAGE, DROP, TRUNCATE)

# drop reasons, as counted in stats.json
NO_ASSISTANT_TOKENS = "no_assistant_tokens"
NO_ASSISTANT_TOKENS_AFTER_TRUNCATION = "no_assistant_tokens_after_truncation"
OVER_MAX_LENGTH = "over_max_length"
DROP_REASONS = (NO_ASSISTANT_TOKENS, NO_ASSISTANT_TOKENS_AFTER_TRUNCATION, OVER_MAX_LENGTH)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZERS: dict[str, Any] = {}


class TemplateError(ValueError):
    """The chat template cannot give assistant spans, or drops content; the message says why and what to do."""


def load_tokenizer(model_path: str):
    """AutoTokenizer from the local target path, once per process (map workers reuse it)."""
    tok = _TOKENIZERS.get(model_path)
    if tok is None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_path)
        if not getattr(tok, "chat_template", None):
            raise TemplateError(f"tokenizer at {model_path} has no chat template; the target's tokenizer_config.json "
                                "or chat_template.jinja must define one")
        _TOKENIZERS[model_path] = tok
    return tok


def _default_template(tokenizer) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default", "")
    return template or ""


def template_label(tokenizer, model_path: str) -> str:
    """Which template a message is about: where it was loaded from and a digest of its text."""
    source = "chat_template.jinja" if os.path.isfile(os.path.join(model_path, "chat_template.jinja")) \
        else "tokenizer_config.json"
    digest = hashlib.sha256(_default_template(tokenizer).encode()).hexdigest()[:12]
    return f"the chat template of {model_path} ({source}, sha256 {digest})"


def mask_method_for(tokenizer, requested: str = "auto") -> str:
    if requested != "auto":
        if requested not in MASK_METHODS:
            raise TemplateError(f"mask method {requested!r}: expected auto, {', '.join(MASK_METHODS)}")
        return requested
    return GENERATION_TAGS if _GENERATION_TAG.search(_default_template(tokenizer)) else PREFIX_DIFF


def render(tokenizer, conv: Conversation, upto: int | None = None, add_generation_prompt: bool = False) -> str:
    messages = conv.messages if upto is None else conv.messages[:upto]
    return tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _render_prefix(tokenizer, conv: Conversation, upto: int) -> str:
    try:
        return render(tokenizer, conv, upto, add_generation_prompt=True)
    except Exception:  # some templates refuse an empty conversation; then nothing precedes the turn
        if upto:
            raise
        return ""


# --- what the rendering must contain -----------------------------------------------------------------------
#
# Checked by rendering a probe: the record with every message text, reasoning, tool name, tool-call name,
# argument key and argument value replaced by a unique marker, same structure otherwise. A marker missing
# from the probe's rendering is content the template drops. (Looking for the real values in the real text
# cannot tell: "7" or an argument named "a" occur anywhere.)

def _marker(path: str) -> str:
    return f"efprobe{path}z"


def _probe_value(value: Any, mid: str, field: str, markers: dict[str, str]) -> Any:
    """``value`` with every key and leaf replaced by a marker; markers maps each to its field."""
    if isinstance(value, dict):
        out = {}
        for n, (k, v) in enumerate(value.items()):
            key = _marker(f"{mid}k{n}")
            markers[key] = f"{field} key {k!r}"
            out[key] = _probe_value(v, f"{mid}k{n}", f"{field}.{k}", markers)
        return out
    if isinstance(value, list):
        return [_probe_value(v, f"{mid}i{n}", f"{field}[{n}]", markers) for n, v in enumerate(value)]
    m = _marker(f"{mid}v")
    markers[m] = f"{field} = {value!r}"
    return m


def _probe(conv: Conversation) -> tuple[Conversation, dict[str, tuple[str, str]], dict[str, str]]:
    """(probe conversation, {marker: (what it stands for, why missing)}, {reasoning marker: what})."""
    markers: dict[str, tuple[str, str]] = {}
    reasoning: dict[str, str] = {}
    tools = None
    if conv.tools:
        tools = []
        for j, t in enumerate(conv.tools):
            name = _marker(f"t{j}")
            markers[name] = (f"tools[{j}] (function {t['function']['name']!r})", "the template ignores the `tools` list")
            tools.append({**t, "function": {**t["function"], "name": name}})
    messages = []
    for i, m in enumerate(conv.messages):
        p = dict(m)
        if m["content"].strip():
            p["content"] = _marker(f"m{i}")
            markers[p["content"]] = (f"messages[{i}].content ({m['role']}, {m['content'].strip()[:60]!r})",
                                     f"the template drops {m['role']} messages here")
        if m.get("reasoning_content", "").strip():
            p["reasoning_content"] = _marker(f"r{i}")
            reasoning[p["reasoning_content"]] = f"messages[{i}].reasoning_content"
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                field = f"messages[{i}].tool_calls[{j}].function"
                name = _marker(f"m{i}c{j}")
                markers[name] = (f"{field}.name {c['function']['name']!r}", "the template drops tool calls")
                args: dict[str, str] = {}
                probe_args = _probe_value(c["function"]["arguments"], f"m{i}c{j}", f"{field}.arguments", args)
                markers.update({mk: (what, "the template drops tool-call arguments") for mk, what in args.items()})
                calls.append({**c, "function": {"name": name, "arguments": probe_args}})
            p["tool_calls"] = calls
        messages.append(p)
    return Conversation(messages, tools), markers, reasoning


@dataclass
class RenderCheck:
    dropped: str | None          # the first part of the record the rendering lacks, described
    reasoning_not_rendered: int  # assistant turns whose reasoning the template leaves out (not an error)


def check_rendering(tokenizer, conv: Conversation) -> RenderCheck:
    """Does the template render every part of this record? Reasoning is only counted: templates
    legitimately drop the reasoning of earlier turns, as the target then never sees it either."""
    probe, markers, reasoning = _probe(conv)
    try:
        text = render(tokenizer, probe)
    except Exception:  # the probe's markers upset this template (the real record rendered): cannot tell
        return RenderCheck(None, 0)
    missing = next((v for mk, v in markers.items() if mk not in text), None)
    return RenderCheck(f"{missing[0]} is not in the rendered text: {missing[1]}" if missing else None,
                       sum(1 for mk in reasoning if mk not in text))


def dropped_content(tokenizer, conv: Conversation) -> str | None:
    return check_rendering(tokenizer, conv).dropped


# --- ids and mask ------------------------------------------------------------------------------------------

@dataclass
class Encoded:
    text: str
    ids: list[int]
    mask: list[int]
    starts: list[int]                 # character offset where each token starts
    assistant_ends: list[int] | None  # char offset where each assistant message's span ends (prefix_diff)


def assistant_char_spans(tokenizer, conv: Conversation, full: str) -> list[tuple[int, int]]:
    """[start, end) character spans of each assistant message (text and tool calls) in ``full``."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        before = _render_prefix(tokenizer, conv, i)
        upto = render(tokenizer, conv, i + 1)
        if upto.startswith(before) and full.startswith(upto):
            spans.append((len(before), len(upto)))
            continue
        # The template rewrites earlier turns (e.g. drops past reasoning): fall back to finding
        # this turn's text in the full text after the previous span (possible for plain text only).
        start = full.find(m["content"], spans[-1][1] if spans else 0) if m["content"] else -1
        if start < 0 or m.get("tool_calls"):
            raise TemplateError("the chat template does not render assistant turns as a stable prefix; add "
                                "{% generation %}...{% endgeneration %} around assistant turns in the template")
        spans.append((start, start + len(m["content"])))
    return spans


def encode_record(tokenizer, conv: Conversation, method: str) -> Encoded:
    """Render once, tokenize with offsets, mask the assistant's tokens."""
    text = render(tokenizer, conv)
    if method == GENERATION_TAGS:
        enc = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True,
                                            tokenizer_kwargs={"return_offsets_mapping": True})
        return Encoded(text, list(enc["input_ids"]), list(enc["assistant_masks"]),
                       [s for s, _ in enc["offset_mapping"]], None)
    spans = assistant_char_spans(tokenizer, conv, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in enc["offset_mapping"]]
    mask = [0] * len(starts)
    j = 0
    for t, start in enumerate(starts):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and spans[j][0] <= start < spans[j][1]:
            mask[t] = 1
    return Encoded(text, list(enc["input_ids"]), mask, starts, [e for _, e in spans])


def encode_conversations(tokenizer, conversations: list, method: str) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each conversation (a Conversation or a plain message list)."""
    out = []
    for c in conversations:
        enc = encode_record(tokenizer, c if isinstance(c, Conversation) else Conversation(list(c)), method)
        out.append((enc.ids, enc.mask))
    return out


def _mask_run_ends(mask: list[int]) -> list[int]:
    return [t + 1 for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]


def assistant_token_ends(tokenizer, conv: Conversation, enc: Encoded) -> list[int]:
    """Token index just past each assistant message, in message order."""
    n_assistant = sum(1 for m in conv.messages if m["role"] == "assistant")
    if enc.assistant_ends is not None:
        return [bisect.bisect_left(enc.starts, e) for e in enc.assistant_ends]
    runs = _mask_run_ends(enc.mask)
    if len(runs) == n_assistant:  # one generation block per assistant message: its end is the message's
        return runs
    # otherwise find each message's end by rendering up to it (it must be a prefix of the full text)
    ends = []
    for i, m in enumerate(conv.messages):
        if m["role"] == "assistant":
            upto = render(tokenizer, conv, i + 1)
            ends.append(bisect.bisect_left(enc.starts, len(upto)) if enc.text.startswith(upto) else -1)
    return ends


@dataclass
class Fitted:
    ids: list[int]
    mask: list[int]
    messages_kept: int
    status: str          # "whole" | "cut" | "truncated" | "dropped"


def fit_to_max_length(tokenizer, conv: Conversation, enc: Encoded, max_length: int, policy: str) -> Fitted:
    n = len(conv.messages)
    if len(enc.ids) <= max_length:
        return Fitted(enc.ids, enc.mask, n, "whole")
    if policy == TRUNCATE:
        return Fitted(enc.ids[:max_length], enc.mask[:max_length], n, "truncated")
    if policy == CUT_AT_MESSAGE:
        assistant_idx = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        ends = assistant_token_ends(tokenizer, conv, enc)
        for i, end in sorted(zip(assistant_idx, ends), reverse=True):
            if 0 < end <= max_length:
                return Fitted(enc.ids[:end], enc.mask[:end], i + 1, "cut")
    return Fitted([], [], 0, "dropped")


def _counts(messages: list[dict]) -> tuple[int, int]:
    calls = sum(len(m.get("tool_calls", ())) for m in messages)
    return calls, sum(1 for m in messages if m["role"] == "tool")


def _list_array(rows: list[list[int]], lengths, value_type):
    """A pyarrow list array built from offsets: ~10x faster than converting nested Python lists."""
    import itertools

    import numpy as np
    import pyarrow as pa
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=value_type, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


@dataclass
class TokenisedRecord:
    ids: list[int]
    mask: list[int]
    status: str                 # see Fitted
    drop_reason: str | None
    turns: int                  # messages kept
    tool_calls: int             # assistant tool calls kept
    tool_messages: int          # tool results kept
    reasoning_not_rendered: int
    template_error: str | None  # the template raised on this record
    content_dropped: str | None  # what the rendering lacks (see dropped_content)


class TokenExactVocabError(ValueError):
    """A regenerated record holds ids outside this tokenizer's vocabulary (another target generated it)."""


def token_exact_record(conv: Conversation, *, max_length: int, over_max_length: str,
                       vocab_size: int | None = None) -> TokenisedRecord:
    """A regenerated record: the target's own ids and mask, never rendered again. Over max_length it is cut
    at the end of the last target span that fits (a prefix, so still exact), dropped or truncated.
    (Shape, mask and span ends were checked when read: ``normalise.checked_token_exact``.)"""
    te = conv.token_exact or {}
    ids, mask = list(te["input_ids"]), list(te["loss_mask"])
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise TokenExactVocabError(f"a regenerated record's eagleflow_token_exact.input_ids hold token id {max(ids)}, outside "
                         f"this tokenizer's vocabulary ({vocab_size} ids): the generation phase ran with another "
                         "target; run it again with this one (delete the run's generated/ dir)")
    status, kept_turns = "whole", len(conv.messages)
    if len(ids) > max_length:
        if over_max_length == TRUNCATE:
            ids, mask, status = ids[:max_length], mask[:max_length], "truncated"
        else:
            ends = [e for e in te.get("span_ends", []) if e <= max_length]
            if over_max_length == CUT_AT_MESSAGE and ends:
                ids, mask, status = ids[:ends[-1]], mask[:ends[-1]], "cut"
                n = len(ends)   # keep the messages up to the n-th assistant turn
                seen = 0
                for i, m in enumerate(conv.messages):
                    seen += m["role"] == "assistant"
                    if seen == n:
                        kept_turns = i + 1
                        break
            else:
                return TokenisedRecord([], [], "dropped", OVER_MAX_LENGTH, 0, 0, 0, 0, None, None)
    reason = None if any(mask) else NO_ASSISTANT_TOKENS
    calls, tools = _counts(conv.messages[:kept_turns])
    return TokenisedRecord(ids, mask, status, reason, kept_turns, calls, tools, 0, None, None)


def tokenise_record(tokenizer, conv: Conversation, *, max_length: int, method: str,
                    over_max_length: str = CUT_AT_MESSAGE) -> TokenisedRecord:
    if conv.token_exact is not None:
        return token_exact_record(conv, max_length=max_length, over_max_length=over_max_length,
                                  vocab_size=len(tokenizer) if tokenizer is not None else None)
    try:
        enc = encode_record(tokenizer, conv, method)
    except TemplateError:
        raise
    except Exception as e:  # the template's own raise_exception, or a template that cannot take this input
        return TokenisedRecord([], [], "dropped", None, 0, 0, 0, 0, f"{type(e).__name__}: {e}", None)
    check = check_rendering(tokenizer, conv)
    fitted = fit_to_max_length(tokenizer, conv, enc, max_length, over_max_length)
    reason = None
    if fitted.status == "dropped":
        reason = OVER_MAX_LENGTH
    elif not any(fitted.mask):
        reason = NO_ASSISTANT_TOKENS_AFTER_TRUNCATION if any(enc.mask) else NO_ASSISTANT_TOKENS
    calls, tools = _counts(conv.messages[:fitted.messages_kept])
    return TokenisedRecord(fitted.ids, fitted.mask, fitted.status, reason, fitted.messages_kept, calls, tools,
                           check.reasoning_not_rendered, None, check.dropped)


def tokenize_batch(batch: dict[str, list], *, model_path: str, max_length: int, method: str,
                   over_max_length: str = CUT_AT_MESSAGE):
    """``datasets.map`` body: conversations (JSON text) in; a pyarrow Table of the other columns plus ids,
    mask, counts, drop reason, template error and dropped content (or None) out."""
    import numpy as np
    import pyarrow as pa
    tok = load_tokenizer(model_path)
    recs = []
    for i, c in enumerate(batch["conversation"]):
        try:
            recs.append(tokenise_record(tok, Conversation.from_json(c), max_length=max_length, method=method,
                                        over_max_length=over_max_length))
        except TokenExactVocabError as e:   # raised inside datasets.map: say which record
            def col(name):
                return batch[name][i] if name in batch else "?"
            raise TokenExactVocabError(f"record {col('id')} (source {col('source')}, {col('where')}): {e}") from None
    ids_rows = [r.ids for r in recs]
    lengths = np.fromiter((len(r) for r in ids_rows), dtype=np.int32, count=len(ids_rows))
    # A table (not a dict) is written by datasets as is: the other columns are passed through here.
    passthrough = {k: v for k, v in batch.items() if k != "conversation"}
    return pa.table({**passthrough,
                     "input_ids": _list_array(ids_rows, lengths, np.int32),
                     "loss_mask": _list_array([r.mask for r in recs], lengths, np.int8),
                     "num_tokens": pa.array(lengths, pa.int32()),
                     "masked_tokens": pa.array([sum(r.mask) for r in recs], pa.int32()),
                     "length_status": pa.array([r.status for r in recs], pa.string()),
                     "drop_reason": pa.array([r.drop_reason for r in recs], pa.string()),
                     "turns": pa.array([r.turns for r in recs], pa.int32()),
                     "tool_calls": pa.array([r.tool_calls for r in recs], pa.int32()),
                     "tool_messages": pa.array([r.tool_messages for r in recs], pa.int32()),
                     "reasoning_not_rendered": pa.array([r.reasoning_not_rendered for r in recs], pa.int32()),
                     "template_error": pa.array([r.template_error for r in recs], pa.string()),
                     "content_dropped": pa.array([r.content_dropped for r in recs], pa.string())})
