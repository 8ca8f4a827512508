"""Benchmark: `eagleflow corpus prepare` against a plain single-process loop, side by side.

Generates a synthetic corpus shaped like the seeds' (8 sources, 37,312 records,
mean ~2,353 tokens, at most 8,192, some over it) scaled by --scale, in the five
source forms (ShareGPT/OpenAI JSONL, JSON, Parquet, a `datasets` directory),
about half of them agentic: tool schemas, assistant tool calls (parallel ones
too), tool results, reasoning, in OpenAI form (tool_calls, content null, tool
role) and ShareGPT function-calling form (function_call / observation, tools as
JSON text); rendered by the demo's local tokenizer and its chat template. Then,
at each size in --sizes (multiples of the scaled corpus), it runs in fresh
processes:

- prepare: ``prepare_corpus`` (datasets/Arrow, batched map in --num-proc processes);
- loop: read every record, normalise, render + tokenise + mask + cut it at a
  message boundary one record at a time (the same functions), keep the kept
  records in memory (numpy arrays), shuffle, write one Parquet file.

It prints tokens/s of each (whole process: start-up, reading, tokenising,
writing; fastest of --repeat runs) and their ratio, and the peak memory (PSS summed over
the process tree, sampled every 50 ms) of each, so that the growth of memory
with corpus size is visible; and extrapolates prepare's time to the seeds' size.

    .venv/bin/python bench/corpus.py --scale 0.1 --sizes 1 2 --num-proc 2 --repeat 2
    .venv/bin/python bench/corpus.py --scale 0.5 --sizes 1 2 --num-proc 2   # half and full seeds scale
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEEDS_RECORDS = 37_312
SEEDS_MEAN_TOKENS = 2_353
SEEDS_TOKENS = 87_800_000
MAX_TOKENS = 8_192
FORMS = ["sharegpt_jsonl", "openai_jsonl", "openai_json", "openai_parquet", "sharegpt_arrow",
         "sharegpt_jsonl", "openai_jsonl", "openai_parquet"]


# --- synthetic corpus --------------------------------------------------------------------------------

def _text(rng: random.Random, words: list[str], n_words: int) -> str:
    return " ".join(rng.choice(words) if rng.random() < 0.8 else str(rng.randrange(1000)) for _ in range(n_words))


def _conversation(rng: random.Random, words: list[str], tokens: int, tokens_per_word: float) -> list[tuple[str, str]]:
    turns = rng.choice([1, 1, 2, 3])
    words_total = max(4, int(tokens / tokens_per_word))
    conv: list[tuple[str, str]] = []
    if rng.random() < 0.3:
        conv.append(("system", _text(rng, words, 8)))
    for _ in range(turns):
        per_turn = max(2, words_total // turns)
        user = max(1, int(per_turn * 0.3))
        conv.append(("user", _text(rng, words, user)))
        conv.append(("assistant", _text(rng, words, per_turn - user)))
    return conv


TOOL_NAMES = ["read_file", "run_tests", "search_code", "edit_file", "list_dir", "web_search", "python", "bash"]


def _tool_schema(name: str, rng: random.Random, words: list[str]) -> dict:
    params = {w: {"type": "string", "description": _text(rng, words, 4)} for w in rng.sample(words, 2)}
    return {"name": name, "description": _text(rng, words, 8),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)}}


def _trajectory(rng: random.Random, words: list[str], tokens: int, tokens_per_word: float) -> dict:
    """An agent trajectory: tools, a task, rounds of (thought + tool calls, results), a final answer.
    Returned in a neutral form that _as_openai / _as_sharegpt turn into the two record forms."""
    words_total = max(40, int(tokens / tokens_per_word))
    tools = [_tool_schema(n, rng, words) for n in rng.sample(TOOL_NAMES, rng.randrange(2, 5))]
    rounds = max(1, min(40, words_total // rng.randrange(120, 400)))
    per_round = max(12, (words_total - 60) // (rounds + 1))
    steps = []
    for _ in range(rounds):
        calls = []
        for _ in range(1 if rng.random() < 0.8 else 2):  # some parallel calls
            t = rng.choice(tools)
            calls.append({"name": t["name"], "arguments": {k: _text(rng, words, rng.randrange(1, 6))
                                                           for k in t["parameters"]["properties"]}})
        steps.append({"thought": _text(rng, words, max(2, per_round // 5)), "calls": calls,
                      "results": [_text(rng, words, max(4, per_round * 3 // (5 * len(calls)))) for _ in calls]})
    return {"tools": tools, "system": _text(rng, words, 12), "task": _text(rng, words, 30), "steps": steps,
            "answer": _text(rng, words, max(8, per_round // 2)), "reasoning": _text(rng, words, 10)}


def _as_openai(t: dict, args_as_text: bool) -> dict:
    msgs = [{"role": "system", "content": t["system"]}, {"role": "user", "content": t["task"]}]
    for r, step in enumerate(t["steps"]):
        calls = [{"id": f"call_{r}_{j}", "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"]) if args_as_text
                               else c["arguments"]}} for j, c in enumerate(step["calls"])]
        msgs.append({"role": "assistant", "content": step["thought"], "tool_calls": calls,
                     **({"reasoning_content": t["reasoning"]} if r == 0 else {})})
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": res} for c, res in zip(calls, step["results"])]
    msgs.append({"role": "assistant", "content": t["answer"]})
    return {"messages": msgs, "tools": [{"type": "function", "function": f} for f in t["tools"]]}


def _as_sharegpt(t: dict) -> dict:
    conv = [{"from": "human", "value": t["task"]}]
    for step in t["steps"]:
        conv.append({"from": "gpt", "value": step["thought"]})
        calls = step["calls"]
        conv.append({"from": "function_call", "value": json.dumps(calls[0] if len(calls) == 1 else calls)})
        conv += [{"from": "observation", "value": res} for res in step["results"]]
    conv.append({"from": "gpt", "value": t["answer"]})
    return {"system": t["system"], "conversations": conv, "tools": json.dumps(t["tools"])}


def make_sources(out: Path, records: int, model_path: str, seed: int = 0, tool_share: float = 0.5) -> list[dict]:
    """8 sources, ``records`` in all, lengths lognormal around the seeds' mean, a few over 8,192 tokens;
    ``tool_share`` of the records agent trajectories with tool calls."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from eagleflow.demo_assets import WORDS

    tok = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(seed)
    sample = _text(rng, list(WORDS), 2000)
    tokens_per_word = len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000
    sigma = 0.8
    mu = math.log(SEEDS_MEAN_TOKENS) - sigma ** 2 / 2
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    per = [records // len(FORMS) + (1 if i < records % len(FORMS) else 0) for i in range(len(FORMS))]
    role = {"system": "system", "user": "human", "assistant": "gpt"}
    for i, (form, n) in enumerate(zip(FORMS, per)):
        name = f"src{i}_{form}"
        structured = form.endswith(("parquet", "arrow"))
        rows = []
        for _ in range(n):
            tokens = int(min(MAX_TOKENS * 1.05, max(48, rng.lognormvariate(mu, sigma))))
            if rng.random() < tool_share:
                t = _trajectory(rng, list(WORDS), tokens, tokens_per_word)
                rec = _as_sharegpt(t) if form.startswith("sharegpt") else _as_openai(t, args_as_text=structured
                                                                                     or rng.random() < 0.5)
                if structured:  # nested schemas differ from row to row: Arrow columns hold their JSON text
                    rec["tools"] = rec["tools"] if isinstance(rec["tools"], str) else json.dumps(rec["tools"])
            else:
                c = _conversation(rng, list(WORDS), tokens, tokens_per_word)
                rec = ({"conversations": [{"from": role[r], "value": x} for r, x in c]} if form.startswith("sharegpt")
                       else {"messages": [{"role": r, "content": x} for r, x in c]})
                if structured:  # one schema for the column: plain chats carry the same (empty) fields
                    rec["tools"] = ""
                    if form.startswith("sharegpt"):
                        rec["system"] = ""
            rows.append(rec)
        if form.endswith("jsonl"):
            path = out / f"{name}.jsonl"
            with path.open("w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        elif form.endswith("json"):
            path = out / f"{name}.json"
            path.write_text(json.dumps(rows))
        elif form.endswith("parquet"):
            path = out / f"{name}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path = out / name
            datasets.Dataset.from_list(rows).save_to_disk(str(path))
        sources.append({"name": name, "path": str(path)})
    return sources


# --- the plain loop ------------------------------------------------------------------------------------

def _records(src: dict):
    import pyarrow.parquet as pq

    from eagleflow.corpus.normalise import _drop_nulls
    path = Path(src["path"])
    if path.suffix == ".jsonl":
        with path.open() as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    elif path.suffix == ".json":
        yield from json.loads(path.read_text())
    elif path.suffix == ".parquet":
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from (_drop_nulls(r) for r in batch.to_pylist())
    else:
        import datasets
        yield from (_drop_nulls(r) for r in datasets.load_from_disk(str(path)))


def plain_loop(cfg_path: str, out: str) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from eagleflow.config import load_config
    from eagleflow.corpus.normalise import normalise_conversation, shuffle_key
    from eagleflow.corpus.tokenize import mask_method_for, tokenise_record

    cfg = load_config(cfg_path)
    cc = cfg.corpus
    tok = AutoTokenizer.from_pretrained(str(cfg.resolve(cfg.target_model)))
    method = mask_method_for(tok)
    rows = []
    for src in cc.sources:
        for i, rec in enumerate(_records({"path": str(cfg.resolve(src.path))})):
            t = tokenise_record(tok, normalise_conversation(rec, non_text=cc.non_text_parts), max_length=cc.max_length,
                                method=method, over_max_length=cc.over_max_length)
            if t.drop_reason is None and t.template_error is None:
                sid = f"{src.name}:{i}"
                rows.append((shuffle_key(cc.seed, sid), sid, src.name, np.array(t.ids, np.int32),
                             np.array(t.mask, np.int8)))
    rows.sort(key=lambda r: (r[0], r[1]))
    table = pa.table({"index": list(range(len(rows))), "id": [r[1] for r in rows], "source": [r[2] for r in rows],
                      "input_ids": pa.array([r[3] for r in rows], pa.list_(pa.int32())),
                      "loss_mask": pa.array([r[4] for r in rows], pa.list_(pa.int8())),
                      "num_tokens": pa.array([len(r[3]) for r in rows], pa.int32())})
    pq.write_table(table, out)
    return {"records": len(rows), "tokens": int(sum(len(r[3]) for r in rows))}


# --- measuring -----------------------------------------------------------------------------------------

def _tree_rss(root: int) -> int:
    """Memory in bytes of root and its descendants: PSS (shared pages of forked workers counted once)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Pss:"))
        except OSError:
            pass
        todo.extend(children.get(pid, []))
    return total


def measure(argv: list[str]) -> tuple[dict, float, int]:
    """Run argv; return its last stdout JSON line, wall seconds and peak tree PSS."""
    start = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(p.pid))
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = p.communicate()
    stop.set()
    t.join()
    wall = time.monotonic() - start
    if p.returncode != 0:
        raise SystemExit(f"{argv} failed ({p.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), wall, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.02, help="fraction of the seeds' 37,312 records (default 0.02)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="corpus sizes, as multiples of the scaled one")
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; the fastest is reported, the highest peak memory")
    ap.add_argument("--work", default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:  # one measured run, in its own process
        mode, cfg_path, out = args.child
        if mode == "loop":
            print(json.dumps(plain_loop(cfg_path, out)))
        else:
            from eagleflow.config import load_config
            from eagleflow.corpus.prepare import prepare_corpus
            from eagleflow.layout import RunLayout
            cfg = load_config(cfg_path)
            stats = prepare_corpus(cfg, RunLayout.for_run(cfg, out), log=lambda _: None)
            print(json.dumps({"records": stats["records"], "tokens": stats["tokens"],
                              "records_with_tool_calls": stats["records_with_tool_calls"],
                              "tool_messages": stats["tool_messages"], "cut": stats["cut_at_message_boundary"],
                              "dropped_over_max_length": stats["dropped"]["over_max_length"]}))
        return

    import yaml

    from eagleflow.demo_assets import ensure_demo_assets
    assets = ensure_demo_assets(REPO / ".cache" / "bench-assets", fit_target=False)  # only its tokenizer is used
    work = Path(args.work or tempfile.mkdtemp(prefix="eagleflow-bench-corpus-"))
    base = max(8, round(SEEDS_RECORDS * args.scale))
    print(f"corpus benchmark: seeds shape (8 sources, {SEEDS_RECORDS} records, mean {SEEDS_MEAN_TOKENS} tokens) "
          f"scaled by {args.scale} -> {base} records; sizes x{args.sizes}; prepare with {args.num_proc} process(es); "
          f"{os.cpu_count()} CPU(s); demo tokenizer {assets['target_model']}")
    results = []
    for mult in args.sizes:
        n = base * mult
        src_dir = work / f"sources_{n}"
        sources = make_sources(src_dir, n, assets["target_model"])
        cfg_path = work / f"config_{n}.yaml"
        cfg_path.write_text(yaml.safe_dump({
            "run_root": str(work / "runs"), "target_model": assets["target_model"],
            "corpus": {"sources": sources, "seed": 42, "max_length": MAX_TOKENS, "num_proc": args.num_proc}}))
        me = [sys.executable, str(Path(__file__).resolve())]
        prep_runs, loop_runs = [], []
        for _ in range(args.repeat):  # alternate, keep the fastest of each: the machine is shared
            prep_runs.append(measure(me + ["--child", "prepare", str(cfg_path), f"prepare_{n}"]))
            loop_runs.append(measure(me + ["--child", "loop", str(cfg_path), str(work / f"loop_{n}.parquet")]))
        prep, prep_s, _ = min(prep_runs, key=lambda r: r[1])
        loop, loop_s, _ = min(loop_runs, key=lambda r: r[1])
        prep_rss, loop_rss = max(r[2] for r in prep_runs), max(r[2] for r in loop_runs)
        import pyarrow.parquet as pq
        same = pq.read_table(work / "runs" / f"prepare_{n}" / "corpus" / "corpus.parquet").equals(
            pq.read_table(work / f"loop_{n}.parquet"))
        if not same:
            raise SystemExit(f"prepare and the plain loop disagree at {n} records: {prep} vs {loop}")
        row = {"records": n, "kept": prep["records"], "tokens": prep["tokens"],
               "mean_tokens": prep["tokens"] / max(prep["records"], 1),
               "records_with_tool_calls": prep["records_with_tool_calls"], "tool_messages": prep["tool_messages"],
               "cut": prep["cut"], "dropped_over_max_length": prep["dropped_over_max_length"],
               "prepare_s": prep_s, "prepare_tok_s": prep["tokens"] / prep_s, "prepare_peak_mib": prep_rss / 2**20,
               "loop_s": loop_s, "loop_tok_s": loop["tokens"] / loop_s, "loop_peak_mib": loop_rss / 2**20}
        results.append(row)
        print(f"  {n:>6} records: {row['kept']} kept, {row['records_with_tool_calls']} with tool calls, "
              f"{row['tool_messages']} tool results, {row['cut']} cut at a message boundary, "
              f"{row['dropped_over_max_length']} dropped over max_length")
        print(f"  {n:>6} records {row['tokens']:>11,} tokens (mean {row['mean_tokens']:.0f}): "
              f"prepare {prep_s:6.1f} s {row['prepare_tok_s']:>9,.0f} tok/s peak {row['prepare_peak_mib']:6.0f} MiB | "
              f"loop {loop_s:6.1f} s {row['loop_tok_s']:>9,.0f} tok/s peak {row['loop_peak_mib']:6.0f} MiB | "
              f"speed ratio prepare/loop {row['prepare_tok_s'] / row['loop_tok_s']:.2f}x (identical output)")
    if len(results) > 1:
        a, b = results[0], results[-1]
        print(f"  memory growth from {a['records']} to {b['records']} records ({b['tokens'] / a['tokens']:.1f}x tokens): "
              f"prepare {b['prepare_peak_mib'] / a['prepare_peak_mib']:.2f}x, loop {b['loop_peak_mib'] / a['loop_peak_mib']:.2f}x")
    best = results[-1]
    if best["records"] >= SEEDS_RECORDS:
        print(f"  seeds scale measured: {best['records']} records, {best['tokens'] / 1e6:.1f} M tokens: prepare "
              f"{best['prepare_s'] / 60:.1f} min, peak {best['prepare_peak_mib']:.0f} MiB; loop "
              f"{best['loop_s'] / 60:.1f} min, peak {best['loop_peak_mib']:.0f} MiB")
    print(f"  seeds-sized corpus ({SEEDS_TOKENS / 1e6:.1f} M tokens) at prepare's rate here: "
          f"~{SEEDS_TOKENS / best['prepare_tok_s'] / 60:.0f} min (loop: ~{SEEDS_TOKENS / best['loop_tok_s'] / 60:.0f} min)")
    print(json.dumps({"scale": args.scale, "num_proc": args.num_proc, "repeat": args.repeat, "results": results}))


if __name__ == "__main__":
    main()
