"""docs/config-reference.md is generated from PipelineConfig's own fields (issue 39 item 7): it cannot drift."""
from __future__ import annotations

from pathlib import Path

from eagleflow.config_reference import render, rows, undescribed

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "config-reference.md"


def test_the_checked_in_reference_is_what_the_config_says():
    assert DOC.read_text() == render(), ("docs/config-reference.md is out of date with eagleflow.config: regenerate "
                                         "it with `.venv/bin/python -m eagleflow.config_reference > "
                                         "docs/config-reference.md`")


def test_every_key_says_what_it_does():
    assert undescribed() == [], "give these fields a description= in eagleflow/config.py"


def test_the_reference_names_nested_and_listed_keys_with_their_bounds():
    keys = {key: (info, type_text) for key, info, type_text in rows()}
    assert "corpus.sources[].path" in keys and "fleet.nodes[].name" in keys and "source_path" not in keys
    text = render()
    assert "| `capture.shards` | integer | `1` | >= `1`, <= `1024` |" in text
    assert "| `gpu.probe` | \"auto\" \\| \"nvml\" \\| \"smi\" | `\"auto\"` |" in text
