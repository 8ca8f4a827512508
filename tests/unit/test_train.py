"""Draft training on CPU: learning, exact resume, export round trip, data and vocabulary checks.

The target is the tiny demo Llama (``demo_assets``); the stored hidden states
are synthetic with a learnable rule (tests/fixtures/train_hidden_states.py),
written with the capture subsystem's own writers, so the reader is tested on
the real storage format.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.train.checkpoint import latest_checkpoint, load_checkpoint
from eagleflow.train.curves import read_metrics
from eagleflow.train.data import (BadSampleError, DataPosition, HiddenStateLoader, epoch_batches,
                                  read_sample_keys, scan_samples)
from eagleflow.train.export import SGLANG_WEIGHT_NAMES, export_latest, load_exported
from eagleflow.train.trainer import build_draft, train
from eagleflow.train.vocab import DraftVocab, build_draft_vocab, count_loss_tokens
from tests.fixtures.train_hidden_states import AUX_LAYERS, write_synthetic_hidden_states


def _setup(tmp_path: Path, target: str, *, samples: int = 48, **train_fields):
    fields = {"device": "cpu", "max_steps": 16, "batch_size": 8, "lr": 3e-3, "warmup_steps": 4,
              "ttt_length": 3, "draft_vocab_size": 64, "checkpoint_every": 1000, "log_every": 1000}
    fields.update(train_fields)
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": target, "train": fields,
                            "capture": {"heartbeat_interval_s": 0.5}})
    layout = RunLayout.for_run(cfg, "r1")
    info = write_synthetic_hidden_states(layout.hidden_states_dir, target, samples=samples)
    return cfg, layout, info


def _quiet(_msg: str) -> None:
    pass


@pytest.mark.slow
def test_loss_falls_and_acc0_climbs_well_above_chance(tmp_path, demo_assets):
    cfg, layout, info = _setup(tmp_path, demo_assets["target_model"], samples=64, max_steps=200,
                               warmup_steps=10, checkpoint_every=100)
    result = train(cfg, layout, log=_quiet)
    assert result.completed and result.step == 200
    rows = read_metrics(Path(layout.draft_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 201))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-10:]) / 10
    acc0 = sum(r["acc_0"] for r in rows[-10:]) / 10
    acc2 = sum(r["acc_2"] for r in rows[-10:]) / 10
    assert last < 0.2 * first, (first, last)
    assert acc0 > 0.8 and acc0 > 10 * info["chance"], acc0
    assert acc2 > 0.5, acc2                              # the chained TTT steps learn too
    assert rows[-1]["accept_length"] > 2.5               # of at most 1 + ttt_length = 4
    # heartbeat, curves and checkpoints the pipeline relies on
    hb = json.loads(Path(layout.train_heartbeat_file).read_text())
    assert hb["state"] == "complete" and hb["unit"] == "steps" and hb["done"] == 200 and hb["total"] == 200
    png = Path(layout.draft_dir) / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert latest_checkpoint(Path(layout.draft_dir) / "checkpoints").name == "step_00000200"


@pytest.mark.slow
def test_resume_matches_an_uninterrupted_run(tmp_path, demo_assets):
    target = demo_assets["target_model"]
    k = 5                 # 10 micro-batches: mid-epoch (12 per epoch), so the data position matters
    common = dict(max_steps=2 * k, grad_accum=2, batch_size=4, warmup_steps=3, checkpoint_every=4)
    cfg_a, layout_a, _ = _setup(tmp_path / "a", target, **common)
    train(cfg_a, layout_a, log=_quiet)
    cfg_b, layout_b, _ = _setup(tmp_path / "b", target, **common)
    first = train(cfg_b, layout_b, stop_after_step=k, log=_quiet)
    assert first.step == k and not first.completed
    ck = load_checkpoint(latest_checkpoint(Path(layout_b.draft_dir) / "checkpoints"))
    assert ck.step == k and ck.optimizer_state["state"], "optimizer state must be in the checkpoint"
    torch.manual_seed(12345)                      # disturb the RNG: resume must restore it
    logs: list[str] = []
    second = train(cfg_b, layout_b, log=logs.append)
    assert second.completed and second.step == 2 * k
    assert any(f"resuming from" in m and f"at step {k}" for m in logs)
    a = read_metrics(Path(layout_a.draft_dir) / "metrics.jsonl")
    b = read_metrics(Path(layout_b.draft_dir) / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 2 * k + 1))   # no step logged twice
    for ra, rb in zip(a, b):
        for key in ("loss", "acc_0", "acc_2", "lr", "tokens", "epoch"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-7), (ra["step"], key, ra[key], rb[key])
    wa = load_checkpoint(latest_checkpoint(Path(layout_a.draft_dir) / "checkpoints")).model_state
    wb = load_checkpoint(latest_checkpoint(Path(layout_b.draft_dir) / "checkpoints")).model_state
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # trains several short runs
def test_trainer_takes_specforges_schedule_betas_and_objective_from_the_config(tmp_path, demo_assets):
    """No warmup_steps: warm-up is int(0.015 x max_steps) (here 3); AdamW gets the config's betas; the
    loss normalisation and mask alignment settings reach the loss (the first step's loss changes)."""
    target = demo_assets["target_model"]
    cfg, layout, _ = _setup(tmp_path / "a", target, max_steps=200, warmup_steps=None, lr=1e-4)
    assert cfg.train.warmup == 3
    train(cfg, layout, stop_after_step=4, log=_quiet)
    rows = read_metrics(Path(layout.draft_dir) / "metrics.jsonl")
    assert [r["lr"] for r in rows[:3]] == pytest.approx([1e-4 / 3, 2e-4 / 3, 1e-4])
    ck = load_checkpoint(latest_checkpoint(Path(layout.draft_dir) / "checkpoints"))
    assert [tuple(g["betas"]) for g in ck.optimizer_state["param_groups"]] == [(0.9, 0.999)]
    assert ck.state["warmup_steps"] == 3
    first = {}
    for name, extra in (("specforge", {}), ("loss_positions", {"loss_normalization": "loss_positions"}),
                        ("predicted_token", {"loss_mask_alignment": "predicted_token"})):
        c, lay, _ = _setup(tmp_path / name, target, max_steps=1, **extra)
        train(c, lay, log=_quiet)
        first[name] = read_metrics(Path(lay.draft_dir) / "metrics.jsonl")[0]
    # same data and seed: only the objective differs. Loss over all B x T positions is the smaller one.
    assert first["loss_positions"]["loss"] > first["specforge"]["loss"] * 1.05
    assert first["predicted_token"]["loss"] != pytest.approx(first["specforge"]["loss"], rel=1e-3)


# What SGLang's LlamaForCausalLMEagle3 holds (python/sglang/srt/models/llama_eagle3.py): its
# load_weights maps q/k/v -> qkv_proj and gate/up -> gate_up_proj, prefixes "model." when the name
# is not a top-level parameter, turns d2t into hot token ids and skips t2d. Any other name is dropped.
SGLANG_PARAMS = {
    "model.embed_tokens.weight", "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight", "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight", "model.midlayer.post_attention_layernorm.weight",
    "model.norm.weight", "lm_head.weight",
}
SGLANG_STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                  (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def _sglang_param_for(name: str) -> str | None:
    """Where SGLang's loader puts a checkpoint name (None: consumed as a map or dropped)."""
    if "d2t" in name or "t2d" in name:
        return "<map>"
    for param, shard in SGLANG_STACKED:
        if shard in name:
            name = name.replace(shard, param)
            break
    for cand in (name, f"model.{name}"):
        if cand in SGLANG_PARAMS:
            return cand
    return None


def _expected_shapes(h: int, inter: int, heads: int, kv: int, hd: int, vd: int, v: int) -> dict[str, tuple]:
    return {
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h), "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h), "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter), "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (v,),
    }


def test_expected_shapes_match_sglang_note_at_llama3_8b_dims():
    # the shared note's table for a Llama-3.1-8B draft, as a check on the formula the export test uses
    s = _expected_shapes(4096, 14336, 32, 8, 128, 32000, 128256)
    assert s["midlayer.self_attn.q_proj.weight"] == (4096, 8192)
    assert s["midlayer.self_attn.k_proj.weight"] == (1024, 8192)
    assert s["fc.weight"] == (4096, 12288) and s["t2d"] == (128256,)


def test_export_round_trip_names_shapes_and_logits(tmp_path, demo_assets):
    from safetensors import safe_open
    target = demo_assets["target_model"]
    cfg, layout, _ = _setup(tmp_path, target, max_steps=5)
    train(cfg, layout, log=_quiet)
    from eagleflow.cli import main
    rc = main(["export", "--config", _write_cfg(tmp_path, cfg), "--run-id", "r1"])
    assert rc == 0
    out = Path(layout.draft_dir) / "export"
    conf = json.loads((out / "config.json").read_text())
    tconf = json.loads((Path(target) / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["num_hidden_layers"] == 1 and conf["tie_word_embeddings"] is False
    assert conf["vocab_size"] == tconf["vocab_size"] and conf["draft_vocab_size"] == 64
    assert conf["max_position_embeddings"] == tconf["max_position_embeddings"]
    assert conf["rope_parameters"] == tconf["rope_parameters"]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_LAYERS
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert names == set(SGLANG_WEIGHT_NAMES)
    assert shapes == _expected_shapes(tconf["hidden_size"], tconf["intermediate_size"],
                                      tconf["num_attention_heads"], tconf["num_key_value_heads"],
                                      tconf["head_dim"], 64, tconf["vocab_size"])
    dropped = [n for n in names if _sglang_param_for(n) is None]
    assert not dropped, f"SGLang would silently drop {dropped}"
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    hot = d2t + torch.arange(64)                         # what SGLang computes as hot token ids
    assert torch.equal(t2d.nonzero().flatten(), hot)
    vocab = DraftVocab.load(Path(layout.draft_dir) / "vocab.safetensors")
    assert torch.equal(hot, vocab.draft_ids)

    # the reloaded export computes what the trained checkpoint computes
    reloaded = load_exported(out, target).eval()
    from eagleflow.train.loss import load_target_head_and_embedding
    from eagleflow.train.model import DraftConfig
    head, embed = load_target_head_and_embedding(target)
    trained = build_draft(DraftConfig.from_target(target, 64), vocab, head, embed, seed=99)
    ck = load_checkpoint(latest_checkpoint(Path(layout.draft_dir) / "checkpoints"))
    trained.load_state_dict(ck.model_state, strict=False)
    trained.eval()
    ref = scan_samples(layout.hidden_states_dir, log=_quiet)[0]
    t = read_sample_keys(ref, ("input_ids", "aux_hidden_states"))
    ids, aux = t["input_ids"][None, 1:], t["aux_hidden_states"][None, :-1].float()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.first_step_logits(ids, aux), trained.first_step_logits(ids, aux))


def _write_cfg(tmp_path: Path, cfg) -> str:
    p = tmp_path / "run-config.json"
    p.write_text(json.dumps(cfg.model_dump(mode="json")))
    return str(p)


def test_manifest_mismatch_raises_naming_the_file_or_is_skipped(tmp_path, demo_assets):
    _, layout, _ = _setup(tmp_path, demo_assets["target_model"], samples=6)
    victim = Path(layout.hidden_states_dir) / "shard_00001" / "00000003.safetensors"
    with open(victim, "ab") as f:
        f.write(b"junk")
    with pytest.raises(BadSampleError, match="00000003.safetensors: size"):
        scan_samples(layout.hidden_states_dir, log=_quiet)
    notes: list[str] = []
    refs = scan_samples(layout.hidden_states_dir, on_bad="skip", log=notes.append)
    assert sorted(r.index for r in refs) == [0, 1, 2, 4, 5]
    assert any("00000003.safetensors" in n for n in notes)
    # same size, different bytes: only the sha256 check sees it
    other = Path(layout.hidden_states_dir) / "shard_00000" / "00000002.safetensors"
    data = bytearray(other.read_bytes())
    data[-1] ^= 0xFF
    other.write_bytes(bytes(data))
    assert 2 in {r.index for r in scan_samples(layout.hidden_states_dir, on_bad="skip", log=_quiet)}
    with pytest.raises(BadSampleError, match="00000002.safetensors: sha256"):
        scan_samples(layout.hidden_states_dir, on_bad="raise", verify_sha256=True, log=_quiet)


def test_partial_manifest_line_is_ignored_and_missing_dir_is_explained(tmp_path, demo_assets):
    _, layout, _ = _setup(tmp_path, demo_assets["target_model"], samples=4)
    with open(Path(layout.hidden_states_dir) / "shard_00000" / "manifest.jsonl", "a") as f:
        f.write('{"id": "synthetic:99", "index": 99, "fi')
    assert [r.index for r in scan_samples(layout.hidden_states_dir, log=_quiet)] == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no shard directories"):
        scan_samples(tmp_path / "nowhere", log=_quiet)


def test_batch_order_is_deterministic_bucketed_and_resumable(tmp_path, demo_assets):
    _, layout, _ = _setup(tmp_path, demo_assets["target_model"], samples=40)
    refs = scan_samples(layout.hidden_states_dir, log=_quiet)
    b0 = epoch_batches(refs, 4, seed=3, epoch=0)
    assert b0 == epoch_batches(refs, 4, seed=3, epoch=0)
    assert b0 != epoch_batches(refs, 4, seed=3, epoch=1)
    assert sorted(i for b in b0 for i in b) == list(range(40))
    # bucketing: within a batch lengths are close (sorted groups), so padding is small
    pad = sum(max(refs[i].tokens for i in b) * len(b) - sum(refs[i].tokens for i in b) for b in b0)
    assert pad < 0.1 * sum(r.tokens for r in refs)
    full = HiddenStateLoader(refs, batch_size=4, seed=3)
    seq = [full.next_batch() for _ in range(14)]        # crosses an epoch boundary (10 batches/epoch)
    full.close()
    part = HiddenStateLoader(refs, batch_size=4, seed=3)
    [part.next_batch() for _ in range(7)]
    pos = DataPosition(**part.position.to_json())
    part.close()
    resumed = HiddenStateLoader(refs, batch_size=4, seed=3, position=pos)
    for want in seq[7:]:
        got = resumed.next_batch()
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.aux_hidden_states, want.aux_hidden_states)
    resumed.close()
    # two processes split each global batch pair between them
    r0 = HiddenStateLoader(refs, batch_size=4, seed=3, rank=0, world_size=2, prefetch=False)
    r1 = HiddenStateLoader(refs, batch_size=4, seed=3, rank=1, world_size=2, prefetch=False)
    plan = epoch_batches(refs, 4, seed=3, epoch=0, world_size=2)
    assert r0.next_batch().input_ids.shape[0] == len(plan[0]) and r1.next_batch().input_ids.shape[0] == len(plan[1])
    assert r0.position == r1.position == DataPosition(0, 2)


def test_draft_vocab_is_most_frequent_loss_tokens_and_capped(tmp_path, demo_assets):
    _, layout, _ = _setup(tmp_path, demo_assets["target_model"], samples=12)
    refs = scan_samples(layout.hidden_states_dir, log=_quiet)
    counts = count_loss_tokens(refs, 512)
    masked = torch.zeros(512, dtype=torch.int64)
    for r in refs:
        t = read_sample_keys(r, ("input_ids", "loss_mask"))
        masked += torch.bincount(t["input_ids"][t["loss_mask"].bool()], minlength=512)
    assert torch.equal(counts, masked)
    vocab = build_draft_vocab(counts, 10, log=_quiet)
    top10 = set(torch.sort(-counts, stable=True).indices[:10].tolist())
    assert set(vocab.draft_ids.tolist()) == top10
    assert torch.equal(vocab.draft_ids, torch.sort(vocab.draft_ids).values)
    assert torch.equal(vocab.d2t + torch.arange(10), vocab.draft_ids)
    assert vocab.t2d.sum() == 10 and vocab.t2d[vocab.draft_ids].all()
    notes: list[str] = []
    capped = build_draft_vocab(counts, 100_000, log=notes.append)
    assert capped.size == 512 and any("exceeds the target vocabulary" in n for n in notes)


def test_target_head_reproduces_the_target_logits_from_stored_last_hidden_states(demo_assets):
    """The stored hidden_states are the target's final (post-norm) states: lm_head of them is its logits."""
    from transformers import AutoModelForCausalLM

    from eagleflow.train.loss import TargetHead, load_target_head_and_embedding
    target = demo_assets["target_model"]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    v = int(model.config.vocab_size)               # the demo tokenizer's size
    ids = torch.randint(6, v, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    head, embed = load_target_head_and_embedding(target)
    assert torch.equal(embed, model.model.embed_tokens.weight)
    draft_ids = torch.arange(6, v - 6, 3)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    restricted, top_in = TargetHead(head, draft_ids, t2d, chunk_rows=7)(out.hidden_states[-1])
    torch.testing.assert_close(restricted, out.logits[..., draft_ids].float(), rtol=1e-4, atol=1e-4)
    assert torch.equal(top_in, t2d[out.logits.argmax(-1)])


def test_fused_long_sequence_attention_equals_the_explicit_one():
    """Past EXPLICIT_ATTENTION_MAX_LEN the TTT attention runs as one SDPA call; same values and gradients."""
    from eagleflow.train.loss import TrainingTimeTest
    from eagleflow.train.model import DraftConfig, Eagle3Draft
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=50, draft_vocab_size=20)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    ids = torch.randint(0, 50, (2, 12))
    aux = torch.randn(2, 12, 96)
    probs = torch.softmax(torch.randn(2, 12, 20), -1)
    valid = torch.rand(2, 12) > 0.3
    results = []
    for limit in (10_000, 4):          # explicit, then fused (12 > 4)
        model.midlayer.self_attn.explicit_max_len = limit
        model.zero_grad()
        loss, stats = TrainingTimeTest(model, 4)(ids, aux, probs, probs.argmax(-1), valid)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}))
    (l1, s1, g1), (l2, s2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g2.keys() and "midlayer.self_attn.q_proj.weight" in g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6)


def test_llama3_rope_scaling_matches_transformers():
    """Llama-3.1 targets use llama3 rope scaling; the draft must rotate exactly as the target (and SGLang) do."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from eagleflow.train.model import DraftConfig, rope_inv_freq
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=sc,
                                                       max_position_embeddings=131072), "cpu")
    d = DraftConfig(hidden_size=4096, intermediate_size=8, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    vocab_size=10, draft_vocab_size=5, rope_theta=500000.0, rope_scaling=sc)
    torch.testing.assert_close(rope_inv_freq(d), ref.float(), rtol=1e-5, atol=1e-9)
