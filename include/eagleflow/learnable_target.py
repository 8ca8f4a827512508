"""A target with something to learn: a small Llama trained on this CPU, once and cached, on real text.

The demo's target is a tiny model fitted to rule-made replies: every draft scores about the same on it, so no
figure can tell a good draft from a broken one. This one learns text nobody here wrote, the Python standard
library's own source and docstrings (the interpreter's ``Lib/``, the same files on every machine with this
Python), shaped as the seeds' kind of chat records:

- **code**: "Write `json.dumps` from the Python standard library." -> the function's source, as written;
- **tool calls**: "What does `json.dumps` do?" -> a ``help`` tool call (with reasoning) -> the tool's answer
  (the docstring's first paragraph, JSON) -> the signature and that paragraph;
- **docstrings**: "Write the docstring of `json.dumps(obj, *, skipkeys=False, ...)`." -> the docstring.

Every record carries ``"metadata": {"function": "<module>.<qualified name>"}``, what it is about: the benchmark
sets ``corpus.eval_group_key`` to it, so all the records of a function land on one side of the held-out split
and the draft is scored on functions it never saw (split by record, a function's source could be trained on
while its docstring was scored).

Two OpenAI-form JSONL sources (code; tool calls and docstrings), a byte-level BPE tokenizer trained on them with
the demo's chat template (tools, tool calls, reasoning, ``{% generation %}`` marks), and a 12-layer Llama
(hidden 192) trained on every record, packed into 256-token blocks, with a cosine schedule. A one-layer
EAGLE-3 draft of it costs about a tenth of the target a token. Cached under ``root`` (``assets.json`` names what
was built and how); a second call returns at once. Used by ``bench/learnable_target.py``, not by ``make demo``:
its training takes about 15 minutes on 2 cores, the demo's budget is about 5 from a fresh clone.
"""
from __future__ import annotations

import ast
import json
import math
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from eagleflow.demo_assets import chat_ids, conversation_texts, read_conversations, train_tokenizer

ASSETS_VERSION = 2   # 2: every record names its function (``metadata.function``), the held-out split's group
HELP_TOOL = {"name": "help", "description": "Show the docstring of a Python standard-library object.",
             "parameters": {"type": "object", "properties": {"symbol": {"type": "string",
                                                                         "description": "module.qualified_name"}},
                            "required": ["symbol"]}}
# Packages whose files are tests, demos or generated tables, not the library's own prose and code.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "turtledemo", "__pycache__", "encodings"}


@dataclass(frozen=True)
class TargetShape:
    """The learnable target's architecture and training (the defaults are what the benchmark's figures use)."""
    hidden_size: int = 192
    layers: int = 12
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    vocab_size: int = 4096
    block: int = 256            # tokens per packed training block
    batch: int = 16
    epochs: float = 1.5
    lr: float = 2e-3
    warmup_steps: int = 30
    seed: int = 0
    max_function_lines: int = 30
    threads: int = 2


@dataclass(frozen=True)
class Function:
    module: str
    qualname: str
    signature: str
    source: str
    docstring: str

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.qualname}"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _walk(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every module-level function and method, in source order."""
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    while stack:
        prefix, node = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                stack.append((f"{prefix}{child.name}.", child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child


def stdlib_functions(root: Path | None = None, max_lines: int = 30) -> list[Function]:
    """Every documented function and method of the standard library of at most ``max_lines`` lines, sorted."""
    root = root or stdlib_root()
    found: list[Function] = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]) or path.name.startswith("test"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
            lines = text.splitlines(keepends=True)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue   # a few files are deliberately invalid (bad encodings, py2 syntax in data files)
        module = _module_name(root, path)
        for qualname, node in _walk(tree):
            doc = ast.get_docstring(node)
            if not doc or qualname.rsplit(".", 1)[-1].startswith("_") and not qualname.endswith("__init__"):
                continue
            if node.end_lineno is None or node.end_lineno - node.lineno + 1 > max_lines:
                continue
            source = "".join(lines[node.lineno - 1:node.end_lineno])   # whole lines: dedent needs the indent
            found.append(Function(module, qualname, f"({ast.unparse(node.args)})",
                                  textwrap.dedent(source).strip("\n"), doc.strip()))
    return found


def _first_paragraph(doc: str, limit: int = 400) -> str:
    para = doc.split("\n\n", 1)[0]
    para = " ".join(para.split())
    return para if len(para) <= limit else para[:limit].rsplit(" ", 1)[0] + " ..."


def records(functions: list[Function]) -> tuple[list[dict], list[dict]]:
    """(code records, tool-call and docstring records), OpenAI chat form, one or two per function."""
    code: list[dict] = []
    docs: list[dict] = []
    for i, f in enumerate(functions):
        about = {"function": f.symbol}   # what the record is about: its held-out group (corpus.eval_group_key)
        code.append({"messages": [
            {"role": "user", "content": f"Write `{f.symbol}` from the Python standard library."},
            {"role": "assistant", "content": f.source}], "metadata": about})
        if i % 3 == 1:
            call_id = f"call_{i}"
            docs.append({"messages": [
                {"role": "user", "content": f"What does `{f.symbol}` do?"},
                {"role": "assistant", "content": None, "reasoning_content": "Look up its docstring: call help.",
                 "tool_calls": [{"id": call_id, "type": "function",
                                 "function": {"name": "help", "arguments": json.dumps({"symbol": f.symbol})}}]},
                {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"doc": _first_paragraph(f.docstring)})},
                {"role": "assistant", "content": f"`{f.symbol}{f.signature}`: {_first_paragraph(f.docstring)}"}],
                "tools": [{"type": "function", "function": HELP_TOOL}], "metadata": about})
        elif i % 3 == 2:
            docs.append({"messages": [
                {"role": "user", "content": f"Write the docstring of `{f.symbol}{f.signature}`."},
                {"role": "assistant", "content": f.docstring[:800]}], "metadata": about})
    return code, docs


def write_sources(out: Path, functions: list[Function]) -> list[dict]:
    """The two JSONL sources under ``out``; returns their config entries."""
    out.mkdir(parents=True, exist_ok=True)
    code, docs = records(functions)
    entries = []
    for name, rows in (("stdlib_code", code), ("stdlib_docs", docs)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        entries.append({"name": name, "path": str(path)})
    return entries


def train_target(model_dir: Path, sequences: list[list[int]], shape: TargetShape, vocab_size: int,
                 log: Callable[[str], None] = print) -> dict:
    """Plain causal-LM training on the sequences packed end to end into blocks; returns its figures."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(shape.seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=4096, tie_word_embeddings=False,
                      dtype="float32", bos_token_id=0, eos_token_id=4, pad_token_id=5)
    model = LlamaForCausalLM(cfg)
    stream = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    blocks = stream[:len(stream) // shape.block * shape.block].view(-1, shape.block)
    steps = max(1, math.ceil(shape.epochs * len(blocks) / shape.batch))
    g = torch.Generator().manual_seed(shape.seed)
    order = torch.cat([torch.randperm(len(blocks), generator=g) for _ in range(math.ceil(shape.epochs) + 1)])
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < shape.warmup_steps:
            return shape.lr * (step + 1) / shape.warmup_steps
        done = (step - shape.warmup_steps) / max(1, steps - shape.warmup_steps)
        return shape.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    threads = torch.get_num_threads()
    torch.set_num_threads(shape.threads)
    model.train()
    t0 = time.monotonic()
    losses: list[float] = []
    try:
        for step in range(steps):
            batch = blocks[order[step * shape.batch:(step + 1) * shape.batch]]
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if step % 25 == 0 or step == steps - 1:
                log(f"target step {step + 1}/{steps}: loss {sum(losses[-25:]) / len(losses[-25:]):.3f} "
                    f"({time.monotonic() - t0:.0f} s)")
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return {"steps": steps, "tokens_trained": steps * shape.batch * shape.block, "corpus_tokens": len(stream),
            "first_loss": round(sum(losses[:10]) / len(losses[:10]), 4),
            "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
            "seconds": round(time.monotonic() - t0, 1),
            "params": sum(p.numel() for p in model.parameters())}


def ensure_learnable_target(root: str | Path, shape: TargetShape = TargetShape(),
                            log: Callable[[str], None] = print) -> dict:
    """Sources, tokenizer and trained target under ``root``; returns assets.json's content."""
    root = Path(root).resolve()
    marker = root / "assets.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("version") == ASSETS_VERSION and info.get("shape") == asdict(shape):
            return info
        if info.get("version") == 1 and info.get("shape") == asdict(shape):
            # version 1 wrote the same conversations without their metadata: the target stands, the sources
            # are written again with it
            functions = stdlib_functions(max_lines=shape.max_function_lines)
            if len(functions) == info.get("functions"):
                info |= {"version": ASSETS_VERSION, "sources": write_sources(root / "sources", functions)}
                marker.write_text(json.dumps(info, indent=2) + "\n")
                log(f"learnable target at {root}: sources written again with each record's function")
                return info
    functions = stdlib_functions(max_lines=shape.max_function_lines)
    if len(functions) < 1000:
        raise RuntimeError(f"only {len(functions)} documented functions found under {stdlib_root()}; the "
                           "learnable target needs the interpreter's standard-library sources (Lib/*.py)")
    sources = write_sources(root / "sources", functions)
    conversations = read_conversations(root / "sources")
    model_dir = root / "target"
    train_tokenizer(conversation_texts(conversations), model_dir, vocab_size=shape.vocab_size)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sequences = [chat_ids(tok, c) for c in conversations]
    log(f"{len(functions)} functions from {stdlib_root()}: {len(sequences)} records, "
        f"{sum(map(len, sequences)):,} tokens")
    figures = train_target(model_dir, sequences, shape, vocab_size=len(tok), log=log)
    info = {"version": ASSETS_VERSION, "shape": asdict(shape), "stdlib": str(stdlib_root()),
            "functions": len(functions), "records": len(sequences), "sources": sources,
            "target_model": str(model_dir), "training": figures}
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return info


if __name__ == "__main__":
    import sys
    print(json.dumps(ensure_learnable_target(sys.argv[1] if len(sys.argv) > 1 else ".cache/learnable-target"),
                     indent=2))
