"""The demo's inputs, made locally (nothing can be downloaded from a model hub).

- three small chat datasets (ShareGPT JSONL, OpenAI JSONL, Parquet) whose
  replies follow simple rules, so a draft model has something to learn;
- every fourth record of each source a tool-calling one (a tool schema, an
  assistant tool call, the tool's result, the answer), in OpenAI form (with
  reasoning_content) and in ShareGPT function_call/observation form;
- a byte-level BPE tokenizer trained on them with the `tokenizers` library,
  with a Llama-3-style chat template that renders the tools, tool calls,
  reasoning and tool results, and marks assistant turns (text and tool calls)
  with ``{% generation %}`` (so loss masks come from the template itself);
- a small Llama-architecture target (``save_pretrained``), briefly fitted to the
  demo's conversations so that its predictions are confident (optional);
- small prompt sets in MT-Bench's, GSM8K's and HumanEval's own formats, in the demo's words, for the
  evaluation's per-set rows (``prompts/``).

Cached under ``<root>``; a second call returns at once.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any
from eagleflow.corpus.normalise import normalise_conversation

if TYPE_CHECKING:
    from eagleflow.corpus.normalise import Conversation

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m.get('content') or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|pad|>"]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _conversation(rng: random.Random) -> list[tuple[str, str]]:
    kind = rng.randrange(4)
    if kind == 0:
        a = rng.randrange(0, 200)
        b = a + rng.randrange(5, 40)
        return [("user", f"Count from {a} to {b}."), ("assistant", " ".join(str(i) for i in range(a, b + 1)))]
    if kind == 1:
        ws = rng.sample(WORDS, rng.randrange(3, 12))
        return [("user", "Reverse these words: " + " ".join(ws)), ("assistant", " ".join(reversed(ws)))]
    if kind == 2:
        ws = rng.sample(WORDS, rng.randrange(3, 10))
        turns = [("system", "You answer in capitals."), ("user", "Shout: " + " ".join(ws)),
                 ("assistant", " ".join(w.upper() for w in ws))]
        return turns
    w = rng.choice(WORDS)
    n = rng.randrange(3, 15)
    return [("user", f"Repeat {w} {n} times."), ("assistant", " ".join([w] * n)),
            ("user", "Now once more, with commas."), ("assistant", ", ".join([w] * n))]


TOOLS = {
    "add": {"name": "add", "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}},
    "reverse_words": {"name": "reverse_words", "description": "Reverse a list of words.",
                      "parameters": {"type": "object",
                                     "properties": {"words": {"type": "array", "items": {"type": "string"}}},
                                     "required": ["words"]}},
}


def _tool_conversation(rng: random.Random) -> dict:
    """One tool call and its result, by a rule: {tool, user, arguments, result, answer, reasoning}."""
    if rng.random() < 0.5:
        a, b = rng.randrange(0, 100), rng.randrange(0, 100)
        return {"tool": "add", "user": f"What is {a} plus {b}?", "arguments": {"a": a, "b": b},
                "result": json.dumps({"sum": a + b}), "answer": f"{a} plus {b} is {a + b}.",
                "reasoning": "The user wants a sum: call add."}
    ws = rng.sample(WORDS, rng.randrange(2, 6))
    return {"tool": "reverse_words", "user": "Use the tool to reverse: " + " ".join(ws),
            "arguments": {"words": ws}, "result": json.dumps(list(reversed(ws))),
            "answer": "Reversed: " + " ".join(reversed(ws)), "reasoning": "Reverse words: call reverse_words."}


def _openai_tool_record(t: dict, i: int) -> dict:
    """OpenAI form: content null beside tool_calls, arguments as a JSON string, a tool message, tools."""
    call_id = f"call_{i}"
    return {"messages": [
        {"role": "user", "content": t["user"]},
        {"role": "assistant", "content": None, "reasoning_content": t["reasoning"],
         "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": t["tool"], "arguments": json.dumps(t["arguments"])}}]},
        {"role": "tool", "tool_call_id": call_id, "content": t["result"]},
        {"role": "assistant", "content": t["answer"]}],
        "tools": [{"type": "function", "function": TOOLS[t["tool"]]}]}


def _sharegpt_tool_record(t: dict) -> dict:
    """ShareGPT function-calling form (glaive / LLaMA-Factory): function_call and observation turns,
    tools as the JSON text of bare function schemas."""
    return {"conversations": [
        {"from": "human", "value": t["user"]},
        {"from": "function_call", "value": json.dumps({"name": t["tool"], "arguments": t["arguments"]})},
        {"from": "observation", "value": t["result"]},
        {"from": "gpt", "value": t["answer"]}],
        "tools": json.dumps([TOOLS[t["tool"]]])}


def write_demo_sources(out: Path, n_per_source: int = 48, seed: int = 7) -> list[dict]:
    """Three sources in three forms, every fourth record a tool-calling one; returns their config entries."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    role_sharegpt = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = out / "rules_sharegpt.jsonl"
    with sharegpt.open("w") as f:
        for i in range(n_per_source):
            if i % 4 == 1:
                rec = _sharegpt_tool_record(_tool_conversation(rng))
            else:
                rec = {"conversations": [{"from": role_sharegpt[r], "value": t} for r, t in _conversation(rng)]}
            f.write(json.dumps(rec) + "\n")
    openai = out / "rules_openai.jsonl"
    with openai.open("w") as f:
        for i in range(n_per_source):
            rec = (_openai_tool_record(_tool_conversation(rng), i) if i % 4 == 1
                   else {"messages": [{"role": r, "content": t} for r, t in _conversation(rng)]})
            f.write(json.dumps(rec) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    # Parquet rows hold tool calls and tool schemas as structs; Arrow fills the fields other rows have with nulls
    rows = [_openai_tool_record(_tool_conversation(rng), i) if i % 4 == 1
            else {"messages": [{"role": r, "content": t} for r, t in _conversation(rng)]} for i in range(n_per_source)]
    parquet = out / "rules_parquet.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return [{"name": "sharegpt", "path": str(sharegpt)}, {"name": "openai", "path": str(openai)},
            {"name": "parquet", "path": str(parquet)}]


def chat_ids(tok: Any, conv: Conversation) -> list[int]:
    """``conv``'s token ids as the chat template renders it. ``tok``: a transformers tokenizer, whose
    apply_chat_template is annotated without return_dict (with it, the answer is a BatchEncoding)."""
    ids: list[int] = tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True,
                                             return_dict=True)["input_ids"]
    return ids


def read_conversations(source_dir: Path) -> list[Conversation]:
    """The JSONL records under ``source_dir``, normalised (messages and tools as the chat template gets them)."""
    return [normalise_conversation(json.loads(line)) for p in sorted(source_dir.glob("*.jsonl"))
            for line in p.read_text().splitlines()]


def conversation_texts(conversations: list[Conversation]) -> list[str]:
    """Every text a tokenizer should learn from the conversations: contents, reasoning, tool calls, tools."""
    texts = []
    for conv in conversations:
        texts += [json.dumps(t["function"]) for t in conv.tools or []]
        for m in conv.messages:
            texts += [m.get("content") or "", m.get("reasoning_content", "")]
            texts += [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                      for c in m.get("tool_calls", [])]
    return texts


def _texts_for_tokenizer(source_dir: Path) -> list[str]:
    return conversation_texts(read_conversations(source_dir)) + [
        "system", "user", "assistant", "tool", "Tools:", "<think>", "</think>", "<tool_call>", "</tool_call>"] + WORDS


def build_tokenizer(source_dir: Path, out: Path, vocab_size: int = 1024) -> None:
    train_tokenizer(_texts_for_tokenizer(source_dir), out, vocab_size)


def train_tokenizer(texts: list[str], out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on ``texts``, with the chat template and special tokens, saved to out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_tiny_llama(out: Path, vocab_size: int, hidden_size: int = 64, layers: int = 8,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0,
                     fit_on: list[list[int]] | None = None, fit_steps: int = 300) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=False, dtype="float32",
                      bos_token_id=0, eos_token_id=4, pad_token_id=5)
    model = LlamaForCausalLM(cfg)
    if fit_on:
        _fit_target(model, fit_on, steps=fit_steps, seed=seed)
    model.save_pretrained(str(out), safe_serialization=True)


def _fit_target(model, sequences: list[list[int]], steps: int, seed: int, batch: int = 16, lr: float = 3e-3) -> None:
    """A few hundred steps of plain LM training, so the tiny target is confident on the
    demo's rules. A random target predicts nearly uniform distributions, which leaves a
    draft model nothing to learn and makes the demo's curves flat."""
    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small: threads cost more than they give (5x on 2 busy cores)
    try:
        _fit_steps(model, opt, sequences, steps, g, batch)
    finally:
        torch.set_num_threads(threads)
    model.eval()


def _fit_steps(model, opt, sequences: list[list[int]], steps: int, g, batch: int) -> None:
    import torch

    # batches of neighbours in length order: a tool-calling record (~180 tokens) would otherwise pad
    # every batch to its width and make this CPU fit several times slower
    by_length = sorted(sequences, key=len)
    for _ in range(steps):
        start = int(torch.randint(max(1, len(by_length) - batch + 1), (1,), generator=g))
        seqs = by_length[start:start + batch]
        width = max(len(x) for x in seqs)
        ids = torch.full((batch, width), model.config.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for r, x in enumerate(seqs):
            ids[r, :len(x)] = torch.tensor(x)
            labels[r, :len(x)] = torch.tensor(x)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def write_demo_prompt_sets(out: Path) -> dict[str, str]:
    """Small prompt sets in the public sets' own formats, written here (nothing downloaded), in the demo's words:
    MT-Bench ``question.jsonl`` (two turns, the second asked after the target's own first answer), GSM8K
    (question, answer) and HumanEval (task_id, prompt, canonical_solution, test, entry_point). {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    sets: dict[str, list[dict[str, Any]]] = {
        "mt_bench": [
            {"question_id": 1, "category": "writing", "turns": ["Repeat golf 6 times.", "Now once more, with commas."]},
            {"question_id": 2, "category": "reasoning",
             "turns": ["Count from 12 to 24.", "Reverse these words: alpha bravo charlie delta"]}],
        "gsm8k": [
            {"question": "What is 17 plus 25?", "answer": "17 plus 25 is 42.\n#### 42"},
            {"question": "Count from 40 to 52.", "answer": " ".join(str(i) for i in range(40, 53)) + "\n#### 52"}],
        "humaneval": [
            {"task_id": f"DemoEval/{i}", "prompt": f'def {name}(words):\n    """{doc}"""\n',
             "canonical_solution": f"    return {body}\n",
             "test": f"def check(f):\n    assert f({arg!r}) == {want!r}\n", "entry_point": name}
            for i, (name, doc, body, arg, want) in enumerate([
                ("shout", "Shout: echo foxtrot golf", "[w.upper() for w in words]", ["echo"], ["ECHO"]),
                ("reverse_words", "Reverse these words: kilo lima mike", "list(reversed(words))", ["a", "b"],
                 ["b", "a"])])],
    }
    paths = {}
    for name, records in sets.items():
        path, text = out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        paths[name] = str(path)
    return paths


ASSETS_VERSION = 3  # 3: tool-calling records and a template that renders tools


def ensure_demo_assets(root: str | Path, n_per_source: int = 48, fit_target: bool = True) -> dict:
    """Sources, tokenizer and target under root; returns {'sources': [...], 'target_model': path}."""
    root = Path(root)
    src_dir = root / "sources"
    model_dir = root / "tiny-llama"
    marker = root / "assets.json"
    prompt_sets = write_demo_prompt_sets(root / "prompts")   # cheap: rewritten every time, never stale
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("version") == ASSETS_VERSION and info.get("fitted") == fit_target:
            return {**info, "prompt_sets": prompt_sets}
    sources = write_demo_sources(src_dir, n_per_source=n_per_source)
    build_tokenizer(src_dir, model_dir)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    conversations = [chat_ids(tok, c) for c in read_conversations(src_dir)]
    build_tiny_llama(model_dir, vocab_size=len(tok), fit_on=conversations if fit_target else None)
    info = {"version": ASSETS_VERSION, "fitted": fit_target, "sources": sources, "target_model": str(model_dir)}
    marker.write_text(json.dumps(info, indent=2))
    return {**info, "prompt_sets": prompt_sets}


if __name__ == "__main__":
    import sys
    print(json.dumps(ensure_demo_assets(sys.argv[1] if len(sys.argv) > 1 else ".cache/demo"), indent=2))
