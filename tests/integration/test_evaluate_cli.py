"""`eagleflow evaluate` as the node runs it: real corpus prepare, a real export directory, real processes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.fixtures.corpus import write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=300)


def write_random_export(out: Path, target_dir: str) -> Path:
    """A draft with random weights, written as `eagleflow export` writes one (config, safetensors, meta)."""
    import torch
    from safetensors.torch import save_file

    from eagleflow.engines.sglang.export import eagle_layer_ids
    from eagleflow.train.export import export_config
    from eagleflow.train.model import DraftConfig, Eagle3Draft
    torch.manual_seed(3)
    dcfg = DraftConfig.from_target(target_dir, 128)
    model = Eagle3Draft(dcfg)
    model.d2t.copy_(torch.arange(128) * 0)   # draft ids 0..127 are target ids 0..127
    model.t2d[:128] = True
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.trainable_state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(export_config(dcfg, eagle_layer_ids(target_dir, None), "float32")))
    (out / "eagleflow_export.json").write_text(json.dumps({"aux_layer_outputs": None}))
    return out


def test_random_draft_is_refused_and_kept_a_passing_one_is_promoted(tmp_path, demo_assets):
    cfg = write_config(tmp_path, demo_assets["target_model"], demo_assets["sources"],
                       corpus={"max_length": 256, "eval_fraction": 0.05, "eval_min_records": 3})
    run = ["--config", str(cfg), "--run-id", "ev"]
    prep = _cli("corpus", "prepare", *run)
    assert prep.returncode == 0, prep.stderr
    corpus_dir = tmp_path / "runs" / "ev" / "corpus"
    held = set(pq.read_table(str(corpus_dir / "eval.parquet"))["id"].to_pylist())
    assert len(held) >= 3 and not held & set(pq.read_table(str(corpus_dir / "corpus.parquet"))["id"].to_pylist())

    export = write_random_export(tmp_path / "runs" / "ev" / "draft" / "export", demo_assets["target_model"])
    small = ["--set", "eval.max_prompts=2", "--set", "eval.max_new_tokens=12",
             "--set", "eval.configs=[{steps: 3, draft_tokens: 4}]"]
    res = _cli("evaluate", *run, *small, "--json")
    assert res.returncode == 1, res.stderr
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert answer["passed"] is False and answer["promoted"] is None
    [row] = answer["results"]
    acc = row["draft"]["accept_length"]
    assert row["config"] == "3/1/4" and row["prompts"] == 2 and acc < 1.2 and row["draft"]["lossless"]
    assert answer["refused"] == [f"configuration 3/1/4 on held_out (2 prompts): acceptance length {acc:.3f} is "
                                 "below eval.min_accept_length 1.500"]
    ev = json.loads((tmp_path / "runs" / "ev" / "eval.json").read_text())
    assert ev["passed"] is False and ev["results"] == answer["results"]
    assert (export / "model.safetensors").is_file()             # kept either way
    assert not (tmp_path / "runs" / "promoted.json").exists()
    assert "acceptance length" in res.stderr and "lossless" in res.stderr   # the table, in the task log

    # the same draft as its own baseline, with a minimum it reaches: passes and is promoted
    res = _cli("evaluate", *run, *small, "--set", "eval.min_accept_length=1.0",
               "--set", f"eval.baseline_draft={export}", "--json")
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert answer["passed"] and answer["results"][0]["baseline"]["accept_length"] == \
        answer["results"][0]["draft"]["accept_length"]
    promoted = json.loads((tmp_path / "runs" / "promoted.json").read_text())
    assert promoted["draft"] == str(export) and promoted["run_id"] == "ev" and "3/1/4" in promoted["accept_length"]

    # extra prompt sets: reported per set and configuration, beside the held-out split
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"prompt": "What is two plus two?"}) + "\n\n"
                    + json.dumps({"id": "chat1", "messages": [{"role": "user", "content": "Say hi"},
                                                              {"role": "assistant", "content": "hi"}]}) + "\n")
    sets = ["--set", f"eval.prompt_sets=[{{name: mine, path: {mine}}}]", "--set", "eval.min_accept_length=1.0"]
    res = _cli("evaluate", *run, *small, *sets, "--json")
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(r["config"], r["prompt_set"], r["prompts"]) for r in answer["results"]] == [
        ("3/1/4", "held_out", 2), ("3/1/4", "mine", 2)]
    assert "mine x2" in res.stderr
    promoted = json.loads((tmp_path / "runs" / "promoted.json").read_text())
    assert [(t["config"], t["prompt_set"]) for t in promoted["table"]] == [("3/1/4", "held_out"), ("3/1/4", "mine")]

    # a bad prompt-set file is named with its line, no figures
    mine.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    res = _cli("evaluate", *run, *small, *sets, "--json")
    assert res.returncode == 2 and f"eval.prompt_sets[0] (mine): {mine} line 2 is not JSON" in res.stderr
    mine.write_text(json.dumps({"messages": []}) + "\n")
    res = _cli("evaluate", *run, *small, *sets, "--json")
    assert res.returncode == 2 and f"{mine} line 1: " in res.stderr and "no messages" in res.stderr
    res = _cli("evaluate", *run, *small, "--set", f"eval.prompt_sets=[{{name: gone, path: {tmp_path}/gone.jsonl}}]")
    assert res.returncode == 2 and f"eval.prompt_sets[0] (gone): {tmp_path}/gone.jsonl is not a file" in res.stderr

    # the sglang backend needs sglang (the node's venv): without it, exit 2 saying what to do
    res = _cli("evaluate", *run, "--set", "eval.backend=sglang")
    assert res.returncode == 2 and "eval.backend sglang: sglang is not installed" in res.stderr, res.stderr
    assert "eval.backend hf" in res.stderr
