"""The held-out split by what a record is about (corpus.eval_group_key): a group is held out or trained on whole."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from eagleflow.config import SourceConfig, load_config
from eagleflow.corpus.normalise import record_group
from eagleflow.corpus.prepare import (EVAL_FILE, GroupKeyError, eval_key, held_out_count, held_out_groups,
                                      prepare_corpus)
from eagleflow.layout import RunLayout
from tests.fixtures.corpus import write_config

TOPICS = 40


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sources(tmp_path: Path) -> tuple[list[dict], dict[str, str]]:
    """Three sources, several records per topic across them (as the learnable target's functions): code in
    OpenAI form with the topic in ``metadata``; questions in ShareGPT form with it at the top level; a third of
    the topics asked once more. Returns the sources and each record id's topic."""
    code, ask, again = [], [], []
    for i in range(TOPICS):
        topic = f"mod{i % 7}.func_{i}"
        code.append({"messages": [{"role": "user", "content": f"Write {topic}."},
                                  {"role": "assistant", "content": f"def func_{i}(x):\n    return x + {i}"}],
                     "metadata": {"function": topic}})
        ask.append({"conversations": [{"from": "human", "value": f"What does {topic} do?"},
                                      {"from": "gpt", "value": f"It adds {i} to x."}], "function": topic})
        if i % 3 == 0:
            again.append({"messages": [{"role": "user", "content": f"Document {topic}."},
                                       {"role": "assistant", "content": f"Return x plus {i}."}],
                          "metadata": {"function": topic, "kind": "doc"}})
    sources = [{"name": "code", "path": _write(tmp_path / "code.jsonl", code)},
               {"name": "ask", "path": _write(tmp_path / "ask.jsonl", ask)},
               {"name": "again", "path": _write(tmp_path / "again.jsonl", again)}]
    topic_of = {f"code:{r}": x["metadata"]["function"] for r, x in enumerate(code)}
    topic_of |= {f"ask:{r}": x["function"] for r, x in enumerate(ask)}
    topic_of |= {f"again:{r}": x["metadata"]["function"] for r, x in enumerate(again)}
    return sources, topic_of


def _prepare(tmp_path, demo_assets, sources, run_id, **corpus):
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], sources, corpus=corpus,
                                   name=f"{run_id}.yaml"))
    layout = RunLayout.for_run(cfg, run_id)
    logs: list[str] = []
    stats = prepare_corpus(cfg, layout, log=logs.append)
    held = pq.read_table(str(layout.corpus_dir / EVAL_FILE), columns=["id"])["id"].to_pylist()
    train = pq.read_table(str(layout.corpus_dir / "corpus.parquet"), columns=["id"])["id"].to_pylist()
    return stats, held, train, logs


def test_no_held_out_group_shares_its_key_with_a_training_record(tmp_path, demo_assets):
    sources, topic_of = _sources(tmp_path)
    total = len(topic_of)
    split = {"eval_fraction": 0.2, "eval_min_records": 4, "max_length": 128}
    # split by record (the key unset), the same corpus has held-out records whose topic is trained on
    s0, held0, train0, _ = _prepare(tmp_path, demo_assets, sources, "by-record", **split)
    assert {topic_of[i] for i in held0} & {topic_of[i] for i in train0}, "the corpus cannot show the difference"
    assert s0["eval_split"]["group_key"] is None
    assert s0["eval_split"]["groups"] == {"eval": len(held0), "train": len(train0)}   # a record a group

    s, held, train, logs = _prepare(tmp_path, demo_assets, sources, "by-topic", eval_group_key="function", **split)
    held_topics, train_topics = {topic_of[i] for i in held}, {topic_of[i] for i in train}
    assert held and not held_topics & train_topics
    assert len(held) + len(train) == total and not set(held) & set(train)
    assert len(held) > len(held_topics)                          # several records per held-out group
    for t in held_topics:                                        # each held out whole, every source's record of it
        assert {i for i in topic_of if topic_of[i] == t} <= set(held)
    # the groups held out: those of the hash's share, by the group's key (not a record's)
    by_hash = {t for t in train_topics | held_topics if eval_key(t) < 0.2 * 2 ** 64}
    assert by_hash <= held_topics
    # a held-out group's records are consecutive in eval.parquet (by group, lowest group key first)
    order = [topic_of[i] for i in held]
    assert order == sorted(order, key=lambda t: (eval_key(t), t))
    # the stats count groups and records per side
    es = s["eval_split"]
    assert es["group_key"] == "function" and "function" in es["key"]
    assert es["groups"] == {"eval": len(held_topics), "train": len(train_topics)}
    assert es["records"] == {"eval": len(held), "train": len(train)} == {"eval": s["eval_records"],
                                                                         "train": s["records"]}
    assert sum(es["groups"].values()) == TOPICS
    assert any(f"{len(held_topics)} group(s) by function held out, {len(train_topics)} trained on" in x
               for x in logs)


def test_a_record_without_the_key_is_an_error_naming_it(tmp_path, demo_assets):
    sources, _ = _sources(tmp_path)
    ask = Path(sources[1]["path"])
    lines = ask.read_text().splitlines()
    for n in (4, 9):   # lines 5 and 10: one without the field, one with it null
        rec = json.loads(lines[n])
        if n == 4:
            del rec["function"]
        else:
            rec["function"] = None
        lines[n] = json.dumps(rec)
    ask.write_text("\n".join(lines) + "\n")
    with pytest.raises(GroupKeyError) as e:
        _prepare(tmp_path, demo_assets, sources, "missing", eval_group_key="function", eval_fraction=0.2)
    msg = str(e.value)
    assert "corpus.eval_group_key is 'function'" in msg
    assert f"record ask:4 ({ask} line 5)" in msg                   # the first one: file, line, record id
    assert "2 of 94 record(s) lack it (ask 2)" in msg                      # how many lack it, per source
    assert "add the field" in msg and "unset it" in msg            # what to do
    assert not (tmp_path / "runs" / "missing" / "corpus" / "corpus.parquet").exists()


def test_held_out_groups_take_whole_groups_within_the_bounds():
    def cc(fraction=0.5, lo=0, hi=500):
        return SimpleNamespace(eval_fraction=fraction, eval_min_records=lo, eval_max_records=hi)
    sizes = {f"g{i}": 1 + i % 4 for i in range(60)}
    order = sorted(sizes, key=lambda g: (eval_key(g), g))
    by_hash = [g for g in order if eval_key(g) < 0.5 * 2 ** 64]
    assert held_out_groups(sizes, cc()) == by_hash                         # the hash's share, by group
    assert held_out_groups(sizes, cc(0.0, lo=10)) == []                    # no split
    low = held_out_groups(sizes, cc(0.01, lo=10))                          # raised to the minimum, whole groups
    assert low == order[:len(low)] and sum(sizes[g] for g in low) >= 10 > sum(sizes[g] for g in low[:-1])
    capped = held_out_groups(sizes, cc(0.9, hi=7))                         # capped, whole groups
    assert capped == order[:len(capped)] and sum(sizes[g] for g in capped) <= 7
    assert sum(sizes[g] for g in order[:len(capped) + 1]) > 7
    assert held_out_groups({"a": 3, "b": 2}, cc(0.99, lo=10)) in (["a"], ["b"])   # one group stays for training
    # a record a group: the same records as the split by record (held_out_count's rule)
    ones = {f"s:{i}": 1 for i in range(200)}
    for c in (cc(0.05, lo=4), cc(0.0001, lo=4), cc(0.5, hi=30)):
        n = held_out_count(sum(eval_key(g) < c.eval_fraction * 2 ** 64 for g in ones), 200, c)
        assert held_out_groups(ones, c) == sorted(ones, key=eval_key)[:n]


def test_record_group_reads_a_field_its_metadata_or_a_dotted_path():
    rec = {"messages": [], "topic": "t1", "metadata": {"function": "json.dumps", "n": 3, "tags": ["b", "a"]},
           "info": {"about": {"id": 7}}, "empty": ""}
    assert record_group(rec, "topic") == "t1"
    assert record_group(rec, "function") == "json.dumps"          # absent at the top level: from metadata
    assert record_group(rec, "metadata.function") == "json.dumps"
    assert record_group(rec, "n") == "3" and record_group(rec, "tags") == '["b","a"]'
    assert record_group(rec, "info.about.id") == "7" and record_group(rec, "info.about") == '{"id":7}'
    assert record_group(rec, "empty") is None and record_group(rec, "nope") is None
    assert record_group(rec, "info.nope") is None and record_group(["not", "a", "dict"], "topic") is None


def test_a_regenerated_source_takes_its_groups_from_its_original_records(tmp_path):
    from eagleflow.corpus.prepare import _original_groups
    sources, topic_of = _sources(tmp_path)
    src = SourceConfig(**sources[0], limit=5)
    groups = _original_groups(src, Path(src.path), "function", str(tmp_path / "cache"))
    assert groups == {r: topic_of[f"code:{r}"] for r in range(5)}


def test_the_config_checks_the_key():
    from pydantic import ValidationError

    from eagleflow.config import CorpusConfig
    assert CorpusConfig().eval_group_key is None
    assert CorpusConfig(eval_group_key="metadata.function").eval_group_key == "metadata.function"
    for bad in ("", "a..b", ".a", "a b"):
        with pytest.raises(ValidationError):
            CorpusConfig(eval_group_key=bad)
