"""prepare_corpus end to end in-process: the contract, determinism, bad records in both modes."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagleflow.config import load_config
from eagleflow.corpus.prepare import BadRecordsError, corpus_schema, prepare_corpus
from eagleflow.corpus.sources import SourceError
from eagleflow.corpus.tokenize import GENERATION_TAGS, encode_conversations, load_tokenizer
from eagleflow.layout import RunLayout
from tests.fixtures.corpus import BAD_SOURCES, GOOD_SOURCES, expected_bad, fixture_path, write_config


@pytest.fixture(scope="module")
def arrow_source(tmp_path_factory) -> str:
    """A `datasets` save_to_disk directory in ShareGPT form."""
    import datasets
    rows = [json.loads(x) for x in Path(fixture_path("good_sharegpt.jsonl")).read_text().splitlines()]
    out = tmp_path_factory.mktemp("arrow") / "sg_arrow"
    datasets.Dataset.from_list(rows).save_to_disk(str(out))
    return str(out)


def _prepare(tmp_path, demo_assets, sources, run_id="r", **corpus):
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], sources, corpus=corpus))
    layout = RunLayout.for_run(cfg, run_id)
    logs: list[str] = []
    stats = prepare_corpus(cfg, layout, log=logs.append)
    return cfg, layout, stats, logs


def _table(layout) -> pa.Table:
    return pq.read_table(str(layout.corpus_dir / "corpus.parquet"))


def test_contract_determinism_and_seed(tmp_path, demo_assets, arrow_source):
    sources = GOOD_SOURCES + [{"name": "sg_arrow", "path": arrow_source, "limit": 4}]
    _, lay1, s1, _ = _prepare(tmp_path, demo_assets, sources, run_id="a", seed=42, max_length=64)
    _, lay2, s2, _ = _prepare(tmp_path, demo_assets, sources, run_id="b", seed=42, max_length=64)
    _, lay3, s3, _ = _prepare(tmp_path, demo_assets, sources, run_id="c", seed=7, max_length=64)
    t1, t2, t3 = _table(lay1), _table(lay2), _table(lay3)

    assert t1.schema.equals(corpus_schema())
    n = 6 + 5 + 4 + 4  # good_sharegpt, good_openai.json, good_openai.parquet, arrow limited to 4
    assert t1.num_rows == n == s1["records"]
    assert t1["index"].to_pylist() == list(range(n))
    ids = t1["id"].to_pylist()
    assert sorted(ids) == sorted([f"sg:{i}" for i in range(6)] + [f"oa_json:{i}" for i in range(5)]
                                 + [f"oa_parquet:{i}" for i in range(4)] + [f"sg_arrow:{i}" for i in range(4)])
    assert ids != sorted(ids, key=lambda x: (x.split(":")[0], int(x.split(":")[1])))  # shuffled
    assert t1.equals(t2) and s1["order_sha256"] == s2["order_sha256"]
    assert sorted(t3["id"].to_pylist()) == sorted(ids) and t3["id"].to_pylist() != ids
    assert s3["order_sha256"] != s1["order_sha256"]

    # rows carry the same tokens and masks as the template gives for that record
    tok = load_tokenizer(demo_assets["target_model"])
    row = t1.to_pylist()[ids.index("sg:3")]
    [(exp_ids, exp_mask)] = encode_conversations(tok, [[{"role": "user", "content": "Repeat echo 3 times."},
                                                        {"role": "assistant", "content": "echo echo echo"}]],
                                                 GENERATION_TAGS)
    assert row["input_ids"] == exp_ids and row["loss_mask"] == exp_mask and row["num_tokens"] == len(exp_ids)
    assert row["source"] == "sg"

    # stats add up
    assert s1["tokens"] == sum(t1["num_tokens"].to_pylist())
    assert s1["masked_tokens"] == sum(sum(m) for m in t1["loss_mask"].to_pylist())
    assert {k: v["records"] for k, v in s1["per_source"].items()} == {"sg": 6, "oa_json": 5, "oa_parquet": 4,
                                                                     "sg_arrow": 4}
    assert s1["length"]["max"] <= 64 and s1["mask_method"] == GENERATION_TAGS
    assert json.loads((Path(str(lay1.corpus_dir)) / "stats.json").read_text()) == s1


@pytest.mark.slow  # starts worker process pools
def test_order_does_not_depend_on_process_count(tmp_path, demo_assets, monkeypatch):
    import eagleflow.corpus.prepare as prepare_mod
    monkeypatch.setattr(prepare_mod, "NORMALISE_ROWS_PER_PROCESS", 2)  # small sources: split them anyway
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], GOOD_SOURCES, corpus={"seed": 3}))
    logs: list[str] = []
    one = prepare_corpus(cfg, RunLayout.for_run(cfg, "p1"), num_proc=1, log=lambda _: None)
    two = prepare_corpus(cfg, RunLayout.for_run(cfg, "p2"), num_proc=2, log=logs.append)
    assert any("tokenised in 2 process(es)" in line for line in logs)
    assert any("sg: 6 record(s)" in line and "normalised in 2 process(es)" in line for line in logs)
    assert _table(RunLayout.for_run(cfg, "p1")).equals(_table(RunLayout.for_run(cfg, "p2")))
    assert one["order_sha256"] == two["order_sha256"]


def test_bad_records_fail_listing_the_first_ten(tmp_path, demo_assets):
    with pytest.raises(BadRecordsError) as e:
        _prepare(tmp_path, demo_assets, BAD_SOURCES, max_bad_records=0)
    msg = str(e.value)
    assert "15 bad record(s), more than corpus.max_bad_records=0" in msg
    listed = [ln for ln in msg.splitlines() if ln.startswith("  - ")]
    assert len(listed) == 10
    for line, (fname, where, field, _kind) in zip(listed, expected_bad()[:10]):
        assert f"{fixture_path(fname)} {where}: field {field} = " in line, line
    assert "'robot'" in listed[3] and "unknown role" in listed[3]   # the value is shown
    assert "(absent)" in listed[1]
    assert "set corpus.max_bad_records to at least 15" in msg
    # no stale corpus is left that a later task could mistake for this run's
    layout_dir = tmp_path / "runs" / "r" / "corpus"
    assert not (layout_dir / "corpus.parquet").exists() and not (layout_dir / "stats.json").exists()
    assert len((layout_dir / "bad_records.jsonl").read_text().splitlines()) == 15


def test_more_bad_records_than_allowed_still_fails(tmp_path, demo_assets):
    with pytest.raises(BadRecordsError, match="15 bad record"):
        _prepare(tmp_path, demo_assets, BAD_SOURCES, max_bad_records=14)


def test_bad_records_skipped_and_counted(tmp_path, demo_assets):
    _, layout, stats, logs = _prepare(tmp_path, demo_assets, BAD_SOURCES, max_bad_records=15)
    exp = expected_bad()
    assert stats["dropped"]["bad_record"] == {k: Counter(x[3] for x in exp)[k] for k in stats["dropped"]["bad_record"]}
    assert stats["dropped"]["no_assistant_tokens"] == 1  # bad_sharegpt.jsonl line 10
    assert {k: v["bad"] for k, v in stats["per_source"].items()} == {"bad_sg": 7, "bad_oa": 4, "bad_pq": 4}
    assert {k: v["read"] for k, v in stats["per_source"].items()} == {"bad_sg": 10, "bad_oa": 6, "bad_pq": 6}
    assert stats["per_source"]["bad_sg"]["dropped"] == 1
    assert stats["records"] == 6
    assert sorted(_table(layout)["id"].to_pylist()) == sorted(["bad_sg:0", "bad_sg:9", "bad_oa:0", "bad_oa:5",
                                                               "bad_pq:0", "bad_pq:5"])
    assert any("skipping 15 bad record(s)" in line for line in logs)
    assert len(stats["bad_records_shown"]) == 10
    assert len(Path(stats["bad_records_file"]).read_text().splitlines()) == 15


def test_unreadable_sources_name_the_fix(tmp_path, demo_assets):
    with pytest.raises(SourceError, match="does not exist; fix corpus.sources"):
        _prepare(tmp_path, demo_assets, [{"name": "x", "path": str(tmp_path / "nope.jsonl")}])
    odd = tmp_path / "data.txt"
    odd.write_text("{}")
    with pytest.raises(SourceError, match="set format: jsonl"):
        _prepare(tmp_path, demo_assets, [{"name": "x", "path": str(odd)}])


def test_empty_sources_and_nothing_to_train_on(tmp_path, demo_assets):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    only_user = tmp_path / "only_user.jsonl"
    only_user.write_text(json.dumps({"messages": [{"role": "user", "content": "hello?"}]}) + "\n")
    _, _, stats, logs = _prepare(tmp_path, demo_assets, [{"name": "e", "path": str(empty)}] + GOOD_SOURCES[:1])
    assert stats["per_source"]["e"] == {"read": 0, "bad": 0, "bad_by_reason": {}, "dropped": 0,
                                        "dropped_by_reason": {}, "records": 0, "turns": 0,
                                        "records_with_tool_calls": 0, "tool_calls": 0, "tool_messages": 0,
                                        "tokens": 0, "masked_tokens": 0, "cut_at_message": 0, "truncated": 0,
                                        "reasoning_not_rendered": 0, "non_text_parts_dropped": 0,
                                        "train_records": 0, "eval_records": 0, "duplicates_of_held_out": 0}
    assert stats["records"] == 6 and any("no records in" in line for line in logs)
    with pytest.raises(BadRecordsError, match=r"no record left to train on: 1 read \(e 0, u 1\), 0 bad, 1 dropped "
                                              r"\(no_assistant_tokens 1\)"):
        _prepare(tmp_path, demo_assets, [{"name": "e", "path": str(empty)}, {"name": "u", "path": str(only_user)}],
                 run_id="none")


def test_prefix_diff_fallback_gives_the_same_corpus(tmp_path, demo_assets):
    cfg = load_config(write_config(tmp_path, demo_assets["target_model"], GOOD_SOURCES, corpus={"max_length": 48}))
    tags = prepare_corpus(cfg, RunLayout.for_run(cfg, "tags"), log=lambda _: None)
    diff = prepare_corpus(cfg, RunLayout.for_run(cfg, "diff"), mask_method="prefix_diff", log=lambda _: None)
    assert (tags["mask_method"], diff["mask_method"]) == ("generation_tags", "prefix_diff")
    assert _table(RunLayout.for_run(cfg, "tags")).equals(_table(RunLayout.for_run(cfg, "diff")))


def test_held_out_split_is_stable_and_apart_from_training(tmp_path, demo_assets):
    """Held-out records: chosen by a hash of their id only (not the seed, not the other sources),
    never in corpus.parquet, rendered like the training rows, with a prompt before the last reply."""
    from eagleflow.corpus.prepare import EVAL_FILE, eval_key, eval_schema
    srcs = demo_assets["sources"]
    _, lay1, s1, logs = _prepare(tmp_path, demo_assets, srcs, run_id="a", eval_fraction=0.05, eval_min_records=4)
    _, lay2, s2, _ = _prepare(tmp_path, demo_assets, srcs, run_id="b", eval_fraction=0.05, eval_min_records=4,
                              seed=7)
    _, lay3, s3, _ = _prepare(tmp_path, demo_assets, srcs[:1], run_id="c", eval_fraction=0.05,
                              eval_min_records=0)
    ev1 = pq.read_table(str(lay1.corpus_dir / EVAL_FILE))
    assert ev1.schema.equals(eval_schema())
    held, train = ev1["id"].to_pylist(), _table(lay1)["id"].to_pylist()
    total = 3 * 24
    assert len(held) == s1["eval_records"] >= 4 and len(train) == s1["records"] == total - len(held)
    assert not set(held) & set(train)
    # the lowest keys of all records, whatever the seed
    all_ids = held + train
    assert sorted(held) == sorted(sorted(all_ids, key=eval_key)[:len(held)])
    assert sorted(pq.read_table(str(lay2.corpus_dir / EVAL_FILE))["id"].to_pylist()) == sorted(held)
    # a source alone keeps exactly its own records of the split (threshold part; no minimum here)
    first = srcs[0]["name"]
    thr = [i for i in all_ids if i.startswith(first + ":") and eval_key(i) < 0.05 * 2 ** 64]
    assert sorted(pq.read_table(str(lay3.corpus_dir / EVAL_FILE))["id"].to_pylist()) == sorted(thr)
    assert s1["splits"]["eval"] == {k: sum(1 for i in held if i.startswith(k + ":")) for k in s1["splits"]["eval"]}
    assert sum(s1["splits"]["train"].values()) == s1["records"]
    assert s1["masked_tokens"] == sum(sum(m) for m in _table(lay1)["loss_mask"].to_pylist())
    assert s1["tokens"] == sum(_table(lay1)["num_tokens"].to_pylist())
    # rendered the same way as training rows; the prompt is a prefix ending at the generation prompt
    tok = load_tokenizer(demo_assets["target_model"])
    for row in ev1.to_pylist():
        from eagleflow.corpus.normalise import Conversation
        conv = Conversation.from_json(row["conversation"])
        [(ids, mask)] = encode_conversations(tok, [conv], GENERATION_TAGS)
        assert row["input_ids"] == ids[:len(row["input_ids"])] and row["loss_mask"] == mask[:len(row["loss_mask"])]
        p = row["prompt_ids"]
        assert p and row["input_ids"][:len(p) - 4] == p[:-4]   # the generation prompt's header differs only
    assert any("held out of training" in line for line in logs)
    # the top-level tool figures are the training split's, like records and tokens
    _, _, s0, _ = _prepare(tmp_path, demo_assets, srcs, run_id="e", eval_fraction=0.0)
    held_tool = [Conversation.from_json(r["conversation"]) for r in ev1.to_pylist()]
    held_tool = [c for c in held_tool if any(m.get("tool_calls") for m in c.messages)]
    assert held_tool, "the split should hold out a tool record for this check to mean something"
    assert s1["records_with_tool_calls"] == s0["records_with_tool_calls"] - len(held_tool)
    assert s1["tool_messages"] == s0["tool_messages"] - sum(
        sum(m["role"] == "tool" for m in c.messages) for c in held_tool)
    # cap
    _, lay4, s4, _ = _prepare(tmp_path, demo_assets, srcs, run_id="d", eval_fraction=0.5, eval_max_records=3)
    assert s4["eval_records"] == 3 and s4["records"] == total - 3


def test_identical_conversations_land_on_one_side_of_the_split(tmp_path, demo_assets):
    """A source listed twice (as real corpora overlap): no held-out conversation has a copy in training, a
    held-out conversation appears once, and the stats count what was found."""
    from eagleflow.corpus.prepare import EVAL_FILE
    srcs = demo_assets["sources"]
    twice = srcs + [{**srcs[0], "name": srcs[0]["name"] + "_again"}]
    _, lay, s, logs = _prepare(tmp_path, demo_assets, twice, run_id="dup", eval_fraction=0.05,
                               eval_min_records=12)
    ev = pq.read_table(str(lay.corpus_dir / EVAL_FILE)).to_pylist()
    train = [tuple(x) for x in _table(lay)["input_ids"].to_pylist()]
    twinned = [r for r in ev if r["source"] in (srcs[0]["name"], srcs[0]["name"] + "_again")]
    assert twinned, "no held-out record of the doubled source: the test proves nothing"
    assert not {tuple(r["input_ids"]) for r in ev} & set(train)        # no held-out conversation trained on
    from eagleflow.corpus.prepare import content_key
    keys = [content_key(r["conversation"]) for r in ev]
    assert len(keys) == len(set(keys))                                 # each held out once
    d = s["duplicates"]
    assert d["records_with_an_identical_earlier_one"] >= 24            # the doubled source at least
    assert d["held_out_twins_dropped_from_training"] + d["held_out_copies_dropped"] >= len(twinned)
    assert s["records"] + s["eval_records"] + d["held_out_twins_dropped_from_training"] + \
        d["held_out_copies_dropped"] == 4 * 24
    assert sum(s["splits"]["train"].values()) == s["records"]
    assert any("copies of held-out ones left out of training" in line for line in logs)
    # the key is the normalised content: ids, sources and whitespace runs aside
    a = json.dumps({"messages": [{"role": "user", "content": "hi  there "}], "tools": None})
    b = json.dumps({"messages": [{"role": "user", "content": "hi there"}], "tools": None, "token_exact": [1]})
    c = json.dumps({"messages": [{"role": "user", "content": "hi where"}], "tools": None})
    assert content_key(a) == content_key(b) != content_key(c)
