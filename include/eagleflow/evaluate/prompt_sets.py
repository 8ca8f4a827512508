"""eval.prompt_sets: prompt files in their own formats, rendered with the target's chat template.

A set is a JSONL file (one JSON object a line) or a folder written by ``datasets``' ``save_to_disk`` (a
``Dataset``, or a ``DatasetDict`` and the set's ``split``). Each record is read in one of these formats,
named by the set's ``format`` or, with ``format: auto``, recognised per record by its fields:

- ``mt_bench``: MT-Bench's ``question.jsonl`` (``question_id``, ``category``, ``turns``: the user's turns).
  Each turn after the first is asked after the target's OWN answer to the turns before it (greedy, the
  target alone: :func:`expand_turns`), as MT-Bench and SpecForge's bench ask it; every turn is scored;
- ``gsm8k``: GSM8K (``question``, ``answer``): the question is the user's turn;
- ``humaneval``: HumanEval (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``): the
  code prompt is the user's turn;
- ``chat``: the corpus schema (``messages`` or ``conversations``); a record ending in an assistant turn is
  prompted with what precedes it;
- ``prompt``: ``{"prompt": "text"}``, one user turn.

Every prompt is the conversation rendered with the target's chat template and its generation prompt. A
record of no known format, or not of the set's, stops the phase naming the set, the file, the line (a
dataset's row) and the fields it has.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator
from eagleflow.corpus.normalise import Conversation, RecordError, normalise_conversation
from eagleflow.corpus.prepare import eval_prompt_ids
from eagleflow.corpus.tokenize import load_tokenizer, render

# format -> the fields that make a record one of it (checked in this order by `auto`: HumanEval's records
# also have a "prompt", MT-Bench's and GSM8K's none of the chat fields)
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "mt_bench": ("question_id", "turns"),
    "gsm8k": ("question", "answer"),
    "humaneval": ("task_id", "prompt", "entry_point"),
    "chat": ("messages|conversations",),
    "prompt": ("prompt",),
}
FORMATS = ("auto", *FORMAT_FIELDS)


def _has(rec: dict, field: str) -> bool:
    return any(rec.get(f) is not None for f in field.split("|"))


def record_format(rec: Any) -> str | None:
    """The format a record's fields say it is in, or None."""
    if not isinstance(rec, dict):
        return None
    return next((fmt for fmt, fields in FORMAT_FIELDS.items() if all(_has(rec, f) for f in fields)), None)


def _known() -> str:
    return "; ".join(f"{fmt}: {', '.join(fields)}" for fmt, fields in FORMAT_FIELDS.items())


def _fields(rec: Any) -> str:
    return f"fields {sorted(rec)}" if isinstance(rec, dict) else f"a JSON {type(rec).__name__}, not an object"


def _text(rec: dict, field: str, where: str) -> str:
    v = rec.get(field)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{where}: field {field} is {type(v).__name__ if not isinstance(v, str) else 'empty'}, "
                         "expected text")
    return v


def _turns(rec: dict, where: str) -> list[str]:
    turns = rec.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{where}: field turns must be a non-empty list of texts (the user's turns), got "
                         f"{type(turns).__name__}")
    return list(turns)


def _records(path: Path, split: str | None, where: str) -> Iterator[tuple[str, Any]]:
    """(where in the file, record) for each record: a JSONL line, or a row of a datasets save_to_disk folder."""
    if path.is_dir():
        from datasets import Dataset, DatasetDict, load_from_disk
        try:
            ds = load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{where}: {path} is a folder but not one written by datasets' save_to_disk ({e}); "
                             "point path at a JSONL file or such a folder") from None
        if isinstance(ds, DatasetDict):
            splits = sorted(ds)
            name = split or ("test" if "test" in ds else splits[0] if len(splits) == 1 else None)
            if name not in ds:
                raise ValueError(f"{where}: {path} holds the splits {splits}"
                                 + (f", not {split!r}" if split else "")
                                 + "; name one with the set's split field")
            ds = ds[name]
        if not isinstance(ds, Dataset):
            raise ValueError(f"{where}: {path} holds a {type(ds).__name__}, not a datasets Dataset")
        for i, row in enumerate(ds):
            yield f"{where}: {path} row {i}", row
        return
    if split:
        raise ValueError(f"{where}: split {split!r} is set but {path} is a file, not a datasets save_to_disk folder")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            here = f"{where}: {path} line {n}"
            try:
                yield here, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{here} is not JSON ({e.msg} at column {e.colno}); one JSON object a line") from None


def _conversation(rec: Any, fmt: str, where: str) -> tuple[str | None, list[dict], list[str], Any]:
    """(the record's own id, the first prompt's messages, the user turns asked after the target's answer,
    the normalised chat record when the format is chat)."""
    if fmt == "mt_bench":
        turns = _turns(rec, where)
        return str(rec["question_id"]), [{"role": "user", "content": turns[0]}], turns[1:], None
    if fmt == "gsm8k":
        return None, [{"role": "user", "content": _text(rec, "question", where)}], [], None
    if fmt == "humaneval":
        return str(rec["task_id"]), [{"role": "user", "content": _text(rec, "prompt", where)}], [], None
    if fmt == "prompt":
        return (str(rec["id"]) if rec.get("id") is not None else None,
                [{"role": "user", "content": _text(rec, "prompt", where)}], [], None)
    try:
        conv = normalise_conversation(rec)
    except RecordError as e:
        raise ValueError(f"{where}: field {e.field}: {e.problem}") from None
    return (str(rec["id"]) if rec.get("id") is not None else None), conv.messages, [], conv


def prompt_ids(tokenizer, messages: list[dict], tools=None) -> list[int]:
    """The conversation rendered with the target's chat template and its generation prompt, as token ids."""
    text = render(tokenizer, Conversation(messages, tools), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def read_prompt_set(path, tokenizer, max_records: int, field: str, fmt: str = "auto",
                    split: str | None = None) -> list[dict]:
    """The set's first prompts, ``max_records`` records at most: [{id, prompt_ids}], plus, for a record with
    more user turns (MT-Bench), ``messages`` (the conversation so far) and ``next_turns`` (asked after the
    target's answer: :func:`expand_turns`)."""
    path = Path(str(path))
    if not path.exists():
        raise FileNotFoundError(f"{field}: {path} is not a file; point path at a JSONL file of prompts "
                                '({"messages": [...]}, {"prompt": "..."}, MT-Bench, GSM8K or HumanEval records) '
                                "or a datasets save_to_disk folder")
    out: list[dict] = []
    seen: dict[str, str] = {}
    for where, rec in _records(path, split, field):
        if len(out) >= max_records:
            break
        got = record_format(rec)
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: {_fields(rec)}; one JSON object a line")
        if fmt == "auto" and got is None:
            raise ValueError(f"{where}: {_fields(rec)} match no prompt format eagleflow reads ({_known()}); "
                             "convert the file, or set the set's format")
        use = got if fmt == "auto" else fmt
        if fmt != "auto" and not all(_has(rec, f) for f in FORMAT_FIELDS[fmt]):
            raise ValueError(f"{where}: {_fields(rec)}, but format {fmt} needs {', '.join(FORMAT_FIELDS[fmt])}"
                             + (f" (the record looks like {got})" if got else ""))
        own_id, messages, next_turns, conv = _conversation(rec, str(use), where)
        if conv is not None and conv.messages[-1]["role"] == "assistant":   # prompted with what precedes it
            ids = eval_prompt_ids(tokenizer, conv, 1 << 30)
        else:
            ids = prompt_ids(tokenizer, messages, conv.tools if conv is not None else None)
        if not ids:
            raise ValueError(f"{where}: no prompt before its only assistant turn; end the record with a user "
                             "turn or drop it")
        base = own_id if own_id is not None else f"{path.stem}:{where.rsplit(' ', 1)[-1]}"
        pid = f"{base}:turn1" if next_turns else base
        if pid in seen:
            raise ValueError(f"{where}: id {pid!r} repeats {seen[pid]}; each prompt of a set needs its own id")
        seen[pid] = where
        p: dict[str, Any] = {"id": pid, "prompt_ids": list(ids)}
        if next_turns:
            p.update({"messages": messages, "next_turns": next_turns, "turn": 1, "record": base})
        out.append(p)
    if not out:
        raise ValueError(f"{field}: {path} holds no prompt")
    return out


def expand_turns(prompts: list[dict], answer: Callable[[list[dict]], dict[str, list[int]]],
                 tokenizer_path: str) -> list[dict]:
    """``prompts`` and, for each with ``next_turns`` (MT-Bench), its following turns: the conversation so far,
    the target's own answer to it (``answer(prompts) -> {id: token ids}``, greedy, the target alone: decoded
    without special tokens, as a chat client reads it) as the assistant turn, then the next user turn, rendered
    with the generation prompt. ``answer`` is called once per turn, with the prompts that have a next turn."""
    out = list(prompts)
    pending = [p for p in prompts if p.get("next_turns")]
    if not pending:
        return out
    tokenizer = load_tokenizer(tokenizer_path)
    while pending:
        answers = answer(pending)
        following = []
        for p in pending:
            text = tokenizer.decode(answers[p["id"]], skip_special_tokens=True)
            messages = p["messages"] + [{"role": "assistant", "content": text},
                                        {"role": "user", "content": p["next_turns"][0]}]
            turn = int(p["turn"]) + 1
            following.append({"id": f"{p['record']}:turn{turn}", "prompt_ids": prompt_ids(tokenizer, messages),
                              "messages": messages, "next_turns": p["next_turns"][1:], "turn": turn,
                              "record": p["record"]})
        out += following
        pending = [p for p in following if p["next_turns"]]
    return out
