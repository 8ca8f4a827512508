"""Figures the docs and shipped configs derive from the code (issue 39 item 7): each written mention of the stall
detection bound equals ``WatchdogConfig.detection_bound_s`` of the defaults it names, so changing a default
without the words fails here instead of leaving the words stale."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from eagleflow.config import WatchdogConfig

REPO = Path(__file__).resolve().parents[2]
# "... = 40 s" or "= **40 s**" or "bound 40 s" after the words "bound" / "detection_bound_s"
MENTION = re.compile(r"(?:(?:detection bound|detection_bound_s|Detection bound|bound)[^.\n]{0,90}?(?:=|bound)\s*\**"
                     r"(\d+(?:\.\d+)?) s\b)|\((\d+(?:\.\d+)?) s with the defaults\)")


def _mentions(path: Path) -> list[tuple[int, float]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if "stall_after" in line or "detection_bound" in line or "Detection bound" in line or "defaults)" in line:
            out += [(i, float(m.group(1) or m.group(2))) for m in MENTION.finditer(line)]
    return out


def test_the_docs_state_the_default_detection_bound_the_code_computes():
    bound = WatchdogConfig().detection_bound_s
    found = {}
    for path in [*(REPO / "docs").glob("*.md"), REPO / "include/eagleflow/config.py",
                 REPO / "include/eagleflow/airflow/shard_watch.py"]:
        for line, value in _mentions(path):
            found[f"{path.relative_to(REPO)}:{line}"] = value
    assert found, "no mention of the detection bound found: the pattern no longer matches the docs"
    wrong = {k: v for k, v in found.items() if v != bound}
    assert not wrong, f"these say a detection bound other than the defaults' {bound:g} s: {wrong}"


def test_each_shipped_config_states_its_own_detection_bound():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        mentions = _mentions(path)
        if not mentions:
            continue
        wd = WatchdogConfig(**(yaml.safe_load(path.read_text()).get("watchdog") or {}))
        assert all(v == wd.detection_bound_s for _, v in mentions), (path.name, mentions, wd.detection_bound_s)
