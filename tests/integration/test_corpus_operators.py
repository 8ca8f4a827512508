"""The corpus operators' failure paths, through the real CLI on a LocalNode (no scheduler needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.corpus_operators import CheckDiskOperator, DeleteOldCachesOperator, PrepareCorpusOperator
from eagleflow.airflow.runtime import RunContext
from tests.fixtures.corpus import BAD_SOURCES, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _ctx(cfg_path: Path, run_id: str) -> RunContext:
    ctx = RunContext.from_params({"config_path": str(cfg_path)}, run_id)
    ctx.write_run_config()
    return ctx


def test_check_disk_fails_with_needed_free_where_and_what_to_free(tmp_path):
    # A target whose hidden states cannot fit anywhere: the real CLI measures the real disk and says no.
    target = tmp_path / "huge-target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 2**40, "torch_dtype": "bfloat16",
                                                    "num_hidden_layers": 61}))
    cache_root = tmp_path / "caches"
    (cache_root / "old").mkdir(parents=True)
    (cache_root / "old" / "blob").write_bytes(b"1" * 8192)
    cfg = write_config(tmp_path, str(target), [{"name": "s", "path": str(tmp_path / "unused.jsonl")}],
                       disk={"cache_root": str(cache_root), "old_caches": [str(cache_root / "old")]})
    ctx = _ctx(cfg, "disk")
    corpus = Path(str(ctx.layout.corpus_dir))
    corpus.mkdir(parents=True)
    (corpus / "stats.json").write_text(json.dumps({"records": 10, "tokens": 1000, "per_source": {"s": {}}}))
    with pytest.raises(AirflowFailException) as e:
        CheckDiskOperator(task_id="check_disk").run(ctx, {})
    msg = str(e.value)
    assert "not enough disk for the hidden states" in msg and "NOT ENOUGH DISK" in msg
    assert "free there:" in msg and str(ctx.layout.hidden_states_dir) in msg
    assert f"{cache_root / 'old'}: " in msg and "delete_old_caches" in msg

    # delete_old_caches off (default): a logged no-op that succeeds, so check_disk still runs after it
    result = DeleteOldCachesOperator(task_id="delete_old_caches").run(ctx, {})
    assert result["enabled"] is False and result["deleted"] == {} and (cache_root / "old" / "blob").exists()


def test_prepare_fails_without_retry_listing_bad_records(tmp_path, demo_assets):
    cfg = write_config(tmp_path, demo_assets["target_model"], BAD_SOURCES)
    ctx = _ctx(cfg, "bad")
    with pytest.raises(AirflowFailException) as e:
        PrepareCorpusOperator(task_id="prepare_corpus").run(ctx, {})
    msg = str(e.value)
    assert "corpus has bad records" in msg and "15 bad record(s)" in msg
    assert "bad_sharegpt.jsonl line 2: field (line)" in msg and "line 5: field conversations[1].from = 'robot'" in msg
    assert msg.count("  - ") == 10


def test_prepare_fails_without_retry_when_the_template_cannot_render_tools(tmp_path, demo_assets):
    import shutil

    from tests.fixtures.corpus import TOOL_SOURCES
    target = tmp_path / "target"
    shutil.copytree(demo_assets["target_model"], target)
    (target / "chat_template.jinja").write_text(  # a template that knows roles and content only
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
        "{% endfor %}")
    ctx = _ctx(write_config(tmp_path, str(target), TOOL_SOURCES), "template")
    with pytest.raises(AirflowFailException) as e:
        PrepareCorpusOperator(task_id="prepare_corpus").run(ctx, {})
    msg = str(e.value)
    assert "chat template cannot render it" in msg and f"the chat template of {target} (chat_template.jinja" in msg
    assert "record tools_oa:0 (" in msg and "tools_openai.jsonl line 1): tools[0] (function 'add')" in msg
