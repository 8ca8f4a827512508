"""The held-out evaluation during training (train.eval_every over <run>/hidden_states_held_out).

Training and held-out stores follow the same learnable rule (tests/fixtures/train_hidden_states.py) with
different samples, so a draft that learns the rule scores better on the held-out ones as it trains; the
figures are computed on those samples, not copied from the training batches.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from eagleflow.capture.verify import NotVerifiedError
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.train.curves import read_metrics
from eagleflow.train.trainer import train
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states


def _setup(tmp_path: Path, target: str, *, held_out: int = 16, held_out_kw: dict | None = None, **train_fields):
    fields = {"device": "cpu", "max_steps": 30, "batch_size": 8, "lr": 3e-3, "warmup_steps": 4, "ttt_length": 3,
              "draft_vocab_size": 64, "checkpoint_every": 1000, "log_every": 1000, "eval_every": 10}
    fields.update(train_fields)
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": target, "train": fields,
                            "capture": {"heartbeat_interval_s": 0.5}})
    layout = RunLayout.for_run(cfg, "r1")
    write_synthetic_hidden_states(layout.hidden_states_dir, target, samples=48)
    if held_out:
        write_synthetic_hidden_states(layout.held_out_hidden_states_dir, target, samples=held_out, shards=1,
                                      first_index=48, **{"id_prefix": "held", **(held_out_kw or {})})
    return cfg, layout


@pytest.mark.slow
def test_held_out_figures_every_eval_every_steps_improve_and_are_their_own(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets["target_model"])
    lines: list[str] = []
    assert train(cfg, layout, log=lines.append).completed
    rows = read_metrics(Path(layout.draft_dir) / "metrics.jsonl")
    scored = [r for r in rows if "eval_accept_length" in r]
    assert [r["step"] for r in scored] == [10, 20, 30]
    assert all(r["eval_samples"] == 16 for r in scored)
    # the draft learns the rule, and the held-out samples show it
    assert scored[-1]["eval_acc_0"] > scored[0]["eval_acc_0"]
    assert scored[-1]["eval_loss_per_position"] < scored[0]["eval_loss_per_position"]
    assert scored[-1]["eval_accept_length"] > 1.0
    # computed on other samples than the step's training batch
    assert all(r["eval_positions"] != r["positions"] or r["eval_loss"] != r["loss"] for r in scored)
    assert any("held-out at step 30" in m and "(16 samples)" in m for m in lines)
    assert (Path(layout.draft_dir) / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow   # trains
def test_no_held_out_store_trains_without_scores_and_says_so(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets["target_model"], held_out=0, max_steps=3)
    lines: list[str] = []
    assert train(cfg, layout, log=lines.append).completed
    assert not any("eval_accept_length" in r for r in read_metrics(Path(layout.draft_dir) / "metrics.jsonl"))
    assert any("no held-out hidden states at" in m and "capture held-out" in m for m in lines)


def test_unverified_held_out_store_is_refused(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets["target_model"], held_out_kw={"verify": False}, max_steps=3)
    with pytest.raises(NotVerifiedError, match="hidden_states_held_out"):
        train(cfg, layout, log=lambda _m: None)


def test_held_out_record_also_in_the_training_store_is_refused(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets["target_model"], held_out_kw={"id_prefix": "synthetic"},
                         max_steps=3)
    with pytest.raises(ValueError, match=r"held-out records \['synthetic:0'.*also in the training store"):
        train(cfg, layout, log=lambda _m: None)


@pytest.mark.slow   # trains
def test_eval_every_zero_never_reads_the_held_out_store(tmp_path, demo_assets):
    cfg, layout = _setup(tmp_path, demo_assets["target_model"], held_out_kw={"verify": False}, max_steps=3,
                         eval_every=0)
    assert train(cfg, layout, log=lambda _m: None).completed   # unverified, yet never read
