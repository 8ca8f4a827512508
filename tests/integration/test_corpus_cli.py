"""`eagleflow corpus ...` as a person (or an operator on the node) runs it: real processes, real files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.corpus import BAD_SOURCES, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", "corpus", *args], capture_output=True, text=True,
                          timeout=180)


def test_prepare_stats_budget_delete(tmp_path, demo_assets):
    cache_root = tmp_path / "caches"
    (cache_root / "old").mkdir(parents=True)
    (cache_root / "old" / "x.bin").write_bytes(b"0" * 20_000)
    cfg = write_config(tmp_path, demo_assets["target_model"], demo_assets["sources"],
                       corpus={"max_length": 256, "num_proc": 2},
                       disk={"cache_root": str(cache_root), "old_caches": [str(cache_root / "old")]})
    run = ["--config", str(cfg), "--run-id", "cli"]

    prep = _cli("prepare", *run)
    assert prep.returncode == 0, prep.stderr
    stats = json.loads(prep.stdout.strip().splitlines()[-1])
    assert stats["records"] == 3 * 24 and stats["mask_method"] == "generation_tags"
    # every fourth demo record calls a tool: OpenAI form, ShareGPT function_call form, Parquet structs
    assert {k: v["records_with_tool_calls"] for k, v in stats["per_source"].items()} == {
        "sharegpt": 6, "openai": 6, "parquet": 6}
    assert stats["tool_messages"] == 18 and stats["dropped"]["over_max_length"] == 0
    assert "tokenised in 2 process(es)" in prep.stderr
    corpus_dir = tmp_path / "runs" / "cli" / "corpus"
    assert (corpus_dir / "corpus.parquet").is_file()
    assert not [p for p in corpus_dir.iterdir() if p.name.startswith(".work-")]  # work files cleaned up

    st = _cli("stats", *run)
    assert st.returncode == 0 and f"records {stats['records']}, tokens {stats['tokens']}" in st.stdout
    assert "sharegpt" in st.stdout and "p99" in st.stdout and "tool calls" in st.stdout

    bud = _cli("budget", "--check", *run)
    assert bud.returncode == 0, bud.stderr
    verdict = json.loads(bud.stdout.strip().splitlines()[-1])
    assert verdict["ok"] and verdict["estimate"]["tokens"] == stats["tokens"]
    assert verdict["where"] == str(tmp_path / "runs" / "cli" / "hidden_states")

    dry = _cli("delete-caches", *run)  # delete_old_caches is off in this config
    assert dry.returncode == 0 and "nothing deleted" in dry.stderr and (cache_root / "old" / "x.bin").exists()
    real = _cli("delete-caches", *run, "--set", "disk.delete_old_caches=true")
    assert real.returncode == 0 and f"deleted {cache_root / 'old'}" in real.stderr
    assert json.loads(real.stdout)["freed_bytes"] >= 20_000 and not (cache_root / "old").exists()

    escape = _cli("delete-caches", *run, "--set", "disk.delete_old_caches=true",
                  "--set", f"disk.old_caches=[{tmp_path / 'runs'}]")
    assert escape.returncode == 5 and "not inside disk.cache_root" in escape.stderr
    assert (tmp_path / "runs" / "cli" / "corpus" / "corpus.parquet").exists()


def test_prepare_fails_on_bad_records_listing_them(tmp_path, demo_assets):
    cfg = write_config(tmp_path, demo_assets["target_model"], BAD_SOURCES)
    res = _cli("prepare", "--config", str(cfg), "--run-id", "bad")
    assert res.returncode == 3
    assert "15 bad record(s)" in res.stderr and "bad_sharegpt.jsonl line 2: field (line)" in res.stderr
    assert "Traceback" not in res.stderr
