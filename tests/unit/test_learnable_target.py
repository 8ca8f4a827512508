"""The learnable target's inputs: standard-library functions shaped as chat records, and its training loop."""
from __future__ import annotations

import json
import textwrap

import pytest

from eagleflow.corpus.normalise import normalise_conversation
from eagleflow.learnable_target import TargetShape, records, stdlib_functions, stdlib_root, train_target


def _lib(tmp_path):
    (tmp_path / "shapes.py").write_text(textwrap.dedent('''
        def area(w, h=1):
            """Return the area of a w by h rectangle.

            Both sides in the same unit."""
            return w * h

        def _hidden():
            """Private: not a record."""

        def undocumented():
            return 1

        class Box:
            def volume(self, depth):
                """Return the volume."""
                return depth

        def long_one():
            """Too long."""
    ''') + "    x = 1\n" * 40)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_shapes.py").write_text('def test_x():\n    """A test, not library text."""\n')
    (tmp_path / "broken.py").write_text("def f(:\n")
    return tmp_path


def test_functions_are_the_documented_short_public_ones_with_their_source(tmp_path):
    fns = stdlib_functions(_lib(tmp_path), max_lines=30)
    assert [f.symbol for f in fns] == ["shapes.area", "shapes.Box.volume"]
    area = fns[0]
    assert area.signature == "(w, h=1)" and area.source.startswith("def area(w, h=1):")
    assert area.docstring.startswith("Return the area") and area.source.endswith("return w * h")
    assert fns[1].source.startswith("def volume(self, depth):")   # dedented out of its class


def test_records_are_chat_records_the_corpus_reads_with_tool_calls_that_parse(tmp_path):
    fns = stdlib_functions(_lib(tmp_path)) * 3
    code, docs = records(fns)
    assert len(code) == 6 and len(docs) == 4
    for rec in code + docs:
        normalise_conversation(json.loads(json.dumps(rec)))
    tool = next(r for r in docs if "tools" in r)
    call = tool["messages"][1]["tool_calls"][0]["function"]
    assert call["name"] == "help" and json.loads(call["arguments"]) == {"symbol": "shapes.Box.volume"}
    assert json.loads(tool["messages"][2]["content"]) == {"doc": "Return the volume."}
    assert tool["messages"][3]["content"] == "`shapes.Box.volume(self, depth)`: Return the volume."
    doc = next(r for r in docs if "tools" not in r)
    assert doc["messages"][1]["content"].startswith("Return the area")


def test_the_interpreters_own_library_gives_thousands_of_functions():
    fns = stdlib_functions(stdlib_root() / "json")
    assert any(f.symbol == "decoder.JSONDecoder.decode" for f in fns)


@pytest.mark.slow
def test_training_lowers_the_loss_and_saves_a_model_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM
    seqs = [[0, 2, 7, 8, 9, 10, 11, 12, 4] * 4 for _ in range(40)]
    shape = TargetShape(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, block=32, batch=8,
                        epochs=6, lr=1e-2, warmup_steps=2, threads=1)
    figures = train_target(tmp_path, seqs, shape, vocab_size=16, log=lambda _: None)
    assert figures["final_loss"] < figures["first_loss"] / 3, figures
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert model.config.num_hidden_layers == 2 and figures["params"] == sum(p.numel() for p in model.parameters())


def test_every_record_says_which_function_it_is_about(tmp_path):
    """The held-out split's group (corpus.eval_group_key "function"): a function's records share it."""
    from eagleflow.corpus.normalise import record_group
    fns = stdlib_functions(_lib(tmp_path)) * 2
    code, docs = records(fns)
    assert [record_group(r, "function") for r in code] == [f.symbol for f in fns]
    assert [record_group(r, "function") for r in docs] == [fns[1].symbol, fns[2].symbol]   # i % 3 == 1, 2


def test_sources_of_a_version_1_cache_are_written_again_with_their_function(tmp_path, monkeypatch):
    """A cache built before the records named their function keeps its trained target; its sources gain it."""
    from dataclasses import asdict

    import eagleflow.learnable_target as lt
    (tmp_path / "lib").mkdir()
    fns = stdlib_functions(_lib(tmp_path / "lib"))
    monkeypatch.setattr(lt, "stdlib_functions", lambda max_lines: fns)
    root = tmp_path / "cache"
    root.mkdir()
    old = {"version": 1, "shape": asdict(TargetShape()), "functions": len(fns), "target_model": "kept",
           "sources": []}
    (root / "assets.json").write_text(json.dumps(old))
    info = lt.ensure_learnable_target(root, log=lambda _: None)
    assert info["version"] == lt.ASSETS_VERSION and info["target_model"] == "kept"
    rows = [json.loads(x) for s in info["sources"] for x in open(s["path"])]
    assert rows and all(r["metadata"]["function"] in {f.symbol for f in fns} for r in rows)
    assert json.loads((root / "assets.json").read_text()) == info
