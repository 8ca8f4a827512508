"""One message schema for every source, and a precise report of each bad record.

A record arrives either as the raw text of a JSON line / array element, or as a
structured row (Parquet, a ``datasets`` directory). It leaves as a list of
``{"role", "content"}`` messages with roles ``system``/``user``/``assistant``,
or as a ``BadRecord`` naming file, line or row, field, value and the problem.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
# ShareGPT `from` values seen in the wild, mapped to the one schema.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "model": "assistant"}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# kinds of bad record, as counted in stats.json
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONVERSATION = "empty_conversation"
BAD_KINDS = (MALFORMED_JSON, MISSING_FIELD, WRONG_TYPE, UNKNOWN_ROLE, EMPTY_CONVERSATION)


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
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ABSENT = object()


def _content_text(content: Any, field: str) -> str:
    """OpenAI content is a string or a list of text parts; anything else is a wrong type."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RecordError(field, content, WRONG_TYPE, "expected a string (or a list of {type: text, text: str} parts)")


def normalise_record(record: Any) -> list[dict[str, str]]:
    """The record's messages in the one schema; raises RecordError naming the bad field."""
    if not isinstance(record, dict):
        raise RecordError("(record)", record, WRONG_TYPE, "expected a JSON object with 'conversations' or 'messages'")
    if record.get("conversations") is not None:
        key, role_key, text_key, roles = "conversations", "from", "value", SHAREGPT_ROLES
    elif record.get("messages") is not None:
        key, role_key, text_key, roles = "messages", "role", "content", OPENAI_ROLES
    else:
        raise RecordError("conversations|messages", _ABSENT, MISSING_FIELD,
                          "no 'conversations' (ShareGPT from/value) or 'messages' (OpenAI role/content) list")
    turns = record[key]
    if not isinstance(turns, list):
        raise RecordError(key, turns, WRONG_TYPE, "expected a list of messages")
    if not turns:
        raise RecordError(key, turns, EMPTY_CONVERSATION, "the conversation has no messages")
    out: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(where, turn, WRONG_TYPE, f"expected an object with '{role_key}' and '{text_key}'")
        role = turn.get(role_key, _ABSENT)
        if role is _ABSENT or role is None:
            raise RecordError(f"{where}.{role_key}", _ABSENT, MISSING_FIELD, f"each message needs '{role_key}'")
        if not isinstance(role, str):
            raise RecordError(f"{where}.{role_key}", role, WRONG_TYPE, "expected a string role")
        if role not in roles:
            raise RecordError(f"{where}.{role_key}", role, UNKNOWN_ROLE,
                              f"unknown role; expected one of {', '.join(sorted(roles))}")
        text = turn.get(text_key, _ABSENT)
        if text is _ABSENT or text is None:
            raise RecordError(f"{where}.{text_key}", _ABSENT, MISSING_FIELD, f"each message needs '{text_key}'")
        out.append({"role": roles[role], "content": _content_text(text, f"{where}.{text_key}")})
    return out


def parse_raw(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise RecordError("(line)", raw.strip(), MALFORMED_JSON, f"not valid JSON ({e.msg} at column {e.colno})") from None


def shuffle_key(seed: int, sample_id: str) -> int:
    """Position key of a sample: a hash of (seed, id), so the order is the same on any machine,
    with any number of processes and any library version, and does not depend on other samples."""
    digest = hashlib.sha256(f"{seed}\x00{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # fits int64


def normalise_batch(batch: dict[str, list], *, source: str, file: str, seed: int) -> dict[str, list]:
    """``datasets.map`` body: raw or structured rows in, one schema (or an error) out."""
    n = len(batch["__row"])
    out: dict[str, list] = {"id": [], "source": [], "messages": [], "error": [], "shuffle_key": []}
    record_cols = [c for c in batch if not c.startswith("__")]
    for i in range(n):
        row = batch["__row"][i]
        where = batch["__where"][i] if "__where" in batch else f"row {row}"
        sample_id = f"{source}:{row}"
        try:
            if "__raw" in batch:
                record = parse_raw(batch["__raw"][i])
            else:
                record = {c: batch[c][i] for c in record_cols}
            messages = normalise_record(record)
            error = None
        except RecordError as e:
            messages = []
            error = BadRecord(source=source, file=file, where=where, field=e.field, value=short_repr(e.value),
                              kind=e.kind, problem=e.problem).to_json()
        out["id"].append(sample_id)
        out["source"].append(source)
        out["messages"].append(messages)
        out["error"].append(error)
        out["shuffle_key"].append(shuffle_key(seed, sample_id))
    return out
